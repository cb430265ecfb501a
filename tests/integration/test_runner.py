"""The runner against a real Prefect API and real Dask processes on 127.0.0.1."""

from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys
import time
import uuid
from pathlib import Path

import distributed
import pytest
from distributed import Client
from prefect import flow, tags, task
from prefect.states import State

from prefect_gpu_dask import GPUDaskTaskRunner, MissingResourceError, forkserver
from prefect_gpu_dask.flow import routing
from prefect_gpu_dask.flow.cluster import PROFILE_INTERVAL, WORKER_PROFILE_INTERVAL
from tests.conftest import recorded_task_run, task_run_logs, worker_process_state


@task(tags=["gpu"])
def gpu_where(i: int) -> str:
    return distributed.get_worker().name


@task
def anywhere(i: int) -> str:
    return distributed.get_worker().name


@task
def interval(seconds: float) -> tuple[float, float]:
    start = time.time()
    time.sleep(seconds)
    return start, time.time()


def _overlaps(intervals: list[tuple[float, float]]) -> bool:
    spans = sorted(intervals)
    return any(b[0] < a[1] for a, b in zip(spans, spans[1:]))


def test_gpu_tasks_run_only_on_the_gpu_worker(remote_cluster):
    @flow(task_runner=GPUDaskTaskRunner(address=remote_cluster.address))
    def routed():
        gpu = [gpu_where.submit(i) for i in range(8)]
        mapped = gpu_where.map(range(8))
        free = anywhere.map(range(16))
        with tags("gpu"):
            ctx = anywhere.submit(99)
        return (
            [f.result() for f in gpu],
            [f.result() for f in mapped],
            [f.result() for f in free],
            ctx.result(),
        )

    gpu, mapped, free, ctx = routed()
    assert set(gpu) == {"gpu-worker"}
    assert set(mapped) == {"gpu-worker"}
    assert ctx == "gpu-worker"  # tags from `with tags("gpu")` count
    assert set(free) <= {"gpu-worker", "cpu-worker"}


def test_a_task_given_a_future_records_its_upstream_task_run_and_assets(remote_cluster):
    """The task-run graph and asset lineage the Prefect UI draws: a task given another's
    future lists that task run among its inputs, and its materialization references the
    upstream asset (prefect-dask's own suite checks the event)."""
    from prefect.assets import Asset, materialize
    from prefect.client.schemas.objects import TaskRunResult

    from tests.ui_helpers import read_events

    raw = Asset(key=f"s3://gpu-dask-test/raw-{uuid.uuid4().hex[:8]}")
    done = Asset(key=f"s3://gpu-dask-test/done-{uuid.uuid4().hex[:8]}")

    @materialize(raw, tags=["gpu"])
    def extract() -> int:
        return 50

    @materialize(done)
    def load(rows: int) -> int:
        return rows * 2

    @flow(task_runner=GPUDaskTaskRunner(address=remote_cluster.address))
    def lineage():
        upstream = extract.submit()
        downstream = load.submit(upstream)
        return downstream.result(), upstream.task_run_id, downstream.task_run_id

    rows, upstream_id, downstream_id = lineage()
    assert rows == 100
    run = recorded_task_run(downstream_id)
    assert run.task_inputs["rows"] == [TaskRunResult(id=upstream_id)]
    referenced = read_events(["prefect.asset.referenced"], resource=raw.key)
    assert [e.resource.id for e in referenced] == [raw.key]


def test_task_runs_submitted_after_another_client_restarts_the_cluster_still_run():
    """A flow run's task objects wait on the scheduler (``payload.SharedRef``); a
    ``Client.restart`` by anyone clears the scheduler's metadata, and the flow run's
    next task runs of the same tasks must still find them."""
    with distributed.LocalCluster(
        n_workers=1, threads_per_worker=2, host="127.0.0.1", dashboard_address=":0"
    ) as cluster:
        address = cluster.scheduler_address  # the flow pickles with what it refers to

        @flow(task_runner=GPUDaskTaskRunner(address=address))
        def across_a_restart():
            before = [anywhere.submit(i).result() for i in range(2)]
            with Client(address, set_as_default=False) as other:
                other.restart(timeout=120)
            after = [anywhere.submit(i).result() for i in range(2)]
            return before, after

        before, after = across_a_restart()
        assert len(before) == len(after) == 2


