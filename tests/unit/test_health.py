"""Sick-GPU detection: the pure judge, the monitor driven by scripted readings, and the
NVML reader against a stand-in ``pynvml`` (no GPU, no driver)."""

from __future__ import annotations

import sys
import types
from collections.abc import Iterable

import pytest

from prefect_gpu_dask import health, nvml
from prefect_gpu_dask.health import (
    CRITICAL_XIDS,
    WARNING_XIDS,
    HealthMonitor,
    HealthReadings,
    HealthVerdict,
    NvmlHealthReader,
    judge,
)

UUID = "GPU-6b5a4c3d-0000-1111-2222-333344445555"
OK = HealthReadings(
    UUID,
    ecc_volatile_uncorrectable=0,
    retired_pages_pending=False,
    row_remap_failure=False,
    row_remap_pending=False,
)


def readings(**fields) -> HealthReadings:
    return HealthReadings(**{**OK.__dict__, **fields})


def scripted(*script: HealthReadings):
    """A reader that returns the given readings in turn, then repeats the last."""
    steps = list(script)

    def read() -> HealthReadings:
        return steps.pop(0) if len(steps) > 1 else steps[0]

    return read


# -- judge ---------------------------------------------------------------------------


def test_clean_readings_are_healthy():
    assert judge(OK) == HealthVerdict(True, (), UUID, ())


def test_unsupported_fields_are_healthy():
    # A consumer GPU: no ECC, no page retirement, no row remapping.
    verdict = judge(HealthReadings(UUID))
    assert verdict.healthy and verdict.reasons == () and verdict.warnings == ()


@pytest.mark.parametrize(
    "fields, reason",
    [
        ({"lost": True}, "GPU is lost (fell off the bus)"),
        ({"reset_required": True}, "GPU needs a reset"),
        ({"ecc_volatile_uncorrectable": 3}, "3 volatile uncorrectable ECC errors"),
        ({"ecc_volatile_uncorrectable": 1}, "1 volatile uncorrectable ECC error"),
        ({"row_remap_failure": True}, "row remapping failed"),
        ({"retired_pages_pending": True}, "page retirement pending"),
        ({"xid_events": (79,)}, "Xid 79 (GPU fell off the bus)"),
    ],
)
def test_each_sick_condition_quarantines_with_its_figure(fields, reason):
    verdict = judge(readings(**fields))
    assert not verdict.healthy
    assert verdict.reasons == (reason,)
    assert verdict.gpu_uuid == UUID


def test_every_condition_at_once_lists_every_reason_in_order():
    verdict = judge(
        readings(
            lost=True,
            ecc_volatile_uncorrectable=2,
            row_remap_failure=True,
            retired_pages_pending=True,
            xid_events=(48, 95),
        )
    )
    assert verdict.reasons == (
        "GPU is lost (fell off the bus)",
        "2 volatile uncorrectable ECC errors",
        "row remapping failed",
        "page retirement pending",
        "Xid 48 (double-bit ECC error)",
        "Xid 95 (uncontained uncorrectable ECC error)",
    )


def test_pending_row_remap_only_warns():
    verdict = judge(readings(row_remap_pending=True))
    assert verdict.healthy
    assert verdict.warnings == ("row remapping pending (applied at the next GPU reset)",)


def test_the_critical_xid_set_is_the_documented_one():
    assert set(CRITICAL_XIDS) == {48, 64, 74, 79, 94, 95, 119, 120, 140}
    assert not set(CRITICAL_XIDS) & set(WARNING_XIDS)


@pytest.mark.parametrize("xid", sorted(CRITICAL_XIDS))
def test_each_critical_xid_quarantines(xid):
    verdict = judge(readings(xid_events=(xid,)))
    assert verdict.reasons == (f"Xid {xid} ({CRITICAL_XIDS[xid]})",)


@pytest.mark.parametrize(
    "xid, warning",
    [
        (13, "Xid 13 (graphics engine exception)"),
        (31, "Xid 31 (GPU memory page fault)"),
        (63, "Xid 63 (row remapping or page retirement recorded)"),
        (92, "Xid 92 (high single-bit ECC error rate)"),
        (999, "Xid 999"),
    ],
)
def test_other_xids_only_warn(xid, warning):
    verdict = judge(readings(xid_events=(xid,)))
    assert verdict.healthy
    assert verdict.warnings == (warning,)


