"""Semantic segmentation with a linear head on a ViT's patch tokens (docs/segmentation.md)."""

import keras
from keras import ops

from keras_vitnorm.models.vit import ViT
from keras_vitnorm.models.compile_config import PortableCompileConfig
from keras_vitnorm.models.guarded_calls import GuardedCalls
from keras_vitnorm.models.vit_config import image_hw
from keras_vitnorm.models.vit_config import vit_config_with_quantized_layers
from keras_vitnorm.validation import check_positive_int


def segmentation_loss(ignore_class=None):
    """Per-pixel cross-entropy on logits, averaged over the pixels not labelled `ignore_class`."""
    return keras.losses.SparseCategoricalCrossentropy(from_logits=True, ignore_class=ignore_class)


def mean_iou(num_classes, ignore_class=None):
    """Keras' mean intersection-over-union of the argmax prediction, ignored pixels left out."""
    return keras.metrics.MeanIoU(num_classes, ignore_class=ignore_class, sparse_y_true=True,
                                 sparse_y_pred=False, name="mean_iou")


@keras.saving.register_keras_serializable(package="keras_vitnorm")
class PixelAccuracy(keras.metrics.SparseCategoricalAccuracy):
    """The share of pixels whose argmax class is right, pixels labelled `ignore_class` left out."""

    def __init__(self, ignore_class=None, name="pixel_accuracy", **kwargs):
        super().__init__(name=name, **kwargs)
        self.ignore_class = ignore_class

    def update_state(self, y_true, y_pred, sample_weight=None):
        if self.ignore_class is not None:
            counted = ops.cast(ops.not_equal(y_true, self.ignore_class), "float32")
            sample_weight = counted if sample_weight is None else counted * sample_weight
        return super().update_state(y_true, y_pred, sample_weight)

    def get_config(self):
        return {**super().get_config(), "ignore_class": self.ignore_class}


@keras.saving.register_keras_serializable(package="keras_vitnorm")
class Segmenter(GuardedCalls, PortableCompileConfig, keras.Model):
    """A ViT encoder (`vit.backbone()`) with a zero-initialized linear per-patch head, upsampled
    bilinearly (the Dual PatchNorm paper's setup; why: docs/segmentation.md).

    Outputs float32 logits `(batch, height, width, num_classes)`.

    Args:
        vit: a `ViT`; its class token and classifier head are unused.
        num_classes: int, the number of pixel classes (the ignore label not counted).

    Example:
    >>> model = Segmenter(ViT.from_preset("s16_dpn", image_size=64), num_classes=21)
    >>> model.compile("adam", segmentation_loss(ignore_class=255), metrics=[mean_iou(21, 255)])

    Reference:
    - [Strudel et al., Segmenter, 2021](https://arxiv.org/abs/2105.05633)
    """

    def __init__(self, vit, num_classes, **kwargs):
        if not isinstance(vit, ViT):
            raise ValueError(
                f"Segmenter needs a keras_vitnorm ViT as its encoder, got {type(vit).__name__}.")
        check_positive_int("num_classes", num_classes)
        config = vit.get_config()
        height, width = image_hw(config["image_size"])
        patch = config["patch_size"]
        grid = (height // patch, width // patch)
        policy = vit.dtype_policy
        images = keras.Input(shape=vit.input.shape[1:], name="images")
        tokens = vit.backbone()(images)["tokens"]
        if config["pooling"] == "cls":
            tokens = tokens[:, 1:]
        patches = keras.layers.Reshape((*grid, config["width"]), name="patch_grid",
                                       dtype=policy)(tokens)
        logits = keras.layers.Dense(num_classes, kernel_initializer="zeros",
                                    name="segmentation_head", dtype=policy)(patches)
        logits = keras.layers.Activation("linear", dtype="float32", name="float32_logits")(logits)
        logits = keras.layers.UpSampling2D(size=(patch, patch), interpolation="bilinear",
                                           name="upsample", dtype="float32")(logits)
        super().__init__(inputs=images, outputs=logits, **kwargs)
        self.dtype_policy = policy
        self.vit_config = config
        self.num_classes = num_classes
        self.grid_size = grid

    def get_config(self):
        return {"vit": vit_config_with_quantized_layers(self, self.vit_config),
                "num_classes": self.num_classes, "name": self.name}

    @classmethod
    def from_config(cls, config, custom_objects=None):
        config = dict(config)
        return cls(ViT.from_config(config.pop("vit")), **config)

    def predict_masks(self, images, batch_size=32):
        """The predicted class of every pixel, `(batch, height, width)` int32 NumPy."""
        logits = self.predict(images, batch_size=batch_size, verbose=0)
        return ops.convert_to_numpy(ops.argmax(logits, axis=-1)).astype("int32")
