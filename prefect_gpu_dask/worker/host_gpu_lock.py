"""One GPU, one cluster at a time: a host-wide turn on a GPU for ``gpu`` task runs.

A ``gpu`` slot is a Dask resource, so it holds inside one cluster only: two flow runs
that each start a ``LocalCUDACluster`` on the same host would each put a whole
``GPU=1`` of work on the same GPU. So before a ``gpu`` task run starts, its worker
process takes its cluster's turn on the GPU: the processes of one cluster (named by
its scheduler's address) share a turn, and Dask's resources share the GPU among their
tasks as before; another cluster's waits until the last of them is done, then has its
own. A cluster waiting keeps the one on the GPU from starting new tasks there, so the
clusters alternate task by task instead of one starving the other.

Three files per GPU, in the user's private directory (``private_dir``): a shared
``flock`` on ``.gate`` held by every process running ``gpu`` work on the GPU, an
exclusive one on ``.mutex`` while a process enters, and ``.room``, which cluster has
the turn and who waits. The kernel drops a dead process's locks, and a stale ``.room``
is overwritten by the next process to find the gate free: a crash leaves nothing stuck.

A process keeps its lock on the gate for ``LINGER_S`` after its last ``gpu`` task run
ends: the next one, often queued on the same slot, then starts without going through
the mutex and ``.room`` again, unless ``.room`` changed meanwhile (another cluster
asked to wait). A cluster that had the turn and finds another waiting lets it in first.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from prefect_gpu_dask.private_dir import private_directory

WAITER_STALE_S = 2.0  # a waiter that stopped asking this long ago has gone
POLL_S = 0.05
LINGER_S = POLL_S  # a waiting cluster's next look is at most this far off anyway
WAITER_LIVE_S = 4 * POLL_S  # a waiter asking this recently is let in before the turn's holder


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # drops the lock


class HostGPUClaim:
    """This process's part in its cluster's turn on one GPU; ``hold()`` around each
    ``gpu`` task run. Threads of the process share it."""

    def __init__(self, gpu_uuid: str, cluster: str, directory: Path | None = None):
        if not gpu_uuid or "/" in gpu_uuid:
            raise ValueError(f"gpu_uuid {gpu_uuid!r} cannot name a lock file")
        base = (directory or private_directory()) / f"gpu-{gpu_uuid}"
        self.gate, self.mutex, self.room = (base.with_suffix(s) for s in (".gate", ".mutex", ".room"))
        self.cluster = cluster
        self._fd: int | None = None
        self._holders = 0
        self._entering = False
        self._changed = threading.Condition()
        self._room_seen: tuple[int, int, int] | None = None  # ``.room`` as this process left it
        self._linger_until = 0.0
        self._lingering: threading.Thread | None = None

    @contextlib.contextmanager
    def hold(self) -> Iterator[float]:
        """Hold the turn for the block; yields the seconds spent waiting for it."""
        waited = self.acquire()
        try:
            yield waited
        finally:
            self.release()

    def acquire(self) -> float:
        started = time.monotonic()
        with self._changed:
            while self._entering:  # another thread of ours is entering: share its turn
                self._changed.wait()
            if self._holders:
                self._holders += 1
                return 0.0
            if self._fd is not None and self._room_stamp() == self._room_seen:
                self._holders = 1  # still ours, and nobody asked to wait since
                return 0.0
            self._entering = True
            lingering, self._fd = self._fd, None
        fd = None
        try:
            if lingering is not None:
                os.close(lingering)  # another cluster asked: enter again, as a newcomer would
            fd = os.open(self.gate, os.O_RDWR | os.O_CREAT, 0o600)
            while not self._enter(fd):
                time.sleep(POLL_S)
        except BaseException:
            if fd is not None:
                os.close(fd)
            with self._changed:
                self._entering = False
                self._changed.notify_all()
            self._stop_waiting()
            raise
        with self._changed:
            self._fd, self._holders, self._entering = fd, 1, False
            self._changed.notify_all()
        return time.monotonic() - started

    def _room_stamp(self) -> tuple[int, int, int] | None:
        try:
            st = os.stat(self.room)
        except FileNotFoundError:
            return None
        return st.st_ino, st.st_mtime_ns, st.st_size

    def _enter(self, fd: int) -> bool:
        """One look at the GPU, under the mutex: enter (a shared lock on the gate), or
        say this cluster waits."""
        with _locked(self.mutex):
            room = self._read_room()
            now = time.time()
            waiting = {c: t for c, t in room.get("waiting", {}).items() if now - t < WAITER_STALE_S}
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # nobody on the GPU?
                empty = True
            except BlockingIOError:
                empty = False
            others_wait = any(c != self.cluster for c in waiting)
            others_asking = any(c != self.cluster and now - t < WAITER_LIVE_S for c, t in waiting.items())
            had_turn = room.get("cluster") == self.cluster
            if (empty and not (had_turn and others_asking)) or (had_turn and not others_wait):
                # Every entry holds the mutex: nobody can take the gate between these two.
                fcntl.flock(fd, fcntl.LOCK_SH)
                waiting.pop(self.cluster, None)
                self._write_room(room, {"cluster": self.cluster, "waiting": waiting})
                self._room_seen = self._room_stamp()
                return True
            if empty:
                fcntl.flock(fd, fcntl.LOCK_UN)  # the waiting cluster's turn comes first
            waiting[self.cluster] = now
            self._write_room(room, {"cluster": room.get("cluster"), "waiting": waiting})
            return False

    def _stop_waiting(self) -> None:
        """Take this cluster off the waiters (it stopped asking), where it can."""
        try:
            with _locked(self.mutex):
                room = self._read_room()
                waiting = dict(room.get("waiting", {}))
                if waiting.pop(self.cluster, None) is not None:
                    self._write_room(room, {"cluster": room.get("cluster"), "waiting": waiting})
        except OSError:
            pass  # the entry goes stale by itself

    def _read_room(self) -> dict[str, Any]:
        try:
            room = json.loads(self.room.read_text())
        except (FileNotFoundError, ValueError):
            return {}
        return room if isinstance(room, dict) else {}

    def _write_room(self, was: dict[str, Any], room: dict[str, Any]) -> None:
        if room == {"cluster": was.get("cluster"), "waiting": was.get("waiting", {})}:
            return  # the same cluster again, nobody waiting: the common case writes nothing
        tmp = self.room.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(room))
        tmp.replace(self.room)

    def release(self) -> None:
        with self._changed:
            self._holders -= 1
            if self._holders == 0 and self._fd is not None:
                self._linger_until = time.monotonic() + LINGER_S
                if self._lingering is None:
                    closer = threading.Thread(target=self._close_when_idle, name="gpu-turn", daemon=True)
                    try:
                        closer.start()
                    except RuntimeError:  # no thread to linger with: give the turn back now
                        fd, self._fd = self._fd, None
                        _close_quietly(fd)
                        return
                    self._lingering = closer
                self._changed.notify_all()

    def _close_when_idle(self) -> None:
        """Drop the gate once no task run held it for ``LINGER_S``."""
        with self._changed:
            while True:
                if self._holders or self._fd is None:
                    self._changed.wait()
                    continue
                left = self._linger_until - time.monotonic()
                if left > 0:
                    self._changed.wait(left)
                    continue
                fd, self._fd = self._fd, None
                _close_quietly(fd)  # drops the shared lock on the gate

    def in_use_elsewhere(self) -> bool:
        """Whether another process runs gpu work on this GPU now (a look, not a wait)."""
        with self._changed:
            if self._holders or self._fd is not None:  # ours, held or lingering
                return False
        fd = os.open(self.gate, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        finally:
            os.close(fd)
        return False


def _close_quietly(fd: int) -> None:
    with contextlib.suppress(OSError):
        os.close(fd)


_claims: dict[tuple[str, str], HostGPUClaim] = {}
_claims_lock = threading.Lock()
WAIT_NOTED_S = 0.5  # a wait longer than this is said in the task run's log


def claim_for(gpu_uuid: str, cluster: str) -> HostGPUClaim:
    """This process's one claim on ``gpu_uuid`` for ``cluster``."""
    with _claims_lock:
        if (gpu_uuid, cluster) not in _claims:
            _claims[gpu_uuid, cluster] = HostGPUClaim(gpu_uuid, cluster)
        return _claims[gpu_uuid, cluster]


@contextlib.contextmanager
def claiming_gpu(memory_probe: Any = None) -> Iterator[None]:
    """The ``around`` of a ``gpu`` task run: hold this worker's GPU against other
    clusters on the host while it runs (a no-op on a worker without a GPU)."""
    from prefect_gpu_dask._compat import current_worker
    from prefect_gpu_dask.worker.probe import worker_probe

    worker = current_worker()
    try:
        probe = worker_probe(worker, memory_probe) if worker is not None else None
    except Exception:  # the guard and the labels say why; the task still runs
        probe = None
    if probe is None:
        yield
        return
    cluster = str(getattr(worker.scheduler, "address", ""))  # the scheduler names the cluster
    with claim_for(probe.gpu.uuid, cluster).hold() as waited:
        if waited > WAIT_NOTED_S:
            from prefect.logging import get_run_logger

            get_run_logger().info(
                "Waited %.1f s for GPU %s: another cluster on this host was running gpu tasks on it",
                waited,
                probe.gpu.uuid,
            )
        yield
