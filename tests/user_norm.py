"""A user's own normalization, as docs/your-norm.md builds it: ScaleNorm (Nguyen and
Salazar, 2019), `g * x / max(||x||, epsilon)` with one learnable scalar `g` initialized to
`sqrt(width)`, registered as `"scalenorm"`. The tests import it as a module and name its
path in `KERAS_VITNORM_NORM_MODULES`, as a user does."""

import keras
from keras import ops

from keras_vitnorm.layers import register_norm


@register_norm("scalenorm")
class ScaleNorm(keras.layers.Layer):
    def __init__(self, epsilon=1e-5, **kwargs):
        super().__init__(**kwargs)
        self.epsilon = epsilon

    def build(self, input_shape):
        self.g = self.add_weight(name="g", shape=(),
                                 initializer=keras.initializers.Constant(input_shape[-1] ** 0.5))

    def call(self, x):
        norm = ops.sqrt(ops.sum(ops.square(x), axis=-1, keepdims=True))
        return ops.cast(self.g, x.dtype) * x / ops.maximum(norm, self.epsilon)

    def get_config(self):
        return {**super().get_config(), "epsilon": self.epsilon}