def test_the_scheduler_never_imports_prefect(remote_cluster):
    @flow(task_runner=GPUDaskTaskRunner(address=remote_cluster.address))
    def chained():
        first = gpu_where.submit(1)
        return anywhere.submit(first).result()  # its inputs name the first task run

    assert chained() in {"gpu-worker", "cpu-worker"}
    with Client(remote_cluster.address) as client:
        # a lambda travels by value: a function of this module would import Prefect there
        loaded = client.run_on_scheduler(
            lambda: sorted(name for name in __import__("sys").modules if name.split(".")[0] == "prefect")
        )
    assert loaded == []


def test_custom_tag_map_routes(remote_cluster):
    @task(tags=["big"])
    def big() -> str:
        return distributed.get_worker().name

    @flow(task_runner=GPUDaskTaskRunner(address=remote_cluster.address, tag_resources={"big": {"GPU": 1}}))
    def custom():
        return [big.submit().result() for _ in range(4)]

    assert set(custom()) == {"gpu-worker"}


def test_user_annotations_are_kept(remote_cluster):
    import dask

    @flow(task_runner=GPUDaskTaskRunner(address=remote_cluster.address))
    def annotated():
        with dask.annotate(resources={"GPU": 1}):
            return [anywhere.submit(i).result() for i in range(4)]

    assert set(annotated()) == {"gpu-worker"}


def test_half_gpu_tasks_share_and_whole_gpu_tasks_do_not(remote_cluster):
    @flow(task_runner=GPUDaskTaskRunner(address=remote_cluster.address))
    def sharing():
        half = interval.with_options(tags=["gpu:0.5"]).map([1.0, 1.0])
        whole = interval.with_options(tags=["gpu:1"]).map([0.5, 0.5, 0.5])
        return [f.result() for f in half], [f.result() for f in whole]

    half, whole = sharing()
    assert _overlaps(half), half
    assert not _overlaps(whole), whole


def test_missing_gpu_falls_back_to_cpu_with_a_warning(remote_cluster):
    @task(tags=["gpu:2"])  # no worker has two GPU slots
    def needs_two() -> str:
        return distributed.get_worker().name

    @flow(task_runner=GPUDaskTaskRunner(address=remote_cluster.address, gpu_wait_s=0))
    def fallback():
        future = needs_two.submit()
        return future.result(), future.task_run_id

    name, task_run_id = fallback()
    assert name in {"gpu-worker", "cpu-worker"}
    assert any(
        "running on CPU instead" in line for line in task_run_logs(task_run_id, "running on CPU instead")
    )


def test_missing_gpu_error_fails_fast(remote_cluster):
    @task(tags=["gpu:2"])
    def needs_two() -> str:
        return "ran"

    @flow(task_runner=GPUDaskTaskRunner(address=remote_cluster.address, on_missing_gpu="error", gpu_wait_s=0))
    def strict():
        return needs_two.submit()

    start = time.monotonic()
    state: State = strict(return_state=True)
    elapsed = time.monotonic() - start
    assert state.is_failed()
    with pytest.raises(MissingResourceError, match=r"asked for resources \{'GPU': 2.0\}"):
        state.result()
    assert elapsed < 30


def test_default_runner_without_gpus_runs_gpu_tasks_on_cpu():
    @flow(task_runner=GPUDaskTaskRunner(cluster_kwargs={"n_workers": 1, "threads_per_worker": 2}))
    def default():
        future = gpu_where.submit(0)
        return future.result(), future.task_run_id

    name, task_run_id = default()
    assert name == 0
    assert any(
        "running on CPU instead" in line for line in task_run_logs(task_run_id, "running on CPU instead")
    )


@task
def worker_parent_and_mark() -> tuple[int, str | None, str]:
    import dask

    return os.getppid(), os.environ.get("PREFECT_GPU_DASK_TEST_MARK"), dask.config.get(PROFILE_INTERVAL)


def _local_worker_parent_and_mark() -> tuple[int, str | None, str]:
    @flow(task_runner=GPUDaskTaskRunner(cluster_kwargs={"n_workers": 1, "threads_per_worker": 1}))
    def which():
        return worker_parent_and_mark.submit().result()

    return which()


