"""Per-step time of data-parallel veritrain runs for N = 1 and 2 processes on this machine (gloo), against one
process training the same global batch as a single batch.

Each configuration is a whole `veritrain train` (verified mode) of --steps steps; the per-step time is the
run's own `train_seconds / steps` (its training loop, not process start-up), and `train_comm_seconds` is rank
0's time in the step's collectives (waiting for the other rank included). Configurations alternate round by
round, so load on the machine hits them alike; medians of --repeats rounds. Appends a section to
bench/RESULTS.md.

    python bench/parallel_speed.py --steps 6 --repeats 3
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

from parallel_comm import _cpu  # noqa: E402 - bench/ is the script's folder

HERE = os.path.dirname(os.path.abspath(__file__))
SHAKESPEARE = os.path.join(HERE, "..", "..", "shared", "data", "shakespeare.txt")
G = 4


def workloads(corpus):
    gpt2 = ["--set", f"corpus={corpus}", "--set", "n_layer=2", "--set", "n_embd=128", "--set", "n_head=4",
            "--set", "seq_len=64", "--set", "max_chars=200000"]
    return {
        "digits-cnn (batch 4 x 64)": (["digits-cnn"], ("batch_size", 64)),
        "gpt2-text 2x128 (batch 4 x 8 x 64)": (["gpt2-text", *gpt2], ("batch_size", 8)),
    }


def run(task_args, key, size, nproc, micro_batches, steps, out):
    """(seconds per step, seconds in collectives per step) of one whole training run."""
    cmd = [sys.executable, "-m", "veritrain.cli", "train", *task_args, "--out", out, "--steps", str(steps),
           "--checkpoint-every", str(steps), "--quiet", "--json", "--set", f"{key}={size}", "--nproc", str(nproc)]
    if micro_batches > 1:
        cmd += ["--micro-batches", str(micro_batches)]
    subprocess.run(cmd, check=True, capture_output=True)
    with open(os.path.join(out, "manifest.json")) as f:
        m = json.load(f)
    return m["train_seconds"] / steps, m.get("train_comm_seconds", 0.0) / steps


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--corpus", default=SHAKESPEARE)
    ap.add_argument("--results", default=os.path.join(HERE, "RESULTS.md"))
    args = ap.parse_args()
    configs = [("one process, one batch of G x b", 1, "whole"), ("N = 1, G = 4", 1, "micro"),
               ("N = 2, G = 4", 2, "micro")]
    rows = []
    for name, (task_args, micro) in workloads(args.corpus).items():
        times = {c[0]: [] for c in configs}
        comms = {c[0]: [] for c in configs}
        for _ in range(args.repeats):
            for label, nproc, kind in configs:
                key, b = micro
                with tempfile.TemporaryDirectory() as d:
                    if kind == "whole":  # a plain run whose one batch is the G micro-batches together
                        t, c = run(task_args, key, b * G, 1, 1, args.steps, os.path.join(d, "run"))
                    else:
                        t, c = run(task_args, key, b, nproc, G, args.steps, os.path.join(d, "run"))
                times[label].append(t)
                comms[label].append(c)
        med = {k: statistics.median(v) for k, v in times.items()}
        rows.append((name, med, {k: statistics.median(v) for k, v in comms.items()}))
        print(name, med, flush=True)
    lines = ["\n## Data-parallel step time, N = 1 and 2 (issue 11)\n",
             f"Command: `python bench/parallel_speed.py --steps {args.steps} --repeats {args.repeats}` "
             f"({time.strftime('%Y-%m-%d')}). Machine: {_cpu()}, {os.cpu_count()} cores, gloo; verified mode; "
             f"`--nproc 2` gives each process {max(1, (os.cpu_count() or 1) // 2)} thread(s), one process uses all. "
             f"Medians of {args.repeats} rounds, configurations alternating; per-step time is the run's training "
             f"loop (`train_seconds / steps`), collectives are rank 0's `train_comm_seconds / steps`.\n",
             "| workload | one process, one batch of G x b | N = 1, G = 4 | N = 2, G = 4 | collectives at N = 2 | "
             "scaling efficiency N = 2 (t(N=1) / 2 t(N=2)) |",
             "| --- | --- | --- | --- | --- | --- |"]
    for name, med, comm in rows:
        eff = med["N = 1, G = 4"] / (2 * med["N = 2, G = 4"])
        lines.append(f"| {name} | {med['one process, one batch of G x b']:.3f} s | {med['N = 1, G = 4']:.3f} s | "
                     f"{med['N = 2, G = 4']:.3f} s | {comm['N = 2, G = 4']:.3f} s | {eff:.2f} |")
    with open(args.results, "a") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
