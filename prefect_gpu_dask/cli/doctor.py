"""``prefect-gpu-dask doctor``: is this host (or a cluster) ready for GPU flows, and if
not, why and what to do.

Each check returns ``Finding``s; ``ready`` is the one verdict over them: GPU flows can
run when nothing failed and some GPU can take ``gpu`` work (a healthy GPU here with CuPy
and dask-cuda, or a GPU worker on the cluster asked about). Nothing here creates a CUDA
context or starts a cluster: NVML talks to the driver, the libraries are looked up by
their installed metadata, and a cluster is only asked what it has.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import os
import re
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from typing import Any

from dask.utils import format_bytes

from prefect_gpu_dask import nvml
from prefect_gpu_dask.host_cluster import HostCluster, find_host_cluster
from prefect_gpu_dask.jobqueue import job_mismatch, worker_jobs
from prefect_gpu_dask.resources import GPU_RESOURCE

OK, WARN, FAIL, INFO = "ok", "warn", "fail", "info"
CONNECT_TIMEOUT_S = 3
POSTGRES_HINT = "for a team, or many flows at once: `prefect server start` on PostgreSQL"
# Prefect's default wait for a temporary server is 20 s: too short for several starting
# together on a busy host, or one started again after a migration clash; this one held
# (docs/deployments.md).
EPHEMERAL_STARTUP_ENOUGH_S = 120


SQLITE_NOTE = (
    "one writer at a time: flow runs and their task runs that write at once wait for each "
    "other (Prefect retries a 'database is locked' answer 503)"
)


def sqlite_finding(where: str) -> Finding:
    """The Prefect API on SQLite: fine for one host's nightly flows, not for many at once."""
    return Finding("Prefect API", INFO, f"{where}; its database is SQLite: {SQLITE_NOTE}", POSTGRES_HINT)


@dataclass(frozen=True)
class Finding:
    area: str  # what was checked: "driver", "GPU 0", "cupy", "Prefect API", ...
    status: str  # ok | warn | fail | info
    detail: str
    hint: str | None = None  # what to do about a warn or a fail
    gpu_ready: bool = False  # this finding shows a GPU that can take gpu work


@dataclass(frozen=True)
class Diagnosis:
    findings: tuple[Finding, ...]
    seconds: float

    @property
    def ready(self) -> bool:
        """GPU flows can run: nothing failed, and some GPU can take gpu work."""
        return not any(f.status == FAIL for f in self.findings) and any(f.gpu_ready for f in self.findings)

    def to_dict(self) -> dict[str, Any]:
        return {
            "ready": self.ready,
            "seconds": round(self.seconds, 3),
            "findings": [asdict(f) for f in self.findings],
        }


# -- this host's GPUs ----------------------------------------------------------------


def _cuda_major(version: int | None) -> int | None:
    return None if not version else version // 1000


def driver_findings() -> tuple[list[Finding], int | None]:
    """The driver and CUDA versions; the CUDA major the driver supports (None: no driver)."""
    if not nvml.is_available():
        return [
            Finding(
                "driver",
                FAIL,
                "NVML did not load: no NVIDIA driver here (gpu-tagged tasks would run on CPU)",
                "install the NVIDIA driver, or run GPU flows on a GPU host (or give --address)",
            )
        ], None
    driver, cuda = nvml.driver_versions()
    major = _cuda_major(cuda)
    cuda_text = f"{major}.{cuda % 1000 // 10}" if cuda else "unknown"
    return [Finding("driver", OK, f"NVIDIA driver {driver}, CUDA {cuda_text} (NVML loaded)")], major


def gpu_findings() -> list[Finding]:
    from prefect_gpu_dask.health import HealthMonitor, NvmlHealthReader

    findings = []
    for index, handle in enumerate(nvml.visible_handles()):
        name, memory = nvml.device_name(handle), nvml.device_memory(handle)
        mig = nvml.mig_enabled(handle)
        size = (
            f"{format_bytes(memory.used)} of {format_bytes(memory.total)} in use"
            if memory
            else "memory unknown"
        )
        detail = f"{name} ({nvml.device_uuid(handle)}), {size}" + (", MIG on" if mig else "")
        try:
            monitor = HealthMonitor(NvmlHealthReader(handle))
            verdict = monitor.check()
            monitor.close()
        except nvml.READ_ERRORS as exc:  # NVML cannot judge it: say so, the GPU may still work
            findings.append(
                Finding(f"GPU {index}", WARN, f"{detail}; health not readable: {exc}", gpu_ready=True)
            )
            continue
        if not verdict.healthy:
            reasons = "; ".join(verdict.reasons)
            findings.append(
                Finding(
                    f"GPU {index}", FAIL, f"{detail}; unhealthy: {reasons}", "reset the GPU or drain the host"
                )
            )
            continue
        warnings = "; ".join(verdict.warnings)
        status = WARN if warnings else OK
        findings.append(
            Finding(
                f"GPU {index}",
                status,
                detail + (f"; {warnings}" if warnings else "; healthy"),
                gpu_ready=True,
            )
        )
    if not findings:
        findings.append(
            Finding("GPUs", FAIL, "NVML sees no GPU this process may use", "check CUDA_VISIBLE_DEVICES")
        )
    return findings


