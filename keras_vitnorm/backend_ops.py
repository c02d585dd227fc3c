"""Reading PyTorch checkpoint files under any Keras backend."""


def read_torch_tensors(path, safetensors_file=False):
    """`{key: float32 NumPy array}` of a PyTorch checkpoint file, under any Keras backend.

    Used by the checkpoint converters for `.pth`/`.bin` files (`torch.load` with
    `weights_only=True`, so no code from the file runs) and for `.safetensors` files
    in bfloat16, which NumPy cannot hold. A dict that wraps the weights under
    `state_dict`, `model` or `module` is unwrapped.
    """
    try:
        import torch
    except ImportError:
        raise ValueError(
            f"Reading {path!r} needs PyTorch (pip install torch); a float32 .safetensors copy "
            "of the checkpoint loads without it."
        ) from None
    if safetensors_file:
        from safetensors.torch import load_file

        state = load_file(path)
    else:
        state = torch.load(path, map_location="cpu", weights_only=True)
        for wrapper in ("state_dict", "model", "module"):
            if isinstance(state, dict) and isinstance(state.get(wrapper), dict):
                state = state[wrapper]
    if not isinstance(state, dict):
        raise ValueError(f"{path!r} does not hold a state dict (found {type(state).__name__}).")
    return {k: v.float().numpy() for k, v in state.items() if isinstance(v, torch.Tensor)}
