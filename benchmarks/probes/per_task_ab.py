"""Per task, side by side: 200 trivial tasks through Prefect's thread pool and then the
runner (guard off, on its own default cluster: a ``LocalCUDACluster`` on a GPU host),
alternating, ``ROUNDS`` times in one process. Run it from each tree compared, in turn:

    LABEL=new ROUNDS=3 PREFECT_HOME=$(mktemp -d) PYTHONPATH=<tree> python benchmarks/probes/per_task_ab.py

Prints a line per round and one of JSON.
"""

from __future__ import annotations

import json
import os
import time


def main() -> None:
    from prefect import flow, task
    from prefect.client.orchestration import get_client
    from prefect.context import FlowRunContext
    from prefect.task_runners import ThreadPoolTaskRunner

    import prefect_gpu_dask
    from prefect_gpu_dask import GPUDaskTaskRunner

    n, warm = 200, 64
    rounds, label = int(os.environ.get("ROUNDS", 3)), os.environ.get("LABEL", "?")

    @task
    def noop(i: int) -> int:
        return i

    def timed(runner: object) -> float:
        @flow(task_runner=runner)
        def many() -> tuple[float, str]:
            getattr(FlowRunContext.get().task_runner, "client", None)  # the cluster first
            assert all(f.result() < 0 for f in noop.map(range(-warm, 0)))
            start = time.perf_counter()
            assert [f.result() for f in noop.map(range(n))] == list(range(n))
            return time.perf_counter() - start, str(FlowRunContext.get().flow_run.id)

        elapsed, flow_run_id = many()
        # The server records the task runs before the next measurement shares it.
        only_this = {"flow_runs": {"id": {"any_": [flow_run_id]}}}
        deadline = time.monotonic() + 30
        with get_client(sync_client=True) as client:
            while time.monotonic() < deadline:
                if client.request("POST", "/task_runs/count", json=only_this).json() >= n + warm:
                    break
                time.sleep(0.5)
        return elapsed

    pool: list[float] = []
    run: list[float] = []
    for _ in range(rounds):
        pool.append(timed(ThreadPoolTaskRunner(max_workers=16)))
        run.append(timed(GPUDaskTaskRunner(cluster_kwargs={"threads_per_worker": 8}, guard="off")))
        ratio = run[-1] / pool[-1]
        print(f"AB {label} round: pool {pool[-1]:.3f} runner {run[-1]:.3f} ratio {ratio:.3f}", flush=True)
    tree = prefect_gpu_dask.__file__
    print("ABJSON " + json.dumps({"label": label, "tree": tree, "pool_s": pool, "runner_s": run}), flush=True)


if __name__ == "__main__":
    main()
