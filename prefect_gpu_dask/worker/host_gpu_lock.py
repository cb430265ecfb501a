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
asked to wait), which also ends the linger. A cluster that had the turn and finds
another waiting lets it in first.

The turn passes with the memory: a process giving up the gate first flushes its
allocators' pools (``flush``: CuPy's and torch's caches, ``guard.release_allocator_caches``),
which otherwise keep a finished task's memory from the next cluster. A process taking
the turn from another cluster then waits, before its task starts, until no other
process holds more than a CUDA context's worth of the GPU (``MemoryHandover``): a
worker that could not flush, or one still dying, has its memory back first.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, NamedTuple

from prefect_gpu_dask.nvml import READ_ERRORS
from prefect_gpu_dask.private_dir import private_directory

WAITER_STALE_S = 2.0  # a waiter that stopped asking this long ago has gone
POLL_S = 0.05
# A lingering turn ends as soon as another cluster asks (``.room`` changes), so it costs
# a waiter no more than one look; while nobody asks it keeps the pools warm between runs.
LINGER_S = 1.0
WAITER_LIVE_S = 4 * POLL_S  # a waiter asking this recently is let in before the turn's holder
# What another process may hold on the GPU without being waited for: a CUDA context
# with a library's handles and kernels (about 0.5 GiB on an H100).
OTHERS_ALLOWANCE = 1536 * 2**20
MEMORY_WAIT_S = 30.0  # the longest a taker waits for another process's memory to come back
MEMORY_STEADY_S = 2.0  # ...and for memory that has stopped coming back (a dying process's goes at once)

logger = logging.getLogger(__name__)


class HandoverWait(NamedTuple):
    """What a process taking the turn from another cluster waited for."""

    waited_s: float  # seconds spent waiting for other processes' memory
    held: int  # bytes other processes held beyond ``OTHERS_ALLOWANCE`` each, at the first look
    left: int  # ...at the last look (0: the memory came back)
    outcome: str  # free | steady (stopped coming back) | timeout | unread (the probe failed)
    pids: tuple[int, ...] = ()  # the processes holding ``left``


