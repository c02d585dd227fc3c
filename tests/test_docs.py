"""The docs against the result files they cite."""

import os
import subprocess
import sys

import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _check_guide():
    """tools/check_guide.py as a module (tools/ is no package)."""
    sys.path.insert(0, os.path.join(ROOT, "tools"))
    try:
        import check_guide
    finally:
        sys.path.pop(0)
    return check_guide


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
    check_guide = _check_guide()
    answer = ("DeepNorm +7.4 ± 1.6 points, 3.1x the gradient, significant below 0.05; "
              "+7.4 again, 1e-3; the paper's +1.4 for Ti/16, and +1.4 of ours")
    exempt = list(check_guide.NOT_RESULTS)  # a figure is exempt only inside its phrase
    assert check_guide.unchecked_figures(answer, ["+7.4 ± 1.6", "not stated", *exempt]) == [
        "3.1x", "+7.4", "+1.4"]
    assert check_guide.unchecked_figures(answer, ["+7.4 ± 1.6", "3.1x", "+7.4", "+1.4 of ours",
                                                  *exempt]) == []


@pytest.mark.one_backend
def test_the_guide_check_writes_a_p_below_a_thousandth_as_a_bound():
    """A Holm-adjusted p that rounds to 0.000 is stated as "p < 0.001", never as zero."""
    check_guide = _check_guide()
    assert check_guide.p_text(0.0001) == "p < 0.001"
    assert check_guide.p_text(0.0304) == "p 0.030"
    assert check_guide.p_text(1.0) == "p 1.000"


@pytest.mark.one_backend
def test_the_guide_check_flags_an_imagenette_row_the_results_no_longer_give(tmp_path,
                                                                           monkeypatch):
    """Each row of the guide's Imagenette table is recomputed from the study's raw files:
    one figure changed in the guide's row fails the check."""
    check_guide = _check_guide()
    with open(check_guide.GUIDE) as f:
        text = f.read()
    row = dict(check_guide.imagenette_checks())["Imagenette DeepNorm: the guide's table row"]
    assert row in text
    cells = row.split(" | ")
    cells[2] = f"{float(cells[2].split(' ')[0]) + 0.1:.1f} " + cells[2].split(" ", 1)[1]
    guide = tmp_path / "guide.md"
    guide.write_text(text.replace(row, " | ".join(cells)))
    monkeypatch.setattr(check_guide, "GUIDE", str(guide))
    assert check_guide.main() == 1


@pytest.mark.one_backend
def test_the_guide_check_holds_the_readmes_summary_to_the_results(tmp_path, monkeypatch,
                                                                  capsys):
    """A figure in README.md's "Which normalization?" that no check computes fails the
    check; figures in the README's other sections are not its business."""
    check_guide = _check_guide()
    computed = "+3.1 ± 2.8, p 0.144"
    monkeypatch.setattr(check_guide, "checks", lambda: [("DeepNorm against pre-LN", computed)])
    monkeypatch.setattr(check_guide, "sections", lambda: ("", computed))
    readme = tmp_path / "README.md"
    monkeypatch.setattr(check_guide, "README", str(readme))
    page = ("# keras_vitnorm\n\n## Which normalization?\n\n| placement | DeepNorm {} |\n\n"
            "## Quick start\n\nA step of 1.23 s.\n")
    readme.write_text(page.format(computed))
    assert check_guide.main() == 0
    readme.write_text(page.format(computed.replace("+3.1", "+3.2")))
    assert check_guide.main() == 1
    assert "in README.md's summary but recomputed by no check: '+3.2'" in capsys.readouterr().out


@pytest.mark.one_backend
def test_the_imagenette_readme_gives_the_studys_own_tables_and_every_run():
    """The imagenette-cpu README quotes the study's generated tables as written, and its
    table of every run has one row per exported run, with that run's accuracies and
    training time from its metrics.json."""
    import glob
    import json

    folder = os.path.join(ROOT, "docs", "study-results", "imagenette-cpu")
    with open(os.path.join(folder, "README.md")) as f:
        readme = f.read()
    for name in ("core_overview.md", "core_fewshot.md", "core_lr_selection.md"):
        with open(os.path.join(folder, name)) as f:
            assert f.read().strip() in readme, f"README.md does not quote {name} as written"
    every = readme.split("\n## Every run\n", 1)[1].split("\n## ", 1)[0]
    rows = {tuple(cell.strip() for cell in line.strip("|").split("|")[:3]):
            [cell.strip() for cell in line.strip("|").split("|")[3:6]]
            for line in every.splitlines() if line.startswith("| ") and "---" not in line}
    rows.pop(("variant", "learning rate", "seed"))
    runs = glob.glob(os.path.join(folder, "core", "*", "lr_*", "seed_*", "metrics.json"))
    assert len(rows) == len(runs) == 73
    for path in runs:
        variant, rate, seed = path.split(os.sep)[-4:-1]
        r = float(rate[3:])
        exponent = int(np.floor(np.log10(r) + 1e-9))
        key = (variant, f"{r / 10 ** exponent:g}e{exponent}", seed[5:])
        with open(path) as f:
            metrics = json.load(f)
        assert rows[key] == [f"{metrics['test_accuracy']:.2%}", f"{metrics['val_accuracy']:.2%}",
                             f"{metrics['train_seconds']:,.0f} s"], key


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
