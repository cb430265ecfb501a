"""The real path on a GPU: LocalCUDACluster, NVML, CuPy pools. Skipped without a GPU."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
from prefect import flow, task
from prefect.context import FlowRunContext
from prefect.variables import Variable

from prefect_gpu_dask import GPUDaskTaskRunner
from prefect_gpu_dask.worker.guard import current_guard
from tests.conftest import recorded_task_run

pytestmark = pytest.mark.gpu
MiB = 2**20
GiB = 2**30
_KEPT: list = []  # lives in the worker process: what a leaking task holds on to


@task(tags=["gpu"])
def device_report() -> dict:
    import cupy
    import distributed

    worker = distributed.get_worker()
    x = cupy.arange(10) ** 2
    return {
        "worker": worker.address,
        "resources": dict(worker.state.total_resources),
        "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
        "array_type": type(x).__module__ + "." + type(x).__name__,
        "device": x.device.id,
        "sum": int(x.sum()),
        "pid": os.getpid(),
        "parent": os.getppid(),
        # dask-cuda imported in the fork server, not again in each worker: its CUDA bindings
        # are loaded there (the worker's parent), where CUDA itself was never initialised.
        "parent_loaded_cuda_bindings": "cuda/bindings" in Path(f"/proc/{os.getppid()}/maps").read_text(),
        # dask-cuda's preload made the CUDA context before the worker registered: the
        # guard's first reading found it made.
        "guard_made_a_context": current_guard().context_bytes > 0,
    }


@task(tags=["gpu"])
def plant_leak(nbytes: int) -> int:
    import cupy

    _KEPT.append(cupy.ones(nbytes // 8, dtype=cupy.float64))
    return os.getpid()


@task(tags=["gpu"])
def churn_pool(nbytes: int) -> float:
    import cupy

    x = cupy.ones(nbytes // 8, dtype=cupy.float64)  # through CuPy's pool
    total = float(x.sum())
    del x  # freed to the pool, which keeps the block cached
    return total


@task(tags=["gpu"])
def pid() -> tuple[int, str]:
    return os.getpid(), os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0]


@task(tags=["gpu"])
def plant_leak_where(nbytes: int) -> tuple[int, str]:
    plant_leak.fn(nbytes)
    return os.getpid(), os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0]


@task(tags=["gpu"])
def cupy_cube(n: int, chunk: int) -> tuple[float, int, int]:
    """The speed-cube on CuPy chunks from inside a gpu task: spread, no deadlock."""
    import cupy
    import dask.array as da
    import distributed

    from prefect_gpu_dask import compute_on_gpus

    x = da.random.RandomState(RandomState=cupy.random.RandomState).normal(
        10, 1, size=(n, n), chunks=(chunk, chunk)
    )
    (mean,) = compute_on_gpus((x[::2, ::2] + 1).mean())
    with distributed.worker_client() as client:
        workers = client.scheduler_info(n_workers=-1)["workers"]
        held = set()
        if len(workers) > 1:
            persisted = client.persist(x)
            distributed.wait(persisted)
            held = {w for ws in client.who_has(persisted).values() for w in ws}
            del persisted
    return float(mean), len(workers), len(held)


@task(tags=["gpu"])
def out_of_memory() -> None:
    import cupy

    cupy.empty(10**15, dtype=cupy.uint8)  # a petabyte: no GPU has it


def test_default_runner_starts_local_cuda_cluster_with_gpu_labels():
    @flow(task_runner=GPUDaskTaskRunner())
    def on_gpu():
        runner = FlowRunContext.get().task_runner
        return (
            device_report.submit().result(),
            type(runner._cluster).__name__,
            [w.get("resources") for w in runner._client.scheduler_info(n_workers=-1)["workers"].values()],
            runner.records,
        )

    report, cluster_name, resources, records = on_gpu()
    print("report:", report, "cluster:", cluster_name, "workers:", resources, "records:", records)
    assert cluster_name == "LocalCUDACluster"
    assert resources and all(r.get("GPU") == 1 for r in resources)
    assert report["array_type"] == "cupy.ndarray" and report["sum"] == 285
    assert report["resources"].get("GPU") == 1
    assert report["device"] == 0  # each worker sees its own GPU first
    assert report["parent"] != os.getpid() and report["parent_loaded_cuda_bindings"], report
    assert not report["guard_made_a_context"], report
    # The context was there before the first reading: the task is not blamed for it.
    [record] = records
    assert record.before > 0 and record.verdict != "leak", record


def test_leak_is_caught_worker_restarted_memory_back_and_churn_is_clean():
    @flow(task_runner=GPUDaskTaskRunner(leak_threshold="256MiB"))
    def leaky_night():
        churn = [churn_pool.submit(4 * GiB).result() for _ in range(2)]
        old, _ = plant_leak_where.submit(512 * MiB).result()
        runner = FlowRunContext.get().task_runner
        deadline = time.monotonic() + 60
        while not runner.restarts and time.monotonic() < deadline:
            pid.submit().result()  # work goes on meanwhile (on another GPU, if there is one)
            time.sleep(0.1)
        worker_pids = set(runner._client.run(os.getpid).values())
        flow_run_id = str(FlowRunContext.get().flow_run.id)
        return churn, old, worker_pids, list(runner.restarts), runner.records, flow_run_id

    churn, old, worker_pids, restarts, records, flow_run_id = leaky_night()
    print("restarts:", restarts)
    for record in records:
        print(
            "record:",
            {
                k: getattr(record, k)
                for k in (
                    "task_run_name",
                    "verdict",
                    "before",
                    "after",
                    "peak",
                    "delta",
                    "duration_s",
                )
            },
        )
    assert churn == [float(4 * GiB // 8)] * 2
    assert old not in worker_pids, "the leaking worker was not restarted"
    verdicts = {r.task_run_name.rsplit("-", 1)[0]: r.verdict for r in records}
    assert verdicts["plant_leak_where"] == "leak"
    assert verdicts["churn_pool"] in {"cached", "clean"}
    churn_records = [r for r in records if r.task_run_name.startswith("churn_pool")]
    assert all(r.peak - r.before >= 4 * GiB * 0.9 for r in churn_records[:1]), churn_records
    [restart] = restarts
    assert restart.old_pid == old and restart.new_pid in worker_pids
    assert restart.reason.startswith("leak")
    assert restart.memory_after < restart.memory_before - 400 * MiB  # the 512 MiB is gone
    assert restart.serving_s < 10

    # -- read back from the API; the summary's hint and picture from real readings --
    from prefect_gpu_dask import read_flow_run_gpu_report
    from prefect_gpu_dask.flow import sizing
    from prefect_gpu_dask.flow.chart import memory_timeline_svg

    deadline = time.monotonic() + 30
    while not (report := read_flow_run_gpu_report(flow_run_id)).restarts and time.monotonic() < deadline:
        time.sleep(0.5)  # events reach the API in batches
    assert set(report.records) == set(records) and report.restarts == (restart,)
    history = sizing.from_value(Variable.get(sizing.variable_name("leaky-night")))
    hints = {h.task_name: h for h in sizing.hints(records, history)}
    churn_hint = hints["churn_pool"]
    print("hints:", [h.describe() for h in hints.values()])
    assert churn_hint.worst_peak >= 0.9 * 4 * GiB and churn_hint.device_total == records[0].device_total
    assert churn_hint.fitting_share * churn_hint.device_total >= 1.2 * churn_hint.worst_peak
    svg = memory_timeline_svg(records)
    assert svg is not None and svg.count("<title>") == len(records)


@task(tags=["gpu"])
def fill_until_oom(piece: int) -> int:
    import cupy

    pieces = []
    while True:  # CuPy raises OutOfMemoryError; the pieces die with this frame
        pieces.append(cupy.ones(piece // 8, dtype=cupy.float64))


def test_out_of_memory_is_an_oom_verdict_not_a_leak_and_the_gpu_recovers():
    @flow(task_runner=GPUDaskTaskRunner())
    def oom():
        huge = out_of_memory.submit()
        huge.wait()
        filled = fill_until_oom.submit(4 * GiB)
        filled.wait()
        # Every GPU (with two workers, the OOM's own among them) still runs work.
        reports = [device_report.submit().result() for _ in range(6)]
        runner = FlowRunContext.get().task_runner
        return huge.state, filled.state, reports, runner.records, runner.restarts

    huge, filled, reports, records, restarts = oom()
    for r in records:
        print(
            f"record: {r.task_run_name:<24} {r.verdict:<6} delta {r.delta / MiB:9.1f} MiB "
            f"peak {r.peak / GiB:6.1f} GiB asked {r.oom_requested} ({r.oom_library}) "
            f"restart {r.restart_reason}"
        )
    for state in (huge, filled):
        assert state.is_failed()
        assert "OutOfMemoryError" in state.message or "out of memory" in state.message.lower()
    assert all(report["sum"] == 285 for report in reports)
    by_task = {r.task_run_name.rsplit("-", 1)[0]: r for r in records}
    assert by_task["out_of_memory"].verdict == "oom" and by_task["out_of_memory"].oom_requested == 10**15
    fill = by_task["fill_until_oom"]
    assert fill.verdict == "oom" and fill.oom_library == "cupy" and fill.oom_requested == 4 * GiB
    assert restarts == (), restarts  # the memory came back: no recycle


def test_gpu_task_computes_a_collection_over_every_gpu():
    @flow(task_runner=GPUDaskTaskRunner())
    def cube():
        return cupy_cube.submit(20_000, 2_000).result(timeout=300)

    mean, workers, held = cube()
    print("speed-cube mean", mean, "workers", workers, "workers holding chunks", held)
    assert abs(mean - 11) < 0.01
    if workers > 1:
        assert held == workers


def runs_ok_in_a_child_on_one_gpu(code: str) -> None:
    """Run ``code`` in a child process on the first visible GPU (a CUDA context here would
    sit on GPU 0 for the other tests); it must exit 0 having printed "ok" first."""
    import subprocess
    import sys

    env = {**os.environ, "CUDA_VISIBLE_DEVICES": os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0]}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    print(done.stdout)
    assert done.returncode == 0 and done.stdout.startswith("ok"), done.stderr


def test_process_reading_matches_the_full_reading_without_device_figures():
    """The guard's cheaper before-task reading (one NVML call) agrees with sample()."""
    code = (
        "import cupy; cupy.zeros(1)\n"
        "from prefect_gpu_dask.worker.probe import open_probe\n"
        "p = open_probe(); full, cheap = p.sample(), p.sample_process()\n"
        "assert full.process > 0 and cheap.process == full.process, (full, cheap)\n"
        "assert (cheap.device_used, cheap.device_total) == (0, 0) and full.device_total > 0\n"
        "print('ok', full.process)\n"
    )
    runs_ok_in_a_child_on_one_gpu(code)


