import platform
import subprocess
import sys
import textwrap

import pytest

GLIBC = platform.system() == "Linux" and platform.libc_ver()[0] == "glibc"

# Touches a 256 MiB malloc block from a worker thread (as XLA's executor does),
# frees it, takes a block of the same size again and touches that: prints the
# page faults of the second touch.
SECOND_TOUCH_FAULTS = """
import ctypes, resource, sys, threading
from keras_vitnorm.host_memory import retain_freed_memory
if sys.argv[1] == "retain":
    assert retain_freed_memory() is True
libc = ctypes.CDLL(None)
libc.malloc.restype = ctypes.c_void_p
libc.free.argtypes = (ctypes.c_void_p,)
size = 256 << 20
faults = []

def work():
    block = libc.malloc(size)
    ctypes.memset(block, 1, size)
    libc.free(block)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    block = libc.malloc(size)
    ctypes.memset(block, 1, size)
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
    libc.free(block)

thread = threading.Thread(target=work)
thread.start()
thread.join()
print(faults[0])
"""


def _second_touch_faults(mode):
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(SECOND_TOUCH_FAULTS), mode],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    return int(done.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not GLIBC,
                    reason="mallopt is glibc's; elsewhere retain_freed_memory changes nothing")
def test_retained_memory_is_reused_without_page_faults():
    pages = (256 << 20) // 4096
    # Without it glibc maps the block afresh: every page faults again (fewer
    # with transparent huge pages, so only a lower bound of 1 in 600 pages).
    assert _second_touch_faults("default") > pages // 600
    assert _second_touch_faults("retain") < 200


@pytest.mark.skipif(GLIBC, reason="on glibc it applies; the no-op path is for other C libraries")
def test_retain_freed_memory_is_a_no_op_without_glibc():
    from keras_vitnorm.host_memory import retain_freed_memory

    assert retain_freed_memory() is False


@pytest.mark.parametrize("command, applied", [("train", True), ("ablate", True),
                                               ("evaluate", False), ("convert", False)])
def test_only_the_training_commands_change_the_allocator(monkeypatch, command, applied):
    from keras_vitnorm import cli
    from keras_vitnorm import host_memory

    calls, mains = [], []
    monkeypatch.setattr(host_memory, "retain_freed_memory", lambda: calls.append(True))
    monkeypatch.setattr(cli, "main", lambda argv, **options: mains.append((argv, options)) or 0)
    monkeypatch.setattr(sys, "argv", ["keras-vitnorm", command, "--help"])
    with pytest.raises(SystemExit):
        cli.console()
    assert len(calls) == applied
    assert mains == [([command, "--help"], {"hide_framework_logs": True})]
    with pytest.raises(SystemExit):  # the arguments it is given win over the process's
        cli.console(["ablate", "--help"])
    assert len(calls) == applied + 1 and mains[-1][0] == ["ablate", "--help"]


def test_a_study_worker_keeps_freed_memory_before_it_trains(tmp_path, monkeypatch):
    # `ablate --parallel N` trains each run in a child process; the child trains as the
    # `ablate` command does, so it takes the allocator setting before its first step.
    import json

    from keras_vitnorm import host_memory
    from keras_vitnorm.study import one_run
    from keras_vitnorm.study import workers
    from keras_vitnorm.training import TrainConfig

    events = []
    monkeypatch.setattr(host_memory, "retain_freed_memory", lambda: events.append("retain"))
    # A stand-in for training; a diverged run has no analysis to write.
    monkeypatch.setattr(one_run, "run_one",
                        lambda *args, **kwargs: events.append("train") or {"status": "diverged"})
    job = {"config": TrainConfig(dataset="synthetic", steps=1).to_dict(), "group": "g",
           "name": "n", "run_dir": str(tmp_path / "run"), "verbose": 0, "take_over_lock": False}
    (tmp_path / "job.json").write_text(json.dumps(job))
    assert workers.main([str(tmp_path / "job.json")]) == 0
    assert events == ["retain", "train"]


@pytest.mark.parametrize("command", ["train", "ablate", "evaluate", "convert"])
def test_the_recipe_scripts_run_their_command_as_the_console_script(monkeypatch, command):
    # `python recipes/train.py` is documented as the same command as `keras-vitnorm
    # train`: it goes through `console`, which sets the allocator for the commands that
    # train and holds back the frameworks' log lines.
    import os
    import runpy

    from keras_vitnorm import cli

    calls = []
    monkeypatch.setattr(cli, "console", lambda argv=None: calls.append(argv))
    monkeypatch.setattr(sys, "argv", [f"{command}.py", "--help"])
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    runpy.run_path(os.path.join(root, "recipes", f"{command}.py"), run_name="__main__")
    assert calls == [[command, "--help"]]
