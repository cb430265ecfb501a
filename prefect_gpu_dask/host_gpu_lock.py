"""One GPU, one cluster at a time: a host-wide claim on a GPU for ``gpu`` task runs.

A ``gpu`` slot is a Dask resource, so it holds inside one cluster only: two flow runs
that each start a ``LocalCUDACluster`` on the same host would each put a whole
``GPU=1`` of work on the same GPU. So a worker process takes an exclusive ``flock`` on
``gpu-<uuid>.lock`` before its first ``gpu`` task starts and lets it go when its last
one ends; the threads of that process share the claim (Dask's resources already
share the GPU among them). A worker of another cluster waits for the claim, so the
clusters take turns on that GPU, task by task. The kernel drops the lock when its
process dies: a crash leaves no stuck claim, and a lock file holds nothing but a name.

The lock files live in a directory only their user may use
(``$XDG_RUNTIME_DIR/prefect-gpu-dask`` or ``/tmp/prefect-gpu-dask-<uid>``, mode 0700):
another local user's flows neither wait for these claims nor take part in them, and a
directory that someone else owns or can write is refused.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import stat
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

DIRECTORY_ENV = "PREFECT_GPU_DASK_LOCK_DIR"


class SharedDirectoryError(PermissionError):
    """The lock directory is not this user's alone."""


def lock_directory() -> Path:
    """This user's directory of GPU claims, made private if it is new."""
    if explicit := os.environ.get(DIRECTORY_ENV):
        path = Path(explicit)
    elif runtime := os.environ.get("XDG_RUNTIME_DIR"):
        path = Path(runtime) / "prefect-gpu-dask"
    else:
        path = Path(tempfile.gettempdir()) / f"prefect-gpu-dask-{os.getuid()}"
    with contextlib.suppress(FileExistsError):
        path.mkdir(mode=0o700, parents=False)
    info = path.lstat()
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid() or info.st_mode & 0o077:
        raise SharedDirectoryError(
            f"{path} must be a directory of uid {os.getuid()} with mode 0700 to hold GPU claims "
            f"(it is uid {info.st_uid}, mode {stat.filemode(info.st_mode)}): refusing to share "
            f"GPU slots through it; remove it or set {DIRECTORY_ENV}"
        )
    return path


class HostGPUClaim:
    """This process's claim on one GPU; ``hold()`` around each ``gpu`` task run."""

    def __init__(self, gpu_uuid: str, directory: Path | None = None):
        if not gpu_uuid or "/" in gpu_uuid:
            raise ValueError(f"gpu_uuid {gpu_uuid!r} cannot name a lock file")
        self.path = (directory or lock_directory()) / f"gpu-{gpu_uuid}.lock"
        self._fd: int | None = None
        self._holders = 0
        self._taking = False
        self._changed = threading.Condition()

    @contextlib.contextmanager
    def hold(self) -> Iterator[float]:
        """Hold the claim for the block; yields the seconds spent waiting for it."""
        waited = self.acquire()
        try:
            yield waited
        finally:
            self.release()

    def acquire(self) -> float:
        started = time.monotonic()
        with self._changed:
            while self._taking:  # another thread of ours is waiting for it: share its turn
                self._changed.wait()
            if self._holders:
                self._holders += 1
                return 0.0
            self._taking = True
        try:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX)  # blocks while another process holds it
            except BaseException:
                os.close(fd)
                raise
        except BaseException:
            with self._changed:
                self._taking = False
                self._changed.notify_all()
            raise
        with self._changed:
            self._fd, self._holders, self._taking = fd, 1, False
            self._changed.notify_all()
        return time.monotonic() - started

    def release(self) -> None:
        with self._changed:
            self._holders -= 1
            if self._holders == 0 and self._fd is not None:
                fd, self._fd = self._fd, None
                fcntl.flock(fd, fcntl.LOCK_UN)
                os.close(fd)

    def held_elsewhere(self) -> bool:
        """Whether another process holds the claim now (a look, not a wait)."""
        with self._changed:
            if self._holders:
                return False
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        finally:
            os.close(fd)  # closing drops a lock taken just now
        return False