def test_the_process_list_is_read_again_only_once_the_device_moved():
    """On a real GPU the device's figure stands still while nothing allocates, so the
    guard's reading skips the process list then; it follows every real change (CuPy's
    pool growing, a block back to the pool, the pool emptied, memory outside every
    allocator), and with another process on the GPU it reads the list every time."""
    code = (
        "import statistics, subprocess, sys, time, cupy\n"
        "from prefect_gpu_dask.worker.probe import NvmlProbe, ProcessReader, process_sampler\n"
        "class Counted(NvmlProbe):\n"
        "    lists = 0\n"
        "    def sample_process_and_others(self):\n"
        "        Counted.lists += 1\n"
        "        return super().sample_process_and_others()\n"
        "probe = Counted(); read = process_sampler(probe); cupy.zeros(1)\n"
        "assert isinstance(read, ProcessReader)\n"
        "def truth(): return probe.sample().process\n"
        "first = read(); assert first.process == truth() > 0, (first, truth())\n"
        "lists = Counted.lists; idle = [read().process for _ in range(200)]\n"
        "assert set(idle) == {truth()}, set(idle)\n"
        "skipped = 200 - (Counted.lists - lists)\n"
        "block = cupy.ones(2**25); cupy.cuda.Device().synchronize()\n"
        "grown = read(); assert grown.process == truth() >= first.process + 2**28, (grown, first)\n"
        "del block; back = read(); assert back.process == truth() == grown.process, (back, grown)\n"
        "cupy.get_default_memory_pool().free_all_blocks()\n"
        "emptied = read(); assert emptied.process == truth() < grown.process, (emptied, grown)\n"
        "read()\n"
        "raw = cupy.cuda.runtime.malloc(2**28)\n"  # outside CuPy's pool: only the device's figure moves
        "outside = read(); assert outside.process == truth() >= emptied.process + 2**28, (outside, emptied)\n"
        "cupy.cuda.runtime.free(raw)\n"
        "freed = read(); assert freed.process == truth() == emptied.process, (freed, emptied)\n"
        "other = subprocess.Popen([sys.executable, '-c', 'import sys, cupy; a = cupy.ones(2**25);'\n"
        "    ' cupy.cuda.Device().synchronize(); print(1, flush=True); sys.stdin.readline()'],\n"
        "    stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)\n"
        "other.stdout.readline(); read()\n"
        "lists = Counted.lists; shared = [read().process for _ in range(20)]\n"
        "listed = Counted.lists - lists\n"
        "assert set(shared) == {truth()} and listed == 20, (set(shared), listed)\n"
        "other.stdin.write('\\n'); other.stdin.flush(); other.wait()\n"
        "def median_us(f):\n"
        "    times = []\n"
        "    for _ in range(500):\n"
        "        t = time.perf_counter(); f(); times.append(time.perf_counter() - t)\n"
        "    return statistics.median(times) * 1e6\n"
        "read(); read()\n"
        "print(f'ok: idle readings without the process list: {skipped} of 200;'\n"
        "      f' reading {median_us(read):.1f} us,'\n"
        "      f' the process list {median_us(probe.sample_process):.1f} us,'\n"
        "      f' the device figure {median_us(probe.sample_device):.1f} us')\n"
        "assert skipped >= 150, skipped\n"
    )
    runs_ok_in_a_child_on_one_gpu(code)


