"""Analysis probes: gradient norms per layer, residual-stream statistics, stem scale maps."""

import keras
import numpy as np
import pytest

from keras_vitnorm import ViT
from keras_vitnorm.analysis import GradientNormRecorder
from keras_vitnorm.analysis import depth_group
from keras_vitnorm.analysis import residual_stream
from keras_vitnorm.analysis import stem_scale_map
from keras_vitnorm.backend import gradients_function
from keras_vitnorm.backend import value_and_gradients


def tiny(stem="dual_patchnorm", depth=2, **kwargs):
    keras.utils.set_random_seed(1)
    return ViT(image_size=8, patch_size=4, width=16, depth=depth, num_heads=2, mlp_dim=32,
               num_classes=3, stem=stem, **kwargs)


def data(n=8, seed=0):
    rng = np.random.default_rng(seed)
    images = rng.normal(size=(n, 8, 8, 3)).astype("float32")
    labels = np.eye(3, dtype="float32")[rng.integers(0, 3, n)]
    return images, labels


def test_recorder_matches_gradients_computed_directly_after_training():
    model = tiny()
    images, labels = data()
    model.compile(keras.optimizers.SGD(0.5),
                  keras.losses.CategoricalCrossentropy(from_logits=True))
    recorder = GradientNormRecorder(images, labels, every=2, group=depth_group)
    model.fit(images, labels, batch_size=2, epochs=1, shuffle=False, verbose=0,
              callbacks=[recorder])
    assert sorted(recorder.records) == [0, 2, 4]

    def loss_fn(logits):
        return keras.ops.mean(keras.losses.categorical_crossentropy(
            keras.ops.convert_to_tensor(labels), logits, from_logits=True))

    _, _, grads = value_and_gradients(model, images, loss_fn)
    expected = {}
    for group in ("patch_embedding", "stem", "block_0", "block_1", "final_norm", "head"):
        parts = [g.ravel() for path, g in grads.items() if depth_group(path) == group]
        expected[group] = float(np.linalg.norm(np.concatenate(parts).astype("float64")))
    assert recorder.records[4].keys() == expected.keys()
    for group, norm in expected.items():
        assert recorder.records[4][group] == pytest.approx(norm, rel=1e-4, abs=1e-9), group
    # Training moved the weights: step 0 and step 4 differ (so stale weights would fail).
    assert recorder.records[0]["head"] != pytest.approx(recorder.records[4]["head"], rel=1e-3)


def _cross_entropy(labels):
    def loss_fn(logits):
        return keras.ops.mean(keras.losses.categorical_crossentropy(
            keras.ops.convert_to_tensor(labels), logits, from_logits=True))

    return loss_fn


def test_a_gradients_function_gives_value_and_gradients_at_the_weights_of_each_call():
    model = tiny()
    images, labels = data()
    loss_fn = _cross_entropy(labels)
    gradients = gradients_function(model, loss_fn)
    for _ in range(2):
        loss, input_grad, grads = gradients(images)
        want_loss, want_input_grad, want_grads = value_and_gradients(model, images, loss_fn)
        assert loss == pytest.approx(want_loss, rel=1e-5)
        np.testing.assert_allclose(input_grad, want_input_grad, rtol=1e-4, atol=1e-7)
        assert grads.keys() == want_grads.keys()
        for path, grad in grads.items():
            np.testing.assert_allclose(grad, want_grads[path], rtol=1e-4, atol=1e-7,
                                       err_msg=path)
        head = model.get_layer("head").kernel
        head.assign(head.numpy() * 2.0 + 0.1)  # the next call sees these weights


def test_under_jax_a_gradients_function_compiles_one_program_once(caplog):
    if keras.backend.backend() != "jax":
        pytest.skip("TensorFlow and PyTorch take a gradients function's gradients eagerly")
    import jax

    model = tiny()
    images, labels = data()
    gradients = gradients_function(model, _cross_entropy(labels))
    compiled = []
    for _ in range(2):
        caplog.clear()
        with jax.log_compiles(), caplog.at_level("WARNING"):
            gradients(images)
        compiled.append(sum("Compiling" in r.getMessage() for r in caplog.records))
    # Op by op, as value_and_gradients runs, the first pass compiles each operation.
    assert compiled[0] <= 2 and compiled[1] == 0, compiled


def test_recorder_writes_csv(tmp_path):
    model = tiny(depth=1)
    images, labels = data(4)
    model.compile(keras.optimizers.SGD(0.1), keras.losses.CategoricalCrossentropy(from_logits=True))
    path = tmp_path / "grads.csv"
    model.fit(images, labels, batch_size=2, verbose=0,
              callbacks=[GradientNormRecorder(images, labels, every=1, path=str(path))])
    rows = path.read_text().strip().splitlines()
    assert rows[0] == "step,group,norm"
    steps = {int(row.split(",")[0]) for row in rows[1:]}
    assert steps == {0, 1, 2}
    assert any(",stem/projection," in row for row in rows)
    with pytest.raises(ValueError, match="every must be a positive integer"):
        GradientNormRecorder(images, labels, every=0)


def test_residual_stream_matches_numpy():
    model = tiny(depth=3)
    images, _ = data(4)
    stats = residual_stream(model, images)
    assert stats["names"] == ["stem", "block_0", "block_1", "block_2"]
    x = np.asarray(keras.ops.convert_to_numpy(model.get_layer("stem")(images)), "float64")
    assert stats["rms"][0] == pytest.approx(np.sqrt(np.mean(x**2)), rel=1e-5)
    y = np.asarray(keras.ops.convert_to_numpy(model.get_layer("block_0")(x.astype("float32"))), "float64")
    assert stats["rms"][1] == pytest.approx(np.sqrt(np.mean(y**2)), rel=1e-4)
    cosine = np.sum(x * y, -1) / (np.linalg.norm(x, axis=-1) * np.linalg.norm(y, axis=-1))
    assert stats["similarity"][0] == pytest.approx(np.mean(cosine), rel=1e-4)
    assert len(stats["similarity"]) == 3


def test_stem_scale_map_is_the_patch_norm_scale_in_pixel_order():
    model = tiny()
    gamma = model.get_layer("stem").patch_norm.gamma
    gamma.assign(np.arange(4 * 4 * 3, dtype="float32"))
    scale = stem_scale_map(model)
    assert scale.shape == (4, 4, 3)
    assert scale[1, 2, 0] == (1 * 4 + 2) * 3 + 0 and scale[3, 0, 2] == (3 * 4 + 0) * 3 + 2
    rms = tiny(stem_norm="rmsnorm")
    assert stem_scale_map(rms).shape == (4, 4, 3)
    with pytest.raises(ValueError, match="no norm before the patch embedding"):
        stem_scale_map(tiny(stem="patch"))
    with pytest.raises(ValueError, match="no learnable scale"):
        stem_scale_map(tiny(stem_norm_learnable=False))
