"""What freezing the fork server's heap saves a worker, and what it keeps: in this
process, the fork server's imports (``WORKER_PRELOAD``), then the objects a collection
would find unreachable (they stay frozen), a full collection's time, and the same
collection after ``gc.freeze()``, which is what a forked worker's ``WorkerHeap`` pays:

    python benchmarks/probes/fork_server_heap.py
"""

import gc
import importlib
import sys
import time

if __name__ == "__main__":
    from prefect_gpu_dask.forkserver import WORKER_PRELOAD

    start = time.perf_counter()
    for name in WORKER_PRELOAD:
        importlib.import_module(name)
    print(f"imports {time.perf_counter() - start:.3f} s, {len(gc.get_objects())} objects tracked")
    gc.set_debug(gc.DEBUG_SAVEALL)  # keep what a collection finds, to count it
    start = time.perf_counter()
    unreachable = gc.collect()
    collect_ms = 1e3 * (time.perf_counter() - start)
    kept = sum(sys.getsizeof(o) for o in gc.garbage)
    print(f"unreachable after the imports: {unreachable} objects, {kept / 1024:.0f} KiB (shallow)")
    print(f"a full collection: {collect_ms:.1f} ms")
    gc.set_debug(0)
    gc.garbage.clear()
    gc.freeze()
    start = time.perf_counter()
    gc.collect()
    print(f"the same after gc.freeze(): {1e3 * (time.perf_counter() - start):.1f} ms")
