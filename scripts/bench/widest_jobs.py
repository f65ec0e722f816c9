"""The widest jobs of a `dispatch-sim --jobs-out` file, and the
simulator's percentile: shared by `sweep-shapes.sh` and
`queue-orders.sh`, so that both read a run's tail the same way."""
import csv
import math


def pct(v, p):
    """Nearest rank, as the simulator's own percentiles (sim::metrics::percentile)."""
    v = sorted(v)
    return v[min(max(math.ceil(p / 100 * len(v)), 1), len(v)) - 1] if v else 0.0


def widest_waits(path):
    """The largest CPU count among the file's started jobs, and those jobs' waits (s)."""
    rows = [r for r in csv.DictReader(open(path)) if r["wait_s"]]
    top = max(int(r["cpus"]) for r in rows)
    return top, [float(r["wait_s"]) for r in rows if int(r["cpus"]) == top]
