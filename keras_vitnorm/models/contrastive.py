"""Contrastive image-text models in the LiT setup: a ViT image tower, a text tower
(docs/contrastive.md)."""

import functools
import math
import re

import keras
import numpy as np
from keras import ops

from keras_vitnorm.layers.encoder_block import EncoderBlock
from keras_vitnorm.layers.normalization import make_norm
from keras_vitnorm.models.vit import ViT
from keras_vitnorm.models.compile_config import PortableCompileConfig
from keras_vitnorm.models.guarded_calls import GuardedCalls
from keras_vitnorm.models.vit_config import vit_config_with_quantized_layers
from keras_vitnorm.validation import check_bool
from keras_vitnorm.validation import check_choice
from keras_vitnorm.validation import check_positive_int

CONTRASTIVE_LOSSES = ("softmax", "sigmoid")
#: What `TextVectorization`'s "lower_and_strip_punctuation" deletes.
_PUNCTUATION = re.compile(r'[!"#$%&()\*\+,-\./:;<=>?@\[\\\]^_`{|}~\']')


def caption_words(text):
    """`text`'s words as the tokenizer makes them: lower-cased, punctuation deleted, split."""
    return _PUNCTUATION.sub("", text.lower()).split()


def check_class_names_fit(max_length, class_names, templates):
    """A `ValueError` where `max_length` tokens cut a class name out of a caption (then every
    class has the same captions); `class_names=None` checks for any one-word name."""
    names = ["{}"] if class_names is None else list(class_names)
    needed, caption = 0, None
    for template in templates:
        before = template.split("{}", 1)[0]
        for name in names:
            length = len(caption_words(before + ("word" if class_names is None else name)))
            if length > needed:
                needed, caption = length, template.format(name)
    if max_length >= needed:
        return
    where = (f"{caption!r} ends its class name at token {needed}" if class_names is not None else
             f"{caption!r} puts the class name at token {needed} (further with a name of several "
             "words)")
    raise ValueError(
        f"max_length={max_length} cuts the class names out of the captions: {where}. Use a "
        f"max_length of at least {needed}.")


def softmax_contrastive_loss(logits):
    """Mean of the image-to-text and text-to-image cross-entropies (`logits[image, caption]`)."""
    logits = ops.cast(logits, "float32")
    labels = ops.arange(ops.shape(logits)[0])
    cross_entropy = functools.partial(keras.losses.sparse_categorical_crossentropy, labels,
                                      from_logits=True)
    return 0.5 * (ops.mean(cross_entropy(logits)) + ops.mean(cross_entropy(ops.transpose(logits))))


def sigmoid_contrastive_loss(logits):
    """SigLIP's loss: `-sum_j log sigmoid(z_ij * logits_ij)`, averaged over images i."""
    logits = ops.cast(logits, "float32")
    signs = 2.0 * ops.eye(ops.shape(logits)[0]) - 1.0
    return -ops.mean(ops.sum(ops.log_sigmoid(signs * logits), axis=1))


@keras.saving.register_keras_serializable(package="keras_vitnorm")
class TextEncoder(keras.layers.Layer):
    """A small pre-LN transformer over token ids, mean-pooled over the non-padding tokens.

    Args:
        vocabulary_size: int, token ids in `[0, vocabulary_size)`; `0` is padding.
        max_length, width, depth, num_heads, mlp_dim: tokens per caption; sizes.
    """

    CONFIG_KEYS = ("vocabulary_size", "max_length", "width", "depth", "num_heads", "mlp_dim")

    def __init__(self, vocabulary_size, max_length, width=128, depth=2, num_heads=4, mlp_dim=512,
                 **kwargs):
        super().__init__(**kwargs)
        arguments = locals()
        for key in self.CONFIG_KEYS:
            check_positive_int(key, arguments[key])
            setattr(self, key, arguments[key])

    def build(self, input_shape):
        self.token_embedding = keras.layers.Embedding(
            self.vocabulary_size, self.width,
            embeddings_initializer=keras.initializers.RandomNormal(stddev=0.02),
            name="token_embedding", dtype=self.dtype_policy)
        self.token_embedding.build(input_shape)
        self.position_embedding = self.add_weight(
            name="position_embedding", shape=(1, self.max_length, self.width),
            initializer=keras.initializers.RandomNormal(stddev=1 / math.sqrt(self.width)))
        self.blocks = [EncoderBlock(self.num_heads, self.mlp_dim, self.depth, name=f"block_{i}",
                                    dtype=self.dtype_policy) for i in range(self.depth)]
        shape = (input_shape[0], self.max_length, self.width)
        for block in self.blocks:
            block.build(shape)
        self.final_norm = make_norm("layernorm", 1e-6, name="final_norm", dtype=self.dtype_policy)
        self.final_norm.build(shape)

    def call(self, tokens, training=None):
        tokens = ops.convert_to_tensor(tokens, "int32")
        if tokens.shape[-1] != self.max_length:
            raise ValueError(f"TextEncoder expects {self.max_length} tokens per caption, got shape "
                             f"{tokens.shape}.")
        x = self.token_embedding(tokens) + ops.cast(self.position_embedding, self.compute_dtype)
        for block in self.blocks:
            x = block(x, training=training)
        x = self.final_norm(x, training=training)
        present = ops.cast(ops.not_equal(tokens, 0), x.dtype)[..., None]
        return ops.sum(x * present, axis=1) / ops.maximum(ops.sum(present, axis=1), 1.0)

    def compute_output_shape(self, input_shape):
        return (input_shape[0], self.width)

    def get_config(self):
        return {**super().get_config(), **{key: getattr(self, key) for key in self.CONFIG_KEYS}}


