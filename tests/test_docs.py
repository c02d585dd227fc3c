"""The docs against the result files they cite."""

import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.one_backend
def test_every_number_of_the_guides_answer_recomputes_from_the_committed_results():
    """tools/check_guide.py recomputes each number the guide's answer states from
    docs/study-results/ and finds it in the text."""
    done = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "check_guide.py")],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr[-2000:]
    assert "numbers found as computed" in done.stdout


@pytest.mark.one_backend
def test_the_guide_check_flags_a_figure_of_the_answer_that_no_check_recomputes():
    sys.path.insert(0, os.path.join(ROOT, "tools"))
    try:
        import check_guide
    finally:
        sys.path.pop(0)
    answer = ("DeepNorm +7.4 ± 1.6 points, 3.1x the gradient, at p < 0.05; +7.4 again, 1e-3; "
              "the paper's +1.4 for Ti/16, and +1.4 of ours")
    exempt = list(check_guide.NOT_RESULTS)  # a figure is exempt only inside its phrase
    assert check_guide.unchecked_figures(answer, ["+7.4 ± 1.6", "not stated", *exempt]) == [
        "3.1x", "+7.4", "+1.4"]
    assert check_guide.unchecked_figures(answer, ["+7.4 ± 1.6", "3.1x", "+7.4", "+1.4 of ours",
                                                  *exempt]) == []


@pytest.mark.one_backend
def test_the_guide_answers_in_one_minute():
    """A recommendation table within the guide's first 30 lines, then a short answer of
    at most 600 words."""
    with open(os.path.join(ROOT, "docs", "normalization-guide.md")) as f:
        text = f.read()
    head = text.splitlines()[:30]
    assert "| your situation | use | the evidence |" in head
    short = text.split("## The short answer", 1)[1].split("\n## ", 1)[0]
    assert len(short.split()) <= 600


@pytest.mark.one_backend
def test_the_committed_efficiency_table_is_what_its_command_writes(tmp_path):
    """docs/study-results/efficiency/efficiency_table_cpu.md, which the guide quotes,
    written again from the committed benchmark files and study by its command."""
    out = os.path.join(ROOT, "docs", "study-results", "efficiency")
    written = tmp_path / "table.md"
    done = subprocess.run(
        [sys.executable, os.path.join(ROOT, "tools", "efficiency_table.py"),
         *(os.path.join(out, f"variants_{model}_cpu{kind}.json")
           for kind in ("", "_memory") for model in ("s16", "b16")),  # the guide's order
         "--study", os.path.join(ROOT, "docs", "study-results", "cifar10-converged"),
         "--group", "converged", "--output", str(written)],
        capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    with open(os.path.join(out, "efficiency_table_cpu.md")) as f:
        assert written.read_text() == f.read()


@pytest.mark.one_backend
def test_the_readmes_test_command_uses_the_readmes_venv_in_a_new_shell(tmp_path):
    """`bash tools/test_backends.sh` in a shell where README command 1's .venv is not
    activated runs that .venv's interpreter, not the `python` on PATH (whose pytest
    has no pytest-xdist for -n); an activated environment or PYTHON wins."""
    import shutil

    (tmp_path / "tools").mkdir()
    shutil.copy(os.path.join(ROOT, "tools", "test_backends.sh"), tmp_path / "tools")
    calls = tmp_path / "calls"

    def stand_in(path, name, status):
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(f"#!/bin/sh\necho {name} >> {calls}\nexit {status}\n")
        path.chmod(0o755)

    stand_in(tmp_path / ".venv" / "bin" / "python", "venv", 0)
    stand_in(tmp_path / "path" / "python", "path", 4)  # the system's: "unrecognized -n"
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHON")}
    env["PATH"] = f"{tmp_path / 'path'}:{env['PATH']}"

    def run(**extra):
        calls.write_text("")
        done = subprocess.run(["bash", str(tmp_path / "tools" / "test_backends.sh")],
                              env={**env, **extra}, capture_output=True, text=True, timeout=60)
        return done.returncode, calls.read_text().split()

    assert run() == (0, ["venv"] * 3)
    assert run(VIRTUAL_ENV="/somewhere") == (1, ["path"] * 3)  # an activated environment
    assert run(PYTHON=str(tmp_path / ".venv" / "bin" / "python")) == (0, ["venv"] * 3)
