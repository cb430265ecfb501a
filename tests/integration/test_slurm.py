"""GPU flows on a real single-node Slurm through dask-jobqueue's ``SLURMCluster``.

CI starts Slurm with ``.ci/slurm/start`` (slurmctld and slurmd on 127.0.0.1, two stand-in
GPUs as ``gres/gpu``). The tests marked ``slurm`` skip where ``sinfo`` is missing or no
partition with ``gres/gpu`` answers; the two trap tests at the end need dask-jobqueue only.
Each job runs one worker (``--gres=gpu:1``, labelled ``GPU=1``); the scheduler runs in this
process, as a flow run's would. Times go to the test's output (``-s``) for docs/clusters.md.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path
from uuid import uuid4

import pytest
from prefect import flow, task
from prefect.context import FlowRunContext
from prefect.states import State

from prefect_gpu_dask import GPUDaskTaskRunner, read_flow_run_gpu_report
from prefect_gpu_dask.records import LEAK
from tests.scripted_probe import FAKE_PROBE, leak

ROOT = Path(__file__).resolve().parents[2]
MiB = 2**20


def slurm_missing() -> str | None:
    """Why the slurm tests cannot run here; None where a Slurm with gres/gpu answers."""
    if shutil.which("sinfo") is None or shutil.which("sbatch") is None:
        return "no Slurm here (sinfo/sbatch missing): .ci/slurm/start starts one"
    # Without a configuration sinfo would ask DNS for a controller: nothing leaves the machine.
    conf = os.environ.get("SLURM_CONF", "/etc/slurm/slurm.conf")
    if not os.path.exists(conf):
        return f"no Slurm configured here ({conf} missing): .ci/slurm/start starts one"
    try:
        out = subprocess.run(["sinfo", "-h", "-o", "%a %G"], capture_output=True, text=True, timeout=10)
    except subprocess.TimeoutExpired:
        return "sinfo does not answer within 10 s"
    if out.returncode != 0:
        return f"Slurm does not answer: {out.stderr.strip().splitlines()[-1:]}"
    if not any(line.startswith("up") and "gpu" in line for line in out.stdout.splitlines()):
        return f"no partition up with gres/gpu: {out.stdout.strip()!r}"
    # Not imported here: the workers import this module (its tasks) off their main thread,
    # where dask-jobqueue's import fails (it sets a SIGINT handler).
    if importlib.util.find_spec("dask_jobqueue") is None:
        return "dask-jobqueue is not installed (pip install -e .[test])"
    return None


SKIP = slurm_missing()
needs_jobqueue = pytest.mark.skipif(
    importlib.util.find_spec("dask_jobqueue") is None, reason="dask-jobqueue is not installed"
)


def node_memory_mb() -> int:
    out = subprocess.run(["sinfo", "-h", "-o", "%m"], capture_output=True, text=True, timeout=10).stdout
    return min(int(re.sub(r"\D", "", v) or 0) for v in out.split())


def node_gpus() -> int:
    """GPUs (gres/gpu) of the node, as sinfo says: ``gpu:ci:2`` -> 2."""
    out = subprocess.run(["sinfo", "-h", "-o", "%G"], capture_output=True, text=True, timeout=10).stdout
    return max((int(n) for n in re.findall(r"gpu(?::[^:,(\s]+)?:(\d+)", out)), default=0)


def slurm_kwargs(log_dir: Path, **extra) -> dict:
    """The runner's cluster_kwargs: one worker per job on one GPU, all on 127.0.0.1."""
    memory_mb = max(256, min(2000, node_memory_mb() // 2))  # two jobs fit the node
    return {
        "cores": 1,
        "processes": 1,
        "memory": f"{memory_mb}MB",
        "job_extra_directives": ["--gres=gpu:1"],
        "worker_extra_args": ["--resources", "GPU=1"],
        "job_name": f"pgd-{uuid4().hex[:8]}",
        "interface": "lo",
        "scheduler_options": {"dashboard_address": "127.0.0.1:0"},
        "log_directory": str(log_dir),
        # The workers import this module's tasks and the scripted probe from the checkout.
        "job_script_prologue": [f"cd {ROOT}"],
        "python": sys.executable,
        **extra,
    }


def squeue(job_name: str) -> list[tuple[str, str]]:
    """(job id, state) of this test's jobs still known to Slurm's queue."""
    out = subprocess.run(
        ["squeue", "-h", "-n", job_name, "-o", "%i %T"], capture_output=True, text=True, timeout=10
    ).stdout
    return [tuple(line.split()) for line in out.splitlines() if line.strip()]


def job_info(job_id: str) -> str:
    return subprocess.run(["scontrol", "show", "job", job_id], capture_output=True, text=True).stdout


@task(tags=["gpu"])
def where(ledger: str, label: str, seconds: float = 0.0) -> dict:
    """Notes this run in ``ledger`` (one line per execution), then sleeps ``seconds``."""
    from distributed import get_worker

    info = {
        "label": label,
        "job": os.environ.get("SLURM_JOB_ID"),
        "job_gpus": os.environ.get("SLURM_JOB_GPUS"),
        "cuda_visible": os.environ.get("CUDA_VISIBLE_DEVICES"),
        "resources": dict(get_worker().state.total_resources),
        "pid": os.getpid(),
    }
    with open(ledger, "a") as fh:
        fh.write(json.dumps(info) + "\n")
    time.sleep(seconds)
    return info


def executions(ledger: str, label: str) -> list[dict]:
    lines = Path(ledger).read_text().splitlines() if Path(ledger).exists() else []
    return [info for info in map(json.loads, lines) if info["label"] == label]


def wait_started(ledger: str, label: str, timeout: float = 120) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if runs := executions(ledger, label):
            return runs[0]
        time.sleep(0.1)
    raise AssertionError(f"{label} never started")


def on_gpu_job(info: dict) -> bool:
    return bool(info["job"]) and bool(info["job_gpus"]) and info["resources"] == {"GPU": 1}


@pytest.mark.slurm
@pytest.mark.skipif(SKIP is not None, reason=SKIP or "")
def test_gpu_tasks_wait_for_the_first_job_of_an_adaptive_cluster_from_zero(tmp_path):
    ledger = str(tmp_path / "ledger")
    kwargs = slurm_kwargs(tmp_path / "jobs")
    runner = GPUDaskTaskRunner(
        cluster_class="dask_jobqueue.SLURMCluster",
        cluster_kwargs=kwargs,
        adapt_kwargs={"minimum": 0, "maximum": 2},
        gpu_wait_s=120,
    )

    @flow(task_runner=runner)
    def from_zero() -> dict:
        assert squeue(kwargs["job_name"]) == [], "a job ran before any task was submitted"
        began = time.monotonic()
        futures = [where.submit(ledger, f"t{i}") for i in range(4)]
        futures[0].result()
        first_s = time.monotonic() - began
        infos = [f.result() for f in futures]
        return {"infos": infos, "first_s": first_s, "all_s": time.monotonic() - began}

    began = time.monotonic()
    out = from_zero()
    print(
        f"\nfrom zero: first task {out['first_s']:.1f} s, 4 tasks {out['all_s']:.1f} s, "
        f"flow {time.monotonic() - began:.1f} s, jobs {sorted({i['job'] for i in out['infos']})}"
    )
    assert all(on_gpu_job(info) for info in out["infos"]), out["infos"]
    assert all(info["cuda_visible"] == info["job_gpus"] for info in out["infos"]), out["infos"]
    assert out["first_s"] < 120  # within gpu_wait_s
    for i in range(4):
        assert len(executions(ledger, f"t{i}")) == 1
    job = out["infos"][0]["job"]
    assert re.search(r"TresPerNode=\S*gpu:1", job_info(job)) or not job_info(job), job_info(job)


def end_a_job_under_a_task(tmp_path, end_job, **cluster_extra) -> dict:
    """A flow on a SLURMCluster (minimum 1, maximum 2): one task, then one that runs until
    ``end_job(job_id)`` ends its job, then one more. The middle one's state and the times."""
    ledger = str(tmp_path / "ledger")
    kwargs = slurm_kwargs(tmp_path / "jobs", **cluster_extra)
    runner = GPUDaskTaskRunner(
        cluster_class="dask_jobqueue.SLURMCluster",
        cluster_kwargs=kwargs,
        adapt_kwargs={"minimum": 1, "maximum": 2},
        gpu_wait_s=120,
    )

    @flow(task_runner=runner)
    def goes_on() -> dict:
        before = where.submit(ledger, "before").result()
        long = where.submit(ledger, "long", 600)
        job = wait_started(ledger, "long")["job"]
        began = time.monotonic()
        end_job(job)
        state: State = long.wait() or long.state
        crashed_s = time.monotonic() - began
        after = where.submit(ledger, "after").result()
        return {
            "before": before,
            "job": job,
            "state": state,
            "crashed_s": crashed_s,
            "after_s": time.monotonic() - began,
            "after": after,
        }

    flow_state = goes_on(return_state=True)
    assert flow_state.is_completed(), flow_state
    out = flow_state.result()
    assert len(executions(ledger, "long")) == 1, "the task on the ended job ran again"
    assert out["state"].is_crashed(), out["state"]
    assert "died while running this task run" in out["state"].message
    assert on_gpu_job(out["after"]) and out["after"]["job"] != out["job"]
    return out


@pytest.mark.slurm
@pytest.mark.skipif(SKIP is not None, reason=SKIP or "")
def test_a_job_cancelled_mid_task_crashes_that_task_run_once_and_the_flow_goes_on(tmp_path):
    out = end_a_job_under_a_task(tmp_path, lambda job: subprocess.run(["scancel", job], check=True))
    print(
        f"\nscancel: Crashed after {out['crashed_s']:.1f} s, next task done on a new job "
        f"{out['after_s']:.1f} s after the scancel"
    )


@pytest.mark.slurm
@pytest.mark.skipif(SKIP is not None, reason=SKIP or "")
def test_a_job_reaching_its_walltime_mid_task_crashes_that_task_run_once(tmp_path):
    # One minute is Slurm's shortest limit; slurmctld checks limits every 30 s or so.
    # --mem-per-gpu beside SLURMCluster's own --mem: the runner leaves --mem out.
    started: dict[str, float] = {}

    def note(job: str) -> None:
        assert "TimeLimit=00:01:00" in job_info(job), job_info(job)
        started["at"] = time.monotonic()

    out = end_a_job_under_a_task(
        tmp_path,
        note,
        walltime="00:01:00",
        job_extra_directives=["--gres=gpu:1", "--mem-per-gpu=500M"],
    )
    print(
        f"\nwalltime: Crashed {out['crashed_s']:.1f} s after the task started on a 1-minute job, "
        f"next task done on a new job {out['after_s']:.1f} s after"
    )
    assert out["crashed_s"] >= 20  # the job's limit ended it, not something earlier


def sbatch_example() -> str:
    """docs/clusters.md's sbatch script of a long-lived GPU cluster."""
    blocks = re.findall(r"```bash\n(.*?)```", (ROOT / "docs" / "clusters.md").read_text(), re.S)
    [script] = [b for b in blocks if "#SBATCH -J dask-gpu" in b]
    return script


def make_tls(directory: Path) -> None:
    """The docs' own recipe: a CA, a node certificate and a client certificate."""
    key = "-newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes -days 1".split()

    def openssl(*args: str) -> None:
        subprocess.run(["openssl", *args], cwd=directory, check=True, capture_output=True)

    openssl("req", "-x509", *key, "-subj", "/CN=dask-ca", "-keyout", "ca-key.pem", "-out", "ca.pem")
    for name in ("node", "client"):
        openssl("req", *key, "-subj", f"/CN=dask-{name}", "-keyout", f"{name}-key.pem", "-out", f"{name}.csr")
        signed = ["-CA", "ca.pem", "-CAkey", "ca-key.pem", "-CAcreateserial", "-days", "1"]
        openssl("x509", "-req", "-in", f"{name}.csr", *signed, "-out", f"{name}.pem")


@pytest.mark.slurm
@pytest.mark.skipif(SKIP is not None or shutil.which("openssl") is None, reason=SKIP or "no openssl")
def test_the_docs_sbatch_cluster_serves_gpu_tasks_to_a_flow_joining_by_address(tmp_path):
    from distributed import Security

    make_tls(tmp_path)
    script = tmp_path / "gpu-cluster.sbatch"
    # Here: no CUDA (plain workers stand in for dask cuda worker's one per GPU), loopback.
    gpus = min(2, node_gpus())
    script.write_text(sbatch_example().replace("127.0.0.1:8787", "127.0.0.1:0"))
    env = {
        **os.environ,
        "NET": "lo",
        "TLS": str(tmp_path),
        "WORKER": f"dask worker --nworkers {gpus}",
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
    }
    # This node's size, given on the command line over the script's own #SBATCH lines.
    began = time.monotonic()
    sbatch = ["sbatch", "--parsable", "-N", "1", f"--gres=gpu:{gpus}", "--cpus-per-task=2", "-t", "10"]
    sbatch += [f"--mem={max(256, node_memory_mb() // 2)}M", "-o", "job.out", str(script)]
    job = subprocess.run(
        sbatch, cwd=tmp_path, env=env, capture_output=True, text=True, check=True
    ).stdout.strip()
    try:
        scheduler_file = tmp_path / f"dask-{job}.json"
        deadline = time.monotonic() + 120
        while not scheduler_file.exists() and time.monotonic() < deadline:
            time.sleep(0.2)
        assert scheduler_file.exists(), f"job {job} never started its scheduler: {job_info(job)}"
        address = json.loads(scheduler_file.read_text())["address"]
        assert address.startswith("tls://127.0.0.1:"), address
        security = Security(
            tls_ca_file=str(tmp_path / "ca.pem"),
            tls_client_cert=str(tmp_path / "client.pem"),
            tls_client_key=str(tmp_path / "client-key.pem"),
            require_encryption=True,
        )
        ledger = str(tmp_path / "ledger")

        @flow(task_runner=GPUDaskTaskRunner(address=address, security=security, gpu_wait_s=120))
        def joins() -> list[dict]:
            return [f.result() for f in [where.submit(ledger, f"t{i}") for i in range(4)]]

        infos = joins()
        print(f"\nsbatch cluster: 4 gpu tasks done {time.monotonic() - began:.1f} s after sbatch")
    finally:
        subprocess.run(["scancel", job], check=False)
    assert {info["job"] for info in infos} == {job}
    assert all(info["resources"] == {"GPU": 1} and info["job_gpus"] for info in infos), infos
    # The step has all of the job's GPUs.
    assert all(len(info["cuda_visible"].split(",")) == gpus for info in infos), infos


@pytest.fixture(scope="module")
def slurm_cluster(tmp_path_factory):
    """One SLURMCluster of one job that several flow runs share (address=...)."""
    from dask_jobqueue import SLURMCluster
    from distributed import Client

    began = time.monotonic()
    cluster = SLURMCluster(**slurm_kwargs(tmp_path_factory.mktemp("jobs")))
    cluster.scale(1)
    with Client(cluster) as client:
        client.wait_for_workers(1, timeout=120)
    print(f"\nshared SLURMCluster: 1 job's worker up in {time.monotonic() - began:.1f} s")
    try:
        yield cluster
    finally:
        cluster.close()


@task(tags=["gpu"])
def keep(nbytes: int) -> dict:
    leak(nbytes)  # the scripted probe's "device memory", held in a global
    return {"job": os.environ.get("SLURM_JOB_ID"), "pid": os.getpid()}


@task(tags=["gpu"])
def job_and_pid() -> dict:
    return {"job": os.environ.get("SLURM_JOB_ID"), "pid": os.getpid()}


def keeping(address: str, threshold: str) -> tuple[dict, dict, object]:
    @flow(task_runner=GPUDaskTaskRunner(address=address, memory_probe=FAKE_PROBE, leak_threshold=threshold))
    def keeps() -> tuple[dict, dict]:
        kept = keep.submit(512 * MiB).result()
        runner = FlowRunContext.get().task_runner
        deadline = time.monotonic() + 60
        while not runner.restarts and time.monotonic() < deadline and threshold == "256MiB":
            time.sleep(0.2)
        return kept, job_and_pid.submit().result()

    state = keeps(return_state=True)
    assert state.is_completed(), state
    kept, after = state.result()
    return kept, after, read_flow_run_gpu_report(state.state_details.flow_run_id)


@pytest.mark.slurm
@pytest.mark.skipif(SKIP is not None, reason=SKIP or "")
def test_flow_runs_on_one_slurm_cluster_keep_their_settings_and_a_leak_restarts_the_worker_in_its_job(
    slurm_cluster,
):
    address = slurm_cluster.scheduler_address
    # The lenient flow run reaches the cluster first: its guard plugin is the one registered.
    _, lenient_after, lenient = keeping(address, "2GiB")
    began = time.monotonic()
    kept, after, strict = keeping(address, "256MiB")
    took = time.monotonic() - began
    print(f"\nleak on a Slurm job: the flow run with the leak and the restart took {took:.1f} s")
    [lenient_record] = [r for r in lenient.records if r.task_name == "keep"]
    [strict_record] = [r for r in strict.records if r.task_name == "keep"]
    assert lenient_record.verdict != LEAK and not lenient.restarts
    assert strict_record.verdict == LEAK, strict_record
    assert [r.outcome for r in strict.restarts] == ["replaced"]
    # The nanny restarted the worker process inside the same Slurm job: no new job.
    assert kept["job"] == after["job"] == lenient_after["job"]
    assert after["pid"] != kept["pid"]
    assert [job for job, _ in squeue(slurm_cluster.job_name)] == [kept["job"]]


@pytest.mark.slurm
@pytest.mark.skipif(SKIP is not None, reason=SKIP or "")
def test_doctor_reports_the_gpu_workers_and_their_slurm_jobs(slurm_cluster, prefect_api):
    address = slurm_cluster.scheduler_address
    began = time.monotonic()
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "prefect_gpu_dask",
            "doctor",
            "--address",
            address,
            "--json",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PREFECT_API_URL": prefect_api},
    )
    print(f"\ndoctor --address on the SLURMCluster: {time.monotonic() - began:.1f} s")
    report = json.loads(out.stdout)
    assert report["ready"], out.stdout
    [job] = [job for job, _ in squeue(slurm_cluster.job_name)]
    workers = [f for f in report["findings"] if f["area"].startswith("worker ")]
    assert len(workers) == 1 and workers[0]["gpu_ready"], workers
    assert f"slurm job {job}, GPUs " in workers[0]["detail"], workers
    assert any(f["detail"] == f"1 batch job(s): slurm {job}" for f in report["findings"]), report


# -- the traps, without Slurm ----------------------------------------------------------

OFF_MAIN_THREAD = """
import sys, threading
from prefect_gpu_dask import GPUDaskTaskRunner
from prefect_gpu_dask.flow.cluster import resolve_cluster_class

def in_thread():
    runner = GPUDaskTaskRunner(cluster_class="dask_jobqueue.SLURMCluster")  # as a deployment's load does
    assert "dask_jobqueue" not in sys.modules
    try:
        resolve_cluster_class(runner.cluster_class)  # a cluster started off the main thread
    except ValueError as exc:
        print("ERROR", exc)

thread = threading.Thread(target=in_thread)
thread.start()
thread.join()
print("MAIN", resolve_cluster_class("dask_jobqueue.SLURMCluster").__name__)
"""


@needs_jobqueue
def test_a_runner_made_off_the_main_thread_imports_dask_jobqueue_only_as_its_cluster_starts():
    out = subprocess.run(
        [sys.executable, "-c", OFF_MAIN_THREAD], capture_output=True, text=True, timeout=120, cwd=ROOT
    )
    assert out.returncode == 0, out.stderr
    error, main = out.stdout.strip().splitlines()[-2:]
    assert error.startswith("ERROR cluster_class='dask_jobqueue.SLURMCluster' cannot be imported in thread")
    assert "only in the main thread" in error and "`import dask_jobqueue`" in error
    assert main == "MAIN SLURMCluster"


@needs_jobqueue
def test_mem_per_gpu_leaves_slurmclusters_own_mem_out(caplog):
    import logging

    from dask_jobqueue import SLURMCluster

    from prefect_gpu_dask.jobqueue import slurm_cluster_kwargs

    given = {"cores": 1, "memory": "2GB", "job_extra_directives": ["--gres=gpu:1", "--mem-per-gpu=8G"]}
    with caplog.at_level(logging.INFO):
        kwargs = slurm_cluster_kwargs(SLURMCluster, given, logging.getLogger("test"))
    assert "--mem-per-gpu=8G" in caplog.text and "--mem is left out" in caplog.text
    assert kwargs["job_directives_skip"] == ["--mem"] and "job_directives_skip" not in given
    loopback = {"host": "127.0.0.1", "dashboard_address": ":0"}
    with SLURMCluster(**kwargs, scheduler_options=loopback) as cluster:
        script = cluster.job_script()
    assert "#SBATCH --mem-per-gpu=8G" in script and "--mem=" not in script, script
    assert "--memory-limit 1.86GiB" in script  # the worker's limit still comes from memory
    # Without a per-GPU or per-CPU request, nothing changes.
    plain = {"memory": "2GB", "job_extra_directives": ["--gres=gpu:1"]}
    assert slurm_cluster_kwargs(SLURMCluster, plain, logging.getLogger("test")) == plain