class MemoryHandover:
    """The taker's side of a hand-over: wait until no other process fills the GPU.

    ``read`` gives every process's bytes on the GPU by PID (a probe's
    ``process_memories``, NVML's compute-process list). A process other than
    ``own_pid`` holding more than ``allowance`` is waited for, polling every ``poll_s``,
    until its memory is back, for at most ``timeout_s``, and no longer than ``steady_s``
    once the memory stops falling: memory that is not coming back (a notebook's, a
    task result another cluster's worker keeps) is not waited for again while it holds
    no more than it did then. Memory the driver cannot attribute to a process (MIG,
    vGPU: -1) is not waited for. Only this process counts as its cluster's: the turn
    came from another cluster, so no other process of this one ran ``gpu`` work since it
    gave its own turn up, flushing its pools.
    """

    def __init__(
        self,
        read: Callable[[], dict[int, int]],
        own_pid: int | None = None,
        allowance: int = OTHERS_ALLOWANCE,
        timeout_s: float = MEMORY_WAIT_S,
        steady_s: float = MEMORY_STEADY_S,
        poll_s: float = POLL_S,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] = time.sleep,
    ):
        self._read = read
        self._own = os.getpid() if own_pid is None else own_pid
        self._allowance = allowance
        self._timeout_s = timeout_s
        self._steady_s = steady_s
        self._poll_s = poll_s
        self._clock = clock
        self._sleep = sleep
        self._settled: dict[int, int] = {}  # pid -> bytes found not coming back

    def filling(self, processes: dict[int, int]) -> dict[int, int]:
        """The bytes beyond the allowance of the other processes that fill the GPU."""
        self._settled = {pid: b for pid, b in self._settled.items() if pid in processes}
        return {
            pid: used - self._allowance
            for pid, used in processes.items()
            if pid != self._own and used > self._allowance and used > self._settled.get(pid, -1)
        }

    def wait(self) -> HandoverWait:
        started = self._clock()
        over = self._look()
        if not over:
            return HandoverWait(0.0, 0, 0, "free" if over is not None else "unread")
        held = lowest = sum(over.values())
        logger.info(
            "Taking the GPU from another cluster: waiting for %.2f GiB held by process(es) %s to come back",
            held / 2**30,
            sorted(over),
        )
        fell, outcome = started, "free"
        while over:
            now = self._clock()
            if now - started >= self._timeout_s:
                outcome = "timeout"
                break
            if now - fell >= self._steady_s:
                outcome = "steady"
                break
            self._sleep(self._poll_s)
            looked = self._look()
            if looked is None:
                outcome = "unread"
                break
            over = looked
            if sum(over.values()) < lowest:
                lowest, fell = sum(over.values()), self._clock()
        waited = self._clock() - started
        if outcome != "free":  # not waited for again while it holds no more than now
            self._settled.update({pid: b + self._allowance for pid, b in over.items()})
        return HandoverWait(waited, held, sum(over.values()), outcome, tuple(sorted(over)))

    def _look(self) -> dict[int, int] | None:
        """``filling`` now; None where the probe could not say."""
        try:
            return self.filling(self._read())
        except READ_ERRORS:  # the task runs whatever the probe says
            logger.warning(
                "Could not list the processes on the GPU: not waiting for their memory", exc_info=True
            )
            return None


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

    def __init__(
        self,
        gpu_uuid: str,
        cluster: str,
        directory: Path | None = None,
        flush: Callable[[], None] | None = None,
        handover: MemoryHandover | None = None,
    ):
        """``flush``: gives this process's cached device memory back before it gives up
        the turn; ``handover``: what it waits on when it takes the turn from another
        cluster (neither: no flush, no wait)."""
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
        self._flush = flush
        self._handover = handover
        self._handed_over = False  # the last entry took the turn from another cluster
        self.flush_s = 0.0  # the last flush's duration

    @contextlib.contextmanager
    def hold(self) -> Iterator[Waited]:
        """Hold the turn for the block; yields the seconds spent waiting for it (with
        what the memory hand-over took, ``Waited.handover``)."""
        waited = self.acquire()
        try:
            yield waited
        finally:
            self.release()

    def acquire(self) -> Waited:
        started = time.monotonic()
        with self._changed:
            while self._entering:  # another thread of ours is entering: share its turn
                self._changed.wait()
            if self._holders:
                self._holders += 1
                return Waited(0.0)
            if self._fd is not None and self._room_stamp() == self._room_seen:
                self._holders = 1  # still ours, and nobody asked to wait since
                return Waited(0.0)
            self._entering = True
            lingering, self._fd = self._fd, None
        fd = None
        handover = None
        entered = False
        try:
            if lingering is not None:
                self._give_up(lingering)  # another cluster asked: enter again, as a newcomer would
            fd = os.open(self.gate, os.O_RDWR | os.O_CREAT, 0o600)
            while not self._enter(fd):
                time.sleep(POLL_S)
            if self._handed_over and self._handover is not None:
                handover = self._handover.wait()  # the turn is ours: nobody else starts meanwhile
            entered = True
        finally:
            if not entered:  # whatever stopped us (an interrupt too): the next thread tries
                if fd is not None:
                    os.close(fd)
                with self._changed:
                    self._entering = False
                    self._changed.notify_all()
                self._stop_waiting()
        with self._changed:
            self._fd, self._holders, self._entering = fd, 1, False
            self._changed.notify_all()
        return Waited(time.monotonic() - started, handover)

    def _give_up(self, fd: int) -> None:
        """Give the gate up, this process's cached device memory first."""
        if self._flush is not None:
            started = time.perf_counter()
            try:
                self._flush()
            # A CUDA error (CuPy's and torch's are RuntimeErrors): the gate is given up all the same.
            except (RuntimeError, OSError, AttributeError):
                logger.warning(
                    "Could not flush the allocators' pools before giving up the GPU", exc_info=True
                )
            self.flush_s = time.perf_counter() - started
            logger.debug(
                "Flushed the allocators' pools in %.1f ms before giving up the GPU", self.flush_s * 1e3
            )
        _close_quietly(fd)

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
                self._handed_over = not had_turn
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
                        self._give_up(fd)
                        return
                    self._lingering = closer
                self._changed.notify_all()

    def _close_when_idle(self) -> None:
        """Drop the gate once no task run held it for ``LINGER_S``, or as soon as
        another cluster asks for it."""
        with self._changed:
            while True:
                if self._holders or self._fd is None:
                    self._changed.wait()
                    continue
                left = self._linger_until - time.monotonic()
                if left > 0 and self._room_stamp() == self._room_seen:
                    self._changed.wait(min(left, POLL_S))
                    continue
                fd, self._fd = self._fd, None
                self._give_up(fd)  # drops the shared lock on the gate

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


