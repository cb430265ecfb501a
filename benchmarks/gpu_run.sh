#!/usr/bin/env bash
# Everything the GPU machine proves, in one batch (see ../shared/device/README.md):
# GPU tests, the GPU flows, the benchmark suite. Output goes to $OUT (default ./gpu-out).
#   PHASES=tests,flows,probes,busy,host,sqlite,bench (default: all but busy)   BENCH_ARGS="--sections cube,scaling"
# Carry [".whl"] (../shared/device/make-wheels, plus this project's own wheel,
# `pip wheel --no-deps -w .whl .`, for its entry points: the code itself runs from the tree),
# and ".pg" (benchmarks/pack_postgres.sh) for the benchmarks' PostgreSQL rounds.
set -uo pipefail
OUT=${OUT:-$PWD/gpu-out}
PHASES=${PHASES:-tests,flows,probes,host,sqlite,bench}
mkdir -p "$OUT"
if [ -d .whl ]; then  # once per machine, again when the wheels change
  wheels=$(ls -l .whl | md5sum | cut -d' ' -f1)
  if [ "$(cat /tmp/site/.wheels 2>/dev/null)" != "$wheels" ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl &&
      echo "$wheels" > /tmp/site/.wheels
  fi
fi
# The image sets PYTHONDONTWRITEBYTECODE: without compiled bytecode every process (each
# worker start included) would compile its imports again, which a pip install spares users.
[ -d /tmp/site ] && python3 -m compileall -q -j 0 /tmp/site "$PWD/prefect_gpu_dask" > /dev/null 2>&1
[ -d /tmp/site ] && export PYTHONPATH=$PWD:/tmp/site
if [ -f .pg/postgres.tar.xz ] && ! ls /usr/lib/postgresql/*/bin/postgres >/dev/null 2>&1; then
  # PostgreSQL packed here by benchmarks/pack_postgres.sh: a library the host lacks comes from
  # the pack; PostgreSQL refuses to run as root, so it runs as a 'postgres' user.
  pack=$(mktemp -d) && tar xJf .pg/postgres.tar.xz -C "$pack" &&
    cp -a "$pack"/usr/lib/postgresql /usr/lib/ && cp -a "$pack"/usr/share/postgresql /usr/share/ &&
    mkdir -p /usr/local/lib/postgres-pack && known=$(ldconfig -p) &&
    for lib in "$pack"/pglibs/*; do
      grep -qF "$(basename "$lib") (" <<<"$known" || cp "$lib" /usr/local/lib/postgres-pack/
    done &&
    echo /usr/local/lib/postgres-pack > /etc/ld.so.conf.d/postgres-pack.conf && ldconfig
  [ -d /usr/share/zoneinfo ] || ln -s /tmp/site/tzdata/zoneinfo /usr/share/zoneinfo
  id postgres >/dev/null 2>&1 || useradd --system --no-create-home postgres
  if ! /usr/lib/postgresql/*/bin/postgres --version; then
    ldd /usr/lib/postgresql/*/bin/postgres | grep "not found"
    rm -rf /usr/lib/postgresql  # the benchmarks then skip PostgreSQL, saying why
  fi
fi
export PYTHONUNBUFFERED=1 PREFECT_SERVER_ANALYTICS_ENABLED=false
quiet() {
  grep -vE "distributed\.(core|nanny|scheduler|worker|http|comm|preloading|utils_perf|shuffle)|^\s*$" |
    grep -vE "(Task|Flow) run '[^']*' - Finished in state Completed\(\)$"
}
{
  echo "# $(nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | paste -sd';'); $(nproc) host cores; $(date -u +%FT%TZ)"
  python3 -c "import dask, distributed, dask_cuda, prefect, cupy; print('dask', dask.__version__, 'distributed', distributed.__version__, 'dask-cuda', dask_cuda.__version__, 'prefect', prefect.__version__, 'cupy', cupy.__version__)"
} > "$OUT/environment.txt" 2>&1
# Each step writes to a file, not a pipe, and a step past its time is stopped with all it
# started (timeout signals its process group; KILL 10 s after TERM, as Prefect's engine
# may take minutes to report a crash): a Prefect server or Dask worker left holding a
# pipe open would hold the batch. The host cluster, in a session of its own, is stopped.
step() {  # step SECONDS OUTFILE COMMAND...: COMMAND's output in OUTFILE, its exit status
  local limit=$1 out=$2 rc
  shift 2
  timeout -k 10 "$limit" "$@" > "$out" 2>&1
  rc=$?
  case $rc in
    124) echo "# stopped after $limit s" >> "$out" ;;
    137) echo "# killed (SIGKILL: past its time and deaf to TERM, or the kernel's OOM killer)" >> "$out" ;;
  esac
  if [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then
    timeout -k 5 60 python3 -m prefect_gpu_dask cluster stop > /dev/null 2>&1
  fi
  return "$rc"
}
filtered() {  # filtered RAW OUT FILTER...: FILTER RAW into OUT, then drop RAW
  local raw=$1 out=$2
  shift 2
  "$@" < "$raw" > "$out"
  rm -f "$raw"
}
if [[ $PHASES == *tests* ]]; then
  step ${TESTS_TIMEOUT:-300} "$OUT/gpu-tests-raw.txt" python3 -m pytest -o addopts="" -p no:cacheprovider -m gpu -v -s tests/
  filtered "$OUT/gpu-tests-raw.txt" "$OUT/gpu-tests.txt" quiet
  tail -3 "$OUT/gpu-tests.txt"
fi
if [[ $PHASES == *flows* ]]; then
  for flow in speed_cube svd leak_demo; do
    step 90 "$OUT/flow-$flow-raw.txt" python3 "flows/$flow.py"
    echo "flows/$flow.py exit $?" >> "$OUT/flow-$flow-raw.txt"
    filtered "$OUT/flow-$flow-raw.txt" "$OUT/flow-$flow.txt" quiet
    tail -2 "$OUT/flow-$flow.txt"
  done
fi
if [[ $PHASES == *probes* ]]; then
  step 120 "$OUT/probe-first-use.txt" python3 benchmarks/probes/library_first_use.py --out "$OUT/first-use.json"
  step 120 "$OUT/probe-cold-start.txt" sh -c \
    'for i in 1 2 3; do PREFECT_HOME=$(mktemp -d) python3 benchmarks/probes/cold_start.py 2>/dev/null; done'
  tail -n 12 "$OUT"/probe-*.txt
fi
if [[ $PHASES == *busy* ]]; then  # several flow runs on one GPU at once (benchmarks/busy_night.py)
  for flows in 4 8; do
    for mode in default host-cluster; do
      extra=$([ $mode = host-cluster ] && echo --host-cluster)
      step 280 "$OUT/busy-$flows-$mode.txt" python3 benchmarks/busy_night.py --flows $flows $extra \
        --hold ${BUSY_HOLD:-8} --run-timeout 240 --out "$OUT/busy-$flows-$mode.json"
      tail -14 "$OUT/busy-$flows-$mode.txt"
    done
  done
fi
if [[ $PHASES == *host* ]]; then  # flow runs sharing one GPU host; the operator's commands
  for flows in 2 4; do
    name="shared-gpu-host-$flows-host-cluster-leak"
    step 150 "$OUT/$name-raw.txt" python3 benchmarks/shared_gpu_host.py --flows $flows --host-cluster --leak-in-one \
      --tasks 10 --out "$OUT/$name.json"
    filtered "$OUT/$name-raw.txt" "$OUT/$name.txt" quiet
    tail -22 "$OUT/$name.txt"
  done
  step 120 "$OUT/operations-raw.txt" python3 benchmarks/probes/operations.py --gpu
  filtered "$OUT/operations-raw.txt" "$OUT/operations.txt" quiet
  step 150 "$OUT/host-cluster-raw.txt" python3 benchmarks/probes/host_cluster.py --joins 10 --starts 3 --tasks 500 \
    --repeat 3 --out "$OUT/host-cluster.json"
  filtered "$OUT/host-cluster-raw.txt" "$OUT/host-cluster.txt" quiet
  tail -8 "$OUT/host-cluster.txt"
fi
if [[ $PHASES == *sqlite* ]]; then  # the README's default: embedded SQLite server, fresh PREFECT_HOME
  step ${SQLITE_TIMEOUT:-480} "$OUT/sqlite-default.txt" sh -c \
    'exec python3 benchmarks/sqlite_default.py --out "$1/sqlite-default.json" 2>"$1/sqlite-default-stderr.txt"' _ "$OUT"
  tail -16 "$OUT/sqlite-default.txt"
fi
if [[ $PHASES == *bench* ]]; then
  # shellcheck disable=SC2086  # BENCH_ARGS are words
  step ${BENCH_TIMEOUT:-400} "$OUT/bench-raw.txt" python3 benchmarks/run.py --out "$OUT/results" ${BENCH_ARGS:-}
  quiet < "$OUT/bench-raw.txt" > "$OUT/bench.txt"
  tail -40 "$OUT/bench.txt"
fi
