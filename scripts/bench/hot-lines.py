#!/usr/bin/env python3
"""Code lines per function of a callgrind profile: where the placement
path's L1i misses come from, and how many a tighter layout could save.

    valgrind --tool=callgrind --cache-sim=yes --dump-instr=yes \
      --toggle-collect='placement::measured_ours' --callgrind-out-file=OUT \
      BIN --bench --nodes 1000 --batch 1
    objdump -d -C --no-show-raw-insn BIN > DIS
    scripts/bench/hot-lines.py OUT DIS OPS [ROWS]

OPS is the profiled loop's operations (20,000 for `--bench`). Per
function, sorted by waste: L1i misses per op, its "hot" 64-byte code
lines (holding an instruction run at least OPS/2 times: once per op or
more), the bytes of those hot instructions, the lines they would take
packed (bytes / 64) and the waste (hot lines - packed): the lines that
rarely-run code inside the hot path (error branches, other
monomorphisations, slow paths laid out between hot blocks) and function
boundaries cost. A path larger than the L1i pays about one miss per hot
line per op, so the waste is what outlining cold code can gain.
"""
import collections
import re
import sys


def parse(prof):
    """Per instruction address: self Ir, I1mr, and its function."""
    events, fn, pos = None, None, 0
    names = {}
    ir, i1, owner = collections.Counter(), collections.Counter(), {}
    call_cost = False
    for line in open(prof):
        line = line.rstrip("\n")
        if line.startswith("events:"):
            events = line.split()[1:]
            continue
        m = re.match(r"c?fn=\((\d+)\)(?: (.*))?", line)
        if m:
            if m.group(2):
                names[m.group(1)] = m.group(2)
            if line.startswith("fn="):
                fn = names[m.group(1)]
            continue
        if line.startswith("calls="):
            call_cost = True  # the next cost line is the call's, inclusive
            continue
        if not line or line[0] not in "0123456789+-*":
            continue
        parts = line.split()
        a = parts[0]
        if a.startswith("0x"):
            pos = int(a, 16)
        elif a[0] in "+-":
            d = int(a[1:], 16) if a[1:].startswith("0x") else int(a[1:])
            pos = pos + d if a[0] == "+" else pos - d
        elif a != "*":
            pos = int(a)
        if call_cost:
            call_cost = False
            continue
        ev = dict(zip(events, (int(v) for v in parts[2:])))
        ir[pos] += ev.get("Ir", 0)
        i1[pos] += ev.get("I1mr", 0)
        owner[pos] = fn
    return ir, i1, owner


def main():
    prof, dis, ops = sys.argv[1], sys.argv[2], int(sys.argv[3])
    rows = int(sys.argv[4]) if len(sys.argv) > 4 else 40
    ir, i1, owner = parse(prof)
    addrs = sorted(
        int(m.group(1), 16)
        for m in (re.match(r"\s+([0-9a-f]+):\s", l) for l in open(dis))
        if m
    )
    size = {a: b - a for a, b in zip(addrs, addrs[1:])}
    hot = collections.defaultdict(set)
    hot_bytes, miss, instr = collections.Counter(), collections.Counter(), collections.Counter()
    for a, c in ir.items():
        f = owner[a]
        miss[f] += i1[a]
        instr[f] += c
        if c >= ops / 2:
            hot[f].add(a >> 6)
            hot_bytes[f] += size.get(a, 4)
    lines, nbytes = sum(len(v) for v in hot.values()), sum(hot_bytes.values())
    print(
        f"per op: {sum(instr.values()) / ops:,.0f} instructions, "
        f"{sum(miss.values()) / ops:,.1f} L1i misses; hot lines {lines}, "
        f"hot bytes {nbytes:,} = {nbytes / 64:.0f} lines packed"
    )
    print(f"{'I1/op':>6} {'instr/op':>8} {'hot':>4} {'bytes':>6} {'packed':>6} {'waste':>5}  function")
    waste = {f: len(hot[f]) - hot_bytes[f] / 64 for f in hot}
    for f in sorted(hot, key=lambda f: -waste[f])[:rows]:
        print(
            f"{miss[f] / ops:6.1f} {instr[f] / ops:8.0f} {len(hot[f]):4d} "
            f"{hot_bytes[f]:6d} {hot_bytes[f] / 64:6.1f} {waste[f]:5.1f}  {f[:110]}"
        )


if __name__ == "__main__":
    main()
