"""The ViT model: presets, every option, serialization, overrides, errors, training."""

import json

import keras
import numpy as np
import pytest

import keras_vitnorm
from keras_vitnorm import ViT
from keras_vitnorm.layers import BLOCK_STYLES
from keras_vitnorm.layers import NORM_TYPES
from keras_vitnorm.layers import PLACEMENTS
from keras_vitnorm.layers import STEM_TYPES

TINY = dict(image_size=16, patch_size=4, width=32, depth=2, num_heads=4, mlp_dim=64, num_classes=5)
# The standard ViT parameter counts (224x224, 1000 classes, class token).
STANDARD_COUNTS = {
    "ti16": 5_717_416,
    "s16": 22_050_664,
    "s32": 22_878_952,
    "b16": 86_567_656,
    "b32": 88_224_232,
    "l16": 304_326_632,
}


def _images(shape=(2, 16, 16, 3), seed=0):
    return np.random.default_rng(seed).uniform(size=shape).astype("float32")


def _numpy(x):
    return keras.ops.convert_to_numpy(x)


# A model's weights are its layers' build code, the same on every backend: the smallest
# preset counts under each backend, the others (seconds to minutes to allocate) under one.
@pytest.mark.parametrize("name", [name if name == "ti16" else pytest.param(name, marks=pytest.mark.one_backend)
                                  for name in sorted(STANDARD_COUNTS)])
def test_preset_parameter_counts(name):
    model = ViT.from_preset(name)
    assert model.count_params() == STANDARD_COUNTS[name]
    del model
    dpn = ViT.from_preset(f"{name}_dpn")
    patch = dpn.patch_size
    # Dual PatchNorm adds two LayerNorms: over P*P*C and over the width.
    extra = 2 * patch * patch * 3 + 2 * dpn.width
    assert dpn.count_params() == STANDARD_COUNTS[name] + extra


def test_list_presets():
    presets = keras_vitnorm.list_presets()
    assert set(presets) == set(STANDARD_COUNTS) | {f"{n}_dpn" for n in STANDARD_COUNTS}
    assert "Dual PatchNorm" in presets["s16_dpn"]
    assert ViT.presets() == presets


def test_from_preset_overrides():
    model = ViT.from_preset("s16_dpn", num_classes=10, image_size=32, depth=1)
    assert model.stem == "dual_patchnorm"
    assert model.output_shape == (None, 10)
    assert model.depth == 1
    assert _numpy(model(_images((1, 32, 32, 3)))).shape == (1, 10)


@pytest.mark.parametrize("style", BLOCK_STYLES)
@pytest.mark.parametrize("attn_norm", PLACEMENTS)
@pytest.mark.parametrize("mlp_norm", PLACEMENTS)
def test_every_placement_and_block_style_runs(attn_norm, mlp_norm, style):
    config = dict(TINY, attn_norm=attn_norm, mlp_norm=mlp_norm, block_style=style)
    if style == "deepnorm" and (attn_norm, mlp_norm) != ("post", "post"):
        with pytest.raises(ValueError, match="deepnorm"):
            ViT(**config)
        return
    y = _numpy(ViT(**config)(_images()))
    assert y.shape == (2, 5) and np.isfinite(y).all()


@pytest.mark.parametrize("norm", NORM_TYPES)
@pytest.mark.parametrize("stem", STEM_TYPES)
def test_every_norm_and_stem_runs(norm, stem):
    # QK-norm is offered for the norms that normalize each head and token on its own.
    qk_norm = norm in keras_vitnorm.layers.QK_NORM_TYPES
    model = ViT(**TINY, norm=norm, norm_groups=4, stem=stem, qk_norm=qk_norm)
    y = _numpy(model(_images(), training=True))
    assert y.shape == (2, 5) and np.isfinite(y).all()


@pytest.mark.parametrize("norm", NORM_TYPES)
@pytest.mark.parametrize("style", ["normformer", "sub_ln", "deepnorm"])
def test_every_norm_with_every_block_style_runs(norm, style):
    model = ViT(**TINY, norm=norm, norm_groups=4, block_style=style)
    y = _numpy(model(_images()))
    assert y.shape == (2, 5) and np.isfinite(y).all()