def test_the_guards_reads_agree_with_nvidia_smi_s_view():
    """The guard's per-process and device-memory reads, on a real GPU: this process's
    memory as NVML lists it, the device's in use and in all."""
    code = (
        "import os, cupy, pynvml; x = cupy.zeros(2**26)\n"
        "from prefect_gpu_dask import nvml\n"
        "from prefect_gpu_dask.worker.probe import open_probe\n"
        "probe = open_probe(); handle = probe._handle\n"
        "mine = nvml.process_memory(handle, os.getpid())\n"
        "assert mine >= 2**26 * 8, mine\n"
        "assert os.getpid() in nvml.process_pids(handle)\n"
        "device = nvml.device_memory(handle)\n"
        "assert device.total > device.used >= mine, (device, mine)\n"
        "print('ok', mine, device)\n"
    )
    runs_ok_in_a_child_on_one_gpu(code)


@task(tags=["gpu"])
def svd_of_tall_skinny(seed: int) -> float:
    """As flows/svd.py: an SVD of a CuPy-backed 10000x1000 Dask array."""
    import cupy
    import dask
    import dask.array as da

    from prefect_gpu_dask import compute_on_gpus

    with dask.config.set({"array.backend": "cupy"}):
        x = da.random.default_rng(seed).random((10_000, 1_000), chunks=(1_000, 1_000))
    _, s, _ = da.linalg.svd(x)
    (values,) = compute_on_gpus(s)
    return float(cupy.asnumpy(values)[0])


