"""`keras_vitnorm.ops`: each op against its formula, each fast path against the plain
form (values and gradients), the switch, and the layers and model with the fast paths
on and off."""

import contextlib
import os
import subprocess
import sys

import keras
import numpy as np
import pytest

from keras_vitnorm import ViT
from keras_vitnorm import layers
from keras_vitnorm import ops as vitnorm_ops
from keras_vitnorm.backend import value_and_gradients
from keras_vitnorm.ops import switch

BACKEND = keras.backend.backend()
ROOT = os.path.join(os.path.dirname(__file__), os.pardir)


def _qkv(seed, dtype="float32", shape=(2, 7, 3, 6)):  # head_dim 6: a scale that is not a power of two
    rng = np.random.default_rng(seed)
    return [keras.ops.cast(rng.normal(0, 2, shape).astype("float32"), dtype) for _ in range(3)]


def _numpy(x):
    return keras.ops.convert_to_numpy(keras.ops.cast(x, "float32"))


def _on_and_off(name, function):
    """`function()` with the fast path `name` on, then off."""
    results = []
    for enabled in (True, False):
        with vitnorm_ops.fast_paths(enabled, [name]):
            results.append(function())
    return results


def _gradients(function, x, shape_in, loss=lambda y: keras.ops.sum(keras.ops.sin(y))):
    model = keras.Sequential([keras.Input(shape_in), keras.layers.Lambda(function)])
    return value_and_gradients(model, x, loss)


# --- the switch ---------------------------------------------------------------------


def test_switch_turns_named_fast_paths_off_and_restores_them():
    initial = {name: switch.fast_path_enabled(name) for name in switch.FAST_PATHS}
    with vitnorm_ops.fast_paths(True):
        with vitnorm_ops.fast_paths(False, ["split_qkv", "attention"]):
            assert not switch.fast_path_enabled("split_qkv") and not switch.fast_path_enabled("attention")
            assert switch.fast_path_enabled("linear")
            with vitnorm_ops.fast_paths(False):
                assert not any(switch.fast_path_enabled(name) for name in switch.FAST_PATHS)
            assert switch.fast_path_enabled("linear")
        assert all(switch.fast_path_enabled(name) for name in switch.FAST_PATHS)
    assert {name: switch.fast_path_enabled(name) for name in switch.FAST_PATHS} == initial
    with pytest.raises(ValueError, match="Unknown fast path 'gleu'.*linear, split_qkv"):
        vitnorm_ops.set_fast_paths(False, ["gleu"])
    with pytest.raises(ValueError, match="enabled must be True or False"):
        vitnorm_ops.set_fast_paths("no")


@pytest.mark.one_backend
def test_environment_variable_sets_the_switch_at_import():
    """Each value of KERAS_VITNORM_FAST_PATHS, read as the module is imported (one child
    process imports it, then reimports it under each value; no backend takes part)."""
    cases = {"0": [], "off": [], "": list(switch.FAST_PATHS), "1": list(switch.FAST_PATHS),
             "attention, linear": ["linear", "attention"],
             "linear,fast": "Unknown fast path 'fast' in KERAS_VITNORM_FAST_PATHS='linear,fast'"}
    code = f"""if True:
        import importlib, os
        os.environ[{switch.ENVIRONMENT_VARIABLE!r}] = {next(iter(cases))!r}
        from keras_vitnorm.ops import switch
        for value in {list(cases)!r}:
            os.environ[switch.ENVIRONMENT_VARIABLE] = value
            try:
                importlib.reload(switch)
            except ValueError as error:
                print(repr(str(error)))
                continue
            print([n for n in switch.FAST_PATHS if switch.fast_path_enabled(n)])
    """
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=300,
                          env={**os.environ, "KERAS_BACKEND": BACKEND})
    assert done.returncode == 0, done.stderr[-2000:]
    printed = done.stdout.strip().splitlines()[-len(cases):]
    for (value, expected), line in zip(cases.items(), printed):
        if isinstance(expected, list):
            assert line == str(expected), value
        else:
            assert expected in line, value


def test_layers_and_models_ask_no_backend_and_import_no_framework():
    package = os.path.join(ROOT, "keras_vitnorm")
    for folder in ("layers", "models"):
        for name in os.listdir(os.path.join(package, folder)):
            if name.endswith(".py"):
                with open(os.path.join(package, folder, name)) as f:
                    source = f.read()
                for forbidden in ("keras.backend.backend()", "import jax", "import torch", "import tensorflow",
                                  "from jax", "from torch", "from tensorflow"):
                    assert forbidden not in source, f"{folder}/{name}: {forbidden}"


