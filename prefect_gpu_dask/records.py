"""The typed records: what the guard saw around one task, and what one restart did.

A ``TaskRecord`` is built on the worker (``worker.guard``), travels to the flow as a Dask
worker event (a plain dict on the wire: ``to_event``/``from_event``) and is read by
attribute everywhere after. A ``RestartRecord`` is built on the flow side by the
recycler. Byte figures are ints; ``dask.utils.format_bytes`` makes them readable.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from typing import Any

from dask.utils import format_bytes as _format_bytes

CLEAN, CACHED, LIBRARY, LEAK, OOM = "clean", "cached", "library", "leak", "oom"
VERDICTS = (CLEAN, CACHED, LIBRARY, LEAK, OOM)
# The Dask worker-event topics records travel on, worker -> flow.
RECORD_TOPIC = "prefect-gpu-dask-memory"
HUNG_TOPIC = "prefect-gpu-dask-hung"
UNHEALTHY_TOPIC = "prefect-gpu-dask-unhealthy"
# Flow -> every flow on the cluster: take your results off these workers (``ResultsOff``).
RESULTS_OFF_TOPIC = "prefect-gpu-dask-results-off"
# Worker event topics, worker -> scheduler: a task run's engine is starting on this
# worker; and it ended, in which state (type, name, message).
STARTED_TOPIC = "prefect-gpu-dask.task-run-started"
ENDED_TOPIC = "prefect-gpu-dask.task-run-ended"
# Task annotations the scheduler sets for the next worker: the worker that died running
# this task run, and whether it had started it there (not merely queued it).
INTERRUPTED = "prefect-gpu-dask-worker-died"
STARTED_THERE = "prefect-gpu-dask-started-on-dead-worker"
# And: this task run's result was lost with a worker after the run ended (Dask computes it
# again); its value is the run's final state as the worker told the scheduler, where it did.
RESULT_LOST = "prefect-gpu-dask-result-lost"
# Task annotation the flow sets: this Dask task is a Prefect task run, which must not
# run twice (a plain Dask task may simply be computed again).
TASK_RUN = "prefect-gpu-dask-task-run"
# TaskRecord fields that count bytes: tables show them readable and keep the number beside.
BYTE_FIELDS = (
    "before",
    "after",
    "peak",
    "delta",
    "allocator_delta",
    "oom_requested",
    "device_used",
    "device_total",
)


def _known_fields(cls: type, values: dict[str, Any]) -> dict[str, Any]:
    """``values`` less the keys ``cls`` has no field for (newer or foreign payloads)."""
    known = {f.name for f in fields(cls)}
    return {k: v for k, v in values.items() if k in known}


def format_bytes(n: int) -> str:
    """``dask.utils.format_bytes`` that keeps a sign."""
    return ("-" if n < 0 else "") + _format_bytes(abs(n))


@dataclass(frozen=True)
class TaskRecord:
    """GPU memory around one guarded task run, measured on the worker that ran it."""

    task_run_id: str | None
    task_run_name: str | None
    task_name: str | None
    flow_run_id: str | None
    tags: tuple[str, ...]
    worker: str
    worker_name: str
    pid: int
    gpu_index: int
    gpu_uuid: str
    before: int  # bytes this process held on its GPU right before the task
    after: int  # ... right after it (once caches had their chance, where suspected)
    peak: int  # the highest reading while it ran
    delta: int  # memory in use (less pools' free blocks) after minus before
    allocator_delta: int | None  # of which allocators say the task still holds (None: none to ask)
    device_used: int
    device_total: int
    verdict: str  # clean | cached | library | leak | oom
    restart_reason: str | None
    duration_s: float
    time: float  # wall-clock end, seconds since the epoch
    oom_requested: int | None = None  # bytes the failed allocation asked for, where the library says
    oom_library: str | None = None  # cupy | torch | rmm | numba | cuda
    gpu_share: float | None = None  # of its GPU the task asked for (gpu:0.5 -> 0.5)
    gpu_seconds: float | None = None  # duration_s x gpu_share
    sm_util_mean: float | None = None  # % of the GPU's SMs busy over the task (util_scope says whose)
    sm_util_peak: float | None = None
    util_scope: str | None = None  # process: this worker's own samples | device: the whole GPU's
    energy_j: float | None = None  # the whole GPU's energy over the task (its share: x gpu_share)
    temperature_peak_c: int | None = None
    throttle_reasons: tuple[str, ...] = ()  # clock slowdowns seen while it ran (sw_power_cap, ...)
    flow_name: str | None = None  # the flow's name: a bounded label for metrics per flow
    allocator: str | None = None  # whose counters judged it: rmm | cupy | torch, joined by "+"

    def to_event(self) -> dict[str, Any]:
        """Plain data for ``Worker.log_event`` (msgpack-friendly)."""
        event = dict(vars(self))  # every field is plain already: no deep copy (asdict)
        event["tags"] = list(self.tags)
        event["throttle_reasons"] = list(self.throttle_reasons)
        return event

    @classmethod
    def from_event(cls, event: dict[str, Any]) -> TaskRecord:
        values = _known_fields(cls, event)
        values["tags"] = tuple(values.get("tags") or ())
        values["throttle_reasons"] = tuple(values.get("throttle_reasons") or ())
        return cls(**values)

    @classmethod
    def from_row(cls, row: dict[str, Any]) -> TaskRecord:
        """A row of the runner's table artifacts (``reporting.table_rows``) as a record."""
        values = dict(row)
        for name in BYTE_FIELDS:
            if f"{name}_bytes" in values:
                values[name] = values.pop(f"{name}_bytes")
        if isinstance(values.get("tags"), str):
            values["tags"] = [tag for tag in values["tags"].split(", ") if tag]
        return cls.from_event(values)

    @property
    def growth(self) -> int:
        """What the task itself added at its peak."""
        return max(0, self.peak - self.before)


