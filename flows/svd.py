"""SVD of a tall-skinny Dask array, CuPy-backed on a GPU, checked by reconstruction.

The standard case: 10000 x 1000 in 1000 x 1000 chunks, ``da.linalg.svd`` (a TSQR over
the row blocks). On a GPU worker the array is created under
``dask.config.set({"array.backend": "cupy"})``, so every chunk and every block QR/SVD
is CuPy's. On CPU the default is 5000 x 500 in 1000 x 500 chunks.

Besides the timing the task returns the checks the flow asserts: the relative
reconstruction error ``||u * s @ v - x|| / ||x||`` and the loss of orthogonality
``||u.T @ u - I||`` (computed in the same graph as the SVD) and, up to
``REFERENCE_MAX_ELEMENTS``, the largest relative difference between ``s`` and
NumPy's singular values of the same matrix.

    python flows/svd.py                     # sizes chosen by the device
    python flows/svd.py 20000 200 2000      # rows, cols, row chunk
"""

from __future__ import annotations

import os

# Before Prefect is imported: the embedded API server may need more than Prefect's
# default 20 s to start on a small, busy machine, and an offline host cannot send
# the server's telemetry (each failed attempt logs an error).
os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "120")
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")

import sys
import time
from contextlib import nullcontext
from typing import Any

import dask
import dask.array as da
import numpy as np
from prefect import flow, get_run_logger, task

from prefect_gpu_dask import GPUDaskTaskRunner, compute_on_gpus, gpu_available

GPU_SIZE = (10_000, 1_000, 1_000)  # rows, cols, row chunk: the standard SVD
CPU_SIZE = (5_000, 500, 1_000)
# float64: a backward-stable SVD reconstructs to ~1e-15; allow for sqrt(n) growth.
TOLERANCE = 1e-10
REFERENCE_MAX_ELEMENTS = 10_000_000  # compare s with numpy.linalg.svd up to 80 MB


def default_size(gpu: bool) -> tuple[int, int, int]:
    """``(rows, cols, row_chunk)``: the standard size on a GPU, a smaller one on CPU."""
    return GPU_SIZE if gpu else CPU_SIZE


def check_tall_skinny(rows: int | None, cols: int | None, row_chunk: int | None) -> None:
    """TSQR needs row blocks at least as tall as the matrix is wide (checks what is known)."""
    if row_chunk is None or cols is None:
        return
    block = min(row_chunk, rows) if rows else row_chunk
    if block < cols:
        raise ValueError(
            f"row blocks of {block} rows < cols={cols}: da.linalg.svd (TSQR) needs blocks "
            "at least as tall as wide; raise row_chunk"
        )


def _to_numpy(a: Any) -> np.ndarray:
    if type(a).__module__.split(".")[0] == "cupy":
        return a.get()
    return np.asarray(a)


def svd_checks(rows: int, cols: int, row_chunk: int, seed: int | None, reference: bool) -> dict[str, Any]:
    """Build ``x``, its SVD and the checks; compute them in one pass over the cluster.

    Call it with the wanted ``array.backend`` already set: the backend is chosen when
    the random array is created. ``seconds`` times the SVD and the two checks on the
    cluster, not the reference SVD on the host.
    """
    # One column chunk: da.linalg.svd takes tall-skinny arrays (a TSQR over row blocks).
    x = da.random.RandomState(seed).standard_normal((rows, cols), chunks=(row_chunk, cols))
    u, s, v = da.linalg.svd(x)
    reconstruction = da.linalg.norm((u * s) @ v - x) / da.linalg.norm(x)
    gram = u.T @ u  # cols x cols: small enough to finish on the host
    start = time.perf_counter()
    s_values, reconstruction, gram = compute_on_gpus(s, reconstruction, gram)
    seconds = time.perf_counter() - start
    s_values = _to_numpy(s_values)
    result = {
        "shape": [rows, cols],
        "chunks": [row_chunk, cols],
        "seconds": seconds,
        "singular_values": len(s_values),
        "s_max": float(s_values[0]),
        "s_min": float(s_values[-1]),
        "descending": bool(np.all(np.diff(s_values) <= 0)),
        "reconstruction_error": float(reconstruction),
        "orthogonality_error": float(np.linalg.norm(_to_numpy(gram) - np.eye(cols))),
        "max_s_error": None,
    }
    if reference:
        # The same graph again (seeded chunks): the same x, now on the host.
        (x_values,) = compute_on_gpus(x)
        expected = np.linalg.svd(_to_numpy(x_values), compute_uv=False)
        result["max_s_error"] = float(np.max(np.abs(s_values - expected)) / expected[0])
    return result


@task(tags=["gpu"])
def svd_report(
    rows: int | None = None,
    cols: int | None = None,
    row_chunk: int | None = None,
    seed: int | None = 0,
) -> dict[str, Any]:
    """The SVD and its checks, CuPy-backed on a GPU worker, NumPy on CPU."""
    gpu = gpu_available()
    default_rows, default_cols, default_chunk = default_size(gpu)
    rows, cols = rows or default_rows, cols or default_cols
    row_chunk = min(row_chunk or default_chunk, rows)
    check_tall_skinny(rows, cols, row_chunk)
    backend = dask.config.set({"array.backend": "cupy"}) if gpu else nullcontext()
    with backend:
        result = svd_checks(rows, cols, row_chunk, seed, rows * cols <= REFERENCE_MAX_ELEMENTS)
    result["device"] = "GPU" if gpu else "CPU"
    return result


@flow(name="svd", task_runner=GPUDaskTaskRunner())
def svd(
    rows: int | None = None,
    cols: int | None = None,
    row_chunk: int | None = None,
    seed: int | None = 0,
) -> dict[str, Any]:
    """Tall-skinny SVD; asserts ``u * s @ v`` gives back ``x`` and ``u`` is orthonormal.

    Sizes left empty pick the device's: 10000 x 1000 in 1000-row chunks on a GPU,
    5000 x 500 in 1000-row chunks on CPU.
    """
    check_tall_skinny(rows, cols, row_chunk)  # fail before starting a cluster
    result = svd_report.submit(rows, cols, row_chunk, seed).result()
    rows, cols = result["shape"]
    assert result["singular_values"] == min(rows, cols), result
    assert result["descending"] and result["s_min"] >= 0, result
    assert result["reconstruction_error"] < TOLERANCE, f"u * s @ v is not x: {result}"
    assert result["orthogonality_error"] < TOLERANCE * cols, f"u is not orthonormal: {result}"
    if result["max_s_error"] is not None:
        assert result["max_s_error"] < TOLERANCE, f"singular values differ from numpy's: {result}"
    get_run_logger().info(
        "svd %dx%d in %d-row chunks on %s: %.2f s, reconstruction error %.2e, "
        "orthogonality error %.2e, singular values vs numpy %s",
        rows,
        cols,
        result["chunks"][0],
        result["device"],
        result["seconds"],
        result["reconstruction_error"],
        result["orthogonality_error"],
        "not checked (too large)" if result["max_s_error"] is None else f"{result['max_s_error']:.2e}",
    )
    return result


if __name__ == "__main__":
    args = [int(a) for a in sys.argv[1:4]]
    print(svd(*args))
