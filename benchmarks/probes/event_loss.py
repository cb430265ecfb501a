"""Does the embedded server lose task-run states under load? On the README default
(embedded SQLite server, fresh PREFECT_HOME), flow runs of trivial tasks through the
runner on a CPU cluster; after each, the API is polled until every task run of that flow
run is final (or ``--settle`` seconds pass). Prints, per flow run, how long the server
took to record them all and how many never became final, and counts the server's
"Subscription queue is full" lines (its in-memory broker dropping a message).

    python benchmarks/probes/event_loss.py [--tasks 2000] [--flows 3] [--threads 8] [--out FILE]

With few tasks and a short ``--poll`` it measures how soon a quiet server records a flow
run's task runs: ``--tasks 10 --flows 20 --poll 0.02``.

``--per-consumer`` also counts, inside the server, each broker consumer's dropped
messages and deepest queue (a ``sitecustomize`` the embedded server picks up from
``PYTHONPATH``, wrapping Prefect's in-memory ``Consumer`` and ``Subscription.deliver``).
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from benchmarks.common import ServerLog, use_readme_default  # noqa: E402

use_readme_default("event-loss")

import argparse  # noqa: E402
import collections  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

QUEUE_FULL = "Subscription queue is full"
# Loaded by every Python process started with the probe's PYTHONPATH; acts only in the
# one that imports Prefect's in-memory broker and starts its consumers: the server.
PER_CONSUMER = """
import collections, importlib.abc, importlib.util, json, os, sys, threading, time
TARGET = "prefect.server.utilities.messaging.memory"
def patch(memory):
    drops, deepest = collections.Counter(), collections.Counter()
    consumer_init, deliver = memory.Consumer.__init__, memory.Subscription.deliver
    def init(self, topic, subscription=None, concurrency=2, **kwargs):
        consumer_init(self, topic, subscription, concurrency, **kwargs)
        self.subscription._label = kwargs.get("group") or kwargs.get("name") or "ephemeral"
    async def counted(self, message):
        label = getattr(self, "_label", "unnamed")
        deepest[label] = max(deepest[label], self._queue.qsize())
        drops[label] += self._queue.full()
        return await deliver(self, message)
    memory.Consumer.__init__, memory.Subscription.deliver = init, counted
    def report():
        while True:
            time.sleep(2)
            if not deepest:  # a process that imported the broker but runs no server
                continue
            with open(os.environ["EVENT_LOSS_PER_CONSUMER"], "w") as out:
                json.dump({"dropped": drops, "deepest_queue": deepest}, out)
    threading.Thread(target=report, daemon=True).start()
class Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != TARGET:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        loader = spec.loader
        class Patching(importlib.abc.Loader):
            def create_module(self, spec):
                return loader.create_module(spec)
            def exec_module(self, module):
                loader.exec_module(module)
                patch(module)
        spec.loader = Patching()
        return spec
if os.environ.get("EVENT_LOSS_PER_CONSUMER"):
    sys.meta_path.insert(0, Finder())
