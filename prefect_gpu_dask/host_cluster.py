"""Where this user's host cluster is, and the certificate that lets only them in.

``prefect-gpu-dask cluster start`` runs one long-lived cluster per user and host, for
every flow run there to join: its ``GPU`` slots then hold across flow runs, and a flow
run joins in a fraction of the time it takes to start a cluster. Its scheduler and
workers speak TLS with a certificate made at start and written, with the address,
to ``host-cluster.json`` in the user's private directory (``private_dir``: mode 0700,
the file 0600). Every connection must present that certificate, so no other user of
the host can join, submit or read. The same goes for the HTTP servers of the scheduler
and of each worker (dashboard, ``/metrics``): they speak HTTPS and take only a client
that presents the certificate, which ``credential_files`` also holds as PEM files for
the owner's browser, ``curl`` or Prometheus. This module is those servers' preload
(``dask_setup``), which makes them ask for it.

``find_host_cluster`` is what a runner with no ``address``, ``cluster`` or
``cluster_class`` calls: the record if the file is there and its process alive, else
``None``. A record whose process has died is stale and is removed by whoever finds
it first: a crash leaves nothing behind that a later flow run would trust.
"""

from __future__ import annotations

import contextlib
import json
import os
import ssl
import stat
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from prefect_gpu_dask.private_dir import private_directory

if TYPE_CHECKING:
    import distributed

FILE_NAME = "host-cluster.json"
# The certificate and its key as PEM files, for HTTPS clients (Prometheus, curl).
CERT_FILE = "host-cluster-cert.pem"
KEY_FILE = "host-cluster-key.pem"
# The name in the certificate (``distributed.Security.temporary``): HTTPS clients that
# check it connect to 127.0.0.1 as this server name.
SERVER_NAME = "dask-internal"
# The preload that makes the cluster's HTTP servers ask for the certificate.
HTTP_PRELOAD = __name__
# The word every host cluster's command line carries, so a reused pid is not taken for it.
COMMAND_MARK = "prefect_gpu_dask"
# Each flow run's Dask client is named so: the scheduler (``cluster status``) tells
# which flow runs use a cluster.
FLOW_RUN_CLIENT = "flow-run-"


def flow_run_of_client(client_id: str) -> str | None:
    """The flow run id in a runner's Dask client id (``<class>-flow-run-<id>-<uuid>``)."""
    _, marker, rest = client_id.partition(f"-{FLOW_RUN_CLIENT}")
    return rest[:36] if marker and len(rest) >= 36 else None


class HostClusterFileError(PermissionError):
    """``host-cluster.json`` is not the user's alone."""


class DashboardNotPrivateError(RuntimeError):
    """A host cluster's HTTP server could not be made to ask for the certificate."""


@dataclass(frozen=True)
class HostCluster:
    """One running host cluster, as its discovery file says."""

    address: str
    pid: int  # the process that owns the scheduler and the workers
    started_at: float  # wall clock
    dashboard: str | None
    workers: int
    gpus: int
    certificate: str  # PEM, self-signed: its own CA, on both ends of the TLS
    key: str  # PEM

    @property
    def security(self) -> distributed.Security:
        """Client side of the cluster's mutual TLS."""
        from distributed import Security

        return Security(
            tls_ca_file=self.certificate,
            tls_client_cert=self.certificate,
            tls_client_key=self.key,
            require_encryption=True,
        )

    def describe(self) -> dict[str, Any]:
        """Everything but the certificate and its key."""
        return {k: v for k, v in asdict(self).items() if k not in ("certificate", "key")}


def discovery_file(directory: Path | None = None) -> Path:
    return (directory or private_directory()) / FILE_NAME


