"""Peak memory of a benchmark worker, and the search for the largest batch that fits.

`WorkerMemory` reads what a worker's computation held at most: device memory on a
GPU, resident host memory on the CPU. `largest_batch` finds the largest training
batch that fits, one try per fresh process (the caller's `try_batch`), so that an
out-of-memory failure cannot leave memory behind for the next try.
"""

import resource
import sys
import time

FRAMEWORKS = ("jax", "tensorflow", "torch")


def _proc_status_bytes(field):
    """A memory field of Linux's `/proc/self/status` (`"VmRSS"`, `"VmHWM"`) in bytes, or
    None where there is none."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024  # in kB
    except OSError:
        pass
    return None


class WorkerMemory:
    """Peak memory of this process's computation under one framework.

    On a GPU it is what the framework's allocator held at most (PyTorch's
    `max_memory_allocated`, JAX's `peak_bytes_in_use`, TensorFlow's `peak`); on the
    CPU it is the process's peak resident memory (Linux's `VmHWM`; elsewhere
    `ru_maxrss`, which also counts what the parent process held before `exec` on
    Linux, hence not used there). `reset()` starts the peak again for PyTorch and
    TensorFlow on a GPU and on a Linux CPU (from the memory resident then); JAX's
    cannot be reset, so it is the process's peak so far (the workers run inference
    before training, so a training figure is training's own).

    Args:
        framework: str, "jax", "tensorflow" or "torch": the framework that computes.
        device: str, "cpu" or "gpu".
    """

    def __init__(self, framework, device):
        if framework not in FRAMEWORKS:
            raise ValueError(f"framework {framework!r} is not one of {', '.join(FRAMEWORKS)}")
        if device not in ("cpu", "gpu"):
            raise ValueError(f"device {device!r} is not one of cpu, gpu")
        self.framework, self.device = framework, device
        self.where = "host" if device == "cpu" else "device"

    def reset(self):
        """Starts the peak again where it can be (see the class)."""
        if self.device == "cpu":
            try:
                with open("/proc/self/clear_refs", "w") as f:
                    f.write("5")  # Linux: the peak resident memory becomes the current one
            except OSError:
                pass
            return
        if self.framework == "torch":
            import torch

            torch.cuda.reset_peak_memory_stats()
        elif self.framework == "tensorflow":
            import tensorflow as tf

            tf.config.experimental.reset_memory_stats("GPU:0")

    @property
    def what(self):
        """In words, what `peak` reads."""
        if self.device == "cpu":
            return "host peak RSS"
        return {"torch": "GPU max_memory_allocated (PyTorch)",
                "jax": "GPU peak_bytes_in_use (JAX)",
                "tensorflow": "GPU get_memory_info peak (TensorFlow)"}[self.framework]

    def current(self):
        """The bytes held now, as `peak` counts them: resident host memory (Linux's
        `VmRSS`) on the CPU, the framework allocator's use on a GPU."""
        if self.device == "cpu":
            return _proc_status_bytes("VmRSS") or 0  # elsewhere: the peak since the start
        if self.framework == "torch":
            import torch

            return torch.cuda.memory_allocated()
        if self.framework == "jax":
            import jax

            return jax.local_devices()[0].memory_stats()["bytes_in_use"]
        import tensorflow as tf

        return tf.config.experimental.get_memory_info("GPU:0")["current"]

    def peak(self):
        """The peak in bytes (see the class)."""
        if self.device == "cpu":
            peak = _proc_status_bytes("VmHWM")
            if peak is not None:
                return peak
            # macOS counts ru_maxrss in bytes, the other systems in KiB.
            scale = 1 if sys.platform == "darwin" else 1024
            return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * scale
        if self.framework == "torch":
            import torch

            return torch.cuda.max_memory_allocated()
        if self.framework == "jax":
            import jax

            return jax.local_devices()[0].memory_stats()["peak_bytes_in_use"]
        import tensorflow as tf

        return tf.config.experimental.get_memory_info("GPU:0")["peak"]

    def capacity(self):
        """Bytes this process's computation could hold at most, or None where unknown.

        JAX: its allocator's limit. PyTorch: the GPU's free memory plus what its
        allocator already holds. None on the CPU and for TensorFlow.
        """
        if self.device == "cpu" or self.framework == "tensorflow":
            return None
        if self.framework == "torch":
            import torch

            return torch.cuda.mem_get_info()[0] + torch.cuda.memory_reserved()
        import jax

        return jax.local_devices()[0].memory_stats().get("bytes_limit")

    def release(self):
        """Hands PyTorch's cached GPU blocks back, so that workers taking turns on one GPU
        hold only their live tensors while another one runs (JAX keeps its pool)."""
        if self.device == "gpu" and self.framework == "torch":
            import torch

            torch.cuda.empty_cache()


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
