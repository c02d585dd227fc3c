"""big_vision / AugReg `.npz` ViT checkpoints -> ViT, in both namings, scanned blocks included;
`pre_logits` layers and MAP heads are refused (the GELU note: docs/checkpoints.md)."""

import numpy as np

from keras_vitnorm.convert._common import POSITION_EMBEDDING
from keras_vitnorm.convert._common import Checkpoint
from keras_vitnorm.convert._common import KeyReader
from keras_vitnorm.convert._common import check_all_used
from keras_vitnorm.convert._common import first_keys
from keras_vitnorm.convert._common import grid_from_position_embedding
from keras_vitnorm.convert._common import vit_config

_PREFIXES = ("", "opt/target/", "params/")


def is_big_vision_state(tensors):
    return any(prefix + "embedding/kernel" in tensors for prefix in _PREFIXES)


def convert(tensors, source="npz"):
    """Maps big_vision / AugReg `{key: array}` (an `np.load`ed `.npz`) onto a `Checkpoint`."""
    tensors = {key: np.asarray(value) for key, value in tensors.items()}
    prefix = next((p for p in _PREFIXES if p + "embedding/kernel" in tensors), None)
    if prefix is None:
        raise ValueError(
            f"{source} is not a big_vision/AugReg ViT checkpoint: it has no key "
            f"'embedding/kernel' (optionally under {', '.join(repr(p) for p in _PREFIXES[1:])}). "
            f"Keys found start with: {first_keys(tensors)}.")
    for marker, what in (("pre_logits/", "a pre-logits (representation) layer"),
                         ("MAPHead", "a MAP attention-pooling head")):
        found = next((k for k in tensors if marker in k), None)
        if found:
            raise ValueError(f"Key {found!r} of {source} belongs to {what}, which the plain ViT "
                             "layout does not have.")
    reader = KeyReader(tensors, "big_vision/AugReg", prefix)
    scanned = reader.has("Transformer/encoderblock/LayerNorm_0/scale")
    augreg = reader.has("Transformer/encoderblock_0/MultiHeadDotProductAttention_1/query/kernel")
    attention, norm1, norm2, mlp = (
        ("MultiHeadDotProductAttention_1", "LayerNorm_0", "LayerNorm_2", "MlpBlock_3") if augreg
        else ("MultiHeadDotProductAttention_0", "LayerNorm_0", "LayerNorm_1", "MlpBlock_0"))
    patch = reader.get("embedding/kernel")
    if patch.ndim != 4 or patch.shape[0] != patch.shape[1]:
        raise ValueError(f"Key {prefix}embedding/kernel has shape {patch.shape}; expected a square "
                         "(P, P, channels, width) convolution kernel.")
    patch_size, channels, width = patch.shape[0], patch.shape[2], patch.shape[3]
    if scanned:
        depth = reader.get("Transformer/encoderblock/LayerNorm_0/scale").shape[0]
    else:
        depth = 0
        while reader.has(f"Transformer/encoderblock_{depth}/{norm1}/scale"):
            depth += 1
    if depth == 0:
        raise ValueError(f"{source} has no encoder blocks (no key "
                         f"'{prefix}Transformer/encoderblock_0/{norm1}/scale').")

    def block_key(i, key):
        block = "encoderblock" if scanned else f"encoderblock_{i}"
        return f"Transformer/{block}/{key}"

    heads = reader.get(block_key(0, f"{attention}/query/kernel")).shape[-2]
    head_dim = width // heads
    mlp_dim = reader.get(block_key(0, f"{mlp}/Dense_0/kernel")).shape[-1]
    has_cls = reader.has("cls")
    position_key = "pos_embedding"
    if augreg or not reader.has(position_key):
        position_key = "Transformer/posembed_input/pos_embedding"
    positions = reader.get(position_key).reshape(1, -1, width)
    patches_only = has_cls and not augreg and position_key == "pos_embedding"
    side = grid_from_position_embedding(positions.shape[1], 0 if patches_only else int(has_cls),
                                        prefix + position_key)
    if patches_only:  # big_vision adds the position embedding before prepending `cls`
        positions = np.concatenate([np.zeros((1, 1, width), "float32"), positions], axis=1)
    classes = tensors[prefix + "head/kernel"].shape[-1] if reader.has("head/kernel") else 0
    qkv_bias = reader.has(block_key(0, f"{attention}/query/bias"))
    config = vit_config(
        image_size=side * patch_size, patch_size=patch_size, channels=channels, width=width,
        depth=depth, heads=heads, mlp_dim=mlp_dim, classes=classes, epsilon=1e-6,
        qkv_bias=qkv_bias, class_token=has_cls)

    def put_block(i, ours, theirs, shape, new_shape=None):
        """Puts block `i`'s tensor `theirs` (a list: joined) at `block_{i}/{ours}`."""
        names = [block_key(i, key) for key in (theirs if isinstance(theirs, list) else [theirs])]

        def transform(array):
            array = array[i] if scanned else array
            return array if new_shape is None else array.reshape(new_shape)

        reader.put(f"block_{i}/{ours}", names, (depth, *shape) if scanned else shape, transform)

    put = reader.put
    put("stem/projection/kernel", "embedding/kernel", transform=lambda a: a.reshape(-1, width))
    put("stem/projection/bias", "embedding/bias", (width,))
    if has_cls:
        put("stem/class_token", "cls", (1, 1, width))
    reader.arrays[POSITION_EMBEDDING] = positions
    reader.keys[POSITION_EMBEDDING] = prefix + position_key
    qkv = [f"{attention}/{p}" for p in ("query", "key", "value")]
    for i in range(depth):
        put_block(i, "attention/qkv/kernel", [k + "/kernel" for k in qkv],
                  (width, heads, head_dim), (width, width))
        if qkv_bias:
            put_block(i, "attention/qkv/bias", [k + "/bias" for k in qkv], (heads, head_dim),
                      (width,))
        put_block(i, "attention/out/kernel", f"{attention}/out/kernel", (heads, head_dim, width),
                  (width, width))
        put_block(i, "attention/out/bias", f"{attention}/out/bias", (width,))
        for ours, theirs, shape in (("fc1", "Dense_0", (width, mlp_dim)),
                                    ("fc2", "Dense_1", (mlp_dim, width))):
            put_block(i, f"mlp/{ours}/kernel", f"{mlp}/{theirs}/kernel", shape)
            put_block(i, f"mlp/{ours}/bias", f"{mlp}/{theirs}/bias", shape[1:])
        for ours, theirs in (("attn_norm", norm1), ("mlp_norm", norm2)):
            put_block(i, f"{ours}/gamma", f"{theirs}/scale", (width,))
            put_block(i, f"{ours}/beta", f"{theirs}/bias", (width,))
    put("final_norm/gamma", "Transformer/encoder_norm/scale", (width,))
    put("final_norm/beta", "Transformer/encoder_norm/bias", (width,))
    if classes:
        put("head/kernel", "head/kernel", (width, classes))
        put("head/bias", "head/bias", (classes,))
    # Keys outside `prefix` are optimizer state.
    check_all_used([key for key in reader.unused() if key.startswith(prefix)], source)
    return Checkpoint("big_vision", source, config, reader.arrays, reader.keys)
