"""Prometheus metrics on Dask's own ``/metrics``: a real scheduler's and a real GPU
worker's endpoints, scraped over HTTP after a flow run with a leak, parsed with
``prometheus_client``'s parser."""

from __future__ import annotations

import json
import re
import urllib.request
from pathlib import Path

import pytest
from distributed import Client
from prometheus_client.parser import text_string_to_metric_families

from tests.scripted_probe import FakeDeviceProbe, ScriptedActivity
from tests.ui_helpers import LEAK_BYTES, run_leaking_flow, start_guarded_cluster

ROOT = Path(__file__).resolve().parents[2]


def scrape(port: int) -> dict[str, list]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        text = response.read().decode()
    samples: dict[str, list] = {}
    for family in text_string_to_metric_families(text):
        # A family with nothing to count yet still names itself (HELP and TYPE lines).
        samples.setdefault(family.name + ("_total" if family.type == "counter" else ""), [])
        for sample in family.samples:
            samples.setdefault(sample.name, []).append(sample)
    return samples


def value(samples: dict[str, list], name: str, **labels: str) -> float:
    [found] = [s.value for s in samples[name] if all(s.labels.get(k) == v for k, v in labels.items())]
    return found


def test_scheduler_and_gpu_worker_serve_gpu_metrics_on_their_metrics_endpoints(dask_processes):
    address = start_guarded_cluster(dask_processes)
    result = run_leaking_flow(address, clean_first=2)
    assert result["restarts"]
    with Client(address, set_as_default=False) as client:
        scheduler_port = client.run_on_scheduler(lambda dask_scheduler: dask_scheduler.http_server.port)
        ports = client.run(lambda dask_worker: (dask_worker.name, dask_worker.http_server.port))
    gpu_port = next(port for name, port in ports.values() if name == "gpu-worker")

    cluster = scrape(scheduler_port)
    gpu = FakeDeviceProbe.gpu
    where = {"worker": "gpu-worker", "gpu": gpu.uuid}
    assert value(cluster, "prefect_gpu_dask_task_verdicts_total", verdict="leak", **where) == 1
    assert value(cluster, "prefect_gpu_dask_task_verdicts_total", verdict="clean", **where) >= 3
    assert value(cluster, "prefect_gpu_dask_worker_restarts_total", reason="leak") == 1
    assert value(cluster, "prefect_gpu_dask_gpu_energy_joules_total", flow="gpu-leak-demo", **where) > 0
    assert value(cluster, "prefect_gpu_dask_gpu_seconds_total", flow="gpu-leak-demo", **where) >= 0
    assert value(cluster, "prefect_gpu_dask_gpu_slots", state="offered") == 1
    assert value(cluster, "prefect_gpu_dask_gpu_slots", state="in_use") == 0
    assert value(cluster, "prefect_gpu_dask_gpu_tasks_waiting") == 0
    assert sum(s.value for s in cluster["prefect_gpu_dask_gpu_workers"]) == 1
    assert any(name.startswith("dask_scheduler_") for name in cluster)  # Dask's own, still there

    worker = scrape(gpu_port)  # the replacement worker, after the leak's restart
    labels = {"uuid": gpu.uuid, "gpu": str(gpu.index)}
    assert value(worker, "prefect_gpu_dask_gpu_memory_total_bytes", **labels) == gpu.memory_total
    assert value(worker, "prefect_gpu_dask_gpu_memory_used_bytes", **labels) < LEAK_BYTES  # the leak left
    assert value(worker, "prefect_gpu_dask_gpu_power_watts", **labels) == ScriptedActivity.POWER_W
    assert (
        value(worker, "prefect_gpu_dask_gpu_temperature_celsius", **labels) == ScriptedActivity.TEMPERATURE_C
    )
    assert (
        value(worker, "prefect_gpu_dask_gpu_sm_utilization_ratio", **labels)
        == ScriptedActivity.SM_PERCENT / 100
    )
    assert value(worker, "prefect_gpu_dask_gpu_quarantined", **labels) == 0
    assert any(name.startswith("dask_worker_") for name in worker)  # Dask's own, still there
    # The dashboard in docs/ uses only names these endpoints serve.
    dashboard = json.loads((ROOT / "docs" / "grafana" / "prefect-gpu-dask.json").read_text())
    exprs = [target["expr"] for panel in dashboard["panels"] for target in panel["targets"]]
    used = set(re.findall(r"prefect_gpu_dask_\w+", " ".join(exprs)))
    assert used and used <= set(cluster) | set(worker), used - set(cluster) - set(worker)
    cpu_port = next(port for name, port in ports.values() if name == "cpu-worker")
    assert not any(name.startswith("prefect_gpu_dask") for name in scrape(cpu_port))


