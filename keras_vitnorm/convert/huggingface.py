"""Hugging Face `transformers` ViT (`ViTForImageClassification`, `ViTModel`) -> ViT, in either
key naming (`encoder.layer.{i}` or transformers 5's `layers.{i}`); the pooler is left out."""

import os

import numpy as np

from keras_vitnorm.convert._common import POSITION_EMBEDDING
from keras_vitnorm.convert._common import Checkpoint
from keras_vitnorm.convert._common import KeyReader
from keras_vitnorm.convert._common import first_keys
from keras_vitnorm.convert._common import grid_from_position_embedding
from keras_vitnorm.convert._common import heads_for_width
from keras_vitnorm.convert._common import read_json
from keras_vitnorm.convert._common import read_tensor_file
from keras_vitnorm.convert._common import to_numpy
from keras_vitnorm.convert._common import torch_conv_to_dense
from keras_vitnorm.convert._common import vit_config

PATCH_KEY = "embeddings.patch_embeddings.projection.weight"
# (file naming, transformers-5 module naming) of each per-block tensor.
_BLOCK_KEYS = {
    "query": ("encoder.layer.{i}.attention.attention.query", "layers.{i}.attention.q_proj"),
    "key": ("encoder.layer.{i}.attention.attention.key", "layers.{i}.attention.k_proj"),
    "value": ("encoder.layer.{i}.attention.attention.value", "layers.{i}.attention.v_proj"),
    "out": ("encoder.layer.{i}.attention.output.dense", "layers.{i}.attention.o_proj"),
    "fc1": ("encoder.layer.{i}.intermediate.dense", "layers.{i}.mlp.fc1"),
    "fc2": ("encoder.layer.{i}.output.dense", "layers.{i}.mlp.fc2"),
    "norm1": ("encoder.layer.{i}.layernorm_before", "layers.{i}.layernorm_before"),
    "norm2": ("encoder.layer.{i}.layernorm_after", "layers.{i}.layernorm_after"),
}


def is_huggingface_state(tensors):
    return any(key.endswith(PATCH_KEY) for key in tensors)


def read_directory(directory):
    """`(state dict, config dict)` of a saved transformers model directory."""
    config_path = os.path.join(directory, "config.json")
    hf_config = read_json(config_path)
    if hf_config.get("class_name") == "ViT":
        raise ValueError(
            f"{directory!r} is a keras_vitnorm preset, not a foreign checkpoint: load it with "
            "ViT.from_preset (keras-vitnorm convert re-saves it with overrides).")
    if "model_type" not in hf_config:
        raise ValueError(
            f"{config_path} names no model format: it is not a keras_vitnorm preset "
            "('class_name': 'ViT' and 'config'), a Hugging Face model ('model_type'), a timm "
            "model ('architecture') or a keras-hub preset ('module': 'keras_hub...').")
    if hf_config.get("model_type") != "vit":
        raise ValueError(
            f"{directory!r} holds a Hugging Face {hf_config.get('model_type')!r} model; only "
            "'vit' (ViTModel, ViTForImageClassification) converts to keras_vitnorm.")
    for name in ("model.safetensors", "pytorch_model.bin"):
        path = os.path.join(directory, name)
        if os.path.exists(path):
            return read_tensor_file(path), hf_config
    raise ValueError(
        f"{directory!r} has a config.json but no model.safetensors or pytorch_model.bin "
        "(sharded checkpoints are not supported; ViTs fit in one file).")


