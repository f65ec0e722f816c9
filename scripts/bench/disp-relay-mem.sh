#!/usr/bin/env bash
# The release dispatcher's RSS with N relayed nodes attached, K per
# AttachMany stream (one connection each), as a relay attaches them:
# `core_costs --attach` is the relays (Registers then one idle LoadReport
# per node, frames of at most 16 KiB (the relay's MAX_FRAME_BYTES), streams opened one after another).
# Prints the dispatcher's VmRSS before, its peak while the nodes
# registered (sampled every 0.1 s), and 2 s after the last Registered,
# each per node; and the dispatcher's CPU time (user + system, ms) from
# the attach's start to 2 s after the last Registered, and the attach's
# wall time (ms).
# Usage: scripts/bench/disp-relay-mem.sh DISPATCHER CORE_COSTS N K
#   (nice cargo build --release -p dispatcher --bin dispatcher --bin core_costs)
set -eu
D=$1; C=$2; N=$3; K=$4
W=$(mktemp -d)
ulimit -n 65536 2>/dev/null || true
$D --listen 127.0.0.1:0 --data-dir $W/d --heartbeat-ms 600000 > $W/d.log 2>&1 &
DP=$!
for i in $(seq 100); do grep -q "DISPATCH_SERVER=" $W/d.log && break; sleep 0.1; done
URL=$(grep -o "DISPATCH_SERVER=[^ ]*" $W/d.log | head -1 | cut -d= -f2)
sleep 1
rss() { awk '/VmRSS/{print $2}' /proc/$DP/status; }
R0=$(rss)
# utime + stime of the dispatcher, in clock ticks.
cpu() { awk '{print $14+$15}' /proc/$DP/stat; }
HZ=$(getconf CLK_TCK)
C0=$(cpu); T0=$(date +%s%N)
mkfifo $W/hold
# The relays hold their streams until the fifo's writer closes it.
$C --attach $URL --connections $N --nodes-per-stream $K < $W/hold > $W/attach.out 2>&1 &
AP=$!
exec 3> $W/hold
PEAK=$R0
until grep -q "^attached" $W/attach.out; do
  kill -0 $AP 2>/dev/null || { cat $W/attach.out; exit 1; }
  R=$(rss); [ "$R" -gt "$PEAK" ] && PEAK=$R
  sleep 0.1
done
T1=$(date +%s%N)
for i in $(seq 20); do R=$(rss); [ "$R" -gt "$PEAK" ] && PEAK=$R; sleep 0.1; done
R1=$(rss)
C1=$(cpu)
ANON=$(awk '/^Anonymous:/{print $2}' /proc/$DP/smaps_rollup)
HWM=$(awk '/VmHWM/{print $2}' /proc/$DP/status)
echo "N=$N K=$K rss0_kib=$R0 peak_kib=$PEAK hwm_kib=$HWM after_kib=$R1 anon_after_kib=$ANON" \
  "peak_per_node=$(( (PEAK-R0)*1024/N )) hwm_per_node=$(( (HWM-R0)*1024/N )) after_per_node=$(( (R1-R0)*1024/N ))" \
  "cpu_ms=$(( (C1-C0)*1000/HZ )) attach_ms=$(( (T1-T0)/1000000 ))"
exec 3>&-
wait $AP || true
kill $DP; wait $DP 2>/dev/null || true
rm -rf $W
