"""Faults and load, on a real Prefect API and real ``dask scheduler``/``dask worker`` processes.

Faults: a worker SIGKILLed mid-task, a task stuck past its timeout, the scheduler
disappearing mid-flow, an unreachable address, a guard-triggered restart while 40 other
tasks run, and a GPU task submitted while the only GPU worker is being recycled. The
load tests are in ``test_load.py``.
"""

from __future__ import annotations

import os
import re
import signal
import time
from collections import Counter
from pathlib import Path

import distributed
import pytest
from distributed import Client
from prefect import flow, task
from prefect.context import FlowRunContext

from prefect_gpu_dask import GPUDaskTaskRunner
from tests.conftest import DaskProcesses, recorded_task_run
from tests.scripted_probe import FAKE_PROBE, leak

MiB = 2**20
DIED = re.compile(r"worker.{0,200}\b(died|dead|killed|lost)\b", re.IGNORECASE | re.DOTALL)


def wait_for_file(path: Path, timeout: float = 60) -> str:
    deadline = time.monotonic() + timeout
    while not path.exists() or not path.read_text():
        if time.monotonic() > deadline:
            raise AssertionError(f"{path} never appeared")
        time.sleep(0.02)
    return path.read_text()


@pytest.fixture
def procs(dask_processes: DaskProcesses):
    return dask_processes


def max_concurrency(spans: list[tuple[float, float]]) -> int:
    """The most intervals open at one instant (an end at t closes before a start at t)."""
    edges = sorted([(start, 1) for start, _ in spans] + [(end, -1) for _, end in spans])
    running = peak = 0
    for _, step in edges:
        running += step
        peak = max(peak, running)
    return peak


def api_state(task_run_id, settled, timeout: float = 20):
    """The task run's state as the API has it, once ``settled(state)`` (events are async)."""
    return recorded_task_run(
        task_run_id, lambda run: run.state is not None and settled(run.state), timeout
    ).state


# -- tasks (module level: they travel to the workers by reference) -----------------


@task(tags=["gpu"])
def long_gpu_task(pidfile: str, ledger: str) -> str:
    """Runs until told to stop (or 60 s): long enough to be killed in the middle."""
    with open(ledger, "a") as fh:
        fh.write(f"{os.getpid()}\n")
    Path(pidfile).write_text(str(os.getpid()))
    stop = Path(pidfile + ".stop")
    for _ in range(600):
        if stop.exists():
            return "stopped"
        time.sleep(0.1)
    return "finished"


@task(tags=["gpu"])
def gpu_square(i: int) -> tuple[int, str]:
    return i * i, str(distributed.get_worker().name)


@task
def cpu_square(i: int) -> tuple[int, str]:
    return i * i, str(distributed.get_worker().name)


# -- 3. faults: a worker killed mid-task --------------------------------------------


def test_worker_killed_mid_task_fails_that_task_run_only(procs: DaskProcesses, tmp_path):
    """The GPU worker is SIGKILLed while a task runs there; its nanny brings it back.
    That task run must end Crashed saying the worker died (not be quietly run a
    second time on the replacement), promptly, and later tasks must still run."""
    address = procs.start_scheduler()
    procs.start_worker("gpu-worker", "--nthreads", "2", "--resources", "GPU=1")
    procs.start_worker("cpu-worker", "--nthreads", "2")
    procs.wait_for_workers(2)
    pidfile, ledger = tmp_path / "pid", tmp_path / "ledger"

    @flow(task_runner=GPUDaskTaskRunner(address=address))
    def killed():
        doomed = long_gpu_task.submit(str(pidfile), str(ledger))
        victim = int(wait_for_file(pidfile))
        os.kill(victim, signal.SIGKILL)
        killed_at = time.monotonic()
        doomed.wait(timeout=20)
        settled_s = time.monotonic() - killed_at
        Path(str(pidfile) + ".stop").write_text("stop")  # a re-run, if any, ends now
        state = doomed.state
        try:
            doomed.result(raise_on_failure=True)
            error = None
        except BaseException as exc:  # noqa: BLE001 - whatever surfaces, it must say why
            error = f"{type(exc).__name__}: {exc}"
        later_gpu = [gpu_square.submit(i) for i in range(4)]
        later_cpu = [cpu_square.submit(i) for i in range(4)]
        return {
            "victim": victim,
            "settled_s": settled_s,
            "state": state,
            "error": error,
            "task_run_id": doomed.task_run_id,
            "later_gpu": [f.result() for f in later_gpu],
            "later_cpu": [f.result() for f in later_cpu],
        }

    start = time.monotonic()
    out = killed()
    flow_s = time.monotonic() - start

    assert flow_s < 60, f"the flow took {flow_s:.1f} s after a worker death"
    assert out["settled_s"] < 20, "the killed task never reached a final state"
    state = out["state"]
    assert state.is_crashed(), state
    assert DIED.search(f"{state.message} {out['error']}"), (state.message, out["error"])
    # The task run was not quietly re-run on the nanny's replacement worker.
    assert wait_for_file(ledger).split() == [str(out["victim"])], "the killed task ran again"
    # The API agrees with the flow.
    recorded = api_state(out["task_run_id"], lambda s: s.is_final())
    assert recorded.is_crashed(), recorded
    # Later work still runs, GPU work on the (restarted) GPU worker.
    assert out["later_gpu"] == [(i * i, "gpu-worker") for i in range(4)]
    assert [r for r, _ in out["later_cpu"]] == [i * i for i in range(4)]