def test_repeated_xids_are_counted():
    verdict = judge(readings(xid_events=(48, 13, 48, 48)))
    assert verdict.reasons == ("Xid 48 (double-bit ECC error), 3 times",)
    assert verdict.warnings == ("Xid 13 (graphics engine exception)",)


def test_slowdown_warns_until_it_persists():
    first = judge(readings(hw_slowdown=True), previous_slowdowns=0, slowdown_checks=3)
    assert first.healthy
    assert first.warnings == ("hardware slowdown (1 of 3 checks to quarantine)",)
    third = judge(readings(hw_slowdown=True), previous_slowdowns=2, slowdown_checks=3)
    assert not third.healthy
    assert third.reasons == ("hardware slowdown in 3 consecutive checks",)
    # Earlier slowdowns count for nothing once this check sees none.
    assert judge(OK, previous_slowdowns=5).healthy


def test_unanswered_queries_warn_and_do_not_pass_for_lost():
    verdict = judge(readings(ecc_volatile_uncorrectable=None, unanswered=("ECC", "clocks")))
    assert verdict.healthy
    assert verdict.warnings == ("NVML did not answer: ECC, clocks",)


# -- monitor -------------------------------------------------------------------------


def test_monitor_quarantines_a_slowdown_in_three_consecutive_checks():
    slow = readings(hw_slowdown=True)
    monitor = HealthMonitor(scripted(slow, slow, slow, OK))
    verdicts = [monitor.check() for _ in range(4)]
    assert [v.healthy for v in verdicts] == [True, True, False, True]
    assert verdicts[2].reasons == ("hardware slowdown in 3 consecutive checks",)
    assert monitor.slowdowns == 0


def test_a_clear_check_restarts_the_slowdown_count():
    slow = readings(hw_slowdown=True)
    monitor = HealthMonitor(scripted(slow, slow, OK, slow, slow))
    assert all(monitor.check().healthy for _ in range(5))
    assert monitor.slowdowns == 2


def test_slowdown_checks_of_one_quarantines_at_once():
    monitor = HealthMonitor(scripted(readings(hw_slowdown=True)), slowdown_checks=1)
    assert monitor.check().reasons == ("hardware slowdown in 1 consecutive checks",)
    with pytest.raises(ValueError, match="at least 1"):
        HealthMonitor(scripted(OK), slowdown_checks=0)


def test_a_critical_xid_stays_in_later_verdicts():
    monitor = HealthMonitor(
        scripted(readings(xid_events=(79, 13)), OK, readings(xid_events=(48, 79, 79)), *[OK] * 1000)
    )
    first, second, third = monitor.check(), monitor.check(), monitor.check()
    assert first.reasons == ("Xid 79 (GPU fell off the bus)",)
    assert first.warnings == ("Xid 13 (graphics engine exception)",)
    assert second.reasons == ("Xid 79 (GPU fell off the bus)",)
    assert second.warnings == ()  # an application fault does not stick
    assert third.reasons == ("Xid 48 (double-bit ECC error)", "Xid 79 (GPU fell off the bus), 2 times")
    for _ in range(1000):  # what sticks is each Xid once, however many checks pass
        later = monitor.check()
    assert later.reasons == ("Xid 79 (GPU fell off the bus)", "Xid 48 (double-bit ECC error)")


def test_screen_reads_everything_where_the_reader_cannot_vouch():
    monitor = HealthMonitor(scripted(OK, readings(ecc_volatile_uncorrectable=1)))
    assert monitor.screen().healthy
    assert monitor.screen().reasons == ("1 volatile uncorrectable ECC error",)


class Vouching:
    """Scripted readings with a ``quiet()`` that says whether they changed."""

    def __init__(self, *answers):
        self.answers = list(answers)
        self.current = OK
        self.reads = 0

    def quiet(self):
        return not self.answers or self.answers[0] == self.current

    def __call__(self):
        self.reads += 1
        if self.answers:
            self.current = self.answers.pop(0)
        return self.current