def _installed(*names: str) -> tuple[str, str] | None:
    """The first of ``names`` installed: (distribution, version)."""
    for name in names:
        try:
            return name, importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def _built_for(distribution: str) -> int | None:
    """The CUDA major a wheel was built for, from its name (cupy-cuda12x, cudf-cu13)."""
    found = re.search(r"cu(?:da)?(\d{2})", distribution)
    return int(found.group(1)) if found else None


def library_findings(cuda_major: int | None) -> list[Finding]:
    findings = []
    for label, names, needed, hint in (
        (
            "cupy",
            ("cupy-cuda13x", "cupy-cuda12x", "cupy"),
            True,
            "pip install 'prefect-gpu-dask[cuda13]' (or [cuda12])",
        ),
        ("dask-cuda", ("dask-cuda",), True, "pip install 'prefect-gpu-dask[cuda13]' (or [cuda12])"),
        (
            "cudf",
            ("cudf-cu13", "cudf-cu12", "cudf"),
            False,
            "pip install 'prefect-gpu-dask[cudf13]' for cuDF flows",
        ),
    ):
        found = _installed(*names)
        if found is None:
            status = FAIL if needed and cuda_major is not None else INFO
            what = "not installed" + ("" if needed else " (optional: flows fall back to pandas)")
            findings.append(Finding(label, status, what, hint))
            continue
        distribution, version = found
        built = _built_for(distribution)
        if built is not None and cuda_major is not None and built > cuda_major:
            findings.append(
                Finding(
                    label,
                    FAIL,
                    f"{distribution} {version} is built for CUDA {built}; "
                    f"the driver supports CUDA {cuda_major}",
                    f"install the cuda{cuda_major} build, or update the driver",
                )
            )
        else:
            spec = importlib.util.find_spec(label.replace("-", "_"))
            status = OK if spec is not None else FAIL
            findings.append(
                Finding(label, status, f"{distribution} {version}" + ("" if spec else ", not importable"))
            )
    return findings


# -- RAPIDS: cuDF, dask-cudf, RMM ----------------------------------------------------

RAPIDS = (  # (label, module, distributions), in import order
    ("rmm", "rmm", ("rmm-cu13", "rmm-cu12", "rmm")),
    ("cudf", "cudf", ("cudf-cu13", "cudf-cu12", "cudf")),
    ("dask-cudf", "dask_cudf", ("dask-cudf-cu13", "dask-cudf-cu12", "dask-cudf")),
)
IMPORT_TIMEOUT_S = 90.0
NUMPY_FIX = "pip install 'numpy<2.5'"
_IMPORT_EACH = """
import importlib, json, sys
failed = {}
for name in sys.argv[1:]:
    try:
        importlib.import_module(name)
    except BaseException as exc:
        failed[name] = f"{type(exc).__name__}: {exc}"[:400]
print(json.dumps(failed))
"""


def import_failures(modules: list[str], timeout_s: float = IMPORT_TIMEOUT_S) -> dict[str, str]:
    """Which of ``modules`` fail to import, and how, asked of a fresh interpreter: a
    library that crashes or hangs on import (native code, CUDA bindings) takes the
    subprocess with it, never the doctor. RAPIDS_NO_INITIALIZE keeps cuDF from touching
    the GPU at import."""
    env = {**os.environ, "RAPIDS_NO_INITIALIZE": "1"}
    try:
        done = subprocess.run(
            [sys.executable, "-c", _IMPORT_EACH, *modules],
            capture_output=True,
            text=True,
            timeout=timeout_s,
            env=env,
        )
    except subprocess.TimeoutExpired:
        return dict.fromkeys(modules, f"the import did not finish in {timeout_s:.0f} s")
    lines = done.stdout.strip().splitlines()
    if done.returncode == 0 and lines:
        try:
            return json.loads(lines[-1])
        except json.JSONDecodeError:
            pass
    tail = (done.stderr.strip().splitlines() or [f"exit status {done.returncode}"])[-1]
    return dict.fromkeys(modules, f"the interpreter importing them stopped: {tail}")


