"""The training and evaluation steps of the library's models: Keras' own, without the host
waiting for the GPU on PyTorch."""

from keras_vitnorm import backend
from keras_vitnorm import ops


class ModelSteps:
    """Runs the steps of `fit`, `train_on_batch` and `evaluate` through `keras_vitnorm.backend`.

    On PyTorch, Keras runs its steps op by op, and the Python numbers it turns into
    tensors on the way (the loss's divisor, the loss tracker's batch size, a metric's
    sample count, AdamW's betas, its weight decay and the iteration counter's
    increment, and the zeros that reset the metrics) are each a copy from host memory,
    before which the host waits for the GPU to finish everything queued: the GPU idles
    at each. While the fast path `device_constants` is on
    (`keras_vitnorm.ops.set_fast_paths`), `train_step`, `test_step` and
    `reset_metrics` make those tensors as copies, on the device, of tensors made once,
    and otherwise compute what Keras' do, in the same order: the same loss, weights,
    metrics and logs. With it off, on JAX and TensorFlow, and under `torch.compile`
    (which trace a step into one program, where such numbers are constants), the steps
    are Keras' own. docs/performance.md counts the waits (`benchmarks/host_waits.py`).

    A mixin, placed before `keras.Model` in the bases.
    """

    def train_step(self, *args):
        if ops.fast_path_enabled("device_constants"):
            return backend.train_step(self, super().train_step, *args)
        return super().train_step(*args)

    def test_step(self, *args):
        if ops.fast_path_enabled("device_constants"):
            return backend.test_step(self, super().test_step, *args)
        return super().test_step(*args)

    def reset_metrics(self):
        if ops.fast_path_enabled("device_constants"):
            with backend.device_constants():
                super().reset_metrics()
        else:
            super().reset_metrics()
