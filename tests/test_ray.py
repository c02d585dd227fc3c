"""`ablate --executor ray` on a local Ray on this CPU: a 2-run plan trained as Ray tasks,
with one run failing first (named with its log, the other run kept), then the same
command again, which trains the failed run and skips the finished one; its tables are
those of the same plan trained by `ablate` itself."""

import csv
import os

import pytest

from keras_vitnorm import cli
from keras_vitnorm.training import run_layout

ray = pytest.importorskip("ray", reason="Ray is the optional `ray` extra")

TINY = ["--image-size", "16", "--patch-size", "4", "--width", "32", "--depth", "1",
        "--num-heads", "2", "--mlp-dim", "64", "--steps", "4", "--grad-norm-every", "2",
        "--batch-size", "32", "--warmup-steps", "1", "--verbose", "0"]
PLAN = ["ablate", "--groups", "stems", "--variants", "stems:dual_patchnorm", "--seeds", "0"]


def _results(path):
    """results.csv without its timings, which differ from one training to the next."""
    with open(path, newline="") as file:
        return [{key: value for key, value in row.items() if key != "train_seconds"}
                for row in csv.DictReader(file)]


@pytest.mark.one_backend
def test_a_plan_on_ray_names_a_failed_run_resumes_and_tables_as_ablate_does(tmp_path, capsys):
    ray.init(num_cpus=2, include_dashboard=False, logging_level="WARNING", log_to_driver=False)
    try:
        study = tmp_path / "ray"
        blocked = study / "stems" / "patch" / "seed_0"
        blocked.mkdir(parents=True)
        (blocked / "notes.txt").write_text("mine")  # a file of the user's: the run refuses
        argv = [*PLAN, "--output-dir", str(study), "--executor", "ray", *TINY]
        assert cli.main(argv) == 1
        err = capsys.readouterr().err
        assert "[stems] patch seed 0: exit status 2" in err and "stems-patch-seed_0.log" in err
        finished = study / "stems" / "dual_patchnorm" / "seed_0" / run_layout.METRICS_FILE
        assert finished.exists()
        written = finished.stat().st_mtime_ns
        os.remove(blocked / "notes.txt")
        assert cli.main(argv) == 0  # the failed run trains; the finished one is skipped
        assert finished.stat().st_mtime_ns == written
    finally:
        ray.shutdown()
    assert cli.main([*PLAN, "--output-dir", str(tmp_path / "direct"), *TINY]) == 0
    assert (study / "stems.md").read_text() == (tmp_path / "direct" / "stems.md").read_text()
    assert _results(study / "results.csv") == _results(tmp_path / "direct" / "results.csv")
