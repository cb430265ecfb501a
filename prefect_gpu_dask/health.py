"""Is this process's GPU sick? NVML readings, a pure judge, and a small monitor.

``HealthReadings`` is what one check reads from NVML; ``judge`` turns readings into a
``HealthVerdict`` and touches nothing; ``HealthMonitor`` reads and judges once per
``check()`` and keeps the little state a verdict needs across checks. Before each task,
``screen()`` reads everything again only where the reader cannot vouch that nothing
changed since the last check (``NvmlHealthReader.quiet``: no Xid event waiting, the same
ECC count, no hardware slowdown). Tests drive the
monitor with a plain callable returning readings; ``HealthMonitor.for_this_worker()``
builds the NVML reader (``pynvml`` is imported inside functions only, so the package
imports and runs on machines without a GPU).

What quarantines (``healthy=False``) and why:

- the GPU is lost (NVML answered ``GPU_IS_LOST``), or NVML says it needs a reset
  (``RESET_REQUIRED``): nothing more can run on it;
- volatile uncorrectable ECC errors > 0: memory failed since the last reset, and the
  counter clears only with a reset, which cannot happen while this process holds the GPU;
- row remapping failed: the GPU could not take the bad memory out of use;
- page retirement pending (GPUs before Ampere, which have no dynamic page offlining):
  the bad page stays in use until a reset;
- a critical Xid (``CRITICAL_XIDS``), each one that NVIDIA's Xid catalogue answers with
  a GPU reset (or worse);
- hardware slowdown (the GPU's own thermal, power-brake or external slowdown signal) in
  ``slowdown_checks`` consecutive checks.

What only warns: pending row remapping (error containment and dynamic page offlining
keep the bad row out of use until the next reset), other Xids (most are application
faults, some are signs to watch: ``WARNING_XIDS``), a hardware slowdown not yet
persistent, and queries NVML failed to answer.

``NVML_ERROR_UNKNOWN`` is not taken for a lost GPU: NVML returns it for driver states
that pass, and a GPU that really fell off the bus answers ``GPU_IS_LOST`` or raises
Xid 79. A query that fails that way is named in ``HealthReadings.unanswered`` (a warning)
rather than read as a healthy figure.
"""

from __future__ import annotations

import dataclasses
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from prefect_gpu_dask import nvml

# Xids whose catalogue entry asks for a GPU reset, node reboot or hardware service.
# Source: NVIDIA's Xid catalogue (docs.nvidia.com/deploy/xid-errors) and the driver's
# mnemonics (open-gpu-kernel-modules, src/common/sdk/nvidia/inc/nverror.h).
CRITICAL_XIDS: dict[int, str] = {
    48: "double-bit ECC error",  # ROBUST_CHANNEL_GPU_ECC_DBE: reset to clear
    64: "row remapping or page retirement failed",  # INFOROM_DRAM_RETIREMENT_FAILURE
    74: "NVLink error",  # NVLINK_ERROR: reset or reboot to clear
    79: "GPU fell off the bus",  # ROBUST_CHANNEL_GPU_HAS_FALLEN_OFF_THE_BUS
    94: "contained uncorrectable ECC error",  # same condition as the volatile ECC count
    95: "uncontained uncorrectable ECC error",  # reset before anything runs again
    119: "GSP RPC timeout",  # GSP_RPC_TIMEOUT: the GPU's firmware stopped answering
    120: "GSP error",  # GSP_ERROR
    140: "unrecovered ECC error",  # pages could not be offlined or remapped: reset
}

# Xids named in warnings; the catalogue asks for no reset.
WARNING_XIDS: dict[int, str] = {
    13: "graphics engine exception",
    31: "GPU memory page fault",
    43: "GPU stopped processing",
    45: "preemptive cleanup",
    63: "row remapping or page retirement recorded",
    92: "high single-bit ECC error rate",
}

# More events than this in one check are left for the next, so a storm cannot stall one.
MAX_EVENTS_PER_CHECK = 64

