"""Each implementation's largest training batch that fits on the GPU, for docs/performance.md.

    python tools/gpu/largest_batch.py --device gpu --preset b16 --batch-size 256 \
        --mixed-precision mixed_bfloat16 --backends jax torch --timm eager compiled \
        --seconds 270 --known b16.json

Takes benchmarks/bench_vit.py's options (the implementations, the model, the
precision) and searches each implementation's largest training batch: doubling from
`--batch-size`, then bisecting to within a sixteenth, each guess replaced by the
batch that the measured peaks predict (a step's peak memory is close to affine in
the batch) where that lies inside the bracket. Every try is a fresh bench_vit.py
worker (its first call and one more step), so that running out of memory leaves
nothing behind; JAX may use 95% of the GPU there instead of its default 75%. The
implementations share `--seconds`, the quickest to compile first; a search out of
time reports what it found. `--known` takes bench_vit.py's `--json` of the same
settings, whose training steps count as known fits. On the CPU it needs `--limit`,
since there running out of memory means swapping, not an error. tools/gpu/perf.sh
runs it after docs/performance.md's GPU table.
"""

import argparse
import functools
import json
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir, os.pardir,
                                "benchmarks"))
import bench_vit  # noqa: E402
from _common import check_positive_ints  # noqa: E402
from _common import run_worker  # noqa: E402


def _rounded(batch, lower, granularity):
    """`batch` rounded down to a multiple of `granularity`, unless that is not above `lower`."""
    if batch >= granularity and batch - batch % granularity > lower:
        return batch - batch % granularity
    return batch


def predicted_largest(peaks, capacity):
    """The largest batch that fits by the measured peaks, or None without the data.

    A training step's peak memory is close to affine in the batch: a fixed part
    (weights, gradients, optimizer state) plus activations per example. With two
    fitting batches the line through the two largest gives the batch whose peak
    reaches `capacity`. With one, `batch * capacity / peak` is a lower bound of it
    (the fixed part is not negative).

    Args:
        peaks: dict, batch -> peak bytes of a step that fitted (None where unknown).
        capacity: int or None, the bytes the process could hold.
    """
    points = sorted((batch, peak) for batch, peak in peaks.items() if peak)
    if not capacity or not points:
        return None
    batch, peak = points[-1]
    if len(points) > 1:
        other_batch, other_peak = points[-2]
        per_example = (peak - other_peak) / (batch - other_batch)
        if per_example > 0:
            return int(batch + (capacity - peak) / per_example)
    return int(batch * capacity / peak)


