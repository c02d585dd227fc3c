"""Hub handles: checkpoints named by where they are published, fetched into the hub's cache.

`hf://`, `hf-hub:` and `kaggle://` handles stand in for a local path (docs/checkpoints.md).
The hub library downloads, so its cache, authentication and offline mode apply.
"""

#: The prefixes of a hub handle.
PREFIXES = ("hf://", "hf-hub:", "kaggle://")

#: Files of a Hugging Face repository that a ViT checkpoint is made of (not the
#: TensorFlow, Flax or ONNX copies).
HF_FILES = ("*.json", "*.safetensors", "pytorch_model.bin", "model.weights.h5", "*.npz")

HANDLE_FORMS = (
    "hf://<owner>/<repo>[@<revision>], hf-hub:<owner>/<repo> or "
    "kaggle://<owner>/<model>/<framework>/<variation>/<version>")


def is_handle(name):
    """Whether `name` is a hub handle rather than a preset name or a local path."""
    return isinstance(name, str) and name.startswith(PREFIXES)


def resolve(handle):
    """The local path of what `handle` names, downloaded into the hub's cache if needed.

    Raises a `ValueError` for a malformed handle, an `ImportError` naming the package
    to install, and an `OSError` naming the handle when the hub cannot provide it
    (unknown repository, no network and not cached, ...).
    """
    if handle.startswith("kaggle://"):
        return _kaggle(handle)
    repo = handle[len("hf://"):] if handle.startswith("hf://") else handle[len("hf-hub:"):]
    return _huggingface(repo, handle)


def _huggingface(repo, handle):
    repo_id, _, revision = repo.partition("@")
    parts = repo_id.split("/")
    if len(parts) != 2 or not all(parts) or (revision == "" and "@" in repo):
        raise ValueError(f"Hub handle {handle!r} is malformed; expected {HANDLE_FORMS}.")
    try:
        from huggingface_hub import snapshot_download
    except ImportError as error:
        raise ImportError(
            f"{handle!r} needs huggingface_hub: pip install huggingface_hub "
            "(or keras-vitnorm[hub])."
        ) from error
    try:
        return snapshot_download(repo_id, revision=revision or None, allow_patterns=list(HF_FILES))
    except Exception as error:  # the hub library's own errors (network, not found, offline)
        raise OSError(f"Could not get {handle!r} from the Hugging Face Hub: {error}") from error


def _kaggle(handle):
    parts = handle[len("kaggle://"):].split("/")
    if len(parts) not in (4, 5) or not all(parts):
        raise ValueError(f"Hub handle {handle!r} is malformed; expected {HANDLE_FORMS}.")
    try:
        import kagglehub
    except ImportError as error:
        raise ImportError(
            f"{handle!r} needs kagglehub: pip install kagglehub (or keras-vitnorm[hub])."
        ) from error
    try:
        return kagglehub.model_download("/".join(parts))
    except Exception as error:  # the hub library's own errors (network, not found, credentials)
        raise OSError(f"Could not get {handle!r} from Kaggle Models: {error}") from error