_ALL_INSTANCES = 0xFFFFFFFF  # event field value meaning "the whole GPU" (no MIG instance)


@dataclass(frozen=True)
class HealthReadings:
    """What one check read from NVML for one GPU.

    A MIG instance is judged by its parent GPU's ECC, row-remapping, page-retirement and
    clock readings (NVML answers those for whole GPUs only), and by the Xids raised for
    the whole GPU or for this instance. ``None``: the GPU or driver cannot say.
    """

    gpu_uuid: str | None  # None: the driver did not say
    lost: bool = False
    ecc_volatile_uncorrectable: int | None = None
    retired_pages_pending: bool | None = None
    row_remap_failure: bool | None = None
    row_remap_pending: bool | None = None
    hw_slowdown: bool = False
    xid_events: tuple[int, ...] = ()  # Xid codes raised since the last check
    reset_required: bool = False
    unanswered: tuple[str, ...] = ()  # queries that failed for another reason than support


@dataclass(frozen=True)
class HealthVerdict:
    """``healthy`` is False when ``reasons`` is not empty; ``warnings`` never quarantine."""

    healthy: bool
    reasons: tuple[str, ...]
    gpu_uuid: str | None
    warnings: tuple[str, ...] = ()


def describe_xid(xid: int, count: int = 1) -> str:
    name = CRITICAL_XIDS.get(xid) or WARNING_XIDS.get(xid)
    text = f"Xid {xid} ({name})" if name else f"Xid {xid}"
    return text if count == 1 else f"{text}, {count} times"


def judge(readings: HealthReadings, previous_slowdowns: int = 0, slowdown_checks: int = 3) -> HealthVerdict:
    """The verdict on one set of readings. Pure.

    ``previous_slowdowns``: how many checks in a row before this one saw a hardware
    slowdown; with this one they reach ``slowdown_checks`` and the slowdown quarantines.
    """
    if _clean(readings):  # the usual case, kept short
        return HealthVerdict(True, (), readings.gpu_uuid)
    reasons: list[str] = []
    warnings: list[str] = []
    if readings.lost:
        reasons.append("GPU is lost (fell off the bus)")
    if readings.reset_required:
        reasons.append("GPU needs a reset")
    errors = readings.ecc_volatile_uncorrectable
    if errors is not None and errors > 0:
        reasons.append(f"{errors} volatile uncorrectable ECC error{'' if errors == 1 else 's'}")
    if readings.row_remap_failure:
        reasons.append("row remapping failed")
    if readings.retired_pages_pending:
        reasons.append("page retirement pending")
    if readings.row_remap_pending:
        warnings.append("row remapping pending (applied at the next GPU reset)")
    counts: dict[int, int] = {}
    for xid in readings.xid_events:
        counts[xid] = counts.get(xid, 0) + 1
    for xid, count in counts.items():
        (reasons if xid in CRITICAL_XIDS else warnings).append(describe_xid(xid, count))
    if readings.hw_slowdown:
        streak = previous_slowdowns + 1
        if streak >= slowdown_checks:
            reasons.append(f"hardware slowdown in {streak} consecutive checks")
        else:
            warnings.append(f"hardware slowdown ({streak} of {slowdown_checks} checks to quarantine)")
    if readings.unanswered:
        warnings.append(f"NVML did not answer: {', '.join(readings.unanswered)}")
    return HealthVerdict(not reasons, tuple(reasons), readings.gpu_uuid, tuple(warnings))


def _clean(r: HealthReadings) -> bool:
    return not (
        r.lost
        or r.reset_required
        or r.ecc_volatile_uncorrectable
        or r.row_remap_failure
        or r.retired_pages_pending
        or r.row_remap_pending
        or r.hw_slowdown
        or r.xid_events
        or r.unanswered
    )


