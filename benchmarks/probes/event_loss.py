"""Does the embedded server lose task-run states under load? On the README default
(embedded SQLite server, fresh PREFECT_HOME), flow runs of trivial tasks through the
runner on a CPU cluster; after each, the API is polled until every task run of that flow
run is final (or ``--settle`` seconds pass). Prints, per flow run, how long the server
took to record them all and how many never became final, and counts the server's
"Subscription queue is full" lines (its in-memory broker dropping a message).

    python benchmarks/probes/event_loss.py [--tasks 2000] [--flows 3] [--threads 8] [--out FILE]
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from benchmarks.common import use_readme_default  # noqa: E402

use_readme_default("event-loss")

import argparse  # noqa: E402
import collections  # noqa: E402
import json  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

QUEUE_FULL = "Subscription queue is full"
FINAL = ("COMPLETED", "FAILED", "CRASHED")


class ServerLog:
    """This process's stderr, which the embedded server inherits, copied to a file."""

    def __init__(self) -> None:
        self.file = tempfile.NamedTemporaryFile("w+", suffix=".log", delete=False)
        self._tee = os.popen(f"tee -a {self.file.name} >&2", "w")  # noqa: S605
        os.dup2(self._tee.fileno(), 2)

    def count(self, text: str) -> int:
        sys.stderr.flush()
        time.sleep(0.5)
        return Path(self.file.name).read_text(errors="replace").count(text)


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
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    log = ServerLog()

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
            time.sleep(0.5)
        row = {
            "flow": i,
            "flow_run_id": flow_run_id,
            "tasks": args.tasks,
            "wall_s": round(wall, 3),
            "recorded_after_s": round(time.perf_counter() - ended, 3),
            "states": dict(counts),
            "not_final": args.tasks - final,
            "queue_full_lines_so_far": log.count(QUEUE_FULL),
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
    summary = {
        "probe": "event_loss",
        "args": vars(args),
        "cores": os.cpu_count(),
        "rows": rows,
        "not_final": sum(r["not_final"] for r in rows),
        "catching_up": later,
        "queue_full_lines": log.count(QUEUE_FULL),
    }
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
