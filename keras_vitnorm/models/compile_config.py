"""A compile config saved so that the model loads and trains under any backend."""

import keras


def _public_optimizer_names(value):
    """`value` with each backend-specific Keras optimizer named by its `keras.optimizers` name."""
    if isinstance(value, list):
        return [_public_optimizer_names(item) for item in value]
    if not isinstance(value, dict):
        return value
    value = {key: _public_optimizer_names(item) for key, item in value.items()}
    module, name = value.get("module"), value.get("class_name")
    public = getattr(keras.optimizers, name, None) if isinstance(name, str) else None
    if (isinstance(module, str) and module.startswith("keras.src.backend.")
            and isinstance(public, type) and issubclass(public, keras.optimizers.Optimizer)):
        value.update(module="keras.optimizers", registered_name=None)
    return value


def _auto_jit_compile(model):
    """What `jit_compile="auto"` gives for `model` here (a private Keras method), or None."""
    resolve = getattr(model, "_resolve_auto_jit_compile", None)
    return resolve() if callable(resolve) else None


class PortableCompileConfig:
    """Saves a `keras.Model`'s compile config without the backend it was compiled under.

    The optimizer is named by its public class (Keras names PyTorch's subclass, which
    fails under another backend), and a `jit_compile` equal to what `"auto"` resolves
    to is saved as `"auto"`, so the loading backend resolves it again (docs/backends.md).
    A mixin, placed before `keras.Model` in the bases.
    """

    def get_compile_config(self):
        config = super().get_compile_config()
        if config is None:
            return None
        config = _public_optimizer_names(config)
        if config.get("jit_compile") == _auto_jit_compile(self):
            config["jit_compile"] = "auto"
        return config
