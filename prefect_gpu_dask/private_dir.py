"""This user's private directory on this host, shared by their flow runs and clusters.

GPU turns (``worker/host_gpu_lock``) and the host cluster's address and certificate
(``host_cluster``) live there: ``$PREFECT_GPU_DASK_RUNTIME_DIR``, else
``$XDG_RUNTIME_DIR/prefect-gpu-dask``, else ``/tmp/prefect-gpu-dask-<uid>``. It is made
with mode 0700 and refused if another user owns it or may write to it: what is in it
decides who may use a GPU and who may join a cluster.
"""

from __future__ import annotations

import contextlib
import os
import stat
import tempfile
from pathlib import Path

DIRECTORY_ENV = "PREFECT_GPU_DASK_RUNTIME_DIR"


class SharedDirectoryError(PermissionError):
    """The private directory is not this user's alone."""


def private_directory() -> Path:
    """This user's directory, made private if it is new."""
    if explicit := os.environ.get(DIRECTORY_ENV):
        path = Path(explicit)
    elif runtime := os.environ.get("XDG_RUNTIME_DIR"):
        path = Path(runtime) / "prefect-gpu-dask"
    else:
        path = Path(tempfile.gettempdir()) / f"prefect-gpu-dask-{os.getuid()}"
    with contextlib.suppress(FileExistsError):
        path.mkdir(mode=0o700, parents=False)
    info = path.lstat()
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid() or info.st_mode & 0o077:
        raise SharedDirectoryError(
            f"{path} must be a directory of uid {os.getuid()} with mode 0700 to hold GPU turns and "
            f"the host cluster's certificate (it is uid {info.st_uid}, mode {stat.filemode(info.st_mode)}): "
            f"refusing to use it; remove it or set {DIRECTORY_ENV}"
        )
    return path
