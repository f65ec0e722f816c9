#!/usr/bin/env bash
# Instructions and simulated cache misses per operation of the placement
# bench's measured loops, ours and the least-loaded scan, each counted
# alone: callgrind with its cache simulation, collecting only inside
# `measured_ours` (then `steady_least_loaded`), the bench's never-inlined
# measured steady-state loops (one op = submit one job + finish one; ours'
# warm-up past the retention cap runs the same `steady_ours` outside
# `measured_ours`, uncounted). Whatever the compiler inlines into them
# (fat LTO inlines `Cluster::submit`), the figure stays the same loop's.
#
#   scripts/bench/per-op.sh BIN NODES OUTDIR [BATCH]
#
# BATCH (default 1): the bench's `--batch K`, K submits then K finishes per
# round instead of one of each alternated (see the bench's docs).
#
# BIN is the placement bench binary (target/release/deps/placement-<hash>,
# built by `cargo build --release -p dispatcher --bench placement`; pick the
# newest). The figures include the bench's own steps (building the job
# spec, its account of running jobs): they are the loop that the
# decisions/s column times. I1 misses are callgrind's model of a 32 KiB
# 8-way first-level instruction cache: a path whose code does not fit
# pays a miss per 64-byte line it runs, which is why they are shown.
set -euo pipefail
bin=$1 nodes=$2 out=$3 batch=${4:-1}
mkdir -p "$out"
for side in measured_ours steady_least_loaded; do
  valgrind --tool=callgrind --cache-sim=yes --toggle-collect="placement::$side" \
    --callgrind-out-file="$out/$side.$nodes.out" \
    "$bin" --bench --nodes "$nodes" --batch "$batch" >"$out/bench.$side.$nodes.txt" 2>"$out/valgrind.$side.$nodes.log"
done
python3 - "$out" "$nodes" "$batch" <<'PY'
import re, sys
out, nodes, batch = sys.argv[1], sys.argv[2], sys.argv[3]
ops = {"1000": 20000, "10000": 20000, "100000": 5000}[nodes]
def totals(side):
    events, summary = None, None
    for line in open(f"{out}/{side}.{nodes}.out"):
        if line.startswith("events:"):
            events = line.split()[1:]
        elif line.startswith("summary:"):
            summary = [int(x) for x in line.split()[1:]]
    return dict(zip(events, summary))
rows = {side: totals(side) for side in ("measured_ours", "steady_least_loaded")}
print(f"{nodes} nodes, {ops:,} ops, batch {batch}: per op")
print(f"{'':>10} {'instr':>10} {'I1 miss':>9} {'D1 miss':>9} {'LL miss':>9}")
for side, name in (("measured_ours", "ours"), ("steady_least_loaded", "scan")):
    t = rows[side]
    d1 = t.get("D1mr", 0) + t.get("D1mw", 0)
    ll = t.get("ILmr", 0) + t.get("DLmr", 0) + t.get("DLmw", 0)
    print(f"{name:>10} {t['Ir'] / ops:>10,.0f} {t['I1mr'] / ops:>9,.1f} {d1 / ops:>9,.1f} {ll / ops:>9,.1f}")
PY
