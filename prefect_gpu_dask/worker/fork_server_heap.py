"""The fork server's last preload: its heap, every import before this one included, is
frozen out of later full collections (``gc.freeze``), as CPython's ``gc`` documentation
advises before forking.

Each worker forked from the server then starts with that heap frozen: ``WorkerHeap``'s
collection at the worker's start, which the runner's plugin registration waits for,
scans only what the worker made since its fork, and the pages of the frozen objects stay
shared with the server instead of being copied when a collection touches them. The heap
is not collected first, which would delay the server's first fork: the few unreachable
objects the imports leave (``benchmarks/probes/fork_server_heap.py``) stay for the
worker's life. Imported only by the fork server (``prefect_gpu_dask.forkserver``).
"""

import gc

gc.freeze()