@task(tags=["gpu"])
def cupy_matmul(n: int) -> float:
    import cupy

    a = cupy.ones((n, n), dtype=cupy.float32)
    return float((a @ a).sum())


@task(tags=["gpu"])
def torch_matmul(n: int) -> float:
    import torch

    a = torch.ones(n, n, device="cuda")
    return float((a @ a).sum())


def test_library_first_use_is_never_a_leak():
    """Ten SVDs (cuSOLVER, per thread), the speed-cube, a first cuBLAS matmul and a torch
    matmul on one cluster: no leak verdict and no restart; the planted leak still is one."""
    try:
        import torch  # noqa: F401

        with_torch = True
    except ImportError:
        with_torch = False

    @flow(task_runner=GPUDaskTaskRunner())
    def first_uses():
        [svd_of_tall_skinny.submit(i).result() for i in range(10)]
        cupy_cube.submit(20_000, 2_000).result()
        cupy_matmul.submit(4096).result()
        if with_torch:
            torch_matmul.submit(4096).result()
        old, _ = plant_leak_where.submit(512 * MiB).result()
        runner = FlowRunContext.get().task_runner
        deadline = time.monotonic() + 60
        while not runner.restarts and time.monotonic() < deadline:
            time.sleep(0.1)
        return sorted(runner.records, key=lambda r: r.time), runner.restarts

    records, restarts = first_uses()
    for r in records:
        print(
            f"record: {r.task_run_name:<28} {r.verdict:<8} delta {r.delta / MiB:8.1f} MiB "
            f"allocator {'n/a' if r.allocator_delta is None else f'{r.allocator_delta / MiB:.1f}'} MiB "
            f"peak {r.peak / MiB:8.1f} MiB worker {r.worker_name} pid {r.pid}"
        )
    print("restarts:", [(r.worker_name, r.reason) for r in restarts])
    verdicts = {r.task_run_name: r.verdict for r in records}
    leaks = [name for name, verdict in verdicts.items() if verdict == "leak"]
    assert len(leaks) == 1 and leaks[0].startswith("plant_leak_where"), verdicts
    [restart] = restarts
    assert restart.reason.startswith("leak")
    assert sum(name.startswith("svd_of_tall_skinny") for name in verdicts) == 10


