"""A training step is traced (compiled) once and never again after warm-up.

The stem's Python `call` runs only while JAX or TensorFlow traces the train step, so
counting its calls counts traces. PyTorch runs eagerly: there the call runs every
step and nothing is compiled, which the test checks too.
"""

import functools

import keras
import numpy as np
import pytest

from keras_vitnorm import ViT
from keras_vitnorm.layers.patch_stem import PatchStem

TINY = {"image_size": 16, "patch_size": 4, "width": 32, "depth": 2, "num_heads": 2,
        "mlp_dim": 64, "num_classes": 5}


@pytest.mark.parametrize("stem, precision", [("dual_patchnorm", "float32"), ("patch", "mixed_bfloat16")])
def test_train_and_predict_steps_do_not_retrace(monkeypatch, stem, precision):
    calls = []
    original = PatchStem.call

    @functools.wraps(original)  # Keras reads the call signature
    def counting(self, *args, **kwargs):
        calls.append(1)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(PatchStem, "call", counting)
    keras.config.set_dtype_policy(precision)
    try:
        model = ViT(**TINY, stem=stem)
        model.compile(optimizer=keras.optimizers.AdamW(1e-3),
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        rng = np.random.default_rng(0)
        batches = [(rng.normal(size=(8, 16, 16, 3)).astype("float32"), rng.integers(0, 5, 8))
                   for _ in range(4)]
        model.train_on_batch(*batches[0])
        model.predict_on_batch(batches[0][0])
        warm = len(calls)
        for x, y in batches[1:]:
            loss = model.train_on_batch(x, y)
            model.predict_on_batch(x)
        assert np.isfinite(loss)
    finally:
        keras.config.set_dtype_policy("float32")
    if keras.backend.backend() == "torch":
        assert len(calls) - warm == 6  # eager: one call per step, nothing compiled
    else:
        assert len(calls) == warm, f"{len(calls) - warm} retraces after warm-up"
