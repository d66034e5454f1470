"""``veritrain report DIR``: one Markdown report from the experiments in DIR, with the paper's published
numbers beside ours where it gives them."""

from __future__ import annotations

import csv
import os
import platform

from . import EXPERIMENTS
from .common import PAPER

PAPER_NUMBERS = """| quantity | paper (GPT-2 fine-tuning, GPUs) | ours |
| --- | --- | --- |
| log per step | 18 MB | {log} |
| proof-of-learning checkpoint per step | 2.78 GB | {ckpt} |
| corrections per step at b=32 / b=27 | 20-25 / 0 | {corr} |
| trainer / auditor time | 1.2-1.4x / 1.3-1.7x the original | {time} |
"""

DIFFERENCES = """Where our setting differs from the paper's: the "different hardware" here is the same CPU under other
instruction sets and math-library settings (AVX2 or baseline ATen kernels, oneDNN limited to AVX2/SSE4.1,
MKL's compatible mode, one thread, mkldnn off), not three GPU types; the image workload runs on
scikit-learn's digits dressed as 3x32x32 images unless a CIFAR-10 archive is given; default sizes are
small so that every experiment finishes in minutes on 2 cores (each table states its settings); time
ratios are against plain float64 on the same CPU, where the paper compares with float32 on a GPU."""


def _rows(path):
    try:
        with open(path) as f:
            return list(csv.DictReader(f))
    except OSError:
        return []


def _ours(root: str) -> dict:
    s = _rows(os.path.join(root, "storage", "storage.csv"))
    c = _rows(os.path.join(root, "corrections", "corrections.csv"))
    t = _rows(os.path.join(root, "time", "time.csv"))
    for sub in sorted(os.listdir(root)):  # runs at other sizes (e.g. gpt2-117m/), labelled by their folder
        if sub not in EXPERIMENTS and os.path.isdir(os.path.join(root, sub)):
            s += [{**r, "workload": f"{r['workload']} ({sub})"} for r in _rows(os.path.join(root, sub, "storage", "storage.csv"))]
            t += [{**r, "workload": f"{r['workload']} ({sub})"} for r in _rows(os.path.join(root, sub, "time", "time.csv"))]
    out = {}
    b32 = [r for r in s if r["bits"] == "32"]
    out["log"] = "; ".join(f"{r['workload']}: {float(r['veritrain_bytes']) / 1e3:.1f} KB" for r in b32) or "(not run)"
    out["ckpt"] = "; ".join(f"{r['workload']}: {float(r['checkpoint_bytes']) / 1e6:.2f} MB" for r in b32) or "(not run)"
    corr = []
    for w in sorted({r["workload"] for r in c}):
        by_b = {r["bits"]: r["total_per_step"] for r in c if r["workload"] == w}
        corr.append(f"{w}: {float(by_b.get('32', 'nan')):.2g} / {float(by_b.get('27', 'nan')):.2g}")
    out["corr"] = "; ".join(corr) or "(not run)"
    out["time"] = "; ".join(f"{r['workload']}: {float(r['trainer_over_fp64']):.2f}x / {float(r['auditor_over_fp64']):.2f}x "
                            f"plain float64" for r in t) or "(not run)"
    return out


def write_report(root: str) -> str:
    if not os.path.isdir(root):
        raise ValueError(f"{root} is not a folder of experiments")
    parts = ["# veritrain: the paper's experiments, reproduced", "",
             f"Paper: {PAPER}.", "", f"Machine: {platform.machine()}, {os.cpu_count()} cores, "
             f"Python {platform.python_version()}.", "", "## Beside the paper", "",
             PAPER_NUMBERS.format(**_ours(root)), DIFFERENCES, ""]
    found = []
    for name in EXPERIMENTS:
        md = os.path.join(root, name, f"{name}.md")
        if os.path.exists(md):
            with open(md) as f:
                text = f.read().replace(f"]({name}.png)", f"]({name}/{name}.png)")
            parts += [text, ""]
            found.append(name)
    # further runs at other sizes, each in a folder of its own (e.g. gpt2-117m/storage/)
    for sub in sorted(os.listdir(root)):
        folder = os.path.join(root, sub)
        if sub in EXPERIMENTS or not os.path.isdir(folder):
            continue
        extra = [n for n in EXPERIMENTS if os.path.exists(os.path.join(folder, n, f"{n}.md"))]
        if extra:
            parts += [f"# Further runs: {sub}", ""]
            for name in extra:
                with open(os.path.join(folder, name, f"{name}.md")) as f:
                    text = f.read().replace(f"]({name}.png)", f"]({sub}/{name}/{name}.png)")
                parts += [text.replace("\n## ", "\n### ").replace("## ", "### ", 1), ""]
    missing = [n for n in EXPERIMENTS if n not in found]
    if missing:
        parts += [f"Not run: {', '.join(missing)}.", ""]
    path = os.path.join(root, "report.md")
    with open(path, "w") as f:
        f.write("\n".join(parts))
    return path
