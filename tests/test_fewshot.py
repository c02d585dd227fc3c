"""Few-shot linear transfer of a study's models (`keras_vitnorm.study.fewshot`): the
least-squares solver, the draws, the per-run cache, the tables and the command."""

import csv
import json
import math
import os

import numpy as np
import pytest

from keras_vitnorm import cli
from keras_vitnorm import durable
from keras_vitnorm.study import fewshot
from keras_vitnorm.study import tables
from keras_vitnorm.study.fewshot_lsr import few_shot_draws
from keras_vitnorm.study.fewshot_lsr import fit_least_squares
from test_study import TINY
from test_training import run_python

#: A request small enough for tiny models on digits (8 + 2 images per class per fit).
SMALL = {"shots": (2, 3), "draws": 2, "test_examples": 40, "verbose": 0}


def make_study(tmp_path, variants=("patch", "dual_patchnorm"), seeds=(0, 1), group="stems"):
    """A study directory as `ablate` leaves it, as far as `fewshot` reads it: results.csv
    and, per completed run, a saved preset (an untrained tiny model for digits)."""
    from keras_vitnorm import ViT

    study = str(tmp_path / "study")
    rows = []
    for variant in variants:
        for seed in seeds:
            run_dir = os.path.join(study, group, variant, f"seed_{seed}")
            stem = variant if variant in ("patch", "dual_patchnorm") else "patch"
            ViT(**TINY, num_channels=1, num_classes=10, stem=stem).save_to_preset(
                os.path.join(run_dir, "preset"))
            rows.append({"group": group, "variant": variant, "seed": seed,
                         "status": "completed", "learning_rate": 1e-3, "run_dir": run_dir})
    tables.write_rows(rows, study, "results.csv")
    return study, rows


def normal_equations_weights(features, labels, num_classes, l2):
    """The ridge weights of big_vision's few-shot classifier, solved directly."""
    x = (features - features.mean(0)) / (features.std(0) + 1e-5)
    x = np.concatenate([x, np.full((len(x), 1), 100.0)], axis=1)
    y = 2.0 * np.eye(num_classes)[labels] - 1.0
    return np.linalg.solve(x.T @ x + l2 * np.eye(x.shape[1]), x.T @ y), x


@pytest.mark.one_backend
@pytest.mark.parametrize("images, width", [(60, 8), (12, 40)])
def test_least_squares_weights_solve_the_regularized_normal_equations(images, width):
    """Both of big_vision's forms (more images than features, and fewer) give the
    direct solution of `(X^T X + l2 I) W = X^T Y`."""
    rng = np.random.default_rng(0)
    features = rng.normal(2.0, 3.0, (images, width))
    labels = np.arange(images) % 3
    for l2 in (2.0**10, 0.5):
        classifier = fit_least_squares(features, labels, 3, l2)
        expected, design = normal_equations_weights(features, labels, 3, l2)
        np.testing.assert_allclose(classifier.weights, expected, rtol=1e-7, atol=1e-10)
        np.testing.assert_array_equal(classifier.predict(features), np.argmax(design @ expected, 1))
    assert not np.allclose(fit_least_squares(features, labels, 3, 1.0).weights, expected)


@pytest.mark.one_backend
def test_least_squares_classifies_separable_features_perfectly_and_checks_its_input():
    rng = np.random.default_rng(1)
    centers = rng.normal(0, 5, (10, 64))

    def sample(per_class):
        labels = np.repeat(np.arange(10), per_class)
        return centers[labels] + rng.normal(0, 0.5, (len(labels), 64)), labels

    classifier = fit_least_squares(*sample(5), num_classes=10)
    assert classifier.accuracy(*sample(100)) == 1.0
    shuffled = fit_least_squares(sample(5)[0], rng.permutation(np.repeat(np.arange(10), 5)), 10)
    assert shuffled.accuracy(*sample(100)) < 0.5
    with pytest.raises(ValueError, match=r"labels must lie in \[0, 3\), got 0 to 3"):
        fit_least_squares(np.ones((4, 2)), [0, 1, 2, 3], 3)
    with pytest.raises(ValueError,
                       match=r"one label per image, got features \(4, 2\) and labels \(3,\)"):
        fit_least_squares(np.ones((4, 2)), [0, 1, 2], 3)
    with pytest.raises(ValueError, match="l2_regularization must be positive, got 0"):
        fit_least_squares(np.ones((4, 2)), [0, 1, 2, 0], 3, 0)