def _gpu_in_use(dask_scheduler) -> float:
    return sum(ws.used_resources.get("GPU", 0) for ws in dask_scheduler.workers.values())


def test_labelling_a_worker_while_a_gpu_task_runs_keeps_its_slot_counted(dask_processes):
    """Dask's own ``Worker.set_resources`` zeroes the scheduler's count of the resources
    running tasks use: a GPU labelled mid-task would end at -1 and take two gpu tasks."""
    import time

    from prefect_gpu_dask.settings import RunnerSettings
    from prefect_gpu_dask.worker.labels import GPULabels
    from tests.scripted_probe import FAKE_PROBE

    dask_processes.start_scheduler()
    dask_processes.start_worker("gpu-worker", "--nthreads", "2", "--resources", "GPU=1")
    dask_processes.wait_for_workers(1)
    with Client(dask_processes.address, set_as_default=False) as client:
        running = client.submit(time.sleep, 3, resources={"GPU": 1}, pure=False)
        while not client.processing()[next(iter(client.scheduler_info()["workers"]))]:
            time.sleep(0.05)
        client.register_plugin(GPULabels(RunnerSettings(memory_probe=FAKE_PROBE)), name=GPULabels.name)
        resources = client.run_on_scheduler(
            lambda dask_scheduler: [dict(ws.resources) for ws in dask_scheduler.workers.values()]
        )
        assert "GPU-MEM" in resources[0]
        assert client.run_on_scheduler(_gpu_in_use) == 1
        running.result()
        time.sleep(0.2)
        assert client.run_on_scheduler(_gpu_in_use) == 0


@pytest.mark.gpu
def test_on_a_gpu_the_metrics_are_the_gpus_own():
    from prefect import flow, task
    from prefect.context import FlowRunContext

    from prefect_gpu_dask import GPUDaskTaskRunner

    @task(tags=["gpu"])
    def matmuls(n: int) -> float:
        import cupy

        x = cupy.random.random((4096, 4096))
        for _ in range(n):
            x = x @ x / 4096
        return float(x.sum())

    @flow(task_runner=GPUDaskTaskRunner())
    def night() -> dict:
        [f.result() for f in [matmuls.submit(50) for _ in range(3)]]
        client = FlowRunContext.get().task_runner.client
        scheduler = client.run_on_scheduler(lambda dask_scheduler: dask_scheduler.http_server.port)
        workers = client.run(lambda dask_worker: dask_worker.http_server.port).values()
        return {"cluster": scrape(scheduler), "workers": [scrape(port) for port in workers]}

    found = night()
    cluster = found["cluster"]
    for scraped in (cluster, *found["workers"]):
        for name, samples in sorted(scraped.items()):
            for sample in samples if name.startswith("prefect_gpu_dask") else ():
                print(name, sample.labels, sample.value)
    for worker in found["workers"]:  # one per GPU, each its own GPU's figures
        [total] = worker["prefect_gpu_dask_gpu_memory_total_bytes"]
        assert total.value > 10 * 2**30 and total.labels["model"].startswith("NVIDIA")
        assert worker["prefect_gpu_dask_gpu_power_watts"][0].value > 10
        assert worker["prefect_gpu_dask_gpu_temperature_celsius"][0].value > 0
    uuids = [w["prefect_gpu_dask_gpu_memory_total_bytes"][0].labels["uuid"] for w in found["workers"]]
    assert len(set(uuids)) == len(uuids), uuids
    verdicts = sum(s.value for s in cluster["prefect_gpu_dask_task_verdicts_total"])
    assert verdicts == 3
    assert sum(s.value for s in cluster["prefect_gpu_dask_gpu_energy_joules_total"]) > 0
    assert sum(s.value for s in cluster["prefect_gpu_dask_gpu_workers"]) >= 1