@pytest.mark.parametrize("stem_norm", ["layernorm", "rmsnorm", "dyt", "batchnorm", "affine"])
@pytest.mark.parametrize("learnable", [True, False])
def test_stem_norm_variants(stem_norm, learnable):
    if stem_norm == "affine" and not learnable:
        with pytest.raises(ValueError, match="identity"):
            ViT(**TINY, stem="dual_patchnorm", stem_norm=stem_norm, stem_norm_learnable=False)
        return
    model = ViT(**TINY, stem="dual_patchnorm", stem_norm=stem_norm, stem_norm_learnable=learnable)
    stem_weights = [w for w in model.trainable_weights if w.path.startswith("stem/") and "norm" in w.path]
    assert bool(stem_weights) == learnable
    assert np.isfinite(_numpy(model(_images()))).all()


def test_options_that_change_structure():
    gap = ViT(**TINY, pooling="gap")
    assert not any("class_token" in w.path for w in gap.weights)
    assert gap.get_layer("stem").pos_embedding.shape == (1, 16, 32)
    no_final = ViT(**TINY, final_norm=False)
    assert not any(w.path.startswith("final_norm") for w in no_final.weights)
    features = ViT(**dict(TINY, num_classes=0))
    assert features.output_shape == (None, 32)
    rect = ViT(**dict(TINY, image_size=[16, 24]))
    assert _numpy(rect(_images((1, 16, 24, 3)))).shape == (1, 5)


def test_norm_ablation_is_a_one_line_config_change():
    model = ViT(**TINY)
    config = model.get_config()
    json.dumps(config)  # JSON-safe
    config["norm"] = "rmsnorm"
    ablated = ViT.from_config(config)
    assert ablated.norm == "rmsnorm"
    assert any(w.path == "block_0/attn_norm/scale" for w in ablated.weights)
    assert not any(w.path == "block_0/attn_norm/beta" for w in ablated.weights)


def test_get_config_from_config_round_trip():
    model = ViT(**TINY, stem="dual_patchnorm", layer_scale=0.1, drop_path_rate=0.1)
    clone = ViT.from_config(model.get_config())
    assert clone.get_config() == model.get_config()
    clone.set_weights(model.get_weights())
    np.testing.assert_allclose(_numpy(clone(_images())), _numpy(model(_images())), atol=1e-6)


def test_keras_file_round_trip(tmp_path):
    model = ViT(**TINY, stem="conv", norm="rmsnorm", block_style="normformer")
    model.get_layer("head").kernel.assign(np.ones((32, 5), "float32"))
    path = str(tmp_path / "model.keras")
    model.save(path)
    loaded = keras.saving.load_model(path)
    assert isinstance(loaded, ViT)
    assert loaded.get_config() == model.get_config()
    np.testing.assert_allclose(_numpy(loaded(_images())), _numpy(model(_images())), atol=1e-6)


def test_save_to_preset_and_reload(tmp_path):
    model = ViT(**TINY, stem="dual_patchnorm")
    model.get_layer("head").kernel.assign(np.ones((32, 5), "float32"))
    directory = tmp_path / "preset"
    model.save_to_preset(directory)
    metadata = json.loads((directory / "metadata.json").read_text())
    assert metadata["parameter_count"] == model.count_params()
    assert metadata["backend"] == keras.backend.backend()
    loaded = ViT.from_preset(str(directory))
    np.testing.assert_allclose(_numpy(loaded(_images())), _numpy(model(_images())), atol=1e-6)


def test_save_to_preset_refuses_to_overwrite(tmp_path):
    model = ViT(**TINY)
    model.save_to_preset(tmp_path)
    before = (tmp_path / "model.weights.npz").read_bytes()
    with pytest.raises(FileExistsError, match="overwrite=True"):
        ViT(**TINY).save_to_preset(tmp_path)
    assert (tmp_path / "model.weights.npz").read_bytes() == before
    ViT(**TINY).save_to_preset(tmp_path, overwrite=True)
    assert (tmp_path / "model.weights.npz").read_bytes() != before


def big_vision_resample(grid, new_h, new_w):
    """big_vision's `resample_posemb` on an `(h, w, d)` grid: `scipy.ndimage.zoom`, order 1."""
    import scipy.ndimage

    h, w, _ = grid.shape
    return scipy.ndimage.zoom(grid, (new_h / h, new_w / w, 1), order=1)


