"""Table 4 of the paper: thresholds per op class, calibrated by measuring float64 differences across
hardware variants (ours: safety factor x the largest difference relative to the error scale) and by the
paper's Algorithm 3 (binary search for the smallest power-of-two threshold covering every observed
rounding disagreement), beside the engine's defaults."""

from __future__ import annotations

import json
import math
import os

from .. import hardware
from .common import read_table, start, Output, sets, veritrain


def run(args) -> Output:
    variants = args.variants or hardware.CALIBRATION_VARIANTS
    steps = args.steps
    loads, out = start(args, "thresholds", variants=variants)
    rows = []
    for w, (task, config) in loads.items():
        cal_dir = out.run_path(f"{w}-calibration")
        veritrain("calibrate", task, "--out", cal_dir, "--steps", steps, "--variants", variants, "--quiet",
                  *sets(config), ok=(0, 1), device=args.device)
        with open(os.path.join(cal_dir, "calibration.json")) as f:
            cal = json.load(f)
        for cls, v in cal["per_class"].items():
            rows.append({"workload": w, "op_class": cls, "default_c": v["default"], "max_ratio": v["max_ratio"],
                         "ours_c": v["recommended"], "rounding_disagreements": v["rounding_disagreements"],
                         "algorithm3_c": v["algorithm3"], "exact_violations": v["exact_violations"]})
    cols = ["workload", "op_class", "default_c", "max_ratio", "ours_c", "rounding_disagreements", "algorithm3_c",
            "exact_violations"]
    out.table(rows, cols)
    plt = out.figure()
    fig, ax = plt.subplots(figsize=(7, 3.8))
    labels = [f"{r['workload']}/{r['op_class']}" for r in rows]
    x = range(len(rows))
    ax.bar([i - 0.2 for i in x], [max(r["max_ratio"], 1e-3) for r in rows], 0.2, label="largest measured ratio")
    ax.bar(list(x), [r["ours_c"] for r in rows], 0.2, label="ours (calibrated c)")
    ax.bar([i + 0.2 for i in x], [r["default_c"] for r in rows], 0.2, label="default c")
    a3 = [(i, r["algorithm3_c"]) for i, r in zip(x, rows) if r["algorithm3_c"] not in (None, math.inf)]
    if a3:
        ax.scatter([i for i, _ in a3], [c for _, c in a3], color="k", zorder=3, label="Algorithm 3")
    ax.set_xticks(list(x), labels, rotation=60, ha="right", fontsize=7)
    ax.set_yscale("log")
    ax.set_ylabel("threshold constant c (units of u * scale)")
    ax.legend(fontsize=7)
    out.save_figure(plt)
    out.markdown("Thresholds per op class (paper Table 4)",
                 "`max_ratio` is the largest |y_variant - y_reference| / (u * scale) measured; ours is 8x that "
                 "(at least 1); Algorithm 3 is the smallest power of two covering every element whose rounding "
                 "differed between machines (empty when none did). The paper's thresholds are per layer and in "
                 "absolute units on GPUs, so only the method compares, not the numbers.", rows, cols)
    return out


def check(out_dir: str) -> list[str]:
    rows = read_table(out_dir, "thresholds")
    problems = [f"{r['workload']}/{r['op_class']}: exact ops differed" for r in rows if int(r["exact_violations"])]
    problems += [f"{r['workload']}/{r['op_class']}: measured ratio {r['max_ratio']} exceeds the default {r['default_c']}"
                 for r in rows if float(r["max_ratio"]) >= float(r["default_c"])]
    return problems