@task(tags=["gpu"], timeout_seconds=3)
def hung_kernel() -> None:
    import cupy

    spin = cupy.RawKernel(
        r'extern "C" __global__ void spin(volatile int* flag) { while (*flag == 0) { } }', "spin"
    )
    flag = cupy.zeros(1, dtype=cupy.int32)
    spin((1,), (1,), (flag,))  # nobody ever sets the flag
    cupy.cuda.Device().synchronize()  # blocks in the driver, outside Python


def test_a_hung_kernel_times_out_and_its_worker_is_recycled():
    @flow(task_runner=GPUDaskTaskRunner())
    def hangs():
        started = time.monotonic()
        stuck = hung_kernel.submit()
        stuck.wait(timeout=120)
        settled_s = time.monotonic() - started
        reports = [device_report.submit().result() for _ in range(4)]
        runner = FlowRunContext.get().task_runner
        return stuck.state, settled_s, reports, runner.restarts

    state, settled_s, reports, restarts = hangs()
    print("hung kernel:", state.name, repr(state.message), f"settled after {settled_s:.1f} s")
    print("restarts:", [(r.worker_name, r.reason, r.restart_s, r.serving_s) for r in restarts])
    assert state.name == "TimedOut", state
    assert settled_s < 3 + 20
    assert all(report["sum"] == 285 for report in reports)
    [restart] = restarts
    assert restart.reason.startswith("hung: hung_kernel")


