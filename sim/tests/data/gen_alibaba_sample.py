#!/usr/bin/env python3
"""Generate a small GENERATED sample in the columns of Alibaba's
cluster-trace-gpu-v2023 (openb_node_list_*.csv, openb_pod_list_*.csv).

No row comes from the real trace: sizes, QoS shares and GPU-sharing
shares are rough imitations of the trace's published description, drawn
with a fixed seed, so the output is the same on every run:

    python3 sim/tests/data/gen_alibaba_sample.py sim/tests/data

writes alibaba_nodes.sample.csv and alibaba_pods.sample.csv there.
"""
import random
import sys
from pathlib import Path

SEED = 16
NODES = 48
PODS = 1500


def nodes(rng):
    # (cpu_milli, memory_mib, gpu, model, weight)
    kinds = [
        (96000, 786432, 8, "V100M32", 4),
        (128000, 786432, 8, "G3", 3),
        (64000, 262144, 4, "T4", 2),
        (32000, 131072, 2, "P100", 1),
        (32000, 262144, 0, "nan", 2),
    ]
    weights = [k[4] for k in kinds]
    out = []
    for i in range(NODES):
        cpu, mem, gpu, model, _ = rng.choices(kinds, weights)[0]
        out.append((f"openb-node-{i:04d}", cpu, mem, gpu, model))
    return out


def pods(rng):
    out = []
    t = 1000
    for i in range(PODS):
        t += int(rng.expovariate(1 / 9.0))
        r = rng.random()
        if r < 0.30:  # CPU only
            num_gpu, gpu_milli = 0, 0
            cpu = rng.choice([1000, 2000, 4000, 8000, 500, 1500])
        elif r < 0.62:  # GPU sharing
            num_gpu, gpu_milli = 1, rng.choice([100, 200, 250, 300, 500, 700, 900])
            cpu = rng.choice([2000, 4000, 6000, 8000])
        elif r < 0.85:  # one whole GPU
            num_gpu, gpu_milli = 1, 1000
            cpu = rng.choice([4000, 8000, 12000, 16000])
        elif r < 0.96:
            num_gpu, gpu_milli = rng.choice([2, 4]), 1000
            cpu = 8000 * num_gpu
        else:
            num_gpu, gpu_milli = 8, 1000
            cpu = rng.choice([64000, 88000])
        mem = cpu // 1000 * rng.choice([2048, 4096, 8192])
        spec = "nan"
        if num_gpu > 0 and rng.random() < 0.1:
            spec = rng.choice(["V100M32", "V100M16|V100M32", "T4"])
        qos = rng.choices(["LS", "BE", "Burstable", "Guaranteed"], [40, 30, 25, 5])[0]
        run = max(1, int(rng.lognormvariate(6.5, 1.3)))
        delay = 0 if rng.random() < 0.9 else rng.randint(1, 30)
        scheduled = t + delay
        deletion = scheduled + run
        phase = rng.choices(["Succeeded", "Running", "Failed"], [80, 15, 5])[0]
        if rng.random() < 0.02:  # never ended in the trace's window
            deletion = ""
            phase = "Running"
        out.append((f"openb-pod-{i:04d}", cpu, mem, num_gpu, gpu_milli, spec,
                    qos, phase, t, deletion, scheduled))
    return out


def main():
    d = Path(sys.argv[1] if len(sys.argv) > 1 else ".")
    rng = random.Random(SEED)
    with open(d / "alibaba_nodes.sample.csv", "w") as f:
        f.write("sn,cpu_milli,memory_mib,gpu,model\n")
        for row in nodes(rng):
            f.write(",".join(map(str, row)) + "\n")
    with open(d / "alibaba_pods.sample.csv", "w") as f:
        f.write("name,cpu_milli,memory_mib,num_gpu,gpu_milli,gpu_spec,qos,"
                "pod_phase,creation_time,deletion_time,scheduled_time\n")
        for row in pods(rng):
            f.write(",".join(map(str, row)) + "\n")


if __name__ == "__main__":
    main()
