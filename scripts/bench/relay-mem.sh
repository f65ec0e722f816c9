#!/usr/bin/env bash
# The dispatch-relay process's RSS with N fake agents (loadgen --attach-url)
# attached to it, and the dispatcher's bytes per node behind it.
# Usage: scripts/bench/relay-mem.sh N   (after nice cargo build --release
#   -p dispatcher -p dispatch-relay -p e2e --bin loadgen)
set -eu
N=$1
W=$(mktemp -d)
B=${BIN_DIR:-target/release}
ulimit -n 65536 2>/dev/null || true
$B/dispatcher --listen 127.0.0.1:0 --data-dir $W/d --heartbeat-ms 2000 > $W/d.log 2>&1 &
DP=$!
for i in $(seq 100); do grep -q "DISPATCH_SERVER=" $W/d.log && break; sleep 0.1; done
DURL=$(grep -o "DISPATCH_SERVER=[^ ]*" $W/d.log | head -1 | cut -d= -f2)
$B/dispatch-relay --listen 127.0.0.1:0 --dispatcher $DURL > $W/r.log 2>&1 &
RP=$!
for i in $(seq 100); do grep -q "listening on" $W/r.log && break; sleep 0.1; done
RURL=$(grep -o "listening on [^ ]*" $W/r.log | head -1 | cut -d' ' -f3)
sleep 1
R0=$(awk '/VmRSS/{print $2}' /proc/$RP/status)
RUST_LOG=warn $B/loadgen --server $DURL --pid $DP --attach-url $RURL --agents $N --rate 20 --duration-s 15 --job-ms 500 > $W/lg.out 2>$W/lg.err &
LP=$!
PEAK=0; SUM=0; CNT=0
while kill -0 $LP 2>/dev/null; do
  R=$(awk '/VmRSS/{print $2}' /proc/$RP/status)
  [ "$R" -gt "$PEAK" ] && PEAK=$R
  sleep 1
done
wait $LP || true
R1=$(awk '/VmRSS/{print $2}' /proc/$RP/status)
echo "N=$N relay_rss_idle_kib=$R0 relay_rss_peak_kib=$PEAK relay_rss_after_kib=$R1 per_agent_bytes=$(( (PEAK-R0)*1024 / N ))"
grep -i "rss\|memory\|per node\|registered in" $W/lg.out | head -8
kill $RP $DP; wait 2>/dev/null || true
rm -rf $W
