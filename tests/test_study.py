"""The ablation runner: statistics, restart without redoing runs, tables, figures, CLI."""

import dataclasses
import gzip
import math
import os

import numpy as np
import pytest

from keras_vitnorm import cli
from keras_vitnorm import durable
from keras_vitnorm.study import confidence_interval
from keras_vitnorm.study import export_study
from keras_vitnorm.study import get_variants
from keras_vitnorm.study import markdown_table
from keras_vitnorm.study import report
from keras_vitnorm.study import run_study
from keras_vitnorm.study import runner
from keras_vitnorm.study import one_run
from keras_vitnorm.study import summarize
from keras_vitnorm.study import tables
from keras_vitnorm.study.variants import STEM_PAIRS
from keras_vitnorm.training import TrainConfig

TINY = {"image_size": 16, "patch_size": 4, "width": 32, "depth": 1, "num_heads": 2, "mlp_dim": 64}


def row(variant, seed, accuracy, status="completed", step=None):
    return {"group": "g", "variant": variant, "seed": seed, "status": status,
            "test_accuracy": accuracy, "diverged_at_step": step}


def test_confidence_interval_matches_numpy_and_scipy():
    from scipy import stats

    values = [0.91, 0.935, 0.902, 0.95]
    mean, half = confidence_interval(values)
    expected = stats.t.ppf(0.975, 3) * np.std(values, ddof=1) / np.sqrt(4)
    assert mean == pytest.approx(np.mean(values)) and half == pytest.approx(expected)
    assert half == pytest.approx(3.182446 * np.std(values, ddof=1) / 2, rel=1e-6)
    assert math.isnan(confidence_interval([0.5])[1])


def test_summary_gains_and_divergent_runs_are_reported():
    rows = [row("base", s, a) for s, a in enumerate([0.90, 0.92, 0.91])]
    rows += [row("better", s, a) for s, a in enumerate([0.95, 0.93, 0.94])]
    rows += [row("shaky", 0, 0.80), row("shaky", 1, None, "diverged", 12), row("shaky", 2, 0.84)]
    rows += [row("broken", s, None, "diverged", 3 + s) for s in range(3)]
    summary = {entry["variant"]: entry for entry in summarize(rows)}
    assert summary["better"]["gain"] == pytest.approx(0.94 - 0.91)
    assert summary["shaky"]["mean"] == pytest.approx(0.82) and summary["shaky"]["diverged"] == 1
    assert summary["broken"]["mean"] is None and summary["broken"]["diverged_steps"] == [3, 4, 5]
    table = markdown_table(summarize(rows))
    half = confidence_interval([0.95, 0.93, 0.94])[1]
    assert f"| better | 3 | 94.00 ± {100 * half:.2f} | +3.00 | 0 |" in table
    assert "| shaky | 3 | 82.00 ± " in table and "1 (at steps 12)" in table
    assert "| broken | 3 | diverged | n/a | 3 (at steps 3, 4, 5) |" in table


def test_depth_profile_skips_the_zero_gradient_first_record(tmp_path):
    from keras_vitnorm.study.model_figures import depth_profile

    path = tmp_path / "grad_norms.csv"
    path.write_text(
        "step,group,norm\n"
        "0,stem/projection,0\n0,block_0/mlp/fc1,0\n0,head,2\n"
        "5,stem/projection,3\n5,block_0/mlp/fc1,3\n5,block_0/mlp/fc2,4\n5,head,1\n"
        "10,stem/projection,1\n10,block_0/mlp/fc1,0\n10,block_0/mlp/fc2,0\n10,head,1\n"
    )
    groups, norms = depth_profile(str(path))
    assert groups == ["patch_embedding", "block_0", "head"]
    np.testing.assert_allclose(norms, [2.0, 2.5, 1.0])


def test_patch_embedding_gradient_ratio_matches_numpy(tmp_path):
    path = tmp_path / "grad_norms.csv"
    path.write_text(
        "step,group,norm\n"
        "0,stem/projection,0\n0,block_0/mlp/fc1,0\n0,head,2\n"
        # still the zero head after a warm-up step at rate 0: no gradient below it either
        "1,stem/projection,0\n1,block_0/mlp/fc1,0\n1,head,2\n"
        "5,stem/projection,6\n5,block_0/mlp/fc1,3\n5,block_0/attention/qkv,1\n5,block_0/attn_norm,50\n"
        "5,block_1/mlp/fc2,2\n5,head,9\n"
        "10,stem/projection,1\n10,block_0/mlp/fc1,4\n10,block_0/attention/qkv,2\n10,block_1/mlp/fc2,3\n"
    )
    stats = tables.patch_embedding_gradient_ratio(str(path))
    # Norm layers and the head are not block dense layers; the zero-head records are left out.
    assert stats["ratio_to_max"] == pytest.approx(np.mean([6 / 3, 1 / 4]))
    assert stats["ratio_to_median"] == pytest.approx(np.mean([6 / 2, 1 / 3]))
    assert stats["largest"] == pytest.approx(0.5)
    # the norms themselves: a ratio can rise while the patch embedding's norm falls
    assert stats["patch_norm"] == pytest.approx(np.mean([6, 1]))
    assert stats["largest_block_norm"] == pytest.approx(np.mean([3, 4]))


def test_gradient_norm_table_gives_the_norms_beside_their_ratios(tmp_path):
    rows = []
    for variant, patch, block in (("patch", (6, 4), 3), ("dual_patchnorm", (3, 5), 1)):
        for seed in (0, 1):
            run_dir = tmp_path / variant / str(seed)
            run_dir.mkdir(parents=True)
            (run_dir / "grad_norms.csv").write_text(
                f"step,group,norm\n5,stem/projection,{patch[seed]}\n5,block_0/mlp/fc1,{block}\n")
            rows.append({"group": "stems", "variant": variant, "seed": seed,
                         "status": "completed", "run_dir": str(run_dir)})
    lines = tables.gradient_norm_table(rows).splitlines()
    assert lines[0].endswith("| patch embedding's gradient norm | largest block layer's |")
    ci = confidence_interval([6, 4])[1]
    assert lines[2].startswith("| stems | patch | 2 | 1.67 ± ")
    assert lines[2].endswith(f"| 5.00 ± {ci:.2f} | 3.00 ± 0.00 |")
    assert lines[3].endswith(f"| 4.00 ± {ci:.2f} | 1.00 ± 0.00 |")


def test_variant_groups_and_subsets():
    assert len(get_variants("placements")) == 9
    assert list(get_variants("stems", ["conv"])) == ["patch", "conv"]
    with pytest.raises(ValueError, match="Did you mean 'dual_patchnorm'"):
        get_variants("stems", ["dual_patchnrom"])
    with pytest.raises(ValueError, match="Unknown variant group"):
        get_variants("stem", None)


def count_trainings(monkeypatch):
    """Makes the runner record each run it trains; returns the (growing) list."""
    trained = []
    original = one_run.train

    def counting(config, **kwargs):
        trained.append(config.output_dir)
        return original(config, **kwargs)

    monkeypatch.setattr(one_run, "train", counting)
    return trained


def base_config():
    return TrainConfig.from_recipe("small", preset="ti16", model=TINY, steps=4, batch_size=32,
                                   warmup_steps=1, tensorboard=False, grad_norm_every=2)


# The runner's skipping, tables, figures and export; training on each backend is
# test_divergent_runs_are_recorded_not_dropped's and test_analysis.py's.
@pytest.mark.one_backend
def test_runner_skips_finished_runs_and_makes_figures(tmp_path, monkeypatch, capsys):
    import matplotlib.pyplot as plt

    study = str(tmp_path / "study")
    subset = {"stems": ["dual_patchnorm"]}
    trained = count_trainings(monkeypatch)
    rows = run_study(base_config(), ["stems"], [0, 1], study, subset, verbose=0)
    assert [(r["variant"], r["seed"], r["status"]) for r in rows] == [
        ("patch", 0, "completed"), ("patch", 1, "completed"),
        ("dual_patchnorm", 0, "completed"), ("dual_patchnorm", 1, "completed")]
    # trained seed by seed, so a study stopped part-way already has every variant
    assert trained == [os.path.join(study, "stems", v, f"seed_{s}")
                       for s in (0, 1) for v in ("patch", "dual_patchnorm")]
    assert os.path.exists(os.path.join(study, "results.csv"))
    assert "| dual_patchnorm | 2 |" in open(os.path.join(study, "stems.md")).read()
    assert "| stems | dual_patchnorm | 2 |" in open(os.path.join(study, "gradient_norms.md")).read()
    # the residual-stream table is over every finished seed of a variant
    assert "| patch | 2 |" in open(os.path.join(study, "figures", "stems_residual_stream.md")).read()
    # how much each model's predictions rest on each patch's mean and std, per variant
    statistics = open(os.path.join(study, "stems_patch_statistics.md")).read()
    assert "| patch | 2 |" in statistics and "| dual_patchnorm | 2 |" in statistics
    # the overview's train - validation gap, from those statistics, is in on the first write
    overview = open(os.path.join(study, "stems_overview.md")).read().splitlines()
    assert all(line.split(" | ")[6] != "n/a" for line in overview[2:4]), overview
    dpn_result = one_run.run_analysis(os.path.join(study, "stems", "dual_patchnorm", "seed_0"))["patch_statistics"]
    from keras_vitnorm.training import data as data_lib

    digits = data_lib.load_dataset("digits")  # under 2,000 images a split: all of each
    assert dpn_result["requested"] == 2000
    assert (dpn_result["train"]["images"], dpn_result["test"]["images"]) == (digits.train.size, digits.test.size)
    # Recomputing the residual stream on other images keeps it in analysis.json.
    run_dir = os.path.join(study, "stems", "dual_patchnorm", "seed_0")
    one_run.run_analysis(run_dir, np.zeros((3, 16, 16, 1), "float32"))
    assert one_run.run_analysis(run_dir)["patch_statistics"] == dpn_result
    for name in ("stems_gains", "stems_gain_curves", "stems_loss", "stems_accuracy",
                 "stems_gradient_norms", "stems_stem_scales", "stems_residual_stream"):
        path = os.path.join(study, "figures", f"{name}.png")
        with open(path, "rb") as f:
            assert f.read(8) == b"\x89PNG\r\n\x1a\n", name
        assert plt.imread(path).ndim == 3

    # Restarted: finished runs are skipped; a missing run is trained again.
    import shutil

    shutil.rmtree(os.path.join(study, "stems", "patch", "seed_1"))
    trained = count_trainings(monkeypatch)
    # Tables only: nothing trains, the missing run is named and left out of the tables.
    tabled = run_study(base_config(), ["stems"], [0, 1], study, subset, verbose=1, mode="tables")
    assert trained == []
    assert [(r["variant"], r["seed"]) for r in tabled] == [("patch", 0), ("dual_patchnorm", 0),
                                                            ("dual_patchnorm", 1)]
    assert "[stems] patch seed 1: not finished, left out of the tables" in capsys.readouterr().out
    assert "| patch | 1 |" in open(os.path.join(study, "stems.md")).read()
    assert len(open(os.path.join(study, "results.csv")).read().splitlines()) == 1 + 3
    again = run_study(base_config(), ["stems"], [0, 1], study, subset, verbose=0)
    assert trained == [os.path.join(study, "stems", "patch", "seed_1")]
    assert [r["test_accuracy"] for r in again][2:] == [r["test_accuracy"] for r in rows][2:]

    changed = base_config()
    changed.learning_rate = 0.5
    with pytest.raises(ValueError, match="learning_rate: saved 0.002, now 0.5"):
        run_study(changed, ["stems"], [0], study, subset, verbose=0)

    # Exported without weights, the study is still one: nothing is trained again and every
    # figure is redrawn from the runs' analysis.json.
    from keras_vitnorm.analysis.probes import stem_scale_map
    from keras_vitnorm.models import ViT

    exported = str(tmp_path / "exported")
    assert export_study(study, exported) == 4
    copied = {os.path.relpath(os.path.join(root, name), exported)
              for root, _, names in os.walk(exported) for name in names}
    assert not any(part in ("preset", "checkpoints", "backup") for path in copied
                   for part in path.split(os.sep))
    dpn_run = os.path.join("stems", "dual_patchnorm", "seed_0")
    kept = set(one_run.RUN_RESULT_FILES) - {"grad_norms.csv"} | {"grad_norms.csv.gz"}
    assert {os.path.join(dpn_run, name) for name in kept} <= copied
    # the gradient norms travel gzip-compressed, the same bytes at every export
    assert not any(path.endswith("grad_norms.csv") for path in copied)
    compressed = os.path.join(exported, dpn_run, "grad_norms.csv.gz")
    with gzip.open(compressed, "rb") as f:
        assert f.read() == open(os.path.join(study, dpn_run, "grad_norms.csv"), "rb").read()
    first = open(compressed, "rb").read()
    assert export_study(study, exported) == 4
    assert open(compressed, "rb").read() == first
    analysis = one_run.run_analysis(os.path.join(exported, dpn_run))
    np.testing.assert_array_equal(
        analysis["stem_scale"], stem_scale_map(ViT.from_preset(os.path.join(study, dpn_run, "preset"))))
    assert one_run.run_analysis(os.path.join(exported, "stems", "patch", "seed_0"))["stem_scale"] is None
    shutil.rmtree(os.path.join(exported, "figures"))
    os.remove(os.path.join(exported, "stems_patch_statistics.md"))
    gradient_table = open(os.path.join(exported, "gradient_norms.md")).read()
    os.remove(os.path.join(exported, "gradient_norms.md"))
    trained.clear()
    redrawn = run_study(base_config(), ["stems"], [0, 1], exported, subset, verbose=0)
    assert trained == []
    assert [r["test_accuracy"] for r in redrawn] == [r["test_accuracy"] for r in again]
    for name in ("stems_stem_scales.png", "stems_residual_stream.png", "stems_gradient_norms.png"):
        assert os.path.exists(os.path.join(exported, "figures", name)), name
    assert open(os.path.join(exported, "stems_patch_statistics.md")).read() == statistics
    assert open(os.path.join(exported, "gradient_norms.md")).read() == gradient_table
    # Without weights, a result made for another number of images is left out, not mixed in.
    from keras_vitnorm.study.patch_statistics import run_patch_statistics

    exported_run = os.path.join(exported, "stems", "dual_patchnorm", "seed_0")
    assert run_patch_statistics(exported_run, images_for=None, count=2000) == dpn_result
    assert run_patch_statistics(exported_run, images_for=None, count=100) is None
    with open(os.path.join(exported, "results.csv")) as f:
        results = f.read()
    assert os.path.join("stems", "patch", "seed_0") in results and str(tmp_path) not in results


