"""Writes a study's `step_times.json` from `benchmarks/bench_variants.py --json` files.

    python tools/step_times.py bench.json:tensorflow [bench2.json:tensorflow ...] \\
        --study runs/cpu --group core [--name STUDY_VARIANT=BENCH_VARIANT ...]

The study's `<group>_overview.md` and `<group>_time_to_accuracy.md`
(`keras_vitnorm.study.overview`) turn steps into seconds with these step times,
measured alone, in place of the runs' own rates, which count whatever shared the
device with them. Redraw the tables afterwards (`keras-vitnorm ablate ... --tables-only`).

The group's baseline (its first variant in the study's `results.csv`) gets the median
of its training-step seconds on BACKEND over every round of every file; each other
variant gets the baseline's figure times the median, over the same rounds, of its
ratio to the baseline within the round. A round of `bench_variants.py` times each
variant in turn, so the ratio within it cancels the host's load drifting between
rounds and between benchmarks run at different times; a single round where the host
was busy moves the median of the ratios little. Variants are looked up under the same
name in the benchmarks or the one `--name` maps them to. A variant a benchmark lacks
or timed in fewer rounds than the baseline, or a benchmark measured at another batch
size than the study's, is an error. Entries the file already holds for other variants
(another group's) are kept.
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


def _round_seconds(spec, study_dir, group, variants, mapping):
    """`{variant: [seconds of each round]}` of one `FILE:BACKEND`, in the study's names."""
    path = spec.rpartition(":")[0]
    try:
        _check_batch_size(spec, study_dir)
        seconds = step_time(spec)[1] or {}  # {} where it lacks the baseline
    except (KeyError, TypeError, AttributeError) as error:
        raise ValueError(f"{path} is not a bench_variants.py --json file "
                         f"({type(error).__name__}: {error})") from None
    missing = [v for v in variants if mapping.get(v, v) not in seconds]
    if missing:
        raise ValueError(f"{spec} has no training-step time of "
                         + ", ".join(f"{v!r}" + (f" (as {mapping[v]!r})" if v in mapping else "")
                                     for v in missing)
                         + f" of group {group!r}; it measured {', '.join(seconds)} "
                         "(map a name with --name STUDY_VARIANT=BENCH_VARIANT)")
    rounds = {v: list(seconds[mapping.get(v, v)]) for v in variants}
    baseline = variants[0]
    for variant, times in rounds.items():
        if len(times) != len(rounds[baseline]):
            raise ValueError(f"{path} measured {mapping.get(variant, variant)!r} in "
                             f"{len(times)} round(s) and the baseline "
                             f"{mapping.get(baseline, baseline)!r} in {len(rounds[baseline])}: "
                             "its rounds cannot be paired")
    return rounds


def step_times(specs, study_dir, group, names=()):
    """`{variant: seconds per training step}` of the group's variants from the
    `FILE:BACKEND` benchmarks `specs`, the baseline's median times each variant's median
    ratio to it within a round; `names`: `STUDY_VARIANT=BENCH_VARIANT` pairs for variants
    named otherwise there."""
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
    rounds = {v: [] for v in variants}
    for spec in specs:
        for variant, times in _round_seconds(spec, study_dir, group, variants, mapping).items():
            rounds[variant].extend(times)
    baseline = rounds[variants[0]]
    baseline_seconds = statistics.median(baseline)
    return {v: baseline_seconds * statistics.median([t / b for t, b in zip(rounds[v], baseline)])
            for v in variants}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("benchmarks", nargs="+", metavar="FILE:BACKEND",
                        help="bench_variants.py --json files, each with the backend whose "
                             "training-step times to take")
    parser.add_argument("--study", required=True, help="the study folder (results.csv)")
    parser.add_argument("--group", required=True, help="the study's variant group")
    parser.add_argument("--name", action="append", default=[],
                        help="STUDY_VARIANT=BENCH_VARIANT, for a variant named otherwise in "
                             "the benchmark (repeat for several)")
    args = parser.parse_args(argv)
    try:
        found = step_times(args.benchmarks, args.study, args.group, args.name)
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
