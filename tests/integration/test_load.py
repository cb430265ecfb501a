"""Load, on a real Prefect API and real ``dask scheduler``/``dask worker`` processes:
1,000 ``gpu:0.25`` tasks on one ``GPU=1`` worker with 8 threads, and 500 CPU tasks mixed
with 500 GPU tasks.

Sized for a 2-core CI box: Prefect's per-task engine and API traffic, not Dask, are the
cost, so these tests ship no task logs to the API, keep their sleeps to 10-20 ms, and
report to a PostgreSQL-backed server where PostgreSQL is installed (SQLite elsewhere).
"""

from __future__ import annotations

import statistics
import time

import distributed
import pytest
from prefect import flow, task
from prefect.settings import PREFECT_LOGGING_TO_API_ENABLED, temporary_settings

from prefect_gpu_dask import GPUDaskTaskRunner
from tests.conftest import DaskProcesses
from tests.integration.test_reliability import max_concurrency
from tests.servers import postgres_missing, postgres_server, using_prefect_server

# -- 4. load ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def load_database():
    """PostgreSQL, Prefect's database for this load, where it is installed: on SQLite
    every tagged task's slot request risks a "database is locked" 503 and a 2 s back-off
    (docs/performance.md). Else None: the server's own SQLite."""
    if postgres_missing() is not None:
        yield None
        return
    with postgres_server() as database:
        yield database


@pytest.fixture(autouse=True)
def own_prefect_api(load_database):
    """A Prefect API server of this test's own (on the module's one database): it spends
    a while after a load test recording its task runs' events, which must not slow the
    next flow run or the tests that share the session's server."""
    with using_prefect_server(load_database):
        yield


@pytest.fixture(scope="module")
def load_cluster(tmp_path_factory):
    """One ``GPU=1`` worker with 8 threads and one 4-thread CPU worker."""
    procs = DaskProcesses(tmp_path_factory.mktemp("load"))
    procs.start_scheduler()
    procs.start_worker("gpu-worker", "--nthreads", "8", "--resources", "GPU=1")
    procs.start_worker("cpu-worker", "--nthreads", "4")
    procs.wait_for_workers(2)
    yield procs.address
    procs.close()


@task(tags=["gpu:0.25"])
def quarter_gpu(i: int, seconds: float) -> tuple[int, float, float, str]:
    start = time.time()
    time.sleep(seconds)
    return i, start, time.time(), str(distributed.get_worker().name)


@task(tags=["gpu"])
def whole_gpu(i: int, seconds: float) -> tuple[int, float, float, str]:
    start = time.time()
    time.sleep(seconds)
    return i, start, time.time(), str(distributed.get_worker().name)


@task
def plain_cpu(i: int) -> tuple[int, float, float, str]:
    start = time.time()
    return i, start, time.time(), str(distributed.get_worker().name)


def test_1000_quarter_gpu_tasks_never_exceed_4_at_once(load_cluster):
    n = 1000

    @flow(task_runner=GPUDaskTaskRunner(address=load_cluster))
    def quarters():
        futures = [quarter_gpu.submit(i, 0.02) for i in range(n)]
        return [f.result() for f in futures]

    start = time.monotonic()
    with temporary_settings({PREFECT_LOGGING_TO_API_ENABLED: False}):
        out = quarters()
    elapsed = time.monotonic() - start

    assert [i for i, *_ in out] == list(range(n))
    assert {w for *_, w in out} == {"gpu-worker"}
    peak = max_concurrency([(s, e) for _, s, e, _ in out])
    assert peak <= 4, f"{peak} gpu:0.25 tasks ran at once on one GPU"
    assert peak >= 2, f"gpu:0.25 tasks never shared the GPU (peak {peak})"
    print(f"1000 x gpu:0.25: {elapsed:.1f} s, peak concurrency {peak}")


def test_500_cpu_tasks_are_not_starved_by_500_gpu_tasks(load_cluster):
    n = 500

    @flow(task_runner=GPUDaskTaskRunner(address=load_cluster))
    def mixed():
        futures = []
        for i in range(n):
            futures.append(whole_gpu.submit(i, 0.01))
            futures.append(plain_cpu.submit(i))
        return [f.result() for f in futures]

    start = time.monotonic()
    with temporary_settings({PREFECT_LOGGING_TO_API_ENABLED: False}):
        out = mixed()
    elapsed = time.monotonic() - start

    gpu, cpu = out[0::2], out[1::2]
    assert [i for i, *_ in gpu] == list(range(n)) and [i for i, *_ in cpu] == list(range(n))
    assert {w for *_, w in gpu} == {"gpu-worker"}
    assert max_concurrency([(s, e) for _, s, e, _ in gpu]) == 1  # whole-GPU tasks queue
    first = min(s for _, s, _, _ in out)
    gpu_ends = sorted(e - first for _, _, e, _ in gpu)
    cpu_ends = sorted(e - first for _, _, e, _ in cpu)
    gpu_done_when_cpu_done = sum(e <= cpu_ends[-1] for e in gpu_ends) / n
    print(
        f"500+500 mixed: {elapsed:.1f} s; CPU done at {cpu_ends[-1]:.1f} s "
        f"(median {statistics.median(cpu_ends):.1f} s), GPU done at {gpu_ends[-1]:.1f} s "
        f"(median {statistics.median(gpu_ends):.1f} s); {gpu_done_when_cpu_done:.0%} of GPU "
        "tasks done when the last CPU task finished"
    )
    # CPU tasks are not held behind the GPU queue: they all finish while most GPU
    # tasks are still waiting for the one GPU. (Held behind it, both would end together.)
    # Their pace is the CPU worker's own Prefect engine throughput on a shared 2-core
    # box, so medians are printed, not compared.
    assert cpu_ends[-1] < 0.75 * gpu_ends[-1], (cpu_ends[-1], gpu_ends[-1])
    assert gpu_done_when_cpu_done < 0.75, gpu_done_when_cpu_done