@pytest.mark.one_backend
def test_identical_variants_of_different_groups_share_one_run(tmp_path, monkeypatch):
    trained = count_trainings(monkeypatch)
    study = tmp_path / "s"
    config = base_config()
    config.grad_norm_every = None
    rows = run_study(config, ["stems", "norm_types"], [0], str(study),
                     {"stems": ["conv"], "norm_types": ["rmsnorm"]}, verbose=0)
    # `layernorm` (norm_types' baseline) is the same model as `patch` (stems'): trained once.
    assert [(r["group"], r["variant"]) for r in rows] == [
        ("stems", "patch"), ("stems", "conv"), ("norm_types", "layernorm"), ("norm_types", "rmsnorm")]
    assert trained == [str(study / "stems" / "patch" / "seed_0"), str(study / "stems" / "conv" / "seed_0"),
                       str(study / "norm_types" / "rmsnorm" / "seed_0")]
    assert rows[2]["run_dir"] == rows[0]["run_dir"]
    assert rows[2]["test_accuracy"] == rows[0]["test_accuracy"]
    assert "| layernorm | 1 |" in (study / "norm_types.md").read_text()


def test_divergent_runs_are_recorded_not_dropped(tmp_path):
    config = base_config()
    config.learning_rate, config.warmup_steps, config.grad_clip = 1e38, 0, 0
    config.grad_norm_every = None
    rows = run_study(config, ["norm_types"], [0], str(tmp_path / "s"),
                     {"norm_types": ["rmsnorm"]}, verbose=0)
    assert [r["status"] for r in rows] == ["diverged", "diverged"]
    assert all(r["diverged_at_step"] >= 1 for r in rows)
    assert "diverged" in open(tmp_path / "s" / "norm_types.md").read()


def test_tables_only_refuses_what_it_cannot_table(tmp_path):
    with pytest.raises(ValueError, match="holds no study"):
        run_study(base_config(), ["stems"], [0], str(tmp_path / "none"), mode="tables")
    runner._check_study_config(base_config(), str(tmp_path / "empty"))  # a study, no run yet
    with pytest.raises(ValueError, match="No run of this plan has finished"):
        run_study(base_config(), ["stems"], [0], str(tmp_path / "empty"), mode="tables")
    with pytest.raises(ValueError, match="with mode 'tables' \\(--tables-only\\) nothing trains"):
        run_study(base_config(), ["stems"], [0], str(tmp_path / "empty"), parallel=2, mode="tables")


@pytest.mark.parametrize("argv, message", [
    (["--groups", "stems", "--variants", "stems:nope"], "Unknown variant of group 'stems'='nope'"),
    (["--groups", "stems", "--variants", "placements:attn_pre-mlp_pre"], "must be GROUP:NAME"),
    (["--groups", "stemz"], "invalid choice: 'stemz'"),
    (["--groups", "stems", "--tables-only", "--parallel", "2"], "(--tables-only) nothing trains"),
])
def test_ablate_cli_errors(capsys, tmp_path, argv, message):
    try:
        status = cli.main(["ablate", "--output-dir", str(tmp_path / "s"), *argv])
    except SystemExit as exit:
        status = exit.code
    assert status == 2
    assert message in capsys.readouterr().err


# ----------------------------------------------------------------------------- parallel runs


class FakeChild:
    """A stand-in for a worker process: finishes with `code` after `polls` polls."""

    running = []

    def __init__(self, job, code, polls):
        self.job, self.code, self.polls, self.terminated = job, code, polls, False
        FakeChild.running.append(self)

    def poll(self):
        self.polls -= 1
        if self.polls > 0:
            return None
        if self in FakeChild.running:
            FakeChild.running.remove(self)
        return self.code

    def terminate(self):
        self.terminated = True

    def wait(self):
        return self.code


def fake_jobs(count):
    return [{"group": "g", "name": f"v{i}", "seed": 0, "log": f"/nonexistent/v{i}.log"}
            for i in range(count)]


def test_train_in_workers_keeps_to_the_limit_and_stops_launching_after_a_failure():
    from keras_vitnorm.study import workers

    FakeChild.running = []
    started, most, finished = [], [0], []

    def start(job):
        started.append(job["name"])
        child = FakeChild(job, 0, polls=1 + len(started) % 3)
        most[0] = max(most[0], len(FakeChild.running))
        return child

    workers.train_in_workers(fake_jobs(7), 3, start, finished.append, poll_seconds=0, say=None)
    assert started == [f"v{i}" for i in range(7)]
    assert most[0] == 3
    assert sorted(job["name"] for job in finished) == started

    # v1 fails: v0 and v2 (already running) finish, nothing more starts, and the error
    # names the failed run and its log.
    FakeChild.running, started, finished = [], [], []

    def start_failing(job):
        started.append(job["name"])
        return FakeChild(job, 4 if job["name"] == "v1" else 0, polls=1 if job["name"] == "v1" else 3)

    with pytest.raises(workers.RunsFailed, match=r"\[g\] v1 seed 0: exit status 4; no log "
                       r"\(log: /nonexistent/v1.log\)") as error:
        workers.train_in_workers(fake_jobs(6), 3, start_failing, finished.append, poll_seconds=0,
                                 say=None)
    assert started == ["v0", "v1", "v2"]
    assert [job["name"] for job in finished] == ["v0", "v2"]
    assert [(job["name"], code) for job, code in error.value.failures] == [("v1", 4)]


def test_train_in_workers_stops_its_children_when_interrupted():
    from keras_vitnorm.study import workers

    FakeChild.running = []
    children = []

    def start(job):
        children.append(FakeChild(job, 0, polls=2 if not children else 10**6))
        return children[-1]

    def interrupt(job):
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        workers.train_in_workers(fake_jobs(4), 2, start, on_finish=interrupt, poll_seconds=0,
                                 say=None)
    assert len(children) == 2 and children[1].terminated


def test_thread_environment_sizes_every_backends_pool():
    from keras_vitnorm.study import workers

    env = workers.thread_environment(1, {"XLA_FLAGS": "--xla_dump_to=/tmp/x", "KEEP": "1"})
    assert env["OMP_NUM_THREADS"] == env["TF_NUM_INTRAOP_THREADS"] == "1"
    assert env["XLA_FLAGS"] == ("--xla_dump_to=/tmp/x --xla_cpu_multi_thread_eigen=false "
                                "intra_op_parallelism_threads=1")
    assert env["KEEP"] == "1"
    assert "multi_thread_eigen=true intra_op_parallelism_threads=3" in (
        workers.thread_environment(3, {})["XLA_FLAGS"])
    for bad in (0, -2, 1.5, True, "2"):
        with pytest.raises(ValueError, match=f"positive integer, got {bad!r}"):
            workers.thread_environment(bad, {})


def test_a_parallel_study_trains_each_run_in_a_worker_with_its_threads(tmp_path):
    from keras_vitnorm.study import workers

    config = base_config()
    config.grad_norm_every = None
    # The workers' part is the same for every group; this one has no stem analyses to compute.
    subset = {"norm_types": ["rmsnorm"]}
    study = tmp_path / "parallel"
    rows = run_study(config, ["norm_types"], [0], str(study), subset, verbose=0,
                     parallel=2, threads_per_run=1)
    assert [(r["variant"], r["status"]) for r in rows] == [("layernorm", "completed"), ("rmsnorm", "completed")]
    # Each run trained in a worker has its job file and its log.
    logs = sorted(name for name in os.listdir(study / "logs") if name.endswith(".log"))
    assert logs == ["norm_types-layernorm-seed_0.log", "norm_types-rmsnorm-seed_0.log"]
    job = durable.read_json(str(study / "logs" / "norm_types-rmsnorm-seed_0.job.json"))
    # its run named from the study directory, the parent of the job file's folder
    assert job["run_dir"] == os.path.join("norm_types", "rmsnorm", "seed_0")
    assert "| rmsnorm | 1 |" in (study / "norm_types.md").read_text()
    # The same runs trained one after another here give the same results.
    sequential = run_study(config, ["norm_types"], [0], str(tmp_path / "sequential"), subset, verbose=0)
    for here, there in zip(sequential, rows):
        assert here["test_accuracy"] == pytest.approx(there["test_accuracy"], abs=0.02)
    assert workers.default_threads_per_run(10**6) == 1


@pytest.mark.one_backend
def test_a_parallel_study_hands_its_workers_the_runs_seed_by_seed(tmp_path, monkeypatch):
    from keras_vitnorm.study import workers

    handed = []
    # workers that train nothing: the study then trains every run itself, in the same order
    monkeypatch.setattr(workers, "train_in_workers",
                        lambda work, *args, **kwargs: handed.extend((j["name"], j["seed"]) for j in work))
    trained = count_trainings(monkeypatch)
    config = base_config()
    config.grad_norm_every, config.steps = None, 2
    study = tmp_path / "s"
    rows = run_study(config, ["stems", "norm_types"], [0, 1], str(study),
                     {"stems": ["conv"], "norm_types": ["rmsnorm"]}, verbose=0, parallel=2)
    # norm_types' baseline `layernorm` is stems' `patch`: handed out once, shared.
    assert handed == [("patch", 0), ("conv", 0), ("rmsnorm", 0), ("patch", 1), ("conv", 1), ("rmsnorm", 1)]
    groups = {"patch": "stems", "conv": "stems", "rmsnorm": "norm_types"}
    assert trained == [str(study / groups[v] / v / f"seed_{s}") for v, s in handed]
    layernorm = [r for r in rows if r["variant"] == "layernorm"]
    assert [r["run_dir"] for r in layernorm] == [str(study / "stems" / "patch" / f"seed_{s}") for s in (0, 1)]


@pytest.mark.one_backend
def test_a_failed_worker_is_named_with_its_log(tmp_path, capsys):
    study = tmp_path / "s"
    # A run directory taken by a live process (this one) makes the worker fail.
    locked = study / "stems" / "patch" / "seed_0"
    locked.mkdir(parents=True)
    from keras_vitnorm.training import run_files

    with run_files.RunLock(str(locked), "run.lock", what="run directory"):
        status = cli.main(["ablate", "--groups", "stems", "--variants", "stems:conv", "--seeds", "0",
                           "--output-dir", str(study), "--parallel", "2", "--threads-per-run", "1",
                           "--image-size", "16", "--patch-size", "4", "--width", "32", "--depth",
                           "1", "--num-heads", "2", "--mlp-dim", "64", "--steps", "2",
                           "--batch-size", "32", "--warmup-steps", "1", "--verbose", "0"])
    err = capsys.readouterr().err
    assert status == 1
    assert "[stems] patch seed 0: exit status 2;" in err
    assert str(study / "logs" / "stems-patch-seed_0.log") in err
    # The other run finished and is kept.
    assert durable.read_json(str(study / "stems" / "conv" / "seed_0" / "metrics.json"))[
        "status"] == "completed"


@pytest.mark.parametrize("argv, message", [
    (["--parallel", "0"], "parallel must be a positive integer (runs at once), got 0"),
    (["--parallel", "2", "--threads-per-run", "0"], "positive integer, got 0"),
    (["--threads-per-run", "2"], "threads_per_run (--threads-per-run) applies to parallel runs"),
])
def test_parallel_cli_errors(capsys, tmp_path, argv, message):
    status = cli.main(["ablate", "--groups", "stems", "--output-dir", str(tmp_path / "s"), *argv])
    assert status == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "s").exists()


# ----------------------------------------------------------------------------- factor groups


def test_new_groups_hold_the_asked_variants_and_each_builds():
    from keras_vitnorm import ViT
    from keras_vitnorm.study.variants import VARIANT_GROUPS
    from keras_vitnorm.study.variants import variant_factors

    assert list(VARIANT_GROUPS["converged"]) == [
        "pre_ln", "dual_patchnorm", "post_ln", "deepnorm", "conv_stem", "rmsnorm", "dyt", "batchnorm"]
    # the CPU Imagenette study's nine: the converged eight and Peri-LN
    assert VARIANT_GROUPS["core"] == {**VARIANT_GROUPS["converged"], "peri_ln": (
        {"attn_norm": "pre_post", "mlp_norm": "pre_post"}, {})}
    assert list(VARIANT_GROUPS["core"])[0] == "pre_ln" and len(VARIANT_GROUPS["core"]) == 9
    depth = VARIANT_GROUPS["depth_stability"]
    assert len(depth) == 3 * 3 * 2
    assert variant_factors("depth_stability", "deepnorm-depth_24-no_warmup") == {
        "placement": "deepnorm", "depth": 24, "warmup": False}
    assert depth["deepnorm-depth_24-no_warmup"] == (
        {"block_style": "deepnorm", "depth": 24}, {"warmup_steps": 0})
    factors = VARIANT_GROUPS["dpn_factors"]
    assert factors["dpn-p8-n10000"] == (
        {"stem": "dual_patchnorm", "patch_size": 8}, {"train_examples": 10000})
    assert {variant_factors("dpn_factors", n)["stem"] for n in factors} == {
        "patch", "dpn", "pre_patchnorm", "post_patchnorm", "dpn_only_learnable",
        "dpn_no_learnable", "dpn_rmsnorm"}
    # the paper's Table 6 ablations, at the base level only
    assert factors["dpn_only_learnable-p4-n10000"] == (
        {"stem": "dual_patchnorm", "stem_norm": "affine", "patch_size": 4}, {"train_examples": 10000})
    assert factors["dpn_no_learnable-p4-n10000"][0]["stem_norm_learnable"] is False
    assert not any(n.startswith("dpn_rmsnorm") and not n.endswith("-p4-n10000") for n in factors)
    for group in ("converged", "core", "dpn_factors", "depth_stability", "depth_drop_path"):
        for name, (model, _) in VARIANT_GROUPS[group].items():
            config = {**TINY, "image_size": 16, "depth": 2, "num_classes": 3, **model}
            config["patch_size"] = min(config["patch_size"], 8)
            assert ViT(**config).count_params() > 0, (group, name)


def test_depth_drop_path_runs_without_drop_path_are_the_depth_stability_runs(tmp_path):
    """Without stochastic depth, the deepest warm-up runs of `depth_drop_path` have the
    settings of `depth_stability`'s, so a study running both trains them once."""
    config = base_config()
    config.grad_norm_every = None
    trained = []
    keys = {}
    for group in ("depth_stability", "depth_drop_path"):
        for name, (model, settings) in get_variants(group).items():
            variant = dataclasses.replace(config, **settings, model={**config.model, **model})
            key = runner._settings_key(variant)
            if key not in keys:
                keys[key] = (group, name)
                trained.append((group, name))
    shared = [name for group, name in keys.values() if group == "depth_drop_path"]
    assert sorted(shared) == ["deepnorm-depth_24-drop_path_0.1", "post_ln-depth_24-drop_path_0.1",
                              "pre_ln-depth_24-drop_path_0.1"]


