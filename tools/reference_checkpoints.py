"""Reference checkpoints for the conversion tests and tools/checkpoint_parity.py.

A transformers ViT's weights (`TI`: ViT-Ti/16 at 224 with 10 classes), perturbed so
that no weight is at its initial value, and the same weights rewritten in timm's and
big_vision/AugReg's key layouts, as those projects name them.
"""

import numpy as np

TI = {"hidden_size": 192, "num_hidden_layers": 12, "num_attention_heads": 3,
      "intermediate_size": 768, "image_size": 224, "patch_size": 16, "num_labels": 10,
      "layer_norm_eps": 1e-6}


def perturbed(module, seed):
    """`module` with every parameter moved by 0.05 N(0, 1) (seeded), in eval mode."""
    import torch

    torch.manual_seed(seed)
    with torch.no_grad():
        for parameter in module.parameters():
            parameter.add_(0.05 * torch.randn_like(parameter))
    return module.eval()


def to_timm(state):
    """transformers file keys -> timm `VisionTransformer` keys (as timm names them)."""
    out = {
        "cls_token": state["vit.embeddings.cls_token"],
        "pos_embed": state["vit.embeddings.position_embeddings"],
        "patch_embed.proj.weight": state["vit.embeddings.patch_embeddings.projection.weight"],
        "patch_embed.proj.bias": state["vit.embeddings.patch_embeddings.projection.bias"],
        "norm.weight": state["vit.layernorm.weight"], "norm.bias": state["vit.layernorm.bias"],
        "head.weight": state["classifier.weight"], "head.bias": state["classifier.bias"],
    }
    for i in range(TI["num_hidden_layers"]):
        hf, tm = f"vit.encoder.layer.{i}.", f"blocks.{i}."
        for kind in ("weight", "bias"):
            out[tm + f"attn.qkv.{kind}"] = np.concatenate(
                [state[hf + f"attention.attention.{p}.{kind}"] for p in ("query", "key", "value")])
            out[tm + f"attn.proj.{kind}"] = state[hf + f"attention.output.dense.{kind}"]
            out[tm + f"mlp.fc1.{kind}"] = state[hf + f"intermediate.dense.{kind}"]
            out[tm + f"mlp.fc2.{kind}"] = state[hf + f"output.dense.{kind}"]
            out[tm + f"norm1.{kind}"] = state[hf + f"layernorm_before.{kind}"]
            out[tm + f"norm2.{kind}"] = state[hf + f"layernorm_after.{kind}"]
    return out


def to_big_vision(state, naming):
    """transformers file keys -> an `.npz` in the AugReg or big_vision (scanned) layout."""
    width, heads = TI["hidden_size"], TI["num_attention_heads"]
    head_dim = width // heads
    depth = TI["num_hidden_layers"]
    augreg = naming == "augreg"
    prefix = "" if augreg else "params/"
    attention, ln1, ln2, mlp = (("MultiHeadDotProductAttention_1", "LayerNorm_0", "LayerNorm_2", "MlpBlock_3")
                                if augreg else ("MultiHeadDotProductAttention_0", "LayerNorm_0", "LayerNorm_1", "MlpBlock_0"))
    out = {
        "embedding/kernel": state["vit.embeddings.patch_embeddings.projection.weight"].transpose(2, 3, 1, 0),
        "embedding/bias": state["vit.embeddings.patch_embeddings.projection.bias"],
        "cls": state["vit.embeddings.cls_token"],
        "Transformer/encoder_norm/scale": state["vit.layernorm.weight"],
        "Transformer/encoder_norm/bias": state["vit.layernorm.bias"],
        "head/kernel": state["classifier.weight"].T,
        "head/bias": state["classifier.bias"],
    }
    positions = state["vit.embeddings.position_embeddings"]
    if augreg:
        out["Transformer/posembed_input/pos_embedding"] = positions
    else:  # big_vision: patches only, added before the class token is prepended
        out["pos_embedding"] = positions[:, 1:]
    blocks = []
    for i in range(depth):
        hf = f"vit.encoder.layer.{i}."
        block = {}
        for p in ("query", "key", "value"):
            block[f"{attention}/{p}/kernel"] = state[hf + f"attention.attention.{p}.weight"].T.reshape(width, heads, head_dim)
            block[f"{attention}/{p}/bias"] = state[hf + f"attention.attention.{p}.bias"].reshape(heads, head_dim)
        block[f"{attention}/out/kernel"] = state[hf + "attention.output.dense.weight"].T.reshape(heads, head_dim, width)
        block[f"{attention}/out/bias"] = state[hf + "attention.output.dense.bias"]
        block[f"{mlp}/Dense_0/kernel"] = state[hf + "intermediate.dense.weight"].T
        block[f"{mlp}/Dense_0/bias"] = state[hf + "intermediate.dense.bias"]
        block[f"{mlp}/Dense_1/kernel"] = state[hf + "output.dense.weight"].T
        block[f"{mlp}/Dense_1/bias"] = state[hf + "output.dense.bias"]
        for name, hf_name in ((ln1, "layernorm_before"), (ln2, "layernorm_after")):
            block[f"{name}/scale"] = state[hf + f"{hf_name}.weight"]
            block[f"{name}/bias"] = state[hf + f"{hf_name}.bias"]
        blocks.append(block)
    if naming == "big_vision_scanned":
        for key in blocks[0]:
            out[f"Transformer/encoderblock/{key}"] = np.stack([b[key] for b in blocks])
    else:
        for i, block in enumerate(blocks):
            out.update({f"Transformer/encoderblock_{i}/{k}": v for k, v in block.items()})
    return {prefix + k: v for k, v in out.items()}
