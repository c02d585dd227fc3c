"""Copying a study's results, without weights, to another directory (docs/study.md)."""

import gzip
import os
import shutil

from keras_vitnorm import durable
from keras_vitnorm.study.one_run import COMPRESSED_GRAD_NORMS_FILE
from keras_vitnorm.study.one_run import GRAD_NORMS_FILE
from keras_vitnorm.study.one_run import RUN_RESULT_FILES
from keras_vitnorm.study.one_run import is_finished
from keras_vitnorm.study.overview import STEP_TIMES_FILE
from keras_vitnorm.training.run_layout import METRICS_FILE


def export_study(study_dir, destination):
    """Copies a study's settings, result files, step times (`STEP_TIMES_FILE`), tables,
    figures and the `RUN_RESULT_FILES` of every finished run into `destination`; returns
    the number of runs copied. Unfinished runs are left out: they could not resume without
    their checkpoints. A run's `grad_norms.csv` is kept gzip-compressed, as
    `grad_norms.csv.gz`, byte for byte the same at every export of the same run."""
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
        source, target = os.path.join(study_dir, relative), os.path.join(destination, relative)
        os.makedirs(os.path.dirname(target), exist_ok=True)
        if os.path.basename(relative) != GRAD_NORMS_FILE:
            durable.write_file(target, lambda temporary: shutil.copyfile(source, temporary))
            return
        durable.write_file(target + ".gz", lambda temporary: compress(source, temporary))
        if os.path.exists(target):  # left by an export that copied it uncompressed
            os.remove(target)

    runs = 0
    for root, directories, files in os.walk(study_dir):
        directories[:] = sorted(d for d in directories
                                if d not in ("preset", "checkpoints", "backup", "tensorboard"))
        relative_root = os.path.relpath(root, study_dir)
        if relative_root == ".":
            kept = [name for name in sorted(files) if name.endswith(".md") or name in (
                "study_config.json", "results.csv", "lr_sweep.csv", "fewshot.csv",
                STEP_TIMES_FILE)]
        elif relative_root.split(os.sep)[0] == "figures":
            kept = [name for name in sorted(files) if name.endswith((".png", ".md"))]
        else:
            if METRICS_FILE not in files or not is_finished(root):
                continue
            kept = [name for name in RUN_RESULT_FILES + (COMPRESSED_GRAD_NORMS_FILE,)
                    if name in files]
            runs += 1
        for name in kept:
            copy(os.path.normpath(os.path.join(relative_root, name)))
    return runs


def compress(source, target):
    """Writes `source` gzip-compressed to `target`, with no name or time in the header,
    so that the same file always gives the same bytes."""
    with open(source, "rb") as plain, open(target, "wb") as raw:
        with gzip.GzipFile(filename="", mode="wb", fileobj=raw, mtime=0) as packed:
            shutil.copyfileobj(plain, packed)