def test_dpn_schedule_varies_only_the_steps_and_shares_its_shortest_runs_with_dpn_factors():
    """At `dpn_factors`'s length the schedule group's runs are `dpn_factors`' base-level
    runs (a study running both trains them once); the longer ones differ only in steps."""
    config = TrainConfig.from_recipe("small", preset="ti16", model=TINY, steps=3000, batch_size=32)

    def settings(group, name):
        model, overrides = get_variants(group)[name]
        return dataclasses.replace(config, **overrides, model={**config.model, **model})

    for stem in ("patch", "dpn"):
        shortest = settings("dpn_schedule", f"{stem}-s3000")
        assert runner._settings_key(shortest) == runner._settings_key(settings("dpn_factors", f"{stem}-p4-n10000"))
        longer = settings("dpn_schedule", f"{stem}-s12000")
        assert longer.steps == 12000
        assert runner._settings_key(dataclasses.replace(longer, steps=3000)) == \
            runner._settings_key(shortest)
    from keras_vitnorm.study.variants import variant_factors

    assert variant_factors("dpn_schedule", "dpn-s12000") == {
        "stem": "dpn", "patch_size": 4, "train_examples": 10000, "steps": 12000}
    # two lengths, each with both stems; the stem analyses read the longer pair
    assert sorted(get_variants("dpn_schedule")) == ["dpn-s12000", "dpn-s3000", "patch-s12000", "patch-s3000"]
    assert STEM_PAIRS["dpn_schedule"] == ("patch-s12000", "dpn-s12000")


def test_dpn_schedule_takes_a_base_given_in_epochs():
    """The recipe's default length is in epochs; each schedule run replaces it with its
    steps instead of being refused for giving both."""
    config = TrainConfig.from_recipe("small", preset="ti16", model=TINY)
    assert config.epochs is not None and config.steps is None
    for name, (model, overrides) in get_variants("dpn_schedule").items():
        variant = dataclasses.replace(config, **overrides, model={**config.model, **model})
        variant.validate()
        assert variant.epochs is None and variant.steps == int(name.split("-s")[1])


def test_the_variants_of_a_factor_group_vary_the_same_factors():
    """A factor table's columns are its group's factors: every variant of a group names
    the same ones, with a level for each."""
    from keras_vitnorm.study.variants import VARIANT_FACTORS
    from keras_vitnorm.study.variants import VARIANT_GROUPS

    for group, levels in VARIANT_FACTORS.items():
        assert set(levels) == set(VARIANT_GROUPS[group]), group
        assert len({tuple(sorted(factors)) for factors in levels.values()}) == 1, group


def test_a_variant_the_base_cannot_take_fails_before_any_run_trains(tmp_path, monkeypatch):
    from keras_vitnorm.study import variants

    monkeypatch.setitem(variants.VARIANT_GROUPS, "stems",
                        {"patch": ({"stem": "patch"}, {}), "bad": ({}, {"epochs": 2})})
    trained = count_trainings(monkeypatch)
    with pytest.raises(ValueError, match="exactly one of epochs and steps"):
        run_study(base_config(), ["stems"], [0], str(tmp_path / "study"), verbose=0)
    assert trained == [] and not (tmp_path / "study" / "stems").exists()


def test_welch_interval_matches_scipy():
    from scipy import stats

    from keras_vitnorm.study.stats import difference_interval

    a, b = [0.71, 0.74, 0.70], [0.65, 0.69, 0.66, 0.64]
    difference, half = difference_interval(a, b)
    assert difference == pytest.approx(np.mean(a) - np.mean(b))
    t = stats.ttest_ind(a, b, equal_var=False)
    # At the 95% interval's edge the Welch test's p-value is 0.05.
    assert (abs(difference) > half) == (t.pvalue < 0.05)
    se = difference / t.statistic
    df = (np.var(a, ddof=1) / 3 + np.var(b, ddof=1) / 4) ** 2 / (
        (np.var(a, ddof=1) / 3) ** 2 / 2 + (np.var(b, ddof=1) / 4) ** 2 / 3)
    assert half == pytest.approx(stats.t.ppf(0.975, df) * se)
    assert math.isnan(difference_interval([0.5], [0.4, 0.6])[1])


def factor_row(variant, seed, accuracy, group="dpn_factors", status="completed", step=None):
    return {"group": group, "variant": variant, "seed": seed, "status": status,
            "test_accuracy": accuracy, "diverged_at_step": step}


def test_dpn_factor_table_gives_each_level_its_difference():
    from keras_vitnorm.study.factors import dpn_factor_table

    rows = [factor_row("patch-p4-n2500", s, a) for s, a in enumerate([0.50, 0.52, 0.51])]
    rows += [factor_row("dpn-p4-n2500", s, a) for s, a in enumerate([0.45, 0.46, 0.44])]
    rows += [factor_row("patch-p8-n10000", s, a) for s, a in enumerate([0.60, 0.61, 0.62])]
    rows += [factor_row("dpn-p8-n10000", s, a) for s, a in enumerate([0.62, 0.60, 0.63])]
    table = dpn_factor_table(rows)
    assert "| 4 | 2,500 | dpn | 3 | 45.00 ± " in table and "| -6.00 ± " in table
    line = next(l for l in table.splitlines() if l.startswith("| 4 | 2,500"))
    assert " * | " in line  # the interval excludes zero
    line = next(l for l in table.splitlines() if l.startswith("| 8 | 10,000"))
    assert "+0.67 ± " in line and " * | " not in line


def test_schedule_group_tables_each_length_with_a_steps_column(tmp_path):
    from keras_vitnorm.study.factors import dpn_factor_table
    from keras_vitnorm.study.factors import stem_differences

    group = "dpn_schedule"
    rows = []
    for steps, plain, dpn in ((12000, [0.60, 0.61, 0.62], [0.61, 0.60, 0.62]),
                              (3000, [0.50, 0.52, 0.51], [0.45, 0.46, 0.44])):
        rows += [factor_row(f"patch-s{steps}", s, a, group) for s, a in enumerate(plain)]
        rows += [factor_row(f"dpn-s{steps}", s, a, group) for s, a in enumerate(dpn)]
    lines = dpn_factor_table(rows, group).splitlines()
    assert lines[0].startswith("| patch size | training images | training steps | stem | runs |")
    assert lines[1] == "|" + "---|" * 10
    # shortest schedule first, whatever order the rows come in
    assert [line.split(" | ")[2] for line in lines[2:]] == ["3,000", "12,000"]
    assert lines[2].startswith("| 4 | 10,000 | 3,000 | dpn | 3 | 45.00 ± ") and " * | " in lines[2]
    assert "| +0.00 ± " in lines[3] and " * | " not in lines[3]
    found = stem_differences(rows, group)
    assert [d["steps"] for d in found] == [3000, 12000]
    # the factor groups' tables keep to the factors they vary
    assert "training steps" not in dpn_factor_table([factor_row("patch-p4-n2500", 0, 0.5),
                                                     factor_row("dpn-p4-n2500", 0, 0.4)])
    tables.write_results([dict(r, run_dir=str(tmp_path / "none")) for r in rows], str(tmp_path))
    assert (tmp_path / "dpn_schedule_differences.md").read_text() == dpn_factor_table(rows, group)
    assert not (tmp_path / "dpn_factors_differences.md").exists()


def test_level_text_names_every_factor_of_the_level():
    from keras_vitnorm.study.variants import level_text

    assert level_text({"patch_size": 4, "train_examples": 10000, "steps": 24000, "stem": "dpn"}) == \
        "patch 4, 10,000 images, 24,000 steps"
    assert level_text({"patch_size": 8, "train_examples": 2500}) == "patch 8, 2,500 images"


def test_against_dpn_table_is_the_papers_table_6_format():
    from keras_vitnorm.study.factors import against_dpn_table

    rows = [factor_row("dpn-p4-n10000", s, a) for s, a in enumerate([0.60, 0.62, 0.61])]
    rows += [factor_row("pre_patchnorm-p4-n10000", s, a) for s, a in enumerate([0.57, 0.58, 0.59])]
    rows += [factor_row("patch-p4-n10000", s, a) for s, a in enumerate([0.63, 0.60, 0.65])]
    rows += [factor_row("patch-p4-n2500", s, a) for s, a in enumerate([0.5, 0.5, 0.5])]  # no DPN
    rows += [factor_row("dpn_only_learnable-p4-n10000", s, a) for s, a in enumerate([0.6, 0.6])]
    table = against_dpn_table(rows)
    lines = table.splitlines()[2:]
    assert [line.split(" | ")[2] for line in lines] == ["pre_patchnorm", "dpn_only_learnable", "patch"]
    assert lines[1].startswith("| 4 | 10,000 | dpn_only_learnable | 2 | -1.00 ± ")
    del lines[1], rows[-2:]
    assert lines[0].startswith("| 4 | 10,000 | pre_patchnorm | 3 | -3.00 ± ")
    assert " * | " in lines[0] and lines[1].startswith("| 4 | 10,000 | patch | 3 | +1.67 ± ")
    assert against_dpn_table(rows[-3:]) == ""


def test_depth_table_counts_trained_diverged_and_stalled_runs():
    from keras_vitnorm.study.factors import depth_table

    group = "depth_stability"
    rows = [
        factor_row("post_ln-depth_24-no_warmup", 0, None, group, "diverged", 37),
        factor_row("post_ln-depth_24-no_warmup", 1, 0.1, group),
        factor_row("post_ln-depth_24-no_warmup", 2, 0.55, group),
        factor_row("pre_ln-depth_24", 0, 0.6, group),
    ]
    table = depth_table(rows)
    assert "| post_ln | 24 | no | 3 | 1 | 1 (37) | 1 | 55.00 |" in table
    assert "| pre_ln | 24 | yes | 1 | 1 | 0 | 0 | 60.00 |" in table


def test_depth_table_gives_the_step_each_stalled_run_peaked_at(tmp_path):
    from keras_vitnorm import durable
    from keras_vitnorm.study.factors import depth_table

    group = "depth_stability"
    rows = []
    for seed, best_epoch in enumerate([1, 3]):
        run_dir = tmp_path / f"seed_{seed}"
        run_dir.mkdir()
        durable.write_json(str(run_dir / "metrics.json"), {"status": "completed", "best_epoch": best_epoch})
        durable.write_json(str(run_dir / "train_config.json"), {"steps_per_epoch": 500})
        rows.append(dict(factor_row("post_ln-depth_12", seed, 0.12, group), run_dir=str(run_dir)))
    rows.append(dict(factor_row("post_ln-depth_12", 2, 0.1, group), run_dir=str(tmp_path / "none")))
    rows.append(dict(factor_row("pre_ln-depth_12", 0, 0.6, group), run_dir=str(tmp_path / "none")))
    table = depth_table(rows)
    # a stalled run without metrics is counted but gives no step
    assert "| post_ln | 12 | yes | 3 | 0 | 0 | 3 (500, 1500) | n/a |" in table
    assert "| pre_ln | 12 | yes | 1 | 1 | 0 | 0 | 60.00 |" in table


def test_residual_stream_table_is_the_mean_and_ci_over_runs():
    from keras_vitnorm.study.factors import residual_stream_table

    def stream(rms, similarity):
        return {"names": ["stem", "block_0", "block_1"], "rms": rms, "similarity": similarity}

    streams = {"post_ln-depth_2": [stream([1.0, 2.0, 3.0], [0.5, 0.7]), stream([3.0, 4.0, 5.0], [0.7, 0.9])],
               "pre_ln-depth_2": [stream([1.0, 1.5, 2.0], [0.9, 0.9])], "empty": []}
    lines = residual_stream_table(streams).splitlines()[2:]
    # two runs: mean 2 and t(0.975, 1) * std / sqrt(2) = 12.71 for the stem's RMS 1 and 3
    assert lines[0].startswith("| post_ln-depth_2 | 2 | 2.00 ± 12.71 | 3.00 ± 12.71 | 4.00 ± 12.71 | 0.700 ± 1.271 |")
    assert lines[1] == "| pre_ln-depth_2 | 1 | 1.00 | 1.50 | 2.00 | 0.900 | 0.900 |"
    assert len(lines) == 2 and residual_stream_table({}) == ""


def test_residual_stream_figure_puts_models_of_different_depths_on_one_axis(tmp_path):
    import matplotlib.pyplot as plt

    from keras_vitnorm.study.model_figures import plot_residual_stream

    def stream(depth, scale):
        names = ["stem"] + [f"block_{i}" for i in range(depth)]
        return {"names": names, "rms": [scale] * (depth + 1), "similarity": [0.5] * depth}

    path = plot_residual_stream({"depth 2": [stream(2, 1.0), stream(2, 3.0)], "depth 30": [stream(30, 1.0)]},
                                "title", str(tmp_path / "stream.png"))
    figure = plt.imread(path)
    assert figure.ndim == 3 and figure.shape[1] > figure.shape[0]


def test_gradient_norm_figure_aligns_models_with_and_without_a_final_norm(tmp_path):
    import math

    import matplotlib.pyplot as plt

    from keras_vitnorm.study.model_figures import aligned_depth_profiles
    from keras_vitnorm.study.model_figures import plot_gradient_norms

    pre = {"stem/projection": 1.0, "block_0/mlp/fc1": 0.5, "final_norm": 0.1, "head": 2.0}
    post = {"stem/projection": 1e-5, "block_0/mlp/fc1": 1e-4, "head": 9.0}
    write_grad_norms(tmp_path / "pre", {50: pre})
    write_grad_norms(tmp_path / "post", {50: post})
    runs = {"pre": str(tmp_path / "pre" / "grad_norms.csv"), "post": str(tmp_path / "post" / "grad_norms.csv")}
    groups, profiles = aligned_depth_profiles(runs)
    assert groups == ["patch_embedding", "block_0", "final_norm", "head"]
    assert profiles["pre"] == pytest.approx([1.0, 0.5, 0.1, 2.0])
    # the post-LN model has no final norm: its head stays at the head's position
    assert profiles["post"][:2] == pytest.approx([1e-5, 1e-4]) and math.isnan(profiles["post"][2])
    assert profiles["post"][3] == pytest.approx(9.0)
    assert plt.imread(plot_gradient_norms(runs, "title", str(tmp_path / "g.png"))).ndim == 3


def test_accuracy_by_depth_gives_each_placement_and_warmup_a_line_over_depth(tmp_path):
    import matplotlib.pyplot as plt

    from keras_vitnorm.study.model_figures import accuracy_by_depth
    from keras_vitnorm.study.model_figures import plot_accuracy_by_depth

    group = "depth_stability"
    rows = [factor_row("pre_ln-depth_24", 0, 0.30, group), factor_row("pre_ln-depth_24", 1, 0.34, group),
            factor_row("pre_ln-depth_6", 0, 0.40, group), factor_row("post_ln-depth_12-no_warmup", 0, 0.1, group),
            factor_row("post_ln-depth_12-no_warmup", 1, None, group, "diverged", 9),
            factor_row("patch-p4-n2500", 0, 0.9)]  # another group
    series = accuracy_by_depth(rows)
    assert list(series) == [("pre_ln", True), ("post_ln", False)]
    (depth, mean, _, runs), (deep, deep_mean, deep_ci, deep_runs) = series[("pre_ln", True)]
    assert (depth, runs, deep, deep_runs) == (6, 1, 24, 2)
    assert mean == pytest.approx(0.40) and deep_mean == pytest.approx(0.32) and deep_ci > 0
    assert [(d, n) for d, _, _, n in series[("post_ln", False)]] == [(12, 1)]  # the diverged run is left out
    assert plt.imread(plot_accuracy_by_depth(rows, "t", str(tmp_path / "d.png"))).ndim == 3