def test_local_workers_fork_from_a_preloaded_server_and_sample_profiles_coarser():
    parent, _, profile_interval = _local_worker_parent_and_mark()
    # A spawned worker is the child of this process, where its Nanny runs.
    assert parent != os.getpid()
    assert profile_interval == WORKER_PROFILE_INTERVAL


ENTER_AND_REPORT = """
import json, os, sys
from prefect_gpu_dask import GPUDaskTaskRunner, forkserver

arguments = eval(sys.argv[1])
if arguments.pop("default_client", False):  # the user's own, as in a notebook: prefect-dask uses it
    import distributed

    distributed.Client(processes=False, dashboard_address=":0")
set_in_body = arguments.pop("set_in_body", False)
import_later = arguments.pop("import_later", None)
environ = dict(os.environ)
runner = GPUDaskTaskRunner(**arguments)
made = forkserver._fork_server_surroundings is not None
if import_later:  # as a flow script may, after it made its runner
    __import__(import_later)
with runner:
    report = {
        "made": made,
        "server": forkserver._fork_server_surroundings is not None,
        "environ_kept": dict(os.environ) == environ,  # the Nanny's variables come with the cluster
        "client": runner._client is not None,
    }
    if set_in_body:  # as a flow's body may, before its first task
        os.environ["PREFECT_GPU_DASK_TEST_MARK"] = "set in the body"
    if report["server"]:
        parents = runner.client.run(os.getppid).values()
        report["forked"] = all(parent != os.getpid() for parent in parents)
        report["seen"] = sorted(set(runner.client.run(os.environ.get, "PREFECT_GPU_DASK_TEST_MARK").values()))
        if import_later:
            report["imported"] = all(runner.client.run(lambda: import_later in sys.modules).values())
print(json.dumps(report))
"""


@pytest.mark.parametrize(
    "arguments, starts",
    [
        ({"cluster_kwargs": {"n_workers": 1, "threads_per_worker": 1}}, True),
        ({"cluster_class": "distributed.LocalCluster", "cluster_kwargs": {"n_workers": 1}}, True),
        ({"cluster_kwargs": {"processes": False}}, False),
        ({"address": "tcp://127.0.0.1:9"}, False),
        ({"cluster_class": "distributed.SSHCluster"}, False),
        ({"default_client": True}, False),
        ({"cluster_kwargs": {"n_workers": 1}, "set_in_body": True}, True),
        ({"cluster_kwargs": {"n_workers": 1}, "import_later": "dask.array"}, True),
    ],
)
def test_entering_the_runner_starts_the_fork_server_only_for_a_local_cluster_of_processes(
    arguments, starts, tmp_path
):
    """A fresh process: making the runner starts nothing; its fork server starts as a
    flow run enters it, before the first task starts the cluster, only where that
    cluster will fork workers, and without touching the flow's environment; that
    cluster's workers then fork from it, or from a new server where the body changed the
    environment before its first task, or where the script imported ``dask.array`` after
    making its runner."""
    env = {**os.environ, "PREFECT_API_URL": "http://127.0.0.1:9/api", "PREFECT_HOME": str(tmp_path)}
    done = subprocess.run(
        [sys.executable, "-c", ENTER_AND_REPORT, repr(arguments)],
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout.splitlines()[-1])
    assert report["made"] is False and report["server"] is starts, report
    assert report["environ_kept"] and not report["client"], report
    if starts:  # a variable set in the body: the workers fork from a new server that has it
        assert report["forked"], report
        assert report["seen"] == (["set in the body"] if "set_in_body" in arguments else [None]), report
        assert report.get("imported", True), report
        assert "Spawning" not in done.stderr


def _in_a_fresh_process(script: str) -> subprocess.CompletedProcess:
    """``script`` run by a new interpreter from the repository's root (``tests`` importable)."""
    return subprocess.run(
        [sys.executable, "-c", script],
        cwd=Path(__file__).parents[2],
        capture_output=True,
        text=True,
        timeout=180,
    )


