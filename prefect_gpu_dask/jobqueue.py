"""Batch-system clusters (dask-jobqueue's ``SLURMCluster`` and kin): the traps a new user
meets, and which batch job each worker runs in.

- dask-jobqueue sets a SIGINT handler as it is imported, which Python allows only in the
  main thread: off it (Prefect loads a deployment's flow in a worker thread) the import
  raises ``ValueError``. The runner imports a cluster class named by a string there only
  as its cluster starts, and says what to do where that is off the main thread too.
- ``SLURMCluster`` always sends ``--mem``, which Slurm refuses beside ``--mem-per-gpu`` or
  ``--mem-per-cpu``: where the job directives have one of those, ``--mem`` is left out.

Nothing here imports dask-jobqueue.
"""

from __future__ import annotations

import inspect
import logging
import os
import sys
import threading
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import dask

from prefect_gpu_dask._compat import current_worker
from prefect_gpu_dask.resources import GPU_RESOURCE

# Slurm takes one of --mem, --mem-per-cpu, --mem-per-gpu.
MEM_PER = ("--mem-per-gpu", "--mem-per-cpu")
# Environment variables naming the batch job a process runs in.
JOB_VARIABLES = (("SLURM_JOB_ID", "slurm"), ("PBS_JOBID", "pbs"), ("LSB_JOBID", "lsf"))


def _on_main_thread() -> bool:
    return threading.current_thread() is threading.main_thread()


def import_later(cluster_class: Any) -> bool:
    """Whether the runner leaves importing ``cluster_class`` (a dotted name) until its
    cluster starts: on a Dask worker (none starts there), or off the main thread while
    its module is not imported yet (it may set a signal handler as it is imported)."""
    if not isinstance(cluster_class, str):
        return False
    if current_worker() is not None:
        return True
    return not _on_main_thread() and cluster_class.rsplit(".", 1)[0] not in sys.modules


def import_cluster_class(name: str) -> Callable[..., Any]:
    """The class ``name`` names; ``ValueError`` saying what to do where importing it off
    the main thread sets a signal handler (dask-jobqueue's SIGINT handler)."""
    from prefect.utilities.importtools import from_qualified_name

    try:
        return from_qualified_name(name)
    except ValueError as exc:
        if _on_main_thread() or "signal" not in str(exc):
            raise
        module, _, attribute = name.rpartition(".")
        raise ValueError(
            f"cluster_class={name!r} cannot be imported in thread {threading.current_thread().name!r}: "
            f"importing {module!r} sets a signal handler, which Python allows only in the main "
            f"thread ({exc}). Import it in the main thread before this flow runs (`import {module}` "
            f"in the script that starts the thread) or pass the class itself "
            f"(`from {module} import {attribute}`; cluster_class={attribute})."
        ) from exc


def is_slurm_cluster(cluster_class: Any) -> bool:
    if isinstance(cluster_class, str):
        return cluster_class.rsplit(".", 1)[-1] == "SLURMCluster"
    return inspect.isclass(cluster_class) and any(c.__name__ == "SLURMCluster" for c in cluster_class.__mro__)


def slurm_cluster_kwargs(
    cluster_class: Any, kwargs: Mapping[str, Any], logger: logging.Logger
) -> dict[str, Any]:
    """``kwargs``, with ``--mem`` among ``job_directives_skip`` where the job directives
    ask for memory per GPU or per CPU (``SLURMCluster`` sends ``--mem`` from ``memory``
    otherwise, and sbatch refuses the job)."""
    kwargs = dict(kwargs)
    if not is_slurm_cluster(cluster_class):
        return kwargs
    directives = kwargs.get("job_extra_directives")
    if directives is None:  # dask-jobqueue falls back to its config
        directives = dask.config.get("jobqueue.slurm.job-extra-directives", None) or []
    per = [str(d).strip() for d in directives if str(d).strip().startswith(MEM_PER)]
    skip = kwargs.get("job_directives_skip")
    if skip is None:
        skip = dask.config.get("jobqueue.slurm.job-directives-skip", None) or []
    if not per or any(str(s).strip() == "--mem" for s in skip):
        return kwargs
    logger.info(
        "job_extra_directives has %s: SLURMCluster's own --mem is left out (Slurm takes one of --mem, "
        "--mem-per-cpu and --mem-per-gpu); `memory` still sets each worker's memory limit",
        per[0],
    )
    kwargs["job_directives_skip"] = [*skip, "--mem"]
    return kwargs


# -- which job a worker runs in (prefect-gpu-dask doctor) ----------------------------------


@dataclass(frozen=True)
class BatchJob:
    system: str  # slurm, pbs, lsf
    job_id: str
    gpus: str | None  # the GPUs the batch system gave the job ("0,1"), None where it says nothing

    def describe(self) -> str:
        gpus = f", GPUs {self.gpus}" if self.gpus else ", no GPU" if self.gpus == "" else ""
        return f"{self.system} job {self.job_id}{gpus}"


def this_process_job() -> tuple[str, str, str | None] | None:
    """The batch job this process runs in: (system, job id, its GPUs), or None."""
    for variable, system in JOB_VARIABLES:
        if job_id := os.environ.get(variable):
            gpus = os.environ.get("SLURM_JOB_GPUS", "") if system == "slurm" else None
            return system, job_id, gpus
    return None


def worker_jobs(
    client: Any, workers: Mapping[str, Mapping[str, Any]], timeout_s: float = 5
) -> dict[str, BatchJob]:
    """Each worker's batch job, by worker address, asked of its nanny (which answers while
    the worker is busy), or of the worker where it has none. Workers in no batch job are
    left out; all are where the answers take longer than ``timeout_s``."""
    nannied = [address for address, w in workers.items() if w.get("nanny")]
    bare = [address for address, w in workers.items() if not w.get("nanny")]

    def ask() -> dict[str, Any]:
        answers: dict[str, Any] = {}
        if nannied:
            answers.update(client.run(this_process_job, workers=nannied, nanny=True, on_error="return"))
        if bare:
            answers.update(client.run(this_process_job, workers=bare, on_error="return"))
        return answers

    pool = ThreadPoolExecutor(1, thread_name_prefix="worker-jobs")
    try:
        answers = pool.submit(ask).result(timeout_s)
    except (OSError, TimeoutError) as exc:
        logging.getLogger(__name__).warning("Could not ask the workers for their batch jobs: %r", exc)
        return {}
    finally:
        pool.shutdown(wait=False)
    return {
        address: BatchJob(*answer)
        for address, answer in answers.items()
        if isinstance(answer, tuple) and len(answer) == 3
    }


def job_mismatch(resources: Mapping[str, float], job: BatchJob | None) -> tuple[str, str] | None:
    """What is wrong, and what to do, where a Slurm job's GPUs and its worker's ``GPU``
    slots disagree; None where they agree or the batch system does not say."""
    if job is None or job.gpus is None:
        return None
    slots = resources.get(GPU_RESOURCE, 0)
    given = len([g for g in job.gpus.split(",") if g])
    where = f"{job.system} job {job.job_id}"
    if slots and not given:
        return (
            f"offers {GPU_RESOURCE}={slots:g} but its {where} was given no GPU",
            "ask for the GPUs: job_extra_directives=['--gres=gpu:N'] (SLURMCluster)",
        )
    if given and not slots:
        return (
            f"its {where} has GPU(s) {job.gpus} but the worker offers no {GPU_RESOURCE} slot",
            "label the worker: worker_extra_args=['--resources', 'GPU=N'] (SLURMCluster)",
        )
    return None