def write_grad_norms(path, records):
    """A `grad_norms.csv` from `{step: {layer: norm}}`."""
    lines = ["step,group,norm"] + [f"{step},{layer},{norm}" for step, layers in records.items()
                                   for layer, norm in layers.items()]
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "grad_norms.csv"), "w") as f:
        f.write("\n".join(lines) + "\n")


def test_depth_table_gives_the_first_to_last_block_gradient_ratio(tmp_path):
    from keras_vitnorm.study.factors import depth_table
    from keras_vitnorm.study.factors import first_to_last_block_gradient

    zero = {"block_0/mlp/fc1": 0.0, "block_2/mlp/fc1": 0.0, "head": 1.0}  # step 0: only the head
    # block 0: sqrt(3^2 + 4^2) = 5; block 2 (the last): 0.5, then 50 -> ratios 10 and 0.1, 1
    records = {0: zero,
               50: {"block_0/attention/qkv": 3.0, "block_0/mlp/fc1": 4.0, "block_1/mlp/fc1": 9.0,
                    "block_2/mlp/fc1": 0.5, "stem/projection": 7.0, "head": 2.0},
               100: {"block_0/mlp/fc1": 5.0, "block_2/mlp/fc1": 50.0},
               150: {"block_0/mlp/fc1": 2.0, "block_2/mlp/fc1": 2.0}}
    write_grad_norms(tmp_path / "a", records)
    assert first_to_last_block_gradient(tmp_path / "a" / "grad_norms.csv") == pytest.approx(1.0)
    write_grad_norms(tmp_path / "b", {50: {"block_0/mlp/fc1": 1.0, "block_5/mlp/fc1": 1e4}})
    write_grad_norms(tmp_path / "c", {50: {"block_0/mlp/fc1": 1.0, "block_5/mlp/fc1": 1e2}})
    assert first_to_last_block_gradient(tmp_path / "b" / "grad_norms.csv") == pytest.approx(1e-4)

    group = "depth_stability"
    rows = [dict(factor_row("post_ln-depth_24", 0, 0.1, group), run_dir=str(tmp_path / "b")),
            dict(factor_row("post_ln-depth_24", 1, 0.1, group), run_dir=str(tmp_path / "c")),
            dict(factor_row("pre_ln-depth_24", 0, 0.6, group), run_dir=str(tmp_path / "missing"))]
    table = depth_table(rows)
    # geometric mean of 1e-4 and 1e-2, and their range; a run without the file gives n/a
    assert "| post_ln | 24 | yes | 2 | 0 | 0 | 2 | n/a | 0.001 (0.0001 to 0.01) |" in table
    assert "| pre_ln | 24 | yes | 1 | 1 | 0 | 0 | 60.00 | n/a |" in table
    write_grad_norms(tmp_path / "b", {50: {"block_0/mlp/fc1": 0.0, "block_5/mlp/fc1": 1e4}})
    assert "| 0 (0 to 0.01) |" in depth_table(rows)  # a gradient that underflowed to 0


def test_depth_table_gives_each_rate_its_row_for_the_deep_groups_sweep(tmp_path):
    from keras_vitnorm.study.factors import depth_table
    from keras_vitnorm.study.lr_sweep import select
    from keras_vitnorm.study.lr_sweep import write_selection
    from keras_vitnorm.study.tables import write_results

    def deep_row(variant, rate, accuracy, seed=0):
        return dict(factor_row(variant, seed, accuracy, "deep"), learning_rate=rate,
                    val_accuracy=accuracy, run_dir=str(tmp_path / f"{variant}-{rate}-{seed}"))

    # post-LN stalls at the highest rate and trains at the two lower ones
    sweep = [deep_row("pre_ln", rate, accuracy) for rate, accuracy in ((5e-4, 0.45), (1e-3, 0.40))]
    sweep += [deep_row("post_ln", rate, accuracy) for rate, accuracy in ((1e-3, 0.1), (2.5e-4, 0.5),
                                                                          (5e-4, 0.48))]
    table = depth_table(sweep, "deep").splitlines()
    assert table[0].startswith("| placement | depth | warm-up | peak learning rate | runs | trained |")
    assert table[1] == "|" + "---|" * 10
    # each placement in the order of the rows, then by rate
    assert [line.split(" | ")[:4] for line in table[2:]] == [
        ["| pre_ln", "12", "yes", "0.0005"], ["| pre_ln", "12", "yes", "0.001"],
        ["| post_ln", "12", "yes", "0.00025"], ["| post_ln", "12", "yes", "0.0005"],
        ["| post_ln", "12", "yes", "0.001"]]
    assert table[-1].startswith("| post_ln | 12 | yes | 0.001 | 1 | 0 | 0 | 1 | n/a |")
    # one rate: the table of depth_stability's form; a group over other factors has none
    assert "peak learning rate" not in depth_table(sweep[:1], "deep")
    assert depth_table([dict(r, group="norm_types") for r in sweep], "norm_types") == ""

    rates = [2.5e-4, 5e-4, 1e-3]
    plan = [("deep", [("pre_ln", None), ("post_ln", None)])]
    selection = select(sweep + [deep_row("pre_ln", 2.5e-4, 0.44)], plan, rates, [0])
    write_selection(sweep, selection, rates, str(tmp_path / "study"))
    assert open(tmp_path / "study" / "deep_lr_sweep_summary.md").read() == depth_table(sweep, "deep")
    # the study's own tables: each variant at its chosen rate
    final = [deep_row("pre_ln", 5e-4, 0.45), deep_row("post_ln", 2.5e-4, 0.5)]
    write_results(final, str(tmp_path / "study"))
    summary = open(tmp_path / "study" / "deep_summary.md").read()
    assert summary == depth_table(final, "deep") and "| post_ln | 12 | yes | 0.00025 | 1 | 1 |" in summary
    assert not os.path.exists(tmp_path / "study" / "depth_stability_summary.md")


def test_patch_norm_analysis_is_the_model_stems_view():
    from keras_vitnorm.analysis import patch_norm
    from keras_vitnorm.layers import patchify

    images = np.random.default_rng(0).normal(size=(3, 8, 12, 3))
    patches = patch_norm.patch_vectors(images, 4)
    expected = keras_numpy(patchify(images.astype("float32"), 4))
    np.testing.assert_allclose(patches, expected, atol=1e-6)
    standardized = patch_norm.standardize_patches(patches)
    np.testing.assert_allclose(standardized.mean(-1), 0, atol=1e-9)
    np.testing.assert_allclose(standardized.std(-1), 1, atol=1e-4)
    mean, std = patch_norm.removed_statistics(patches)
    assert mean.shape == std.shape == (3, 6)
    flat = np.ones((1, 4, 4, 1)) * 2.0  # all energy in the mean
    assert patch_norm.energy_in_patch_means(patch_norm.patch_vectors(flat, 2)) == pytest.approx(1.0)


def test_patch_norm_probe_finds_what_the_first_norm_removes():
    """Classes that differ only in each patch's brightness: the probe on the removed
    statistics separates them; the probe on standardized patches cannot."""
    from keras_vitnorm.analysis.patch_norm import patch_norm_probe

    rng = np.random.default_rng(0)
    labels = rng.integers(0, 2, 400)
    texture = rng.normal(size=(400, 8, 8, 1))
    images = texture + 3.0 * labels[:, None, None, None]
    result = patch_norm_probe(images[:300], labels[:300], images[300:], labels[300:], 4)
    assert result["patch_mean_and_std"] > 0.95 and result["pixels"] > 0.95
    assert result["standardized_patches"] < 0.7
    assert result["patch_dim"] == 16 and 0 < result["energy_in_means"] < 1
    # The floor keeps the removal of each patch's mean: brightness stays unreadable.
    assert result["floored_patches"] < 0.7
    assert result["low_contrast"] == 0.0  # unit-variance texture: no near-flat patch


def test_a_linear_probe_that_does_not_converge_is_an_error_not_a_number(monkeypatch):
    """A probe stopped before convergence reports an accuracy that moves with the
    iteration limit, so it ends with an error naming the limit instead."""
    from keras_vitnorm.analysis import patch_norm

    rng = np.random.default_rng(1)
    features = rng.normal(size=(200, 30))
    labels = (features[:, 0] + 0.5 * rng.normal(size=200) > 0).astype(int)
    accuracy = patch_norm.linear_probe_accuracy(features[:150], labels[:150], features[150:], labels[150:])
    assert accuracy > 0.7
    monkeypatch.setattr(patch_norm, "PROBE_MAX_ITER", 2)
    with pytest.raises(RuntimeError, match=r"did not converge in 2 iterations.*150 examples of 30 features"):
        patch_norm.linear_probe_accuracy(features[:150], labels[:150], features[150:], labels[150:])


def test_the_variance_floor_keeps_near_flat_patches_at_low_contrast():
    from keras_vitnorm.analysis import patch_norm

    rng = np.random.default_rng(0)
    flat = 0.3 + 0.01 * rng.normal(size=(1, 8, 8, 3))  # std 0.01: JPEG-noise level
    textured = rng.uniform(-1, 1, size=(1, 8, 8, 3))
    patches = patch_norm.patch_vectors(np.concatenate([flat, textured], axis=2), 8)
    assert patch_norm.low_contrast_share(patches) == 0.5
    plain = patch_norm.standardize_patches(patches)
    floored = patch_norm.standardize_patches(patches, patch_norm.VARIANCE_FLOOR)
    np.testing.assert_allclose(plain.std(-1), 1, atol=0.01)  # noise stretched to full contrast
    assert floored[0, 0].std() < 0.15 and floored[0, 1].std() > 0.95
    np.testing.assert_allclose(floored.mean(-1), 0, atol=1e-9)


def test_combined_patches_have_one_images_patterns_and_the_others_mean_and_std():
    from keras_vitnorm.analysis import patch_norm

    rng = np.random.default_rng(0)
    patterns_from, statistics_from = rng.uniform(-1, 1, size=(2, 3, 8, 12, 3))
    patches = patch_norm.patch_vectors(patterns_from, 4)
    np.testing.assert_array_equal(patch_norm.images_from_patches(patches, patterns_from.shape, 4),
                                  patterns_from)
    combined = patch_norm.patch_vectors(patch_norm.combine_patches(patterns_from, statistics_from, 4), 4)
    mean, std = patch_norm.removed_statistics(combined)
    donor_mean, donor_std = patch_norm.removed_statistics(patch_norm.patch_vectors(statistics_from, 4))
    np.testing.assert_allclose(mean, donor_mean, atol=1e-12)
    np.testing.assert_allclose(std, donor_std, rtol=1e-4)
    # What LN_0 passes on, each patch standardized, is the first image's.
    np.testing.assert_allclose(patch_norm.standardize_patches(combined),
                               patch_norm.standardize_patches(patches), atol=1e-4)
    with pytest.raises(ValueError, match="8x12 are not whole patches of 5"):
        patch_norm.combine_patches(patterns_from, statistics_from, 5)
    with pytest.raises(ValueError, match=r"one shape .*got \(3, 8, 12, 3\) and \(2, 8, 12, 3\)"):
        patch_norm.combine_patches(patterns_from, statistics_from[:2], 4)


def test_each_donor_is_of_another_class():
    from keras_vitnorm.analysis.patch_norm import other_class_donors

    labels = np.array([0, 0, 1, 1, 2, 2, 2])
    donors = other_class_donors(labels, seed=3)
    assert np.all(labels[donors] != labels)
    np.testing.assert_array_equal(donors, other_class_donors(labels, seed=3))
    assert len({tuple(other_class_donors(labels, seed=s)) for s in range(5)}) > 1
    with pytest.raises(ValueError, match="at least two classes"):
        other_class_donors([1, 1, 1])


@pytest.mark.parametrize("stem", ["patch", "dual_patchnorm"])
def test_a_dpn_model_reads_only_the_patterns_and_a_plain_model_the_statistics_too(stem):
    """A DPN model standardizes each patch first: with the statistics swapped it
    predicts as before, with the patterns swapped as on the donor image."""
    import keras

    from keras_vitnorm.analysis.patch_norm import other_class_donors
    from keras_vitnorm.analysis.patch_norm import patch_statistics_reliance
    from keras_vitnorm.models import ViT

    keras.utils.set_random_seed(0)
    patch = 8  # not the 4 of the other tests: the swap must use the model's own patch size
    model = ViT(**{**TINY, "patch_size": patch, "num_classes": 4}, stem=stem)
    head = model.get_layer("head")
    head.kernel.assign(np.random.default_rng(1).normal(size=head.kernel.shape).astype("float32"))
    rng = np.random.default_rng(2)

    def per_patch(low, high):  # one value per patch, repeated over its pixels
        return rng.uniform(low, high, size=(64, 2, 2, 1)).repeat(patch, axis=1).repeat(patch, axis=2)

    # Patches whose brightness and contrast vary from image to image, as in photographs.
    images = (rng.uniform(-1, 1, size=(64, 16, 16, 3)) * per_patch(0.1, 2) + per_patch(-2, 2)).astype("float32")
    predicted = np.argmax(keras_numpy(model(images)), axis=-1)
    if len(np.unique(predicted)) < 2:
        pytest.fail("the random model predicts one class: no donors of another class")
    labels = predicted.copy()
    labels[:8] = (labels[:8] + 1) % 4  # 8 of 64 labels the model gets wrong
    result = patch_statistics_reliance(model, images, labels, batch_size=16)
    assert result["clean"] == 56 / 64 and result["images"] == 64
    donors = other_class_donors(labels)
    if stem == "dual_patchnorm":
        assert result["statistics_swapped"] == result["clean"]
        assert result["patterns_swapped"] == np.mean(predicted[donors] == labels)
        assert result["patterns_swapped_to_donor"] == np.mean(predicted[donors] == labels[donors])
    else:
        assert result["statistics_swapped"] < result["clean"] - 0.1
        assert result["statistics_swapped_to_donor"] > 0
    with pytest.raises(ValueError, match="one label per image, got images of shape .* and 3 labels"):
        patch_statistics_reliance(model, images, labels[:3])


