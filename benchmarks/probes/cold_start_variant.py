"""``cold_start.py`` with ``dask.array`` imported first (``--dask-array``, as a flow that
uses it does) and/or the workers' fork server started only as the flow run enters the
runner (``--late``: the runner's constructor starts none, as before the server started as
the runner is made). Alternate the variants, each a fresh process:

    for v in "--dask-array" "--dask-array --late" "" "--late"; do
      PREFECT_HOME=$(mktemp -d) python benchmarks/probes/cold_start_variant.py $v
    done
"""

import os
import runpy
import sys
import time

if "--dask-array" in sys.argv:
    started = time.perf_counter()
    import dask.array  # noqa: F401

    print(f"dask.array imported in {time.perf_counter() - started:.3f} s")
if "--late" in sys.argv:
    import prefect_gpu_dask.flow.runner as runner_module

    runner_module.is_main_process = lambda: False
runpy.run_path(os.path.join(os.path.dirname(os.path.abspath(__file__)), "cold_start.py"), run_name="__main__")
