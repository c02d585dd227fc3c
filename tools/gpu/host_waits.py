"""Counts the calls in a PyTorch step that would make the host wait for a GPU, on any device.

    python tools/gpu/host_waits.py --mode train --reference
    python tools/gpu/host_waits.py --mode fit --mixed-precision mixed_bfloat16 --fast-paths off
    python tools/gpu/host_waits.py --mode evaluate
    python tools/gpu/host_waits.py --mode inference --preset s16 --batch-size 4

On a GPU, PyTorch launches kernels without waiting for them, and the host runs ahead
of the device, except where it needs a value back or hands over host memory: a
tensor's value read into Python (`.item()`, `float()`, `bool()`, `.numpy()`,
`.tolist()`, a copy to the host, an op whose output shape depends on values, such as
`nonzero` or boolean indexing), and a tensor made on the device from host data
(`torch.tensor(0.9, device=...)`, `torch.as_tensor` of a Python number, list or NumPy
array, a copy from the host), which copies from pageable memory and waits for the
device's queue first. Each such call leaves the GPU idle while the host catches up.

`HostWaits` records those calls as they happen, with the Python frames that made
them, through two PyTorch modes: a `TorchDispatchMode` sees every ATen operator
(`_local_scalar_dense` behind `.item()`/`float()`/`bool()`, `lift_fresh` behind every
tensor made from host data, copies between devices) and a `TorchFunctionMode` sees
reads that are no operator (`.numpy()`, `__array__`, `.tolist()`). It needs no GPU: on
the CPU every tensor counts as being on the device, which is where a GPU run would
have it, so the same step gives the same count (less the copies of batches that a
data loader hands over as CPU tensors: on the CPU they are already in place). A
tensor that code deliberately makes on the host (no `device=`) counts as an upload
on the CPU although on a GPU it would stay on the host. Both modes are per thread:
what Keras' callbacks read on their worker thread is not counted, since the step's
thread does not wait for it.

This script builds a keras_vitnorm ViT on the PyTorch backend (AdamW and
cross-entropy, as `benchmarks/bench_vit.py` compiles it; the batch on the device as
there) and prints, for one step after two warm-up steps, every call that would wait,
grouped by site, with the count by kind:

- `--mode train`: one `train_on_batch`.
- `--mode fit`: one step of `fit` (the calls between two batches' starts, after two
  warm-up batches), with accuracy as a metric.
- `--mode evaluate`: one step of `evaluate`, likewise.
- `--mode inference`: one `predict_on_batch`.

`--fast-paths off` switches the library's fast paths off (`keras_vitnorm.ops`); the
step itself is Keras' either way. `--reference` (train and inference) counts the
transformers ViT's step too, run as `benchmarks/bench_vit.py` runs it. Where PyTorch
sees a GPU, each step then runs once more under `torch.cuda.set_sync_debug_mode("warn")`
and the calls at which PyTorch itself saw the host wait are listed beside the count.
"""

import argparse
import collections
import os
import sys
import traceback
import warnings

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir, os.pardir,
                                "benchmarks"))
from _common import check_positive_ints  # noqa: E402
from _common import reference_steps  # noqa: E402

#: Kinds of calls that wait: a value read back to the host, a tensor made from host data.
READ, UPLOAD = "read", "upload"
#: ATen operators whose output depends on values the host must see first.
_VALUE_SHAPED = ("aten._local_scalar_dense", "aten.nonzero", "aten.masked_select",
                 "aten._unique", "aten.unique", "aten.repeat_interleave")
#: Tensor methods that hand a tensor's values to Python without an ATen operator.
_HOST_VIEWS = ("numpy", "__array__", "tolist")


