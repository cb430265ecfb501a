"""Timeline of compute_on_gpus' split path on k GPUs: where the time goes between the
caller's prep, remote starts, per-part compute and the gather. Absolute clocks
(time.time) so caller and worker timestamps line up."""

import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def part_fn(pickled, outputs, nthreads, t_submit):
    import cloudpickle
    import dask

    t0 = time.time()
    g = cloudpickle.loads(pickled)
    t1 = time.time()
    vals = dask.threaded.get(g, outputs, num_workers=nthreads)
    t2 = time.time()
    blob = cloudpickle.dumps(dict(zip(outputs, vals)))
    t3 = time.time()
    return blob, {
        "start": t0 - t_submit,
        "unpickled": t1 - t_submit,
        "computed": t2 - t_submit,
        "pickled": t3 - t_submit,
        "compute": t2 - t1,
    }


def dumps(obj):
    """What compute_on_gpus ships shares with (the C pickler first)."""
    from distributed.protocol import pickle

    return pickle.dumps(obj)


def timeline(n, chunk, variant):
    import cloudpickle
    import dask
    import distributed
    from common import check_cube, speed_cube_expr
    from dask._expr import FinalizeCompute
    from dask._task_spec import DataNode
    from dask.base import collections_to_expr, unpack_collections
    from dask.core import flatten

    from prefect_gpu_dask.worker.compute import TASKS_BASED, _threads, split_graph
    from prefect_gpu_dask.worker.compute import gpu_workers as _gpu_workers

    T0 = time.time()
    tm = {}
    me = distributed.get_worker().address
    with distributed.worker_client() as client:
        workers = _gpu_workers(client.scheduler_info(n_workers=-1)["workers"])
        tm["client"] = time.time() - T0
        with dask.config.set(TASKS_BASED):
            c = speed_cube_expr(n, chunk, os.environ.get("CPU_CHECK") is None)
            unpacked, repack = unpack_collections(c)
            expr = FinalizeCompute(collections_to_expr(unpacked, True)).optimize()
            keys = list(flatten(expr.__dask_keys__()))
            graph = dict(expr.__dask_graph__())
            tm["graph"] = time.time() - T0
            parts, join = split_graph(graph, keys, len(workers))
            tm["split"] = time.time() - T0
            tm["n_tasks"] = len(graph)
            tm["n_join"] = len(join)
            shares = dict(zip(workers, parts))
            own = shares.pop(me) if variant == "local" else None
            futs = []
            for w, (p, outs) in shares.items():
                futs.append(
                    client.submit(
                        part_fn,
                        dumps(p),
                        outs,
                        _threads(),
                        T0,
                        workers=[w],
                        allow_other_workers=True,
                        pure=False,
                    )
                )
            tm["submitted"] = time.time() - T0
            held = {}
            if own is not None:
                p, outs = own
                held.update(zip(outs, dask.threaded.get(p, outs, num_workers=_threads())))
                tm["own_done"] = time.time() - T0
            arrivals, infos = [], []
            for f in distributed.as_completed(futs):
                blob, info = f.result()
                arrivals.append(time.time() - T0)
                held.update(cloudpickle.loads(blob))
                infos.append(info)
            tm["gathered"] = time.time() - T0
            final = {**{k: DataNode(k, v) for k, v in held.items()}, **join}
            vals = dask.get(final, keys)
            tm["joined"] = time.time() - T0
    check_cube(repack(vals)[0])
    tm["arrivals"] = arrivals
    tm["parts"] = sorted(infos, key=lambda i: i["start"])
    return tm


def main():
    if os.environ.get("CPU_CHECK"):
        return cpu_check()
    import pynvml

    pynvml.nvmlInit()
    count = pynvml.nvmlDeviceGetCount()
    out = {"gpus": count, "cores": os.cpu_count()}
    from dask_cuda import LocalCUDACluster
    from distributed import Client

    from prefect_gpu_dask.flow.cluster import GPU_WORKER_THREADS

    for k in sorted({1, 2, 4, count}):
        devs = ",".join(map(str, range(k)))
        with (
            LocalCUDACluster(
                CUDA_VISIBLE_DEVICES=devs, threads_per_worker=GPU_WORKER_THREADS, resources={"GPU": 1}
            ) as cl,
            Client(cl) as client,
        ):
            client.run(lambda: __import__("cupy").ones(1).sum())
            for n in (100_000, 200_000):
                for variant in ("local", "remote") if k > 1 else ("remote",):
                    runs = [
                        client.submit(timeline, n, 10_000, variant, pure=False, resources={"GPU": 1}).result()
                        for _ in range(4)
                    ]
                    best = min(runs[1:], key=lambda r: r["joined"])
                    out[f"{k}gpu_n{n}_{variant}"] = best
                    p = best["parts"]
                    print(
                        k,
                        n,
                        variant,
                        "graph {:.3f} split {:.3f} submitted {:.3f} own {} gathered {:.3f} joined {:.3f} | "
                        "remote start {:.3f}-{:.3f} computed {:.3f}-{:.3f} "
                        "compute {:.3f}-{:.3f} arrivals {:.3f}-{:.3f}".format(
                            best["graph"],
                            best["split"],
                            best["submitted"],
                            "{:.3f}".format(best["own_done"]) if "own_done" in best else "-",
                            best["gathered"],
                            best["joined"],
                            p[0]["start"],
                            p[-1]["start"],
                            min(i["computed"] for i in p),
                            max(i["computed"] for i in p),
                            min(i["compute"] for i in p),
                            max(i["compute"] for i in p),
                            min(best["arrivals"]),
                            max(best["arrivals"]),
                        ),
                        flush=True,
                    )
    os.makedirs(os.environ.get("OUT", "."), exist_ok=True)
    with open(os.path.join(os.environ.get("OUT", "."), "timeline8b.json"), "w") as f:
        json.dump(out, f, indent=1, default=float)


def cpu_check():
    from distributed import Client, LocalCluster

    with LocalCluster(n_workers=2, threads_per_worker=2, resources={"GPU": 1}) as cl, Client(cl) as client:
        for variant in ("local", "remote"):
            print(
                variant,
                client.submit(timeline, 4000, 1000, variant, pure=False, resources={"GPU": 1}).result(),
            )


if __name__ == "__main__":
    main()
