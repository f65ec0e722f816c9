#!/bin/bash
# loadgen-cpu.sh DISPATCHER LOADGEN OUT: issue 14's 50,000 jobs/s run of
# loadgen-server.sh (500 agents, 70,000 offered, batches of 500), plus the
# dispatcher's CPU seconds and minor faults per accepted job, read from
# /proc/PID/stat every 50 ms until it exits (its last reading), after the
# report's lines that loadgen-server.sh prints.
D=$1 L=$2 O=$3
"$(dirname "$0")/loadgen-server.sh" $D $L $O --heartbeat-ms 2000 --missed-heartbeats 3 -- --agents 500 --rate 70000 --batch 500 --duration-s 5 --job-ms 0 > $O.sum 2>&1 &
S=$!
P=
for i in $(seq 400); do P=$(pgrep -f "^$D --listen" | head -1); [ -n "$P" ] && break; sleep 0.01; done
# Bash builtins only (read, and a read with a timeout on a pipe nothing
# writes to as the 50 ms sleep): a `cat` and a `sleep` every 50 ms were 40
# processes a second, each ~1 ms of CPU on this machine (the dynamic
# loader's CPUID probes), taken from the dispatcher being measured.
exec {nap}<> <(:)
last=
while kill -0 $P 2>/dev/null; do
  read -r l < /proc/$P/stat 2>/dev/null && [ -n "$l" ] && last=$l
  read -r -t 0.05 -u $nap _ || true
done
exec {nap}>&-
wait $S
rest=${last##*) }
set -- $rest
minflt=$8; ut=${12}; st=${13}
acc=$(grep -o "accepted rate (per s) | [0-9]* / [0-9.]*" $O.sum | awk '{print $NF}')
jobs=$(grep -o "accepted / failed / not sent (in-flight cap) | [0-9]*" $O.sum | awk '{print $NF}')
cpu=$(grep "dispatcher CPU under load" $O.sum | awk -F'|' '{print $3}')
cat $O.sum
python3 -c "
ut,st,mf,jobs=$ut,$st,$minflt,$jobs
print(f'$D accepted/s $acc  CPU% {\"$cpu\".strip()}  CPU us/job {(ut+st)/100/jobs*1e6:.2f}  faults/job {mf/jobs:.3f}  jobs {jobs}')"
