"""Hub handles (`hf://`, `hf-hub:`, `kaggle://`): checkpoints named by where they are
published, in place of a local path, fetched by the hub's library (docs/checkpoints.md)."""

import importlib

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
    """The local path of what `handle` names, downloaded into the hub's cache if needed;
    raises `ValueError` (malformed handle), `ImportError` (the hub package is missing) or
    `OSError` (the hub cannot provide it: unknown repository, offline and not cached, ...)."""
    if handle.startswith("kaggle://"):
        parts = handle[len("kaggle://"):].split("/")
        if len(parts) not in (4, 5) or not all(parts):
            raise ValueError(f"Hub handle {handle!r} is malformed; expected {HANDLE_FORMS}.")
        return _download(handle, "kagglehub", "Kaggle Models",
                         lambda kagglehub: kagglehub.model_download("/".join(parts)))
    repo = handle[len("hf://"):] if handle.startswith("hf://") else handle[len("hf-hub:"):]
    repo_id, _, revision = repo.partition("@")
    parts = repo_id.split("/")
    if len(parts) != 2 or not all(parts) or (revision == "" and "@" in repo):
        raise ValueError(f"Hub handle {handle!r} is malformed; expected {HANDLE_FORMS}.")
    return _download(handle, "huggingface_hub", "the Hugging Face Hub",
                     lambda hub: hub.snapshot_download(repo_id, revision=revision or None,
                                                       allow_patterns=list(HF_FILES)))


def _download(handle, package, hub, download):
    """`download(module)` with the hub's `package` imported; its failures name `handle`."""
    try:
        module = importlib.import_module(package)
    except ImportError as error:
        raise ImportError(f"{handle!r} needs {package}: pip install {package} "
                          "(or keras-vitnorm[hub]).") from error
    try:
        return download(module)
    except Exception as error:  # the hub library's own (network, not found, offline, credentials)
        raise OSError(f"Could not get {handle!r} from {hub}: {error}") from error
