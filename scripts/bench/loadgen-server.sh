#!/usr/bin/env bash
# One `loadgen` pass against a release dispatcher started by hand on a
# fresh data directory (as `loadgen` would start its own, but with a
# given binary, so two builds can be alternated in one window). Prints
# the report's throughput and latency lines; the whole report goes to
# OUT.
#
#   scripts/bench/loadgen-server.sh DISPATCHER LOADGEN OUT [DISPATCHER FLAGS --] LOADGEN ARGS...
#
# e.g. issue 14's 50,000 jobs/s (500 agents, 70,000 offered, batches of 500):
#   scripts/bench/loadgen-server.sh target/release/dispatcher target/release/loadgen /tmp/lg.txt \
#     --heartbeat-ms 2000 --missed-heartbeats 3 -- \
#     --agents 500 --rate 70000 --batch 500 --duration-s 5 --job-ms 0
# and its 10,000 agents at 1 Hz with 5,000 submits/s:
#   scripts/bench/loadgen-server.sh target/release/dispatcher target/release/loadgen /tmp/lg10k.txt \
#     -- --agents 10000 --rate 5000 --duration-s 20 --pending 1000
# (build: nice cargo build --release -p dispatcher --bin dispatcher -p e2e --bin loadgen)
set -euo pipefail
D=$1 L=$2 OUT=$3
shift 3
dflags=()
if [[ " $* " == *" -- "* ]]; then
  while [ "$1" != "--" ]; do dflags+=("$1"); shift; done
  shift
fi
W=$(mktemp -d)
ulimit -n 65536 2>/dev/null || true
# --submit-rate 0: no per-client rate limit (loadgen's own dispatcher runs so).
"$D" --listen 127.0.0.1:0 --data-dir "$W/d" --submit-rate 0 "${dflags[@]}" > "$W/d.log" 2>&1 &
DP=$!
trap 'kill $DP 2>/dev/null; wait $DP 2>/dev/null; rm -rf "$W"' EXIT
for _ in $(seq 100); do grep -qs "DISPATCH_SERVER=" "$W/d.log" && break; sleep 0.1; done
URL=$(grep -o "DISPATCH_SERVER=[^ ]*" "$W/d.log" | head -1 | cut -d= -f2)
[ -n "$URL" ] || { echo "dispatcher did not start:" >&2; cat "$W/d.log" >&2; exit 1; }
"$L" --server "$URL" --pid "$DP" "$@" > "$OUT" 2>&1
grep -E "accepted rate|accepted / failed|finished at the agents|submit->Assign|CPU under load|drained" "$OUT"
