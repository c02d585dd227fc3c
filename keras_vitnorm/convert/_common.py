"""What every converter shares: reading tensor files, the `Checkpoint` record, and checks
whose errors name the key in the user's file."""

import dataclasses
import os

import numpy as np

from keras_vitnorm import durable

# Width -> heads of the standard ViT sizes, for state dicts without a head count (timm).
STANDARD_HEADS = {192: 3, 384: 6, 768: 12, 1024: 16, 1280: 16}
#: The variable path of the position embedding, which a new image size resamples.
POSITION_EMBEDDING = "stem/position_embedding"


@dataclasses.dataclass
class Checkpoint:
    """A source checkpoint mapped onto the plain ViT layout.

    Attributes:
        format: `"huggingface"`, `"big_vision"`, `"timm"` or `"keras_hub"`.
        source: where it was read from (a path or a description).
        config: dict of `ViT` constructor arguments the checkpoint describes.
        arrays: `{variable path: float32 array}` in this project's layout.
        source_keys: `{variable path: source key(s)}` the array was made from.
        ignored: source keys left out (e.g. a `ViTModel` pooler), with the reason.
    """

    format: str
    source: str
    config: dict
    arrays: dict
    source_keys: dict
    ignored: list = dataclasses.field(default_factory=list)


class KeyReader:
    """Reads named tensors from `{key: array}` (errors name the format, key and expected shape)
    and `put`s them onto `arrays` (`{variable path: array}`) and `keys` (their source keys)."""

    def __init__(self, tensors, format_name, prefix=""):
        self.tensors = tensors
        self.format_name = format_name
        self.prefix = prefix
        self.used = set()
        self.arrays, self.keys = {}, {}

    def has(self, key):
        return self.prefix + key in self.tensors

    def get(self, key, shape=None):
        full = self.prefix + key
        if full not in self.tensors:
            raise ValueError(
                f"The {self.format_name} checkpoint has no key {full!r}, which a ViT in "
                f"this layout needs. Keys found start with: {first_keys(self.tensors)}.")
        array = np.asarray(self.tensors[full], dtype="float32")
        if shape is not None and tuple(array.shape) != tuple(shape):
            raise ValueError(
                f"Key {full!r} of the {self.format_name} checkpoint has shape "
                f"{tuple(array.shape)}; a ViT with the config read from this checkpoint "
                f"expects {tuple(shape)}. The checkpoint is inconsistent or not a "
                "standard ViT.")
        self.used.add(full)
        return array

    def put(self, path, key, shape=None, transform=None):
        """Maps the tensor `key` (or those of a list of keys, joined on the last axis), each
        `transform`ed, onto the variable `path`."""
        names = key if isinstance(key, list) else [key]
        parts = [self.get(name, shape) for name in names]
        if transform is not None:
            parts = [transform(part) for part in parts]
        self.arrays[path] = parts[0] if len(parts) == 1 else np.concatenate(parts, axis=-1)
        self.keys[path] = ", ".join(self.prefix + name for name in names)

    def unused(self):
        return sorted(key for key in self.tensors if key not in self.used)


def to_numpy(value):
    """A NumPy array from an array or a torch tensor (bfloat16 too), without importing torch."""
    if hasattr(value, "detach"):
        return value.detach().float().cpu().numpy()
    return np.asarray(value)


def first_keys(tensors, count=4):
    """The first `count` keys (sorted) with their shapes, for error messages."""
    keys = sorted(tensors)
    shown = ", ".join(f"{k!r} {tuple(np.shape(tensors[k]))}" for k in keys[:count])
    return shown + (f" ... ({len(keys)} keys)" if len(keys) > count else "")


def check_all_used(leftover, source, model="a plain ViT"):
    """Raises a `ValueError` naming the first of the `leftover` source keys, if any."""
    if leftover:
        more = f" (and {len(leftover) - 1} more keys)" if len(leftover) > 1 else ""
        raise ValueError(f"Key {leftover[0]!r} of {source} has no counterpart in {model}{more}.")


