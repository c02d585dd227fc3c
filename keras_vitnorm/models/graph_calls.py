"""The forward pass of the library's functional models, through `keras_vitnorm.ops.call_graph`."""

from keras_vitnorm import ops


class GraphCalls:
    """Runs a functional model's `call` through `keras_vitnorm.ops.call_graph`.

    Keras' functional model calls each layer of its graph through `Layer.__call__`,
    eager Python around every call on PyTorch. While the fast path `direct_calls` is
    on, a PyTorch model outside `torch.compile` calls them as `call_layer` does:
    the same outputs, gradients and weights (tests/test_ops.py). Elsewhere, for a mask
    and for a call that leaves `training` unset, the call is Keras' own. Users write
    nothing new.

    A mixin, placed before `keras.Model` in the bases of a model built from its
    inputs and outputs.
    """

    def call(self, inputs, training=None, mask=None, **kwargs):
        return ops.call_graph(self, super().call, inputs, training=training, mask=mask, **kwargs)
