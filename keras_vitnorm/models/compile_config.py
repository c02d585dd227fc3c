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


class PortableCompileConfig:
    """Saves a `keras.Model`'s compile config without the backend it was compiled under.

    A mixin before `keras.Model`: the optimizer is named by its public class (not PyTorch's
    subclass), and a `jit_compile` that `"auto"` resolves to here is saved as `"auto"`, for
    the loading backend to resolve again (docs/backends.md).
    """

    def get_compile_config(self):
        config = super().get_compile_config()
        if config is None:
            return None
        config = _public_optimizer_names(config)
        resolve = getattr(self, "_resolve_auto_jit_compile", None)  # private in Keras
        if config.get("jit_compile") == (resolve() if callable(resolve) else None):
            config["jit_compile"] = "auto"
        return config
