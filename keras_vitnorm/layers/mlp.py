"""The transformer MLP: Dense, GELU, optional mid norm, Dense."""

import keras

from keras_vitnorm.validation import check_bool
from keras_vitnorm.validation import check_positive_float
from keras_vitnorm.validation import check_positive_int
from keras_vitnorm.validation import check_rate
from keras_vitnorm.layers.dense import FusedDense
from keras_vitnorm.layers.initializers import ScaledInitializer
from keras_vitnorm.layers.normalization import check_norm
from keras_vitnorm.layers.normalization import check_norm_options
from keras_vitnorm.layers.normalization import make_norm


@keras.saving.register_keras_serializable(package="keras_vitnorm")
class MLP(keras.layers.Layer):
    """Two-layer MLP `fc2(N(gelu(fc1(x))))` of a transformer block, with exact (erf) GELU.

    Args:
        hidden_dim: int. Width of the hidden layer.
        mid_norm: str or None, default `None`. A norm after the activation (NormFormer, Sub-LN).
        norm_epsilon: float, default `1e-6`; norm_groups: int, default `32`.
        init_scale: float, default `1.0`. Multiplies the initial `fc1` and `fc2` weights.
        dropout: float, default `0.0`. Dropout after the activation and after `fc2`.
        weight_standardization: bool, default `False`.
        **kwargs: base layer keyword arguments.

    Example:
    >>> mlp = MLP(hidden_dim=128, mid_norm="layernorm")
    >>> y = mlp(keras.random.normal((2, 17, 32)))
    """

    #: The constructor arguments, in `get_config`'s order.
    CONFIG_KEYS = ("hidden_dim", "mid_norm", "norm_epsilon", "norm_groups", "init_scale",
                   "dropout", "weight_standardization")

    def __init__(self, hidden_dim, mid_norm=None, norm_epsilon=1e-6, norm_groups=32, init_scale=1.0,
                 dropout=0.0, weight_standardization=False, **kwargs):
        super().__init__(**kwargs)
        arguments = {key: value for key, value in locals().items() if key in self.CONFIG_KEYS}
        self.check_arguments(**arguments)
        for key, value in arguments.items():
            setattr(self, key, value)

    @staticmethod
    def check_arguments(hidden_dim, mid_norm=None, norm_epsilon=1e-6, norm_groups=32,
                        init_scale=1.0, dropout=0.0, weight_standardization=False):
        """Raises a `ValueError` naming the first bad argument of the constructor."""
        check_positive_int("hidden_dim", hidden_dim)
        if mid_norm is not None:
            check_norm("mid_norm", mid_norm)
        check_norm_options(norm_epsilon, norm_groups, prefix="norm_")
        check_positive_float("init_scale", init_scale)
        check_rate("dropout", dropout)
        check_bool("weight_standardization", weight_standardization)

    def build(self, input_shape):
        width = input_shape[-1]
        hidden_shape = (*input_shape[:-1], self.hidden_dim)

        def scaled(initializer):
            if self.init_scale == 1.0:
                return initializer
            return ScaledInitializer(initializer, self.init_scale)

        def dense(units, name, shape):  # big_vision's MLP: Xavier-uniform, bias N(0, 1e-6)
            # The bias initializer first: an unseeded one draws its seed when made.
            bias_initializer = scaled(keras.initializers.RandomNormal(stddev=1e-6))
            layer = FusedDense(units, kernel_initializer=scaled("glorot_uniform"),
                               bias_initializer=bias_initializer, name=name,
                               dtype=self.dtype_policy,
                               weight_standardization=self.weight_standardization)
            layer.build(shape)
            return layer

        self.fc1 = dense(self.hidden_dim, "fc1", input_shape)
        self.fc2 = dense(width, "fc2", hidden_shape)
        self.mid_norm_layer = None
        if self.mid_norm is not None:
            self.mid_norm_layer = make_norm(self.mid_norm, epsilon=self.norm_epsilon,
                                            groups=self.norm_groups, name="mid_norm",
                                            dtype=self.dtype_policy)
            self.mid_norm_layer.build(hidden_shape)
        self.dropout_layer = keras.layers.Dropout(self.dropout, dtype=self.dtype_policy)

    def call(self, x, training=None):
        x = keras.activations.gelu(self.fc1(x, training=training), approximate=False)
        if self.mid_norm_layer is not None:
            x = self.mid_norm_layer(x, training=training)
        if self.dropout:  # a rate of 0 is the identity: no layer call
            x = self.dropout_layer(x, training=training)
        x = self.fc2(x, training=training)
        return self.dropout_layer(x, training=training) if self.dropout else x

    def compute_output_shape(self, input_shape):
        return input_shape

    def get_config(self):
        return {**super().get_config(), **{key: getattr(self, key) for key in self.CONFIG_KEYS}}