def test_an_oom_is_retried_as_the_task_runs_own_retry():
    @flow(task_runner=GPUDaskTaskRunner(oom_retries=1))
    def retried():
        filled = fill_until_oom.submit(8 * GiB)  # runs out of memory every time
        filled.wait()
        return filled.state, filled.task_run_id, FlowRunContext.get().task_runner.records

    state, task_run_id, records = retried()
    from prefect.client.orchestration import get_client

    run = recorded_task_run(task_run_id)
    with get_client(sync_client=True) as api:
        names = [s.name for s in api.read_task_run_states(task_run_id)]
    verdicts = [r.verdict for r in records if r.task_run_id == str(task_run_id)]
    print("oom retry:", state.name, "run_count", run.run_count, "states", names, "verdicts", verdicts)
    assert state.is_failed() and run.run_count == 2 and ("Retrying" in names or "AwaitingRetry" in names)
    assert verdicts == ["oom", "oom"]


def test_workers_advertise_their_gpu_model_and_memory_and_tags_route_on_them():
    import pynvml
    from prefect import tags

    from prefect_gpu_dask import nvml
    from prefect_gpu_dask.resources import model_resource, model_slug

    pynvml.nvmlInit()
    handle = pynvml.nvmlDeviceGetHandleByIndex(0)
    name, total = nvml.device_name(handle), nvml.device_memory(handle).total
    model = model_slug(name)

    @flow(task_runner=GPUDaskTaskRunner(on_missing_gpu="error"))
    def labelled():
        client = FlowRunContext.get().task_runner.client
        offered = [w["resources"] for w in client.scheduler_info(n_workers=-1)["workers"].values()]
        with tags(f"gpu:{model}" if model in ("h100", "h200") else f"gpu-model:{model}", "gpu:0.5"):
            with tags(f"gpu-mem:{total // 4}"):
                reports = [device_report.submit() for _ in range(4)]
        with tags(f"gpu-mem:{2 * total}"):
            too_big = device_report.submit()
            too_big.wait()
        return offered, [r.result() for r in reports], too_big.state

    offered, reports, too_big = labelled()
    print("gpu:", name, "model tag", model, "offered:", offered)
    assert offered and all(r[model_resource(model)] == 1 and r["GPU-MEM"] == total for r in offered)
    assert all(r["sum"] == 285 for r in reports)
    assert too_big.is_failed() and "GPU-MEM" in too_big.message


def quiet(monitor) -> bool:
    """Whether the monitor's NVML reader vouches for its last check now (as a screen asks)."""
    with monitor._lock:  # the health timer reads on the event loop meanwhile
        return monitor._reader.quiet()


@task(tags=["gpu"])
def health_on_this_worker(checks: int) -> dict:
    import statistics

    from prefect_gpu_dask.worker.guard import current_guard

    watch = current_guard().health
    timings, screens = [], []
    for _ in range(checks):
        started = time.perf_counter()
        verdict = watch.monitor.check()
        timings.append(time.perf_counter() - started)
    for _ in range(checks):
        started = time.perf_counter()
        screened = watch.monitor.screen()
        screens.append(time.perf_counter() - started)
    return {
        "healthy": verdict.healthy and screened.healthy,
        "reasons": verdict.reasons,
        "warnings": verdict.warnings,
        "limits": watch.monitor.limits,
        "quiet": quiet(watch.monitor),
        "median_us": statistics.median(timings) * 1e6,
        "p95_us": sorted(timings)[int(0.95 * (checks - 1))] * 1e6,
        "screen_median_us": statistics.median(screens) * 1e6,
        "quarantined": watch.quarantine is not None,
    }


def test_real_gpu_health_is_checked_through_nvml_and_healthy_gpus_run_their_tasks():
    """Every GPU worker's guard holds an NVML health watch; on a healthy GPU nothing is
    quarantined and every gpu task runs. Prints what NVML let it check and a check's cost."""

    @flow(task_runner=GPUDaskTaskRunner(health_check_s=0.5))
    def checked():
        reports = [health_on_this_worker.submit(2000).result() for _ in range(2)]
        time.sleep(1.5)  # a few timer checks
        return reports, FlowRunContext.get().task_runner.quarantines

    reports, quarantines = checked()
    for report in reports:
        print("health:", report)
    assert quarantines == ()
    assert all(r["healthy"] and not r["quarantined"] for r in reports)
    # Where Xid events are registered, the screen before each task vouches for the last
    # check without reading everything again.
    xids_checked = not any(limit.startswith("Xid events not checked") for limit in reports[0]["limits"])
    assert all(r["quiet"] == xids_checked for r in reports)