@pytest.mark.parametrize("source, target", [
    ((14, 14), (24, 24)), ((24, 24), (14, 14)), ((7, 7), (5, 5)), ((3, 5), (6, 2)), ((4, 4), (1, 1)),
])
def test_bilinear_resampling_is_big_vision_zoom(source, target):
    """The NumPy form of `resample_position_embedding` gives scipy's zoom on every grid,
    up and down, square or not."""
    from keras_vitnorm.models.weights import resample_position_embedding

    rng = np.random.default_rng(0)
    embedding = rng.normal(size=(1, 1 + source[0] * source[1], 8)).astype("float32")
    resampled = resample_position_embedding(embedding, source, target, num_prefix_tokens=1)
    expected = big_vision_resample(embedding[0, 1:].reshape(*source, 8), *target)
    np.testing.assert_allclose(resampled[0, 1:].reshape(*target, 8), expected, atol=1e-6)
    np.testing.assert_array_equal(resampled[:, 0], embedding[:, 0])


def test_new_image_size_resamples_position_embedding(tmp_path):
    model = ViT(**TINY)
    model.save_to_preset(tmp_path)
    bigger = ViT.from_preset(str(tmp_path), image_size=28)  # 4x4 grid -> 7x7
    old = _numpy(model.get_layer("stem").pos_embedding)
    new = _numpy(bigger.get_layer("stem").pos_embedding)
    assert new.shape == (1, 1 + 49, 32)
    np.testing.assert_allclose(new[:, 0], old[:, 0])  # class token position kept
    expected = big_vision_resample(old[0, 1:].reshape(4, 4, 32), 7, 7).reshape(49, 32)
    np.testing.assert_allclose(new[0, 1:], expected, atol=1e-6)
    # big_vision's zoom aligns the corners: the four corner patches keep their embedding.
    old_grid, new_grid = old[0, 1:].reshape(4, 4, 32), new[0, 1:].reshape(7, 7, 32)
    for (i, j), (k, m) in (((0, 0), (0, 0)), ((0, 3), (0, 6)), ((3, 0), (6, 0)), ((3, 3), (6, 6))):
        np.testing.assert_allclose(new_grid[k, m], old_grid[i, j], atol=1e-6)
    old_other = {w.path: _numpy(w) for w in model.weights if "position" not in w.path}
    for w in bigger.weights:
        if "position" not in w.path:
            np.testing.assert_array_equal(_numpy(w), old_other[w.path])
    assert np.isfinite(_numpy(bigger(_images((1, 28, 28, 3))))).all()


def test_load_weights_by_path_needs_every_weight_and_only_fitting_ones():
    source = ViT(**TINY)
    arrays = {path: _numpy(v) for path, v in source.weights_by_path().items()}
    model = ViT(**TINY)
    model.load_weights_by_path(arrays)
    np.testing.assert_array_equal(_numpy(model(_images())), _numpy(source(_images())))

    missing = dict(arrays)
    missing.pop("head/kernel")
    with pytest.raises(ValueError, match="missing from the weights: 'head/kernel"):
        ViT(**TINY).load_weights_by_path(missing)
    with pytest.raises(ValueError, match="in the weights but not in the model: 'block_9/extra'"):
        ViT(**TINY).load_weights_by_path({**arrays, "block_9/extra": np.zeros(3)})
    wrong = {**arrays, "head/bias": np.zeros(7)}
    expected = r"key 'head/bias' of the given arrays has shape \(7,\); the model expects \(5,\)"
    with pytest.raises(ValueError, match=expected):
        ViT(**TINY).load_weights_by_path(wrong)

    bigger = ViT(**{**TINY, "image_size": 24})
    with pytest.raises(ValueError, match="resample_position_embedding=False"):
        bigger.load_weights_by_path(arrays, resample_position_embedding=False)
    bigger.load_weights_by_path(arrays)
    embedding = _numpy(bigger.get_layer("stem").pos_embedding)
    np.testing.assert_array_equal(embedding[:, 0], arrays["stem/position_embedding"][:, 0])  # class token kept
    np.testing.assert_allclose(embedding[:, 1:].mean(), arrays["stem/position_embedding"][:, 1:].mean(), atol=0.05)