@task(tags=["gpu"])
def dies_as_it_starts(ledger: str) -> None:
    with open(ledger, "a") as fh:
        fh.write(f"{os.getpid()}\n")
    os.kill(os.getpid(), signal.SIGKILL)  # before the API can have heard it was running


def test_a_worker_dying_before_the_api_heard_of_the_run_still_crashes_it_once(procs, tmp_path):
    """Task run states reach Prefect's API as events: a worker killed just after a task
    run started there may leave the API not knowing it ever ran. The scheduler knows
    (the worker said so in its own stream): the run crashes, and is not run again."""
    address = procs.start_scheduler()
    procs.start_worker("gpu-worker", "--nthreads", "2", "--resources", "GPU=1")
    procs.wait_for_workers(1)
    ledger = tmp_path / "ledger"

    @flow(task_runner=GPUDaskTaskRunner(address=address))
    def killed_at_once():
        doomed = dies_as_it_starts.submit(str(ledger))
        doomed.wait(timeout=60)
        return doomed.state, doomed.task_run_id

    state, task_run_id = killed_at_once()
    assert state.is_crashed(), state
    assert DIED.search(state.message), state.message
    assert len(ledger.read_text().splitlines()) == 1, "the task ran again on the replacement"
    assert api_state(task_run_id, lambda s: s.is_final()).is_crashed()


def test_a_worker_dying_before_its_stream_reached_the_scheduler_still_crashes_the_run_once(procs, tmp_path):
    """As above, on a worker whose stream to the scheduler sends once a second: the task
    run's start must reach the scheduler before its function runs, not with the stream's
    next batch, which a process killed meanwhile never sends."""
    address = procs.start_scheduler()
    procs.start_worker(
        "gpu-worker", "--nthreads", "2", "--resources", "GPU=1", "--preload", "tests.slow_worker_stream"
    )
    procs.wait_for_workers(1)
    ledger = tmp_path / "ledger"

    @flow(task_runner=GPUDaskTaskRunner(address=address))
    def killed_at_once():
        doomed = dies_as_it_starts.submit(str(ledger))
        doomed.wait(timeout=90)
        return doomed.state, doomed.task_run_id

    state, _ = killed_at_once()
    assert state.is_crashed(), state
    assert len(ledger.read_text().splitlines()) == 1, "the task ran again on the replacement"


def started_then_killed(ledger: str) -> tuple[str | None, bool]:
    from prefect_gpu_dask.worker.recycling import announce_start

    dead, started_there = announce_start()
    if dead is None:
        with open(ledger, "a") as fh:
            fh.write(f"{os.getpid()}\n")
        time.sleep(0.5)  # the worker's stream carries the start to the scheduler meanwhile
        os.kill(os.getpid(), signal.SIGKILL)
    return dead, started_there


def queued_behind(_: int) -> tuple[str | None, bool]:
    from prefect_gpu_dask.worker.recycling import announce_start

    return announce_start()


def test_task_runs_starting_together_share_one_start_notice_each_answered(procs):
    """Eight threads start tasks at once: the notices that wait while one is on its way
    leave together, and every task run's start reaches the scheduler exactly once."""
    from prefect_gpu_dask.records import STARTED_TOPIC

    address = procs.start_scheduler()
    procs.start_worker("gpu-worker", "--nthreads", "8")
    procs.wait_for_workers(1)
    with Client(address) as client:
        futures = [client.submit(queued_behind, i, pure=False) for i in range(64)]
        assert client.gather(futures) == [(None, False)] * 64
        notices = [msg for _, msg in client.get_events(STARTED_TOPIC)]
    keys = [key for msg in notices for key in msg["keys"]]
    assert sorted(keys) == sorted(f.key for f in futures)
    assert len(notices) < len(keys), "no start notice carried more than one task run"


