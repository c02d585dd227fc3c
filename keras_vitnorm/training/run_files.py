"""What keeps a run directory usable whatever moment its process is killed: `RunLock`,
`StorageError` (a refused write, with what is still safe) and `results_run`.
"""

import contextlib
import errno
import json
import os
import socket
import sys
import time

from keras_vitnorm import durable
from keras_vitnorm.training.run_layout import METRICS_FILE
from keras_vitnorm.validation import check_directory_path

#: Errors of the storage itself, reported as a `StorageError`.
_STORAGE_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EROFS, errno.EACCES, errno.EPERM)


class StorageError(OSError):
    """A run's file could not be written (full disk, quota, permissions, read-only).
    Its text is its message alone, without the errno number `OSError` puts first."""

    def __str__(self):
        return str(self.strerror)


def _storage_error(error):
    """Whether `error` is the storage refusing a write (h5py's included)."""
    if isinstance(error, OSError) and error.errno in _STORAGE_ERRNOS:
        return True
    text = str(error).lower()
    return any(words in text for words in ("no space left", "disk quota", "file too large",
                                           "permission denied", "read-only file system"))


def _related(file, path):
    """Whether `file` is `path`, lies inside it or is a folder above it."""
    if not isinstance(file, (str, bytes, os.PathLike)):
        return True
    file, path = os.path.abspath(os.fsdecode(file)), os.path.abspath(path)
    return os.path.commonpath([file, path]) in (file, path)


#: What a `StorageError`'s message advises where nothing of the run was written yet.
AGAIN = "run the same command again"


@contextlib.contextmanager
def storage_errors(path, safe, then="continue with --resume"):
    """Turns a storage failure while writing `path` into a `StorageError` whose message
    names the file, what is still intact (`safe`) and what to do once the write can
    succeed (`then`; `AGAIN` where there is nothing to resume)."""
    try:
        yield
    except StorageError:
        raise
    except Exception as error:  # h5py and TensorFlow raise their own types for a failed write
        named = getattr(error, "filename", None)
        if not _storage_error(error) or (named and not _related(named, path)):
            raise  # not a write of `path` (e.g. an unreadable preset elsewhere): as it is
        where = named or path
        reason = getattr(error, "strerror", None) or str(error)
        raise StorageError(
            getattr(error, "errno", None) or errno.EIO,
            f"Could not write {where}: {reason}. {safe} Free space (or fix the permissions), "
            f"then {then}.",
        ) from error


def _process_start(pid):
    """The start time of process `pid` (Linux clock ticks since boot), or `None`."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return int(fields[19])
    except (OSError, IndexError, ValueError):
        return None


def _process_alive(pid, start):
    """Whether `pid` runs and, where the start time is known, is the same process."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    now = _process_start(pid)
    return start is None or now is None or now == start


def _is_file_at(descriptor, path):
    """Whether the open file `descriptor` is still the file at `path`."""
    try:
        return os.path.samestat(os.fstat(descriptor), os.stat(path))
    except OSError:
        return False


class LockedError(RuntimeError):
    """The directory is owned by another process (or by a stale lock not taken over)."""


#: What `flock` raises where the file system keeps no locks (some network file systems).
_NO_FILE_LOCKS = (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL)


