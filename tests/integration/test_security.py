"""Bad input and access control, on a real Prefect API and real Dask processes.

* every constructor argument is validated up front, with a ValueError naming the bad value;
* plaintext ``tcp://`` to a non-loopback host is refused unless ``allow_insecure=True``;
* ``tls://`` with a ``distributed.Security`` works end to end against a real TLS scheduler
  and worker (certificates generated here, in ``tmp_path``), and that scheduler refuses
  plaintext and certificate-less clients;
* the default local cluster listens on 127.0.0.1 only, judged from the sockets the
  scheduler, nanny and worker processes actually have open.
"""

from __future__ import annotations

import dataclasses
import datetime
import ipaddress
import os
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import distributed
import psutil
import pytest
from dask.utils import parse_bytes
from distributed import Client, Security
from prefect import flow, task
from prefect.context import FlowRunContext

from prefect_gpu_dask import GPUDaskTaskRunner, RunnerSettings
from tests.conftest import DaskProcesses

# -- 1. bad input -------------------------------------------------------------------

# (keyword arguments, text the error must contain: the bad value as the user wrote it)
BAD_ARGUMENTS = [
    ({"on_missing_gpu": "gpu"}, "'gpu'"),
    ({"on_missing_gpu": None}, "None"),
    ({"on_missing_gpu": "CPU"}, "'CPU'"),
    ({"restart": "sometimes"}, "'sometimes'"),
    ({"restart": True}, "True"),
    ({"guard": "on"}, "'on'"),
    ({"guard": ""}, "''"),
    ({"leak_threshold": "lots"}, "'lots'"),
    ({"leak_threshold": "12 parsecs"}, "'12 parsecs'"),
    ({"leak_threshold": None}, "None"),
    ({"leak_threshold": -5}, "-5"),
    ({"leak_threshold": 0}, "0"),
    ({"leak_threshold": "-1MiB"}, "'-1MiB'"),
    ({"leak_threshold": True}, "True"),
    ({"memory_limit": 0}, "0"),
    ({"memory_limit": 0.0}, "0.0"),
    ({"memory_limit": -0.5}, "-0.5"),
    ({"memory_limit": 1.01}, "1.01"),
    ({"memory_limit": 90}, "90"),
    ({"memory_limit": float("nan")}, "nan"),
    ({"memory_limit": "0.5"}, "'0.5'"),
    ({"memory_limit": None}, "None"),
    ({"restart_after_tasks": 0}, "0"),
    ({"restart_after_tasks": -3}, "-3"),
    ({"restart_after_tasks": 2.5}, "2.5"),
    ({"restart_after_tasks": "10"}, "'10'"),
    ({"tag_resources": {"nvme": {"NVME": -1}}}, "-1"),
    ({"tag_resources": {"nvme": {"NVME": 0}}}, "0"),
    ({"tag_resources": {"nvme": {"NVME": "one"}}}, "'one'"),
    ({"tag_resources": {"nvme": {"NVME": None}}}, "None"),
    ({"tag_resources": {"nvme": {"NVME": float("inf")}}}, "inf"),
    ({"tag_resources": {"nvme": {"NVME": True}}}, "True"),
    ({"tag_resources": {"nvme": {"NVME": -0.5}, "ok": {"OK": 1}}}, "-0.5"),
    ({"tag_resources": {"nvme": 3}}, "3"),
    ({"tag_resources": {"nvme": {}}}, "{}"),
    ({"tag_resources": ["nvme"]}, "['nvme']"),
    ({"tag_resources": {"gpu": {"GPU": 2}}}, "'gpu'"),
    ({"address": "http://x:8786"}, "http://x:8786"),
    ({"address": "https://scheduler:8786"}, "https://scheduler:8786"),
    ({"address": "foo://"}, "foo://"),
    ({"address": "foo://127.0.0.1:8786"}, "foo://127.0.0.1:8786"),
    ({"address": "tcp+tls://127.0.0.1:8786"}, "tcp+tls://127.0.0.1:8786"),
    ({"security": "tls"}, "'tls'"),
]


@pytest.mark.parametrize(
    "kwargs, named", BAD_ARGUMENTS, ids=[f"{next(iter(k))}={v}" for k, v in BAD_ARGUMENTS]
)
def test_bad_arguments_fail_in_the_constructor_naming_the_value(kwargs, named):
    with pytest.raises(ValueError) as info:
        GPUDaskTaskRunner(**kwargs)
    assert named in str(info.value), str(info.value)
    assert next(iter(kwargs)) in str(info.value) or "address" in str(info.value), str(info.value)