def is_alive(pid: int) -> bool:
    """Whether ``pid`` is a live process of a host cluster (not a reused pid)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return False  # another user's process: not the one that wrote our file
    cmdline = Path(f"/proc/{pid}/cmdline")
    if cmdline.exists():
        with contextlib.suppress(OSError):
            return COMMAND_MARK in cmdline.read_bytes().decode(errors="replace")
    return True


def find_host_cluster(directory: Path | None = None) -> HostCluster | None:
    """The running host cluster of this user, or ``None``; a stale file is removed."""
    path = discovery_file(directory)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except FileNotFoundError:
        return None
    with os.fdopen(fd) as fh:
        info = os.fstat(fh.fileno())
        if info.st_uid != os.getuid() or info.st_mode & 0o077:
            raise HostClusterFileError(
                f"{path} must belong to uid {os.getuid()} with mode 0600 (it is uid {info.st_uid}, "
                f"mode {stat.filemode(info.st_mode)}): not joining the cluster it names; remove it"
            )
        try:
            record = HostCluster(**json.load(fh))
        except (ValueError, TypeError):
            record = None
    if record is None or not is_alive(record.pid):
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
        return None
    return record


def write_host_cluster(record: HostCluster, directory: Path | None = None) -> Path:
    """Publish ``record``: created 0600 under a temporary name, then renamed into place."""
    path = discovery_file(directory)
    partial = path.with_name(f".{FILE_NAME}.{os.getpid()}")
    fd = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "w") as fh:
        json.dump(asdict(record), fh)
    os.replace(partial, path)
    return path


def remove_host_cluster(pid: int, directory: Path | None = None) -> None:
    """Remove the discovery file if it still names ``pid``'s cluster."""
    path = discovery_file(directory)
    with contextlib.suppress(FileNotFoundError, ValueError, TypeError, KeyError):
        if json.loads(path.read_text())["pid"] == pid:
            path.unlink()


def credential_files(directory: Path | None = None) -> tuple[Path, Path]:
    """Where the running host cluster's certificate and key are, as PEM files."""
    directory = directory or private_directory()
    return directory / CERT_FILE, directory / KEY_FILE


def write_credentials(certificate: str, key: str, directory: Path | None = None) -> tuple[Path, Path]:
    """Write the certificate and key (PEM) 0600, each under a temporary name first."""
    paths = credential_files(directory)
    for path, text in zip(paths, (certificate, key)):
        partial = path.with_name(f".{path.name}.{os.getpid()}")
        fd = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
        with os.fdopen(fd, "w") as fh:
            fh.write(text)
        os.replace(partial, path)
    return paths


def remove_credentials(certificate: str, directory: Path | None = None) -> None:
    """Remove the PEM files if they still hold ``certificate`` (not a later cluster's)."""
    cert_path, key_path = credential_files(directory)
    with contextlib.suppress(OSError):
        if cert_path.read_text() == certificate:
            key_path.unlink(missing_ok=True)
            cert_path.unlink()


def dashboard_tls_config(cert_path: Path, key_path: Path) -> dict[str, str]:
    """Dask's settings for HTTPS on the scheduler's and the workers' HTTP servers, with
    the certificate as the only CA whose clients ``dask_setup`` lets in."""
    return {
        "distributed.scheduler.dashboard.tls.cert": str(cert_path),
        "distributed.scheduler.dashboard.tls.key": str(key_path),
        "distributed.scheduler.dashboard.tls.ca-file": str(cert_path),
    }


async def dask_setup(server: Any) -> None:
    """Preload of the host cluster's scheduler and workers: their HTTP server takes only
    clients with a certificate its CA signed.

    Dask serves the dashboard over HTTPS (``dashboard_tls_config``) but does not ask
    clients for a certificate. This runs as the server starts, before its event loop
    accepts a connection; one accepted before (none, as distributed starts today) is
    closed. Where the server is not HTTPS, its HTTP server is stopped rather than left
    open, and the error says so.
    """
    http_server = getattr(server, "http_server", None)
    context = getattr(http_server, "ssl_options", None)
    if not isinstance(context, ssl.SSLContext):
        if http_server is not None:
            http_server.stop()
        raise DashboardNotPrivateError(
            f"The HTTP server of {type(server).__name__} {getattr(server, 'address', '')} does not "
            f"speak TLS (ssl_options {context!r}): stopped it, so its dashboard and /metrics are off"
        )
    context.verify_mode = ssl.CERT_REQUIRED
    assert http_server is not None  # its ssl_options were read
    await http_server.close_all_connections()