def next_batch(lower, upper, peaks, capacity, start, limit, granularity=8, precision=16):
    """`(batch to try next, None)`, or `(None, why the search ends)`.

    `lower` is the largest batch known to fit, `upper` the smallest known not to
    (None where none is known yet). From `start` the batch doubles until one does
    not fit, then the bracket is bisected until it is within `1/precision` of the
    lower end (or `granularity`). Where the measured peaks predict the largest
    batch (`predicted_largest`), that prediction, kept inside the bracket, is tried
    instead of the doubled or middle batch; a prediction the bracket has already
    refuted gives way to the middle. Batches are multiples of `granularity` where
    they can be.
    """
    if lower is None:
        if upper is None:
            return start, None
        if upper <= 1:
            return None, "nothing fits"
        return _rounded(upper // 2, 0, granularity), None
    if lower >= limit:
        return None, "limit"
    gap = max(granularity, lower // precision)
    if upper is not None and upper - lower <= gap:
        return None, "bracket"
    predicted = predicted_largest(peaks, capacity)
    if upper is None:
        batch = 2 * lower if predicted is None else max(predicted, lower + gap)
    elif predicted is None or predicted >= upper:
        batch = (lower + upper) // 2
    else:
        batch = min(max(predicted, lower + gap), upper - gap)
    return _rounded(min(batch, limit), lower, granularity), None


def largest_batch(try_batch, start, limit, deadline, known=None, clock=time.monotonic,
                  granularity=8, precision=16):
    """The largest training batch that fits, searched with `next_batch`, each try by `try_batch`.

    Args:
        try_batch: `try_batch(batch, seconds)` runs training steps at `batch` (in a
            fresh process) within `seconds` and returns `{"fits": bool, "peak_bytes",
            "capacity_bytes"}` (either may be None), or `{"error": str}` for a failure
            other than running out of memory, with `"timed_out": True` when it ran
            out of time.
        start: int, the first batch to try (the benchmark's batch).
        limit: int, the largest batch to try.
        deadline: float, the `clock()` time after which no try starts; each try gets
            the seconds left, and none starts with less left than the last try took.
        known: dict, batch -> peak bytes (or None) of batches already known to fit.
        clock: the clock of `deadline`.
        granularity, precision: as `next_batch`.

    Returns:
        dict: `largest` (the largest batch that fitted, None if none did),
        `does_not_fit` (the smallest that did not, None if none failed), `known`
        (as given), `tries` (every try's batch and outcome, in order) and `stopped`:
        "bracket" (found to the precision), "limit", "time", "nothing fits" or "error".
    """
    known = dict(known or {})
    peaks = dict(known)
    lower = max(peaks) if peaks else None
    upper, capacity, tries, last_seconds = None, None, [], 0.0
    while True:
        batch, stopped = next_batch(lower, upper, peaks, capacity, start, limit, granularity,
                                    precision)
        if batch is None:
            break
        left = deadline - clock()
        if left <= 0 or left < last_seconds:
            stopped = "time"
            break
        began = clock()
        outcome = try_batch(batch, left)
        last_seconds = clock() - began
        tries.append({"batch": batch, **outcome})
        if "error" in outcome:
            stopped = "time" if outcome.get("timed_out") else "error"
            break
        if outcome["fits"]:
            lower = batch if lower is None else max(lower, batch)
            peaks[batch] = outcome.get("peak_bytes")
            capacity = outcome.get("capacity_bytes") or capacity
        else:
            upper = batch if upper is None else min(upper, batch)
    return {"largest": lower, "does_not_fit": upper, "known": known, "tries": tries,
            "stopped": stopped}


def describe_largest_batch(result):
    """The table cell of a `largest_batch` result, e.g. "1040 (1104 does not fit)"."""
    largest, upper, stopped = result["largest"], result["does_not_fit"], result["stopped"]
    fails = f"; {upper} does not fit" if upper is not None else ""
    if stopped == "nothing fits":
        return "none: 1 does not fit"
    if stopped == "error":
        error = result["tries"][-1]["error"].split(" | ")[-1].replace("|", "/")[:100]
        found = "none found" if largest is None else f">= {largest}"
        return f"{found} (batch {result['tries'][-1]['batch']} failed: {error})"
    if largest is None:
        return f"none found (out of time{fails})"
    if stopped == "bracket":
        return f"{largest} ({upper} does not fit)"
    if stopped == "limit":
        return f">= {largest} (the limit)"
    return f">= {largest} (out of time{fails})"


def largest_batches(runs, results, batch_size, limit, seconds, attempt, clock=time.monotonic):
    """`{label: largest_batch result}` of every implementation of `runs` that did not fail.

    The implementations take turns and share `seconds`: each may use its share of the
    time left when its turn comes, so what one leaves goes to the next. Those whose
    training compiled fastest in the table go first (a try costs about a compilation),
    so that the time the quick ones leave goes to the slow ones. A training result of
    the table at `batch_size` counts as a known fit.

    Args:
        runs: `(label, backend, implementation)` triples, as the benchmark runs them.
        results: `{label: result}` of the benchmark's table (`{"error": ...}` for a failure).
        batch_size, limit: the search's start and its largest batch.
        seconds: float, the time for all the searches together.
        attempt: `attempt(implementation, backend, batch, seconds)`, one try
            (`largest_batch`'s `try_batch`).
    """
    end = clock() + seconds
    runs = [run for run in runs if "error" not in results.get(run[0], {})]
    runs.sort(key=lambda run: results.get(run[0], {}).get("train", {}).get("compile_s",
                                                                           float("inf")))
    searched = {}
    for index, (label, backend, implementation) in enumerate(runs):
        print(f"largest batch of {label} ...", file=sys.stderr, flush=True)
        train = results.get(label, {}).get("train")
        known = {batch_size: train.get("peak_bytes")} if train else {}
        deadline = clock() + (end - clock()) / (len(runs) - index)
        searched[label] = largest_batch(
            lambda batch, left, i=implementation, b=backend: attempt(i, b, batch, left),
            batch_size, limit, deadline, known=known, clock=clock)
    return searched


def try_batch(args, implementation, backend, batch, seconds):
    """One try: a fresh bench_vit.py worker trains at `batch` (its first call and one more
    step) within `seconds`; `largest_batch`'s outcome of it."""
    trial = argparse.Namespace(**{**vars(args), "batch_size": batch, "modes": ["train"],
                                  "steps": 1, "warmup": 0, "repeats": 1})
    result = run_worker(bench_vit.__file__, bench_vit.worker_arguments(trial, implementation),
                        backend, args.threads, args.device, gpu_memory="whole", timeout=seconds)
    if "error" in result:
        if result.get("out_of_memory"):
            return {"fits": False}
        return {key: result[key] for key in ("error", "timed_out") if key in result}
    train = result["train"]
    return {"fits": True, "peak_bytes": train.get("peak_bytes"),
            "capacity_bytes": train.get("capacity_bytes")}


def _gib(count):
    return "n/a" if count is None else f"{count / 2**30:.1f}"


def largest_batch_table(args, largest):
    """The markdown table: per implementation what it found and its tries."""
    where = "device memory" if args.device == "gpu" else "resident host memory"
    title = (f"Largest training batch of {args.preset} at {args.image_size}x{args.image_size}, "
             f"{args.mixed_precision}, from batch {args.batch_size} up to {args.limit}; "
             f"peak memory: {where}")
    columns = ("implementation", "largest batch", "peak memory at it (GiB)", "capacity (GiB)",
               "tries")
    lines = [title, "", "| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    for label, result in largest.items():
        known = {int(batch): peak for batch, peak in result.get("known", {}).items()}
        fitted = [attempt for attempt in result["tries"] if attempt.get("fits")]
        peaks = {**known, **{attempt["batch"]: attempt.get("peak_bytes") for attempt in fitted}}
        capacity = next((a["capacity_bytes"] for a in reversed(fitted) if a.get("capacity_bytes")),
                        None)
        tries = [f"{batch} known" for batch in known]
        tries += [f"{a['batch']} " + ("fits" if a.get("fits") else
                                      "does not fit" if "fits" in a else "failed")
                  for a in result["tries"]]
        lines.append(f"| {label} | {describe_largest_batch(result)} | "
                     f"{_gib(peaks.get(result['largest']))} | {_gib(capacity)} | "
                     f"{', '.join(tries) or 'none'} |")
    return lines


#: The settings a `--known` table must share with the search.
KNOWN_SETTINGS = ("preset", "image_size", "batch_size", "mixed_precision", "device", "overrides")


def known_results(parser, args):
    """The results of `--known` (`{}` without it); exits through `parser.error` if the file
    cannot be read or was measured with other settings."""
    if not args.known:
        return {}
    try:
        with open(args.known) as f:
            report = json.load(f)
        settings, results = report["settings"], report["results"]
    except (OSError, ValueError, KeyError, TypeError) as error:
        parser.error(f"--known {args.known}: not a table of bench_vit.py's --json ({error})")
    for name in KNOWN_SETTINGS:
        if settings.get(name) != getattr(args, name):
            parser.error(f"--known {args.known} was measured with {name} "
                         f"{settings.get(name)!r}, this search has {getattr(args, name)!r}")
    return results


def main(argv=None):
    parser = bench_vit.argument_parser(__doc__.split("\n\n")[0])
    parser.add_argument("--limit", type=int,
                        help="the largest batch to try (default 8192 on a GPU; required on the "
                             "CPU, where running out of memory means swapping or the kernel "
                             "killing a process)")
    parser.add_argument("--seconds", type=float, default=600.0,
                        help="time for the whole search, shared by the implementations; a search "
                             "out of time reports what it found (default 600)")
    parser.add_argument("--known", metavar="TABLE.json",
                        help="bench_vit.py's --json of a run of the same settings, whose training "
                             "steps count as known fits (one try less each) and order the search "
                             "by their compile times")
    args = parser.parse_args(argv)
    bench_vit.model_config(parser, args)
    check_positive_ints(parser, args, ("limit",))
    if args.seconds <= 0:
        parser.error(f"--seconds must be positive, got {args.seconds}")
    if args.limit is None:
        if args.device == "cpu":
            parser.error("--limit is required on the CPU: there running out of memory means "
                         "swapping or the kernel killing a process, not an error")
        args.limit = 8192
    if args.limit < args.batch_size:
        parser.error(f"--limit ({args.limit}) must be at least --batch-size ({args.batch_size})")
    results = known_results(parser, args)
    largest = largest_batches(bench_vit.implementations(args), results, args.batch_size,
                              args.limit, args.seconds, functools.partial(try_batch, args))
    lines = largest_batch_table(args, largest)
    print("\n".join(lines))
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write("\n".join(lines) + "\n")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"settings": vars(args), "largest_batch": largest}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