class Waited(float):
    """Seconds a task run waited for its turn; ``handover``: what it waited for another
    cluster's memory meanwhile (None: it did not take the turn from another cluster)."""

    handover: HandoverWait | None

    def __new__(cls, seconds: float, handover: HandoverWait | None = None) -> Waited:
        waited = super().__new__(cls, seconds)
        waited.handover = handover
        return waited


def _close_quietly(fd: int) -> None:
    with contextlib.suppress(OSError):
        os.close(fd)


_claims: dict[tuple[str, str], HostGPUClaim] = {}
_claims_lock = threading.Lock()
WAIT_NOTED_S = 0.5  # a wait longer than this is said in the task run's log


def claim_for(gpu_uuid: str, cluster: str, probe: Any = None) -> HostGPUClaim:
    """This process's one claim on ``gpu_uuid`` for ``cluster``: it flushes the loaded
    allocators' pools as it gives the turn up, and waits for other processes' memory
    where ``probe`` lists it (``process_memories``) as it takes the turn."""
    with _claims_lock:
        if (gpu_uuid, cluster) not in _claims:
            from prefect_gpu_dask.worker.guard import release_allocator_caches

            listed = getattr(probe, "process_memories", None)
            handover = MemoryHandover(listed) if listed is not None else None
            _claims[gpu_uuid, cluster] = HostGPUClaim(
                gpu_uuid, cluster, flush=release_allocator_caches, handover=handover
            )
        return _claims[gpu_uuid, cluster]


@contextlib.contextmanager
def claiming_gpu(memory_probe: Any = None) -> Iterator[None]:
    """The ``around`` of a ``gpu`` task run: hold this worker's GPU against other
    clusters on the host while it runs (a no-op on a worker without a GPU)."""
    from prefect_gpu_dask._compat import current_worker
    from prefect_gpu_dask.worker.probe import OPEN_ERRORS, worker_probe

    worker = current_worker()
    try:
        probe = worker_probe(worker, memory_probe) if worker is not None else None
    except OPEN_ERRORS:  # the guard and the labels say why; the task still runs
        probe = None
    if probe is None:
        yield
        return
    cluster = str(getattr(worker.scheduler, "address", ""))  # the scheduler names the cluster
    with claim_for(probe.gpu.uuid, cluster, probe).hold() as waited:
        handover = waited.handover
        if waited > WAIT_NOTED_S or (handover is not None and handover.held):
            _say_wait(waited, probe.gpu.uuid)
        yield


def _say_wait(waited: Waited, gpu_uuid: str) -> None:
    """In the task run's log: how long it waited for the GPU, and for what."""
    from prefect.logging import get_run_logger

    run_logger = get_run_logger()
    if waited > WAIT_NOTED_S:
        run_logger.info(
            "Waited %.1f s for GPU %s: another cluster on this host was running gpu tasks on it",
            waited,
            gpu_uuid,
        )
    handover = waited.handover
    if handover is None or not handover.held:
        return
    if handover.outcome == "free":
        run_logger.info(
            "GPU %s handed over: waited %.2f s for %.2f GiB another cluster's process held to come back",
            gpu_uuid,
            handover.waited_s,
            handover.held / 2**30,
        )
    else:
        run_logger.warning(
            "GPU %s: process(es) %s still hold %.2f GiB more than a CUDA context after %.1f s (%s); "
            "starting anyway, the task may run out of memory",
            gpu_uuid,
            ", ".join(map(str, handover.pids)),
            handover.left / 2**30,
            handover.waited_s,
            "stopped coming back" if handover.outcome == "steady" else handover.outcome,
        )
