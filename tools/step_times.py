"""Writes a study's `step_times.json` from a `benchmarks/bench_variants.py --json` file.

    python tools/step_times.py bench.json:tensorflow --study runs/cpu --group core \\
        [--name STUDY_VARIANT=BENCH_VARIANT ...]

The study's `<group>_overview.md` and `<group>_time_to_accuracy.md`
(`keras_vitnorm.study.overview`) turn steps into seconds with these step times,
measured alone, in place of the runs' own rates, which count whatever shared the
device with them. Redraw the tables afterwards (`keras-vitnorm ablate ... --tables-only`).

Each variant of the group (from the study's `results.csv`) gets the median over the
benchmark's rounds of its training-step seconds on BACKEND, under the same name in
the benchmark or the one `--name` maps it to. A variant the benchmark lacks, or a
benchmark measured at another batch size than the study's, is an error. Entries the
file already holds for other variants (another group's) are kept.
"""

import argparse
import csv
import os
import statistics
import sys

ROOT = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(ROOT))
sys.path.insert(0, ROOT)

from efficiency_table import step_time  # noqa: E402

from keras_vitnorm import durable  # noqa: E402
from keras_vitnorm.study.overview import STEP_TIMES_FILE  # noqa: E402
from keras_vitnorm.study.overview import read_step_times  # noqa: E402


def group_variants(study_dir, group):
    """The group's variants in `<study_dir>/results.csv`, baseline first."""
    path = os.path.join(study_dir, "results.csv")
    if not os.path.exists(path):
        raise ValueError(f"{path} does not exist: give the folder of a study that has results")
    with open(path, newline="") as f:
        rows = list(csv.DictReader(f))
    variants = list(dict.fromkeys(r["variant"] for r in rows if r["group"] == group))
    if not variants:
        raise ValueError(f"group {group!r} is not in {path}; it has "
                         + ", ".join(dict.fromkeys(r["group"] for r in rows)))
    return variants


def _check_batch_size(spec, study_dir):
    path = spec.rpartition(":")[0]
    measured = (durable.read_json(path) or {}).get("arguments", {}).get("batch_size")
    study = durable.read_json(os.path.join(study_dir, "study_config.json")) or {}
    if measured is not None and study.get("batch_size") not in (None, measured):
        raise ValueError(f"{path} measured batch {measured}, the study in {study_dir} trains "
                         f"batch {study['batch_size']}: its step times are not the study's")


def step_times(spec, study_dir, group, names=()):
    """`{variant: seconds per training step}` of the group's variants from `FILE:BACKEND`;
    `names`: `STUDY_VARIANT=BENCH_VARIANT` pairs for variants named otherwise there."""
    mapping = {}
    for pair in names:
        study_name, sep, bench_name = pair.partition("=")
        if not sep or not study_name or not bench_name:
            raise ValueError(f"--name {pair!r}: give STUDY_VARIANT=BENCH_VARIANT")
        mapping[study_name] = bench_name
    variants = group_variants(study_dir, group)
    unknown = sorted(set(mapping) - set(variants))
    if unknown:
        raise ValueError(f"--name maps {', '.join(unknown)}, not variants of {group!r} "
                         f"({', '.join(variants)})")
    try:
        _check_batch_size(spec, study_dir)
        seconds = step_time(spec)[1] or {}  # {} where it lacks the baseline
    except (KeyError, TypeError, AttributeError) as error:
        raise ValueError(f"{spec.rpartition(':')[0]} is not a bench_variants.py --json file "
                         f"({type(error).__name__}: {error})") from None
    missing = [v for v in variants if mapping.get(v, v) not in seconds]
    if missing:
        raise ValueError(f"{spec} has no training-step time of "
                         + ", ".join(f"{v!r}" + (f" (as {mapping[v]!r})" if v in mapping else "")
                                     for v in missing)
                         + f" of group {group!r}; it measured {', '.join(seconds)} "
                         "(map a name with --name STUDY_VARIANT=BENCH_VARIANT)")
    return {v: statistics.median(seconds[mapping.get(v, v)]) for v in variants}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("benchmark", help="FILE:BACKEND, a bench_variants.py --json file and "
                                          "the backend whose training-step times to take")
    parser.add_argument("--study", required=True, help="the study folder (results.csv)")
    parser.add_argument("--group", required=True, help="the study's variant group")
    parser.add_argument("--name", action="append", default=[],
                        help="STUDY_VARIANT=BENCH_VARIANT, for a variant named otherwise in "
                             "the benchmark (repeat for several)")
    args = parser.parse_args(argv)
    try:
        found = step_times(args.benchmark, args.study, args.group, args.name)
        known = read_step_times(args.study, []) or {}
    except (OSError, ValueError) as error:
        parser.error(str(error))
    path = os.path.join(args.study, STEP_TIMES_FILE)
    durable.write_json(path, {**known, **found})
    for variant, seconds in found.items():
        print(f"{variant}: {1000 * seconds:.1f} ms per step")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