@keras.saving.register_keras_serializable(package="keras_vitnorm")
class LiT(GuardedCalls, PortableCompileConfig, keras.Model):
    """A ViT image tower and a `TextEncoder`, trained contrastively through `model.fit`.

    `fit` takes `{"images": ..., "tokens": ...}` batches of matching pairs (no labels); the
    output is the batch's float32 similarity logits `(images, captions)` (docs/contrastive.md).

    Args:
        vit: a `ViT`; its pooled features (`vit.backbone()`) represent the image.
        vocabulary: list of str, a `TextVectorization` vocabulary (`""` and `"[UNK]"` first),
            e.g. from `caption_vocabulary`.
        max_length, embed_dim: tokens per caption; size of the shared embedding.
        freeze_image_tower: bool, default `True` (LiT's setup), BatchNorm statistics too.
        loss: `"softmax"` (default) or `"sigmoid"` (SigLIP).
        text_width, text_depth, text_heads, text_mlp_dim: the text tower's size.
        temperature, bias: initial `t` (learned as `log t`) and sigmoid-loss bias.
        **kwargs: `keras.Model` arguments; `dtype` defaults to the ViT's policy.

    Example:
    >>> lit = LiT(ViT.from_preset("runs/plain/preset"), caption_vocabulary(captions))
    >>> lit.compile(optimizer="adam")
    >>> lit.fit({"images": images, "tokens": lit.tokenize(captions)}, batch_size=128)

    Reference:
    - [Zhai et al., LiT: Zero-Shot Transfer with Locked-image text Tuning, 2022](
      https://arxiv.org/abs/2111.07991)
    """

    def __init__(self, vit, vocabulary, max_length=16, embed_dim=128, freeze_image_tower=True,
                 loss="softmax", text_width=128, text_depth=2, text_heads=4, text_mlp_dim=512,
                 temperature=10.0, bias=-10.0, **kwargs):
        if not isinstance(vit, ViT):
            raise ValueError(
                f"LiT needs a keras_vitnorm ViT as its image tower, got {type(vit).__name__}.")
        super().__init__(**{"dtype": vit.dtype_policy, **kwargs})
        check_choice("loss", loss, CONTRASTIVE_LOSSES)
        check_positive_int("embed_dim", embed_dim)
        check_bool("freeze_image_tower", freeze_image_tower)
        vocabulary = list(vocabulary)
        if len(vocabulary) < 3 or vocabulary[:2] != ["", "[UNK]"]:
            raise ValueError(
                "vocabulary must be a TextVectorization vocabulary: '' and '[UNK]' first, then at "
                f"least one token (got {vocabulary[:5]}...). Build it with "
                "caption_vocabulary(captions).")
        if not (isinstance(temperature, (int, float)) and temperature > 0):
            raise ValueError(f"temperature must be a number > 0, got {temperature!r}.")
        self.vit_config = vit.get_config()
        self.vocabulary = vocabulary
        self.max_length = max_length
        self.embed_dim = embed_dim
        self.freeze_image_tower = freeze_image_tower
        self.loss_name = loss
        self.temperature_init = float(temperature)
        self.bias_init = float(bias)
        self.image_encoder = vit.backbone()
        self.image_encoder.trainable = not freeze_image_tower
        policy = self.dtype_policy
        self.image_projection = keras.layers.Dense(embed_dim, name="image_projection", dtype=policy)
        self.text_encoder = TextEncoder(len(vocabulary), max_length, text_width, text_depth,
                                        text_heads, text_mlp_dim, name="text_encoder", dtype=policy)
        self.text_projection = keras.layers.Dense(embed_dim, name="text_projection", dtype=policy)
        self.log_temperature = self.add_weight(
            name="log_temperature", shape=(),
            initializer=keras.initializers.Constant(math.log(temperature)))
        self.logit_bias = None
        if loss == "sigmoid":
            self.logit_bias = self.add_weight(name="logit_bias", shape=(),
                                              initializer=keras.initializers.Constant(bias))
        # Built here, whole, so that a saved model reloads into the same variables.
        self.image_projection.build((None, self.vit_config["width"]))
        self.text_encoder.build((None, max_length))
        self.text_projection.build((None, text_width))
        self.built = True

    def build(self, input_shape=None):
        self.built = True  # every variable is made in the constructor

    def input_shapes(self):
        """`{"images": (height, width, channels), "tokens": (max_length,)}` that the calls take."""
        return {"images": tuple(self.image_encoder.inputs[0].shape[1:]),
                "tokens": (self.max_length,)}

    @functools.cached_property
    def _tokenizer(self):
        # Untracked (a cached property): as a sublayer it would be saved and stop `quantize`.
        return keras.layers.TextVectorization(
            standardize="lower_and_strip_punctuation", output_sequence_length=self.max_length,
            vocabulary=self.vocabulary[2:])

    def tokenize(self, captions):
        """Token ids `(len(captions), max_length)` int32 NumPy of a list of strings."""
        captions = list(captions)
        if not captions:
            raise ValueError("tokenize got no captions: pass a non-empty list of strings.")
        if not all(isinstance(c, str) for c in captions):
            raise ValueError("tokenize takes a list of strings.")
        return np.asarray(keras.ops.convert_to_numpy(self._tokenizer(captions)), "int32")

    def encode_images(self, images, training=None):
        """Unit-length image embeddings `(batch, embed_dim)`, float32."""
        features = self.image_encoder(images, training=training and not self.freeze_image_tower)
        return _normalize(self.image_projection(features["pooled"]))

    def encode_text(self, tokens, training=None):
        """Unit-length caption embeddings `(batch, embed_dim)` of token ids, float32."""
        if tokens is None or np.shape(tokens)[0] == 0:  # a static size; None in a traced graph
            raise ValueError(
                "encode_text got an empty batch: pass at least one caption's token ids.")
        return _normalize(self.text_projection(self.text_encoder(tokens, training=training)))

    def call(self, inputs, training=None):
        if not isinstance(inputs, dict) or set(inputs) != {"images", "tokens"}:
            keys = sorted(inputs) if isinstance(inputs, dict) else type(inputs).__name__
            raise ValueError(f"LiT takes a dict with 'images' and 'tokens', got {keys}.")
        images = self.encode_images(inputs["images"], training=training)
        texts = self.encode_text(inputs["tokens"], training=training)
        temperature = ops.exp(ops.cast(self.log_temperature, "float32"))
        logits = ops.matmul(images, ops.transpose(texts)) * temperature
        if self.logit_bias is not None:
            logits = logits + ops.cast(self.logit_bias, "float32")
        return logits

    def compute_loss(self, x=None, y=None, y_pred=None, sample_weight=None, training=True):
        if y_pred is None:
            y_pred = self(x, training=training)
        sigmoid = self.loss_name == "sigmoid"
        loss = (sigmoid_contrastive_loss if sigmoid else softmax_contrastive_loss)(y_pred)
        return loss + ops.cast(sum(self.losses), "float32") if self.losses else loss

    def zero_shot_classifier(self, class_names, templates):
        """`(classes, embed_dim)`: each class's prompt embeddings averaged and renormalized;
        each of `templates` has a `{}` for the class name (`"a photo of a {}."`)."""
        if not class_names or not templates:
            raise ValueError("zero_shot_classifier needs at least one class name and one template.")
        bad = [t for t in templates if "{}" not in t]
        if bad:
            raise ValueError(
                f"Every template needs a '{{}}' for the class name; {bad[0]!r} has none.")
        check_class_names_fit(self.max_length, class_names, templates)
        rows = []
        for name in class_names:
            tokens = self.tokenize([t.format(name) for t in templates])
            rows.append(ops.mean(self.encode_text(tokens), axis=0))
        return _normalize(ops.stack(rows))

    def zero_shot_predict(self, images, classifier, batch_size=64):
        """The class index of each image under `classifier` (`zero_shot_classifier`), int32."""
        predictions = []
        for start in range(0, len(images), batch_size):
            scores = ops.matmul(self.encode_images(images[start:start + batch_size]),
                                ops.transpose(classifier))
            predictions.append(ops.convert_to_numpy(ops.argmax(scores, -1)))
        return np.concatenate(predictions).astype("int32")

    def get_config(self):
        text = self.text_encoder
        return {
            "vit": vit_config_with_quantized_layers(self, self.vit_config),
            "vocabulary": self.vocabulary, "max_length": self.max_length,
            "embed_dim": self.embed_dim, "freeze_image_tower": self.freeze_image_tower,
            "loss": self.loss_name, "text_width": text.width, "text_depth": text.depth,
            "text_heads": text.num_heads, "text_mlp_dim": text.mlp_dim,
            "temperature": self.temperature_init, "bias": self.bias_init, "name": self.name,
        }

    @classmethod
    def from_config(cls, config, custom_objects=None):
        config = dict(config)
        return cls(ViT.from_config(config.pop("vit")), **config)


def caption_vocabulary(captions, max_tokens=None):
    """The `TextVectorization` vocabulary of `captions` (`""`, `"[UNK]"`, then by frequency)."""
    captions = list(captions)
    if not captions:
        raise ValueError("caption_vocabulary got no captions.")
    layer = keras.layers.TextVectorization(max_tokens=max_tokens,
                                           standardize="lower_and_strip_punctuation")
    layer.adapt(captions)
    return [str(token) for token in layer.get_vocabulary()]


def _normalize(x):
    x = ops.cast(x, "float32")
    return x / ops.sqrt(ops.maximum(ops.sum(ops.square(x), axis=-1, keepdims=True), 1e-12))
