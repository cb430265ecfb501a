"""scaling: the speed-cube on 1, 2, 4 and 8 GPUs (as many as the host has), through the
runner (one gpu task, ``compute_on_gpus``) and raw distributed on the same GPUs, at each
cube size asked for. GPU hosts only."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from benchmarks.common import Options, in_child_process
from benchmarks.sections.cube import cube_through_runner, raw_local_cuda_cluster_s


def run(options: Options) -> Iterator[tuple[str, Any]]:
    if not options.gpu:
        return
    for i, (side, side_chunk) in enumerate(options.scaling_sizes):
        # After the seed's cube, more work per GPU: fixed costs weigh less.
        name = "scaling" if i == 0 else f"scaling_n{side}"
        name += f"_c{side_chunk}" if i and side_chunk != options.chunk else ""
        yield name, bench_scaling(side, side_chunk, options.repeat)


def bench_scaling(n: int, chunk: int, repeat: int) -> dict[str, Any]:
    """1, 2, 4, 8 GPUs: through the runner (one gpu task, compute_on_gpus) and raw Dask."""
    import pynvml

    pynvml.nvmlInit()
    count = pynvml.nvmlDeviceGetCount()
    out: dict[str, Any] = {"gpus": count, "n": n, "chunk": chunk}
    for k in sorted({1, 2, 4, 8, count}):
        if k > count:
            continue
        devices = ",".join(str(i) for i in range(k))
        runs = cube_through_runner(
            n, chunk, max(repeat, 10), spread_of_runs=True, cluster_kwargs={"CUDA_VISIBLE_DEVICES": devices}
        )
        out[f"runner_{k}gpu"] = runs  # with the time inside the task: the rest is the task's overhead
        out[f"runner_{k}gpu_s"] = runs["median_s"]
        out[f"raw_distributed_{k}gpu_s"] = in_child_process(
            raw_local_cuda_cluster_s, n, chunk, repeat, devices
        )
    for k in (2, 4, 8):
        if f"runner_{k}gpu_s" in out:
            out[f"scaling_{k}gpu"] = out["runner_1gpu_s"] / out[f"runner_{k}gpu_s"]
            out[f"raw_distributed_scaling_{k}gpu"] = (
                out["raw_distributed_1gpu_s"] / out[f"raw_distributed_{k}gpu_s"]
            )
            out[f"efficiency_{k}gpu"] = out[f"scaling_{k}gpu"] / k
    return out