"""
FINAL = ("COMPLETED", "FAILED", "CRASHED")


def states_of(flow_run_id: str) -> collections.Counter:
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

    with get_client(sync_client=True) as client:
        counts: collections.Counter = collections.Counter()
        offset = 0
        while True:
            runs = client.read_task_runs(
                flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_run_id])),
                limit=200,
                offset=offset,
            )
            counts.update(r.state.type.value if r.state else "NONE" for r in runs)
            if len(runs) < 200:
                return counts
            offset += 200


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--tasks", type=int, default=2000)
    parser.add_argument("--flows", type=int, default=3)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--threads", type=int, default=8)
    parser.add_argument("--settle", type=float, default=20.0, help="seconds to wait after each flow run")
    parser.add_argument("--catch-up", type=float, default=300.0, help="seconds to wait after the last")
    parser.add_argument("--poll", type=float, default=0.5, help="seconds between reads of the task runs")
    parser.add_argument("--per-consumer", action="store_true", help="count each consumer's drops")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    log = ServerLog()
    per_consumer = None
    if args.per_consumer:  # before the flow's first API call starts the server
        site = Path(tempfile.mkdtemp(prefix="event-loss-site-"))
        (site / "sitecustomize.py").write_text(PER_CONSUMER)
        per_consumer = site / "per-consumer.json"
        os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(site), os.environ.get("PYTHONPATH")]))
        os.environ["EVENT_LOSS_PER_CONSUMER"] = str(per_consumer)

    from prefect import flow, task
    from prefect.context import get_run_context

    from prefect_gpu_dask import GPUDaskTaskRunner

    @task
    def noop(i: int) -> int:
        return i

    runner = GPUDaskTaskRunner(
        host_cluster=False,
        cluster_kwargs={"n_workers": args.workers, "threads_per_worker": args.threads},
    )

    @flow(task_runner=runner)
    def many() -> tuple[str, float]:
        start = time.perf_counter()
        assert [f.result() for f in noop.map(range(args.tasks))] == list(range(args.tasks))
        return str(get_run_context().flow_run.id), time.perf_counter() - start

    rows = []
    for i in range(args.flows):
        flow_run_id, wall = many()
        ended = time.perf_counter()
        while True:
            counts = states_of(flow_run_id)
            final = sum(n for state, n in counts.items() if state in FINAL)
            if final >= args.tasks or time.perf_counter() - ended > args.settle:
                break
            time.sleep(args.poll)
        row = {
            "flow": i,
            "flow_run_id": flow_run_id,
            "tasks": args.tasks,
            "wall_s": round(wall, 3),
            "recorded_after_s": round(time.perf_counter() - ended, 3),
            "states": dict(counts),
            "not_final": args.tasks - final,
            "queue_full_lines_so_far": log.count(QUEUE_FULL)[QUEUE_FULL],
        }
        rows.append(row)
        print(json.dumps(row), flush=True)
    # Then whether the server catches up later (lag) or never (lost).
    later, deadline = [], time.perf_counter() + args.catch_up
    while True:
        counts = [states_of(row["flow_run_id"]) for row in rows]
        not_final = sum(args.tasks - sum(n for s, n in c.items() if s in FINAL) for c in counts)
        later.append({"after_last_flow_s": round(time.perf_counter() - ended, 1), "not_final": not_final})
        print(json.dumps(later[-1]), flush=True)
        if not_final == 0 or time.perf_counter() > deadline:
            break
        time.sleep(10)
    lags = sorted(row["recorded_after_s"] for row in rows)
    summary = {
        "probe": "event_loss",
        "recorded_after_s": {
            "median": statistics.median(lags),
            "p95": lags[min(len(lags) - 1, int(0.95 * len(lags)))],
        },
        "args": vars(args),
        "cores": os.cpu_count(),
        "rows": rows,
        "not_final": sum(r["not_final"] for r in rows),
        "catching_up": later,
        "queue_full_lines": log.count(QUEUE_FULL)[QUEUE_FULL],
    }
    if per_consumer is not None:
        time.sleep(2.5)
        summary["per_consumer"] = json.loads(per_consumer.read_text()) if per_consumer.exists() else None
        print("per consumer:", summary["per_consumer"])
    lag = summary["recorded_after_s"]
    print(
        f"a flow run's task runs all final after its end: median {lag['median']:.3f} s, "
        f"p95 {lag['p95']:.3f} s (polled every {args.poll:g} s)"
    )
    print(
        f"task runs not final {args.settle:g} s after their flow run: {summary['not_final']}; "
        f"{later[-1]['after_last_flow_s']:g} s after the last: {later[-1]['not_final']}; "
        f"queue-full lines: {summary['queue_full_lines']}"
    )
    if args.out:
        Path(args.out).write_text(json.dumps(summary, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