def torch_conv_to_dense(weight):
    """PyTorch `Conv2d` weight `(D, C, P, P)` -> this project's `(P*P*C, D)` kernel."""
    out_dim = weight.shape[0]
    return np.transpose(weight, (2, 3, 1, 0)).reshape(-1, out_dim)


def grid_from_position_embedding(num_positions, num_prefix, key):
    """Square grid side of a position embedding with `num_positions` rows."""
    side = int(round((num_positions - num_prefix) ** 0.5))
    if side * side != num_positions - num_prefix or side < 1:
        raise ValueError(
            f"Key {key!r} has {num_positions} positions, which is not {num_prefix} prefix "
            "token(s) plus a square grid; only square grids are supported.")
    return side


def vit_config(*, image_size, patch_size, channels, width, depth, heads, mlp_dim, classes,
               epsilon, qkv_bias, class_token):
    """The `ViT` constructor arguments of a plain checkpoint."""
    return {"image_size": image_size, "patch_size": patch_size, "num_channels": channels,
            "width": width, "depth": depth, "num_heads": heads, "mlp_dim": mlp_dim,
            "num_classes": classes, "norm_epsilon": float(epsilon), "qkv_bias": bool(qkv_bias),
            "pooling": "cls" if class_token else "gap"}


def heads_for_width(width, num_heads, format_name):
    if num_heads is not None:
        return num_heads
    if width not in STANDARD_HEADS:
        raise ValueError(
            f"The {format_name} checkpoint does not record its head count and width={width} "
            f"is not a standard ViT width ({', '.join(map(str, STANDARD_HEADS))}). Pass "
            "num_heads=<int>.")
    return STANDARD_HEADS[width]


def read_json(path):
    """The JSON object in `path`; a `ValueError` naming the file if it is missing or not one."""
    if not os.path.isfile(path):
        raise ValueError(f"{path} does not exist or is not a file.")
    value = durable.read_json(path)
    if not isinstance(value, dict):
        raise ValueError(f"{path} holds a JSON {type(value).__name__}, not an object.")
    return value


def read_npz(path):
    """`{key: array}` of a NumPy archive; a `ValueError` naming the file if it is damaged."""
    try:
        with np.load(path, allow_pickle=False) as archive:
            return {key: archive[key] for key in archive.files}
    except Exception as error:  # BadZipFile, EOFError, zlib.error, ValueError, OSError
        raise ValueError(
            f"{path} is not a readable NumPy archive ({type(error).__name__}: {error}); the "
            "file may be truncated or corrupt."
        ) from error


def read_tensor_file(path):
    """`{key: np.ndarray}` of a `.safetensors`, `.pth`/`.pt`/`.bin` or `.npz` file."""
    path = os.fspath(path)
    extension = os.path.splitext(path)[1].lower()
    if extension == ".npz":
        return read_npz(path)
    if extension in (".safetensors", ".pth", ".pt", ".bin"):
        try:
            if extension != ".safetensors":
                return read_torch_tensors(path)
            from safetensors.numpy import load_file

            try:
                return load_file(path)
            except TypeError:  # bfloat16 tensors, which NumPy cannot hold
                return read_torch_tensors(path, safetensors_file=True)
        except ImportError:
            raise
        except Exception as error:  # safetensors' and torch's own error types
            raise ValueError(
                f"{path} is not a readable {extension} checkpoint ({type(error).__name__}: "
                f"{error}); the file may be truncated or corrupt."
            ) from error
    raise ValueError(
        f"Unsupported checkpoint file {path!r}: expected .safetensors, .pth, .pt, .bin or "
        ".npz (or a directory: a Hugging Face model, a keras-hub preset or a keras_vitnorm "
        "preset).")


def read_torch_tensors(path, safetensors_file=False):
    """`{key: float32 NumPy array}` of a PyTorch file (`weights_only`: no code runs) or a
    bfloat16 `.safetensors`; a `state_dict`/`model`/`module` wrapper is unwrapped."""
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
