"""The host cluster's HTTP servers (the scheduler's dashboard and /metrics, each worker's
/metrics) serve only its owner: HTTPS with the cluster's certificate as the client's.
Real processes: the cluster as ``prefect-gpu-dask cluster start`` runs it, plain
``urllib`` clients, and where this runs as root, another OS user (``nobody``)."""

from __future__ import annotations

import http.client
import json
import os
import shutil
import signal
import ssl
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from distributed import Client, Security

from prefect_gpu_dask.host_cluster import FILE_NAME, HostCluster, credential_files, find_host_cluster

ROOT = Path(__file__).resolve().parents[2]
SYSTEM_PYTHON = "/usr/bin/python3"  # readable by any user, unlike a virtual environment under /root
NOBODY = 65534


def cli(runtime: Path, *args: str, timeout: float = 240) -> subprocess.CompletedProcess:
    env = {
        **os.environ,
        "PREFECT_GPU_DASK_RUNTIME_DIR": str(runtime),
        "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
    }
    return subprocess.run(
        [sys.executable, "-m", "prefect_gpu_dask", *args],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


@pytest.fixture(scope="module")
def runtime(tmp_path_factory) -> Iterator[Path]:
    path = tmp_path_factory.mktemp("dashboard") / "runtime"
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("PREFECT_GPU_DASK_RUNTIME_DIR", str(path))
        yield path


@pytest.fixture(scope="module")
def host(runtime) -> Iterator[HostCluster]:
    started = cli(
        runtime, "cluster", "start", "--workers", "1", "--threads-per-worker", "1",
        "--resources", "GPU=1", "--dashboard-address", "127.0.0.1:0",
    )  # fmt: skip
    assert started.returncode == 0, started.stdout + started.stderr
    host = find_host_cluster(runtime)
    assert host is not None
    yield host
    cli(runtime, "cluster", "stop", "--force")
    try:
        os.killpg(host.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def urls(runtime: Path, host: HostCluster) -> dict[str, str]:
    """What another user wants to read: the scheduler's worker list and metrics, each
    worker's metrics (its address from ``cluster status --json``)."""
    shown = cli(runtime, "cluster", "status", "--json")
    assert shown.returncode == 0, shown.stderr
    workers = json.loads(shown.stdout)["workers"]
    assert workers and all(w["http"] and w["http"].startswith("https://127.0.0.1:") for w in workers), workers
    assert host.dashboard and host.dashboard.startswith("https://127.0.0.1:"), host.dashboard
    scheduler = host.dashboard.removesuffix("/status")
    found = {
        "scheduler workers.html": f"{scheduler}/info/main/workers.html",
        "scheduler /metrics": f"{scheduler}/metrics",
    }
    found.update({f"worker {w['name']} /metrics": f"{w['http']}/metrics" for w in workers})
    return found


def read(url: str, cert: Path | None = None, key: Path | None = None, ca: Path | None = None) -> str:
    context = ssl.create_default_context(cafile=str(ca) if ca else None)
    context.check_hostname = False  # the certificate names dask-internal, not 127.0.0.1
    if ca is None:
        context.verify_mode = ssl.CERT_NONE  # a client that trusts any server: not what stops it
    if cert is not None:
        context.load_cert_chain(str(cert), str(key))
    with urllib.request.urlopen(url, context=context, timeout=10) as answer:
        return answer.read().decode(errors="replace")


def refused(url: str, **credentials: Path) -> str | None:
    """Why reading ``url`` failed, or ``None`` if it was read."""
    try:
        read(url, **credentials)
    except (OSError, http.client.HTTPException) as exc:
        return repr(exc)
    return None


def plain(url: str) -> str:
    return "http://" + url.removeprefix("https://")


def assert_owner_only(runtime: Path, host: HostCluster, foreign: tuple[Path, Path]) -> dict[str, str]:
    cert, key = credential_files(runtime)
    found = urls(runtime, host)
    for name, url in found.items():
        assert refused(plain(url)) is not None, f"{name} answered plaintext HTTP"
        assert refused(url) is not None, f"{name} answered an HTTPS client without a certificate"
        assert refused(url, cert=foreign[0], key=foreign[1]) is not None, f"{name} took another certificate"
        body = read(url, cert=cert, key=key, ca=cert)
        if name.endswith("/metrics"):
            assert "dask_" in body, (name, body[:300])
        else:
            assert all(w in body for w in worker_addresses(host)), (name, body[:300])
    return found


def worker_addresses(host: HostCluster) -> list[str]:
    with Client(host.address, security=host.security, timeout=10, set_as_default=False) as client:
        return list(client.scheduler_info(n_workers=-1)["workers"])


@pytest.fixture
def foreign(tmp_path) -> tuple[Path, Path]:
    """Another cluster's certificate and key: a client that has one, but not this one."""
    other = Security.temporary()
    cert, key = tmp_path / "other-cert.pem", tmp_path / "other-key.pem"
    cert.write_text(other.tls_client_cert)
    key.write_text(other.tls_client_key)
    return cert, key


def test_only_the_owner_reads_the_dashboard_and_metrics_also_after_a_restart(runtime, host, foreign):
    cert, key = credential_files(runtime)
    for path in (cert, key, runtime / FILE_NAME):
        assert path.stat().st_mode & 0o777 == 0o600, path
    before = assert_owner_only(runtime, host, foreign)
    # A worker process the nanny starts again gets the same settings and preload.
    with Client(host.address, security=host.security, timeout=10, set_as_default=False) as client:
        client.restart(timeout=120)
    after = assert_owner_only(runtime, host, foreign)
    assert set(after.values()) - set(before.values()), "the worker's HTTP server did not restart"


CAN_BE_ANOTHER_USER = os.geteuid() == 0 and bool(shutil.which("setpriv")) and os.path.exists(SYSTEM_PYTHON)


@pytest.mark.skipif(
    not CAN_BE_ANOTHER_USER,
    reason="needs root, setpriv and a system python to act as another user",
)
def test_another_local_user_reads_nothing(runtime, host):
    found = urls(runtime, host)
    cert, key = credential_files(runtime)
    files = [str(runtime / FILE_NAME), str(cert), str(key)]
    targets = {**found, **{f"{name} (HTTP)": plain(url) for name, url in found.items()}}
    script = f"""
import json, ssl, urllib.request
out = {{}}
for path in {files!r}:
    try:
        open(path).read(1)
        out[path] = "read"
    except OSError as exc:
        out[path] = repr(exc)
context = ssl.create_default_context()
context.check_hostname = False
context.verify_mode = ssl.CERT_NONE
for name, url in {targets!r}.items():
    try:
        with urllib.request.urlopen(url, context=context, timeout=10) as answer:
            out[name] = "read %d: %s" % (answer.status, answer.read(200))
    except Exception as exc:
        out[name] = repr(exc)
print(json.dumps(out))
"""
    ran = subprocess.run(
        ["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups", SYSTEM_PYTHON, "-c", script],
        cwd="/",
        env={"PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert ran.returncode == 0, ran.stderr
    seen = json.loads(ran.stdout)
    assert set(seen) == set(files) | set(targets)
    leaked = {what: how for what, how in seen.items() if how.startswith("read")}
    assert not leaked, leaked
    assert all("Permission" in seen[path] for path in files), seen
    # The same URLs are open to the owner: the refusals above are about who asks.
    assert all(read(url, cert=cert, key=key, ca=cert) for url in found.values())
