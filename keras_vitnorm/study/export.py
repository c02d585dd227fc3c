"""Copying a study's results, without weights, to another directory (docs/study.md)."""

import os
import shutil

from keras_vitnorm import durable
from keras_vitnorm.study.one_run import RUN_RESULT_FILES
from keras_vitnorm.study.one_run import is_finished
from keras_vitnorm.training.run_layout import METRICS_FILE


def export_study(study_dir, destination):
    """Copies a study's settings, result files, tables, figures and the `RUN_RESULT_FILES`
    of every finished run into `destination`; returns the number of runs copied. Unfinished
    runs are left out: they could not resume without their checkpoints."""
    if not os.path.isfile(os.path.join(study_dir, "study_config.json")):
        raise ValueError(f"{study_dir!r} is not a study directory (no study_config.json).")
    study, target = os.path.abspath(study_dir), os.path.abspath(destination)
    if target == study:
        raise ValueError("export_study needs a destination other than the study directory.")
    if os.path.commonpath([target, study]) == study:
        raise ValueError(f"export_study's destination {destination!r} lies inside the study "
                         f"{study_dir!r}, whose copy would hold itself: choose one outside it.")
    saved = durable.read_json(os.path.join(destination, "study_config.json"))
    if saved is not None and saved != durable.read_json(os.path.join(study, "study_config.json")):
        raise ValueError(f"{destination!r} holds another study (its study_config.json differs "
                         f"from {study_dir!r}'s): the two studies' runs would mix. Export to "
                         "another directory.")

    def copy(relative):
        target = os.path.join(destination, relative)
        os.makedirs(os.path.dirname(target), exist_ok=True)
        durable.write_file(target, lambda temporary: shutil.copyfile(
            os.path.join(study_dir, relative), temporary))

    runs = 0
    for root, directories, files in os.walk(study_dir):
        directories[:] = sorted(d for d in directories
                                if d not in ("preset", "checkpoints", "backup", "tensorboard"))
        relative_root = os.path.relpath(root, study_dir)
        if relative_root == ".":
            kept = [name for name in sorted(files) if name.endswith(".md") or name in (
                "study_config.json", "results.csv", "lr_sweep.csv", "fewshot.csv")]
        elif relative_root.split(os.sep)[0] == "figures":
            kept = [name for name in sorted(files) if name.endswith((".png", ".md"))]
        else:
            if METRICS_FILE not in files or not is_finished(root):
                continue
            kept = [name for name in RUN_RESULT_FILES if name in files]
            runs += 1
        for name in kept:
            copy(os.path.normpath(os.path.join(relative_root, name)))
    return runs
