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


def test_a_dataset_of_0_255_images_is_warned_about_as_fit_reads_it_and_not_read_ahead():
    """A `tf.data` dataset is checked as `fit` reads it (a map over its batches), not read
    ahead: the generator behind one gives what it gives to Keras alone; a dataset in
    range, or one the trainer feeds (`check_datasets` off), gets no warning."""
    tf = pytest.importorskip("tensorflow", reason="tf.data is TensorFlow's")
    read = []

    def counted():  # the batches the dataset gives, counted as they are read
        for start in (0, 3):
            read.append(start)
            yield PIXELS[start:start + 3], np.zeros(3, "int32")

    generated = tf.data.Dataset.from_generator(
        counted, output_signature=(tf.TensorSpec((None, 16, 16, 3), "float32"),
                                   tf.TensorSpec((None,), "int32")))
    plain = ViT(**SMALL)
    plain.check_datasets = False
    plain.compile(optimizer="sgd", loss="sparse_categorical_crossentropy")
    plain.fit(generated, verbose=0)
    plain_reads, read[:] = list(read), []
    model = ViT(**SMALL)
    model.compile(optimizer="sgd", loss="sparse_categorical_crossentropy")
    found = range_warnings(lambda: model.fit(generated, verbose=0))
    assert len(found) == 1 and found[0].startswith("ViT.fit got images with values in [")
    assert read == plain_reads  # no batch read for the check beyond what fit reads
    dataset = tf.data.Dataset.from_tensor_slices((PIXELS, np.zeros(6, "int32"))).batch(3)
    scaled = dataset.map(lambda x, y: (x / 127.5 - 1, y))
    fresh = ViT(**SMALL)
    fresh.compile(optimizer="sgd", loss="sparse_categorical_crossentropy")
    assert range_warnings(lambda: fresh.fit(scaled, verbose=0)) == []
    quiet = ViT(**SMALL)
    quiet.check_datasets = False  # what the trainer sets: its pipelines give the range
    quiet.compile(optimizer="sgd", loss="sparse_categorical_crossentropy")
    assert range_warnings(lambda: quiet.fit(dataset, verbose=0)) == []


def test_arrays_are_checked_once_per_model_and_non_finite_values_are_left_out():
    model = ViT(**SMALL)
    with_nan = (PIXELS / 127.5 - 1).copy()
    with_nan[0, 0, 0, 0] = np.nan
    assert range_warnings(lambda: model.predict(with_nan, verbose=0)) == []
    # checked once: a later call is not read again (no copy of its images per call)
    assert range_warnings(lambda: model.predict(PIXELS, verbose=0)) == []


def test_a_segmenter_takes_its_vits_range():
    vit = ViT(**{**SMALL, "num_classes": 0}, pixel_range=[0, 255])
    segmenter = Segmenter(vit, num_classes=2)
    assert range_warnings(lambda: segmenter.predict(PIXELS, verbose=0)) == []
    [warning] = range_warnings(
        lambda: Segmenter(ViT(**{**SMALL, "num_classes": 0}), num_classes=2).predict(
            PIXELS, verbose=0))
    assert "build it on a ViT of the range they have, e.g. ViT.from_preset(..., " \
        "pixel_range=[0, 255])" in warning


@pytest.mark.one_backend
def test_the_trainer_refuses_another_range_and_trains_a_saved_model_of_one_in_minus_1_1(
        tmp_path):
    from keras_vitnorm.training import TrainConfig
    from keras_vitnorm.training import train

    model = ViT(**{**SMALL, "num_classes": 10}, pixel_range=[0, 255])  # the digits' 10
    model.save_to_preset(tmp_path / "preset")
    body = {key: value for key, value in SMALL.items() if key != "num_classes"}
    settings = dict(steps=2, batch_size=32, warmup_steps=1, tensorboard=False)
    with pytest.raises(ValueError, match=r"pixel_range=\[0, 255\]: the library's input "
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


def test_the_segmenter_and_lit_builders_and_evaluate_take_minus_1_1_whatever_the_preset(
        tmp_path, monkeypatch):
    """Their pipelines feed [-1, 1] too: a preset saved with [0, 255] loads in [-1, 1] (the
    same weights), and another range asked for is refused."""
    from keras_vitnorm.training import evaluation
    from keras_vitnorm.training.contrastive import LiTConfig
    from keras_vitnorm.training.contrastive import build_lit
    from keras_vitnorm.training.segmentation import SegmentationConfig
    from keras_vitnorm.training.segmentation import build_segmenter

    ViT(**{**SMALL, "num_classes": 0}, pixel_range=[0, 255]).save_to_preset(tmp_path / "p")
    preset = str(tmp_path / "p")
    segmenter = build_segmenter(SegmentationConfig(preset=preset, image_size=16), 2)
    assert segmenter.pixel_ranges() == {"images": (-1.0, 1.0)}
    lit = build_lit(LiTConfig(preset=preset, image_size=16), ["", "[UNK]", "a", "b"])
    assert lit.pixel_ranges() == {"images": (-1.0, 1.0)}
    with pytest.raises(ValueError, match="the library's input pipelines feed images in"):
        build_segmenter(SegmentationConfig(preset=preset, image_size=16,
                                           model={"pixel_range": [0, 1]}), 2)
    loaded = []

    class Spy:
        @staticmethod
        def from_preset(path, **overrides):
            loaded.append(overrides)
            raise ValueError("stop here")

    monkeypatch.setattr(evaluation, "ViT", Spy)
    with pytest.raises(ValueError, match="stop here"):
        evaluation._score(preset, None, "test", 8, 0.0, 0)
    assert loaded == [{"pixel_range": (-1.0, 1.0)}]


def test_a_dataset_of_another_structure_trains_unchecked():
    """Elements whose first part is not one tensor of images (a nested tuple here) pass
    through the check's map as they are."""
    tf = pytest.importorskip("tensorflow", reason="tf.data is TensorFlow's")
    model = ViT(**SMALL)
    nested = tf.data.Dataset.from_tensor_slices(((PIXELS, PIXELS), np.zeros(6, "int32"))).batch(3)
    checked = model.check_pixel_range(nested, "fit")
    assert checked.element_spec == nested.element_spec
    assert [tuple(x[0].shape) for x, _ in checked] == [(3, 16, 16, 3), (3, 16, 16, 3)]