@dataclass(frozen=True)
class HungTask:
    """A task run still running past its ``timeout_seconds``, seen by its worker's
    watchdog; or (``stalled``) one whose thread stayed in one call, using no CPU, while
    its GPU did no work, for ``timeout_s`` (its flow run's ``stall_s``)."""

    task_run_id: str
    task_run_name: str
    flow_run_id: str | None
    key: str  # the Dask key of the task run
    worker: str
    worker_name: str
    pid: int
    timeout_s: float
    running_s: float
    stalled: bool = False
    fail: bool = True  # end it TimedOut and recycle its worker; False: only say so (on_stall="warn")

    def to_event(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_event(cls, event: dict[str, Any]) -> HungTask:
        return cls(**{f.name: event[f.name] for f in fields(cls) if f.name in event})


@dataclass(frozen=True)
class ResultsOff:
    """A restart of ``workers`` waits for results other flow runs hold only there, and a
    hung task keeps those workers from running the work those flow runs need to end and
    let them go. Each runner that hears it moves its own results there into its flow.
    ``requester``: the Dask client id of the flow run whose restart waits."""

    workers: tuple[str, ...]
    requester: str
    reason: str

    def to_event(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_event(cls, event: dict[str, Any]) -> ResultsOff:
        values = _known_fields(cls, event)
        return cls(**{**values, "workers": tuple(values["workers"])})


@dataclass(frozen=True)
class GPUQuarantine:
    """A GPU found unhealthy by its worker's health check, and what became of its worker.

    ``withdrawn``: the worker's GPU resources were set to 0 on the scheduler, so its
    ``gpu`` tasks go to healthy GPUs. False while no other worker offers a GPU: the
    worker keeps them, and ``gpu`` tasks reaching it fail at once (``UnhealthyGPUError``)
    instead of waiting for a GPU that will not come.
    """

    worker: str
    worker_name: str
    pid: int
    gpu_index: int
    gpu_uuid: str
    reasons: tuple[str, ...]
    warnings: tuple[str, ...]
    withdrawn: bool
    healthy_gpu_workers: int  # other workers still offering a GPU when this one was judged
    time: float  # wall clock, seconds since the epoch

    @property
    def flow_run_id(self) -> None:
        return None  # a GPU belongs to no one flow run

    @property
    def task_run_id(self) -> None:
        return None

    def describe(self) -> str:
        where = f"GPU {self.gpu_index} ({self.gpu_uuid}) on worker {self.worker_name}"
        return f"{where}: {'; '.join(self.reasons)}"

    def to_event(self) -> dict[str, Any]:
        event = asdict(self)
        event["reasons"], event["warnings"] = list(self.reasons), list(self.warnings)
        return event

    @classmethod
    def from_event(cls, event: dict[str, Any]) -> GPUQuarantine:
        values = {f.name: event[f.name] for f in fields(cls)}
        values["reasons"], values["warnings"] = tuple(values["reasons"]), tuple(values["warnings"])
        return cls(**values)


REPLACED, LOST = "replaced", "lost"


@dataclass(frozen=True)
class RestartRecord:
    """One worker (or cluster) restart the runner carried out, and why."""

    worker: str
    worker_name: str
    reason: str
    policy: str
    gpu_index: int | None = None
    gpu_uuid: str | None = None
    flow_run_id: str | None = None
    task_run_id: str | None = None  # the task whose record asked for the restart
    task_run_name: str | None = None
    old_pid: int | None = None
    new_worker: str | None = None
    new_pid: int | None = None
    memory_before: int | None = None  # the old process's bytes on its GPU at the verdict
    memory_after: int | None = None  # the replacement's bytes once it serves
    baseline: int | None = None
    safe_point_s: float | None = None  # request -> nothing left running there: the restart began
    restart_s: float = 0.0  # request -> the scheduler's restart returned (the new process registered)
    serving_s: float = 0.0  # request -> the replacement was found serving, memory read
    # request -> the replacement found the old process's GPU memory released: an upper
    # bound (it looks once it has started), None where no NVML probe could look.
    memory_free_s: float | None = None
    # "replaced": a worker of the same name serves again; "lost": none came back (why in
    # ``lost_reason``): its GPU has no worker until one joins.
    outcome: str = REPLACED
    lost_reason: str | None = None
    requested_at: float = 0.0  # Unix time the restart was asked for

    @property
    def lost(self) -> bool:
        return self.outcome == LOST

    def to_payload(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_payload(cls, payload: dict[str, Any]) -> RestartRecord:
        return cls(**_known_fields(cls, payload))