def test_patch_statistics_table_is_the_mean_and_ci_over_runs():
    from keras_vitnorm.study.patch_statistics import patch_statistics_table

    def run(train_clean, test_clean):
        def split(clean, offset):
            return {"clean": clean, "statistics_swapped": 0.4 + offset, "patterns_swapped": 0.2 + offset,
                    "statistics_swapped_to_donor": 0.1 + offset, "patterns_swapped_to_donor": 0.5 + offset,
                    "images": 10}
        return {"requested": 10, "train": split(train_clean, 0.0), "test": split(test_clean, -0.05)}

    text = patch_statistics_table({"patch": [run(1.0, 0.7), run(0.9, 0.7)], "dpn": [run(0.8, 0.6)], "none": []})
    lines = [line for line in text.splitlines() if line.startswith("|")]
    assert len(lines) == 8
    assert lines[2] == ("| patch | 2 | 95.00 ± 63.53 | 40.00 ± 0.00 | 20.00 ± 0.00 | 70.00 ± 0.00 "
                        "| 35.00 ± 0.00 | 15.00 ± 0.00 |")
    assert lines[3] == "| dpn | 1 | 80.00 | 40.00 | 20.00 | 60.00 | 35.00 | 15.00 |"
    assert lines[6] == ("| patch | 2 | 25.00 ± 63.53 | 5.00 ± 0.00 | 5.00 ± 0.00 | 10.00 ± 0.00 / 5.00 ± 0.00 "
                        "| 50.00 ± 0.00 / 45.00 ± 0.00 |")
    assert lines[7] == "| dpn | 1 | 20.00 | 5.00 | 5.00 | 10.00 / 5.00 | 50.00 / 45.00 |"
    assert patch_statistics_table({}) == ""


def test_dpn_mechanism_writes_the_probe_table(tmp_path):
    base = TrainConfig.from_recipe("small", model={**TINY, "image_size": 16}, steps=2)
    path = report.dpn_mechanism(base, str(tmp_path), patch_sizes=(4, 8), train_count=300)
    text = open(path).read()
    assert "| 4 | 16 (LN_0 removes 2) |" in text and "| 8 | 64 (LN_0 removes 2) |" in text
    assert "with variance floor 0.01" in text and "std below 0.1" in text
    rows = [line for line in text.splitlines() if line.startswith("| 4 |") or line.startswith("| 8 |")]
    assert all(line.count("|") == 9 for line in rows)  # 8 cells


def keras_numpy(x):
    import keras

    return keras.ops.convert_to_numpy(x)


def logged_run(tmp_path, variant, seed, curve, status="completed"):
    """A result row whose run folder has a `log.csv`: validation accuracy `curve`, and
    training accuracy 0.9 + 0.01 * seed + epoch / 1000."""
    run_dir = tmp_path / f"{variant}{seed}"
    run_dir.mkdir()
    lines = ["epoch,accuracy,loss,val_accuracy,val_loss"]
    lines += [f"{i},{0.9 + 0.01 * seed + i / 1000},1.0,{value},1.0" for i, value in enumerate(curve)]
    (run_dir / "log.csv").write_text("\n".join(lines) + "\n")
    return {**row(variant, seed, curve[-1], status), "run_dir": str(run_dir)}


def test_convergence_table_names_its_marks_and_what_training_added_after_the_late_one(tmp_path):
    from keras_vitnorm.study import factors

    def run(*args, **kwargs):
        return logged_run(tmp_path, *args, **kwargs)

    rows = [run("a", 0, [0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.75]),
            run("a", 1, [0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.77, 0.9]),  # cut to 8 epochs
            run("b", 0, [0.1, 0.2, 0.3]),  # too short to judge
            run("c", 0, [0.5] * 8, status="diverged"),
            run("d", 0, [0.1, 0.2, 0.3, 0.4, 0.5, 0.6])]
    table = factors.convergence_table(rows)
    # half: epoch 4 (40%); three quarters: epoch 6 (60%); end: 75% and 77%; added 15 and
    # 17; training accuracy in the 8th epoch 90.7% and 91.7%.
    differences = np.array([0.75, 0.77]) - 0.6
    mean, ci = confidence_interval(differences)
    assert (f"| a | 2 | 8 | 4, 6 | 40.00 | 60.00 | 76.00 | {100 * mean:.2f} ± {100 * ci:.2f} "
            "| 91.20 |") in table
    # Six epochs have no epoch at three quarters: the late mark is the last epoch before
    # it (the 4th), and the row says so rather than call the last third a quarter.
    assert "| d | 1 | 6 | 3, 4 | 30.00 | 40.00 | 60.00 | 20.00 | 90.50 |" in table
    assert "| b |" not in table and "| c |" not in table
    assert factors.convergence_table(rows[2:4]) == ""


def test_gain_curves_pair_each_variant_with_the_baseline_seed_by_seed(tmp_path):
    from keras_vitnorm.study import figures

    def run(*args, **kwargs):
        return logged_run(tmp_path, *args, **kwargs)

    rows = [run("base", 0, [0.2, 0.4, 0.5]), run("base", 1, [0.3, 0.5, 0.6, 0.7]),
            run("base", 2, [0.1, 0.1, 0.1]),
            run("dpn", 1, [0.1, 0.6, 0.8, 0.9]), run("dpn", 0, [0.1, 0.5, 0.7, 0.8]),
            run("dpn", 3, [0.9, 0.9, 0.9]),  # no baseline run of seed 3
            run("dpn", 2, [0.9, 0.9, 0.9], status="diverged")]
    # seeds 0 and 1 pair, in seed order, cut to the shorter curve of the pairs (3 epochs)
    np.testing.assert_allclose(figures.gain_curves(rows, "dpn", "base"),
                               [[-0.1, 0.1, 0.2], [-0.2, 0.1, 0.2]], atol=1e-12)
    assert figures.gain_curves(rows, "conv", "base").shape == (0, 0)
    path = figures.plot_gain_curves(rows, "g: gain", str(tmp_path / "gain_curves.png"))
    import matplotlib.pyplot as plt

    assert plt.imread(path).ndim == 3


def test_curve_bands_are_the_t_interval_from_three_runs_and_the_runs_range_with_two(tmp_path, monkeypatch):
    """Two runs' 95% t interval reaches 12.7 standard errors either side of the mean,
    so wide that it hides every difference: with two runs the band is the two curves
    themselves, and the figure's title says which band it shades."""
    from scipy import stats

    from keras_vitnorm.study import figures

    two = np.array([[0.5, 0.6], [0.7, 0.4]])
    low, high, kind = figures.curve_band(two)
    np.testing.assert_allclose(low, [0.5, 0.4])
    np.testing.assert_allclose(high, [0.7, 0.6])
    assert kind == "range"
    three = np.array([[0.5, 0.6], [0.7, 0.4], [0.6, 0.8]])
    low, high, kind = figures.curve_band(three)
    half = stats.t.ppf(0.975, 2) * three.std(axis=0, ddof=1) / np.sqrt(3)
    np.testing.assert_allclose(low, three.mean(axis=0) - half)
    np.testing.assert_allclose(high, three.mean(axis=0) + half)
    assert kind == "95% CI"
    assert figures.curve_band(three[:1]) is None

    def run(*args, **kwargs):
        return logged_run(tmp_path, *args, **kwargs)

    rows = [run("base", 0, [0.2, 0.4]), run("base", 1, [0.3, 0.5]), run("base", 2, [0.1, 0.2]),
            run("dpn", 0, [0.1, 0.5]), run("dpn", 1, [0.1, 0.6])]
    drawn = drawn_figures(monkeypatch)
    figures.plot_accuracy_curves(rows, "g: accuracy", str(tmp_path / "accuracy.png"))
    figures.plot_gain_curves(rows, "g: gain", str(tmp_path / "gain.png"))
    figures.plot_accuracy_curves(rows[:3], "g: accuracy", str(tmp_path / "accuracy3.png"))
    figures.plot_accuracy_curves(rows[3:], "g: accuracy", str(tmp_path / "accuracy2.png"))
    assert [figure.axes[0].get_title() for figure in drawn] == [
        "g: accuracy\n(mean over seeds; shaded: 95% CI, or the range of a variant's two seeds)",
        "g: gain\n(paired by seed; mean; shaded: the range of the two seeds)",
        "g: accuracy\n(mean over seeds; shaded: 95% CI)",
        "g: accuracy\n(mean over seeds; shaded: the range of the two seeds)",
    ]


def test_curve_figures_without_a_logged_epoch_say_so_instead_of_an_empty_legend(tmp_path, monkeypatch):
    """All runs diverged before their first epoch: each curve figure is written, with
    a note where the curves would be and no legend (matplotlib warns on an empty one)."""
    import warnings

    from keras_vitnorm.study import figures

    rows = [{"variant": variant, "seed": 0, "status": "diverged", "run_dir": str(tmp_path / variant)}
            for variant in ("base", "dpn")]
    drawn = drawn_figures(monkeypatch)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for plot in (figures.plot_loss_curves, figures.plot_gain_curves, figures.plot_accuracy_curves):
            assert os.path.exists(plot(rows, "t", str(tmp_path / f"{plot.__name__}.png")))
    assert [([text.get_text() for text in figure.axes[0].texts], figure.axes[0].get_legend())
            for figure in drawn] == [(["no curve: no finished run of these variants logged an epoch"], None)] * 3


@pytest.mark.one_backend
def run_recipe(tmp_path, recipe, *args, env=None):
    """Runs a study recipe with a stand-in interpreter that records each command and its
    backend instead of training. Returns the finished process and `recorded()`: the
    commands so far, each parsed by the command's own parser."""
    import dataclasses
    import json
    import subprocess
    import sys

    from keras_vitnorm.cli import build_parser
    from keras_vitnorm.cli import train_config_from_args

    calls = tmp_path / "calls.jsonl"
    stand_in = tmp_path / "python"
    stand_in.write_text(
        f"#!{sys.executable}\n"
        "import json, os, sys\n"
        f"with open({str(calls)!r}, 'a') as f:\n"
        "    f.write(json.dumps({'argv': sys.argv[1:], 'backend': os.environ.get('KERAS_BACKEND')}) + '\\n')\n")
    stand_in.chmod(0o755)
    done = subprocess.run(["bash", recipe, *args], env={**os.environ, "PYTHON": str(stand_in), **(env or {})},
                          capture_output=True, text=True)

    def recorded():
        studies = []
        for line in calls.read_text().splitlines():
            call = json.loads(line)
            if call["argv"][0].endswith(os.path.join("tools", "resize_folder.py")):
                continue  # a data preparation step (tools_called)
            assert call["argv"][:2] == ["-m", "keras_vitnorm"], call["argv"]
            args = build_parser().parse_args(call["argv"][2:])
            args.preset, args.output_dir = "ti16", None
            studies.append({"groups": args.groups, "dir": args.study_dir, "parallel": args.parallel,
                            "variants": args.variants, "seeds": args.seeds, "backend": call["backend"],
                            "lr_sweep": args.lr_sweep, "extend_sweep": args.extend_sweep,
                            "config": dataclasses.asdict(train_config_from_args(args))})
        return studies

    return done, recorded


def test_the_cifar10_study_recipe_gives_ablate_valid_settings(tmp_path):
    """recipes/cifar10_study.sh: each of its eight commands parses into a valid study
    (a stand-in interpreter records each command and its backend instead of training;
    the test parses them with the command's own parser)."""
    import subprocess

    recipe = os.path.join(os.path.dirname(__file__), os.pardir, "recipes", "cifar10_study.sh")
    done, recorded = run_recipe(tmp_path, recipe, str(tmp_path / "cifar"), str(tmp_path / "out"))
    assert done.returncode == 0, done.stderr
    calls = tmp_path / "calls.jsonl"
    studies = recorded()
    assert [s["groups"] for s in studies] == [
        ["depth_stability", "depth_drop_path"], ["depth_stability"], ["dpn_factors", "dpn_schedule"],
        ["converged"], ["converged"], ["converged"], ["deep"], ["deep"]]
    assert [s["dir"] for s in studies] == [str(tmp_path / "out" / n) for n in (
        "depth", "depth_no_clip", "factors", "converged", "converged_lr", "regularized", "deep",
        "deep_cpu")]
    # the runs without clipping are the deepest models without warm-up, otherwise as in depth
    no_clip = studies[1]
    assert no_clip["config"]["grad_clip"] == 0 and studies[0]["config"]["grad_clip"] == 1.0
    assert no_clip["variants"] == [f"depth_stability:{p}-depth_24-no_warmup" for p in ("pre_ln", "post_ln", "deepnorm")]
    assert {k: v for k, v in no_clip["config"].items() if k != "grad_clip"} == {
        k: v for k, v in studies[0]["config"].items() if k != "grad_clip"}
    for study in studies:
        config = study["config"]
        assert config["dataset"] == f"folder:{tmp_path / 'cifar'}" and study["seeds"] == [0, 1, 2]
        assert config["mixed_precision"] == "mixed_bfloat16"
        # Every run's warm-up ends before its schedule does.
        assert config["warmup_steps"] < config["steps"]
    for study in studies[:3] + studies[7:]:  # on a CPU
        assert study["backend"] == "tensorflow" and study["parallel"] == 2
        assert study["config"]["batch_size"] == 32 and study["config"]["learning_rate"] == 5e-4
    converged = studies[3]  # on a GPU: 80 passes over the 45,000 training images
    assert converged["backend"] == "jax" and converged["parallel"] == 8
    config = converged["config"]
    assert config["model"]["patch_size"] == 4 and config["input_pipeline"] == "python"
    assert round(config["steps"] * config["batch_size"] / 45000) == 80
    assert config["steps"] % config["steps_per_epoch"] == 0
    # Each variant at its own rate: the converged recipe with a sweep around its rate; with
    # regularization; and at depth 12 with a warm-up of at least 10% of the steps.
    assert converged["lr_sweep"] is None
    converged_lr, regularized, deep, deep_cpu = studies[4:]
    for study in (converged_lr, regularized, deep):
        assert study["lr_sweep"][-3:] == [5e-4, 1e-3, 2e-3] and study["parallel"] == 8
        assert config["learning_rate"] in study["lr_sweep"]
    # post-LN at depth trains at low rates only (deep_cpu): deep's grid reaches a quarter
    assert converged_lr["lr_sweep"] == regularized["lr_sweep"] == [5e-4, 1e-3, 2e-3]
    assert deep["lr_sweep"] == [config["learning_rate"] / 4, 5e-4, 1e-3, 2e-3]
    assert converged_lr["config"] == config
    augmentation = {"randaugment_ops": 2, "randaugment_factor": 0.5, "mixup": 0.2, "drop_path": 0.1}
    assert {k: regularized["config"][k] for k in augmentation} == augmentation
    assert {k: v for k, v in regularized["config"].items() if k not in augmentation} == {
        k: v for k, v in config.items() if k not in augmentation}
    assert deep["config"]["warmup_steps"] >= 0.1 * deep["config"]["steps"]
    assert {k: v for k, v in deep["config"].items() if k != "warmup_steps"} == {
        k: v for k, v in config.items() if k != "warmup_steps"}
    # deep's variants and sweep in depth's CPU setting, four times as long, with a warm-up
    # of at least 10% and a sweep around the CPU recipe's rate
    depth = studies[0]["config"]
    assert deep_cpu["config"]["steps"] == 4 * depth["steps"]
    assert deep_cpu["config"]["warmup_steps"] >= 0.1 * deep_cpu["config"]["steps"]
    assert depth["learning_rate"] in deep_cpu["lr_sweep"] and len(deep_cpu["lr_sweep"]) >= 3
    changed = ("steps", "warmup_steps", "grad_norm_every")
    assert {k: v for k, v in deep_cpu["config"].items() if k not in changed} == {
        k: v for k, v in depth.items() if k not in changed}
    # STUDIES picks studies; extra options come last and win.
    calls.unlink()
    done, recorded = run_recipe(tmp_path, recipe, str(tmp_path / "cifar"), str(tmp_path / "out"),
                                "--seeds", "1", "--parallel", "4", env={"STUDIES": "converged"})
    assert done.returncode == 0, done.stderr
    [picked] = recorded()
    assert picked["groups"] == ["converged"] and picked["seeds"] == [1] and picked["parallel"] == 4
    assert {k: v for k, v in picked["config"].items() if k != "seed"} == {
        k: v for k, v in config.items() if k != "seed"}
    bad = subprocess.run(["bash", recipe], capture_output=True, text=True)
    assert bad.returncode == 2 and "usage:" in bad.stderr
    unknown = subprocess.run(["bash", recipe, "a", "b"], env={**os.environ, "STUDIES": "depth converge"},
                             capture_output=True, text=True)
    assert unknown.returncode == 2 and "unknown study 'converge'" in unknown.stderr
    assert "valid: depth depth_no_clip factors converged converged_lr regularized deep deep_cpu" in \
        unknown.stderr