@pytest.mark.one_backend
def test_draws_take_shots_of_every_class_by_seed_and_nest_the_shot_counts():
    labels = np.random.default_rng(2).integers(0, 3, 60)
    draws = few_shot_draws(labels, 3, 5, 4)
    assert draws.shape == (4, 3, 5)
    for draw in draws:
        for label, indices in enumerate(draw):
            assert len(set(indices)) == 5 and (labels[indices] == label).all()
    np.testing.assert_array_equal(draws, few_shot_draws(labels, 3, 5, 4))
    rng = np.random.default_rng(1)  # draw 1: big_vision's permutation of each class, seed 1
    np.testing.assert_array_equal(
        draws[1], [rng.permutation(np.flatnonzero(labels == label))[:5] for label in range(3)])
    np.testing.assert_array_equal(draws[:2], few_shot_draws(labels, 3, 5, 2))
    assert all(not np.array_equal(draws[a], draws[b]) for a in range(4) for b in range(a))
    np.testing.assert_array_equal(few_shot_draws(labels, 3, 2, 4), draws[:, :, :2])
    uneven = np.array([0] * 6 + [1] * 3 + [2] * 6)
    with pytest.raises(ValueError, match=r"4 shots need 4 training images of every class; "
                       r"class\(es\) 'b' \(3\) have fewer"):
        few_shot_draws(uneven, 3, 4, 1, class_names=["a", "b", "c"])
    assert few_shot_draws(uneven, 3, 3, 1).shape == (1, 3, 3)


def test_pooled_features_are_what_the_classifier_head_reads():
    import keras

    from keras_vitnorm import ViT

    model = ViT(**TINY, num_classes=4)
    head = model.get_layer("head")
    head.kernel.assign(np.random.default_rng(3).normal(size=head.kernel.shape).astype("float32"))
    images = np.random.default_rng(4).uniform(-1, 1, (6, 16, 16, 3)).astype("float32")
    features = fewshot.pooled_features(model, [(images[:4],), (images[4:],)])
    assert features.shape == (6, 32)
    logits = keras.ops.convert_to_numpy(head(features))
    np.testing.assert_allclose(logits, model.predict(images, verbose=0), rtol=1e-4, atol=1e-4)
    assert np.abs(logits).max() > 1e-2


def test_fewshot_scores_each_completed_run_once_and_writes_the_tables(tmp_path):
    study, rows = make_study(tmp_path)
    shared = {**rows[0], "group": "other", "variant": "pre_ln"}  # a run two groups share
    diverged = {**rows[1], "variant": "post_ln", "status": "diverged",
                "run_dir": os.path.join(study, "missing")}
    tables.write_rows(rows + [shared, diverged], study, "results.csv")
    written = fewshot.write_fewshot(study, "digits", **SMALL)
    assert list(written) == ["stems", "other"]
    with open(os.path.join(study, "fewshot.csv"), newline="") as f:
        records = list(csv.DictReader(f))
    assert len(records) == (4 + 1) * 2 * 2  # runs x shot counts x draws
    accuracies = np.array([float(r["accuracy"]) for r in records])
    assert ((accuracies >= 0) & (accuracies <= 1)).all() and len(set(accuracies)) > 2
    assert {r["test_images"] for r in records} == {"40"}
    assert records[0]["run_dir"] == os.path.join("stems", "patch", "seed_0")
    patch_3 = [float(r["accuracy"]) for r in records
               if r["group"] == "stems" and r["variant"] == "patch" and r["shots"] == "3"]
    table = open(os.path.join(study, "stems_fewshot.md")).read()
    assert table == written["stems"]
    patch_3_runs = fewshot.mean_ci_text(np.mean(np.reshape(patch_3, (2, 2)), axis=1))
    assert f"| patch | 2 | {patch_3_runs} |" in table
    # a variant whose runs diverged stays in its place
    assert f"| post_ln | 0 | n/a | {patch_3_runs} | n/a | n/a | n/a |" in table
    shared_result = durable.read_json(os.path.join(rows[0]["run_dir"], "analysis.json"))
    assert len(shared_result["fewshot"]) == 1


