"""Nanny preload for the Dask workers of a remote cluster::

    dask worker tcp://scheduler:8786 --resources GPU=1 --preload-nanny prefect_gpu_dask.worker.nanny
    DASK_DISTRIBUTED__NANNY__PRELOAD=prefect_gpu_dask.worker.nanny dask cuda worker tcp://scheduler:8786

The nanny's worker process, the first and every replacement after a recycle, forks
from a server that has already imported Prefect, Dask and this package, as the
runner's own local clusters do (``forkserver.worker_start_method``), instead of being
spawned to import them again: a recycled GPU worker serves again seconds sooner. The
nanny itself imports none of them; the server does, once, and never touches CUDA or
NVML. A start method set in Dask's config (``distributed.worker.multiprocessing-method``)
other than the default ``spawn`` is left as it is.
"""

from __future__ import annotations

import importlib.util
import sys
from typing import Any

import dask

from prefect_gpu_dask.forkserver import START_METHOD_KEY, WORKER_PRELOAD, worker_start_method


def installed(module: str) -> bool:
    """Whether ``module``'s top-level package is installed, without importing it."""
    return importlib.util.find_spec(module.partition(".")[0]) is not None


def dask_setup(nanny: Any) -> None:
    # ``dask cuda worker`` imported dask-cuda here: its workers import it too.
    cuda = "dask_cuda" in sys.modules
    method = worker_start_method(cuda, preload=[name for name in WORKER_PRELOAD if installed(name)])
    if method == "forkserver":
        dask.config.set({START_METHOD_KEY: method})
