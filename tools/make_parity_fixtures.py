"""Generates the cross-backend parity fixtures in tests/fixtures/parity/.

Each fixture is a tiny ViT config with randomized weights (every variable, norm
gains and BatchNorm statistics included), a batch of images, the logits and the
gradient of `sum(logits * cotangent)` with respect to the images, computed once
under the backend this script runs on. Every backend's test run must reproduce
them (tests/test_parity.py). `base.weights.h5` is the `base` model saved with
Keras' own `save_weights`, to check that a Keras weights file written under one
backend loads under the others.

Run (the committed fixtures were made with the JAX backend):

    KERAS_BACKEND=jax python tools/make_parity_fixtures.py

Report this backend's error against the committed fixtures without writing:

    KERAS_BACKEND=torch python tools/make_parity_fixtures.py --check

Regenerate only when a config is added or the model's computation changes on
purpose; the fixtures are the contract that all backends compute the same thing.
"""

import json
import math
import os
import sys

import keras
import numpy as np

import keras_vitnorm
from keras_vitnorm.backend import value_and_gradients

OUTPUT_DIR = os.path.join(os.path.dirname(__file__), "..", "tests", "fixtures", "parity")
TINY = {
    "image_size": 16,
    "patch_size": 4,
    "num_channels": 3,
    "width": 32,
    "depth": 2,
    "num_heads": 4,
    "mlp_dim": 64,
    "num_classes": 5,
}
#: name -> overrides of TINY. Together they use every option of the vocabulary.
CONFIGS = {
    "base": {},
    "dpn_rmsnorm": {"stem": "dual_patchnorm", "norm": "rmsnorm"},
    "deepnorm_post": {"block_style": "deepnorm", "attn_norm": "post", "mlp_norm": "post",
                      "final_norm": False},
    "normformer": {"block_style": "normformer", "attn_norm": "pre_post", "mlp_norm": "none"},
    "sub_ln_groupnorm_gap": {"block_style": "sub_ln", "norm": "groupnorm", "norm_groups": 4,
                             "pooling": "gap"},
    "dyt_post_posemb": {"norm": "dyt", "stem": "post_posemb", "layer_scale": 0.1,
                        "qk_norm": True},
    "conv_batchnorm": {"stem": "conv", "norm": "batchnorm", "attn_norm": "post",
                       "mlp_norm": "pre_post"},
    "post_patchnorm_identity": {"stem": "post_patchnorm", "stem_norm": "rmsnorm",
                                "stem_norm_learnable": False, "norm": "identity",
                                "attn_norm": "none", "mlp_norm": "pre"},
    "pre_patchnorm_affine": {"stem": "pre_patchnorm", "stem_norm": "affine", "qkv_bias": False,
                             "attn_norm": "pre_post", "mlp_norm": "post", "final_norm": True,
                             "image_size": [16, 24],
                             "drop_path_rate": 0.1, "dropout": 0.1},
}
_GAIN_NAMES = ("gamma", "scale", "head_scale", "moving_variance")


def random_weights(model, rng):
    """Returns `{path: array}`: every weight randomized around a sensible scale."""
    arrays = {}
    for variable in model.weights:
        shape = tuple(variable.shape)
        name = variable.path.rsplit("/", 1)[-1]
        noise = rng.standard_normal(shape)
        if name in _GAIN_NAMES:
            value = 1.0 + 0.3 * np.abs(noise) if name == "moving_variance" else 1.0 + 0.2 * noise
        elif name == "alpha":
            value = 0.5 + 0.1 * noise
        elif name == "kernel":
            value = noise / math.sqrt(math.prod(shape[:-1]))
        else:
            value = 0.2 * noise
        arrays[variable.path] = value.astype("float32")
    return arrays


def make_fixture(name, overrides, rng):
    config = {**TINY, **overrides}
    model = keras_vitnorm.ViT(**config)
    weights = random_weights(model, rng)
    model.load_weights_by_path(weights)
    height, width = (config["image_size"],) * 2 if isinstance(config["image_size"], int) else config["image_size"]
    images = rng.uniform(size=(2, height, width, config["num_channels"])).astype("float32")
    cotangent = rng.standard_normal((2, config["num_classes"])).astype("float32")
    logits = keras.ops.convert_to_numpy(model(images, training=False))
    _, input_gradient, _ = value_and_gradients(
        model, images, lambda y: keras.ops.sum(keras.ops.multiply(y, cotangent))
    )
    arrays = {f"weight:{path}": value for path, value in weights.items()}
    np.savez_compressed(
        os.path.join(OUTPUT_DIR, f"{name}.npz"),
        config=np.array(json.dumps(config)),
        images=images,
        cotangent=cotangent,
        logits=logits,
        input_gradient=input_gradient,
        backend=np.array(keras.backend.backend()),
        **arrays,
    )
    return model, logits


def check():
    """Prints the max absolute logit and input-gradient error of each fixture."""
    worst = 0.0
    for name in CONFIGS:
        with np.load(os.path.join(OUTPUT_DIR, f"{name}.npz")) as data:
            data = {key: data[key] for key in data.files}
        config = json.loads(str(data["config"]))
        model = keras_vitnorm.ViT(**config)
        model.load_weights_by_path(
            {k[len("weight:"):]: v for k, v in data.items() if k.startswith("weight:")}
        )
        logits = keras.ops.convert_to_numpy(model(data["images"], training=False))
        cotangent = data["cotangent"]
        _, input_gradient, _ = value_and_gradients(
            model, data["images"], lambda y: keras.ops.sum(keras.ops.multiply(y, cotangent))
        )
        logit_error = float(np.abs(logits - data["logits"]).max())
        gradient_error = float(np.abs(input_gradient - data["input_gradient"]).max())
        worst = max(worst, logit_error)
        print(f"{name:26s} logits {logit_error:.2e}  input gradient {gradient_error:.2e}")
    print(f"{keras.backend.backend()}: worst logit error {worst:.2e}")
    return 0


def main():
    if "--check" in sys.argv[1:]:
        return check()
    os.makedirs(OUTPUT_DIR, exist_ok=True)
    rng = np.random.default_rng(20261122)
    for name, overrides in CONFIGS.items():
        model, logits = make_fixture(name, overrides, rng)
        if name == "base":
            model.save_weights(os.path.join(OUTPUT_DIR, "base.weights.h5"), overwrite=True)
        print(f"{name}: logits max |x| = {np.abs(logits).max():.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