@pytest.mark.one_backend
def test_every_model_is_fitted_on_the_same_images_and_the_draws_differ(tmp_path, monkeypatch):
    study, _ = make_study(tmp_path)
    # Features that are the images themselves: what each fit receives names its images.
    monkeypatch.setattr(fewshot, "pooled_features", lambda model, batches, progress=None:
                        np.concatenate([np.reshape(b[0], (len(b[0]), -1)) for b in batches]))
    fits = []

    def recording(features, labels, num_classes, l2):
        fits.append((features.copy(), labels.copy()))
        return fit_least_squares(features, labels, num_classes, l2)

    monkeypatch.setattr(fewshot, "fit_least_squares", recording)
    fewshot.write_fewshot(study, "digits", **SMALL)
    per_run = len(fits) // 4
    assert per_run == 2 * 2  # shot counts x draws
    for run in range(1, 4):
        for (features, labels), (first, first_labels) in zip(fits[run * per_run:], fits[:per_run]):
            np.testing.assert_array_equal(features, first)
            np.testing.assert_array_equal(labels, first_labels)
    (two_a, labels), (two_b, _), (three_a, _), _ = fits[:per_run]
    np.testing.assert_array_equal(labels, np.repeat(np.arange(10), 2))
    assert not np.array_equal(two_a, two_b)  # draw 0 and draw 1
    np.testing.assert_array_equal(two_a, three_a.reshape(10, 3, -1)[:, :2].reshape(20, -1))


@pytest.mark.one_backend
def test_results_are_kept_in_analysis_json_and_a_new_request_recomputes(tmp_path, monkeypatch):
    from keras_vitnorm import ViT

    study, rows = make_study(tmp_path, variants=("patch",), seeds=(0,))
    analysis = os.path.join(rows[0]["run_dir"], "analysis.json")
    durable.write_json(analysis, {"stem_scale": None, "patch_statistics": {"requested": 5}})
    loads = []
    original = ViT.from_preset
    monkeypatch.setattr(ViT, "from_preset", lambda *a, **k: loads.append(a) or original(*a, **k))

    first = fewshot.write_fewshot(study, "digits", **SMALL)
    assert len(loads) == 1
    assert fewshot.write_fewshot(study, "digits", **SMALL) == first and len(loads) == 1
    for change in ({"draws": 3}, {"test_examples": 30}, {"shots": (2,)}):
        fewshot.write_fewshot(study, "digits", **{**SMALL, **change})
    assert len(loads) == 4
    kept = durable.read_json(analysis)
    assert kept["patch_statistics"] == {"requested": 5} and kept["stem_scale"] is None
    assert len(kept["fewshot"]) == 4
    requests = [json.loads(key) for key in kept["fewshot"]]
    assert sorted(r["draws"] for r in requests) == [2, 2, 2, 3]
    # Without the weights the kept result is the table's; another request has none.
    import shutil

    shutil.rmtree(os.path.join(rows[0]["run_dir"], "preset"))
    assert fewshot.write_fewshot(study, "digits", **SMALL) == first and len(loads) == 4
    with pytest.raises(ValueError,
                       match="No completed run of .* has a preset or a few-shot result"):
        fewshot.write_fewshot(study, "digits", **{**SMALL, "draws": 4})