class HostWaits:
    """A context manager that records the calls that would make the host wait for a GPU.

    Args:
        frames: int, default 6. Python frames kept per call (innermost last), PyTorch's
            own frames left out.
        host_tensors: tensors that a GPU run keeps on the host (PyTorch's optimizers keep
            their step counters there), whose reads are not counted. Default none.

    Attributes:
        events: list of `(phase, kind, operator, frames)`, in the order they happened;
            `phase` is what `mark` last set (`None` before).

    Example:
    >>> with HostWaits() as waits:
    ...     model.train_on_batch(x, y)
    >>> waits.count(), waits.count(kind="upload")
    """

    def __init__(self, frames=6, host_tensors=()):
        self.frames = frames
        self._host_tensors = list(host_tensors)  # kept alive, so that their ids stay theirs
        self._host_ids = {id(t) for t in self._host_tensors}
        self.events = []
        self._phase = None
        self._modes = ()
        self._torch_dir = None

    def mark(self, phase):
        """Attributes the calls from now on to `phase` (a step number, a name)."""
        self._phase = phase

    def count(self, kind=None, phase=None):
        """The number of recorded calls, of `kind` (`"read"`, `"upload"`) and in `phase` if
        given (`None`: every one)."""
        return sum(1 for p, k, _, _ in self.events
                   if (kind is None or k == kind) and (phase is None or p == phase))

    def sites(self, phase=None):
        """`{(kind, operator, frames): count}` of the calls (in `phase` if given)."""
        return collections.Counter((k, op, frames) for p, k, op, frames in self.events
                                   if phase is None or p == phase)

    def report(self, phase=None):
        """The sites as text, most frequent first, with the totals by kind."""
        sites = self.sites(phase)
        lines = [f"{self.count(phase=phase)} calls that would wait for the GPU "
                 f"({self.count(READ, phase)} reads, {self.count(UPLOAD, phase)} uploads)"]
        for (kind, op, frames), n in sites.most_common():
            lines.append(f"x{n} {kind} ({op}):\n{frames}")
        return "\n".join(lines)

    def _record(self, kind, op):
        stack = [f for f in traceback.extract_stack()[:-1]
                 if not f.filename.startswith(self._torch_dir) and f.filename != __file__]
        frames = "\n".join(f"    {_short(f.filename)}:{f.lineno} {f.name}: {f.line}"
                           for f in stack[-self.frames:])
        self.events.append((self._phase, kind, op, frames))

    def __enter__(self):
        import torch
        from torch.overrides import TorchFunctionMode
        from torch.utils._python_dispatch import TorchDispatchMode

        device = _compute_device()
        owner = self
        self._torch_dir = os.path.dirname(torch.__file__) + os.sep

        def on_device(tensor):
            return (isinstance(tensor, torch.Tensor) and tensor.device.type == device.type
                    and id(tensor) not in owner._host_ids)

        class Operators(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                kwargs = kwargs or {}
                name = str(func)
                out = func(*args, **kwargs)
                first = args[0] if args else None
                if name.startswith(_VALUE_SHAPED) and on_device(first):
                    owner._record(READ, name)
                elif name.startswith("aten.index.Tensor") and on_device(first) and any(
                        isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in args[1]):
                    owner._record(READ, name)  # boolean indexing: the output size is a value
                elif name.startswith("aten.lift_fresh") and on_device(out):
                    owner._record(UPLOAD, name)
                elif (name.startswith(("aten._to_copy", "aten.copy_")) and device.type != "cpu"
                      and not _non_blocking(args, kwargs)):
                    # A copy between host and device (a GPU run only: on the CPU there is
                    # no other device); one that does not block (pinned memory) waits for
                    # nothing.
                    source = args[1] if name.startswith("aten.copy_") else first
                    target = first if name.startswith("aten.copy_") else out
                    if on_device(source) and target.device.type == "cpu":
                        owner._record(READ, name)
                    elif source.device.type == "cpu" and on_device(target):
                        owner._record(UPLOAD, name)
                return out

        class Methods(TorchFunctionMode):
            def __torch_function__(self, func, types, args=(), kwargs=None):
                if getattr(func, "__name__", None) in _HOST_VIEWS and args and on_device(args[0]):
                    owner._record(READ, f"Tensor.{func.__name__}")
                return func(*args, **(kwargs or {}))

        self._modes = (Methods(), Operators())
        for mode in self._modes:
            mode.__enter__()
        return self

    def __exit__(self, *exc_info):
        for mode in reversed(self._modes):
            mode.__exit__(*exc_info)
        self._modes = ()
        return False


def _non_blocking(args, kwargs):
    """Whether a `_to_copy` or `copy_` call asks for a copy that does not block the host."""
    return bool(kwargs.get("non_blocking", args[2] if len(args) > 2 else False))


def _compute_device():
    """The device Keras computes on under the PyTorch backend (the CPU without a GPU)."""
    import torch

    try:
        from keras.src.backend.torch.core import get_device
    except ImportError:  # another Keras layout: PyTorch's choice
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(get_device())


_ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), os.pardir, os.pardir)) + os.sep


def _short(filename):
    """`filename` from its package (`keras/...`) or this repository's root."""
    return filename.split(f"site-packages{os.sep}")[-1].removeprefix(_ROOT)


