#!/usr/bin/env bash
# The relay's hop: the same loadgen run (N fake agents, RATE submits/s,
# D seconds) against one dispatcher, first with the agents attached
# directly, then through a dispatch-relay; loadgen's submit->Assign and
# Attach->Registered latencies both ways, and the relay's CPU (utime+stime
# from /proc) per message it carried (dispatch_relay_messages_total, both
# directions, from its /metrics).
# Usage: scripts/bench/relay-hop.sh N RATE D   (after nice cargo build
#   --release -p dispatcher -p dispatch-relay -p e2e --bin loadgen)
set -eu
N=$1; RATE=$2; D=$3
W=$(mktemp -d)
B=${BIN_DIR:-target/release}
TCK=$(getconf CLK_TCK)
ulimit -n 65536 2>/dev/null || true
$B/dispatcher --listen 127.0.0.1:0 --data-dir $W/d --heartbeat-ms 2000 > $W/d.log 2>&1 &
DP=$!
for i in $(seq 100); do grep -q "DISPATCH_SERVER=" $W/d.log && break; sleep 0.1; done
DURL=$(grep -o "DISPATCH_SERVER=[^ ]*" $W/d.log | head -1 | cut -d= -f2)
$B/dispatch-relay --listen 127.0.0.1:0 --metrics-listen 127.0.0.1:0 --dispatcher $DURL > $W/r.log 2>&1 &
RP=$!
for i in $(seq 100); do grep -q "listening on" $W/r.log && break; sleep 0.1; done
RURL=$(grep -o "listening on [^ ]*" $W/r.log | head -1 | cut -d' ' -f3)
MURL=$(grep -o "metrics on [^ ]*" $W/r.log | head -1 | cut -d' ' -f3)
cpu() { awk '{print $14+$15}' /proc/$1/stat; }
msgs() { curl -s $MURL | awk '/^dispatch_relay_messages_total/{s+=$2} END{print s+0}'; }
frames() { curl -s $MURL | awk '/^dispatch_relay_frames_total/{s+=$2} END{print s+0}'; }
run() { # $1: label, rest: extra loadgen args
  local label=$1; shift
  local c0 m0 f0 d0
  c0=$(cpu $RP); m0=$(msgs); f0=$(frames); d0=$(cpu $DP)
  RUST_LOG=warn $B/loadgen --server $DURL --pid $DP "$@" --agents $N --rate $RATE \
    --duration-s $D --job-ms 200 --seed 7 > $W/$label.out 2>$W/$label.err || true
  local c1 m1 f1 d1
  c1=$(cpu $RP); m1=$(msgs); f1=$(frames); d1=$(cpu $DP)
  echo "== $label: relay cpu_ticks=$((c1-c0)) messages=$((m1-m0)) frames=$((f1-f0)) dispatcher cpu_ticks=$((d1-d0)) (CLK_TCK=$TCK)"
  if [ $((m1-m0)) -gt 0 ]; then
    echo "   relay CPU per message: $(( (c1-c0) * 1000000000 / TCK / (m1-m0) )) ns"
  fi
  grep -m1 "^| " $W/$label.out; grep -E "submit->Assign|Attach->Registered|SubmitJob " $W/$label.out | head -4
}
run direct
run relay --attach-url $RURL
kill $RP $DP; wait 2>/dev/null || true
rm -rf $W