@pytest.mark.one_backend
def test_fewshot_table_is_the_hand_computed_mean_difference_and_holm_p_value():
    from scipy import stats

    def run(ten, twenty_five):
        return {"accuracy": {"10": ten, "25": twenty_five}}

    base = [run([0.50, 0.54], [0.6, 0.6]), run([0.60, 0.62], [0.7, 0.7]),
            run([0.55, 0.55], [0.65, 0.65])]
    better = [run([0.70, 0.70], [0.8, 0.8]), run([0.74, 0.76], [0.82, 0.82]),
              run([0.72, 0.72], [0.81, 0.81])]
    same = [run([0.52, 0.56], [0.6, 0.6]), run([0.58, 0.60], [0.7, 0.7])]
    text = fewshot.fewshot_table({"patch": base, "dpn": better, "conv": same, "none": []}, [10, 25])
    b, d, c = [0.52, 0.61, 0.55], [0.70, 0.75, 0.72], [0.54, 0.59]  # 10-shot run means

    def interval(values):
        half = stats.t.ppf(0.975, len(values) - 1) * np.std(values, ddof=1) / math.sqrt(len(values))
        return f"{100 * np.mean(values):.2f} ± {100 * half:.2f}"

    def welch(x, y):
        va, vb = np.var(x, ddof=1) / len(x), np.var(y, ddof=1) / len(y)
        df = (va + vb) ** 2 / (va**2 / (len(x) - 1) + vb**2 / (len(y) - 1))
        return np.mean(x) - np.mean(y), stats.t.ppf(0.975, df) * math.sqrt(va + vb)

    p_d = stats.ttest_ind(d, b, equal_var=False).pvalue
    p_c = stats.ttest_ind(c, b, equal_var=False).pvalue
    low, high = sorted([p_d, p_c])  # Holm over two: the smaller doubled, then at least that
    holm = {low: min(1.0, 2 * low), high: max(min(1.0, 2 * low), high)}

    def p_text(p, adjusted=False):
        return ("<0.001" if p < 0.0005 else f"{p:.3f}") + (" *" if adjusted and p < 0.05 else "")

    def difference(x, y):
        gain, half = welch(x, y)
        return f"{100 * gain:+.2f} ± {100 * half:.2f}" + (" *" if abs(gain) > half else "")

    section = text.split("25 training images per class")[0]
    assert ("| variant | runs | 10-shot accuracy (%), mean ± 95% CI | patch (%) | difference, "
            "points (Welch 95% CI) | p (Welch) | p, Holm-adjusted over 2 comparisons |") in section
    assert f"| patch | 3 | {interval(b)} | {interval(b)} | baseline |  |  |" in section
    assert (f"| dpn | 3 | {interval(d)} | {interval(b)} | {difference(d, b)} | {p_text(p_d)} "
            f"| {p_text(holm[p_d], adjusted=True)} |") in section
    assert (f"| conv | 2 | {interval(c)} | {interval(b)} | {difference(c, b)} | {p_text(p_c)} "
            f"| {p_text(holm[p_c], adjusted=True)} |") in section
    assert f"| none | 0 | n/a | {interval(b)} | n/a | n/a | n/a |" in section
    assert "| 25-shot accuracy (%)" in text
    assert f"| patch | 3 | {interval([0.6, 0.7, 0.65])} |" in text
    assert fewshot.fewshot_table({"patch": [], "dpn": []}, [10]) == ""
    no_baseline = fewshot.fewshot_table({"patch": [], "dpn": better}, [10])
    assert "| patch | 0 | n/a | n/a | baseline |  |  |" in no_baseline
    assert f"| dpn | 3 | {interval(d)} | n/a | n/a | n/a | n/a |" in no_baseline


@pytest.mark.one_backend
def test_the_command_names_each_bad_value(tmp_path, capsys):
    study, rows = make_study(tmp_path, variants=("patch",), seeds=(0,))

    def error(*argv):
        assert cli.main(["fewshot", *argv, "--verbose", "0"]) == 2
        return capsys.readouterr().err.strip()

    empty = tmp_path / "empty"
    empty.mkdir()
    assert f"{empty} holds no results.csv" in error(str(empty), "--dataset", "digits")
    assert "shots must be one or more positive integers (training images per class), got [10, 0]" \
        in error(study, "--dataset", "digits", "--shots", "10", "0")
    assert "draws must be a positive integer, got 0" in error(study, "--dataset", "digits",
                                                              "--draws", "0")
    assert "test_examples must be a positive integer" in error(study, "--dataset", "digits",
                                                               "--test-examples", "-3")
    assert "Unknown dataset='cifar'. Valid forms: digits, tfds:<name>, folder:<path>" in error(
        study, "--dataset", "cifar")
    assert "few-shot draws need every training label" in error(study, "--dataset", "tfds:cifar10")
    assert "dataset='digits': 500 shots need 500 training images of every class; class(es) '0' (" \
        in error(study, "--dataset", "digits", "--shots", "500")
    assert "test_examples=9999 is more than the 360 test images of digits" in error(
        study, "--dataset", "digits", "--test-examples", "9999")
    tables.write_rows([{**rows[0], "status": "diverged"}], study, "results.csv")
    assert "lists no completed run to evaluate" in error(study, "--dataset", "digits")
    assert not os.path.exists(os.path.join(study, "fewshot.csv"))


@pytest.mark.one_backend
def test_the_command_prints_and_writes_the_tables(tmp_path, capsys):
    study, rows = make_study(tmp_path, variants=("patch", "dual_patchnorm"), seeds=(0,))
    assert cli.main(["fewshot", study, "--dataset", "digits", "--shots", "2", "--draws", "2",
                     "--test-examples", "40", "--batch-size", "16", "--verbose", "0"]) == 0
    out = capsys.readouterr().out
    assert open(os.path.join(study, "stems_fewshot.md")).read() in out
    assert out.strip().endswith(f"written: {os.path.join(study, 'stems_fewshot.md')}, "
                                f"{os.path.join(study, 'fewshot.csv')}")
    assert "| dual_patchnorm | 1 |" in out


