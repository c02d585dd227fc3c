"""keras-hub `ViTBackbone` / `ViTImageClassifier` presets on disk -> ViT (needs keras-hub)."""

import os
import re

import numpy as np

from keras_vitnorm.convert._common import POSITION_EMBEDDING
from keras_vitnorm.convert._common import Checkpoint
from keras_vitnorm.convert._common import read_json
from keras_vitnorm.convert._common import vit_config


def is_keras_hub_directory(directory):
    path = os.path.join(directory, "config.json")
    return os.path.isfile(path) and str(read_json(path).get("module", "")).startswith("keras_hub")


def read_directory(directory):
    """Loads the preset with keras-hub; returns `(backbone, classifier or None)`."""
    try:
        import keras_hub
    except ImportError:
        raise ValueError(
            f"{directory!r} is a keras-hub preset; reading it needs keras-hub: "
            "pip install keras-hub."
        ) from None
    class_name = read_json(os.path.join(directory, "config.json")).get("class_name")
    if class_name != "ViTBackbone":
        raise ValueError(
            f"{directory!r} is a keras-hub {class_name!r} preset; only ViTBackbone (and "
            "ViTImageClassifier) presets convert to keras_vitnorm.")
    if os.path.isfile(os.path.join(directory, "task.json")):
        classifier = keras_hub.models.ImageClassifier.from_preset(directory)
        return classifier.backbone, classifier
    return keras_hub.models.ViTBackbone.from_preset(directory), None


def convert(backbone, classifier=None, source="keras-hub model"):
    """Maps a keras-hub `ViTBackbone` (and its `ViTImageClassifier`) onto a `Checkpoint`."""
    config = backbone.get_config()
    if not all(config.get(f"use_{part}_bias", True) for part in ("mha", "mlp", "patch")):
        raise ValueError(
            f"{source} has use_mha_bias/use_mlp_bias/use_patch_bias off; keras_vitnorm's ViT "
            "has those biases (only the qkv bias can be switched off).")
    height, width_px, channels = config["image_shape"]
    patch_size = config["patch_size"]
    patch_size = patch_size[0] if isinstance(patch_size, (list, tuple)) else patch_size
    if height != width_px:
        raise ValueError(
            f"{source} has non-square images {config['image_shape']}; only square ones convert.")
    width, heads = config["hidden_dim"], config["num_heads"]
    has_cls = config.get("use_class_token", True)
    if classifier is not None:
        wanted = {"token": True, "gap": False}.get(classifier.pooling)
        if wanted is None or wanted != has_cls or getattr(classifier, "intermediate_dim", None):
            raise ValueError(
                f"{source}: a ViTImageClassifier with pooling={classifier.pooling!r}, "
                f"use_class_token={has_cls} and intermediate_dim="
                f"{getattr(classifier, 'intermediate_dim', None)} has no keras_vitnorm "
                "equivalent (supported: token pooling with a class token, or gap without one, "
                "and no pre-logits layer).")
    weights = {w.path: np.asarray(_numpy(w)) for w in backbone.weights}
    arrays, keys = {}, {}

    def take(path, key, transform=None):
        if key not in weights:
            raise ValueError(
                f"{source} has no weight {key!r}; found: {', '.join(sorted(weights)[:4])} ...")
        array = weights.pop(key)
        arrays[path] = transform(array) if transform else array
        keys[path] = key

    embed = "vit_patching_and_embedding"
    take("stem/projection/kernel", f"{embed}/patch_embedding/kernel",
         lambda a: a.reshape(-1, width))
    take("stem/projection/bias", f"{embed}/patch_embedding/bias")
    if has_cls:
        take("stem/class_token", f"{embed}/class_token", lambda a: a.reshape(1, 1, width))
    take(POSITION_EMBEDDING, f"{embed}/position_embedding/embeddings", lambda a: a[None])
    numbers = (re.search(r"transformer_block_(\d+)/", key) for key in weights)
    blocks = sorted({int(match.group(1)) for match in numbers if match})
    for i, number in enumerate(blocks):
        theirs, ours = f"vit_encoder/transformer_block_{number}", f"block_{i}"
        for kind, shape in (("kernel", (width, width)), ("bias", (width,))):
            parts = [weights.pop(f"{theirs}/mha/{p}/{kind}").reshape(shape)
                     for p in ("query", "key", "value")]
            arrays[f"{ours}/attention/qkv/{kind}"] = np.concatenate(parts, axis=-1)
            keys[f"{ours}/attention/qkv/{kind}"] = f"{theirs}/mha/{{query,key,value}}/{kind}"
        take(f"{ours}/attention/out/kernel", f"{theirs}/mha/attention_output/kernel",
             lambda a: a.reshape(width, width))
        take(f"{ours}/attention/out/bias", f"{theirs}/mha/attention_output/bias")
        for layer, theirs_layer in (("mlp/fc1", "mlp/dense_1"), ("mlp/fc2", "mlp/dense_2")):
            take(f"{ours}/{layer}/kernel", f"{theirs}/{theirs_layer}/kernel")
            take(f"{ours}/{layer}/bias", f"{theirs}/{theirs_layer}/bias")
        for norm, theirs_norm in (("attn_norm", "ln_1"), ("mlp_norm", "ln_2")):
            take(f"{ours}/{norm}/gamma", f"{theirs}/{theirs_norm}/gamma")
            take(f"{ours}/{norm}/beta", f"{theirs}/{theirs_norm}/beta")
    take("final_norm/gamma", "vit_encoder/ln/gamma")
    take("final_norm/beta", "vit_encoder/ln/beta")
    if weights:
        raise ValueError(
            f"Weight {sorted(weights)[0]!r} of {source} has no counterpart in a plain ViT.")
    classes = 0
    if classifier is not None:
        dense = classifier.output_dense
        arrays["head/kernel"], arrays["head/bias"] = _numpy(dense.kernel), _numpy(dense.bias)
        keys["head/kernel"], keys["head/bias"] = dense.kernel.path, dense.bias.path
        classes = arrays["head/kernel"].shape[-1]
    converted = vit_config(
        image_size=height, patch_size=patch_size, channels=channels, width=width,
        depth=len(blocks), heads=heads, mlp_dim=config["mlp_dim"], classes=classes,
        epsilon=config.get("layer_norm_epsilon", 1e-6), qkv_bias=True, class_token=has_cls)
    return Checkpoint("keras_hub", source, converted, arrays, keys)


def _numpy(variable):
    from keras import ops

    return np.asarray(ops.convert_to_numpy(variable), dtype="float32")