def test_new_num_classes_keeps_body_and_makes_a_fresh_head(tmp_path, capsys):
    model = ViT(**TINY)
    model.get_layer("head").kernel.assign(np.ones((32, 5), "float32"))
    model.save_to_preset(tmp_path)
    new = ViT.from_preset(str(tmp_path), num_classes=3)
    assert "head/kernel" in capsys.readouterr().out
    assert new.get_layer("head").kernel.shape == (32, 3)
    np.testing.assert_array_equal(
        _numpy(new.get_layer("block_1").mlp.fc2.kernel), _numpy(model.get_layer("block_1").mlp.fc2.kernel)
    )


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(image_size=18), "image height 18 is not divisible by patch_size=4"),
        (dict(num_heads=5), "width=32 is not divisible by num_heads=5"),
        (dict(norm="layer_norm"), "Did you mean 'layernorm'"),
        (dict(attn_norm="sandwich"), "Unknown attn_norm='sandwich'"),
        (dict(mlp_norm="peri"), "Unknown mlp_norm='peri'"),
        (dict(stem="dual_patch_norm"), "Did you mean 'dual_patchnorm'"),
        (dict(block_style="normformers"), "Did you mean 'normformer'"),
        (dict(stem_norm="rms"), "Unknown stem_norm='rms'"),
        (dict(pooling="mean"), "Unknown pooling='mean'"),
        (dict(block_style="deepnorm", attn_norm="pre"), "needs attn_norm='post'"),
        (dict(block_style="deepnorm", mlp_norm="pre_post"), "needs attn_norm='post'"),
        (dict(drop_path=0.1), "Unknown ViT argument 'drop_path'. Did you mean 'drop_path_rate'"),
        (dict(norm_epsilon=-1), "norm_epsilon must be a finite number > 0, got -1"),
        (dict(norm_epsilon=0.0), "norm_epsilon must be a finite number > 0"),
        (dict(norm_epsilon="x"), "norm_epsilon must be a finite number > 0, got 'x'"),
        (dict(norm_epsilon=float("nan")), "norm_epsilon must be a finite number > 0"),
        (dict(layer_scale=-0.1), "layer_scale must be a finite number > 0"),
        (dict(layer_scale="1e-5"), "layer_scale must be a finite number > 0"),
        (dict(norm_groups=0), "norm_groups must be a positive integer"),
        (dict(qk_norm="yes"), "qk_norm must be True or False"),
        (dict(final_norm=1), "final_norm must be True or False"),
        (dict(qkv_bias=None), "qkv_bias must be True or False"),
        (dict(stem_norm_learnable="no"), "stem_norm_learnable must be True or False"),
        (dict(dropout=1.0), r"dropout must be a float in \[0, 1\)"),
        (dict(drop_path_rate=-0.1), r"drop_path_rate must be a float in \[0, 1\)"),
        (dict(norm="batchnorm", qk_norm=True), "qk_norm normalizes each head's query and key"),
        (dict(norm="groupnorm", norm_groups=4, qk_norm=True), "norm='groupnorm' does not"),
        (dict(norm="groupnorm", norm_groups=5), "norm_groups=5"),
        (dict(depth=0), "depth must be a positive integer"),
        (dict(image_size="big"), "image_size must be"),
    ],
)
def test_bad_config_raises_clear_error(kwargs, message):
    with pytest.raises(ValueError, match=message):
        ViT(**{**TINY, **kwargs})


@pytest.mark.parametrize("kwargs, message", [
    (dict(stem="patch", stem_norm="rmsnorm"), "stem='patch' has no normalization"),
    (dict(stem="conv", patch_size=6, image_size=24), "power of two >= 2; got patch_size=6"),
])
def test_a_config_is_refused_before_anything_is_built(kwargs, message):
    # What a run plan and a variants file check before training: the stem's rules too.
    from keras_vitnorm.models.vit_config import validate_config

    with pytest.raises(ValueError, match=message):
        validate_config({**ViT.default_config(), **TINY, **kwargs})


def test_unknown_preset_suggests_close_names():
    with pytest.raises(ValueError, match="Did you mean 's16_dpn'"):
        ViT.from_preset("s16dpn")
    with pytest.raises(ValueError, match="Unknown override 'normalization'"):
        ViT.from_preset("s16", normalization="rmsnorm")
    with pytest.raises(ValueError, match="Did you mean 'drop_path_rate'"):
        ViT.from_preset("s16", drop_path=0.1)
    with pytest.raises(ValueError, match="Unknown resample='nearest'"):
        ViT.from_preset("s16", resample="nearest")