def numpy_clash() -> str | None:
    """numpy without ``np.row_stack`` (2.5 removed it) beside numba-cuda, which registers
    it at import: cuDF and RMM then fail to import. None where there is no clash."""
    import numpy

    numba_cuda = _installed("numba-cuda", "numba-cuda-mlir")
    if numba_cuda is None or hasattr(numpy, "row_stack"):
        return None
    name, version = numba_cuda
    return f"numpy {numpy.__version__} has no np.row_stack, which {name} {version} needs at import"


def rapids_findings(rapids: tuple[tuple[str, str, tuple[str, ...]], ...] = RAPIDS) -> list[Finding]:
    """cuDF, dask-cudf and RMM: installed, importable (``import_failures``), the numpy /
    numba-cuda clash named with its fix, and cuDF's spilling in this process."""
    found = {label: (module, _installed(*names)) for label, module, names in rapids}
    if not any(dist for _, dist in found.values()):
        return [Finding("RAPIDS", INFO, "cuDF, dask-cudf and RMM not installed (optional)")]
    failed = import_failures([module for module, dist in found.values() if dist])
    clash = numpy_clash()
    findings = []
    for label, (module, dist) in found.items():
        if dist is None:
            findings.append(Finding(label, INFO, "not installed"))
        elif module in failed:
            error = failed[module]
            if "row_stack" in error and clash is None:
                clash = "numpy has no np.row_stack, which numba-cuda needs at import"
            hint = (
                NUMPY_FIX if "row_stack" in error else "reinstall it for this CUDA, or read the error above"
            )
            findings.append(Finding(label, FAIL, f"{dist[0]} {dist[1]}, not importable: {error}", hint))
        else:
            findings.append(Finding(label, OK, f"{dist[0]} {dist[1]}, importable"))
    if clash is not None:
        findings.append(
            Finding("numpy", FAIL, f"{clash}: cuDF, RMM and RMM-pool workers cannot start", NUMPY_FIX)
        )
    if found["cudf"][1] is not None:
        spill = os.environ.get("CUDF_SPILL", "")
        on = spill.lower() in ("1", "on", "true", "yes")
        findings.append(
            Finding(
                "cuDF spilling",
                OK if on else INFO,
                f"CUDF_SPILL={spill or '(unset)'} here: spilling {'on' if on else 'off'} in this process",
                "LocalCUDACluster(enable_cudf_spill=True) turns it on in its workers and this process; "
                "for workers started elsewhere: dask cuda worker --enable-cudf-spill, and CUDF_SPILL=on "
                "where the flow runs",
            )
        )
    return findings


# -- the Prefect API -----------------------------------------------------------------


def prefect_findings() -> list[Finding]:
    from prefect.settings import PREFECT_API_URL

    url = PREFECT_API_URL.value()
    if not url:
        return [
            sqlite_finding("no PREFECT_API_URL: each flow run starts a temporary server of its own"),
            *temporary_server_findings(),
        ]
    import httpx

    began = time.perf_counter()
    try:
        with httpx.Client(timeout=CONNECT_TIMEOUT_S) as http:
            http.get(f"{url}/health").raise_for_status()
            settings = http.get(f"{url}/admin/settings").json()
    except (httpx.HTTPError, httpx.InvalidURL, OSError, ValueError) as exc:  # unreachable, refusing, not JSON
        return [
            Finding(
                "Prefect API",
                FAIL,
                f"{url} does not answer: {exc}",
                "start the server or fix PREFECT_API_URL",
            )
        ]
    took = f"answered in {1000 * (time.perf_counter() - began):.0f} ms"
    database = (settings.get("server") or {}).get("database") or {}
    driver = database.get("driver") or ""
    if "sqlite" in driver or (not driver and not database.get("host")):
        return [sqlite_finding(f"{url} {took}")]
    return [Finding("Prefect API", OK, f"{url} {took}; database PostgreSQL")]


def temporary_server_findings() -> list[Finding]:
    """Flow runs without ``PREFECT_API_URL`` each start a temporary server on this
    profile's database: whether several starting together (a night's scripts) each start."""
    try:
        return [startup_timeout_finding()]
    except ImportError as exc:  # a Prefect whose settings moved: say so, nothing is wrong yet
        return [Finding("temporary server", INFO, f"Prefect's settings for it not readable: {exc!r}")]


