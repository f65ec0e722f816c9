#!/usr/bin/env bash
# A profile-guided (PGO) build of the dispatcher binary.
#
#   scripts/pgo-build.sh            # -> target/pgo/dispatcher
#
# 1. builds the dispatcher instrumented (-Cprofile-generate) and loadgen
#    plain, each in its own target directory under target/pgo;
# 2. trains it on loopback with loadgen: 500 agents offered 70,000 jobs/s
#    for 5 s (issue 14's data path: submits, statuses, the store), then
#    2,000 agents at 1 Hz with 5,000 submits/s for 10 s (heartbeats,
#    load reports, the web-free core at a larger cluster); the
#    dispatcher writes its profile when loadgen-server.sh stops it;
# 3. merges the profile with llvm-profdata (rustup's llvm-tools, whose
#    LLVM is rustc's own: installed here if missing);
# 4. builds the dispatcher again with -Cprofile-use.
#
# Why: at one job at a time the core's way through a submit and a finish
# does not fit in the CPU's instruction cache (callgrind: ~785 L1
# instruction misses per op of the placement bench at 1,000 nodes); PGO
# lays the hot paths out together. Measured (docs/BENCHMARKS.md, session
# 34): the placement bench +12-18% ours/s at 1,000 and 10,000 nodes;
# loadgen's 50,000 jobs/s run -11% dispatcher CPU per job. Two fat-LTO
# builds: ~10-20 minutes on 2 cores.
set -euo pipefail
cd "$(dirname "$0")/.."
out=${PGO_TARGET_DIR:-$PWD/target/pgo}
mkdir -p "$out"
if ! profdata=$(find "$(rustc --print sysroot)" -name llvm-profdata -type f 2>/dev/null | grep -m1 .); then
  rustup component add llvm-tools >&2
  profdata=$(find "$(rustc --print sysroot)" -name llvm-profdata -type f | grep -m1 .) || {
    echo "pgo-build: no llvm-profdata in rustc's sysroot (rustup component add llvm-tools)" >&2
    exit 1
  }
fi
data="$out/profile"

echo "pgo-build: instrumented dispatcher, plain loadgen" >&2
RUSTFLAGS="-Cprofile-generate=$data" CARGO_TARGET_DIR="$out/gen" \
  cargo build --release --locked -p dispatcher --bin dispatcher
CARGO_TARGET_DIR="$out/plain" cargo build --release --locked -p e2e --bin loadgen

# Emptied after the builds: their build scripts and proc macros are
# instrumented too, and wrote their own profiles here as they ran.
rm -rf "$data"
mkdir -p "$data"
echo "pgo-build: training" >&2
scripts/bench/loadgen-server.sh "$out/gen/release/dispatcher" "$out/plain/release/loadgen" \
  "$out/train-data-path.txt" --heartbeat-ms 2000 --missed-heartbeats 3 -- \
  --agents 500 --rate 70000 --batch 500 --duration-s 5 --job-ms 0 >&2
scripts/bench/loadgen-server.sh "$out/gen/release/dispatcher" "$out/plain/release/loadgen" \
  "$out/train-agents.txt" -- --agents 2000 --rate 5000 --duration-s 10 --pending 1000 >&2
shopt -s nullglob
raw=("$data"/*.profraw)
[ ${#raw[@]} -gt 0 ] || { echo "pgo-build: the training wrote no profile" >&2; exit 1; }
"$profdata" merge -o "$out/dispatcher.profdata" "${raw[@]}"

echo "pgo-build: optimised dispatcher" >&2
RUSTFLAGS="-Cprofile-use=$out/dispatcher.profdata" CARGO_TARGET_DIR="$out/use" \
  cargo build --release --locked -p dispatcher --bin dispatcher
cp "$out/use/release/dispatcher" "$out/dispatcher"
echo "$out/dispatcher"