def test_screen_keeps_a_healthy_verdict_while_the_reader_is_quiet():
    reader = Vouching(OK, OK, OK)
    monitor = HealthMonitor(reader)
    first = monitor.screen()  # no verdict yet: a full reading
    assert first.healthy and reader.reads == 1
    assert all(monitor.screen() is first for _ in range(10))
    assert reader.reads == 1
    reader.answers = [readings(xid_events=(95,))]
    assert monitor.screen().reasons == ("Xid 95 (uncontained uncorrectable ECC error)",)
    assert reader.reads == 2


def test_screen_never_keeps_an_unhealthy_verdict_unread():
    reader = Vouching(readings(row_remap_failure=True))
    monitor = HealthMonitor(reader)
    assert not monitor.screen().healthy
    assert reader.quiet()  # the reader vouches, yet a sick verdict is read again
    assert not monitor.screen().healthy and reader.reads == 2


def test_monitor_limits_come_from_the_reader_once():
    class Reader:
        limits = ("Xid events not checked: registration refused (Not Supported)",)

        def __call__(self):
            return OK

    monitor = HealthMonitor(Reader())
    assert monitor.limits == ("Xid events not checked: registration refused (Not Supported)",)
    assert monitor.check().warnings == ()  # said in limits, not in every verdict
    assert HealthMonitor(scripted(OK)).limits == ()
    assert HealthMonitor(Reader(), limits=("ECC errors not checked",)).limits == ("ECC errors not checked",)


def test_for_this_worker_is_none_without_a_gpu():
    assert nvml.visible_gpu_count() == 0  # this machine: NVML has no driver to talk to
    assert HealthMonitor.for_this_worker() is None