def _package_imports():
    """`{package: set of packages it imports}` over keras_vitnorm's packages and top-level
    modules, counting every import statement (lazy ones inside functions too)."""
    import ast

    root = os.path.join(os.path.dirname(__file__), os.pardir, "keras_vitnorm")
    units = {name[:-3] if name.endswith(".py") else name for name in os.listdir(root)
             if (name.endswith(".py") and name != "__init__.py") or os.path.isdir(os.path.join(root, name, ""))
             and os.path.exists(os.path.join(root, name, "__init__.py"))}
    graph = {}
    for unit in units:
        path = os.path.join(root, unit)
        files = ([os.path.join(d, f) for d, _, fs in os.walk(path) for f in fs if f.endswith(".py")]
                 if os.path.isdir(path) else [path + ".py"])
        targets = set()
        for file in files:
            with open(file) as f:
                tree = ast.parse(f.read())
            for node in ast.walk(tree):
                names = []
                if isinstance(node, ast.Import):
                    names = [alias.name for alias in node.names]
                elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                    names = [node.module + "." + alias.name for alias in node.names]
                for name in names:
                    parts = name.split(".")
                    if parts[0] == "keras_vitnorm" and len(parts) > 1 and parts[1] in units and parts[1] != unit:
                        targets.add(parts[1])
        graph[unit] = targets
    return graph


def test_no_import_cycle_between_the_packages_and_convert_never_imports_models():
    graph = _package_imports()
    assert "models" not in graph["convert"]
    # Depth-first search for a cycle in the package graph.
    state = {}

    def visit(unit, path):
        state[unit] = "open"
        for target in sorted(graph[unit]):
            assert state.get(target) != "open", f"import cycle: {' -> '.join(path + [target])}"
            if target not in state:
                visit(target, path + [target])
        state[unit] = "done"

    for unit in sorted(graph):
        if unit not in state:
            visit(unit, [unit])


# --- linear ---------------------------------------------------------------------------