@task(tags=["gpu"])
def matmuls_for(seconds: float) -> int:
    import cupy

    a = cupy.random.random((8192, 8192), dtype=cupy.float32)
    done, deadline = 0, time.monotonic() + seconds
    while time.monotonic() < deadline:
        a = a @ a
        a /= cupy.abs(a).max()
        cupy.cuda.Device().synchronize()
        done += 1
    return done


@task(tags=["gpu"])
def waits_for(seconds: float) -> None:
    import cupy

    cupy.zeros(1)  # a CUDA context, then nothing for the GPU to do
    time.sleep(seconds)


def nvidia_smi_power(stop, samples: list) -> None:
    """``nvidia-smi --query-gpu=power.draw`` of every GPU every 100 ms: (GPU UUID, epoch
    seconds, watts). Every GPU: which one a task lands on is the scheduler's choice."""
    import datetime
    import subprocess

    query = ["nvidia-smi", "--query-gpu=uuid,timestamp,power.draw", "--format=csv,noheader,nounits"]
    with subprocess.Popen([*query, "-lms", "100"], stdout=subprocess.PIPE, text=True) as smi:
        try:
            for line in smi.stdout:
                uuid, stamp, watts = (part.strip() for part in line.split(","))
                when = datetime.datetime.strptime(stamp, "%Y/%m/%d %H:%M:%S.%f").timestamp()
                samples.append((uuid, when, float(watts)))
                if stop.is_set():
                    break
        finally:
            smi.terminate()


def test_a_busy_task_and_an_idle_one_differ_in_utilisation_and_energy_as_nvidia_smi_sees_it():
    import threading

    stop, power = threading.Event(), []
    threading.Thread(target=nvidia_smi_power, args=(stop, power), daemon=True).start()

    @flow(task_runner=GPUDaskTaskRunner())
    def busy_and_idle():  # closes over nothing: Prefect sends the flow to the workers
        waits_for.submit(4.0).wait()  # the cluster and the CUDA context come up first
        idle = waits_for.submit(6.0)
        idle.wait()
        busy = matmuls_for.submit(6.0)
        busy.wait()
        time.sleep(1.0)
        ids = {"idle": str(idle.task_run_id), "busy": str(busy.task_run_id)}
        records = FlowRunContext.get().task_runner.records
        return {name: next(r for r in records if r.task_run_id == id_) for name, id_ in ids.items()}

    try:
        records = busy_and_idle()
    finally:
        stop.set()
    smi = {}
    for name, r in records.items():
        start, end = r.time - r.duration_s, r.time
        inside = [watts for uuid, when, watts in power if uuid == r.gpu_uuid and start <= when <= end]
        smi[name] = sum(inside) / len(inside) * r.duration_s if inside else None
        print(
            f"{name}: {r.duration_s:.2f} s, SM {r.sm_util_mean}% mean / {r.sm_util_peak}% peak "
            f"({r.util_scope}), energy {r.energy_j} J (nvidia-smi power x time {smi[name]} J from "
            f"{len(inside)} samples), peak {r.temperature_peak_c} C, throttle {r.throttle_reasons}, "
            f"GPU-seconds {r.gpu_seconds}"
        )
    busy, idle = records["busy"], records["idle"]
    assert busy.sm_util_mean > 50 and idle.sm_util_mean < 10, (busy, idle)
    assert busy.energy_j > 1.5 * idle.energy_j, (busy.energy_j, idle.energy_j)
    for name, r in records.items():
        assert r.energy_j == pytest.approx(smi[name], rel=0.2), (name, r.energy_j, smi[name])
    assert busy.gpu_share == 1 and busy.gpu_seconds == pytest.approx(busy.duration_s, abs=1e-5)