def test_unknown_key_in_a_saved_config_is_an_error_naming_the_file(tmp_path):
    ViT(**TINY).save_to_preset(tmp_path)
    path = tmp_path / "config.json"
    saved = json.loads(path.read_text())
    saved["config"]["drop_path"] = 0.1
    path.write_text(json.dumps(saved))
    with pytest.raises(ValueError, match=r"Unknown key in .*config\.json 'drop_path'\. "
                       r"Did you mean 'drop_path_rate'"):
        ViT.from_preset(str(tmp_path))


@pytest.mark.parametrize(
    "block_style, placements, final_norm",
    [
        ("standard", ("pre", "pre"), True),
        ("normformer", ("pre", "pre"), True),
        ("sub_ln", ("pre", "pre"), True),
        ("deepnorm", ("post", "post"), False),
    ],
)
def test_placement_and_final_norm_defaults_follow_the_block_style(block_style, placements, final_norm):
    model = ViT(**TINY, block_style=block_style)
    block = model.get_layer("block_0")
    assert (block.resolved_attn_norm, block.resolved_mlp_norm) == placements
    names = {layer.name for layer in model.layers}
    assert ("final_norm" in names) == final_norm
    # The config keeps "not given", so that a block style change stays a one-line edit.
    config = model.get_config()
    assert (config["attn_norm"], config["mlp_norm"], config["final_norm"]) == (None, None, None)
    config["block_style"] = "deepnorm" if block_style != "deepnorm" else "standard"
    ViT.from_config(config)


@pytest.mark.parametrize(
    "attn_norm, mlp_norm, final_norm",
    [
        ("pre", "pre", True),
        ("post", "post", False),
        ("pre", "post", False),
        ("post", "pre", True),
        ("pre_post", "pre_post", True),
        ("none", "none", True),
    ],
)
def test_final_norm_default_follows_the_mlp_placement(attn_norm, mlp_norm, final_norm):
    model = ViT(**TINY, attn_norm=attn_norm, mlp_norm=mlp_norm)
    assert ("final_norm" in {layer.name for layer in model.layers}) == final_norm
    forced = ViT(**TINY, attn_norm=attn_norm, mlp_norm=mlp_norm, final_norm=not final_norm)
    assert ("final_norm" in {layer.name for layer in forced.layers}) == (not final_norm)


@pytest.mark.parametrize("kwargs", [dict(norm="batchnorm"), dict(stem="conv"),
                                    dict(stem="dual_patchnorm", stem_norm="batchnorm")])
def test_batchnorm_models_give_finite_logits_under_mixed_float16_in_inference(kwargs):
    """Inputs up to 1000 (unnormalized pixels): fresh moving statistics leave tokens of
    a few hundred, whose attention logits pass float16's range unless accumulated in
    float32 (NaN logits on JAX and TensorFlow before)."""
    if keras.backend.backend() == "torch" and kwargs.get("stem") == "conv":
        pytest.skip("PyTorch has no float16 convolution on CPU")
    previous = keras.config.dtype_policy()
    keras.config.set_dtype_policy("mixed_float16")
    try:
        keras.utils.set_random_seed(0)
        model = ViT(**TINY, **kwargs)
        logits = _numpy(model(_images((4, 16, 16, 3)) * 1000.0, training=False))
    finally:
        keras.config.set_dtype_policy(previous)
    assert np.isfinite(logits).all()


@pytest.mark.parametrize("shape", [(2, 16, 16, 1), (2, 32, 32, 3)])
def test_wrong_image_shape_at_call_time(shape):
    model = ViT(**TINY)
    # Keras' input check or the stem's own check, depending on what differs.
    expected = r"(expected shape=\(None, 16, 16, 3\)|Expected images of shape \(batch, 16, 16, 3\))"
    with pytest.raises(ValueError, match=expected):
        model(_images(shape))


