#!/usr/bin/env bash
# What the fleet soak's flow process keeps on its malloc heap per flow run: the soak
# (clean runs, `dask scheduler` + `dask worker` subprocesses) under heaptrack, for N and
# then 2N sequential flow runs; heaptrack_print's diff of what each left allocated at its
# exit is what N more flow runs keep. RSS, which also counts memory the allocators hold
# free, is the soak's own "sample after" lines.
#   bash benchmarks/probes/flow_process_heap.sh [N=20]       (needs heaptrack)
set -u
N=${1:-20}
python=$(python3 -c 'import sys; print(sys.executable)')  # not a shell shim: heaptrack follows exec
work=$(mktemp -d)
for runs in "$N" $((2 * N)); do
  heaptrack -o "$work/heap-$runs" "$python" benchmarks/fleet_soak.py --runs "$runs" --concurrent-runs 0 \
    --fault-every 0 --cluster cli --sample-every 10 --out "$work/soak-$runs.json" 2>&1 |
    grep -E "^sample after" | cut -d' ' -f1-8 | sed "s/^/$runs runs: /"
  echo "$runs runs: $(heaptrack_print -f "$work/heap-$runs.zst" 2>/dev/null | grep -E 'total memory leaked|peak heap')" |
    tr '\n' ' '
  echo
done
echo "left allocated at exit, $((2 * N)) runs minus $N runs:"
heaptrack_print -f "$work/heap-$((2 * N)).zst" -d "$work/heap-$N.zst" --print-leaks 1 --print-peaks 0 \
  --print-allocators 0 --print-temporary 0 --print-histogram 0 --print-flamegraph 0 2>/dev/null |
  grep -E "leaked over|total memory leaked" | head -12
rm -rf "$work"