class HealthMonitor:
    """Checks one GPU: built once per worker process, ``check()`` as often as wanted.

    Critical Xids stay in every later verdict: the reset they call for needs every
    process off the GPU, this one included, so for this process they never clear.
    ``limits`` says, once, what this GPU, driver or container does not let it check.
    """

    def __init__(
        self,
        reader: Callable[[], HealthReadings],
        slowdown_checks: int = 3,
        limits: tuple[str, ...] | None = None,
    ):
        if slowdown_checks < 1:
            raise ValueError(f"slowdown_checks must be at least 1, not {slowdown_checks}")
        self._reader = reader
        self.slowdown_checks = slowdown_checks
        self.limits: tuple[str, ...] = tuple(limits if limits is not None else getattr(reader, "limits", ()))
        self._slowdowns = 0
        self._critical: tuple[int, ...] = ()
        self._last: HealthVerdict | None = None
        self._lock = threading.Lock()

    @classmethod
    def for_this_worker(cls, slowdown_checks: int = 3) -> HealthMonitor | None:
        """A monitor of this process's GPU (first ``CUDA_VISIBLE_DEVICES`` entry) read
        through NVML, or None where NVML has no GPU for this process."""
        if nvml.visible_gpu_count() == 0:
            return None
        import pynvml

        try:
            reader = NvmlHealthReader(nvml.worker_device_handle())
        except pynvml.NVMLError as error:
            if error.value != pynvml.NVML_ERROR_GPU_IS_LOST:
                return None
            # Lost before the first reading: still a GPU this process was given, and sick.
            lost = HealthReadings(_visible_name(), lost=True)
            return cls(
                lambda: lost, slowdown_checks, ("everything: the GPU was lost before the first check",)
            )
        except RuntimeError:  # distributed found no GPU for this process
            return None
        return cls(reader, slowdown_checks)

    @property
    def slowdowns(self) -> int:
        """Consecutive checks, up to the last, that saw a hardware slowdown."""
        return self._slowdowns

    def check(self) -> HealthVerdict:
        with self._lock:
            readings = self._reader()
            if readings.xid_events or self._critical:
                # Earlier critical Xids once each, then this check's events as counted.
                earlier = tuple(xid for xid in self._critical if xid not in readings.xid_events)
                if earlier:
                    readings = dataclasses.replace(readings, xid_events=earlier + readings.xid_events)
                self._critical += tuple(
                    dict.fromkeys(
                        x for x in readings.xid_events if x in CRITICAL_XIDS and x not in self._critical
                    )
                )
            verdict = self._last = judge(readings, self._slowdowns, self.slowdown_checks)
            self._slowdowns = self._slowdowns + 1 if readings.hw_slowdown else 0
            return verdict

    def screen(self) -> HealthVerdict:
        """The verdict right before a task: the last check's where that one was healthy
        and the reader vouches that nothing which quarantines has happened since
        (its ``quiet()``), else a new ``check()``. A reader without ``quiet`` is read
        in full every time."""
        quiet = getattr(self._reader, "quiet", None)
        if quiet is not None:
            with self._lock:
                last = self._last
                if last is not None and last.healthy and quiet():
                    return last
        return self.check()

    def close(self) -> None:
        close = getattr(self._reader, "close", None)
        if close is not None:
            close()


def _visible_name() -> str:
    visible = os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",")[0].strip()
    return visible or "0"


