"""Flow runs on one GPU host, each with a cluster of its own: a ``gpu`` slot holds
across them. Each flow run is a process of its own, as under a process work pool."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from prefect.settings import PREFECT_API_URL

ROOT = Path(__file__).resolve().parents[2]
HOLD_S = 3.0


def start_flow_run(ledger: Path, lock_dir: Path) -> subprocess.Popen:
    env = {
        **os.environ,
        "PREFECT_API_URL": PREFECT_API_URL.value(),
        "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
        "PREFECT_GPU_DASK_RUNTIME_DIR": str(lock_dir),
    }
    return subprocess.Popen(
        [sys.executable, "-m", "tests.shared_host_flows", str(ledger), str(HOLD_S)],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def test_two_flow_runs_with_their_own_clusters_take_turns_on_one_gpu(tmp_path):
    ledger, lock_dir = tmp_path / "ledger", tmp_path / "locks"
    runs = [start_flow_run(ledger, lock_dir) for _ in range(2)]
    outputs = [run.communicate(timeout=240)[0] for run in runs]
    assert [run.returncode for run in runs] == [0, 0], "\n".join(outputs)
    held = sorted(tuple(map(float, line.split()[1:])) for line in ledger.read_text().splitlines())
    assert len(held) == 2
    (start_a, end_a), (start_b, end_b) = held
    assert end_a <= start_b, f"the two gpu tasks overlapped on the GPU: {held}"
    assert any("Waited" in out and "another cluster on this host" in out for out in outputs), outputs