def convert(state_dict, hf_config=None, source="state dict", num_heads=None):
    """Maps a transformers ViT state dict onto a `Checkpoint`. Without `hf_config` (a dict or
    `ViTConfig`) the head count comes from the standard widths or `num_heads`, epsilon 1e-12."""
    tensors = {key: to_numpy(value) for key, value in state_dict.items()}
    if hasattr(hf_config, "to_dict"):
        hf_config = hf_config.to_dict()
    hf_config = dict(hf_config or {})
    patch_key = next((key for key in tensors if key.endswith(PATCH_KEY)), None)
    if patch_key is None:
        raise ValueError(
            f"{source} is not a Hugging Face ViT state dict: it has no key ending in "
            f"{PATCH_KEY!r}. Keys found start with: {first_keys(tensors)}.")
    prefix = patch_key[: -len(PATCH_KEY)]  # "vit." for ViTForImageClassification
    reader = KeyReader(tensors, "Hugging Face ViT", prefix)
    naming = 0 if reader.has(_BLOCK_KEYS["query"][0].format(i=0) + ".weight") else 1

    patch = reader.get(PATCH_KEY)
    width, channels, patch_size = patch.shape[0], patch.shape[1], patch.shape[2]
    depth = 0
    while reader.has(_BLOCK_KEYS["query"][naming].format(i=depth) + ".weight"):
        depth += 1
    if depth == 0:
        raise ValueError(f"{source} has no encoder blocks (no key like "
                         f"{prefix + _BLOCK_KEYS['query'][naming].format(i=0)}.weight).")
    mlp_dim = reader.get(_BLOCK_KEYS["fc1"][naming].format(i=0) + ".weight").shape[0]
    position_key = "embeddings.position_embeddings"
    has_cls = reader.has("embeddings.cls_token")
    positions = reader.get(position_key)
    side = grid_from_position_embedding(positions.shape[1], int(has_cls), prefix + position_key)
    if "image_size" in hf_config and hf_config["image_size"] != side * patch_size:
        raise ValueError(
            f"config.json says image_size={hf_config['image_size']} but {prefix + position_key} "
            f"has a {side}x{side} grid of {patch_size}-pixel patches ({side * patch_size}).")
    heads = (hf_config.get("num_attention_heads")
             or heads_for_width(width, num_heads, "Hugging Face"))
    if hf_config.get("hidden_act", "gelu") != "gelu":
        raise ValueError(
            f"config.json has hidden_act={hf_config['hidden_act']!r}; keras_vitnorm's MLP uses "
            "exact GELU ('gelu').")
    classes = tensors["classifier.weight"].shape[0] if "classifier.weight" in tensors else 0
    config = vit_config(
        image_size=side * patch_size, patch_size=patch_size, channels=channels, width=width,
        depth=depth, heads=heads, mlp_dim=mlp_dim, classes=classes,
        epsilon=hf_config.get("layer_norm_eps", 1e-12), qkv_bias=hf_config.get("qkv_bias", True),
        class_token=has_cls)
    put = reader.put
    put("stem/projection/kernel", PATCH_KEY, transform=torch_conv_to_dense)
    put("stem/projection/bias", PATCH_KEY[:-6] + "bias", (width,))
    if has_cls:
        put("stem/class_token", "embeddings.cls_token", (1, 1, width))
    put(POSITION_EMBEDDING, position_key)
    for i in range(depth):
        name = {k: v[naming].format(i=i) for k, v in _BLOCK_KEYS.items()}
        block, qkv = f"block_{i}", [name[p] for p in ("query", "key", "value")]
        put(f"{block}/attention/qkv/kernel", [k + ".weight" for k in qkv], (width, width),
            np.transpose)
        if config["qkv_bias"]:
            put(f"{block}/attention/qkv/bias", [k + ".bias" for k in qkv], (width,))
        for ours, theirs, shape in (
            ("attention/out", "out", (width, width)),
            ("mlp/fc1", "fc1", (mlp_dim, width)),
            ("mlp/fc2", "fc2", (width, mlp_dim)),
        ):
            put(f"{block}/{ours}/kernel", name[theirs] + ".weight", shape, np.transpose)
            put(f"{block}/{ours}/bias", name[theirs] + ".bias", shape[:1])
        for ours, theirs in (("attn_norm", "norm1"), ("mlp_norm", "norm2")):
            put(f"{block}/{ours}/gamma", name[theirs] + ".weight", (width,))
            put(f"{block}/{ours}/beta", name[theirs] + ".bias", (width,))
    put("final_norm/gamma", "layernorm.weight", (width,))
    put("final_norm/beta", "layernorm.bias", (width,))
    if classes:
        reader.prefix = ""  # the classifier sits beside `vit.`, not in it
        put("head/kernel", "classifier.weight", (classes, width), np.transpose)
        put("head/bias", "classifier.bias", (classes,))
    ignored = []
    for key in reader.unused():
        if "pooler." in key:
            ignored.append(f"{key} (ViTModel's tanh pooler; the classifier does not use it)")
        elif key.endswith("embeddings.mask_token"):
            ignored.append(f"{key} (masked-image-modeling token)")
        else:
            raise ValueError(
                f"Key {key!r} of {source} has no counterpart in a standard ViT; keras_vitnorm "
                "converts ViTModel and ViTForImageClassification checkpoints.")
    return Checkpoint("huggingface", source, config, reader.arrays, reader.keys, ignored)
