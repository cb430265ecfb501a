"""``prefect-gpu-dask``: the operator's commands, in the manner of ``dask`` and ``prefect``.

Exit status: 0 when the command did what it says; 1 when it could not (the message says
why); 2 for a usage error (click's); ``cluster status`` exits 3 when no host cluster
runs (as ``systemctl status`` does for a stopped service).
"""

from __future__ import annotations

import json
import logging
import sys
import time

import click
from dask.utils import format_bytes, format_time

from prefect_gpu_dask.cli import host_cluster
from prefect_gpu_dask.cli.tables import table
from prefect_gpu_dask.host_cluster import find_host_cluster

NOT_RUNNING = 3


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
def main() -> None:
    """GPU Dask for Prefect flows: the operator's commands.

    \b
    Examples:
      prefect-gpu-dask cluster start        # one cluster for every flow run of this user here
      prefect-gpu-dask cluster status       # its workers, GPUs and the flow runs using it
      prefect-gpu-dask cluster stop
      prefect-gpu-dask report FLOW_RUN_ID   # a flow run's GPU records, restarts, quarantines
    """


@main.group()
def cluster() -> None:
    """This user's long-lived host cluster, which flow runs on this host join.

    A runner with no address, cluster or cluster_class joins it when it runs
    (host_cluster=True, the default) instead of starting a cluster of its own, so a
    `gpu` slot holds across every flow run on the host. Only this user can join it:
    every connection is TLS with a certificate kept in a 0600 file.

    \b
    Examples:
      prefect-gpu-dask cluster start
      prefect-gpu-dask cluster start --foreground          # under systemd or another supervisor
      prefect-gpu-dask cluster start --workers 2 --resources GPU=1   # a CPU host, for trials
      prefect-gpu-dask cluster status --json
      prefect-gpu-dask cluster stop --force                # even while flow runs use it
    """


def _serve_options(
    workers: int | None, threads_per_worker: int | None, resources: str, dashboard_address: str
) -> host_cluster.ServeOptions:
    try:
        return host_cluster.ServeOptions(
            workers=workers,
            threads_per_worker=threads_per_worker,
            resources=host_cluster.parse_resources(resources),
            dashboard_address=dashboard_address,
        )
    except ValueError as exc:
        raise click.BadParameter(str(exc)) from None


@cluster.command()
@click.option("--workers", type=int, default=None, help="Workers on a CPU host (a GPU host has one per GPU).")
@click.option("--threads-per-worker", type=int, default=None, help="Threads of each worker.")
@click.option("--resources", default="", help="Extra resources of each worker, e.g. 'GPU=1'.")
@click.option(
    "--dashboard-address", default="127.0.0.1:8787", show_default=True, help="Where the dashboard listens."
)
@click.option("--foreground", is_flag=True, help="Run here until SIGTERM or Ctrl-C (for a service manager).")
def start(
    workers: int | None,
    threads_per_worker: int | None,
    resources: str,
    dashboard_address: str,
    foreground: bool,
) -> None:
    """Start the host cluster (in the background, unless --foreground)."""
    options = _serve_options(workers, threads_per_worker, resources, dashboard_address)
    try:
        if foreground:
            logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
            host_cluster.serve(options)
            return
        host = host_cluster.start(options)
    except host_cluster.HostClusterError as exc:
        raise click.ClickException(str(exc)) from None
    click.echo(f"Host cluster started at {host.address} (pid {host.pid})")
    click.echo(f"  workers: {host.workers}, GPUs: {host.gpus}, dashboard: {host.dashboard}")
    click.echo(f"  log: {host_cluster.log_path()}")


@cluster.command()
@click.option("--json", "as_json", is_flag=True, help="One JSON object, for scripts.")
def status(as_json: bool) -> None:
    """Show the host cluster: workers, GPUs, clients and the flow runs using it."""
    if (host := find_host_cluster()) is None:
        if as_json:
            click.echo(json.dumps({"running": False}))
        else:
            click.echo("No host cluster runs (start one: prefect-gpu-dask cluster start)")
        sys.exit(NOT_RUNNING)
    try:
        found = host_cluster.status(host)
    except OSError as exc:
        raise click.ClickException(
            f"The host cluster at {host.address} (pid {host.pid}) does not answer: {exc}"
        ) from None
    if as_json:
        click.echo(json.dumps({"running": True, **found.to_dict()}, indent=2))
        return
    click.echo(
        f"Host cluster  {host.address}  pid {host.pid}, up {format_time(time.time() - host.started_at)}"
    )
    click.echo(f"Dashboard     {host.dashboard}")
    click.echo(f"Workers       {len(found.workers)}")
    rows = [
        (
            w.name,
            w.address,
            w.gpu or "-",
            format_bytes(w.gpu_memory) if w.gpu_memory else "-",
            f"{w.gpu_slots:g}",
            str(w.threads),
            str(w.running),
        )
        for w in found.workers
    ]
    header = ("NAME", "ADDRESS", "GPU", "GPU MEMORY", "GPU SLOTS", "THREADS", "RUNNING")
    for line in table(header, rows):
        click.echo(line)
    click.echo(
        f"Clients       {len(found.clients)} ({len(found.flow_runs)} flow run(s)), {found.tasks} task(s)"
    )
    for flow_run in found.flow_runs:
        click.echo(f"  flow run {flow_run}")


