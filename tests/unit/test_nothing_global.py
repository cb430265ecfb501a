"""Importing the package and making runners changes nothing outside them.

In a fresh interpreter: Prefect, prefect-dask and distributed imported first (their own
import is theirs), then a snapshot of threads, child processes, open sockets, the
environment, Dask's config and every upstream attribute the package ever wraps; then
``import prefect_gpu_dask``, runners of every kind made, ``duplicate()``d and pickled
round; then the same snapshot again, which must be equal.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

SCRIPT = textwrap.dedent(
    """
    import json, os, pickle, threading

    import dask, distributed, prefect, prefect_dask, psutil
    import prefect.flow_engine, prefect.task_engine
    from prefect.server.api.server import SubprocessASGIServer
    from distributed.scheduler import Scheduler

    WATCHED = {
        "prefect.task_engine._concurrency": lambda: prefect.task_engine._concurrency,
        "prefect.task_engine._aconcurrency": lambda: prefect.task_engine._aconcurrency,
        "prefect.flow_engine._send_heartbeats": lambda: prefect.flow_engine._send_heartbeats,
        "SubprocessASGIServer.start": lambda: SubprocessASGIServer.start,
        "Scheduler.add_resources": lambda: Scheduler.add_resources,
        "distributed.Worker.set_resources": lambda: distributed.Worker.set_resources,
        "prefect_dask.DaskTaskRunner.submit": lambda: prefect_dask.DaskTaskRunner.submit,
    }

    def snapshot():
        me = psutil.Process()
        return {
            "threads": sorted(t.name for t in threading.enumerate()),
            "children": len(me.children(recursive=True)),
            "sockets": len(me.net_connections(kind="inet")),
            "environ": dict(os.environ),
            "config": json.dumps(dask.config.config, sort_keys=True, default=repr),
            "attributes": {name: id(get()) for name, get in WATCHED.items()},
        }

    before = snapshot()
    import prefect_gpu_dask
    from prefect_gpu_dask import GPUDaskTaskRunner

    runners = [
        GPUDaskTaskRunner(),
        GPUDaskTaskRunner(address="tcp://127.0.0.1:8786", gpu_wait_s=5),
        GPUDaskTaskRunner(cluster_class="distributed.LocalCluster", cluster_kwargs={"n_workers": 1}),
        GPUDaskTaskRunner(tag_resources={"big": {"GPU": 1, "BIG": 1}}, guard="all", oom_retries=1),
    ]
    for runner in runners:
        copy = runner.duplicate()
        assert copy == runner
        assert pickle.loads(pickle.dumps(runner)) == runner
    after = snapshot()
    print(json.dumps({"before": before, "after": after}))
    """
)


def test_import_construct_duplicate_and_pickle_start_nothing_and_patch_nothing(tmp_path):
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=120, cwd=tmp_path
    )
    assert done.returncode == 0, done.stderr[-3000:]
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    before, after = seen["before"], seen["after"]
    for key in ("threads", "children", "sockets", "attributes", "config"):
        assert after[key] == before[key], (key, before[key], after[key])
    changed = {
        k: (before["environ"].get(k), v) for k, v in after["environ"].items() if before["environ"].get(k) != v
    }
    removed = set(before["environ"]) - set(after["environ"])
    assert not changed and not removed, (changed, removed)