CUDA_AFTER_CPU = """
import multiprocessing
from prefect_gpu_dask import forkserver
from tests.conftest import exit_with_module_loaded

methods = [forkserver.worker_start_method(cuda=False), forkserver.worker_start_method(cuda=True)]
child = multiprocessing.get_context("forkserver").Process(
    target=exit_with_module_loaded, args=(forkserver.CUDA_WORKER_PRELOAD[0],)
)
child.start()
child.join(120)
print(*methods, child.exitcode)
"""


def test_a_cuda_cluster_after_a_cpu_one_forks_from_a_server_that_imported_dask_cuda():
    """A fresh process: a CPU cluster's server lacks what CUDA workers import, and a
    CUDA cluster's variable changes the environment; with no cluster forking from that
    server any more, the CUDA cluster gets a new server, and its workers fork from it
    (on a machine without dask-cuda its import fails there, and the server stays up)."""
    done = _in_a_fresh_process(CUDA_AFTER_CPU)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["forkserver", "forkserver", "0"], (done.stdout, done.stderr)


DASK_ARRAY_PRELOADED = """
import multiprocessing
import dask.array  # the flow's module uses it
from prefect_gpu_dask import forkserver
from tests.conftest import exit_with_module_loaded

forkserver.worker_start_method()
fork = multiprocessing.get_context("forkserver")
child = fork.Process(target=exit_with_module_loaded, args=("dask.array",))
child.start()
child.join(120)
print(child.exitcode)
"""


def test_workers_fork_with_dask_array_imported_where_the_flow_imported_it():
    """A worker that imports ``dask.array`` in a task's thread while a graph arriving
    beside it unpickles one of its submodules fails one of them (CPython's import
    deadlock): where the flow process has it, the fork server imports it once, first."""
    done = _in_a_fresh_process(DASK_ARRAY_PRELOADED)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["0"], (done.stdout, done.stderr)


def test_local_workers_spawn_when_the_environment_changed_since_the_server_started(monkeypatch, caplog):
    forkserver.worker_start_method()  # the fork server is running, with today's environment
    mark = uuid.uuid4().hex
    monkeypatch.setenv("PREFECT_GPU_DASK_TEST_MARK", mark)
    with caplog.at_level("INFO", logger=forkserver.__name__):
        parent, seen, _ = _local_worker_parent_and_mark()
    assert (parent, seen) == (os.getpid(), mark)
    # Named, never valued: a variable may hold a secret.
    assert "$PREFECT_GPU_DASK_TEST_MARK changed since the fork server started" in caplog.text
    assert mark not in caplog.text


def test_remote_workers_with_the_nanny_preload_fork_from_a_preloaded_server(dask_processes):
    """``dask worker --preload-nanny prefect_gpu_dask.worker.nanny``: the first worker process
    and its replacement after a restart fork from a server that already imported
    Prefect (the nanny itself imports none of it); a plain ``dask worker`` spawns one
    that has not."""
    dask_processes.start_scheduler()
    dask_processes.start_worker("forked", "--nthreads", "1", fork=True)
    dask_processes.start_worker("spawned", "--nthreads", "1", fork=False)
    dask_processes.wait_for_workers(2)
    with Client(dask_processes.address) as client:
        names = {w["name"]: a for a, w in client.scheduler_info(n_workers=-1)["workers"].items()}
        states = client.run(worker_process_state)
        nanny_states = client.run(worker_process_state, nanny=True)
        nannies = {address: pid for address, (pid, _, _) in nanny_states.items()}
        assert not any(engine for _, _, engine in nanny_states.values()), nanny_states
        forked_pid, server, preloaded = states[names["forked"]]
        assert preloaded and server != nannies[names["forked"]]
        _, spawned_parent, spawned_preloaded = states[names["spawned"]]
        assert not spawned_preloaded and spawned_parent == nannies[names["spawned"]]

        client.restart_workers([names["forked"]])
        client.wait_for_workers(2)
        names = {w["name"]: a for a, w in client.scheduler_info(n_workers=-1)["workers"].items()}
        pid, parent, preloaded = client.run(worker_process_state, workers=[names["forked"]])[names["forked"]]
        assert (parent, preloaded) == (server, True) and pid != forked_pid