@cluster.command()
@click.option("--force", is_flag=True, help="Stop it even while flow runs use it (their tasks crash).")
def stop(force: bool) -> None:
    """Stop the host cluster; refused while flow runs use it, unless --force."""
    if (host := find_host_cluster()) is None:
        click.echo("No host cluster runs")
        return
    try:
        host_cluster.stop(host, force=force)
    except host_cluster.HostClusterError as exc:
        raise click.ClickException(str(exc)) from None
    click.echo(f"Stopped the host cluster at {host.address} (pid {host.pid})")


@main.command()
@click.argument("flow_run_id")
@click.option("--json", "as_json", is_flag=True, help="One JSON object, for scripts.")
def report(flow_run_id: str, as_json: bool) -> None:
    """What a flow run did to its GPUs: each task's record, restarts, quarantined GPUs.

    Read from the Prefect API (PREFECT_API_URL), as read_flow_run_gpu_report does: no
    cluster or GPU is needed.

    \b
    Examples:
      prefect-gpu-dask report 4b7c1e2a-...-flow-run-id
      prefect-gpu-dask report 4b7c1e2a-...-flow-run-id --json | jq '.records[] | select(.verdict == "leak")'
    """
    import httpx
    from prefect.exceptions import PrefectException

    from prefect_gpu_dask.cli.report import render, to_dict
    from prefect_gpu_dask.flow.flow_run_report import read_flow_run_gpu_report

    try:
        found = read_flow_run_gpu_report(flow_run_id)
    except ValueError:
        raise click.BadParameter(f"{flow_run_id!r} is not a flow run id (a UUID)") from None
    except (httpx.HTTPError, PrefectException, OSError) as exc:  # the API unreachable or refusing
        raise click.ClickException(
            f"Could not read flow run {flow_run_id} from the Prefect API: {exc}"
        ) from None
    click.echo(json.dumps(to_dict(found), indent=2) if as_json else render(found))


@main.command()
@click.option("--address", default=None, help="Ask a cluster (its scheduler's address) instead of this host.")
@click.option("--tls-ca-file", default=None, help="CA certificate for a tls:// --address.")
@click.option("--tls-cert", default=None, help="Client certificate for a tls:// --address.")
@click.option("--tls-key", default=None, help="Client key for a tls:// --address.")
@click.option("--json", "as_json", is_flag=True, help="One JSON object, for scripts.")
def doctor(
    address: str | None, tls_ca_file: str | None, tls_cert: str | None, tls_key: str | None, as_json: bool
) -> None:
    """Is this host (or the cluster at --address) ready for GPU flows? If not, why, and what to do.

    Checks the NVIDIA driver and CUDA version, each GPU (model, memory, MIG, health),
    CuPy, dask-cuda and cuDF against the driver's CUDA, this user's host cluster, and the
    Prefect API and its database. Exit status 0: GPU flows can run; 1: they cannot (each
    FAIL line says why); 2: bad options.

    \b
    Examples:
      prefect-gpu-dask doctor
      prefect-gpu-dask doctor --json | jq .ready
      prefect-gpu-dask doctor --address tls://gpu-host:8786 --tls-ca-file ca.pem \\
          --tls-cert client.pem --tls-key client-key.pem
    """
    from prefect_gpu_dask.cli.doctor import diagnose, render

    security = None
    if any((tls_ca_file, tls_cert, tls_key)):
        from distributed import Security

        security = Security(
            tls_ca_file=tls_ca_file, tls_client_cert=tls_cert, tls_client_key=tls_key, require_encryption=True
        )
    found = diagnose(address, security)
    click.echo(json.dumps(found.to_dict(), indent=2) if as_json else render(found))
    sys.exit(0 if found.ready else 1)
