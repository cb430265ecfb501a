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


def test_doctor_names_the_numpy_clash_and_survives_a_crashing_import(tmp_path, monkeypatch):
    from prefect_gpu_dask.cli import doctor

    (tmp_path / "clashing_lib.py").write_text(
        "raise AttributeError(\"module 'numpy' has no attribute 'row_stack'\")\n"
    )
    (tmp_path / "crashing_lib.py").write_text("import os\nos._exit(3)\n")
    (tmp_path / "fine_lib.py").write_text("")
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    # Installed distributions stand for the RAPIDS ones: the doctor asks metadata, then imports.
    findings = doctor.rapids_findings(
        (
            ("rmm", "fine_lib", ("dask",)),
            ("cudf", "clashing_lib", ("distributed",)),
            ("dask-cudf", "x", ("nope",)),
        )
    )
    by_area = {f.area: f for f in findings}
    assert by_area["rmm"].status == doctor.OK
    assert by_area["cudf"].status == doctor.FAIL and by_area["cudf"].hint == "pip install 'numpy<2.5'"
    assert by_area["numpy"].status == doctor.FAIL and "row_stack" in by_area["numpy"].detail
    assert by_area["dask-cudf"].detail == "not installed"
    assert by_area["cuDF spilling"].status in (doctor.OK, doctor.INFO)

    crashed = doctor.import_failures(["fine_lib", "crashing_lib"])
    assert set(crashed) == {"fine_lib", "crashing_lib"}  # which one is unknown: both said
    assert "stopped" in crashed["crashing_lib"]
