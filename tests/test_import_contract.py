"""The import contract of pyproject.toml, checked by import-linter's `lint-imports`: the
zoo never imports the lab or its dependencies, the lab depends downward, no package
has an import circle. It reads the source only, so it runs once."""

import pathlib
import shutil
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent

pytestmark = pytest.mark.one_backend


def lint_imports(root):
    """`(exit status, output)` of `lint-imports` on the package under `root`."""
    script = "import sys; from importlinter.cli import lint_imports_command; lint_imports_command()"
    result = subprocess.run(
        [sys.executable, "-c", script, "--no-cache", "--no-logo", str(root / "pyproject.toml")],
        cwd=root, env={"PYTHONPATH": str(root), "PATH": ""}, capture_output=True, text=True,
        timeout=120)
    return result.returncode, result.stdout + result.stderr


def test_the_package_keeps_the_import_contract():
    code, output = lint_imports(ROOT)
    assert code == 0, output
    assert "Contracts: 3 kept, 0 broken." in output


def test_a_zoo_module_importing_the_lab_or_a_circle_breaks_the_contract(tmp_path):
    shutil.copytree(ROOT / "keras_vitnorm", tmp_path / "keras_vitnorm",
                    ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path)
    presets = tmp_path / "keras_vitnorm" / "models" / "presets.py"
    presets.write_text(presets.read_text() + "\n\ndef lab():\n    import keras_vitnorm.training\n")
    weights = tmp_path / "keras_vitnorm" / "models" / "weights.py"
    weights.write_text(weights.read_text()
                       + "\n\ndef vit():\n    from keras_vitnorm.models import vit\n")
    code, output = lint_imports(tmp_path)
    assert code == 1
    assert "keras_vitnorm.models.presets -> keras_vitnorm.training" in output
    assert "No cycles are allowed in keras_vitnorm.models." in output
    assert "Contracts: 0 kept, 3 broken." in output  # the lab is above the models too