def startup_timeout_finding() -> Finding:
    from prefect.settings import PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS

    wait_s = PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS.value()
    if wait_s >= EPHEMERAL_STARTUP_ENOUGH_S:
        waits = f"each flow run waits up to {wait_s} s for its server to start"
        return Finding("temporary server", OK, waits)
    return Finding(
        "temporary server",
        WARN,
        f"each flow run waits {wait_s} s for its server to start; several starting together on a busy "
        "host, or one started again after a migration clash, can take longer, and the flow run then "
        "fails before it begins",
        f"prefect config set PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS={EPHEMERAL_STARTUP_ENOUGH_S}; "
        "or run one `prefect server start` for them all and set PREFECT_API_URL",
    )


# -- clusters ------------------------------------------------------------------------


def cluster_findings(address: str, security: Any = None, label: str = "cluster") -> list[Finding]:
    from distributed import Client

    try:
        with Client(address, security=security, timeout=CONNECT_TIMEOUT_S, set_as_default=False) as client:
            info = client.scheduler_info(n_workers=-1)
            jobs = worker_jobs(client, info.get("workers", {}))  # batch jobs (Slurm...)
    # No answer (CommClosedError is an OSError), a bad address, tls:// without TLS files (TypeError).
    except (OSError, TimeoutError, ValueError, TypeError) as exc:
        return [
            Finding(label, FAIL, f"{address} does not answer: {exc}", "check the address and --tls-* files")
        ]
    workers = info.get("workers", {})
    tls = "TLS" if address.startswith("tls://") else "no TLS"
    findings = [Finding(label, OK, f"{address} ({tls}), {len(workers)} worker(s)")]
    for worker_address, worker in sorted(workers.items(), key=lambda item: str(item[1].get("name"))):
        resources = worker.get("resources", {})
        job = jobs.get(worker_address)
        in_job = f" ({job.describe()})" if job is not None else ""
        model = next((n[4:] for n in resources if n.startswith("GPU-") and n != "GPU-MEM"), None)
        slots = resources.get(GPU_RESOURCE, 0)
        if slots:
            memory = f", {format_bytes(int(resources['GPU-MEM']))}" if "GPU-MEM" in resources else ""
            detail = f"{worker_address}: {GPU_RESOURCE}={slots:g}" + (f", {model}{memory}" if model else "")
            detail += in_job
            findings.append(Finding(f"worker {worker.get('name')}", OK, detail, gpu_ready=True))
        else:
            detail = f"{worker_address}: no GPU slot{in_job}"
            findings.append(Finding(f"worker {worker.get('name')}", INFO, detail))
        if (mismatch := job_mismatch(resources, job)) is not None:
            findings.append(Finding(f"worker {worker.get('name')}", WARN, *mismatch))
    if jobs:
        ids = sorted({f"{j.system} {j.job_id}" for j in jobs.values()})
        findings.append(Finding(label, INFO, f"{len(ids)} batch job(s): {', '.join(ids)}"))
    if not any(f.gpu_ready for f in findings):
        findings.append(
            Finding(
                label,
                FAIL,
                "no worker offers a GPU slot",
                "start GPU workers with --resources GPU=1 (dask cuda worker)",
            )
        )
    return findings


def host_cluster_findings() -> list[Finding]:
    try:
        host: HostCluster | None = find_host_cluster()
    except PermissionError as exc:
        return [Finding("host cluster", FAIL, str(exc), "remove the file or directory it names")]
    if host is None:
        return [Finding("host cluster", INFO, "none runs (flow runs start their own cluster)")]
    findings = cluster_findings(host.address, host.security, label="host cluster")
    # Its GPU workers count for this host; a failure of the host cluster is the host's.
    return findings


def diagnose(address: str | None = None, security: Any = None) -> Diagnosis:
    began = time.perf_counter()
    findings: list[Finding] = []
    if address:
        findings += cluster_findings(address, security)
    else:
        driver, cuda_major = driver_findings()
        findings += driver
        if cuda_major is not None:
            findings += gpu_findings()
        findings += library_findings(cuda_major)
        findings += rapids_findings()
        findings += host_cluster_findings()
    findings += prefect_findings()
    return Diagnosis(tuple(findings), time.perf_counter() - began)


MARK = {OK: "ok  ", WARN: "warn", FAIL: "FAIL", INFO: "info"}


def render(diagnosis: Diagnosis) -> str:
    lines = []
    for f in diagnosis.findings:
        lines.append(f"[{MARK[f.status]}] {f.area}: {f.detail}")
        if f.hint and f.status in (WARN, FAIL):
            lines.append(f"       -> {f.hint}")
    verdict = "ready for GPU flows" if diagnosis.ready else "NOT ready for GPU flows"
    lines.append(f"{verdict} ({diagnosis.seconds:.2f} s)")
    return "\n".join(lines)
