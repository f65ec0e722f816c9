#!/usr/bin/env bash
# The queue orders a site can choose, side by side under load (offered
# 0.85-1.2, where jobs queue): the default (the widest job that fits
# first, then the shortest remaining limit, with aging bounded by each
# job's own limit); `ours+widefirst:overdue` and `ours-widefirst`
# (`--widest-first overdue` / `never`); `ours+deadline`
# (`--deadline-order true`) and `ours-sjbf` (`--shortest-limit-first
# false`: by age), each also with `-widefirst`; and a central
# least-loaded queue. Seven cluster shapes and workloads (whole-node jobs
# on small nodes, 256-CPU nodes, wide jobs, overload, a heavy tail), five
# seeds each: 35 `dispatch-sim synthetic` runs that the generated tables
# do not use. For each order, the geometric mean over the 35 runs of its
# ratio to the default (below 1: lower, better), and the worst run's
# ratio, for mean response, bounded slowdown, the p99 wait of all jobs,
# and the p99 and longest wait of each run's widest jobs (its largest
# CPU count), where shortest-first makes its tail.
#
#   scripts/bench/queue-orders.sh SIM [OUTDIR]
#
# SIM is a release `dispatch-sim` (cargo build --release -p sim). OUTDIR
# keeps each run's summary CSV and jobs; without it they go to a
# temporary directory, removed at the end. ~55 s on 2 cores.
# `bench/run.sh` runs it into docs/BENCHMARKS.md; the README's "Queue
# order" section quotes it.
set -euo pipefail
sim=$1
if [ $# -ge 2 ]; then
  out=$2
else
  out=$(mktemp -d)
  trap 'rm -rf "$out"' EXIT
fi
mkdir -p "$out"
policies=ours,ours+widefirst:overdue,ours-widefirst,ours+deadline,ours+deadline-widefirst,ours-sjbf,ours-sjbf-widefirst,least-loaded
for seed in 11 12 13 14 15; do
  run() {
    local name=$1-s$seed
    shift
    "$sim" synthetic --name "$name" --seed "$seed" "$@" --policies "$policies" \
      --format csv --jobs-out "$out/jobs" --no-progress >"$out/$name.csv"
  }
  run small4 --jobs 20000 --cluster 1z:4r:8n --node 1s:4c:1t --cpus 1:6,2:3,4:1 --load 0.9
  run big256 --jobs 20000 --cluster 1z:2r:4n --node 4s:32c:2t --cpus 1-64 --load 0.9
  run wide --jobs 20000 --cluster 1z:4r:10n --node 2s:16c:2t --cpus 16-64 --load 0.85
  run tiny --jobs 20000 --cluster 1z:2r:4n --node 1s:4c:1t --load 0.9
  run tiny95 --jobs 20000 --cluster 1z:2r:4n --node 1s:4c:1t --load 0.95
  run mid8 --jobs 20000 --cluster 2z:4r:4n --node 1s:8c:1t --load 0.95 --durations pareto:1.3:120
  run overload --jobs 20000 --cluster 2z:4r:10n --node 2s:8c:2t --load 1.2
done
python3 - "$out" "$policies" "$(dirname "$0")" <<'PY'
import csv, glob, math, os, sys
out, policies = sys.argv[1], sys.argv[2].split(",")
sys.dont_write_bytecode = True
sys.path.insert(0, sys.argv[3])
from widest_jobs import pct, widest_waits

def figures(name, summary, policy):
    _, w = widest_waits(f"{out}/jobs/{name}.{policy}.jobs.csv")
    s = summary[policy]
    return {
        "mean response": float(s["resp_mean_s"]),
        "bounded slowdown": float(s["bsld_mean"]),
        "p99 wait": float(s["wait_p99_s"]),
        "widest p99 wait": pct(w, 99),
        "widest longest wait": max(w),
    }

runs = sorted(os.path.basename(f)[:-4] for f in glob.glob(f"{out}/*.csv"))
table = {}
for name in runs:
    summary = {r["policy"]: r for r in csv.DictReader(open(f"{out}/{name}.csv"))}
    table[name] = {p: figures(name, summary, p) for p in policies}
keys = list(table[runs[0]][policies[0]])
print(f"{len(runs)} runs; each cell: geometric mean of the ratio to `ours` (worst run's ratio)")
print()
print("| policy | " + " | ".join(keys) + " |")
print("|---|" + "--:|" * len(keys))
for p in policies:
    cells = []
    for k in keys:
        # +1 s keeps a run where both wait 0 s at a ratio of 1.
        r = [(table[n][p][k] + 1) / (table[n]["ours"][k] + 1) for n in runs]
        gm = math.exp(sum(math.log(x) for x in r) / len(r))
        cells.append(f"{gm:.2f} ({max(r):.2f})")
    print(f"| {p} | " + " | ".join(cells) + " |")
PY
