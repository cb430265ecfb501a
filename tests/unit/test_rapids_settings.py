"""RAPIDS options the runner refuses before anything starts (no GPU, no cluster)."""

from __future__ import annotations

import pytest

from prefect_gpu_dask import GPUDaskTaskRunner
from prefect_gpu_dask.settings import check_cluster_kwargs


def test_jit_unspill_is_refused_with_what_to_use_instead():
    with pytest.raises(ValueError, match=r"jit_unspill=True is no longer an option.*enable_cudf_spill=True"):
        GPUDaskTaskRunner(
            cluster_class="dask_cuda.LocalCUDACluster",
            cluster_kwargs={"rmm_pool_size": "8GiB", "jit_unspill": True},
        )


def test_rmm_and_spill_options_pass():
    check_cluster_kwargs({"rmm_pool_size": "8GiB", "rmm_async": True, "enable_cudf_spill": True})
    check_cluster_kwargs(None)
