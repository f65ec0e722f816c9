#!/usr/bin/env bash
# Ours against least-loaded on cluster and machine shapes, and workloads,
# that the generated benchmarks do not use: the check that quality is not
# tuned to the tables of docs/BENCHMARKS.md. Every run is `dispatch-sim
# synthetic` with `--jobs-out`; the table puts each run's two policies
# side by side (bounded slowdown, mean response, p99 wait, utilization)
# with the wait of its widest jobs (the largest CPU count of the run),
# where a queue's tail is made, and marks a run where ours is worse in
# mean or bounded slowdown.
#
#   scripts/bench/sweep-shapes.sh SIM [OUTDIR]
#
# SIM is a release `dispatch-sim` (cargo build --release -p sim). OUTDIR
# keeps each run's summary CSV and its jobs (`OUTDIR/jobs/`); without it
# they go to a temporary directory, removed at the end. The whole sweep:
# ~7 s on 2 cores. `bench/run.sh` runs it into docs/BENCHMARKS.md.
set -euo pipefail
sim=$1
if [ $# -ge 2 ]; then
  out=$2
else
  out=$(mktemp -d)
  trap 'rm -rf "$out"' EXIT
fi
mkdir -p "$out"
run() {
  local name=$1
  shift
  "$sim" synthetic --name "$name" "$@" --policies least-loaded,ours \
    --format csv --jobs-out "$out/jobs" --no-progress >"$out/$name.csv"
}
# Shapes: whole-node jobs on 4-CPU nodes, 256-CPU nodes, a mix of node
# sizes, 2-CPU nodes beside 32-CPU ones.
run small4 --jobs 20000 --cluster 1z:4r:8n --node 1s:4c:1t --cpus 1:6,2:3,4:1 --load 0.9
run big256 --jobs 20000 --cluster 1z:2r:4n --node 4s:32c:2t --cpus 1-64 --load 0.9
run hetero --jobs 20000 --cluster 2z:5r:10n --node '2s:16c:2t*3,1s:8c:2t' --load 0.95
run tinymix --jobs 20000 --cluster 1z:5r:8n --node '1s:2c:1t*4,2s:8c:2t' --load 0.9
# Workloads: heavy tail in bursts, one-CPU jobs, wide jobs, overload,
# fan-out heavy, gangs, no time limits.
run pareto-burst --jobs 20000 --cluster 2z:4r:10n --node 2s:8c:2t --durations pareto:1.2:60 --arrivals bursty:2:600 --load 0.95
run ones --jobs 30000 --cluster 1z:4r:10n --node 1s:8c:2t --cpus 1 --durations exp:30 --load 0.95
run wide --jobs 20000 --cluster 1z:4r:10n --node 2s:16c:2t --cpus 16-64 --load 0.85
run overload --jobs 20000 --cluster 2z:4r:10n --node 2s:8c:2t --load 1.2
run fanout-heavy --jobs 20000 --cluster 2z:4r:10n --node 2s:8c:2t --fanout 0.3:32 --load 0.8
run gangs --jobs 20000 --cluster 2z:4r:10n --node 2s:8c:2t --gangs 0.2:4 --load 0.8
run no-limits --jobs 20000 --cluster 2z:4r:10n --node 2s:8c:2t --limit-overestimate -1 --load 0.9
# A cluster of eight 4-CPU nodes (two racks of four), five seeds: the default mix's 8- and
# 16-CPU jobs become whole-node jobs, 40% of all.
for seed in 1 2 3 4 5; do
  run "tiny-s$seed" --jobs 20000 --cluster 1z:2r:4n --node 1s:4c:1t --load 0.9 --seed "$seed"
done
python3 - "$out" "$(dirname "$0")" <<'PY'
import csv, glob, os, sys
out = sys.argv[1]
sys.dont_write_bytecode = True
sys.path.insert(0, sys.argv[2])
from widest_jobs import pct, widest_waits

def widest(name, policy):
    top, w = widest_waits(f"{out}/jobs/{name}.{policy}.jobs.csv")
    return top, sum(w) / len(w), pct(w, 99), max(w)

print("| run | bsld ours / ll | mean resp s ours / ll | p99 wait s ours / ll | util ours / ll | widest jobs (CPUs): mean wait s ours / ll | their p99 wait | their max wait |")
print("|---|--:|--:|--:|--:|--:|--:|--:|")
order = sorted(glob.glob(f"{out}/*.csv"), key=os.path.getmtime)
for f in order:
    name = os.path.basename(f)[:-4]
    rows = {r["policy"]: r for r in csv.DictReader(open(f))}
    o, l = rows["ours"], rows["least-loaded"]
    g = lambda r, k: float(r[k] or "nan")
    worse = g(o, "bsld_mean") > g(l, "bsld_mean") * 1.001 or g(o, "resp_mean_s") > g(l, "resp_mean_s") * 1.001
    top, om, op, ox = widest(name, "ours")
    _, lm, lp, lx = widest(name, "least-loaded")
    mark = " **ours worse**" if worse else ""
    print(f"| {name}{mark} | {g(o,'bsld_mean'):.2f} / {g(l,'bsld_mean'):.2f} | {g(o,'resp_mean_s'):.1f} / {g(l,'resp_mean_s'):.1f} "
          f"| {g(o,'wait_p99_s'):.0f} / {g(l,'wait_p99_s'):.0f} | {g(o,'utilization'):.3f} / {g(l,'utilization'):.3f} "
          f"| ({top}) {om:.0f} / {lm:.0f} | {op:.0f} / {lp:.0f} | {ox:.0f} / {lx:.0f} |")
PY