@pytest.mark.parametrize("use_bias", [True, False])
def test_linear_is_matmul_plus_bias_with_and_without_its_fast_path(use_bias):
    rng = np.random.default_rng(1)
    x = rng.normal(size=(2, 5, 16)).astype("float32")
    kernel = rng.normal(size=(16, 6)).astype("float32")
    bias = rng.normal(size=(6,)).astype("float32") if use_bias else None
    expected = x @ kernel + (bias if use_bias else 0)

    def run():
        return _gradients(lambda t: vitnorm_ops.linear(t, kernel, bias), x, (5, 16))

    (loss_on, dx_on, _), (loss_off, dx_off, _) = _on_and_off("linear", run)
    for name in ("linear", None):
        with vitnorm_ops.fast_paths(name is not None, None if name is None else [name]):
            np.testing.assert_allclose(_numpy(vitnorm_ops.linear(x, kernel, bias)), expected, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(loss_on, loss_off, rtol=1e-5)
    np.testing.assert_allclose(dx_on, dx_off, rtol=1e-5, atol=1e-5)


def _dense_pair(use_bias, activation, lora):
    """A keras Dense and a FusedDense with the same weights (and LoRA weights)."""
    pair = []
    for cls in (keras.layers.Dense, layers.FusedDense):
        keras.utils.set_random_seed(4)
        layer = cls(6, use_bias=use_bias, activation=activation, bias_initializer="random_normal")
        layer.build((None, 16))
        if lora:
            layer.enable_lora(2, b_initializer="random_normal")
        pair.append(layer)
    return pair


@pytest.mark.parametrize("shape", [(4, 16), (2, 5, 16)])
@pytest.mark.parametrize("use_bias,activation,lora", [(True, None, False), (False, "gelu", False), (True, None, True)])
def test_fused_dense_computes_what_keras_dense_computes(shape, use_bias, activation, lora):
    x = np.random.default_rng(3).normal(size=shape).astype("float32")
    results = []
    for layer in _dense_pair(use_bias, activation, lora):
        inputs = keras.Input(shape[1:])
        model = keras.Model(inputs, layer(inputs))
        results.append(value_and_gradients(model, x, lambda y: keras.ops.sum(keras.ops.sin(y))))
        results[-1] += (keras.ops.convert_to_numpy(model(x)),)
    (loss_a, dx_a, dw_a, y_a), (loss_b, dx_b, dw_b, y_b) = results
    np.testing.assert_allclose(y_b, y_a, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(dx_b, dx_a, rtol=1e-5, atol=1e-6)
    by_name = lambda grads: {path.split("/")[-1]: grad for path, grad in grads.items()}  # noqa: E731
    dw_a, dw_b = by_name(dw_a), by_name(dw_b)
    # LoRA freezes the kernel and trains its two low-rank factors instead.
    expected = ({"lora_kernel_a", "lora_kernel_b"} if lora else {"kernel"}) | ({"bias"} if use_bias else set())
    assert set(dw_a) == set(dw_b) == expected
    for name in expected:
        np.testing.assert_allclose(dw_b[name], dw_a[name], rtol=1e-5, atol=1e-6, err_msg=name)


@pytest.mark.parametrize("qkv_bias", [True, False])
@pytest.mark.parametrize("lora", [False, True])
def test_split_and_fused_qkv_projections_agree(monkeypatch, qkv_bias, lora):
    # The split form (TensorFlow's fast path) and the fused form, forced on this
    # backend, give the same output and gradients from the same weights.
    keras.utils.set_random_seed(5)
    layer = layers.MultiHeadSelfAttention(4, qkv_bias=qkv_bias, qk_norm="layernorm")
    inputs = keras.Input((9, 16))
    model = keras.Model(inputs, layer(inputs))
    if lora:
        layer.qkv.enable_lora(2, b_initializer="random_normal")
    if qkv_bias:  # a zero-initialized bias would hide a bias sliced in the wrong place
        layer.qkv.bias.assign(np.random.default_rng(1).normal(size=layer.qkv.bias.shape).astype("float32"))
    x = np.random.default_rng(2).normal(size=(3, 9, 16)).astype("float32")
    results, fast = {}, vitnorm_ops._fast
    for form in ("fused", "split"):
        with monkeypatch.context() as patch:  # the split form on this backend too
            patch.setattr(vitnorm_ops, "_fast", lambda name, *backends, split=form == "split": (
                split if name == "split_qkv" else fast(name, *backends)))
            results[form] = value_and_gradients(model, x, lambda y: keras.ops.sum(keras.ops.sin(y)))
    (loss_f, dx_f, dw_f), (loss_s, dx_s, dw_s) = results["fused"], results["split"]
    np.testing.assert_allclose(loss_s, loss_f, rtol=1e-5)
    np.testing.assert_allclose(dx_s, dx_f, rtol=1e-4, atol=1e-5)
    assert set(dw_s) == set(dw_f)
    for path in dw_f:  # float32 sums in another order: atol against gradients of order 1 to 10
        np.testing.assert_allclose(dw_s[path], dw_f[path], rtol=1e-4, atol=1e-5, err_msg=path)


def test_split_heads_gives_the_head_major_thirds_and_one_gradient_for_the_three():
    # (batch 2, tokens 5, [q | k | v] of 2 heads x 3 dims): each third, head by head.
    fused = np.arange(2 * 5 * 18, dtype="float32").reshape(2, 5, 18)
    q, k, v = vitnorm_ops.split_heads(keras.ops.convert_to_tensor(fused), 2)
    for index, part in enumerate((q, k, v)):
        expected = fused[..., 6 * index:6 * (index + 1)].reshape(2, 5, 2, 3)
        np.testing.assert_array_equal(_numpy(part), expected)
    if keras.backend.backend() == "torch":
        # One unstack: its gradient stacks the three. Three selections would each
        # build a zero tensor of the fused size, to be summed (aten::select_backward).
        import torch

        leaf = torch.tensor(fused, requires_grad=True)
        parts = vitnorm_ops.split_heads(leaf * 1.0, 2)
        assert {p.grad_fn.name() for p in parts} == {"UnbindBackward0"}
        with torch.profiler.profile() as profile:
            sum((p * (i + 1)).sum() for i, p in enumerate(parts)).backward()
        assert "aten::select_backward" not in {event.key for event in profile.key_averages()}
        np.testing.assert_array_equal(leaf.grad.numpy().reshape(2, 5, 3, 6)[:, :, 1], 2.0)


# --- attention ------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_heads_first_attention_matches_dot_product_attention(dtype):
    q, k, v = _qkv(11, dtype)
    ours = vitnorm_ops.heads_first_attention(q, k, v)
    assert tuple(ours.shape) == (2, 7, 3, 6)
    assert keras.backend.standardize_dtype(ours.dtype) == dtype
    # The reference: float32 attention of the same (for bfloat16, already rounded)
    # inputs. bfloat16 out may be off by its rounding of the probabilities and of the
    # output (8-bit mantissa: 2^-9 relative each); bfloat16 logits would add errors
    # of several hundredths (logits of order 10 here).
    exact = keras.ops.dot_product_attention(*(keras.ops.cast(t, "float32") for t in (q, k, v)))
    tolerance = 1e-5 if dtype == "float32" else 1e-2
    np.testing.assert_allclose(_numpy(ours), _numpy(exact), rtol=tolerance, atol=tolerance)


def test_attention_with_and_without_its_fast_path():
    x = np.concatenate([keras.ops.convert_to_numpy(t) for t in _qkv(12)], axis=-1)  # (2, 7, 3, 18)

    def attention(t):
        return vitnorm_ops.attention(t[..., :6], t[..., 6:12], t[..., 12:])

    def run():
        return _numpy(attention(x)), _gradients(attention, x, (7, 3, 18))[1]

    (y_on, dx_on), (y_off, dx_off) = _on_and_off("attention", run)
    expected = _numpy(keras.ops.dot_product_attention(*_qkv(12)))
    np.testing.assert_allclose(y_on, expected, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(y_off, expected, rtol=1e-5, atol=1e-6)
    assert np.abs(dx_on).max() > 1e-3  # the gradient reaches q, k and v
    np.testing.assert_allclose(dx_on, dx_off, rtol=1e-4, atol=1e-5)


def test_attention_logits_beyond_float16_range_stay_finite_with_fast_paths_on_and_off():
    """q and k of a few hundred over 8 dims give logits past 65504: every form sums them in float32."""
    rng = np.random.default_rng(0)
    q, k, v = (rng.normal(size=(2, 9, 4, 8)).astype("float32") * 300 for _ in range(3))
    expected = _numpy(vitnorm_ops.heads_first_attention(q, k, v))
    half = [keras.ops.cast(t, "float16") for t in (q, k, v)]
    results = [_numpy(vitnorm_ops.heads_first_attention(*half))]
    results += _on_and_off("attention", lambda: _numpy(vitnorm_ops.attention(*half)))
    for got in results:
        assert np.isfinite(got).all()
        np.testing.assert_allclose(got, expected, rtol=0.01, atol=0.5)


@pytest.mark.parametrize("num_tokens", [5, 6])
def test_plain_attention_asks_for_xla_attention_only_where_jax_cudnn_rejects_it(monkeypatch, num_tokens):
    # JAX's cuDNN flash attention rejects odd token counts wherever it is differentiated,
    # in inference mode too (as by the gradient-norm probes); there the plain form asks
    # for XLA's attention (False); everywhere else Keras chooses (None).
    seen = []
    original = keras.ops.dot_product_attention

    def recording(*args, **kwargs):
        seen.append(kwargs.get("flash_attention", "not passed"))
        return original(*args, **kwargs)

    monkeypatch.setattr(keras.ops, "dot_product_attention", recording)
    q, k, v = _qkv(3, shape=(2, num_tokens, 2, 8))
    with vitnorm_ops.fast_paths(False, ["attention"]):
        y = vitnorm_ops.attention(q, k, v)
    rejects = BACKEND == "jax" and num_tokens % 2 == 1
    assert seen == [False if rejects else None]
    np.testing.assert_allclose(_numpy(y), _numpy(original(q, k, v)), rtol=1e-6, atol=1e-6)


def test_attention_takes_this_backends_fast_form_on_a_cpu(monkeypatch):
    from keras_vitnorm import ops as module

    if BACKEND == "jax":
        import jax

        if jax.default_backend() != "cpu":
            pytest.skip("asserts the CPU choice; this host has an accelerator")
    calls = []
    target = (module, "heads_first_attention") if BACKEND in ("jax", "tensorflow") else (module._native(), "attention")
    original = getattr(*target)

    def spy(q, k, v):
        calls.append(tuple(q.shape))
        return original(q, k, v)

    monkeypatch.setattr(*target, spy)
    with vitnorm_ops.fast_paths(True, ["attention"]):
        layers.MultiHeadSelfAttention(num_heads=2)(np.ones((2, 5, 8), "float32"))
    assert calls == [(2, 5, 2, 4)]
    with vitnorm_ops.fast_paths(False, ["attention"]):
        layers.MultiHeadSelfAttention(num_heads=2)(np.ones((2, 5, 8), "float32"))
    assert len(calls) == 1


@pytest.mark.skipif(BACKEND != "jax", reason="JAX's padded cuDNN attention; this run's backend is another")
@pytest.mark.parametrize("num_tokens, training, padded",
                         [(5, True, True), (5, False, True), (6, True, False), (6, False, False)])
def test_jax_pads_for_cudnn_with_an_odd_token_count_in_either_mode(monkeypatch, num_tokens, training, padded):
    from keras_vitnorm import ops as module
    from keras_vitnorm.ops import _jax

    # As on a GPU where cuDNN's attention fits: not the CPU form, cuDNN available.
    monkeypatch.setattr(module, "_xla_or_graph_on_cpu", lambda: False)
    monkeypatch.setattr(_jax, "cudnn_attention_fits", lambda q, k, v: True)
    calls = []

    def spy(q, k, v):
        calls.append(tuple(q.shape))
        return keras.ops.dot_product_attention(q, k, v)

    monkeypatch.setattr(_jax, "padded_attention", spy)
    with vitnorm_ops.fast_paths(True, ["attention"]):
        layers.MultiHeadSelfAttention(num_heads=2)(np.ones((2, num_tokens, 8), "float32"), training=training)
    assert calls == ([(2, num_tokens, 2, 4)] if padded else [])


@pytest.mark.skipif(BACKEND != "jax", reason="JAX's padded cuDNN attention; this run's backend is another")
def test_jax_cudnn_attention_does_not_fit_cpu_arrays():
    import jax

    from keras_vitnorm.ops import _jax

    if jax.default_backend() != "cpu":
        pytest.skip("asserts the CPU answer; this host has an accelerator")
    assert _jax.cudnn_attention_fits(*_qkv(5, "bfloat16", shape=(2, 7, 2, 8))) is False


@pytest.mark.skipif(BACKEND != "jax", reason="JAX's padded cuDNN attention; this run's backend is another")
@pytest.mark.parametrize("num_tokens, dtype", [(13, "float32"), (16, "float32"), (13, "bfloat16")])
def test_jax_padded_attention_matches_unpadded_attention(num_tokens, dtype):
    import jax
    import jax.numpy as jnp

    from keras_vitnorm.ops import _jax

    q, k, v = _qkv(7, dtype, shape=(2, num_tokens, 3, 8))
    # cuDNN needs a GPU; XLA's attention takes the same padding and length arguments.
    ours = _jax.padded_attention(q, k, v, implementation="xla")
    theirs = keras.ops.dot_product_attention(q, k, v)
    assert ours.shape == (2, num_tokens, 3, 8) and ours.dtype == theirs.dtype
    tolerance = 1e-5 if dtype == "float32" else 2e-2
    np.testing.assert_allclose(np.asarray(ours, "float32"), np.asarray(theirs, "float32"),
                               rtol=tolerance, atol=tolerance)
    weights = jnp.asarray(np.random.default_rng(8).normal(size=ours.shape), "float32")

    def loss(function):
        return lambda *qkv: jnp.sum(function(*qkv).astype("float32") * weights)

    padded = jax.grad(loss(lambda *t: _jax.padded_attention(*t, implementation="xla")), argnums=(0, 1, 2))
    plain = jax.grad(loss(keras.ops.dot_product_attention), argnums=(0, 1, 2))
    for ours, theirs in zip(padded(q, k, v), plain(q, k, v)):
        assert float(jnp.max(jnp.abs(theirs.astype("float32")))) > 1e-2
        np.testing.assert_allclose(np.asarray(ours, "float32"), np.asarray(theirs, "float32"),
                                   rtol=tolerance, atol=tolerance)


@pytest.mark.skipif(BACKEND != "jax", reason="JAX's padded cuDNN attention; this run's backend is another")
def test_jax_padded_attention_falls_back_to_xla_where_jax_rejects_cudnn(monkeypatch):
    import jax

    from keras_vitnorm.ops import _jax

    original, asked = jax.nn.dot_product_attention, []

    def cudnn_rejects(*args, implementation=None, **kwargs):
        asked.append(implementation)
        if implementation == "cudnn":  # as JAX does where cuDNN does not take the inputs
            raise NotImplementedError("Unsupported sequence length")
        return original(*args, implementation=implementation, **kwargs)

    monkeypatch.setattr(jax.nn, "dot_product_attention", cudnn_rejects)
    q, k, v = _qkv(9, shape=(2, 13, 3, 8))
    ours = _jax.padded_attention(q, k, v)
    assert asked == ["cudnn", "xla"]
    np.testing.assert_allclose(np.asarray(ours), np.asarray(original(q, k, v, implementation="xla")),
                               rtol=1e-6, atol=1e-6)


@pytest.mark.skipif(BACKEND != "torch", reason="PyTorch's attention; this run's backend is another")
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_torch_attention_on_views_matches_dot_product_attention(dtype):
    from keras_vitnorm.ops import _torch

    q, k, v = _qkv(13, dtype)
    ours = _torch.attention(q, k, v)
    theirs = keras.ops.dot_product_attention(q, k, v)
    assert tuple(ours.shape) == (2, 7, 3, 6) and ours.dtype == theirs.dtype
    tolerance = 1e-6 if dtype == "float32" else 1e-2
    np.testing.assert_allclose(_numpy(ours), _numpy(theirs), rtol=tolerance, atol=tolerance)


# --- the residual fence ---------------------------------------------------------------


@pytest.mark.parametrize("enabled", [True, False])
def test_residual_fence_is_the_identity_in_value_and_gradient(enabled):
    x = np.random.default_rng(4).normal(size=(2, 5, 8)).astype("float32")
    with vitnorm_ops.fast_paths(enabled, ["residual_fence"]):
        y = _numpy(vitnorm_ops.residual_fence(keras.ops.convert_to_tensor(x)))
        _, dx, _ = _gradients(lambda t: vitnorm_ops.residual_fence(t * t), x, (5, 8))
    np.testing.assert_array_equal(y, x)
    np.testing.assert_allclose(dx, 2 * x * np.cos(x * x), rtol=1e-5, atol=1e-6)


# --- the whole model ------------------------------------------------------------------


@pytest.mark.parametrize("overrides", [
    {},
    {"norm": "rmsnorm", "stem": "dual_patchnorm", "qk_norm": True},
    {"block_style": "normformer", "norm": "dyt"},
    {"block_style": "deepnorm", "layer_scale": 0.1},
    {"block_style": "sub_ln", "pooling": "gap", "stem": "conv"},
])
def test_model_values_and_gradients_are_the_same_with_fast_paths_on_and_off(overrides):
    config = {"image_size": 16, "patch_size": 4, "width": 32, "depth": 2, "num_heads": 4, "mlp_dim": 64,
              "num_classes": 5, **overrides}
    images = np.random.default_rng(0).uniform(size=(2, 16, 16, 3)).astype("float32")

    def run():
        keras.utils.set_random_seed(1)
        model = ViT(**config)
        head = model.get_layer("head")
        head.kernel.assign(np.random.default_rng(2).normal(size=head.kernel.shape).astype("float32"))
        logits = _numpy(model(images))
        return logits, value_and_gradients(model, images, lambda y: keras.ops.sum(keras.ops.sin(y)))

    (logits_on, (loss_on, dx_on, dw_on)), (logits_off, (loss_off, dx_off, dw_off)) = [
        _on_and_off_all(run, enabled) for enabled in (True, False)]
    np.testing.assert_allclose(logits_on, logits_off, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(loss_on, loss_off, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(dx_on, dx_off, rtol=1e-3, atol=1e-5)
    assert set(dw_on) == set(dw_off)
    for path in dw_on:
        # Relative to the whole gradient: a weight gradient sums over the batch and the
        # tokens, and another order of those float32 sums (oneDNN's kernels differ by
        # processor) moves a near-zero entry by more than any per-entry tolerance.
        error = np.linalg.norm(dw_on[path] - dw_off[path])
        assert error <= 1e-4 * np.linalg.norm(dw_off[path]) + 1e-7, (path, error)


def _on_and_off_all(function, enabled):
    with vitnorm_ops.fast_paths(enabled):
        return function()


# --- LayerNorm --------------------------------------------------------------------------


def _float32_loss(y):  # a bfloat16 loss would not convert to NumPy on TensorFlow
    return keras.ops.sum(keras.ops.sin(keras.ops.cast(y, "float32")))


@pytest.mark.parametrize("policy", ["float32", "mixed_bfloat16", "mixed_float16", "bfloat16"])
@pytest.mark.parametrize("learnable", [True, False])
def test_layer_norm_is_keras_layer_normalization(policy, learnable):
    """`layers.LayerNormalization` gives what `keras.layers.LayerNormalization` with the same
    weights gives, outputs and gradients bit for bit and in the same dtype, under each
    precision (bfloat16 variables included), on inputs in the compute dtype as a model's
    layers hand them over; and matches the formula in float64."""
    rng = np.random.default_rng(0)
    x = (rng.normal(size=(3, 5, 16)) * 4 + 2).astype("float32")
    gamma, beta = rng.normal(1, 0.5, 16).astype("float32"), rng.normal(0, 0.5, 16).astype("float32")
    compute_dtype = keras.DTypePolicy(policy).compute_dtype

    def model(layer):
        net = keras.Sequential([keras.Input((5, 16)),
                                keras.layers.Lambda(lambda t: keras.ops.cast(t, compute_dtype)), layer])
        if learnable:
            layer.gamma.assign(gamma)
            layer.beta.assign(beta)
        return net

    arguments = {"epsilon": 1e-6, "center": learnable, "scale": learnable, "dtype": policy}
    keras_model = model(keras.layers.LayerNormalization(**arguments))
    expected = keras_model(x)
    expected_grads = value_and_gradients(keras_model, x, _float32_loss)

    def run():
        net = model(layers.LayerNormalization(**arguments))
        return net(x), value_and_gradients(net, x, _float32_loss)

    for y, (loss, dx, dw) in [run()]:
        assert keras.backend.standardize_dtype(y.dtype) == keras.backend.standardize_dtype(expected.dtype)
        np.testing.assert_array_equal(_numpy(y), _numpy(expected))
        np.testing.assert_array_equal(loss, expected_grads[0])
        np.testing.assert_array_equal(dx, expected_grads[1])
        by_name = {path.split("/")[-1]: gradient for path, gradient in dw.items()}
        expected_by_name = {path.split("/")[-1]: gradient for path, gradient in expected_grads[2].items()}
        assert set(by_name) == set(expected_by_name) == ({"gamma", "beta"} if learnable else set())
        for name in by_name:
            np.testing.assert_array_equal(by_name[name], expected_by_name[name], err_msg=name)
    # epsilon=None is Keras' epsilon, as keras.ops takes it.
    np.testing.assert_array_equal(
        _numpy(vitnorm_ops.layer_norm(x, epsilon=None)),
        _numpy(keras.ops.layer_normalization(x, axis=-1, epsilon=keras.config.epsilon())))
    x64 = x.astype("float64")
    normalized = (x64 - x64.mean(-1, keepdims=True)) / np.sqrt(x64.var(-1, keepdims=True) + 1e-6)
    formula = normalized * gamma + beta if learnable else normalized
    tolerance = 1e-5 if policy == "float32" else 5e-2
    np.testing.assert_allclose(_numpy(expected), formula, rtol=tolerance, atol=tolerance)


@pytest.mark.filterwarnings("ignore:You passed `rms_scaling=True`")
def test_layer_norm_over_another_axis_or_with_rms_scaling_is_keras_own_call():
    """`layers.LayerNormalization` writes only the last axis' normalization; another axis and
    `rms_scaling` take Keras' call, and give what Keras' layer gives."""
    x = np.random.default_rng(0).normal(size=(3, 5, 16)).astype("float32")
    for arguments in ({"axis": [1, 2]}, {"rms_scaling": True}):
        ours, theirs = layers.LayerNormalization(**arguments), keras.layers.LayerNormalization(**arguments)
        np.testing.assert_array_equal(_numpy(ours(x)), _numpy(theirs(x)))


def _standardized(kernel, epsilon=1e-10):
    """NumPy float64: each output unit (last axis) over its fan-in, at variance 1/fan_in."""
    w = kernel.astype("float64").reshape(-1, kernel.shape[-1])
    w = (w - w.mean(0)) / np.sqrt(w.var(0) + epsilon) / np.sqrt(w.shape[0])
    return w.reshape(kernel.shape)


@pytest.mark.parametrize("shape", [(16, 6), (3, 3, 4, 5)])
def test_standardize_kernel_matches_numpy(shape):
    kernel = np.random.default_rng(0).normal(0.3, 2.0, shape).astype("float32")
    ours = _numpy(vitnorm_ops.standardize_kernel(kernel))
    np.testing.assert_allclose(ours, _standardized(kernel), rtol=1e-5, atol=1e-6)
    fan_in = np.prod(shape[:-1])
    np.testing.assert_allclose(ours.reshape(-1, shape[-1]).var(0) * fan_in, 1.0, rtol=1e-4)
    bf16 = vitnorm_ops.standardize_kernel(keras.ops.cast(kernel, "bfloat16"))
    assert keras.backend.standardize_dtype(bf16.dtype) == "bfloat16"


def test_weight_standardized_dense_and_conv_compute_with_the_standardized_kernel():
    rng = np.random.default_rng(1)
    x = rng.normal(size=(2, 5, 16)).astype("float32")
    dense = layers.FusedDense(6, weight_standardization=True, bias_initializer="random_normal")
    y = _numpy(dense(x))
    kernel, bias = (keras.ops.convert_to_numpy(w) for w in (dense.kernel, dense.bias))
    np.testing.assert_allclose(y, x @ _standardized(kernel) + bias, rtol=1e-5, atol=1e-5)
    images = rng.normal(size=(2, 8, 8, 3)).astype("float32")
    conv = layers.StandardizedConv2D(4, 3, use_bias=False)
    plain = keras.layers.Conv2D(4, 3, use_bias=False)
    plain.build(images.shape)
    conv.build(images.shape)
    plain.kernel.assign(_standardized(keras.ops.convert_to_numpy(conv.kernel)).astype("float32"))
    np.testing.assert_allclose(_numpy(conv(images)), _numpy(plain(images)), rtol=1e-5, atol=1e-5)
    # The stored kernel stays the raw one; the config round trip keeps the option.
    assert not np.allclose(keras.ops.convert_to_numpy(dense.kernel), _standardized(kernel))
    assert layers.FusedDense.from_config(dense.get_config()).weight_standardization is True
    assert layers.StandardizedConv2D.from_config(conv.get_config()).weight_standardization is True
    with pytest.raises(ValueError, match="weight_standardization must be True or False, got 1"):
        layers.FusedDense(4, weight_standardization=1)


def test_weight_standardized_vit_trains_round_trips_and_refuses_what_it_cannot_do(tmp_path):
    config = {"image_size": 16, "patch_size": 4, "width": 32, "depth": 2, "num_heads": 4, "mlp_dim": 64,
              "num_classes": 3}
    model = ViT(**config, weight_standardization=True)
    plain = ViT(**config)
    assert model.count_params() == plain.count_params()
    standardized = [layer.name for layer in _sublayers(model) if getattr(layer, "weight_standardization", False)]
    assert {"projection", "qkv", "out", "fc1", "fc2"} <= set(standardized) and "head" not in standardized
    assert len([n for n in standardized if n == "qkv"]) == 2
    rng = np.random.default_rng(0)
    images = rng.uniform(-1, 1, (32, 16, 16, 3)).astype("float32")
    labels = rng.integers(0, 3, 32)
    model.compile(optimizer=keras.optimizers.Adam(3e-3),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    losses = model.fit(images, labels, epochs=8, batch_size=32, verbose=0).history["loss"]
    assert losses[-1] < losses[0]
    model.save_to_preset(str(tmp_path / "ws"))
    reloaded = ViT.from_preset(str(tmp_path / "ws"))
    assert reloaded.weight_standardization is True
    np.testing.assert_allclose(_numpy(reloaded(images[:2])), _numpy(model(images[:2])), rtol=1e-5, atol=1e-5)
    conv = ViT(**{**config, "stem": "conv"}, weight_standardization=True)
    assert all(layer.weight_standardization for layer in _sublayers(conv) if isinstance(layer, keras.layers.Conv2D))
    with pytest.raises(ValueError, match="cannot be combined with block_style='deepnorm'"):
        ViT(**config, block_style="deepnorm", weight_standardization=True)
    qkv = model.get_layer("block_0").attention.qkv
    with pytest.raises(ValueError, match="qkv: a weight-standardized layer cannot be quantized"):
        qkv.quantize("int8")


def _sublayers(model):
    found, stack = [], list(model.layers)
    while stack:
        layer = stack.pop()
        found.append(layer)
        stack.extend(getattr(layer, "_layers", []))
    return found