class NvmlHealthReader:
    """Reads ``HealthReadings`` for one NVML device handle (a GPU or a MIG instance).

    Each reading (``nvml``'s readers) is tried once here: one the GPU, driver or
    container does not support, or lets this process read, is left out of every check
    and named in ``limits``. In a check, a reading that raises gives None for its
    fields; ``GPU_IS_LOST`` and ``RESET_REQUIRED`` set their flags. Xid events are
    drained without waiting.

    ``quiet()`` is the cheap reading before each task: every condition that quarantines
    a GPU but a slowdown raises an Xid when it happens (ECC errors 48, 94, 95; row
    remapping or page retirement 63, 64; a lost GPU 79; and the rest of
    ``CRITICAL_XIDS``), and a lost GPU or one that needs a reset fails device queries.
    So where Xid events are registered, the event queue, the ECC count and the clock
    event reasons (the slowdown) say whether a full reading can tell anything new.
    """

    def __init__(self, handle: Any):
        import pynvml

        self._nvml = p = pynvml
        self.gpu_uuid = nvml.device_uuid(handle)
        self._device, self._instance = _physical_device(p, handle)
        limits: list[str] = []
        self._ecc = self._supported("ECC errors", limits, nvml.ecc_volatile_uncorrectable)
        if self._ecc and not self._ecc_enabled():
            self._ecc = False
            limits.append("ECC errors not checked: ECC is disabled on this GPU")
        self._retired = self._supported("page retirement", limits, nvml.retired_pages_pending)
        self._rows = self._supported("row remapping", limits, nvml.remapped_rows)
        self._slowdown_mask = nvml.hardware_slowdown_mask()
        self._clocks = self._supported("hardware slowdown", limits, nvml.clock_event_reasons)
        self._xid_type = p.nvmlEventTypeXidCriticalError
        self._wait = getattr(p, "nvmlEventSetWait_v2", None) or p.nvmlEventSetWait
        self._events = self._open_events(limits)
        self._waiting: list[Any] = []  # events quiet() took off the queue, for the next reading
        self._ecc_seen: int | None = None
        self._quiet = frozenset(_quiet_codes(p))
        self.limits = tuple(limits)

    def _supported(self, name: str, limits: list[str], reading: Callable[[Any], Any]) -> bool:
        p = self._nvml
        try:
            answer = reading(self._device)
        except p.NVMLError as error:
            if error.value == p.NVML_ERROR_NO_PERMISSION:
                limits.append(f"{name} not checked: no permission")
                return False
            # A lost GPU or one that needs a reset: the checks report it. Any other
            # error may pass, and the checks will say so.
            return True
        if answer is None:
            limits.append(f"{name} not checked: not supported by this GPU or driver")
            return False
        return True

    def _ecc_enabled(self) -> bool:
        try:
            enabled = nvml.ecc_enabled(self._device)
        except self._nvml.NVMLError:  # the counter answered: let it speak
            return True
        return enabled is not False

    def _open_events(self, limits: list[str]) -> Any:
        p = self._nvml
        try:
            supported = p.nvmlDeviceGetSupportedEventTypes(self._device)
        except p.NVMLError as error:
            limits.append(f"Xid events not checked: {error}")
            return None
        if not supported & self._xid_type:
            limits.append("Xid events not checked: not supported by this GPU or driver")
            return None
        try:
            events = p.nvmlEventSetCreate()
        except p.NVMLError as error:
            limits.append(f"Xid events not checked: {error}")
            return None
        try:
            p.nvmlDeviceRegisterEvents(self._device, self._xid_type, events)
        except p.NVMLError as error:  # MIG, containers without the capability
            _free_events(p, events)
            limits.append(f"Xid events not checked: registration refused ({error})")
            return None
        return events

    def __call__(self) -> HealthReadings:
        p = self._nvml
        failed: list[tuple[str, int]] = []

        def ask(name: str, reading: Callable[[Any], Any], wanted: bool) -> Any:
            if not wanted:
                return None
            try:
                return reading(self._device)
            except p.NVMLError as error:
                failed.append((name, error.value))
                return None

        errors = self._ecc_seen = ask("ECC", nvml.ecc_volatile_uncorrectable, self._ecc)
        pending = ask("page retirement", nvml.retired_pages_pending, self._retired)
        rows = ask("row remapping", nvml.remapped_rows, self._rows)
        reasons = ask("clocks", nvml.clock_event_reasons, self._clocks)
        xids = self._drain_xids(failed) if self._events is not None else ()
        codes = {code for _, code in failed}
        return HealthReadings(
            gpu_uuid=self.gpu_uuid,
            lost=p.NVML_ERROR_GPU_IS_LOST in codes,
            ecc_volatile_uncorrectable=errors,
            retired_pages_pending=pending,
            row_remap_failure=None if rows is None else rows.failed,
            row_remap_pending=None if rows is None else rows.pending,
            hw_slowdown=bool(reasons is not None and reasons & self._slowdown_mask),
            xid_events=xids,
            reset_required=p.NVML_ERROR_RESET_REQUIRED in codes,
            unanswered=tuple(name for name, code in failed if code not in self._quiet),
        )

    def quiet(self) -> bool:
        """Whether a full reading now would find what the last one did: Xid events are
        registered, none is waiting (nor kept from an earlier look), the ECC count has
        not moved, and the clocks show no hardware slowdown. An event found here waits
        for the next full reading; any failure says "not quiet"."""
        if self._events is None or self._waiting or (self._ecc and self._ecc_seen is None):
            return False
        if not (self._ecc or self._clocks):  # no device reading to vouch with
            return False
        p = self._nvml
        try:
            self._waiting.append(self._wait(self._events, 0))
            return False
        except p.NVMLError as error:
            if error.value != p.NVML_ERROR_TIMEOUT:
                return False
        try:
            if self._ecc and nvml.ecc_volatile_uncorrectable(self._device) != self._ecc_seen:
                return False
            # A slowdown raises no Xid: while it lasts, every screen is a full check.
            return not (self._clocks and (nvml.clock_event_reasons(self._device) or 0) & self._slowdown_mask)
        except p.NVMLError:  # a lost GPU, a reset needed: the full check says which
            return False

    def _drain_xids(self, failed: list[tuple[str, int]]) -> tuple[int, ...]:
        p, xids = self._nvml, []
        waiting, self._waiting = self._waiting, []
        for _ in range(MAX_EVENTS_PER_CHECK):
            if waiting:
                data = waiting.pop(0)
            else:
                try:
                    data = self._wait(self._events, 0)
                except p.NVMLError as error:
                    if error.value != p.NVML_ERROR_TIMEOUT:  # timeout: no event waiting
                        failed.append(("Xid events", error.value))
                    break
            if data.eventType == self._xid_type and self._concerns_us(data):
                xids.append(int(data.eventData))
        self._waiting = waiting  # more than one check's worth: the next check's
        return tuple(xids)

    def _concerns_us(self, data: Any) -> bool:
        if self._instance is None:
            return True
        gpu_instance, compute_instance = self._instance
        return data.gpuInstanceId in (_ALL_INSTANCES, gpu_instance) and data.computeInstanceId in (
            _ALL_INSTANCES,
            compute_instance,
        )

    def close(self) -> None:
        events, self._events = self._events, None
        if events is not None:
            _free_events(self._nvml, events)


