"""The pixel range a model takes: stated in its config (`pixel_range`), mapped onto the
[-1, 1] its layers work in, saved with it, and a warning for images far outside it."""

import warnings

import keras
import numpy as np
import pytest

from keras_vitnorm import ViT
from keras_vitnorm.models.segmenter import Segmenter

SMALL = dict(image_size=16, patch_size=4, width=32, depth=1, num_heads=2, mlp_dim=64,
             num_classes=3, stem="dual_patchnorm")
PIXELS = np.random.default_rng(0).integers(0, 256, (6, 16, 16, 3)).astype("float32")


def trained_like(model):
    """`model` with random weights everywhere (the head too, zeros at init)."""
    rng = np.random.default_rng(1)
    model.set_weights([rng.normal(0, 0.2, np.shape(w)).astype("float32")
                       for w in model.get_weights()])
    return model


def range_warnings(call):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        call()
    return [str(w.message) for w in caught if "pixel_range" in str(w.message)]


def test_a_preset_loaded_with_the_users_range_predicts_on_0_255_images_as_on_minus_1_1(
        tmp_path):
    model = trained_like(ViT(**SMALL))
    model.save_to_preset(tmp_path / "preset")
    loaded = ViT.from_preset(str(tmp_path / "preset"), pixel_range=[0, 255])
    expected = model.predict(PIXELS / 127.5 - 1, verbose=0)
    assert np.abs(expected).max() > 0.1  # a head that tells the inputs apart
    np.testing.assert_allclose(loaded.predict(PIXELS, verbose=0), expected, atol=2e-5)
    unit = ViT.from_preset(str(tmp_path / "preset"), pixel_range=[0, 1])
    np.testing.assert_allclose(unit.predict(PIXELS / 255, verbose=0), expected, atol=2e-5)
    # The same weights: the range maps the input, and adds none.
    assert loaded.count_params() == model.count_params()


def test_the_range_is_saved_with_the_model_and_a_config_without_it_takes_minus_1_1(tmp_path):
    model = trained_like(ViT(**SMALL, pixel_range=(0, 255)))
    assert model.get_config()["pixel_range"] == [0.0, 255.0]
    model.save(tmp_path / "model.keras")
    loaded = keras.saving.load_model(tmp_path / "model.keras")
    assert loaded.get_config()["pixel_range"] == [0.0, 255.0]
    np.testing.assert_allclose(loaded.predict(PIXELS, verbose=0), model.predict(PIXELS, verbose=0),
                               atol=1e-6)
    config = ViT(**SMALL).get_config()
    del config["pixel_range"]  # a model saved before the setting existed
    assert ViT.from_config(config).get_config()["pixel_range"] == [-1.0, 1.0]


@pytest.mark.parametrize("value", [[255, 0], [0], "0-255", [0, float("nan")], [True, 2]])
def test_a_bad_pixel_range_is_refused_with_its_value(value):
    with pytest.raises(ValueError, match=r"pixel_range must be a pair \[low, high\].*got "
                       + repr(value).replace("[", r"\[").replace("]", r"\]")):
        ViT(**SMALL, pixel_range=value)


def test_0_255_images_given_to_a_minus_1_1_model_get_one_warning_naming_both_ranges():
    model = ViT(**SMALL)
    found = range_warnings(lambda: (model.predict(PIXELS, verbose=0),
                                    model.predict(PIXELS, verbose=0)))
    assert found == [
        f"ViT.predict got images with values in [{PIXELS.min():g}, {PIXELS.max():g}]; the "
        "model takes images in [-1, 1] (its pixel_range). Scale them to that range, or build "
        "the model with the range they have, e.g. pixel_range=[0, 255] (also as a from_preset "
        "override): it maps them onto the range its weights were trained on. This warning is "
        "given once per model."]
    assert range_warnings(lambda: ViT(**SMALL).predict(PIXELS / 127.5 - 1, verbose=0)) == []
    assert range_warnings(  # the range it was built for
        lambda: ViT(**SMALL, pixel_range=[0, 255]).predict(PIXELS, verbose=0)) == []


def test_a_dataset_of_0_255_images_is_read_ahead_once_and_warned_about_in_fit():
    tf = pytest.importorskip("tensorflow", reason="tf.data is TensorFlow's")
    model = ViT(**SMALL)
    model.compile(optimizer="sgd", loss="sparse_categorical_crossentropy")
    dataset = tf.data.Dataset.from_tensor_slices((PIXELS, np.zeros(6, "int32"))).batch(3)
    found = range_warnings(lambda: model.fit(dataset, verbose=0))
    assert len(found) == 1 and found[0].startswith("ViT.fit got images with values in [")
    quiet = ViT(**SMALL)
    quiet.peek_datasets = False  # what the trainer sets: its pipelines produce the range
    quiet.compile(optimizer="sgd", loss="sparse_categorical_crossentropy")
    assert range_warnings(lambda: quiet.fit(dataset, verbose=0)) == []


def test_a_segmenter_takes_its_vits_range():
    vit = ViT(**{**SMALL, "num_classes": 0}, pixel_range=[0, 255])
    segmenter = Segmenter(vit, num_classes=2)
    assert range_warnings(lambda: segmenter.predict(PIXELS, verbose=0)) == []
    assert len(range_warnings(
        lambda: Segmenter(ViT(**{**SMALL, "num_classes": 0}), num_classes=2).predict(
            PIXELS, verbose=0))) == 1


@pytest.mark.one_backend
def test_the_trainer_refuses_another_range_and_trains_a_saved_model_of_one_in_minus_1_1(
        tmp_path):
    from keras_vitnorm.training import TrainConfig
    from keras_vitnorm.training import train

    model = ViT(**{**SMALL, "num_classes": 10}, pixel_range=[0, 255])  # the digits' 10
    model.save_to_preset(tmp_path / "preset")
    body = {key: value for key, value in SMALL.items() if key != "num_classes"}
    settings = dict(steps=2, batch_size=32, warmup_steps=1, tensorboard=False)
    with pytest.raises(ValueError, match=r"pixel_range=\[0, 255\]: the trainer's input "
                       r"pipelines feed images in \[-1, 1\]"):
        train(TrainConfig.from_recipe("small", model=dict(body, pixel_range=[0, 255]),
                                      output_dir=str(tmp_path / "refused"), **settings),
              verbose=0)
    assert not (tmp_path / "refused").exists()
    train(TrainConfig.from_recipe("small", preset=str(tmp_path / "preset"),
                                  model=dict(image_size=16),
                                  output_dir=str(tmp_path / "run"), **settings), verbose=0)
    assert ViT.from_preset(str(tmp_path / "run" / "preset")).get_config()["pixel_range"] == [
        -1.0, 1.0]