@pytest.mark.one_backend
def test_fewshot_help_imports_no_backend_and_the_command_needs_the_study_extra(monkeypatch, capsys):
    from keras_vitnorm.cli import errors

    result = run_python("""
        import sys
        from keras_vitnorm import cli
        try:
            cli.main(["fewshot", "--help"])
        except SystemExit as exit:
            assert exit.code == 0
        print(sorted(m for m in ("keras", "tensorflow", "jax", "torch") if m in sys.modules))
    """, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().splitlines()[-1] == "[]"
    assert "--test-examples N" in result.stdout
    monkeypatch.setitem(errors.EXTRAS, "study", (("not-installed", "no_such_module_here"),))
    assert cli.main(["fewshot", "s", "--dataset", "digits"]) == 2
    assert capsys.readouterr().err.strip() == (
        "keras-vitnorm fewshot: error: this command needs the 'study' extra: pip install "
        "'keras-vitnorm[study]' (missing: not-installed).")


@pytest.mark.one_backend
def test_an_exported_study_keeps_the_fewshot_results_and_redraws_the_tables(tmp_path):
    from keras_vitnorm.study import export_study

    study, rows = make_study(tmp_path, variants=("patch", "dual_patchnorm"), seeds=(0,))
    durable.write_json(os.path.join(study, "study_config.json"), {})
    for row in rows:
        durable.write_json(os.path.join(row["run_dir"], "metrics.json"), {"status": "completed"})
    written = fewshot.write_fewshot(study, "digits", **SMALL)
    exported = str(tmp_path / "exported")
    assert export_study(study, exported) == 2
    assert not os.path.exists(os.path.join(exported, "stems", "patch", "seed_0", "preset"))
    with open(os.path.join(study, "fewshot.csv")) as f, \
            open(os.path.join(exported, "fewshot.csv")) as g:
        assert f.read() == g.read()
    os.remove(os.path.join(exported, "stems_fewshot.md"))
    assert fewshot.write_fewshot(exported, "digits", **SMALL) == written
    assert open(os.path.join(exported, "stems_fewshot.md")).read() == written["stems"]


@pytest.mark.one_backend
def test_a_folder_dataset_draws_from_all_of_train_and_scores_on_test(tmp_path):
    from PIL import Image

    rng = np.random.default_rng(5)
    for label in ("cat", "dog"):
        for split, count in (("train", 6), ("test", 2)):
            os.makedirs(tmp_path / "images" / split / label)
            for i in range(count):
                pixels = rng.integers(0, 256, (8, 8, 3), dtype=np.uint8)
                Image.fromarray(pixels).save(tmp_path / "images" / split / label / f"{i}.png")
    dataset = f"folder:{tmp_path / 'images'}"
    # load_dataset holds 1 image of each class out of train/ for validation: both are drawn.
    transfer = fewshot.TransferData(dataset, shots=(2, 6), draws=2, batch_size=4)
    assert transfer.train.size == 12 and transfer.test.size == 4
    assert sorted(os.path.basename(os.path.dirname(p)) for p in transfer.test.arrays[0]) == \
        ["cat", "cat", "dog", "dog"]
    assert all(os.sep + "train" + os.sep in p for p in transfer.train.arrays[0])
    with pytest.raises(ValueError, match=r"7 shots need 7 training images of every class; "
                       r"class\(es\) 'cat' \(6\), 'dog' \(6\) have fewer"):
        fewshot.TransferData(dataset, shots=(7,), draws=1)


def test_the_table_names_an_image_folder_not_its_path(tmp_path):
    """A study's tables travel with its results: the header names the image folder it was
    scored on by the folder's own name, never by its path on the scoring machine."""
    from types import SimpleNamespace

    folder = tmp_path / "private" / "cifar10"
    rows = [{"group": "core", "variant": v, "seed": str(s), "learning_rate": "0.001",
             "status": "completed", "run_dir": str(tmp_path / f"{v}-{s}")}
            for v in ("pre_ln", "dyt") for s in range(2)]
    found = {row["run_dir"]: {"accuracy": {"2": [0.3 + 0.01 * i, 0.31]}, "test_images": 4}
             for i, row in enumerate(rows)}
    transfer = SimpleNamespace(
        request={"dataset": f"folder:{folder}", "shots": (2,), "draws": 2,
                 "l2_regularization": 1024.0},
        shots=(2,), test=SimpleNamespace(size=4))
    tables = fewshot._write_outputs(str(tmp_path), rows, found, transfer)
    written = (tmp_path / "core_fewshot.md").read_text()
    assert written == tables["core"]
    assert "Few-shot linear transfer to the image folder 'cifar10': " in written
    assert str(tmp_path) not in written
