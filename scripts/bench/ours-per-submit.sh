#!/usr/bin/env bash
# Instructions per submit + finish of the dispatcher's placement ("ours per
# submit"): runs the placement bench at one size under callgrind and divides
# the inclusive cost of `Cluster::submit` + `Cluster::job_status` by the
# number of submits (20,000 at 1,000 and 10,000 nodes, 5,000 at 100,000).
#
#   scripts/bench/ours-per-submit.sh BIN NODES OUTDIR
#
# BIN is the placement bench binary (target/release/deps/placement-<hash>,
# built by `cargo build --release -p dispatcher --bench placement`; pick the
# newest). callgrind counts instructions, so the figure repeats whatever
# else the machine does. Prints the per-function inclusive table's top too.
set -euo pipefail
bin=$1 nodes=$2 out=$3
mkdir -p "$out"
case $nodes in 100000) submits=5000 ;; *) submits=20000 ;; esac
cg="$out/callgrind.$nodes.out"
valgrind --tool=callgrind --callgrind-out-file="$cg" "$bin" --bench --nodes "$nodes" >"$out/bench.$nodes.txt" 2>"$out/valgrind.$nodes.log"
callgrind_annotate --inclusive=yes --threshold=100 "$cg" >"$out/annotate.$nodes.txt" 2>/dev/null
python3 - "$out/annotate.$nodes.txt" "$submits" <<'PY'
import re, sys
text = open(sys.argv[1]).read()
submits = int(sys.argv[2])
def incl(name):
    total = 0
    for line in text.splitlines():
        m = re.match(r"\s*([\d,]+)\s+\(\s*[\d.]+%\)\s+\S*:(.*)", line)
        if m and re.search(r"Cluster(<[^>]*>)?::" + name + r"\b", m.group(2)) and "{{closure}}" not in m.group(2):
            total = max(total, int(m.group(1).replace(",", "")))
    return total
s, f = incl("submit"), incl("job_status")
print(f"submit {s:,}  job_status {f:,}  per submit+finish {(s + f) / submits:,.0f}")
PY
