#!/usr/bin/env bash
# The nine simulator workloads every placement change is checked on, each
# written to OUTDIR/<name>.txt: KTH-SP2, NASA-iPSC, NASA at time-scale 1.6,
# KTH and NASA with gangs, and the four synthetic mixes at 100,000 jobs.
# Compare two runs with scripts/bench/cmp.py (timing columns ignored).
#
#   scripts/bench/sims.sh SIM OUTDIR [TRACES]
set -euo pipefail
sim=$1 out=$2 traces=${3:-../shared/traces}
mkdir -p "$out"
kth=$traces/KTH-SP2-1996-2.1-cln.swf.gz
nasa=$traces/NASA-iPSC-1993-3.1-cln.swf.gz
run() { local name=$1; shift; "$sim" "$@" --no-progress >"$out/$name.txt" 2>"$out/$name.err"; }
run kth swf --trace "$kth" --policies ours,least-loaded --tick-ms 10000
run nasa swf --trace "$nasa" --policies ours,least-loaded --tick-ms 10000
run nasa-x1.6 swf --trace "$nasa" --policies ours,least-loaded --tick-ms 10000 --time-scale 1.6
run kth-gangs swf --trace "$kth" --policies ours,ours+pack --tick-ms 10000 --gangs
run nasa-gangs swf --trace "$nasa" --policies ours,ours+pack --tick-ms 10000 --gangs
run mixed synthetic --name mixed --jobs 100000 --load 0.9 --policies ours,least-loaded
run heavy-tail synthetic --name heavy-tail --jobs 100000 --load 0.85 --durations pareto:1.5:60 --arrivals bursty:1.8:300 --policies ours,least-loaded
run workflows synthetic --name workflows --jobs 100000 --load 0.8 --durations exp:60 --fanout 0.2:32 --pipeline 0.2:8 --policies ours,least-loaded
run light-load synthetic --name light-load --jobs 100000 --load 0.3 --durations exp:120 --policies ours,ours+pack
echo "wrote $out"
