#!/usr/bin/env bash
# Everything the GPU machine proves, in one batch (see ../shared/device/README.md):
# GPU tests, the GPU flows, the benchmark suite. Output goes to $OUT (default ./gpu-out).
#   PHASES=tests,flows,probes,host,sqlite,bench (default: all six)   BENCH_ARGS="--sections cube,scaling"
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
if [[ $PHASES == *tests* ]]; then
  timeout ${TESTS_TIMEOUT:-300} python3 -m pytest -o addopts="" -p no:cacheprovider -m gpu -v -s tests/ 2>&1 | quiet > "$OUT/gpu-tests.txt"
  tail -3 "$OUT/gpu-tests.txt"
fi
if [[ $PHASES == *flows* ]]; then
  for flow in speed_cube svd leak_demo; do
    timeout 90 python3 "flows/$flow.py" 2>&1 | quiet > "$OUT/flow-$flow.txt"
    echo "flows/$flow.py exit $?" >> "$OUT/flow-$flow.txt"
    tail -2 "$OUT/flow-$flow.txt"
  done
fi
if [[ $PHASES == *probes* ]]; then
  timeout 120 python3 benchmarks/probes/library_first_use.py --out "$OUT/first-use.json" 2>&1 | tee "$OUT/probe-first-use.txt"
  timeout 120 python3 benchmarks/probes/flow_end.py 2>/dev/null | tee "$OUT/probe-flow-end.txt"
  timeout 240 python3 benchmarks/probes/tagged_path.py 1000 30 2>/dev/null | grep -v "| INFO" | tee "$OUT/probe-tagged-path.txt"
  timeout 240 python3 benchmarks/probes/console_lines.py --tasks 1000 --task-rounds 3 \
    --out "$OUT/console-lines.json" 2>/dev/null | tee "$OUT/probe-console-lines.txt"
fi
if [[ $PHASES == *host* ]]; then  # flow runs sharing one GPU host; the operator's commands
  for flows in 2 4; do
    timeout 150 python3 benchmarks/shared_gpu_host.py --flows $flows --host-cluster --leak-in-one --tasks 10 \
      --out "$OUT/shared-gpu-host-$flows-host-cluster-leak.json" 2>&1 | quiet > "$OUT/shared-gpu-host-$flows-host-cluster-leak.txt"
    tail -22 "$OUT/shared-gpu-host-$flows-host-cluster-leak.txt"
  done
  timeout 120 python3 benchmarks/probes/operations.py --gpu 2>&1 | quiet > "$OUT/operations.txt"
  timeout 150 python3 benchmarks/probes/host_cluster.py --joins 10 --starts 3 --tasks 500 --repeat 3 \
    --out "$OUT/host-cluster.json" 2>&1 | quiet > "$OUT/host-cluster.txt"
  tail -8 "$OUT/host-cluster.txt"
fi
if [[ $PHASES == *sqlite* ]]; then  # the README's default: embedded SQLite server, fresh PREFECT_HOME
  timeout ${SQLITE_TIMEOUT:-480} python3 benchmarks/sqlite_default.py --out "$OUT/sqlite-default.json" \
    2>"$OUT/sqlite-default-stderr.txt" | tee "$OUT/sqlite-default.txt" | tail -16
fi
if [[ $PHASES == *bench* ]]; then
  timeout ${BENCH_TIMEOUT:-400} python3 benchmarks/run.py --out "$OUT/results" ${BENCH_ARGS:-} 2>&1 |
    tee "$OUT/bench-raw.txt" | quiet > "$OUT/bench.txt"
  tail -40 "$OUT/bench.txt"
fi