GOOD_ARGUMENTS = [
    {"on_missing_gpu": "cpu"},
    {"on_missing_gpu": "error"},
    {"restart": "worker"},
    {"restart": "cluster"},
    {"restart": "never"},
    {"guard": "gpu"},
    {"guard": "all"},
    {"guard": "off"},
    {"leak_threshold": "1GiB"},
    {"leak_threshold": 1},
    {"memory_limit": 1},
    {"memory_limit": 0.01},
    {"restart_after_tasks": 1},
    {"restart_after_tasks": None},
    {"tag_resources": {"nvme": {"NVME": 0.5, "DISK": 2}}},
    {"address": "tcp://127.0.0.1:8786"},
    {"address": "127.0.0.1:8786"},
    {"address": "tls://10.0.0.5:8786"},
    {"address": "inproc://10.0.0.5/1/2"},
]


@pytest.mark.parametrize("kwargs", GOOD_ARGUMENTS, ids=str)
def test_good_arguments_are_accepted(kwargs):
    """The validation is not a blanket refusal: the documented values construct."""
    runner = GPUDaskTaskRunner(**kwargs)
    name, value = next(iter(kwargs.items()))
    if name == "tag_resources":
        assert runner.router.resources_for_tags({"nvme"}) == {"NVME": 0.5, "DISK": 2.0}
    elif name == "leak_threshold":
        assert runner.settings.leak_threshold == (parse_bytes(value) if isinstance(value, str) else value)
    elif name in {f.name for f in dataclasses.fields(RunnerSettings)}:
        assert getattr(runner.settings, name) == value
    else:
        assert getattr(runner, name) == value


@pytest.mark.parametrize("tag", ["gpu:abc", "gpu:-1", "gpu:0", "gpu:", "gpu:nan", "gpu:inf"])
def test_malformed_gpu_tags_fail_at_submit_naming_the_tag(tag):
    ran = []

    @task(tags=[tag])
    def tagged() -> None:
        ran.append(1)

    @flow(
        task_runner=GPUDaskTaskRunner(
            cluster_kwargs={"n_workers": 1, "threads_per_worker": 1, "processes": False}
        )
    )
    def submit_it():
        tagged.submit()

    with pytest.raises(ValueError) as info:
        submit_it()
    assert repr(tag) in str(info.value)
    assert ran == []


# -- 2. access: plaintext to remote hosts -------------------------------------------

REMOTE_PLAINTEXT = [
    "tcp://10.0.0.5:8786",
    "10.0.0.5:8786",  # no scheme means tcp
    "tcp://scheduler.example.com:8786",
    "tcp://0.0.0.0:8786",
    "tcp://localhost.example.com:8786",
    "tcp://[2001:db8::1]:8786",
    "ws://10.0.0.5:8786",
    "ucx://10.0.0.5:8786",
]


@pytest.mark.parametrize("address", REMOTE_PLAINTEXT)
def test_plaintext_to_a_remote_host_is_refused_unless_opted_in(address):
    with pytest.raises(ValueError, match="plaintext") as info:
        GPUDaskTaskRunner(address=address)
    assert address in str(info.value)
    # A Security that does not encrypt is no excuse.
    with pytest.raises(ValueError, match="plaintext"):
        GPUDaskTaskRunner(address=address, security=Security(require_encryption=False))
    runner = GPUDaskTaskRunner(address=address, allow_insecure=True)
    assert runner.address == address and runner.allow_insecure is True


@pytest.mark.parametrize(
    "address",
    ["tcp://127.0.0.1:8786", "127.0.0.1:8786", "tcp://localhost:8786", "tcp://[::1]:8786"],
)
def test_plaintext_to_loopback_is_allowed(address):
    assert GPUDaskTaskRunner(address=address).address == address


def test_an_insecure_runner_survives_pickling_with_its_opt_in():
    import pickle

    runner = GPUDaskTaskRunner(address="tcp://10.0.0.5:8786", allow_insecure=True)
    clone = pickle.loads(pickle.dumps(runner))
    assert clone.allow_insecure is True and clone.address == runner.address


# -- 2. access: TLS end to end ------------------------------------------------------


@dataclass
class Certs:
    ca: Path
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path
    rogue_cert: Path  # signed by a different CA
    rogue_key: Path


def _key():
    from cryptography.hazmat.primitives.asymmetric import ec

    return ec.generate_private_key(ec.SECP256R1())


