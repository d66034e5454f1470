"""One full run of the paper's experiments at default sizes, plus the GPT-2 117M storage and time rows at the
paper's batch and sequence length, into docs/report/; then the report and a summary in bench/RESULTS.md.

    python bench/run_experiments.py                 # everything (about an hour on 2 cores)
    python bench/run_experiments.py --collect-only  # only rewrite the report and the summary

Commands it runs (from the repository root):

    veritrain experiment all --out docs/report --corpus ../shared/data/shakespeare.txt \\
        --tokenizer ../shared/data/gpt2-tokenizer
    veritrain experiment storage --out docs/report/gpt2-117m --workloads gpt2 --steps 2 --bits 32 $GPT2_117M
    veritrain experiment time --out docs/report/gpt2-117m --workloads gpt2 --steps 4 $GPT2_117M
    veritrain report docs/report

with GPT2_117M = --set gpt2.n_layer=12 --set gpt2.n_embd=768 --set gpt2.n_head=12 (batch 8, sequence 64).
"""

from __future__ import annotations

import argparse
import csv
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
REPORT = os.path.join(ROOT, "docs", "report")
SHARED = os.path.join(ROOT, "..", "shared", "data")
DATA = ["--corpus", os.path.join(SHARED, "shakespeare.txt"), "--tokenizer", os.path.join(SHARED, "gpt2-tokenizer")]
GPT2_117M = ["--set", "gpt2.n_layer=12", "--set", "gpt2.n_embd=768", "--set", "gpt2.n_head=12"]
BEGIN, END = "<!-- experiments: written by bench/run_experiments.py -->", "<!-- /experiments -->"


def veritrain(*args):
    print("veritrain", " ".join(args), flush=True)
    subprocess.run([sys.executable, "-m", "veritrain.cli", *args], check=True, cwd=ROOT)


def rows(*parts):
    try:
        with open(os.path.join(REPORT, *parts)) as f:
            return list(csv.DictReader(f))
    except OSError:
        return []


def variant_of(name: str) -> str:
    """The auditor's hardware variant an experiment ran under (its settings.json)."""
    import json

    try:
        with open(os.path.join(REPORT, name, "settings.json")) as f:
            settings = json.load(f)
    except OSError:
        return "?"
    return settings.get("auditor_variant") or settings.get("hardware_variant") or "?"


def summary() -> str:
    lines = [BEGIN, "", "## Experiments (the paper's tables, at default sizes)", "",
             "Command: `python bench/run_experiments.py` (the commands are in its docstring). Full tables, settings "
             "and plots: [docs/report/report.md](../docs/report/report.md).", ""]
    div = rows("divergence", "divergence.csv")
    if div:
        lines.append(f"Divergence (L2 distance of weights, trainer vs auditor under `{variant_of('divergence')}`, "
                     f"after the last step):")
        lines.append("")
        for w in sorted({r["workload"] for r in div}):
            last = {r["mode"]: r["l2_distance"] for r in div if r["workload"] == w}
            lines.append(f"- {w}: plain float32 {float(last['fp32']):.3g}, float64+rounding without log "
                         f"{float(last['nolog']):.3g}, veritrain {float(last['verified']):.3g}")
        lines.append("")
    for title, part in (("Storage per step, default sizes", ("storage", "storage.csv")),
                        ("Storage per step, GPT-2 117M, batch 8 x 64", ("gpt2-117m", "storage", "storage.csv"))):
        st = rows(*part)
        if st:
            lines += [f"{title}:", "", "| workload | b | rounded values | naive | packed | packed+zip | veritrain | "
                      "weights checkpoint |", "| --- | --- | --- | --- | --- | --- | --- | --- |"]
            for r in st:
                lines.append(f"| {r['workload']} | {r['bits']} | {float(r['rounded_values']):.3g} | "
                             f"{float(r['naive_bytes']) / 1e6:.1f} MB | {float(r['packed_bytes']) / 1e6:.1f} MB | "
                             f"{float(r['packed_zip_bytes']) / 1e3:.1f} KB | {float(r['veritrain_bytes']) / 1e3:.1f} KB | "
                             f"{float(r['checkpoint_bytes']) / 1e6:.1f} MB |")
            lines.append("")
    for title, part in (("Time per step, default sizes", ("time", "time.csv")),
                        ("Time per step, GPT-2 117M, batch 8 x 64", ("gpt2-117m", "time", "time.csv"))):
        t = rows(*part)
        if t:
            lines += [f"{title} (medians of same-step ratios in one process):", "",
                      "| workload | fp32 / fp64 | trainer / fp64 | auditor / fp64 | trainer / fp32 | auditor / fp32 |",
                      "| --- | --- | --- | --- | --- | --- |"]
            for r in t:
                lines.append(f"| {r['workload']} | {float(r['fp32_over_fp64']):.2f} | {float(r['trainer_over_fp64']):.2f} | "
                             f"{float(r['auditor_over_fp64']):.2f} | {float(r['trainer_over_fp32']):.2f} | "
                             f"{float(r['auditor_over_fp32']):.2f} |")
            lines.append("")
    cor = rows("corrections", "corrections.csv")
    if cor:
        lines.append(f"Corrections per step (auditor under `{variant_of('corrections')}`): " + "; ".join(
            f"{r['workload']} b={r['bits']}: {float(r['total_per_step']):.2g}" for r in cor) + ".")
        lines.append("")
    lines += [END, ""]
    return "\n".join(lines)


def write_summary():
    path = os.path.join(HERE, "RESULTS.md")
    text = open(path).read() if os.path.exists(path) else "# Benchmarks\n\n"
    if BEGIN in text and END in text:
        text = text[: text.index(BEGIN)] + text[text.index(END) + len(END):].lstrip("\n")
    with open(path, "w") as f:
        f.write(text.rstrip("\n") + "\n\n" + summary())


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--collect-only", action="store_true")
    args = ap.parse_args()
    if not args.collect_only:
        veritrain("experiment", "all", "--out", REPORT, *DATA)
        veritrain("experiment", "storage", "--out", os.path.join(REPORT, "gpt2-117m"), "--workloads", "gpt2",
                  "--steps", "2", "--bits", "32", *DATA, *GPT2_117M)
        veritrain("experiment", "time", "--out", os.path.join(REPORT, "gpt2-117m"), "--workloads", "gpt2",
                  "--steps", "4", *DATA, *GPT2_117M)
    veritrain("report", REPORT)
    write_summary()


if __name__ == "__main__":
    main()