def test_for_this_worker_is_none_with_devices_named_but_no_driver(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    assert HealthMonitor.for_this_worker() is None


# -- the NVML reader, against a stand-in pynvml --------------------------------------


class Fail(int):
    """An answer that raises NVML's error of this code."""


class FakeNvml(types.ModuleType):
    """The part of ``pynvml`` the reader uses. ``answers`` maps a function name to what
    it returns, or to a ``Fail`` it raises."""

    NVML_ERROR_NOT_SUPPORTED = 3
    NVML_ERROR_NO_PERMISSION = 4
    NVML_ERROR_TIMEOUT = 10
    NVML_ERROR_FUNCTION_NOT_FOUND = 13
    NVML_ERROR_GPU_IS_LOST = 15
    NVML_ERROR_RESET_REQUIRED = 16
    NVML_ERROR_UNKNOWN = 999
    NVML_FEATURE_ENABLED = 1
    NVML_MEMORY_ERROR_TYPE_UNCORRECTED = 1
    NVML_VOLATILE_ECC = 0
    nvmlEventTypeXidCriticalError = 0x8
    nvmlClocksEventReasonHwSlowdown = 0x8
    nvmlClocksEventReasonHwThermalSlowdown = 0x40
    nvmlClocksEventReasonHwPowerBrakeSlowdown = 0x80
    nvmlClocksThrottleReasonHwSlowdown = 0x8
    nvmlClocksThrottleReasonHwThermalSlowdown = 0x40
    nvmlClocksThrottleReasonHwPowerBrakeSlowdown = 0x80

    class NVMLError(Exception):
        def __init__(self, value):
            super().__init__(value)
            self.value = value

        def __str__(self):
            return {3: "Not Supported", 15: "GPU is lost", 999: "Unknown Error"}.get(
                self.value, str(self.value)
            )

    def __init__(self):
        super().__init__("pynvml")
        self.answers = {
            "nvmlDeviceGetUUID": UUID,
            "nvmlDeviceIsMigDeviceHandle": 0,
            "nvmlDeviceGetDeviceHandleFromMigDeviceHandle": "parent",
            "nvmlDeviceGetGpuInstanceId": 1,
            "nvmlDeviceGetComputeInstanceId": 0,
            "nvmlDeviceGetEccMode": (1, 1),
            "nvmlDeviceGetTotalEccErrors": 0,
            "nvmlDeviceGetRetiredPagesPendingStatus": Fail(3),  # Ampere and later
            "nvmlDeviceGetRemappedRows": (0, 0, 0, 0),
            "nvmlDeviceGetCurrentClocksEventReasons": 0,
            "nvmlDeviceGetCurrentClocksThrottleReasons": 0,
            "nvmlDeviceGetSupportedEventTypes": 0xF,
            "nvmlEventSetCreate": "event-set",
            "nvmlDeviceRegisterEvents": None,
        }
        self.events: list = []  # what nvmlEventSetWait_v2 hands out: event data, or a Fail
        self.freed: list = []

    def __getattr__(self, name):
        answers = self.__dict__.get("answers", {})
        if name not in answers:
            raise AttributeError(name)

        def call(*args):
            answer = answers[name]
            if isinstance(answer, Fail):
                raise self.NVMLError(int(answer))
            return answer

        return call

    def fail(self, code, names: Iterable[str]):
        for name in names:
            self.answers[name] = Fail(code)

    def nvmlEventSetWait_v2(self, events, timeout_ms):
        assert timeout_ms == 0  # a check never waits
        if not self.events:
            raise self.NVMLError(self.NVML_ERROR_TIMEOUT)
        event = self.events.pop(0)
        if isinstance(event, Fail):
            raise self.NVMLError(int(event))
        return event

    def nvmlEventSetFree(self, events):
        self.freed.append(events)


def xid(code, event_type=0x8, gpu_instance=0xFFFFFFFF, compute_instance=0xFFFFFFFF):
    return types.SimpleNamespace(
        eventType=event_type, eventData=code, gpuInstanceId=gpu_instance, computeInstanceId=compute_instance
    )


QUERIES = (
    "nvmlDeviceGetTotalEccErrors",
    "nvmlDeviceGetRemappedRows",
    "nvmlDeviceGetCurrentClocksEventReasons",
)


@pytest.fixture
def fake(monkeypatch):
    module = FakeNvml()
    monkeypatch.setitem(sys.modules, "pynvml", module)
    return module


def test_reader_on_a_healthy_gpu(fake):
    reader = NvmlHealthReader("handle")
    assert reader() == HealthReadings(
        UUID,
        ecc_volatile_uncorrectable=0,
        retired_pages_pending=None,
        row_remap_failure=False,
        row_remap_pending=False,
    )
    assert reader.limits == ("page retirement not checked: not supported by this GPU or driver",)
    assert judge(reader()).healthy


def test_reader_reads_each_figure(fake):
    fake.answers.update(
        nvmlDeviceGetTotalEccErrors=4,
        nvmlDeviceGetRetiredPagesPendingStatus=1,
        nvmlDeviceGetRemappedRows=(2, 1, 1, 1),
    )
    got = NvmlHealthReader("handle")()
    assert (got.ecc_volatile_uncorrectable, got.retired_pages_pending) == (4, True)
    assert (got.row_remap_pending, got.row_remap_failure) == (True, True)


@pytest.mark.parametrize("bits, slow", [(0x40, True), (0x80, True), (0x8, True), (0x4, False), (0, False)])
def test_reader_sees_only_hardware_slowdowns(fake, bits, slow):
    fake.answers["nvmlDeviceGetCurrentClocksEventReasons"] = bits
    assert NvmlHealthReader("handle")().hw_slowdown is slow


def test_an_older_driver_answers_through_the_throttle_reasons(fake):
    fake.fail(fake.NVML_ERROR_FUNCTION_NOT_FOUND, ["nvmlDeviceGetCurrentClocksEventReasons"])
    fake.answers["nvmlDeviceGetCurrentClocksThrottleReasons"] = 0x40
    reader = NvmlHealthReader("handle")
    assert reader.limits == ("page retirement not checked: not supported by this GPU or driver",)
    assert reader().hw_slowdown is True


def test_reader_drains_xid_events_without_waiting(fake):
    reader = NvmlHealthReader("handle")
    fake.events = [xid(79), xid(1, event_type=0x2), xid(13)]
    assert reader().xid_events == (79, 13)
    assert reader().xid_events == ()  # drained


def test_reader_leaves_an_event_storm_for_the_next_check(fake):
    reader = NvmlHealthReader("handle")
    fake.events = [xid(13)] * (health.MAX_EVENTS_PER_CHECK + 5)
    assert len(reader().xid_events) == health.MAX_EVENTS_PER_CHECK
    assert len(reader().xid_events) == 5


def test_quiet_while_no_event_waits_and_the_ecc_count_holds(fake):
    reader = NvmlHealthReader("handle")
    assert not reader.quiet()  # nothing read yet
    reader()
    assert reader.quiet()
    fake.answers["nvmlDeviceGetTotalEccErrors"] = 1
    assert not reader.quiet()
    assert reader().ecc_volatile_uncorrectable == 1
    assert reader.quiet()


def test_an_event_quiet_finds_waits_for_the_next_reading(fake):
    reader = NvmlHealthReader("handle")
    reader()
    fake.events = [xid(79), xid(13)]
    assert not reader.quiet()
    assert reader().xid_events == (79, 13)  # the one quiet() took comes first
    assert reader.quiet()


def test_a_gpu_lost_is_never_quiet(fake):
    reader = NvmlHealthReader("handle")
    reader()
    fake.events = [Fail(fake.NVML_ERROR_GPU_IS_LOST)]
    assert not reader.quiet()
    fake.fail(fake.NVML_ERROR_GPU_IS_LOST, ["nvmlDeviceGetTotalEccErrors"])
    assert not reader.quiet()


def test_an_event_kept_from_an_earlier_look_is_never_quiet(fake):
    reader = NvmlHealthReader("handle")
    reader()
    fake.events = [xid(95)]
    assert not reader.quiet()
    assert not reader.quiet()  # the queue is empty now, but Xid 95 still waits
    assert reader().xid_events == (95,)


def test_events_beyond_one_check_wait_for_the_next(fake, monkeypatch):
    monkeypatch.setattr(health, "MAX_EVENTS_PER_CHECK", 1)
    reader = NvmlHealthReader("handle")
    reader()
    fake.events = [xid(79)]
    assert not reader.quiet()  # took Xid 79 off the queue
    fake.events = [xid(13)]
    assert reader().xid_events == (79,)
    assert not reader.quiet()
    assert reader().xid_events == (13,)
    assert reader.quiet()


def test_a_hardware_slowdown_is_never_quiet(fake):
    reader = NvmlHealthReader("handle")
    reader()
    fake.answers["nvmlDeviceGetCurrentClocksEventReasons"] = 0x8  # hw_slowdown
    assert not reader.quiet()
    fake.answers["nvmlDeviceGetCurrentClocksEventReasons"] = 0x4  # sw_power_cap: no slowdown
    assert reader.quiet()


def test_with_ecc_off_the_clocks_vouch(fake):
    fake.answers["nvmlDeviceGetEccMode"] = (0, 0)
    reader = NvmlHealthReader("handle")
    reader()
    assert reader.quiet()
    fake.fail(fake.NVML_ERROR_GPU_IS_LOST, ["nvmlDeviceGetCurrentClocksEventReasons"])
    assert not reader.quiet()
    fake.fail(fake.NVML_ERROR_RESET_REQUIRED, ["nvmlDeviceGetCurrentClocksEventReasons"])
    assert not reader.quiet()


def test_a_failed_ecc_reading_is_never_quiet(fake):
    reader = NvmlHealthReader("handle")
    fake.fail(fake.NVML_ERROR_UNKNOWN, ["nvmlDeviceGetTotalEccErrors"])
    reader()
    fake.answers["nvmlDeviceGetTotalEccErrors"] = 0
    assert not reader.quiet()  # the last full reading had no ECC count to compare with
    reader()
    assert reader.quiet()


def test_without_xid_events_every_screen_reads_everything(fake):
    fake.answers["nvmlDeviceRegisterEvents"] = Fail(fake.NVML_ERROR_NOT_SUPPORTED)
    reader = NvmlHealthReader("handle")
    reader()
    assert not reader.quiet()


def test_screen_on_nvml_sees_an_ecc_error_before_the_next_task(fake):
    monitor = HealthMonitor(NvmlHealthReader("handle"))
    assert monitor.screen().healthy and monitor.screen().healthy
    fake.answers["nvmlDeviceGetTotalEccErrors"] = 2
    assert monitor.screen().reasons == ("2 volatile uncorrectable ECC errors",)


def test_xid_registration_refused_is_said_once_in_limits(fake):
    fake.answers["nvmlDeviceRegisterEvents"] = Fail(fake.NVML_ERROR_NOT_SUPPORTED)
    monitor = HealthMonitor(NvmlHealthReader("handle"))
    assert "Xid events not checked: registration refused (Not Supported)" in monitor.limits
    assert fake.freed == ["event-set"]
    fake.events = [xid(79)]
    assert monitor.check().healthy  # nothing registered, nothing drained


def test_ecc_disabled_is_a_limit_not_a_reading(fake):
    fake.answers["nvmlDeviceGetEccMode"] = (0, 0)
    reader = NvmlHealthReader("handle")
    assert "ECC errors not checked: ECC is disabled on this GPU" in reader.limits
    assert reader().ecc_volatile_uncorrectable is None


def test_a_gpu_lost_after_start_reads_lost(fake):
    reader = NvmlHealthReader("handle")
    fake.fail(fake.NVML_ERROR_GPU_IS_LOST, QUERIES)
    fake.events = [Fail(fake.NVML_ERROR_GPU_IS_LOST)]
    got = reader()
    assert got.lost and got.unanswered == ()
    assert got.ecc_volatile_uncorrectable is None
    assert judge(got).reasons == ("GPU is lost (fell off the bus)",)


def test_reset_required_quarantines(fake):
    reader = NvmlHealthReader("handle")
    fake.fail(fake.NVML_ERROR_RESET_REQUIRED, ["nvmlDeviceGetTotalEccErrors"])
    assert judge(reader()).reasons == ("GPU needs a reset",)


def test_an_unknown_error_is_unanswered_not_lost(fake):
    reader = NvmlHealthReader("handle")
    fake.fail(fake.NVML_ERROR_UNKNOWN, ["nvmlDeviceGetCurrentClocksEventReasons"])
    got = reader()
    assert not got.lost and got.unanswered == ("clocks",)
    assert judge(got).warnings == ("NVML did not answer: clocks",)


def test_mig_instance_reads_its_parent_and_its_own_xids(fake):
    fake.answers["nvmlDeviceIsMigDeviceHandle"] = 1
    reader = NvmlHealthReader("mig-handle")
    assert reader._device == "parent"
    fake.events = [
        xid(94, gpu_instance=2, compute_instance=0),
        xid(95, gpu_instance=1, compute_instance=0),
        xid(79),
    ]
    assert reader().xid_events == (95, 79)


def test_close_frees_the_event_set_once(fake):
    reader = NvmlHealthReader("handle")
    reader.close()
    reader.close()
    assert fake.freed == ["event-set"]


def test_for_this_worker_on_a_gpu_lost_before_the_start(fake, monkeypatch):
    monkeypatch.setattr(nvml, "visible_gpu_count", lambda: 1)

    def lost_handle():
        raise fake.NVMLError(fake.NVML_ERROR_GPU_IS_LOST)

    monkeypatch.setattr(nvml, "worker_device_handle", lost_handle)
    monitor = HealthMonitor.for_this_worker()
    assert monitor is not None
    assert monitor.check().reasons == ("GPU is lost (fell off the bus)",)


def test_for_this_worker_builds_the_nvml_reader(fake, monkeypatch):
    monkeypatch.setattr(nvml, "visible_gpu_count", lambda: 1)
    monkeypatch.setattr(nvml, "worker_device_handle", lambda: "handle")
    monitor = HealthMonitor.for_this_worker(slowdown_checks=2)
    assert monitor.limits == ("page retirement not checked: not supported by this GPU or driver",)
    assert monitor.check() == HealthVerdict(True, (), UUID, ())
    monitor.close()
    assert fake.freed == ["event-set"]
