"""The nightly flows in flows/, run for real on CPU at small sizes (real Prefect API, real Dask workers)."""

from __future__ import annotations

import math
from pathlib import Path

import dask.array as da
import numpy as np
import pandas as pd
import pytest

from flows.cudf_etl import BAD_VALUE, CATEGORIES, DAYS, clean, cudf_etl, make_partition
from flows.leak_demo import leak_demo
from flows.speed_cube import speed_cube, speed_cube_expr
from flows.svd import svd
from prefect_gpu_dask import GPUDaskTaskRunner
from tests.conftest import has_gpu

DEVICE = "GPU" if has_gpu() else "CPU"
ONE_WORKER = {"n_workers": 1, "threads_per_worker": 2}
TWO_WORKERS = {"n_workers": 2, "threads_per_worker": 1}


def small(flow, cluster_kwargs=ONE_WORKER, **runner_kwargs):
    """The flow on a small CPU-sized local cluster instead of its default one."""
    return flow.with_options(task_runner=GPUDaskTaskRunner(cluster_kwargs=cluster_kwargs, **runner_kwargs))


def test_speed_cube_mean_is_eleven_across_two_workers():
    # Two workers: compute_on_gpus spreads the chunks over the cluster (no threads shortcut).
    result = small(speed_cube, TWO_WORKERS)(n=1200, chunk=300, seed=7)
    assert abs(result["mean"] - 11) < 0.01
    assert result["shape"] == [1200, 1200]
    assert result["chunks"] == [300, 300]
    assert result["n_chunks"] == 16
    assert result["device"] == DEVICE
    assert 0 < result["seconds"] < 60
    # The flow computed the seed's expression, not something else that averages 11.
    assert result["mean"] == pytest.approx(float(speed_cube_expr(1200, 300, None, 7).compute()), abs=1e-12)


def test_speed_cube_expr_is_the_seed_expression():
    expr = speed_cube_expr(400, 100, None, 1)
    assert expr.shape == ()
    # The same draws by hand: N(10, 1) chunks, every other row and column, plus one, mean.
    x = da.random.RandomState(1).normal(10, 1, size=(400, 400), chunks=(100, 100)).compute()
    assert float(expr.compute()) == pytest.approx((x[::2, ::2] + 1).mean(), abs=1e-12)
    assert abs(float(expr.compute()) - 11) < 0.05
    # Different seeds, different data; the same seed, the same value.
    assert float(speed_cube_expr(400, 100, None, 1).compute()) == float(expr.compute())
    assert float(speed_cube_expr(400, 100, None, 2).compute()) != float(expr.compute())


def test_svd_reconstructs_and_matches_numpy():
    result = small(svd)(rows=2000, cols=100, row_chunk=500, seed=3)
    assert result["device"] == DEVICE
    assert result["shape"] == [2000, 100] and result["chunks"] == [500, 100]
    assert result["singular_values"] == 100 and result["descending"]
    assert result["reconstruction_error"] < 1e-12
    assert result["orthogonality_error"] < 1e-12
    assert result["max_s_error"] is not None and result["max_s_error"] < 1e-12
    # A 2000 x 100 standard normal matrix: singular values near sqrt(2000) +- sqrt(100).
    assert math.sqrt(2000) - math.sqrt(100) - 5 < result["s_min"] < result["s_max"]
    assert result["s_max"] < math.sqrt(2000) + math.sqrt(100) + 5


def test_svd_rejects_blocks_shorter_than_wide():
    with pytest.raises(ValueError, match="raise row_chunk"):
        small(svd)(rows=1000, cols=200, row_chunk=100)


def test_cudf_etl_writes_parquet_equal_to_pandas(tmp_path: Path):
    report = small(cudf_etl)(out_dir=str(tmp_path), partitions=3, rows_per_partition=5_000, seed=11)
    assert report["backend"] == "pandas"  # no cuDF here
    assert report["device"] == DEVICE
    assert report["rows"] == 15_000
    assert report["groups"] == len(CATEGORIES) * DAYS
    # ~5.5% of rows are bad (NaN, sentinel, missing or junk category, missing timestamp).
    assert 0.90 * 15_000 < report["kept_rows"] < 0.98 * 15_000
    files = list(Path(report["path"]).glob("*.parquet"))
    assert files and Path(report["path"]).parent == tmp_path
    written = pd.read_parquet(report["path"])
    assert sorted(written.columns) == sorted(["category", "day", "readings", "total", "mean", "low", "high"])
    assert set(written["category"]) == set(CATEGORIES)
    assert int(written["readings"].sum()) == report["kept_rows"]

    # A second night overwrites rather than appends. Many partitions on one worker: the
    # aggregation must not pick a P2P shuffle, which the threads scheduler cannot run.
    again = small(cudf_etl)(out_dir=str(tmp_path), partitions=32, rows_per_partition=300, seed=12)
    assert again["rows"] == 32 * 300
    rewritten = pd.read_parquet(again["path"])
    assert len(rewritten) == len(CATEGORIES) * DAYS
    assert int(rewritten["readings"].sum()) == again["kept_rows"] != report["kept_rows"]


def test_etl_cleaning_rules():
    ts = pd.Timestamp("2025-01-02 13:45")
    raw = pd.DataFrame(
        {
            "ts": [ts, ts, ts, ts, ts, pd.NaT, ts],
            "category": ["alpha", " BETA ", "??", None, "gamma", "delta", "epsilon"],
            "value": [1.0, 2.0, 3.0, 4.0, np.nan, 6.0, BAD_VALUE],
        }
    )
    got = clean(raw)
    assert list(got["category"]) == ["alpha", "beta"]
    assert list(got["value"]) == [1.0, 2.0]
    assert (got["day"] == pd.Timestamp("2025-01-02")).all()


def test_generated_partitions_are_reproducible_and_dirty():
    a, b = make_partition(0, 2_000, seed=5), make_partition(0, 2_000, seed=5)
    pd.testing.assert_frame_equal(a, b)
    assert not make_partition(1, 2_000, seed=5).equals(a)
    assert a["value"].isna().any() and (a["value"] == BAD_VALUE).any()
    assert a["category"].isna().any() and a["ts"].isna().any()


def test_leak_demo_completes_and_guard_is_a_noop_without_gpu():
    if DEVICE == "GPU":
        pytest.skip("on a GPU the leak is real: tests/integration/test_gpu.py covers the restart")
    report = small(leak_demo, leak_threshold="256MiB")(mib=512, timeout_s=5)
    assert report["device"] == "CPU"
    assert report["guard"] == "no-op"
    assert report["restarted"] is False
    assert report["leaked"]["leaked_bytes"] == 0
    assert report["after"]["device"] == "CPU"


def test_leak_demo_refuses_a_leak_below_the_threshold():
    with pytest.raises(ValueError, match="threshold"):
        small(leak_demo)(mib=64)