def test_weights_that_do_not_fit_the_config(tmp_path):
    ViT(**TINY).save_to_preset(tmp_path)
    with pytest.raises(ValueError, match=r"Override width=48 does not fit the checkpoint, which has "
                       r"width=32 \(e.g. key 'stem/projection/bias' of shape \(32,\)\)"):
        ViT.from_preset(str(tmp_path), width=48)
    with pytest.raises(ValueError, match="Override depth=3 does not fit"):
        ViT.from_preset(str(tmp_path), depth=3)
    with pytest.raises(ValueError, match="not a keras_vitnorm preset directory"):
        (tmp_path / "empty").mkdir()
        ViT.from_preset(str(tmp_path / "empty"))


def test_tiny_vit_trains_with_fit_and_loss_falls():
    keras.utils.set_random_seed(0)
    rng = np.random.default_rng(0)
    labels = rng.integers(0, 4, size=256)
    images = rng.normal(0, 0.3, size=(256, 16, 16, 3)).astype("float32")
    for i, label in enumerate(labels):  # the class is the bright quadrant
        r, c = divmod(int(label), 2)
        images[i, r * 8:(r + 1) * 8, c * 8:(c + 1) * 8] += 1.0
    model = ViT(**dict(TINY, num_classes=4), stem="dual_patchnorm")
    model.compile(
        optimizer=keras.optimizers.AdamW(3e-3, weight_decay=1e-4),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
    )
    history = model.fit(images, labels, batch_size=32, epochs=10, verbose=0)
    losses = history.history["loss"]
    assert losses[-1] < 0.7 * losses[0], losses
    assert history.history["accuracy"][-1] > 0.5


@pytest.mark.parametrize("pooling", ["cls", "gap"])
def test_backbone_gives_token_and_pooled_features_of_the_same_weights(pooling):
    model = ViT(**{**TINY, "pooling": pooling})
    count = len(model.weights)
    backbone = model.backbone()
    assert len(model.weights) == count and [layer.name for layer in model.layers][-1] == "outputs"
    images = _images()
    features = backbone(images)
    tokens = keras.ops.convert_to_numpy(features["tokens"])
    pooled = keras.ops.convert_to_numpy(features["pooled"])
    assert tokens.shape == (2, 16 + (pooling == "cls"), TINY["width"])
    np.testing.assert_allclose(pooled, tokens[:, 0] if pooling == "cls" else tokens.mean(1),
                               rtol=1e-5, atol=1e-6)
    head = model.get_layer("head")
    head.kernel.assign(np.random.default_rng(1).normal(size=head.kernel.shape).astype("float32"))
    np.testing.assert_allclose(keras.ops.convert_to_numpy(model(images)),
                               pooled @ keras.ops.convert_to_numpy(head.kernel)
                               + keras.ops.convert_to_numpy(head.bias), rtol=1e-4, atol=1e-5)
    # One set of variables: a step on a head over the tokens trains the ViT's encoder.
    assert {id(v) for v in backbone.weights} <= {id(v) for v in model.weights}
    assert [v.path for v in backbone.weights] == [v.path for v in model.weights if not v.path.startswith("head")]
    segmenter_inputs = keras.Input(images.shape[1:])
    logits = keras.layers.Dense(3)(backbone(segmenter_inputs)["tokens"])
    segmenter = keras.Model(segmenter_inputs, logits)
    segmenter.compile(optimizer=keras.optimizers.SGD(0.5), loss="mse")
    before = keras.ops.convert_to_numpy(model.get_layer("block_0").weights[0]).copy()
    segmenter.fit(images, np.ones((2, tokens.shape[1], 3), "float32"), epochs=1, verbose=0)
    assert not np.allclose(keras.ops.convert_to_numpy(model.get_layer("block_0").weights[0]), before)


@pytest.mark.skipif(keras.backend.backend() == "tensorflow",
                    reason="under TensorFlow, TensorFlow is the backend and is imported anyway")
def test_building_a_preset_leaves_tensorflow_unimported_under_jax_and_torch():
    """A user's script that builds a model under JAX or PyTorch does not import TensorFlow
    (and print its start-up log lines) just because it is installed."""
    import subprocess
    import sys

    code = ("import sys, keras_vitnorm\n"
            "model = keras_vitnorm.ViT.from_preset('ti16', depth=1, num_classes=3)\n"
            "model.predict(__import__('numpy').zeros((1, 224, 224, 3)), verbose=0)\n"
            "print(sorted(m for m in sys.modules if m.split('.')[0] == 'tensorflow')[:3])\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip() == "[]", done.stdout
