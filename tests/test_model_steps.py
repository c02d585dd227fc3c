"""The models' training and evaluation steps (`keras_vitnorm.models.steps`): with the fast
path `device_constants` they compute what Keras' own steps compute, and on PyTorch they
keep the host from waiting for the device, counted by `benchmarks/host_waits.py`."""

import os
import sys

import keras
import numpy as np
import pytest

from keras_vitnorm import ViT
from keras_vitnorm import ops as vitnorm_ops

sys.path.insert(0, os.path.join(os.path.dirname(__file__), os.pardir, "benchmarks"))
import host_waits  # noqa: E402

BACKEND = keras.backend.backend()
TINY = {"image_size": 8, "patch_size": 4, "width": 8, "depth": 1, "num_heads": 2, "mlp_dim": 16,
        "num_classes": 3}
STEP = "device_constants"
torch_only = pytest.mark.skipif(BACKEND != "torch", reason="the fast path is PyTorch's steps")


def _batch(size):
    rng = np.random.default_rng(0)
    x = rng.uniform(-1, 1, (size, 8, 8, 3)).astype("float32")
    return x, np.array([0, 1, 2, 0] * (size // 4))


def _train(step_on, others_on, precision="float32"):
    """Losses, logs and weights of a tiny ViT after three `train_on_batch` calls and a
    `fit` epoch of two batches with a validation pass (AdamW with weight decay, accuracy,
    a learning-rate schedule), with the steps' fast path `step_on` and every other
    `others_on`."""
    x, y = _batch(8)
    others = [name for name in vitnorm_ops.FAST_PATHS if name != STEP]
    previous = keras.config.dtype_policy().name
    keras.config.set_dtype_policy(precision)
    try:
        with vitnorm_ops.fast_paths(others_on, others), vitnorm_ops.fast_paths(step_on, [STEP]):
            keras.utils.set_random_seed(0)
            model = ViT(**TINY)
            for weight in model.trainable_weights:  # the head starts at zero
                weight.assign(np.random.default_rng(1).normal(0, 0.3, weight.shape))
            schedule = keras.optimizers.schedules.CosineDecay(1e-2, 10, warmup_target=2e-2,
                                                              warmup_steps=2)
            model.compile(optimizer=keras.optimizers.AdamW(schedule, weight_decay=0.1),
                          loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                          metrics=["accuracy"])
            losses = [model.train_on_batch(x[:4], y[:4], return_dict=True) for _ in range(3)]
            batch_logs = []
            logger = keras.callbacks.LambdaCallback(
                on_train_batch_end=lambda batch, logs: batch_logs.append(dict(logs)))
            history = model.fit(x, y, batch_size=4, epochs=1, shuffle=False, verbose=0,
                                callbacks=[logger], validation_data=(x[::-1], y[::-1]))
            weights = [keras.ops.convert_to_numpy(w) for w in model.weights]
            optimizer = [keras.ops.convert_to_numpy(v) for v in model.optimizer.variables]
    finally:
        keras.config.set_dtype_policy(previous)
    return losses, batch_logs, history.history, weights, optimizer


@pytest.mark.parametrize("others_on", [True, False], ids=["fast_paths_on", "fast_paths_off"])
@pytest.mark.parametrize("precision", ["float32"] + [
    pytest.param(precision, marks=pytest.mark.skipif(
        BACKEND != "torch", reason="mixed precision and loss scaling run in the library's own "
        "step on PyTorch only; on JAX and TensorFlow the step is Keras' either way"))
    for precision in ("mixed_bfloat16", "mixed_float16")
])
def test_the_step_gives_keras_losses_logs_and_weights(others_on, precision):
    """Three `train_on_batch` calls and a `fit` epoch with validation through the library's
    steps and through Keras' own: the same losses, logs (accuracy too), weights and
    optimizer state, bit for bit, with the other fast paths on and off, and with loss
    scaling."""
    fast = _train(True, others_on, precision)
    plain = _train(False, others_on, precision)
    assert fast[:3] == plain[:3]
    assert len(fast[1]) == 2 and set(fast[2]) == {"loss", "accuracy", "val_loss", "val_accuracy"}
    for fast_values, plain_values in zip(fast[3:], plain[3:]):
        assert len(fast_values) == len(plain_values)
        for a, b in zip(fast_values, plain_values):
            np.testing.assert_array_equal(a, b)


def _waits(mode, precision="float32", step_on=True):
    with vitnorm_ops.fast_paths(step_on, [STEP]):
        waits = host_waits.keras_waits(mode, TINY, 4, precision)
    return waits.count(phase=2 if mode in ("fit", "evaluate") else None), waits


@torch_only
@pytest.mark.parametrize("precision", ["float32", "mixed_bfloat16"])
def test_train_on_batch_waits_only_to_read_its_loss(precision):
    """Keras' step makes the host wait at each Python number it turns into a tensor
    (loss, loss tracker, AdamW, iteration counter, metric resets); the library's step
    waits once, where `train_on_batch` reads the loss it returns."""
    count, waits = _waits("train", precision)
    assert (count, waits.count("read")) == (1, 1), waits.report()
    plain, plain_waits = _waits("train", precision, step_on=False)
    assert plain > count, plain_waits.report()


@torch_only
@pytest.mark.parametrize("mode", ["fit", "evaluate"])
def test_a_fit_or_evaluate_step_waits_only_for_its_batch(mode):
    """In `fit` and `evaluate` the library's steps wait for nothing of their own: what is
    left is Keras' data adapter putting the batch (images and labels) on the device."""
    count, waits = _waits(mode)
    assert count == 2, waits.report(2)
    assert all("data_adapter" in frames for _, _, frames in waits.sites(2)), waits.report(2)
    plain, plain_waits = _waits(mode, step_on=False)
    assert plain > count, plain_waits.report(2)


@torch_only
def test_prediction_waits_once_to_read_its_output():
    count, waits = _waits("inference")
    assert (count, waits.count("read")) == (1, 1), waits.report()


@torch_only
def test_without_keras_trainer_parts_the_step_is_keras_own(monkeypatch):
    """The step uses private attributes of Keras' PyTorch trainer; where one is missing it
    runs Keras' step (waits and all), and still computes the same."""
    from keras_vitnorm.backend import _torch

    def in_the_step(waits):  # resetting the metrics needs no private part
        return sum(n for (_, _, frames), n in waits.sites().items()
                   if "reset_metrics" not in frames)

    monkeypatch.setattr(_torch, "STEP_PARTS", (*_torch.STEP_PARTS, "_not_in_this_keras"))
    plain = in_the_step(_waits("train", step_on=False)[1])
    assert plain > 1 and in_the_step(_waits("train")[1]) == plain
    assert _train(True, True)[:3] == _train(False, True)[:3]


@torch_only
def test_under_torch_compile_the_step_is_keras_own():
    """`torch.compile` keeps Python numbers in the compiled graph: there the step is Keras'
    own, with no frame of the library's between the compiler and it."""
    import torch

    from keras_vitnorm import backend

    class Model:  # has every part the library's step uses, so only the compiler decides
        _call_has_training_arg, _loss_tracker = True, object()

        def _compute_loss(self, **kwargs):
            raise AssertionError("the library's step ran")

        def __call__(self, x, training):
            return x

        def zero_grad(self):
            pass

    def keras_step(x):
        return x + 2.0

    compiled = torch.compile(lambda x: backend.train_step(Model(), keras_step, x),
                             fullgraph=True, backend="eager")
    assert compiled(torch.zeros(())).item() == 2.0
    with pytest.raises(AssertionError, match="the library's step ran"):
        backend.train_step(Model(), keras_step, torch.zeros(()))


@torch_only
def test_device_constants_keep_at_most_their_limit(monkeypatch):
    import torch

    from keras_vitnorm import backend
    from keras_vitnorm.backend import _torch

    monkeypatch.setattr(_torch, "_constants", {})
    monkeypatch.setattr(_torch, "CONSTANTS_LIMIT", 2)
    with backend.device_constants():
        made = [torch.as_tensor(value) for value in (1.5, 2.5, 3.5, 3.5, 1.5)]
    assert [t.item() for t in made] == [1.5, 2.5, 3.5, 3.5, 1.5]
    assert len(_torch._constants) == 2  # 3.5 made anew each time, not kept


@torch_only
def test_device_constants_are_the_tensors_the_call_makes():
    """Inside the context a tensor made from Python numbers is what the same call makes
    outside it (value, dtype, device), each call a tensor of its own, and numbers that
    compare equal but differ (0.0 and -0.0, 1 and True and 1.0) stay apart."""
    import torch

    from keras_vitnorm import backend

    calls = [(torch.as_tensor, 0.0, {"dtype": torch.float32, "device": "cpu"}),
             (torch.as_tensor, -0.0, {"dtype": torch.float32, "device": "cpu"}),
             (torch.as_tensor, 1, {}), (torch.as_tensor, True, {}), (torch.as_tensor, 1.0, {}),
             (torch.tensor, [4, 2], {"dtype": torch.int32}), (torch.asarray, (0.5,), {})]
    expected = [make(value, **kwargs) for make, value, kwargs in calls]
    with backend.device_constants():
        for _ in range(2):
            made = [make(value, **kwargs) for make, value, kwargs in calls]
            for tensor, reference in zip(made, expected):
                assert (tensor.dtype, tensor.device, tensor.shape) == \
                    (reference.dtype, reference.device, reference.shape)
                assert torch.equal(tensor, reference)
                assert torch.signbit(tensor).tolist() == torch.signbit(reference).tolist()
            made[0].add_(5.0)  # a caller that changes its tensor changes no other's
        again = torch.as_tensor(0.0, dtype=torch.float32, device="cpu")
        array = torch.as_tensor(np.arange(3.0))  # not Python numbers: made as it is
    assert again.item() == 0.0 and array.tolist() == [0.0, 1.0, 2.0]
