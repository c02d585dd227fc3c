"""Which backend the library runs on is asked in two places only: `keras_vitnorm.ops`
and `keras_vitnorm.backend`. Read from the source (no backend is imported), so it runs
once."""

import ast
import pathlib

import pytest

PACKAGE = pathlib.Path(__file__).resolve().parent.parent / "keras_vitnorm"
FRAMEWORKS = ("jax", "jaxlib", "tensorflow", "torch")
#: Modules that may import a framework outside ops/ and backend/, and which: data
#: formats, not backend dispatch.
DATA_FORMATS = {
    "training/data/tf_pipeline.py": {"tensorflow"},  # the tf.data input pipeline
    "convert/_common.py": {"torch"},  # reads PyTorch's .pth files
}

pytestmark = pytest.mark.one_backend


def framework_imports(tree):
    """`[(line, framework)]` of every import of a framework in `tree`."""
    found = []
    for node in ast.walk(tree):
        names = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            names = [node.module]
        for name in names:
            parts = name.split(".")
            framework = next((part for part in parts if part in FRAMEWORKS), None)
            if framework and (parts[0] in FRAMEWORKS or parts[0] == "safetensors"):
                found.append((node.lineno, framework))
    return found


def backend_calls(tree):
    """Lines of every `keras.backend.backend()` call in `tree`."""
    return [node.lineno for node in ast.walk(tree)
            if isinstance(node, ast.Call) and ast.unparse(node.func) == "keras.backend.backend"]


def library_files():
    for path in sorted(PACKAGE.rglob("*.py")):
        relative = path.relative_to(PACKAGE).as_posix()
        if not relative.startswith(("ops/", "backend/")):
            yield relative, ast.parse(path.read_text(), filename=str(path))


def test_no_module_outside_ops_and_backend_asks_for_the_backend():
    found = [f"{path}:{line}" for path, tree in library_files() for line in backend_calls(tree)]
    assert found == []


def test_frameworks_are_imported_by_ops_backend_and_the_data_formats_only():
    found = [f"{path}:{line} imports {framework}" for path, tree in library_files()
             for line, framework in framework_imports(tree)
             if framework not in DATA_FORMATS.get(path, ())]
    assert found == []


def test_the_scan_sees_what_it_looks_for():
    tree = ast.parse("import keras\nimport torch.distributed as dist\n"
                     "from jax.experimental import multihost_utils\n"
                     "from safetensors.torch import load_file\nimport tensorflow_datasets\n"
                     "def f():\n    return keras.backend.backend()\n")
    assert framework_imports(tree) == [(2, "torch"), (3, "jax"), (4, "torch")]
    assert backend_calls(tree) == [7]


def test_every_backend_module_has_every_function_the_switch_dispatches_to():
    switch = ast.parse((PACKAGE / "backend/__init__.py").read_text())
    dispatched = {node.attr for node in ast.walk(switch)
                  if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Call)
                  and ast.unparse(node.value.func) == "_native"}
    assert {"value_and_gradients", "distribution_scope", "from_first_process"} <= dispatched
    for name in ("_jax", "_tensorflow", "_torch"):
        tree = ast.parse((PACKAGE / f"backend/{name}.py").read_text())
        defined = {node.name for node in tree.body if isinstance(node, ast.FunctionDef)}
        defined |= {target.id for node in tree.body if isinstance(node, ast.Assign)
                    for target in node.targets if isinstance(target, ast.Name)}
        assert dispatched - defined == set(), name