def test_the_scheduler_tells_a_started_task_from_a_queued_one_on_a_dead_worker(procs, tmp_path):
    from prefect_gpu_dask.scheduler.recycling import InterruptedTasks

    address = procs.start_scheduler()
    procs.start_worker("gpu-worker", "--nthreads", "1", "--resources", "GPU=1")
    procs.wait_for_workers(1)
    with Client(address) as client:
        client.register_plugin(InterruptedTasks())
        [victim] = client.scheduler_info(n_workers=-1)["workers"]
        ledger = str(tmp_path / "ledger")
        started = client.submit(started_then_killed, ledger, resources={"GPU": 1}, pure=False)
        queued = client.submit(queued_behind, 0, resources={"GPU": 1}, pure=False)  # waits for the slot
        assert started.result(timeout=60) == (victim, True)
        assert queued.result(timeout=60) == (victim, False)


@task(tags=["gpu"])
def noted_gpu(ledger: str, label: str) -> int:
    with open(ledger, "a") as fh:
        fh.write(f"{label} {os.getpid()}\n")
    return os.getpid()


def test_results_lost_with_a_killed_worker_are_not_run_again(procs: DaskProcesses, tmp_path):
    """The GPU worker is SIGKILLed holding the results of task runs that ended there,
    whose futures the flow still holds: Dask computes those keys again on the nanny's new
    worker. Each must come back as its run's final state, its body not run a second time."""
    procs.start_scheduler()
    procs.start_worker("gpu-worker", "--nthreads", "1", "--resources", "GPU=1")
    procs.wait_for_workers(1)
    ledger = tmp_path / "ledger"

    @flow(task_runner=GPUDaskTaskRunner(address=procs.address))
    def lost_results():
        done = [noted_gpu.submit(str(ledger), f"done-{i}") for i in range(3)]
        [victim] = {f.result() for f in done}
        os.kill(victim, signal.SIGKILL)
        later = noted_gpu.submit(str(ledger), "later").result(timeout=120)  # on the new worker
        again = [f.wrapped_future.result(timeout=60) for f in done]  # what Dask computed again
        return victim, later, again, [f.state for f in done]

    victim, later, again, states = lost_results()
    assert later != victim
    runs = Counter(line.split()[0] for line in ledger.read_text().splitlines())
    assert runs == {"done-0": 1, "done-1": 1, "done-2": 1, "later": 1}, runs
    assert all(state.is_completed() for state in again), again
    assert all(state.is_completed() for state in states), states


# -- 3. faults: the scheduler disappears mid-flow -----------------------------------


def test_scheduler_death_mid_flow_fails_clearly_and_quickly(procs: DaskProcesses, tmp_path):
    address = procs.start_scheduler()
    procs.start_worker("gpu-worker", "--nthreads", "2", "--resources", "GPU=1")
    procs.wait_for_workers(1)
    scheduler_pid = procs.procs[0].pid
    pidfile, ledger = tmp_path / "pid", tmp_path / "ledger"

    @flow(task_runner=GPUDaskTaskRunner(address=address, client_kwargs={"timeout": "5s"}))
    def orphaned():
        running = long_gpu_task.submit(str(pidfile), str(ledger))
        wait_for_file(pidfile)
        os.kill(scheduler_pid, signal.SIGKILL)
        return running.result()

    start = time.monotonic()
    try:
        state = orphaned(return_state=True)
    finally:
        Path(str(pidfile) + ".stop").write_text("stop")
    elapsed = time.monotonic() - start

    assert state.is_failed(), state
    assert "scheduler" in state.message.lower(), state.message
    # Bounded by the client's 5 s connect timeout, not the default 30 s or forever.
    assert elapsed < 20, f"the flow took {elapsed:.1f} s to notice the scheduler was gone"


