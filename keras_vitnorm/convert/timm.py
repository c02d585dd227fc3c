"""timm `VisionTransformer` state dicts (`vit_*_patch{16,32}_*`) -> ViT, without timm; a
variant with parts a plain ViT lacks is refused with the key that shows it."""

import os

import numpy as np

from keras_vitnorm.convert._common import POSITION_EMBEDDING
from keras_vitnorm.convert._common import Checkpoint
from keras_vitnorm.convert._common import KeyReader
from keras_vitnorm.convert._common import check_all_used
from keras_vitnorm.convert._common import first_keys
from keras_vitnorm.convert._common import grid_from_position_embedding
from keras_vitnorm.convert._common import heads_for_width
from keras_vitnorm.convert._common import read_json
from keras_vitnorm.convert._common import read_tensor_file
from keras_vitnorm.convert._common import to_numpy
from keras_vitnorm.convert._common import torch_conv_to_dense
from keras_vitnorm.convert._common import vit_config

PATCH_KEY = "patch_embed.proj.weight"
_UNSUPPORTED = {
    ".ls1.": "LayerScale",
    "reg_token": "register tokens",
    "fc_norm.": "fc_norm (a norm after global pooling)",
    ".q_norm.": "QK-norm",
    "pre_logits.": "a pre-logits layer",
    "attn_pool.": "attention pooling",
    "norm_pre.": "a pre-encoder norm",
}
WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin")


def is_timm_directory(directory):
    """Whether `directory` is a timm model as the Hub serves it (`architecture` in config.json)."""
    config = os.path.join(directory, "config.json")
    return os.path.isfile(config) and "architecture" in read_json(config)


def read_directory(directory):
    """The state dict of a timm model directory."""
    for name in WEIGHT_FILES:
        path = os.path.join(directory, name)
        if os.path.exists(path):
            return read_tensor_file(path)
    architecture = read_json(os.path.join(directory, "config.json"))["architecture"]
    raise ValueError(
        f"{directory!r} is a timm {architecture!r} model without weights: neither of "
        f"{', '.join(WEIGHT_FILES)} is there.")


def is_timm_state(tensors):
    return PATCH_KEY in tensors or "module." + PATCH_KEY in tensors


def convert(state_dict, source="state dict", num_heads=None):
    """Maps a timm ViT state dict onto a `Checkpoint`; `num_heads` for a non-standard width."""
    tensors = {key: to_numpy(value) for key, value in state_dict.items()}
    prefix = "module." if "module." + PATCH_KEY in tensors else ""
    if PATCH_KEY not in tensors and not prefix:
        raise ValueError(
            f"{source} is not a timm ViT state dict: it has no key {PATCH_KEY!r}. Keys found "
            f"start with: {first_keys(tensors)}.")
    for key in tensors:
        for marker, what in _UNSUPPORTED.items():
            if marker in key or key.startswith(prefix + marker.lstrip(".")):
                raise ValueError(
                    f"Key {key!r} of {source} belongs to {what}, which the plain ViT layout "
                    "does not have; only plain timm ViTs (vit_*_patch{16,32}_*) convert.")
    reader = KeyReader(tensors, "timm ViT", prefix)
    patch = reader.get(PATCH_KEY)
    width, channels, patch_size = patch.shape[0], patch.shape[1], patch.shape[2]
    depth = 0
    while reader.has(f"blocks.{depth}.attn.qkv.weight"):
        depth += 1
    if depth == 0:
        raise ValueError(f"{source} has no encoder blocks (no key 'blocks.0.attn.qkv.weight').")
    mlp_dim = reader.get("blocks.0.mlp.fc1.weight").shape[0]
    has_cls = reader.has("cls_token")
    positions = reader.get("pos_embed")
    side = grid_from_position_embedding(positions.shape[1], int(has_cls), prefix + "pos_embed")
    qkv_bias = reader.has("blocks.0.attn.qkv.bias")
    classes = tensors[prefix + "head.weight"].shape[0] if reader.has("head.weight") else 0
    config = vit_config(
        image_size=side * patch_size, patch_size=patch_size, channels=channels, width=width,
        depth=depth, heads=heads_for_width(width, num_heads, "timm"), mlp_dim=mlp_dim,
        classes=classes, epsilon=1e-6, qkv_bias=qkv_bias, class_token=has_cls)
    put, transpose = reader.put, np.transpose
    put("stem/projection/kernel", PATCH_KEY, transform=torch_conv_to_dense)
    put("stem/projection/bias", "patch_embed.proj.bias", (width,))
    if has_cls:
        put("stem/class_token", "cls_token", (1, 1, width))
    put(POSITION_EMBEDDING, "pos_embed")
    for i in range(depth):
        block, theirs = f"block_{i}", f"blocks.{i}"
        put(f"{block}/attention/qkv/kernel", f"{theirs}.attn.qkv.weight", (3 * width, width),
            transpose)
        if qkv_bias:
            put(f"{block}/attention/qkv/bias", f"{theirs}.attn.qkv.bias", (3 * width,))
        for ours, key, shape in (
            ("attention/out", "attn.proj", (width, width)),
            ("mlp/fc1", "mlp.fc1", (mlp_dim, width)),
            ("mlp/fc2", "mlp.fc2", (width, mlp_dim)),
        ):
            put(f"{block}/{ours}/kernel", f"{theirs}.{key}.weight", shape, transpose)
            put(f"{block}/{ours}/bias", f"{theirs}.{key}.bias", shape[:1])
        for ours, key in (("attn_norm", "norm1"), ("mlp_norm", "norm2")):
            put(f"{block}/{ours}/gamma", f"{theirs}.{key}.weight", (width,))
            put(f"{block}/{ours}/beta", f"{theirs}.{key}.bias", (width,))
    put("final_norm/gamma", "norm.weight", (width,))
    put("final_norm/beta", "norm.bias", (width,))
    if classes:
        put("head/kernel", "head.weight", (classes, width), transpose)
        put("head/bias", "head.bias", (classes,))
    check_all_used(reader.unused(), source, f"a plain ViT of depth {depth}")
    return Checkpoint("timm", source, config, reader.arrays, reader.keys)
