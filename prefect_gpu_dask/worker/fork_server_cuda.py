"""The fork server's import of dask-cuda, for CUDA workers (``forkserver.CUDA_WORKER_PRELOAD``).

Imported in the server, before any worker forks from it: each GPU worker then finds
dask-cuda imported when its ``dask_cuda.initialize`` preload runs, which makes the
worker's CUDA context. The import makes no CUDA call. The server's own preloading survives only
``ImportError``; an import that fails here in any other way leaves the server up, and
each worker imports dask-cuda itself, failing there as it would have without the server.
"""

import contextlib

with contextlib.suppress(Exception):
    import dask_cuda  # noqa: F401