def test_default_runner_error_mode_fails_within_bound():
    @flow(
        task_runner=GPUDaskTaskRunner(
            on_missing_gpu="error", cluster_kwargs={"n_workers": 1, "threads_per_worker": 1}
        )
    )
    def strict():
        return gpu_where.submit(0).result()

    start = time.monotonic()
    state = strict(return_state=True)
    assert state.is_failed()
    assert "no worker offers them" in state.message or "no worker offers" in str(
        state.result(raise_on_failure=False)
    )
    assert time.monotonic() - start < 60


def test_gpu_submit_uses_the_last_resource_answer_and_refreshes_it_in_the_background(remote_cluster):
    from prefect.context import get_run_context

    # gpu_wait_s: the unsatisfiable request below asks the scheduler, then falls back at once.
    @flow(task_runner=GPUDaskTaskRunner(address=remote_cluster.address, gpu_wait_s=0))
    def stale_answer():
        runner = get_run_context().task_runner
        assert runner.client is not None  # connects: the runner is lazy
        asked = []
        real = routing.scheduler_identity  # the runner's one synchronous way to ask
        routing.scheduler_identity = lambda client: (asked.append(client), real(client))[1]
        try:
            offers = runner.worker_offers
            offers.asked_at -= 60  # last answer a minute old: due for a refresh
            stale_at = offers.asked_at
            where = gpu_where.submit(0)
            asked_on_submit = list(asked)
            deadline = time.monotonic() + 10
            while offers.asked_at == stale_at and time.monotonic() < deadline:
                time.sleep(0.01)
            refreshed = offers.asked_at > stale_at
            # A task the last answer cannot run still asks the scheduler first (no
            # background refresh may answer it meanwhile).
            offers.asked_at -= 60
            offers.refreshing = True
            try:
                with tags("gpu:2"):
                    anywhere.submit(0).result()  # no worker has two GPU slots: runs on CPU
            finally:
                offers.refreshing = False
            return where.result(), asked_on_submit, refreshed, len(asked)
        finally:
            routing.scheduler_identity = real

    where, asked_on_submit, refreshed, asked = stale_answer()
    assert where == "gpu-worker"
    assert asked_on_submit == []  # the submit did not wait for the scheduler
    assert refreshed  # ... which answered in the background
    assert asked >= 1  # the unsatisfiable request asked before giving up


def test_malformed_tag_raises_before_the_task_runs(remote_cluster):
    ran = []

    @task(tags=["gpu:abc"])
    def bad() -> None:
        ran.append(1)

    @flow(task_runner=GPUDaskTaskRunner(address=remote_cluster.address))
    def malformed():
        bad.submit()

    with pytest.raises(ValueError, match="gpu:abc"):
        malformed()
    assert ran == []


ARGUMENTS = dict(
    address="tcp://127.0.0.1:8786",
    client_kwargs={"timeout": "5s"},
    performance_report_path=None,
    tag_resources={"nvme": {"NVME": 1}},
    on_missing_gpu="error",
    guard="all",
    leak_threshold="128MiB",
    memory_limit=0.8,
    restart="cluster",
    restart_after_tasks=10,
    allow_insecure=False,
    oom_retries=2,
    gpu_wait_s=12.5,
    health_check_s=7.5,
)


def test_duplicate_and_pickle_round_trip_every_argument():
    runner = GPUDaskTaskRunner(**ARGUMENTS, memory_probe="tests.scripted_probe:fake_probe")
    validated = {**ARGUMENTS, "leak_threshold": 128 * 2**20, "tag_resources": {"nvme": {"NVME": 1.0}}}
    for clone in (runner.duplicate(), pickle.loads(pickle.dumps(runner))):
        assert type(clone) is GPUDaskTaskRunner
        assert clone == runner
        assert clone.settings == runner.settings
        arguments = clone._arguments()
        for name, value in validated.items():
            assert arguments[name] == value, name
        assert arguments["memory_probe"] == "tests.scripted_probe:fake_probe"
        assert clone.client_kwargs["timeout"] == "5s"
        assert clone.router.resources_for_tags({"nvme"}) == {"NVME": 1.0}