def _physical_device(p: Any, handle: Any) -> tuple[Any, tuple[int, int] | None]:
    """The whole GPU behind ``handle`` and, for a MIG instance, its (GPU, compute)
    instance ids."""
    try:
        is_mig = p.nvmlDeviceIsMigDeviceHandle(handle)
    except p.NVMLError:  # driver without MIG
        return handle, None
    if not int(getattr(is_mig, "value", is_mig)):
        return handle, None
    parent = p.nvmlDeviceGetDeviceHandleFromMigDeviceHandle(handle)
    instance = (int(p.nvmlDeviceGetGpuInstanceId(handle)), int(p.nvmlDeviceGetComputeInstanceId(handle)))
    return parent, instance


def _quiet_codes(p: Any) -> tuple[int, ...]:
    """Failures a check reports by flags or not at all, not as unanswered queries."""
    return (
        p.NVML_ERROR_GPU_IS_LOST,
        p.NVML_ERROR_RESET_REQUIRED,
        p.NVML_ERROR_NOT_SUPPORTED,
        p.NVML_ERROR_FUNCTION_NOT_FOUND,
    )


def _free_events(p: Any, events: Any) -> None:
    try:
        p.nvmlEventSetFree(events)
    except p.NVMLError:
        pass  # nothing left to release on a lost GPU
