#!/usr/bin/env bash
# The release dispatcher under callgrind, one output file per thread,
# while `loadgen` runs 20,000 jobs through it (50 agents, 1,000 jobs/s
# in SubmitJobs of 500, jobs of 0 ms). Instruction counts repeat within
# ~0.3% between runs of one binary, where the wall clock of the 50,000
# jobs/s run moves by 10-30%: compare two builds by their threads'
# totals (`grep ^summary: OUT.*-*`). The threads are numbered in the
# order they start: the tokio worker that serves the agents and the
# submissions, the core (`dispatch-core`) and the store
# (`dispatch-store`) are the three large ones; `callgrind_annotate`
# tells which is which. The totals include loadgen's polling ListJobs
# while the last jobs drain, the same for both builds.
#
#   scripts/bench/cg-loadgen.sh DISPATCHER LOADGEN OUT
#   (nice cargo build --release -p dispatcher --bin dispatcher -p e2e --bin loadgen)
set -euo pipefail
D=$1 L=$2 O=$3
W=$(mktemp -d)
valgrind --tool=callgrind --separate-threads=yes --callgrind-out-file="$O.%p" \
  "$D" --listen 127.0.0.1:0 --data-dir "$W/d" --submit-rate 0 > "$W/d.log" 2>&1 &
DP=$!
trap 'kill $DP 2>/dev/null; wait $DP 2>/dev/null; rm -rf "$W"' EXIT
for _ in $(seq 600); do grep -qs "DISPATCH_SERVER=" "$W/d.log" && break; sleep 0.1; done
URL=$(grep -o "DISPATCH_SERVER=[^ ]*" "$W/d.log" | head -1 | cut -d= -f2)
[ -n "$URL" ] || { echo "dispatcher did not start:" >&2; cat "$W/d.log" >&2; exit 1; }
"$L" --server "$URL" --agents 50 --rate 1000 --batch 500 --duration-s 20 --job-ms 0 --pending 0 > "$O.loadgen" 2>&1
grep -E "accepted / failed" "$O.loadgen"
# SIGTERM: the dispatcher exits cleanly and callgrind writes its files.
kill -TERM $DP
wait $DP || true
trap 'rm -rf "$W"' EXIT
for f in "$O".*-*; do
  echo "$f $(grep -E '^summary:' "$f" | awk '{print $2}')"
done