def test_scheduler_death_with_default_timeouts_is_bounded(procs: DaskProcesses, tmp_path):
    """No client_kwargs: the flow must still end promptly once its task has failed."""
    address = procs.start_scheduler()
    procs.start_worker("gpu-worker", "--nthreads", "2", "--resources", "GPU=1")
    procs.wait_for_workers(1)
    scheduler_pid = procs.procs[0].pid
    pidfile, ledger = tmp_path / "pid", tmp_path / "ledger"

    @flow(task_runner=GPUDaskTaskRunner(address=address))
    def orphaned():
        running = long_gpu_task.submit(str(pidfile), str(ledger))
        wait_for_file(pidfile)
        os.kill(scheduler_pid, signal.SIGKILL)
        return running.result()

    start = time.monotonic()
    try:
        state = orphaned(return_state=True)
    finally:
        Path(str(pidfile) + ".stop").write_text("stop")
    elapsed = time.monotonic() - start
    assert state.is_failed(), state
    assert "scheduler" in state.message.lower(), state.message
    # The task's error arrives at once; the runner must not then sit out distributed's
    # 30 s reconnect window on its way out (e.g. to publish the GPU memory report).
    assert elapsed < 20, f"the flow took {elapsed:.1f} s to end after the scheduler died"


# -- 3. faults: an unreachable address ----------------------------------------------


def test_unreachable_address_fails_within_the_connect_timeout():
    ran = []

    @task
    def never() -> None:
        ran.append(1)

    @flow(task_runner=GPUDaskTaskRunner(address="tcp://127.0.0.1:1", client_kwargs={"timeout": "3s"}))
    def unreachable():
        return never.submit().result()

    start = time.monotonic()
    state = unreachable(return_state=True)
    elapsed = time.monotonic() - start
    assert state.is_failed(), state
    assert "127.0.0.1:1" in state.message, state.message
    assert re.search(r"connect|timed out", state.message, re.IGNORECASE), state.message
    assert 2.5 < elapsed < 15, elapsed  # it did wait for the timeout, and not much longer
    assert ran == []


# -- 3. faults: a restart while 40 other tasks run ----------------------------------


def note(ledger: str, label: str) -> int:
    with open(ledger, "a") as fh:
        fh.write(f"{label} {os.getpid()}\n")
    return os.getpid()


@task(tags=["gpu"])
def leaky(ledger: str, nbytes: int) -> int:
    """Leaks (so the guard recycles this worker) once a CPU task is running elsewhere."""
    note(ledger, "leaky")
    deadline = time.monotonic() + 60
    while "cpu-" not in Path(ledger).read_text() and time.monotonic() < deadline:
        time.sleep(0.02)
    leak(nbytes)
    return 21


@task(tags=["gpu:0.25"])
def gpu_work(ledger: str, i: int, seconds: float) -> tuple[int, int]:
    pid = note(ledger, f"gpu-{i}")
    time.sleep(seconds)
    return i * i, pid


@task(tags=["cpu"])
def cpu_work(ledger: str, i: int, release: str) -> tuple[int, int]:
    """Holds a CPU-worker thread until the flow has seen the restart (at most 60 s)."""
    pid = note(ledger, f"cpu-{i}")
    deadline = time.monotonic() + 60
    while not Path(release).exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    return i + 1000, pid


@task
def combine(ledger: str, i: int, square: tuple[int, int], plus: tuple[int, int]) -> int:
    note(ledger, f"combine-{i}")
    return square[0] + plus[0]


