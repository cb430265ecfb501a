#!/usr/bin/env bash
# RAPIDS on the GPU machine (issue 66): doctor, the RAPIDS GPU tests, the cuDF ETL flow on
# cuDF and on pandas at the same size, and the numpy 2.5 clash. Output under $OUT.
# The RAPIDS wheels come first in parts (../shared/device/README.md, split-for-carry) into
# /tmp/carry on the same warm machine; carry [".whl"] for this call. COMMIT names the tree.
set -uo pipefail
OUT=${OUT:-$PWD/rapids-out}
ROWS=${ROWS:-1000000} PARTS=${PARTS:-16}
mkdir -p "$OUT" /tmp/carried /tmp/site-big /tmp/np24
if [ ! -f /tmp/site-big/.done ]; then
  cat /tmp/carry/part* | tar -x -C /tmp/carried &&
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/np24 /tmp/carried/numpy-*.whl &&
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site-big \
      $(ls /tmp/carried/*.whl | grep -v /numpy-) && touch /tmp/site-big/.done || echo "# RAPIDS install failed"
fi
[ -d /tmp/site/prefect ] || python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
  --upgrade --target /tmp/site .whl/*.whl
export PYTHONUNBUFFERED=1 PREFECT_SERVER_ANALYTICS_ENABLED=false
FIXED=$PWD:/tmp/np24:/tmp/site-big:/tmp/site  # numpy 2.4 ahead of the image's 2.5
CLASH=$PWD:/tmp/site-big:/tmp/site            # the image's numpy 2.5: cuDF cannot import
step() {  # step SECONDS OUTFILE PYTHONPATH COMMAND...
  local limit=$1 out=$2 path=$3 began=$SECONDS rc
  shift 3
  PYTHONPATH=$path timeout -k 5 "$limit" "$@" > "$out" 2>&1
  rc=$?
  echo "# exit $rc after $((SECONDS - began)) s" >> "$out"
}
{
  echo "# $(nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader); $(nproc) cores; $(date -u +%FT%TZ); commit ${COMMIT:-?}"
  PYTHONPATH=$FIXED python3 -c "import numpy, pandas, dask, distributed, dask_cuda, prefect, cupy, rmm, cudf, dask_cudf, numba_cuda
print('numpy', numpy.__version__, 'pandas', pandas.__version__, 'dask', dask.__version__, 'distributed', distributed.__version__, 'dask-cuda', dask_cuda.__version__, 'prefect', prefect.__version__, 'cupy', cupy.__version__, 'rmm', rmm.__version__, 'cudf', cudf.__version__, 'dask-cudf', dask_cudf.__version__, 'numba-cuda', numba_cuda.__version__)"
} > "$OUT/environment.txt" 2>&1
step 60 "$OUT/doctor.txt" "$FIXED" python3 -c "from prefect_gpu_dask.cli.main import main; main(['doctor'])"
step 200 "$OUT/tests.txt" "$FIXED" python3 -m pytest -p no:cacheprovider -o addopts="" -v -s \
  tests/integration/test_rapids.py tests/unit/test_rmm_verdict.py
step 90 "$OUT/etl-cudf.txt" "$FIXED" python3 flows/cudf_etl.py /tmp/etl-cudf cudf "$PARTS" "$ROWS"
step 120 "$OUT/etl-pandas.txt" "$FIXED" python3 flows/cudf_etl.py /tmp/etl-pandas pandas "$PARTS" "$ROWS"

step 70 "$OUT/etl-numpy25.txt" "$CLASH" python3 flows/cudf_etl.py /tmp/etl-clash