def test_duplicate_keeps_cluster_class_and_kwargs():
    runner = GPUDaskTaskRunner(
        cluster_class="distributed.LocalCluster",
        cluster_kwargs={"n_workers": 1},
        adapt_kwargs={"maximum": 2},
    )
    clone = pickle.loads(pickle.dumps(runner.duplicate()))
    assert clone.cluster_class == "distributed.LocalCluster"
    assert clone.cluster_kwargs == {"n_workers": 1}
    assert clone.adapt_kwargs == {"maximum": 2}


def test_security_round_trips(tmp_path):
    security = distributed.Security(require_encryption=False)
    runner = GPUDaskTaskRunner(address="tls://10.0.0.5:8786", security=security)
    clone = pickle.loads(pickle.dumps(runner)).duplicate()
    assert clone.security is not None
    assert clone.client_kwargs["security"] is not None
    assert "security" not in clone._arguments()["client_kwargs"]


@task(tags=["gpu"])
def cube_mean(n: int, chunk: int) -> tuple[float, int]:
    import dask.array as da

    from prefect_gpu_dask import compute_on_gpus

    x = da.random.RandomState(0).normal(10, 1, size=(n, n), chunks=(chunk, chunk))
    (mean,) = compute_on_gpus((x[::2, ::2] + 1).mean())
    return float(mean), len(distributed.get_client().scheduler_info(n_workers=-1)["workers"])


@pytest.mark.parametrize("workers", [1, 2])
def test_gpu_task_computing_a_collection_cannot_deadlock(dask_processes, workers):
    # One thread per worker and one GPU slot each: the task holds both while it waits.
    dask_processes.start_scheduler()
    for i in range(workers):
        dask_processes.start_worker(f"gpu-{i}", "--nthreads", "1", "--resources", "GPU=1")
    dask_processes.wait_for_workers(workers)

    @flow(task_runner=GPUDaskTaskRunner(address=dask_processes.address))
    def cube():
        return cube_mean.submit(2000, 500).result(timeout=120)

    mean, seen = cube()
    assert abs(mean - 11) < 0.01
    assert seen == workers


@task
def on_which_worker() -> str:
    return str(distributed.get_worker().name)


def test_a_cluster_class_with_an_async_adapt_scales_up_from_zero():
    runner = GPUDaskTaskRunner(
        cluster_class="tests.cluster_classes.AsyncAdaptCluster",
        cluster_kwargs={"n_workers": 0, "threads_per_worker": 1},
        adapt_kwargs={"minimum": 0, "maximum": 1},
    )

    @flow(task_runner=runner)
    def adaptive():
        from prefect.context import get_run_context

        worker = on_which_worker.submit().result(timeout=120)
        return worker, get_run_context().task_runner._cluster.adapted_with

    worker, adapted_with = adaptive()
    assert worker and adapted_with == {"minimum": 0, "maximum": 1}


@task(tags=["gpu"])
def ooms_once(ledger: str) -> int:
    with open(ledger, "a") as fh:
        fh.write("attempt\n")
    attempts = len(open(ledger).read().splitlines())
    if attempts == 1:
        raise RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB")  # as torch says it
    return attempts


@task(tags=["gpu"])
def fails_otherwise(ledger: str) -> int:
    with open(ledger, "a") as fh:
        fh.write("attempt\n")
    raise ValueError("a bad row")


def test_oom_retries_retry_only_out_of_memory_as_the_task_runs_own_retries(remote_cluster, tmp_path):
    oom_ledger, other_ledger = tmp_path / "oom", tmp_path / "other"

    @flow(task_runner=GPUDaskTaskRunner(address=remote_cluster.address, oom_retries=1))
    def retried():
        oom = ooms_once.submit(str(oom_ledger))
        other = fails_otherwise.submit(str(other_ledger))
        other.wait()
        return oom.result(), oom.task_run_id, other.state

    attempts, task_run_id, other = retried()
    assert attempts == 2  # one retry, on the same task run
    assert other.is_failed() and len(other_ledger.read_text().splitlines()) == 1  # no retries of its own
    from prefect.client.orchestration import get_client

    run = recorded_task_run(task_run_id)
    with get_client(sync_client=True) as api:
        names = [s.name for s in api.read_task_run_states(task_run_id)]
    assert run.run_count == 2 and run.state.is_completed(), (run.run_count, names)
    assert "Retrying" in names or "AwaitingRetry" in names, names