def test_restart_while_40_tasks_run_loses_none_and_repeats_none(procs: DaskProcesses, tmp_path):
    """A leak recycles the GPU worker while 20 GPU tasks are queued on it and 20 CPU
    tasks hold or wait for the CPU worker; results from before the restart feed tasks
    submitted after it. Every task runs exactly once and returns the right value."""
    procs.start_scheduler()
    procs.start_worker("gpu-worker", "--nthreads", "4", "--resources", "GPU=1")
    procs.start_worker("cpu-worker", "--nthreads", "4", "--resources", "CPU=4")
    procs.wait_for_workers(2)
    address = procs.address
    with Client(address) as client:
        names = {a: w["name"] for a, w in client.scheduler_info(n_workers=-1)["workers"].items()}
        pid_before = {names[a]: pid for a, pid in client.run(os.getpid).items()}
    ledger = str(tmp_path / "ledger")
    release = str(tmp_path / "release")
    n = 20

    runner = GPUDaskTaskRunner(
        address=address, restart="worker", tag_resources={"cpu": {"CPU": 1}}, memory_probe=FAKE_PROBE
    )

    @flow(task_runner=runner)
    def busy():
        runner = FlowRunContext.get().task_runner
        leaked = leaky.submit(ledger, 512 * MiB)  # the GPU worker will be recycled
        gpu = [gpu_work.submit(ledger, i, 0.2) for i in range(n)]
        cpu = [cpu_work.submit(ledger, i, release) for i in range(n)]
        deadline = time.monotonic() + 90
        while not runner.restarts and time.monotonic() < deadline:
            time.sleep(0.05)
        during = {
            "cpu_started": sum(line.startswith("cpu-") for line in Path(ledger).read_text().splitlines()),
            "cpu_done": sum(f.wrapped_future.done() for f in cpu),
        }
        Path(release).write_text("go")
        # Submitted after the restart, depending on results computed before it.
        combined = [combine.submit(ledger, i, gpu[i], cpu[i]) for i in range(n)]
        fresh = [gpu_work.submit(ledger, 100 + i, 0.0) for i in range(5)]
        return {
            "during": during,
            "leaked": leaked.result(),
            "gpu": [f.result() for f in gpu],
            "cpu": [f.result() for f in cpu],
            "combined": [f.result() for f in combined],
            "fresh": [f.result() for f in fresh],
            "restarts": list(runner.restarts),
        }

    start = time.monotonic()
    out = busy()
    elapsed = time.monotonic() - start

    counts = Counter(line.split()[0] for line in Path(ledger).read_text().splitlines())
    expected = (
        {"leaky"}
        | {f"gpu-{i}" for i in range(n)}
        | {f"cpu-{i}" for i in range(n)}
        | {f"combine-{i}" for i in range(n)}
        | {f"gpu-{100 + i}" for i in range(5)}
    )
    assert set(counts) == expected, set(counts) ^ expected
    twice = {label: c for label, c in counts.items() if c != 1}
    assert not twice, f"tasks ran more than once: {twice}"

    [restart] = out["restarts"]
    assert restart.worker_name == "gpu-worker", restart
    assert restart.reason.startswith("leak:"), restart
    assert restart.new_pid != pid_before["gpu-worker"]
    # The CPU worker was busy the whole time the GPU worker was being recycled.
    assert 1 <= out["during"]["cpu_started"] <= 4 and out["during"]["cpu_done"] == 0, out["during"]

    assert out["leaked"] == 21
    assert [r for r, _ in out["gpu"]] == [i * i for i in range(n)]
    assert [r for r, _ in out["cpu"]] == [i + 1000 for i in range(n)]
    assert out["combined"] == [i * i + i + 1000 for i in range(n)]
    assert [r for r, _ in out["fresh"]] == [(100 + i) ** 2 for i in range(5)]
    # The GPU tasks queued behind the leak never started in the leaking process: they
    # ran in its replacement, like the fresh ones; CPU tasks on the CPU worker, which
    # was never restarted.
    assert {pid for _, pid in out["gpu"]} == {restart.new_pid}
    assert {pid for _, pid in out["fresh"]} == {restart.new_pid}
    assert {pid for _, pid in out["cpu"]} == {pid_before["cpu-worker"]}

    assert elapsed < 120, elapsed


@task(tags=["gpu"])
def slow_leak(nbytes: int, delay: float) -> int:
    time.sleep(delay)  # the flow submits nothing meanwhile: its view of the workers ages
    leak(nbytes)
    return os.getpid()