def test_the_imagenette_recipe_is_the_papers_geometry_with_the_test_split_read_at_the_end(tmp_path):
    """recipes/imagenette_study.sh: 224 px in 16-px patches on a Ti/16-sized model, the
    eight variants each at its own rate, AugReg's light augmentation with stochastic
    depth; the official val/ folder is the test split and validation is carved from
    train/ (parsed with the command's own parser, as the CIFAR-10 recipe's)."""
    data = tmp_path / "imagenette"
    for split in ("train", "val"):
        (data / split / "n01440764").mkdir(parents=True)
    recipe = os.path.join(os.path.dirname(__file__), os.pardir, "recipes", "imagenette_study.sh")
    done, recorded = run_recipe(tmp_path, recipe, str(data), str(tmp_path / "out"),
                                env={"STUDIES": "imagenette calibrate"})
    assert done.returncode == 0, done.stderr
    study, calibrate = recorded()
    config = study["config"]
    assert study["backend"] == "jax" and study["groups"] == ["converged"]
    assert study["lr_sweep"] == [5e-4, 1e-3, 2e-3] and study["seeds"] == [0, 1, 2]
    assert {k: config["model"][k] for k in ("image_size", "patch_size", "width", "num_heads",
                                             "mlp_dim", "depth")} == {
        "image_size": 224, "patch_size": 16, "width": 192, "num_heads": 3, "mlp_dim": 768,
        "depth": 12}
    assert (config["randaugment_ops"], config["mixup"], config["drop_path"]) == (2, 0.2, 0.1)
    assert config["weight_decay"] > 0 and config["flip"] and config["crop"] == "zoom"
    assert config["steps"] % config["steps_per_epoch"] == 0 and config["val_examples"] is None
    layout = config["dataset"].removeprefix("folder:")
    assert sorted(os.listdir(layout)) == ["test", "train"]
    assert os.path.realpath(os.path.join(layout, "test")) == str(data / "val")
    assert os.path.realpath(os.path.join(layout, "train")) == str(data / "train")
    # the calibration: the same runs, shorter, one seed, no sweep
    assert calibrate["lr_sweep"] is None and calibrate["seeds"] == [0]
    assert calibrate["config"]["steps"] < config["steps"]
    for run in (config, calibrate["config"]):  # warm-up leaves steps to decay over
        assert 0 < run["warmup_steps"] < run["steps"]
    shorter = ("steps", "warmup_steps", "seed")
    assert {k: v for k, v in calibrate["config"].items() if k not in shorter} == {
        k: v for k, v in config.items() if k not in shorter}
    done, _ = run_recipe(tmp_path, recipe, str(tmp_path / "nothing"), str(tmp_path / "out"))
    assert done.returncode == 2 and "has no train/ folder" in done.stderr


def test_the_imagenette_cpu_recipe_is_the_papers_patch_at_112_px_for_the_nine_variants(tmp_path):
    """recipes/imagenette_study.sh, `cpu` and `cpu_calibrate`: the images resized once to
    112 px, 16-px patches on a Ti/16 body, the nine variants of `core` each at its own
    rate (the sweep extended past an edge) with 3 seeds, on TensorFlow two runs at a
    time; the calibration is pre-LN alone, twice as long."""
    import json

    data = tmp_path / "imagenette"
    for split in ("train", "val"):
        (data / split / "n01440764").mkdir(parents=True)
    recipe = os.path.join(os.path.dirname(__file__), os.pardir, "recipes", "imagenette_study.sh")
    out = tmp_path / "out"
    # the resized copy is made first (here the stand-in interpreter writes nothing)
    done, recorded = run_recipe(tmp_path, recipe, str(data), str(out), env={"STUDIES": "cpu"})
    assert done.returncode == 1 and "wrote no" in done.stderr
    [call] = [json.loads(line)["argv"] for line in (tmp_path / "calls.jsonl").read_text().splitlines()]
    assert call[0].endswith(os.path.join("tools", "resize_folder.py"))
    assert call[1:] == [str(data), str(out / "imagenette_112"), "--size", "112"]
    for split in ("train", "val"):
        (out / "imagenette_112" / split).mkdir(parents=True)
    (tmp_path / "calls.jsonl").unlink()
    done, recorded = run_recipe(tmp_path, recipe, str(data), str(out),
                                env={"STUDIES": "cpu cpu_calibrate"})
    assert done.returncode == 0, done.stderr
    assert "resize_folder" not in (tmp_path / "calls.jsonl").read_text()  # made once
    study, calibrate = recorded()
    config = study["config"]
    assert study["backend"] == calibrate["backend"] == "tensorflow"
    assert study["groups"] == ["core"] and study["parallel"] == 2 and study["seeds"] == [0, 1, 2]
    assert study["lr_sweep"] == [5e-4, 1e-3, 2e-3] and study["extend_sweep"]
    assert config["learning_rate"] in study["lr_sweep"]
    assert {k: config["model"][k] for k in ("image_size", "patch_size", "width", "num_heads",
                                             "mlp_dim", "depth")} == {
        "image_size": 112, "patch_size": 16, "width": 192, "num_heads": 3, "mlp_dim": 768,
        "depth": 12}
    # 30 passes over the 8,522 training images (90% of train/), evaluated after each
    assert config["steps"] == 30 * config["steps_per_epoch"]
    assert config["steps_per_epoch"] == 8522 // config["batch_size"]
    assert 0.05 * config["steps"] <= config["warmup_steps"] <= 0.1 * config["steps"]
    assert config["randaugment_ops"] == 0 and (config["mixup"], config["drop_path"]) == (0.2, 0.1)
    assert config["crop"] == "zoom" and config["flip"] and config["weight_decay"] > 0
    assert config["mixed_precision"] == "mixed_bfloat16" and config["val_fraction"] == 0.1
    layout = config["dataset"].removeprefix("folder:")
    assert os.path.realpath(os.path.join(layout, "test")) == str(out / "imagenette_112" / "val")
    assert os.path.realpath(os.path.join(layout, "train")) == str(out / "imagenette_112" / "train")
    # the calibration: pre-LN alone at the recipe's rate, twice as long, one seed
    assert calibrate["variants"] == ["core:pre_ln"] and calibrate["seeds"] == [0]
    assert calibrate["lr_sweep"] is None and calibrate["config"]["steps"] == 2 * config["steps"]
    assert {k: v for k, v in calibrate["config"].items() if k != "steps"} == {
        k: v for k, v in config.items() if k != "steps"}


@pytest.mark.parametrize("metrics, expected", [
    ({"train_seconds": 90.0, "train_seconds_this_run": 30.0, "resumed_from_step": 8}, 90.0),
    ({"train_seconds": None, "train_seconds_this_run": 30.0, "resumed_from_step": 8}, None),
    # metrics.json written before runs recorded the total:
    ({"train_seconds_this_run": 30.0, "resumed_from_step": 0}, 30.0),
    ({"train_seconds_this_run": 30.0, "resumed_from_step": 8}, None),
])
def test_the_results_row_gives_a_resumed_runs_whole_training_time_or_none(metrics, expected):
    assert one_run.whole_train_seconds(metrics) == expected


def drawn_figures(monkeypatch):
    """A list that gets each figure the study's figure functions save, as they save it."""
    from keras_vitnorm.study import figures

    drawn, save = [], figures.save

    def recording_save(figure, path):
        drawn.append(figure)
        return save(figure, path)

    monkeypatch.setattr(figures, "save", recording_save)
    return drawn


def drawn_error_bar_widths(monkeypatch, plot, *args):
    """Draws with `plot(*args)` and returns the width of each error bar it drew."""
    from matplotlib.container import ErrorbarContainer

    drawn = drawn_figures(monkeypatch)
    assert os.path.getsize(plot(*args)) > 0
    [errors] = [c for c in drawn[0].axes[0].containers if isinstance(c, ErrorbarContainer)]
    return [abs(seg[1][0] - seg[0][0]) for seg in errors.lines[2][0].get_segments() if len(seg)]


def test_gains_figure_draws_an_error_bar_only_where_there_is_an_interval(tmp_path, monkeypatch):
    from keras_vitnorm.study import figures
    from keras_vitnorm.study.stats import difference_interval

    rows = [{"variant": v, "seed": s, "status": "completed", "test_accuracy": a}
            for v, accuracies in (("base", [0.5, 0.52, 0.51]), ("three", [0.55, 0.56, 0.54]), ("one", [0.6]))
            for s, a in enumerate(accuracies)]
    summary = summarize(rows)
    assert summary[1]["ci"] > 0 and math.isnan(summary[2]["ci"])
    widths = drawn_error_bar_widths(monkeypatch, figures.plot_gains, summary, "t", str(tmp_path / "g.png"))
    # a gain's interval is the difference's (Welch), the baseline's spread included
    _, half = difference_interval([0.55, 0.56, 0.54], [0.5, 0.52, 0.51])
    assert summary[1]["gain_ci"] == pytest.approx(half) and half != pytest.approx(summary[1]["ci"])
    assert widths == [pytest.approx(2 * 100 * half)]
    assert summary[0]["gain_ci"] is None and math.isnan(summary[2]["gain_ci"])


def test_stem_differences_pair_each_stem_with_the_plain_stem_of_its_level(tmp_path, monkeypatch):
    from keras_vitnorm.study import figures
    from keras_vitnorm.study.factors import stem_differences

    rows = [factor_row("patch-p4-n2500", s, a) for s, a in enumerate([0.50, 0.52, 0.51])]
    rows += [factor_row("dpn-p4-n2500", s, a) for s, a in enumerate([0.45, 0.46, 0.44])]
    rows += [factor_row("patch-p8-n10000", s, a) for s, a in enumerate([0.60, 0.61, 0.62])]
    rows += [factor_row("dpn-p8-n10000", 0, 0.63)]
    rows += [factor_row("dpn-p4-n40000", 0, 0.7)]  # no plain run at this level
    rows += [factor_row("pre_ln-depth_6", 0, 0.4, group="depth_stability")]
    found = stem_differences(rows)
    assert [(d["patch_size"], d["train_examples"], d["stem"]) for d in found] == [
        (4, 2500, "dpn"), (8, 10000, "dpn")]
    assert found[0]["difference"] == pytest.approx(-0.06) and found[0]["ci"] > 0
    assert found[1]["difference"] == pytest.approx(0.02) and math.isnan(found[1]["ci"])
    assert (found[1]["runs"], found[1]["plain_runs"]) == (1, 3)
    assert stem_differences(rows, "depth_stability") == []
    # an error bar only where there is an interval: none for the 1-against-3 level
    widths = drawn_error_bar_widths(monkeypatch, figures.plot_stem_differences, found, "t",
                                    str(tmp_path / "d.png"))
    assert widths == [pytest.approx(2 * 100 * found[0]["ci"])]


def test_a_stem_factor_group_gets_a_differences_figure_instead_of_gains(tmp_path):
    rows = [dict(factor_row(v, s, a), run_dir=str(tmp_path / f"{v}-{s}"))
            for v, values in (("patch-p4-n2500", [0.50, 0.52]), ("dpn-p4-n2500", [0.45, 0.46]))
            for s, a in enumerate(values)]
    rows += [dict(factor_row(v, 0, a, group="converged"), run_dir=str(tmp_path / v))
             for v, a in (("pre_ln", 0.5), ("dpn", 0.4))]
    names = {os.path.basename(p) for p in report.make_figures(rows, str(tmp_path / "figures"))}
    assert "dpn_factors_differences.png" in names and "dpn_factors_gains.png" not in names
    assert "converged_gains.png" in names and "converged_differences.png" not in names


def test_a_group_without_stem_levels_gets_each_variant_against_its_baseline(tmp_path):
    from keras_vitnorm.study.tables import difference_table
    from keras_vitnorm.study.stats import difference_interval

    rows = [row("base", s, a) for s, a in enumerate([0.76, 0.75, 0.77])]
    rows += [row("better", s, a) for s, a in enumerate([0.80, 0.81, 0.80])]
    rows += [row("same", s, a) for s, a in enumerate([0.77, 0.74, 0.76])]
    rows += [row("broken", s, None, "diverged", 3 + s) for s in range(3)]
    lines = difference_table(summarize(rows)).splitlines()
    assert lines[0] == ("| variant | runs | test accuracy (%), mean ± 95% CI | base (%) "
                        "| difference, points (Welch 95% CI) | p (Welch) "
                        "| p, Holm-adjusted over 2 comparisons |")
    assert [line.split(" | ")[0] for line in lines[2:]] == ["| better", "| same", "| broken"]
    difference, half = difference_interval([0.80, 0.81, 0.80], [0.76, 0.75, 0.77])
    assert f"| {100 * difference:+.2f} ± {100 * half:.2f} * | " in lines[2]
    assert "| -0.33 ± " in lines[3] and " * | " not in lines[3]
    assert lines[4] == "| broken | 3 | n/a | 76.00 ± 2.48 | n/a | n/a | n/a |"
    # written beside the group's table; a stem factor group keeps its own differences table
    tables.write_results([dict(r, run_dir=str(tmp_path / "none")) for r in rows], str(tmp_path))
    assert (tmp_path / "g_differences.md").read_text() == difference_table(summarize(rows))
    assert difference_table(summarize([row("base", 0, 0.7), row("base", 1, 0.72)])) == ""


