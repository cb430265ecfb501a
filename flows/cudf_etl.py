"""A nightly ETL on dask-cudf, or on pandas-backed Dask where there is no cuDF.

Generate partitioned sensor readings (timestamps, a category, a value, with NaNs and
bad rows), clean them, aggregate per category and day, and write the aggregate as
Parquet under ``out_dir`` (a fresh temporary directory by default). The flow then
checks the Parquet files against the same aggregation done in plain pandas, one
generated partition at a time.

The flow chooses the backend: dask-cudf (``dask.config.set({"dataframe.backend":
"cudf"})``) where there is a GPU and ``cudf`` and ``dask_cudf`` import, pandas
otherwise. Where cuDF is installed but cannot be imported (numpy 2.5 beside
numba-cuda, say), the flow logs why at WARNING and takes the pandas path; so does
the ``gpu`` task on a worker where cuDF does not import. Every step of the pipeline
is written once, for both.

    python flows/cudf_etl.py                  # sizes chosen by the device
    python flows/cudf_etl.py /tmp/etl-out     # out_dir
    python flows/cudf_etl.py /tmp/etl-out pandas 32 1000000   # backend and size
"""

from __future__ import annotations

import os

# Before Prefect is imported: the embedded API server may need more than Prefect's
# default 20 s to start on a small, busy machine, and an offline host cannot send
# the server's telemetry (each failed attempt logs an error).
os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "120")
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")

import functools
import importlib.util
import os
import sys
import tempfile
import time
from typing import Any

import dask
import dask.dataframe as dd
import numpy as np
import pandas as pd
from prefect import flow, get_run_logger, task

from prefect_gpu_dask import GPUDaskTaskRunner, compute_on_gpus, gpu_available

CATEGORIES = ("alpha", "beta", "gamma", "delta", "epsilon")
BAD_VALUE = -999.0  # the sentinel an upstream system writes for a failed reading
START = pd.Timestamp("2025-01-01")
DAYS = 7
GPU_SIZE = (32, 1_000_000)  # partitions, rows per partition
CPU_SIZE = (4, 25_000)
OUTPUT = "daily_category_stats"
KEYS = ["category", "day"]
COLUMNS = ["readings", "total", "mean", "low", "high"]


def default_size(gpu: bool) -> tuple[int, int]:
    """``(partitions, rows_per_partition)``: 32M rows on a GPU, 100k on CPU."""
    return GPU_SIZE if gpu else CPU_SIZE


def make_partition(index: int, rows: int, seed: int) -> pd.DataFrame:
    """One raw partition, the same for the same ``(index, rows, seed)`` on any machine.

    About 2% of values are NaN, 1% are the ``BAD_VALUE`` sentinel, 1% of categories are
    missing, 1% are junk, a quarter come with stray case and spaces, and 0.5% of
    timestamps are missing.
    """
    rng = np.random.default_rng([seed, index])
    seconds = rng.integers(0, DAYS * 86_400, rows)
    ts = pd.Series(START + pd.to_timedelta(seconds, unit="s"), dtype="datetime64[ns]")
    ts[rng.random(rows) < 0.005] = pd.NaT
    category = np.asarray(CATEGORIES, dtype=object)[rng.integers(0, len(CATEGORIES), rows)]
    messy = rng.random(rows) < 0.25
    category[messy] = [f" {c.upper()} " for c in category[messy]]
    category[rng.random(rows) < 0.01] = "??"
    category[rng.random(rows) < 0.01] = None
    value = rng.normal(50.0, 10.0, rows)
    value[rng.random(rows) < 0.02] = np.nan
    value[rng.random(rows) < 0.01] = BAD_VALUE
    return pd.DataFrame(
        {
            "ts": ts,
            "category": pd.Series(category, dtype=object),
            "value": value,
        }
    )


def clean(df: Any) -> Any:
    """Drop missing and sentinel readings, normalise categories, keep known ones, add ``day``.

    Works unchanged on a pandas, cuDF, Dask-pandas or dask-cudf frame.
    """
    df = df.dropna(subset=["ts", "category", "value"])
    df = df[df["value"] != BAD_VALUE]
    df = df.assign(category=df["category"].str.strip().str.lower())
    df = df[df["category"].isin(list(CATEGORIES))]
    return df.assign(day=df["ts"].dt.floor("D"))


def aggregate(df: Any) -> Any:
    """Per ``(category, day)``: count, sum, mean, min and max of ``value``, as columns.

    For a Dask frame. ``split_out=1``: a few dozen groups come out of any input, so a
    tree reduction is right; left to itself Dask picks a shuffle for many partitions,
    a P2P shuffle when it sees a distributed client, and that cannot run on the
    threads scheduler ``compute_on_gpus`` uses on a one-worker cluster.
    """
    out = df.groupby(KEYS)["value"].agg(["count", "sum", "mean", "min", "max"], split_out=1)
    out.columns = COLUMNS
    return out.reset_index()


NO_GPU, NO_CUDF = "no GPU here", "cudf and dask_cudf are not installed"  # said at INFO only


