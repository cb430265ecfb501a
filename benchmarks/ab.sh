#!/usr/bin/env bash
# An A/B on one warm machine: one benchmark command run against an older package and this
# tree's, in turn, ROUNDS times each, so the host's drift falls on both sides alike.
#
#   git archive <commit> prefect_gpu_dask benchmarks tests flows | xz > .whl/old-<commit>.tar.xz
#   OLD=.whl/old-<commit>.tar.xz ROUNDS=3 LABEL=guard bash benchmarks/ab.sh benchmarks/run.py --sections guard
#
# The command is a Python script path relative to a tree, and its arguments; each side runs
# it from its own tree (after benchmarks/gpu_run.sh has installed /tmp/site). Output:
# $OUT/ab-$LABEL.txt, each run headed "## run K-old|new", its JSON under $OUT/ab-$LABEL/.
# FRESH_HOME=1: each run with a fresh PREFECT_HOME (a process's first flow run, on a new
# embedded server), as benchmarks/probes/cold_start.py wants.
set -uo pipefail
: "${OLD:?OLD=<git archive of the older package>}"
OUT=${OUT:-$PWD/gpu-out}
ROUNDS=${ROUNDS:-3}
LABEL=${LABEL:-ab}
LIMIT=${LIMIT:-300}
old_tree=$(mktemp -d)
tar xf "$OLD" -C "$old_tree"
python3 -m compileall -q -j 0 "$old_tree/prefect_gpu_dask" > /dev/null 2>&1
site=${SITE:-/tmp/site}
report="$OUT/ab-$LABEL.txt"
mkdir -p "$OUT/ab-$LABEL"
echo "# A/B, alternating: old = $(basename "$OLD"), new = this tree; $ROUNDS rounds; $*" > "$report"
for ((round = 1; round <= ROUNDS; round++)); do
  for side in old new; do
    tree=$PWD
    [ "$side" = old ] && tree=$old_tree
    echo "## run $round-$side" >> "$report"
    home=()
    [ "${FRESH_HOME:-0}" = 1 ] && home=("PREFECT_HOME=$(mktemp -d)")
    (cd "$tree" && env "${home[@]}" PYTHONPATH="$tree:$site" timeout -k 10 "$LIMIT" python3 "$@" \
      --out "$OUT/ab-$LABEL/$round-$side") >> "$report" 2>&1
    echo "# exit $?" >> "$report"
  done
done
rm -rf "$old_tree"