def test_holm_adjustment_is_the_step_down_bonferroni_over_the_tests_given():
    from keras_vitnorm.study.stats import holm_adjusted

    # sorted: 0.005 x 4, 0.01 x 3, 0.03 x 2, 0.04 x 1 (raised to the running maximum)
    assert holm_adjusted([0.01, 0.04, 0.03, 0.005]) == pytest.approx([0.03, 0.06, 0.06, 0.02])
    # capped at 1; a missing test (NaN) is neither adjusted nor counted
    adjusted = holm_adjusted([0.6, math.nan, 0.2])
    assert adjusted[0] == pytest.approx(0.6) and math.isnan(adjusted[1])
    assert adjusted[2] == pytest.approx(0.4)
    assert holm_adjusted([0.5, 0.7, 0.9]) == pytest.approx([1.0, 1.0, 1.0])
    assert holm_adjusted([]) == []


def test_welch_p_value_is_scipys_welch_test_and_agrees_with_the_interval():
    from scipy import stats

    from keras_vitnorm.study.stats import difference_interval
    from keras_vitnorm.study.stats import welch_p_value

    a, b = [0.71, 0.74, 0.70], [0.65, 0.69, 0.66, 0.64]
    assert welch_p_value(a, b) == pytest.approx(stats.ttest_ind(a, b, equal_var=False).pvalue)
    for treated in (a, [0.66, 0.70, 0.64]):
        difference, half = difference_interval(treated, b)
        assert (abs(difference) > half) == (welch_p_value(treated, b) < 0.05)
    assert math.isnan(welch_p_value([0.5], [0.4, 0.6]))
    # no spread on either side: the difference is certain, or there is none
    assert welch_p_value([0.5, 0.5], [0.4, 0.4]) == 0.0
    assert welch_p_value([0.5, 0.5], [0.5, 0.5]) == 1.0


def test_differences_tables_give_each_p_value_and_holm_over_the_tables_comparisons(tmp_path):
    from scipy import stats

    from keras_vitnorm.study.factors import against_dpn_table
    from keras_vitnorm.study.factors import dpn_factor_table
    from keras_vitnorm.study.tables import difference_table
    from keras_vitnorm.study.stats import holm_adjusted

    base, better, close = [0.76, 0.75, 0.77], [0.80, 0.81, 0.80], [0.785, 0.775, 0.795]
    same = [0.77, 0.74, 0.76]
    rows = [row(name, s, a) for name, values in (("base", base), ("better", better),
                                                  ("close", close), ("same", same))
            for s, a in enumerate(values)]
    lines = difference_table(summarize(rows)).splitlines()
    assert lines[0].endswith("| difference, points (Welch 95% CI) | p (Welch) "
                             "| p, Holm-adjusted over 3 comparisons |")
    p = [stats.ttest_ind(v, base, equal_var=False).pvalue for v in (better, close, same)]
    adjusted = holm_adjusted(p)
    assert p[1] < 0.05 < adjusted[1]  # significant alone, not after the adjustment
    assert lines[2].endswith(f"| {p[0]:.3f} | {adjusted[0]:.3f} * |")
    assert lines[3].endswith(f" * | {p[1]:.3f} | {adjusted[1]:.3f} |")  # the CI alone excludes 0
    assert lines[4].endswith(f"| {p[2]:.3f} | {adjusted[2]:.3f} |")
    assert len(lines) == 5

    rows = [factor_row("patch-p4-n2500", s, a) for s, a in enumerate(base)]
    rows += [factor_row("dpn-p4-n2500", s, a) for s, a in enumerate(close)]
    rows += [factor_row("patch-p4-n10000", s, a) for s, a in enumerate(base)]
    rows += [factor_row("dpn-p4-n10000", s, a) for s, a in enumerate(better)]
    rows += [factor_row("pre_patchnorm-p4-n10000", s, a) for s, a in enumerate(close)]
    lines = dpn_factor_table(rows).splitlines()
    assert lines[0].endswith("| p (Welch) | p, Holm-adjusted over 3 comparisons |")
    assert lines[1] == "|" + "---|" * 9
    table_p = [stats.ttest_ind(t, base, equal_var=False).pvalue for t in (close, better, close)]
    for line, adjusted_p in zip(lines[2:5], holm_adjusted(table_p)):
        assert line.split(" | ")[-1].startswith(f"{adjusted_p:.3f}")
    lines = against_dpn_table(rows).splitlines()
    assert lines[0].endswith("| p (Welch) | p, Holm-adjusted over 3 comparisons |")


def read_csv_rows(path):
    import csv

    with open(path, newline="") as f:
        return list(csv.DictReader(f))


@pytest.mark.one_backend
def test_each_variant_trains_at_the_rate_its_sweep_chose_on_validation(tmp_path, monkeypatch):
    from keras_vitnorm.study import lr_sweep

    trained = count_trainings(monkeypatch)
    study = str(tmp_path / "study")
    config = base_config()
    config.grad_norm_every, config.warmup_steps, config.grad_clip = None, 0, 0
    rates = [1e38, 3e-3, 1e-4]  # any order; 1e38 diverges
    args = (config, ["norm_types"], [0, 1], study, {"norm_types": ["rmsnorm"]})
    rows = run_study(*args, verbose=0, lr_sweep=rates, sweep_seeds=[1])
    sweep = read_csv_rows(os.path.join(study, "lr_sweep.csv"))
    assert len(sweep) == 2 * 3 and {r["seed"] for r in sweep} == {"1"}
    chosen, tied = {}, {}
    for variant in ("layernorm", "rmsnorm"):
        runs_ = [r for r in sweep if r["variant"] == variant]
        assert {r["status"] for r in runs_ if float(r["learning_rate"]) == 1e38} == {"diverged"}
        finished = {float(r["learning_rate"]): {"values": [float(r["val_accuracy"])],
                                                 "examples": [int(r["val_examples"])]}
                    for r in runs_ if r["status"] == "completed"}
        chosen[variant] = max(sorted(finished), key=lambda rate: finished[rate]["values"])
        tied[variant] = [rate for rate in sorted(finished)
                         if finished[chosen[variant]]["values"][0] - finished[rate]["values"][0]
                         <= lr_sweep.noise_margin(finished[chosen[variant]], finished[rate])]
    # the final runs: each variant at its chosen rate, the sweep's seed-1 run shared
    assert [(r["variant"], r["seed"], r["learning_rate"]) for r in rows] == [
        (v, s, chosen[v]) for v in ("layernorm", "rmsnorm") for s in (0, 1)]
    for r in rows:
        assert r["run_dir"] == os.path.join(study, "norm_types", r["variant"],
                                            f"lr_{chosen[r['variant']]:g}", f"seed_{r['seed']}")
    assert len(trained) == 6 + 2  # 2 variants x 3 rates, then seed 0 of each
    results = read_csv_rows(os.path.join(study, "results.csv"))
    assert [float(r["learning_rate"]) for r in results] == [r["learning_rate"] for r in rows]
    table = open(os.path.join(study, "norm_types_lr_selection.md")).read().splitlines()
    assert table[0] == ("| variant | lr 0.0001 | lr 0.003 | lr 1e+38 | chosen rate "
                        "| tied within the seed noise |")
    line = next(line for line in table if line.startswith("| rmsnorm |"))
    notes = ["edge of the grid"] if chosen["rmsnorm"] == 1e-4 else []  # 1e38: the other edge
    if len(tied["rmsnorm"]) > 1:
        notes.append("tied within the validation noise: "
                     + ", ".join(f"{r:g}" for r in tied["rmsnorm"]))
    note = f" ({'; '.join(notes)})" if notes else ""
    assert "1 diverged" in line and f"| {chosen['rmsnorm']:g}{note} | " in line
    # the margin of a tie comes from the final runs' two seeds at the chosen rate
    finals = [float(r["val_accuracy"]) for r in rows if r["variant"] == "rmsnorm"]
    assert line.endswith(f"(margin {100 * lr_sweep.tie_margin(finals):.2f} points) |")
    assert os.path.exists(os.path.join(study, "figures", "norm_types_lr_sweep.png"))
    # rerun: nothing trains again
    trained.clear()
    assert run_study(*args, verbose=0, lr_sweep=rates, sweep_seeds=[1]) == rows
    assert trained == []
    with pytest.raises(ValueError, match="two or more distinct rates"):
        lr_sweep.check_rates([1e-3, 1e-3])
    with pytest.raises(ValueError, match="positive numbers, got -0.1"):
        lr_sweep.check_rates([1e-3, -0.1])
    with pytest.raises(ValueError, match="give lr_sweep \\(--lr-sweep\\) too"):
        run_study(config, ["norm_types"], [0], study, sweep_seeds=[0])
    with pytest.raises(ValueError, match="No run of this plan's learning-rate sweep has finished"):
        run_study(config, ["norm_types"], [0], study, mode="tables", lr_sweep=[0.1, 0.2])


@pytest.mark.one_backend
def test_a_sweep_collected_part_way_tables_no_variant_from_runs_at_several_rates(tmp_path):
    # The study's tables compare each variant at its chosen rate; the sweep's runs, at
    # every rate, go to lr_sweep.csv and the selection table alone (and are exported).
    study = str(tmp_path / "study")
    config = base_config()
    config.grad_norm_every, config.warmup_steps = None, 0
    args = (config, ["norm_types"], [0, 1], study, {"norm_types": ["rmsnorm"]})
    commands = run_study(*args, verbose=0, mode="plan", lr_sweep=[1e-3, 3e-3])
    jobs = [command.split()[-1] for command in commands]
    for job in (jobs[0], jobs[2]):  # both variants at 1e-3: no rate chosen yet
        assert cli.main(["ablate-job", job, "--verbose", "0"]) == 0
    assert run_study(*args, verbose=0, mode="tables", lr_sweep=[1e-3, 3e-3]) == []
    assert len(read_csv_rows(os.path.join(study, "lr_sweep.csv"))) == 2
    assert os.path.exists(os.path.join(study, "norm_types_lr_selection.md"))
    assert not os.path.exists(os.path.join(study, "results.csv"))
    assert not os.path.exists(os.path.join(study, "norm_types.md"))
    assert cli.main(["ablate-job", jobs[1], "--verbose", "0"]) == 0  # layernorm's sweep done
    rows = run_study(*args, verbose=0, mode="tables", lr_sweep=[1e-3, 3e-3])
    assert [(r["variant"], r["seed"]) for r in rows] == [("layernorm", 0)]
    results = read_csv_rows(os.path.join(study, "results.csv"))
    assert [(r["variant"], float(r["learning_rate"])) for r in results] == [
        ("layernorm", rows[0]["learning_rate"])]
    assert "| layernorm | 1 |" in open(os.path.join(study, "norm_types.md")).read()
    exported = str(tmp_path / "exported")
    assert export_study(study, exported) == 3
    assert len(read_csv_rows(os.path.join(exported, "lr_sweep.csv"))) == 3


def test_an_extended_sweep_adds_the_next_rate_beyond_the_end_its_choice_lies_on():
    from keras_vitnorm.study.lr_sweep import EXTEND_LIMIT
    from keras_vitnorm.study.lr_sweep import extend

    rates = [5e-4, 1e-3, 2e-3]
    grids = {("g", v): list(rates) for v in ("top", "bottom", "inside", "open")}
    selection = {("g", "top"): {"rate": 2e-3}, ("g", "bottom"): {"rate": 5e-4},
                 ("g", "inside"): {"rate": 1e-3}, ("g", "open"): {"rate": None}}
    wider = extend(grids, selection, rates)
    assert wider == {("g", "top"): rates + [4e-3], ("g", "bottom"): [2.5e-4] + rates,
                     ("g", "inside"): rates, ("g", "open"): rates}
    # a grid of other ratios keeps its ratio at that end, rounded to 6 digits
    assert extend({("g", "a"): [1e-4, 3e-4]}, {("g", "a"): {"rate": 3e-4}}, [1e-4, 3e-4]) == {
        ("g", "a"): [1e-4, 3e-4, 9e-4]}
    # at most EXTEND_LIMIT rates beyond either end of the base grid
    top = rates + [4e-3 * 2 ** i for i in range(EXTEND_LIMIT)]
    assert extend({("g", "top"): top}, {("g", "top"): {"rate": top[-1]}}, rates) == {
        ("g", "top"): top}


def test_rates_within_the_seed_noise_of_the_chosen_one_are_reported_as_ties():
    from scipy import stats

    from keras_vitnorm.study.lr_sweep import selection_table
    from keras_vitnorm.study.lr_sweep import tie_margin

    finals = [0.50, 0.52, 0.47]  # the chosen rate's three seeds
    margin = stats.t.ppf(0.975, 2) * np.std(finals, ddof=1) * math.sqrt(2)
    assert tie_margin(finals) == pytest.approx(margin) and tie_margin([0.5]) is None
    scores = {1e-3: 0.50, 2e-3: 0.50 - margin + 0.001, 5e-4: 0.50 - margin - 0.001}
    choice = {"rate": 1e-3, "reason": None,
              "scores": {r: {"values": [v], "diverged": 0, "missing": 0} for r, v in scores.items()}}
    final_rows = [{"group": "g", "variant": "a", "status": "completed", "learning_rate": 1e-3,
                   "val_accuracy": v} for v in finals]
    final_rows.append(dict(final_rows[0], learning_rate=2e-3, val_accuracy=0.9))  # another rate
    table = selection_table({("g", "a"): choice}, sorted(scores), "g", final_rows)
    assert table.splitlines()[2].endswith(f"| 0.001 | 0.002 (margin {100 * margin:.2f} points) |")
    one_seed = selection_table({("g", "a"): choice}, sorted(scores), "g", final_rows[:1])
    assert one_seed.splitlines()[2].endswith("| n/a (fewer than 2 seeds at the chosen rate) |")


def test_the_extend_sweep_help_states_the_limit(capsys):
    from keras_vitnorm.study.lr_sweep import EXTEND_LIMIT

    with pytest.raises(SystemExit):
        cli.main(["ablate", "--help"])
    assert f"up to {EXTEND_LIMIT} rates beyond" in " ".join(capsys.readouterr().out.split())


