"""Right-sizing: which GPU share each task needs, from the worst of its recent runs.

Runs in the flow process when a flow ends. Each task's peak is what it added to its
worker's GPU memory at its highest (``TaskRecord.growth``); a flow's worst peak per task
name is kept for the last ``HISTORY_RUNS`` runs in one Prefect Variable per flow name,
so a hint speaks of the nights before this one too, and anyone can read or clear it in
the UI. Concurrent runs of one flow may each miss the other's figure: a hint, not a
ledger.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from prefect_gpu_dask.records import TaskRecord, format_bytes

SHARES = (0.05, 0.1, 0.125, 0.2, 0.25, 0.5, 1.0)  # the gpu:<share> tags a hint may suggest
MARGIN = 0.2  # head room a suggested share keeps above the worst peak
TIGHT = 0.95  # a peak at or above this part of its share is flagged
HISTORY_RUNS = 10
VARIABLE_PREFIX = "prefect_gpu_dask_peaks__"
# Prefect caps a Variable's JSON value at 5000 characters.
MAX_VALUE_CHARS = 5000


@dataclass(frozen=True)
class PeakHistory:
    """One task name's worst peak in each of its last runs (newest last)."""

    device_total: int
    peaks: tuple[int, ...]


@dataclass(frozen=True)
class SizingHint:
    task_name: str
    worst_peak: int  # bytes, the worst over ``runs`` flow runs
    device_total: int  # bytes on the GPU it peaked on
    runs: int
    asked_share: float | None  # what its tags asked for; None: no share known
    fitting_share: float  # the smallest of ``SHARES`` holding the worst peak plus ``MARGIN``
    tight: bool  # the worst peak came within 5 % of the share it asked for (or past it)

    def describe(self) -> str:
        peak = f"peaks at {format_bytes(self.worst_peak)} of {format_bytes(self.device_total)}"
        over = f" over the last {self.runs} runs" if self.runs > 1 else ""
        fits = f"`{share_tag(self.fitting_share)}` fits"
        asked = "" if self.asked_share is None else f"; it asked for `{share_tag(self.asked_share)}`"
        flag = " **(within 5 % of its share)**" if self.tight else ""
        return f"{peak}{over}: {fits}{asked}{flag}"


def share_tag(share: float) -> str:
    return "gpu" if share >= 1 else f"gpu:{share:g}"


def fitting_share(peak: int, device_total: int) -> float:
    need = peak * (1 + MARGIN)
    return next((share for share in SHARES if need <= share * device_total), 1.0)


def worst_per_task(records: Iterable[TaskRecord]) -> dict[str, PeakHistory]:
    """This run's worst peak per task name, as a one-run history."""
    worst: dict[str, PeakHistory] = {}
    for record in records:
        if not record.task_name or record.device_total <= 0:
            continue
        seen = worst.get(record.task_name)
        if seen is None or record.growth > seen.peaks[0]:
            worst[record.task_name] = PeakHistory(record.device_total, (record.growth,))
    return worst


def merged(
    before: Mapping[str, PeakHistory], this_run: Mapping[str, PeakHistory], keep: int = HISTORY_RUNS
) -> dict[str, PeakHistory]:
    """``before`` with this run's peaks appended; tasks not in this run keep theirs."""
    out = dict(before)
    for name, run in this_run.items():
        old = before.get(name)
        peaks = (old.peaks if old else ()) + run.peaks
        out[name] = PeakHistory(run.device_total, peaks[-keep:])
    return out


def hints(records: Sequence[TaskRecord], history: Mapping[str, PeakHistory]) -> list[SizingHint]:
    """One hint per task name in ``records``, judged on the worst of its ``history``."""
    asked: dict[str, float | None] = {}
    for record in records:
        if record.task_name:
            asked[record.task_name] = max(
                (s for s in (asked.get(record.task_name), record.gpu_share) if s is not None), default=None
            )
    out = []
    for name in sorted(asked):
        if name not in history:
            continue
        past = history[name]
        worst = max(past.peaks)
        share = asked[name]
        out.append(
            SizingHint(
                task_name=name,
                worst_peak=worst,
                device_total=past.device_total,
                runs=len(past.peaks),
                asked_share=share,
                fitting_share=fitting_share(worst, past.device_total),
                tight=share is not None and worst >= TIGHT * share * past.device_total,
            )
        )
    return out


# -- the store: one Prefect Variable per flow name ----------------------------------
def variable_name(flow_name: str) -> str:
    """A valid Variable name (letters, digits, ``_``, ``-``) that no other flow name maps to."""
    slug = re.sub(r"[^a-z0-9_-]+", "_", flow_name.lower()).strip("_")[:80]
    digest = hashlib.sha1(flow_name.encode()).hexdigest()[:8]
    return f"{VARIABLE_PREFIX}{slug}_{digest}"


def value_size(value: object) -> int:
    """As Prefect measures a Variable's value: its compact JSON, in bytes."""
    return len(json.dumps(value, separators=(",", ":"), ensure_ascii=False).encode())


def to_value(history: Mapping[str, PeakHistory], newest: Iterable[str] = ()) -> dict:
    """JSON for the Variable, within Prefect's limit: tasks not in ``newest`` go first,
    then the oldest runs of the rest, then (only if still too big) tasks of this run."""
    keep, newest = HISTORY_RUNS, set(newest)
    names = sorted(history, key=lambda n: (n in newest, n), reverse=True)  # stale ones last
    while True:
        value = {
            n: {"total": history[n].device_total, "peaks": list(history[n].peaks[-keep:])} for n in names
        }
        if value_size(value) <= MAX_VALUE_CHARS or not names:
            return value
        if names[-1] not in newest or keep == 1:
            names.pop()
        else:
            keep -= 1


def from_value(value: object) -> dict[str, PeakHistory]:
    """The history in a Variable's value; anything else a person left there reads as none."""
    if not isinstance(value, dict):
        return {}
    out = {}
    for name, entry in value.items():
        try:
            history = PeakHistory(int(entry["total"]), tuple(int(p) for p in entry["peaks"]))
        except (KeyError, TypeError, ValueError):
            continue
        if history.peaks and history.device_total > 0:
            out[str(name)] = history
    return out


def remember(flow_name: str, this_run: Mapping[str, PeakHistory]) -> dict[str, PeakHistory]:
    """Add this run's peaks (``worst_per_task``) to the flow's Variable; returns the
    history hints use."""
    from prefect.variables import Variable

    name = variable_name(flow_name)
    # _sync: the runner closes inside an async flow's event loop too, and waits here.
    # ``_sync`` is async_dispatch's own keyword, not in the methods' signatures.
    stored = Variable.get(name, default=None, _sync=True)  # type: ignore[call-overload]
    history = merged(from_value(stored), this_run)
    value = to_value(history, newest=this_run)
    if value != stored:  # a write less on the server where the last runs peaked alike
        Variable.set(name, value, overwrite=True, _sync=True)  # type: ignore[call-arg]
    return history
