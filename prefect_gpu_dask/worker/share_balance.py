"""How many of a split graph's roots each GPU worker's share of ``compute_on_gpus`` gets.

An even split makes the calling task wait for the slowest share: GPUs of one host
differ by a few per cent, and a GPU another process is using is slower still. So each
calling worker process remembers, per graph shape, how fast each worker computed its
shares of it, and deals the next split's roots in proportion: the shares then end
together. A graph seen for the first time gets an even split, and a worker with no speed
yet a typical share. A worker's first share of a graph is not learnt from, and the
call's other shares are kept against each other, not against it: that share also paid
for the worker's first use of the graph's kernels (compiling, loading). So the first
two splits of a graph on two workers are even, as are the first two after either restarts.

Each speed is kept relative to the other shares of the same call (roots per second over
their mean), so two graphs that share a shape but not their cost still compare.

Timed where each share ran, not by when its values reached the caller: a share that
ends first may wait for the caller's event loop, whose GIL the caller's own share holds,
so the caller's clock would see it no sooner than its own, and each split would repeat
the last one's lean. The way back is left out by choice; a large share's transfer is
not counted against its worker. Shares the scheduler placed (a worker not serving them)
are not timed: that worker keeps a typical share.
"""

from __future__ import annotations

import statistics
import threading
from collections import OrderedDict, deque
from collections.abc import Hashable, Mapping, Sequence
from typing import Any

from dask.utils import key_split

# The last few shares' speeds per worker: their median ignores one slow share and follows a
# lasting change within a few calls.
SPEEDS_KEPT = 5
GRAPHS_KEPT = 128
# Per graph shape: restarted workers come back at new addresses, the old ones go.
WORKERS_KEPT = 64
# No worker counts as more than this many times faster or slower than the median one,
# whatever was seen (so two workers' shares differ by at most its square).
MOST_UNEVEN = 3.0


def graph_shape(graph: Mapping[Hashable, Any], keys: Sequence[Hashable]) -> Hashable:
    """What makes two graphs the same work: their size, their outputs' count, and their
    tasks' names without tokens (a random array has new tokens on every build)."""
    layers = {key[0] if isinstance(key, tuple) and key else key for key in graph}
    return len(graph), len(keys), tuple(sorted({key_split(layer) for layer in layers}))


def share_sizes(roots: int, speeds: Sequence[float | None]) -> list[int]:
    """``roots`` dealt in proportion to ``speeds`` (unknown ones: the median of the
    known, or even; each within ``MOST_UNEVEN`` times the median), each share at least
    one root."""
    if not 0 < len(speeds) <= roots:
        raise ValueError(f"cannot deal {roots} roots into {len(speeds)} shares of at least one each")
    known = [s for s in speeds if s is not None and s > 0]
    typical = statistics.median(known) if known else 1.0
    weights = [
        min(max(s if s is not None and s > 0 else typical, typical / MOST_UNEVEN), typical * MOST_UNEVEN)
        for s in speeds
    ]
    exact = [roots * w / sum(weights) for w in weights]
    sizes = [max(1, int(x)) for x in exact]
    # Largest remainders first, until the sizes add up; then trim the largest shares.
    for i in sorted(range(len(sizes)), key=lambda i: exact[i] - int(exact[i]), reverse=True):
        if sum(sizes) >= roots:
            break
        sizes[i] += 1
    while sum(sizes) > roots:
        sizes[sizes.index(max(sizes))] -= 1
    return sizes


class ShareSpeeds:
    """What this process saw of each worker's shares, per graph shape. Thread-safe: tasks
    on one worker may call ``compute_on_gpus`` at once."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._seen: OrderedDict[Hashable, OrderedDict[str, deque[float]]] = OrderedDict()

    def speeds(self, shape: Hashable, workers: Sequence[str]) -> list[float | None]:
        """Each worker's speed on graphs of ``shape`` against the others' (1 is their
        mean), None where unknown."""
        with self._lock:
            seen: Mapping[str, deque[float]] = self._seen.get(shape, {})
            return [statistics.median(seen[w]) if seen.get(w) else None for w in workers]

    def note(self, shape: Hashable, shares: Mapping[str, tuple[int, float]]) -> None:
        """``shares``: worker → (roots in its share, seconds it took to compute). Only
        calls where two or more shares were timed tell how fast each is against the
        others, and only shares of workers seen on this shape before count."""
        speeds = {w: roots / seconds for w, (roots, seconds) in shares.items() if roots > 0 and seconds > 0}
        if len(speeds) < 2:
            return
        with self._lock:
            seen = self._seen.setdefault(shape, OrderedDict())
            self._seen.move_to_end(shape)
            # A worker's first share is only noted as seen; the others are kept against
            # each other, not against it.
            known = {w: speed for w, speed in speeds.items() if w in seen}
            mean = statistics.fmean(known.values()) if len(known) >= 2 else None
            for worker, speed in speeds.items():
                kept = seen.setdefault(worker, deque(maxlen=SPEEDS_KEPT))  # empty: seen, no speed yet
                if mean is not None and worker in known:
                    kept.append(speed / mean)
                seen.move_to_end(worker)
            while len(seen) > max(WORKERS_KEPT, len(speeds)):  # never this call's own workers
                seen.popitem(last=False)
            while len(self._seen) > GRAPHS_KEPT:
                self._seen.popitem(last=False)


share_speeds = ShareSpeeds()  # this process's, for the tasks that call compute_on_gpus here