def _write_key(key, path: Path) -> Path:
    from cryptography.hazmat.primitives import serialization

    path.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    path.chmod(0o600)
    return path


def _write_cert(cert, path: Path) -> Path:
    from cryptography.hazmat.primitives import serialization

    path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    return path


def _ca(name: str):
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes
    from cryptography.x509.oid import NameOID

    key = _key()
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=True,
                crl_sign=True,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .sign(key, hashes.SHA256())
    )
    return key, cert


def _leaf(ca_key, ca_cert, name: str):
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    key = _key()
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)]))
        .issuer_name(ca_cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(
            x509.SubjectAlternativeName(
                [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
            ),
            critical=False,
        )
        .add_extension(
            x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]),
            critical=False,
        )
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()),
            critical=False,
        )
        .sign(ca_key, hashes.SHA256())
    )
    return key, cert


def make_certs(directory: Path) -> Certs:
    """A CA, a server and a client certificate for 127.0.0.1/localhost, and a rogue one."""
    directory.mkdir(parents=True, exist_ok=True)
    ca_key, ca_cert = _ca("prefect-gpu-dask test CA")
    server_key, server_cert = _leaf(ca_key, ca_cert, "dask-scheduler")
    client_key, client_cert = _leaf(ca_key, ca_cert, "prefect-flow")
    rogue_ca_key, rogue_ca_cert = _ca("someone else's CA")
    rogue_key, rogue_cert = _leaf(rogue_ca_key, rogue_ca_cert, "intruder")
    return Certs(
        ca=_write_cert(ca_cert, directory / "ca.pem"),
        server_cert=_write_cert(server_cert, directory / "server.pem"),
        server_key=_write_key(server_key, directory / "server-key.pem"),
        client_cert=_write_cert(client_cert, directory / "client.pem"),
        client_key=_write_key(client_key, directory / "client-key.pem"),
        rogue_cert=_write_cert(rogue_cert, directory / "rogue.pem"),
        rogue_key=_write_key(rogue_key, directory / "rogue-key.pem"),
    )


def tls_options(certs: Certs) -> list[str]:
    return [
        "--tls-ca-file",
        str(certs.ca),
        "--tls-cert",
        str(certs.server_cert),
        "--tls-key",
        str(certs.server_key),
    ]


def client_security(certs: Certs) -> Security:
    return Security(
        tls_ca_file=str(certs.ca),
        tls_client_cert=str(certs.client_cert),
        tls_client_key=str(certs.client_key),
        require_encryption=True,
    )


@pytest.fixture
def tls_cluster(dask_processes: DaskProcesses, tmp_path):
    """A TLS-only scheduler and one ``GPU=1`` worker (under a nanny), all speaking TLS."""
    certs = make_certs(tmp_path / "certs")
    address = dask_processes.start_scheduler("--protocol", "tls", *tls_options(certs))
    assert address.startswith("tls://127.0.0.1:"), address
    dask_processes.start_worker(
        "tls-gpu-worker", "--nthreads", "2", "--resources", "GPU=1", *tls_options(certs)
    )
    with Client(address, security=client_security(certs), timeout="60s") as client:
        client.wait_for_workers(1, timeout=60)
    yield address, certs
    # Workers before their scheduler: otherwise each spends ~8 s giving up on it.
    for proc in dask_processes.procs[1:]:
        proc.terminate()
    for proc in dask_processes.procs[1:]:
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()


@task(tags=["gpu"])
def where_am_i() -> dict:
    worker = distributed.get_worker()
    return {"name": worker.name, "address": worker.address, "resources": worker.state.total_resources}


def test_tls_cluster_end_to_end(tls_cluster):
    address, certs = tls_cluster
    runner = GPUDaskTaskRunner(address=address, security=client_security(certs))

    @flow(task_runner=runner)
    def over_tls():
        client = FlowRunContext.get().task_runner.client
        where = [where_am_i.submit() for _ in range(3)]
        return [f.result() for f in where], client.scheduler.address

    where, scheduler = over_tls()
    assert scheduler == address
    for w in where:
        assert w["name"] == "tls-gpu-worker"
        assert w["address"].startswith("tls://127.0.0.1:"), w
        assert w["resources"] == {"GPU": 1}


def _refused(make_client, timeout: float = 20) -> BaseException:
    """The error a client construction fails with. Such clients pass
    ``set_as_default=False``: distributed registers a client as the global default
    before it connects, and a refused one would stay there until garbage-collected,
    where a later default runner (``distributed.get_client()``) would find it."""
    start = time.monotonic()
    with pytest.raises(Exception) as info:  # noqa: B017 - the type differs by failure mode
        client = make_client()
        client.close()
    assert time.monotonic() - start < timeout
    return info.value


