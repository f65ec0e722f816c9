#!/usr/bin/env bash
# Instructions per submit + finish of the dispatcher's placement ("ours per
# submit"): runs the placement bench at one size under callgrind and divides
# the inclusive cost of `Cluster::submit` + `Cluster::job_status` by the
# number of `Cluster::submit` calls (the fill to 75% busy and the measured
# submits: 25,404 at 1,000 nodes, 73,274 at 10,000), read from callgrind's
# call counts.
#
#   scripts/bench/ours-per-submit.sh BIN NODES OUTDIR
#
# BIN is the placement bench binary (target/release/deps/placement-<hash>,
# built by `cargo build --release -p dispatcher --bench placement`; pick the
# newest). callgrind counts instructions, so the figure repeats whatever
# else the machine does.
set -euo pipefail
bin=$1 nodes=$2 out=$3
mkdir -p "$out"
cg="$out/callgrind.$nodes.out"
# REUSE=1: read the profile of an earlier run in OUTDIR again.
[ "${REUSE:-0}" = 1 ] && [ -s "$cg" ] || valgrind --tool=callgrind --callgrind-out-file="$cg" "$bin" --bench --nodes "$nodes" >"$out/bench.$nodes.txt" 2>"$out/valgrind.$nodes.log"
callgrind_annotate --inclusive=yes --threshold=100 "$cg" >"$out/annotate.$nodes.txt" 2>/dev/null
python3 - "$out/annotate.$nodes.txt" "$cg" <<'PY'
import re, sys
text = open(sys.argv[1]).read()
FN = re.compile(r"Cluster>?::(submit|job_status)$")
def incl(name):
    total = 0
    for line in text.splitlines():
        m = re.match(r"\s*([\d,]+)\s+\(\s*[\d.]+%\)\s+\S*:(.*?)(\s+\[.*\])?$", line)
        if m and re.search(r"Cluster>?::" + name + r"$", m.group(2).strip()):
            total = max(total, int(m.group(1).replace(",", "")))
    return total
# Calls to Cluster::submit, from the raw profile (names are compressed to
# "(id) name" on first use, "(id)" after).
names, calls, cfn = {}, 0, None
for line in open(sys.argv[2]):
    if line.startswith(("fn=", "cfn=", "cfi=", "cfl=")) and not line.startswith(("cfi=", "cfl=")):
        key, _, rest = line.rstrip("\n").partition("=")
        m = re.match(r"\((\d+)\)(?: (.*))?", rest)
        if m:
            if m.group(2):
                names[m.group(1)] = m.group(2)
            name = names.get(m.group(1), "")
        else:
            name = rest
        if key == "cfn":
            cfn = name
    elif line.startswith("calls=") and cfn is not None:
        if re.search(r"Cluster>?::submit$", cfn):
            calls += int(line[6:].split()[0])
        cfn = None
s, f = incl("submit"), incl("job_status")
print(f"submit {s:,}  job_status {f:,}  submit calls {calls:,}  per submit+finish {(s + f) / max(calls, 1):,.0f}")
PY