def test_gpu_workers_advertise_model_and_memory_and_tags_route_on_them(dask_processes):
    from tests.scripted_probe import FAKE_PROBE, TOTAL

    dask_processes.start_scheduler()
    dask_processes.start_worker("gpu-worker", "--nthreads", "2", "--resources", "GPU=1")
    dask_processes.start_worker("cpu-worker", "--nthreads", "2")
    dask_processes.wait_for_workers(2)

    @flow(
        task_runner=GPUDaskTaskRunner(
            address=dask_processes.address, memory_probe=FAKE_PROBE, on_missing_gpu="error", gpu_wait_s=0
        )
    )
    def labelled():
        from prefect.context import get_run_context

        client = get_run_context().task_runner.client
        offered = {w["name"]: w["resources"] for w in client.scheduler_info(n_workers=-1)["workers"].values()}
        with tags("gpu-model:fakegpu"):
            by_model = on_which_worker.submit().result()
        with tags("gpu:0.5", "gpu-mem:8GiB"):
            by_memory = [on_which_worker.submit() for _ in range(4)]
        with tags("gpu-mem:32GiB"):
            too_big = on_which_worker.submit()
            too_big.wait()
        return offered, by_model, [f.result() for f in by_memory], too_big.state

    offered, by_model, by_memory, too_big = labelled()
    assert offered["gpu-worker"] == {"GPU": 1, "GPU-FAKEGPU": 1, "GPU-MEM": TOTAL}, offered
    assert offered["cpu-worker"] == {}, offered
    assert by_model == "gpu-worker" and set(by_memory) == {"gpu-worker"}
    assert too_big.is_failed() and "GPU-MEM" in too_big.message, too_big.message


def test_a_cluster_class_that_sets_a_signal_handler_at_import_is_not_imported_on_workers():
    """Prefect re-creates the runner on each worker, in a worker thread: importing such
    a class there would fail every task run."""

    @flow(
        task_runner=GPUDaskTaskRunner(
            cluster_class="tests.signal_cluster.SignalCluster",
            cluster_kwargs={"n_workers": 1, "threads_per_worker": 1},
        )
    )
    def on_signal_cluster():
        return anywhere.submit(0).result()

    assert on_signal_cluster() == 0  # the one worker's name


def test_a_cluster_passed_in_is_the_one_the_flow_uses():
    from distributed import LocalCluster

    with LocalCluster(
        n_workers=1, threads_per_worker=1, resources={"GPU": 1}, dashboard_address=":0"
    ) as cluster:

        @flow(task_runner=GPUDaskTaskRunner(cluster=cluster))
        def on_given_cluster():
            from prefect.context import get_run_context

            scheduler = get_run_context().task_runner.client.scheduler.address
            return gpu_where.submit(0).result(), scheduler

        name, scheduler = on_given_cluster()
        assert scheduler == cluster.scheduler_address
        assert name in {w.name for w in cluster.workers.values()}


def flow_run_settings_built() -> list[str]:
    """For ``Client.run``: the flow runs' settings and API clients this worker has built."""
    from prefect_gpu_dask.worker import taskrun

    return sorted(key for key in taskrun._worker_cache if key.startswith("settings-"))


def test_workers_build_a_flow_runs_settings_and_client_before_its_first_task_run():
    @flow(task_runner=GPUDaskTaskRunner(cluster_kwargs={"n_workers": 2, "threads_per_worker": 1}))
    def prepared() -> tuple[dict[str, list[str]], dict[str, list[str]]]:
        from prefect.context import FlowRunContext

        client = FlowRunContext.get().task_runner.client
        deadline = time.monotonic() + 30
        built = client.run(flow_run_settings_built)
        while not all(built.values()) and time.monotonic() < deadline:
            time.sleep(0.05)
            built = client.run(flow_run_settings_built)
        [f.result() for f in anywhere.map(range(8))]
        return built, client.run(flow_run_settings_built)

    before, after = prepared()
    assert len(before) == 2
    # Each worker built this flow run's settings and client with no task run yet, and its
    # task runs then used that one: none built a second.
    assert all(len(keys) == 1 for keys in before.values()), before
    assert after == before