def test_gpu_task_submitted_mid_restart_waits_for_the_gpu_worker(procs: DaskProcesses, tmp_path):
    """A GPU task submitted while the only GPU worker is being recycled must wait for
    its replacement, not fall back to the CPU worker as if there were no GPU."""
    procs.start_scheduler()
    # The replacement registers seconds late: the task is surely submitted while it is away.
    procs.start_worker(
        "gpu-worker", "--nthreads", "2", "--resources", "GPU=1", "--preload", "tests.slow_replacement"
    )
    procs.start_worker("cpu-worker", "--nthreads", "2")
    procs.wait_for_workers(2)
    address = procs.address
    with Client(address) as client:
        names = {a: w["name"] for a, w in client.scheduler_info(n_workers=-1)["workers"].items()}
        pid_before = {names[a]: pid for a, pid in client.run(os.getpid).items()}
    [gpu_address] = [a for a, name in names.items() if name == "gpu-worker"]
    ledger = str(tmp_path / "ledger")

    @flow(task_runner=GPUDaskTaskRunner(address=address, memory_probe=FAKE_PROBE))
    def mid_restart():
        runner = FlowRunContext.get().task_runner
        leaked = slow_leak.submit(512 * MiB, 1.5)
        # Watch the scheduler (with a client of our own) for the old GPU worker to go.
        # Asked directly: ``scheduler_info()`` returns a snapshot that the client's own
        # periodic refresh may have overwritten with an older one.
        with Client(address, set_as_default=False) as watcher:

            def gpu_worker_present() -> bool:
                return watcher.run_on_scheduler(lambda dask_scheduler: gpu_address in dask_scheduler.workers)

            deadline = time.monotonic() + 60
            while time.monotonic() < deadline and gpu_worker_present():
                time.sleep(0.01)
            during = gpu_work.submit(ledger, 0, 0.0)
            removed = not gpu_worker_present()
        deadline = time.monotonic() + 60
        while not runner.restarts and time.monotonic() < deadline:
            time.sleep(0.05)
        return {
            "removed": removed,
            "leaked_pid": leaked.result(),
            "during": during.result(),
            "restarts": list(runner.restarts),
        }

    out = mid_restart()
    [restart] = out["restarts"]
    assert out["leaked_pid"] == pid_before["gpu-worker"]
    assert out["removed"], "the GPU task was not submitted while the GPU worker was away"
    square, pid = out["during"]
    assert square == 0
    assert pid != pid_before["cpu-worker"], "a GPU task submitted mid-restart ran on the CPU worker"
    assert pid == restart.new_pid, (pid, restart)


def test_tasks_queued_on_a_dead_worker_run_on_its_replacement(procs: DaskProcesses, tmp_path):
    """Only the task run that was running when its worker died crashes: the GPU tasks
    queued behind it there never started, and run once on the replacement."""
    procs.start_scheduler()
    procs.start_worker("gpu-worker", "--nthreads", "1", "--resources", "GPU=1")
    procs.wait_for_workers(1)
    pidfile, ledger = tmp_path / "pid", tmp_path / "ledger"

    @flow(task_runner=GPUDaskTaskRunner(address=procs.address))
    def queued():
        doomed = long_gpu_task.submit(str(pidfile), str(ledger))
        victim = int(wait_for_file(pidfile))
        behind = [gpu_square.submit(i) for i in range(3)]  # queued on the only GPU slot
        time.sleep(1.0)
        os.kill(victim, signal.SIGKILL)
        doomed.wait(timeout=60)
        values = [f.result(timeout=60) for f in behind]
        return doomed.state, [f.state for f in behind], values

    doomed, behind_states, behind = queued()
    assert doomed.is_crashed(), doomed
    assert all(state.is_completed() for state in behind_states), behind_states
    assert [value for value, _ in behind] == [0, 1, 4]


@task(timeout_seconds=2)
def blocked_in_c(ledger: str) -> str:
    with open(ledger, "a") as fh:
        fh.write(f"{os.getpid()} {time.time()}\n")
    time.sleep(40)  # outside Python bytecode: Prefect's own timeout lands only after it
    return "finished"


@task
def after_the_hang(i: int) -> int:
    return os.getpid()


def test_a_task_stuck_past_its_timeout_ends_timed_out_once_and_its_worker_is_recycled(
    procs: DaskProcesses, tmp_path
):
    procs.start_scheduler()
    procs.start_worker("worker", "--nthreads", "2")
    procs.wait_for_workers(1)
    ledger = tmp_path / "ledger"
    with Client(procs.address) as client:
        [old_pid] = client.run(os.getpid).values()

    @flow(task_runner=GPUDaskTaskRunner(address=procs.address))
    def nightly():
        stuck = blocked_in_c.submit(str(ledger))
        stuck.wait(timeout=60)
        settled_at = time.time()
        later = [after_the_hang.submit(i).result() for i in range(2)]
        return stuck.state, stuck.task_run_id, settled_at, later

    state, task_run_id, settled_at, later = nightly()
    assert state.name == "TimedOut" and state.is_failed(), state
    assert "exceeded timeout of 2 second(s)" in state.message
    pid, started_at = wait_for_file(ledger).split()
    past_deadline_s = settled_at - (float(started_at) + 2)
    assert past_deadline_s <= 5, f"the flow saw the timeout {past_deadline_s:.1f} s after the deadline"
    recorded = api_state(task_run_id, lambda state: state.is_final())
    assert recorded.name == "TimedOut", recorded
    assert len(ledger.read_text().splitlines()) == 1 and pid == str(old_pid), "the stuck task ran again"
    assert old_pid not in later, "the worker holding the stuck thread was not recycled"