class RunLock:
    """An exclusive lock on a run or study directory: `flock` on `<directory>/<name>`, a
    file that records the holder (docs/training.md, "Interrupted runs"). `take_over=True`
    replaces a lock file whose holder is gone, where the file system keeps no locks.
    Released with nothing added, it removes what it made; `new=True` requires a new one."""

    def __init__(self, directory, name="run.lock", take_over=False, what="run directory",
                 new=False):
        self.path = os.path.join(directory, name)
        self.directory = directory
        self.take_over = take_over
        self.what = what
        self.new = new
        self._held = False
        self._file = None  # the open lock file whose flock this lock holds
        self._made = []  # the folders acquire made, deepest first
        self._created = False  # whether acquire created the lock file
        self._before = set()  # the directory's other entries when it was locked

    def _record(self):
        pid = os.getpid()
        return {
            "pid": pid,
            "process_start": _process_start(pid),
            "host": socket.gethostname(),
            "started": time.strftime("%Y-%m-%d %H:%M:%S"),
            "command": " ".join(sys.argv),
        }

    def holder(self):
        """The lock file's record, or `None` if there is none (`{}` if unreadable)."""
        try:
            with open(self.path) as f:
                return json.load(f)
        except FileNotFoundError:
            return None
        except (OSError, ValueError):
            return {}

    def _who(self, holder):
        if not holder:
            return "its record is being written"
        return (f"pid {holder.get('pid')} on {holder.get('host')}, started "
                f"{holder.get('started')}: {holder.get('command')!r}")

    def _writing(self):
        return storage_errors(self.path, "Nothing was written.", AGAIN)

    def _in_use(self, holder):
        return LockedError(
            f"The {self.what} {self.directory} is in use by another process "
            f"({self._who(holder)}). Wait for it to finish, or stop it first; two processes "
            "must not write one run.")

    def acquire(self):
        check_directory_path(self.directory, self.what)
        with self._writing():
            self._made = []
            folder = os.path.abspath(self.directory)
            while not os.path.exists(folder):
                self._made.append(folder)
                folder = os.path.dirname(folder)
            if self.new:
                if not self._made:
                    raise FileExistsError(f"The {self.what} {self.directory} exists already.")
                os.makedirs(os.path.dirname(self._made[0]), exist_ok=True)
                os.mkdir(self.directory)  # FileExistsError: another process made it first
            else:
                os.makedirs(self.directory, exist_ok=True)
            self._before = set(os.listdir(self.directory)) - {os.path.basename(self.path)}
        for _ in range(3):
            with self._writing():
                created = not os.path.exists(self.path)
                descriptor = os.open(self.path, os.O_CREAT | os.O_RDWR, 0o644)
            try:
                import fcntl

                fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(descriptor)
                raise self._in_use(self.holder()) from None
            except (ImportError, OSError) as error:  # no file locks here: the file is the lock
                os.close(descriptor)
                if isinstance(error, OSError) and error.errno not in _NO_FILE_LOCKS:
                    raise
                if created:  # the empty file made for flock is not a lock
                    os.remove(self.path)
                return self._acquire_file()
            if _is_file_at(descriptor, self.path):
                break
            os.close(descriptor)  # its holder removed it meanwhile: lock the file there now
        else:
            raise LockedError(f"Could not take the lock {self.path}: other processes kept "
                              "replacing it.")
        self._created = created
        self._file = os.fdopen(descriptor, "r+")
        try:
            with self._writing():
                self._file.truncate(0)
                json.dump(self._record(), self._file)
                self._file.flush()
        except BaseException:
            self._file.close()  # and with it the lock
            self._file = None
            raise
        self._held = True
        return self

    def _acquire_file(self):
        """The lock without the kernel's: a file created atomically (`O_EXCL`)."""
        for _ in range(2):
            try:
                with self._writing():
                    descriptor = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                self._handle_existing()
                continue
            try:
                with self._writing(), os.fdopen(descriptor, "w") as f:
                    json.dump(self._record(), f)
            except BaseException:  # an empty lock would refuse the next run
                os.remove(self.path)
                raise
            self._held = self._created = True
            return self
        raise LockedError(f"Could not take the lock {self.path}: another process took it first.")

    def _handle_existing(self):
        holder = self.holder()
        if holder is None:
            return  # released meanwhile: try again
        pid, host = holder.get("pid"), holder.get("host")
        here = host == socket.gethostname()
        if here and isinstance(pid, int) and _process_alive(pid, holder.get("process_start")):
            raise self._in_use(holder)
        if not self.take_over:
            if not holder:
                state = (f"an empty or unreadable lock file {self.path}, left by a process "
                         "killed while it took the lock (or one taking it at this moment)")
            else:
                state = (f"a lock from {self._who(holder)}, a process that "
                         + ("no longer runs" if here else "cannot be checked from this host"))
            raise LockedError(
                f"The {self.what} {self.directory} has {state}, and this file system keeps no "
                "file locks that end with their process. If that process is gone, take the "
                "directory over with --take-over-lock (Python: take_over_lock=True).")
        os.remove(self.path)

    def release(self):
        try:
            added = set(os.listdir(self.directory)) - {os.path.basename(self.path)} - self._before
            unused = self._held and self._created and not added
        except OSError:
            unused = False
        if self._held:  # removed while still locked: a process that opened it sees it go
            with contextlib.suppress(FileNotFoundError):
                os.remove(self.path)
        if self._file is not None:
            self._file.close()  # the kernel lets go of the lock with the file
            self._file = None
        self._held = False
        if unused:
            for folder in self._made:  # only while empty: another process may write there
                try:
                    os.rmdir(folder)
                except OSError:
                    break

    def __enter__(self):
        return self.acquire()

    def __exit__(self, *exc):
        self.release()


@contextlib.contextmanager
def results_run(output_dir, what, overwrite=False, take_over_lock=False):
    """Owns `output_dir` (`None`: nothing locked or saved) for a run that writes its
    model and metrics once, at its end. Yields `save(model, model_file, metrics)`, which
    writes each atomically. Raises `FileExistsError` on a finished run without
    `overwrite`, `LockedError` and `StorageError`.
    """

    def save(model, model_file, metrics):
        with storage_errors(output_dir, "Nothing of this run was kept.", AGAIN):
            durable.write_file(os.path.join(output_dir, model_file), model.save)
            durable.write_json(os.path.join(output_dir, METRICS_FILE), metrics)

    if output_dir is None:
        yield lambda model, model_file, metrics: None
        return
    with RunLock(output_dir, take_over=take_over_lock):
        # Checked under the lock: a run that finished while this one waited counts.
        if os.path.exists(os.path.join(output_dir, METRICS_FILE)) and not overwrite:
            raise FileExistsError(
                f"{output_dir!r} already holds a finished {what} ({METRICS_FILE}). Pass "
                "overwrite=True (--overwrite) to replace it, or choose another directory.")
        yield save