def keras_waits(mode, config, batch_size, mixed_precision="float32", warmup=2):
    """`(HostWaits, step)` of one `train_on_batch`, `fit` or `evaluate` step or
    `predict_on_batch` of a ViT; `step` runs one more (None for `fit` and `evaluate`).

    The model (compiled as `bench_vit.py` compiles it, plus accuracy in `"fit"` and
    `"evaluate"`) runs `warmup` steps first, unrecorded. For `"fit"` and `"evaluate"`,
    the recorded phase of each call is the batch it happened in (they run `warmup + 2`
    batches; phase `warmup` is a whole step between two batches' starts).
    """
    import keras
    import numpy as np

    from keras_vitnorm import ViT

    previous = keras.config.dtype_policy()
    keras.config.set_dtype_policy(mixed_precision)
    try:
        model = ViT(**config)
    finally:
        keras.config.set_dtype_policy(previous)
    model.compile(optimizer=keras.optimizers.AdamW(1e-4),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=["accuracy"] if mode in ("fit", "evaluate") else None)
    rng = np.random.default_rng(0)
    size = config["image_size"]
    x = rng.uniform(-1, 1, (batch_size, size, size, 3)).astype("float32")
    y = rng.integers(0, config["num_classes"], (batch_size,))
    waits = HostWaits()
    if mode in ("fit", "evaluate"):
        class Phases(keras.callbacks.Callback):
            def on_train_batch_begin(self, batch, logs=None):
                waits.mark(batch)

            def on_test_batch_begin(self, batch, logs=None):
                waits.mark(batch)

        steps = warmup + 2
        xs, ys = np.concatenate([x] * steps), np.concatenate([y] * steps)
        run = model.fit if mode == "fit" else model.evaluate
        extra = {"epochs": 1, "shuffle": False} if mode == "fit" else {}
        with waits:
            run(xs, ys, batch_size=batch_size, verbose=0, callbacks=[Phases()], **extra)
        return waits, None
    x, y = (keras.ops.convert_to_tensor(a) for a in (x, y))  # on the device, as bench_vit.py
    step = ((lambda: model.train_on_batch(x, y)) if mode == "train"
            else (lambda: model.predict_on_batch(x)))
    for _ in range(warmup):
        step()
    with waits:
        step()
    return waits, step


def synchronizing_calls(step, frames=6):
    """`{innermost Python frames: count}` of the calls in `step()` that made the host wait for
    the GPU, as PyTorch's sync debug mode warns at each (a `.item()`, a copy to the host, a
    copy from pageable host memory); the stack is read at that moment."""
    import torch

    found = collections.Counter()

    def record(*args, **kwargs):
        stack = [f for f in traceback.extract_stack()[:-1]
                 if not f.filename.endswith("warnings.py")]
        if stack[-1].name == "set_sync_debug_mode":  # the mode announces itself; not a wait
            return
        found["\n".join(f"    {_short(f.filename)}:{f.lineno} {f.name}: {f.line}"
                         for f in stack[-frames:])] += 1

    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = record
        torch.cuda.set_sync_debug_mode("warn")
        try:
            step()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return found


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    parser.add_argument("--mode", choices=("train", "fit", "evaluate", "inference"), default="train")
    parser.add_argument("--preset", default="ti16")
    parser.add_argument("--image-size", type=int, default=32,
                        help="pixels (the count does not depend on the size)")
    parser.add_argument("--batch-size", type=int, default=2)
    parser.add_argument("--mixed-precision", default="float32",
                        choices=("float32", "mixed_bfloat16", "mixed_float16"))
    parser.add_argument("--fast-paths", choices=("on", "off"), default="on")
    parser.add_argument("--reference", action="store_true",
                        help="count the transformers ViT's step too (train and inference)")
    args = parser.parse_args(argv)
    check_positive_ints(parser, args, ("image_size", "batch_size"))
    if args.reference and args.mode not in ("train", "inference"):
        parser.error(f"--reference counts a train or inference step, not {args.mode}")
    if "keras" in sys.modules and sys.modules["keras"].backend.backend() != "torch":
        parser.error("Keras is already imported with another backend; run this script on its own")
    os.environ["KERAS_BACKEND"] = "torch"
    from keras_vitnorm import ops
    from keras_vitnorm.models.presets import preset_config

    try:
        config = {**preset_config(args.preset), "image_size": args.image_size, "num_classes": 10}
    except ValueError as error:
        parser.error(f"--preset: {error}")
    import torch

    with ops.fast_paths(args.fast_paths == "on"):
        waits, step = keras_waits(args.mode, config, args.batch_size, args.mixed_precision)
        phase = 2 if args.mode in ("fit", "evaluate") else None
        what = f"step of {args.mode}" if phase is not None else f"{args.mode} call"
        print(f"== keras_vitnorm (torch), {args.mode}, {args.mixed_precision}, fast paths "
              f"{args.fast_paths}: one {what}")
        print(waits.report(phase))
        steps = [("keras_vitnorm (torch)", step)] if step else []
        if args.reference:
            device = "gpu" if torch.cuda.is_available() else "cpu"
            reference = reference_steps(config, args.batch_size, [args.mode], os.cpu_count(),
                                        device, args.mixed_precision)[args.mode]
            for _ in range(2):
                reference()
            with HostWaits(host_tensors=getattr(reference, "host_tensors", list)()) as waits:
                reference()
            print(f"== transformers ViT (reference), one {what}")
            print(waits.report())
            steps.append(("transformers ViT (reference)", reference))
        for name, step in steps if torch.cuda.is_available() else ():
            stacks = synchronizing_calls(step)
            print(f"== {name}, one {what} under PyTorch's sync debug mode: "
                  f"{sum(stacks.values())} calls that waited for the GPU")
            for frames, count in stacks.items():
                print(f"x{count}:\n{frames}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