def test_tls_scheduler_refuses_plaintext_and_uncertified_clients(tls_cluster):
    address, certs = tls_cluster
    port = address.rsplit(":", 1)[1]
    plaintext = f"tcp://127.0.0.1:{port}"
    _refused(lambda: Client(plaintext, timeout="3s", set_as_default=False))
    # TLS, but without a client certificate: the scheduler demands one (mutual TLS).
    _refused(
        lambda: Client(
            address,
            security=Security(tls_ca_file=str(certs.ca), require_encryption=True),
            timeout="3s",
            set_as_default=False,
        )
    )
    # TLS with a certificate from a CA the scheduler does not trust.
    _refused(
        lambda: Client(
            address,
            security=Security(
                tls_ca_file=str(certs.ca),
                tls_client_cert=str(certs.rogue_cert),
                tls_client_key=str(certs.rogue_key),
                require_encryption=True,
            ),
            timeout="3s",
            set_as_default=False,
        )
    )
    # The runner, pointed at that scheduler in plaintext (loopback, so allowed to try):
    # the flow fails quickly rather than running anything.
    ran = []

    @task
    def never() -> None:
        ran.append(1)

    @flow(task_runner=GPUDaskTaskRunner(address=plaintext, client_kwargs={"timeout": "3s"}))
    def plaintext_flow():
        return never.submit().result()

    start = time.monotonic()
    state = plaintext_flow(return_state=True)
    assert state.is_failed(), state
    assert time.monotonic() - start < 30
    assert ran == []
    # ...and the real client still gets in afterwards.
    with Client(address, security=client_security(certs), timeout="10s") as client:
        assert len(client.scheduler_info()["workers"]) == 1
    # No refused client is left behind as the default for the next runner to join.
    with pytest.raises(ValueError):
        distributed.get_client()


# -- 2. access: local clusters listen on loopback only ------------------------------


def _listening(pid: int) -> set[tuple[str, int]]:
    return {
        (c.laddr.ip, c.laddr.port)
        for c in psutil.Process(pid).net_connections(kind="inet")
        if c.status == psutil.CONN_LISTEN
    }


def _host_port(address: str) -> tuple[str, int]:
    host, port = address.split("://", 1)[1].rsplit(":", 1)
    return host, int(port)


def test_default_local_cluster_listens_on_loopback_only():
    me = os.getpid()
    before = _listening(me)

    @flow(task_runner=GPUDaskTaskRunner())
    def inspect_cluster():
        runner = FlowRunContext.get().task_runner
        client = runner.client
        cluster = runner._cluster
        assert cluster is not None, "the default runner started no local cluster"
        worker_pids = client.run(os.getpid)
        nannies = {name: w.address for name, w in cluster.workers.items()}
        sockets = {
            "flow process (scheduler, nannies, dashboard)": _listening(me) - before,
            **{f"worker {a}": _listening(pid) for a, pid in worker_pids.items()},
        }
        return {
            "scheduler": cluster.scheduler_address,
            "dashboard": cluster.dashboard_link,
            "worker_pids": worker_pids,
            "nannies": nannies,
            "sockets": sockets,
            "type": type(cluster).__name__,
        }

    out = inspect_cluster()
    assert out["type"] == "LocalCluster"
    assert out["worker_pids"], out
    assert all(pid != me for pid in out["worker_pids"].values()), "workers are not processes"
    assert out["nannies"], "no nannies"

    # Every socket that listens anywhere in the cluster listens on 127.0.0.1.
    for who, sockets in out["sockets"].items():
        assert sockets, f"{who} listens on nothing: the check would be vacuous"
        wide = {s for s in sockets if s[0] != "127.0.0.1"}
        assert not wide, f"{who} listens beyond loopback: {sorted(wide)}"

    # ...and those sockets are the cluster's: the scheduler, each nanny and each worker.
    in_process = out["sockets"]["flow process (scheduler, nannies, dashboard)"]
    assert _host_port(out["scheduler"]) in in_process
    for nanny in out["nannies"].values():
        assert _host_port(nanny) in in_process, nanny
    for address in out["worker_pids"]:
        assert _host_port(address) in out["sockets"][f"worker {address}"]
    # The dashboard, where one runs, is bound to loopback too.
    if out["dashboard"]:
        assert "127.0.0.1" in out["dashboard"], out["dashboard"]
