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
    """What `jit_compile="auto"` gives for `model` here, or None where Keras does not say.

    Keras resolves it in a private method of its trainer; without that method the saved
    value is left as it is.
    """
    resolve = getattr(model, "_resolve_auto_jit_compile", None)
    return resolve() if callable(resolve) else None


class PortableCompileConfig:
    """Saves a `keras.Model`'s compile config without the backend it was compiled under.

    Keras' own config keeps two things of that backend. Under PyTorch, Keras' optimizers
    are PyTorch subclasses and the config names their module
    (`keras.src.backend.torch.optimizers.torch_adamw`): the file reloads under JAX or
    TensorFlow with a PyTorch optimizer, whose first step fails. Here the config names
    the public class (`keras.optimizers.AdamW`), which builds each backend's own. And
    `jit_compile` is saved resolved (`"auto"` becomes `True` under JAX, `False` under
    TensorFlow on a CPU and under PyTorch): the file reloads under PyTorch with
    `torch.compile` and under JAX without XLA. Here a value that is what `"auto"` gives
    under the saving backend is saved as `"auto"`, so that the loading backend resolves
    it again; `compile` itself cannot record the argument as given, since Keras does
    not compile a loaded model whose class overrides `compile`. docs/backends.md shows
    both with Keras alone.

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