@pytest.mark.one_backend
def test_an_extended_sweep_plans_the_rate_beyond_the_edge_until_the_choice_is_inside(tmp_path):
    # Each sweep run is finished by hand with a validation accuracy that peaks at 4e-3:
    # the plan then asks for 4e-3 beyond the grid's top, then 8e-3, and, the choice now
    # inside the grid, the final seed at 4e-3.
    from keras_vitnorm.study import plan as plan_lib

    study = str(tmp_path / "study")
    config = base_config()
    config.grad_norm_every, config.warmup_steps = None, 0
    args = (config, ["norm_types"], [0, 1], study, {"norm_types": ["layernorm"]})

    def plan():
        commands = run_study(*args, verbose=0, mode="plan", lr_sweep=[1e-3, 2e-3],
                             extend_sweep=True)
        return [os.path.relpath(plan_lib.read_job(c.split()[-1])["run_dir"], study)
                for c in commands]

    def finish(run_dir, rate):
        os.makedirs(os.path.join(study, run_dir))
        durable.write_json(os.path.join(study, run_dir, "metrics.json"),
                           {"status": "completed", "val_accuracy": 0.5 - abs(math.log2(rate / 4e-3)) / 10,
                            "test_accuracy": 0.5, "steps": 4})

    folder = os.path.join("norm_types", "layernorm")
    expected = [[os.path.join(folder, "lr_0.001", "seed_0"), os.path.join(folder, "lr_0.002", "seed_0")],
                [os.path.join(folder, "lr_0.004", "seed_0")],
                [os.path.join(folder, "lr_0.008", "seed_0")],
                [os.path.join(folder, "lr_0.004", "seed_1")]]
    for runs_planned in expected:
        assert plan() == runs_planned
        for run_dir in runs_planned[:1] if "seed_1" in runs_planned[0] else runs_planned:
            finish(run_dir, float(run_dir.split("lr_")[1].split(os.sep)[0]))
    table = open(os.path.join(study, "norm_types_lr_selection.md")).read().splitlines()
    assert table[0] == ("| variant | lr 0.001 | lr 0.002 | lr 0.004 | lr 0.008 | chosen rate "
                        "| tied within the seed noise |")
    assert table[2] == ("| layernorm | 30.00 | 40.00 | 50.00 | 40.00 | 0.004 "
                        "| n/a (fewer than 2 seeds at the chosen rate) |")
    # without --extend-sweep the choice stays at the grid's edge
    run_study(*args, verbose=0, mode="plan", lr_sweep=[1e-3, 2e-3])
    assert "| 0.002 (edge of the grid) |" in open(
        os.path.join(study, "norm_types_lr_selection.md")).read()
    with pytest.raises(ValueError, match="extend_sweep \\(--extend-sweep\\) widens the grid"):
        run_study(config, ["norm_types"], [0], study, extend_sweep=True)


def test_the_lr_sweep_figure_fills_the_chosen_rates_marker(tmp_path, monkeypatch):
    # The chosen rate's filled marker is drawn over the line's white-faced ones: the
    # rendered pixel at its centre has the line's colour.
    from matplotlib.colors import to_rgb

    from keras_vitnorm.study import figures

    drawn = []
    monkeypatch.setattr(figures, "save", lambda figure, path: drawn.append(figure) or path)
    rates = [1e-4, 1e-3]
    choice = {"rate": 1e-3, "scores": {1e-4: {"values": [0.4], "diverged": 0},
                                         1e-3: {"values": [0.5], "diverged": 0}}}
    figures.plot_lr_sweep({"post_ln": choice}, rates, "sweep", str(tmp_path / "sweep.png"))
    [figure] = drawn
    figure.canvas.draw()
    pixels = np.asarray(figure.canvas.buffer_rgba())
    axes = figure.axes[0]
    colour = np.array(to_rgb(axes.lines[0].get_color()))

    def pixel(rate, accuracy):
        x, y = axes.transData.transform((rate, 100 * accuracy))
        return pixels[pixels.shape[0] - int(round(y)), int(round(x)), :3] / 255

    assert np.allclose(pixel(1e-3, 0.5), colour, atol=0.05)  # chosen: filled
    assert np.allclose(pixel(1e-4, 0.4), 1.0, atol=0.05)  # not chosen: white face


def test_a_rate_is_chosen_only_when_its_sweep_has_finished_and_not_where_a_run_diverged():
    from keras_vitnorm.study.lr_sweep import select

    def sweep_row(variant, rate, seed, accuracy, status="completed"):
        return {"group": "g", "variant": variant, "learning_rate": rate, "seed": seed,
                "status": status, "val_accuracy": accuracy}

    plan = [("g", [("a", ({}, {})), ("b", ({}, {})), ("c", ({}, {}))])]
    rows = [sweep_row("a", 1e-3, s, v) for s, v in ((0, 0.6), (1, 0.7))]
    rows += [sweep_row("a", 1e-2, s, v) for s, v in ((0, 0.8), (1, None))]
    rows[-1]["status"] = "diverged"  # the better mean would be 1e-2's, but one seed diverged
    rows += [sweep_row("b", 1e-3, 0, 0.5), sweep_row("b", 1e-3, 1, 0.5),
             sweep_row("b", 1e-2, 0, 0.4)]  # seed 1 at 1e-2 not finished
    rows += [sweep_row("c", rate, s, None, "diverged") for rate in (1e-3, 1e-2) for s in (0, 1)]
    selection = select(rows, plan, [1e-3, 1e-2], [0, 1])
    assert selection[("g", "a")]["rate"] == 1e-3
    assert selection[("g", "a")]["scores"][1e-3]["values"] == [0.6, 0.7]
    assert selection[("g", "b")]["rate"] is None
    assert selection[("g", "b")]["reason"] == "1 sweep run(s) not finished"
    assert selection[("g", "c")] == {**selection[("g", "c")], "rate": None,
                                     "reason": "a run diverged at every rate"}


def test_rates_within_the_validation_noise_of_the_chosen_one_tie_and_widen_the_sweep():
    from keras_vitnorm.study.lr_sweep import extend
    from keras_vitnorm.study.lr_sweep import noise_margin
    from keras_vitnorm.study.lr_sweep import select
    from keras_vitnorm.study.lr_sweep import selection_table

    rates = [5e-4, 1e-3, 2e-3]
    finals = {"stalled": (0.1246, 0.1257, 0.1045),  # a variant that learns at no rate
              "learns": (0.529, 0.436, 0.325), "flat_top": (0.40, 0.50, 0.51)}
    rows = [{"group": "g", "variant": v, "learning_rate": rate, "seed": seed,
             "status": "completed", "val_accuracy": a, "val_examples": "947"}
            for v, accuracies in finals.items() for rate, a in zip(rates, accuracies)
            for seed in (0, 1)]  # two seeds score the same 947 images
    plan = [("g", [(v, ({}, {})) for v in finals])]
    selection = select(rows, plan, rates, [0, 1])
    # the best mean is the choice; 1e-3 is best by 1 image in 947 and 2e-3 behind by 20:
    # chance alone spreads rates that far, so all three tie and the grid widens both ways
    assert selection[("g", "stalled")]["rate"] == 1e-3
    assert selection[("g", "stalled")]["tied"] == rates
    assert selection[("g", "learns")]["rate"] == 5e-4 and selection[("g", "learns")]["tied"] == []
    # the top rate is best by one point, tied with 1e-3: the grid widens upward only
    assert selection[("g", "flat_top")]["rate"] == 2e-3
    assert selection[("g", "flat_top")]["tied"] == [1e-3, 2e-3]
    grids = {key: list(rates) for key in selection}
    assert extend(grids, selection, rates) == {("g", "stalled"): [2.5e-4, *rates, 4e-3],
                                               ("g", "learns"): [2.5e-4, *rates],
                                               ("g", "flat_top"): [*rates, 4e-3]}
    table = selection_table(selection, rates, "g")
    assert "| 0.001 (tied within the validation noise: 0.0005, 0.001, 0.002) |" in table
    # the margin: 1.96 standard errors of a difference of proportions over the images one
    # run scores (the seeds' runs score the same images, so they add none)
    best, other = selection[("g", "learns")]["scores"][5e-4], {"values": [0.5], "examples": [947]}
    assert noise_margin(best, other) == pytest.approx(
        1.96 * math.sqrt((0.529 * 0.471 + 0.5 * 0.5) / 947))
    # runs that do not record their validation images: only an exact tie is one
    for row in rows:
        del row["val_examples"]
    assert select(rows, plan, rates, [0, 1])[("g", "stalled")]["tied"] == []


@pytest.mark.one_backend
def test_a_plan_is_one_resumable_command_per_run_and_tables_only_collects_them(
        tmp_path, monkeypatch, capsys):
    import shlex
    import subprocess
    import sys

    from keras_vitnorm.study import plan

    trained = count_trainings(monkeypatch)
    study = str(tmp_path / "study")
    config = base_config()
    config.grad_norm_every, config.warmup_steps = None, 0
    args = (config, ["norm_types"], [0, 1], study, {"norm_types": ["rmsnorm"]})
    commands = run_study(*args, verbose=1, mode="plan", lr_sweep=[1e-3, 3e-3])
    assert trained == [] and "4 run(s) to train" in capsys.readouterr().out
    assert open(os.path.join(study, "plan", "commands.txt")).read().splitlines() == commands
    # the sweep's runs first: the rates are chosen before the other seeds can be planned
    files = [shlex.split(command)[-1] for command in commands]
    assert [os.path.basename(f) for f in files] == [
        f"norm_types-{v}-lr_{r}-seed_0.job.json" for v in ("layernorm", "rmsnorm")
        for r in ("0.001", "0.003")]
    assert all(c.startswith("KERAS_BACKEND=torch keras-vitnorm ablate-job ") for c in commands)
    # One line as a scheduler runs it; the study moved meanwhile (job paths are relative).
    moved = str(tmp_path / "moved")
    os.rename(study, moved)
    files = [f.replace(study, moved) for f in files]
    line = commands[0].replace(study, moved).replace(
        "keras-vitnorm", f"{shlex.quote(sys.executable)} -m keras_vitnorm", 1)
    done = subprocess.run(line, shell=True, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    assert one_run.read_metrics(os.path.join(moved, "norm_types", "layernorm", "lr_0.001",
                                          "seed_0"))["status"] == "completed"
    for path in files[1:]:
        assert cli.main(["ablate-job", path, "--verbose", "0"]) == 0
    assert cli.main(["ablate-job", files[1], "--verbose", "0"]) == 0  # again: nothing to do
    assert len(trained) == 3
    # Each job analyzed its own run, on the probe images the tables step uses.
    analyses = [os.path.join(moved, "norm_types", variant, rate, "seed_0", "analysis.json")
                for variant in ("layernorm", "rmsnorm") for rate in ("lr_0.001", "lr_0.003")]
    written = [os.stat(path).st_mtime_ns for path in analyses]
    assert all(durable.read_json(path)["probe_images"] == 64 for path in analyses)
    # The sweep is done: the plan is now the other seed of each variant at its rate.
    commands = run_study(config, ["norm_types"], [0, 1], moved, {"norm_types": ["rmsnorm"]},
                         verbose=0, mode="plan", lr_sweep=[1e-3, 3e-3])
    assert len(commands) == 2 and all("seed_1.job.json" in c for c in commands)
    assert sorted(os.listdir(os.path.join(moved, "plan"))) == sorted(
        [os.path.basename(shlex.split(c)[-1]) for c in commands] + ["commands.txt"])
    # Collected part-way: the tables hold the finished runs, the rest are named.
    rows = run_study(config, ["norm_types"], [0, 1], moved, {"norm_types": ["rmsnorm"]},
                     verbose=1, mode="tables", lr_sweep=[1e-3, 3e-3])
    assert [(r["variant"], r["seed"]) for r in rows] == [("layernorm", 0), ("rmsnorm", 0)]
    assert "seed 1: not finished, left out of the tables" in capsys.readouterr().out
    assert [os.stat(path).st_mtime_ns for path in analyses] == written  # read, not redone
    assert os.path.exists(os.path.join(moved, "norm_types_lr_selection.md"))
    with pytest.raises(ValueError, match="commands.txt is not valid JSON"):
        plan.run_job(os.path.join(moved, "plan", "commands.txt"))
    bad = tmp_path / "bad.job.json"
    bad.write_text("[1, 2]")
    assert cli.main(["ablate-job", str(bad)]) == 2
    assert "bad.job.json is not a job file: it needs the keys" in capsys.readouterr().err


def fake_run(run_dir, accuracies, steps_per_epoch, total, seconds):
    """A finished run directory with a per-epoch log, as training leaves it."""
    os.makedirs(run_dir)
    durable.write_json(os.path.join(run_dir, "train_config.json"),
                       {"steps_per_epoch": steps_per_epoch})
    durable.write_json(os.path.join(run_dir, "metrics.json"),
                       {"status": "completed", "steps": total, "train_seconds": seconds,
                        "val_accuracy": accuracies[-1]})
    durable.write_text(os.path.join(run_dir, "log.csv"), "epoch,accuracy,val_accuracy\n" + "".join(
        f"{epoch},0.9,{accuracy}\n" for epoch, accuracy in enumerate(accuracies)))


def test_time_to_accuracy_counts_the_steps_to_the_baselines_final_validation_accuracy(tmp_path):
    from keras_vitnorm.study.time_to_accuracy import time_to_accuracy_table

    curves = {"base": [[0.5, 0.6, 0.7, 0.72], [0.5, 0.62, 0.69, 0.70]],  # target 0.71
              "fast": [[0.6, 0.71, 0.75, 0.76], [0.65, 0.72, 0.74, 0.75]],
              "slow": [[0.4, 0.5, 0.6, 0.72], [0.4, 0.5, 0.6, 0.65]]}
    rows = []
    for variant, runs_ in curves.items():
        for seed, curve in enumerate(runs_):
            run_dir = str(tmp_path / variant / str(seed))
            # 4 evaluations every 100 steps, the last epoch shorter: 350 steps in 70 s
            fake_run(run_dir, curve, 100, 350, 70.0)
            rows.append({"group": "g", "variant": variant, "seed": seed, "status": "completed",
                         "val_accuracy": curve[-1], "test_accuracy": curve[-1],
                         "run_dir": run_dir})
    lines = time_to_accuracy_table(rows).splitlines()
    assert lines[0].startswith("| variant | runs reaching 71.00% | steps to it per run")
    # base: 350 (0.72 at the shorter last epoch) and never (0.70 < 0.71: censored at 350);
    # half the runs arrive by 350, the Kaplan-Meier median (tests/test_overview.py)
    assert lines[2] == "| base | 1 of 2 | 350, >350 | 350 | 1.00x | 70 |"
    assert lines[3] == "| fast | 2 of 2 | 200, 200 | 200 | 0.57x | 40 |"
    assert lines[4] == "| slow | 1 of 2 | 350, >350 | 350 | 1.00x | 70 |"
    # without logs (results exported without run files) there is no table
    assert time_to_accuracy_table([dict(r, run_dir=str(tmp_path / "none")) for r in rows]) == ""
    tables.write_results(rows, str(tmp_path / "study"))
    assert (tmp_path / "study" / "g_time_to_accuracy.md").read_text() == "\n".join(lines) + "\n"