@functools.cache
def cudf_unusable() -> str | None:
    """Why this process cannot run the cuDF path (None: it can).

    No GPU, or no cuDF installed, is said plainly; cuDF installed but failing to import
    says what it raised. Importing cuDF runs native code and its CUDA bindings, which
    fail in more ways than ``ImportError`` (numba-cuda registers ``np.row_stack``,
    gone in numpy 2.5: ``AttributeError``), so any failure is caught here and said.
    """
    if not gpu_available():
        return NO_GPU
    if importlib.util.find_spec("cudf") is None or importlib.util.find_spec("dask_cudf") is None:
        return NO_CUDF
    try:
        import cudf  # noqa: F401
        import dask_cudf  # noqa: F401  (registers the "cudf" backend)
    except Exception as exc:  # a boundary: the pandas path runs instead, said at WARNING
        reason = f"cuDF is installed but cannot be imported ({type(exc).__name__}: {exc})"
        if "row_stack" in str(exc):
            reason += (
                f"; numpy {np.__version__} has no np.row_stack, which numba-cuda needs:"
                " pip install 'numpy<2.5'"
            )
        return reason
    return None


def use_cudf() -> bool:
    """A GPU here, and cudf plus dask_cudf (which registers the ``cudf`` backend) import."""
    return cudf_unusable() is None


@task(tags=["gpu"])
def run_etl(partitions: int, rows: int, seed: int, out_dir: str, backend: str = "cudf") -> dict[str, Any]:
    """Generate, clean, aggregate and write Parquet: with dask-cudf where ``backend`` is
    ``cudf`` and this worker can, else with pandas."""
    if backend == "cudf" and (why := cudf_unusable()) is not None:
        get_run_logger().warning("cudf-etl takes the pandas path on this worker: %s", why)
        backend = "pandas"
    cudf = backend == "cudf"
    path = os.path.join(out_dir, OUTPUT)
    start = time.perf_counter()
    with dask.config.set({"dataframe.backend": backend}):
        raw = dd.from_map(make_partition, range(partitions), rows=rows, seed=seed)
        if cudf:
            raw = raw.to_backend("cudf")  # pandas partitions -> cuDF, on the GPU workers
        stats = aggregate(clean(raw))
        # Small output (one partition after split_out=1): one file, overwritten each night.
        write = stats.to_parquet(path, write_index=False, overwrite=True, compute=False)
        compute_on_gpus(write)
    return {
        "backend": backend,
        "device": "GPU" if gpu_available() else "CPU",
        "path": path,
        "partitions": partitions,
        "rows": partitions * rows,
        "seconds": time.perf_counter() - start,
    }


@task
def expected_stats(partitions: int, rows: int, seed: int) -> pd.DataFrame:
    """The same aggregation in plain pandas, one partition at a time (little memory)."""
    parts = []
    for index in range(partitions):
        df = clean(make_partition(index, rows, seed))
        parts.append(df.groupby(KEYS)["value"].agg(["count", "sum", "min", "max"]))
    combined = (
        pd.concat(parts).groupby(level=KEYS).agg({"count": "sum", "sum": "sum", "min": "min", "max": "max"})
    )
    combined.insert(2, "mean", combined["sum"] / combined["count"])
    combined.columns = COLUMNS
    return normalise(combined.reset_index())


def normalise(df: pd.DataFrame) -> pd.DataFrame:
    """Same column types and row order, whatever wrote or read the frame."""
    df = df.astype(
        {"category": str, "day": "datetime64[ns]", "readings": "int64"} | {c: "float64" for c in COLUMNS[1:]}
    )
    return df.sort_values(KEYS).reset_index(drop=True)[KEYS + COLUMNS]


@task
def read_stats(path: str) -> pd.DataFrame:
    """What the nightly run left on disk, read back with plain pandas."""
    return normalise(pd.read_parquet(path))


@flow(name="cudf-etl", task_runner=GPUDaskTaskRunner())
def cudf_etl(
    out_dir: str | None = None,
    backend: str | None = None,
    partitions: int | None = None,
    rows_per_partition: int | None = None,
    seed: int = 0,
) -> dict[str, Any]:
    """Generate -> clean -> aggregate -> Parquet; asserts the files equal a pandas computation.

    ``backend``: ``cudf`` or ``pandas``; left empty, ``cudf`` where this process can use
    it. Sizes left empty pick the backend's: 32 x 1M rows with cuDF, 4 x 25k with pandas
    (the check recomputes everything in pandas, so pandas gets the small size).
    """
    if backend not in (None, "cudf", "pandas"):
        raise ValueError(f"backend {backend!r} is not 'cudf' or 'pandas'")
    why = cudf_unusable() if backend != "pandas" else None
    if why is not None:
        if backend == "cudf" or why not in (NO_GPU, NO_CUDF):
            get_run_logger().warning("cudf-etl takes the pandas path: %s", why)
        else:
            get_run_logger().info("cudf-etl takes the pandas path: %s", why)
        backend = "pandas"
    backend = backend or "cudf"
    default_partitions, default_rows = default_size(backend == "cudf")
    partitions = partitions or default_partitions
    rows = rows_per_partition or default_rows
    out_dir = out_dir or tempfile.mkdtemp(prefix="cudf-etl-")
    expected = expected_stats.submit(partitions, rows, seed)
    report = run_etl.submit(partitions, rows, seed, out_dir, backend).result()
    got = read_stats.submit(report["path"]).result()
    want = expected.result()
    assert len(want) == len(CATEGORIES) * DAYS, want
    pd.testing.assert_frame_equal(got, want, check_exact=False, rtol=1e-9)
    report["groups"] = len(got)
    report["kept_rows"] = int(got["readings"].sum())
    get_run_logger().info(
        "cudf-etl on %s (%s): %d rows -> %d kept -> %d groups in %.2f s, written to %s",
        report["device"],
        report["backend"],
        report["rows"],
        report["kept_rows"],
        report["groups"],
        report["seconds"],
        report["path"],
    )
    return report


if __name__ == "__main__":
    args = sys.argv[1:]
    print(cudf_etl(*args[:2], *(int(n) for n in args[2:4])))
