"""Cost of verified training per step: plain float32, plain float64, trainer (records the log) and auditor
(replays it), measured in one process so the ratios share the machine's state.

    python bench/bench_engine.py                      # GPT-2 117M (batch 8 x 64) and ResNet-18 (batch 32)
    python bench/bench_engine.py --workloads resnet18 --steps 3 --no-write
    python bench/bench_engine.py --device cuda           # every mode on the GPU (default: cpu)
    python bench/bench_engine.py --device cuda --force-compiled --no-write   # what compiled GPU paths would give

The measurement is veritrain.experiments.timecost.measure (the `time` experiment's): every step index
runs in every mode, in rotated order, the first step not counted; ratios are per-step, then the median, shown
with the smallest and largest per-step ratio, and the verdict counts the steps within each target.
Writes bench/RESULTS.md unless --no-write.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import platform
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)

import torch  # noqa: E402

from veritrain import hardware  # noqa: E402
from veritrain.experiments.timecost import measure  # noqa: E402

WORKLOADS = {
    "gpt2-117m": ("gpt2-text", lambda shared: {
        "corpus": os.path.join(shared, "shakespeare.txt"), "tokenizer": os.path.join(shared, "gpt2-tokenizer"),
        "n_layer": 12, "n_embd": 768, "n_head": 12, "batch_size": 8, "seq_len": 64, "optimizer": "adamw",
        "lr": 1e-4, "dropout": 0.1}, "GPT-2 117M config (12x768, BPE vocabulary 50257), batch 8 x 64, AdamW, dropout 0.1"),
    "resnet18": ("resnet_task:make_task", lambda shared: {"width": 64, "batch_size": 32},
                 "ResNet-18 (CIFAR variant), batch 32 x 3x32x32, SGD momentum 0.9, weight decay 5e-4"),
}


# issue 12's targets (trainer, auditor) as multiples of plain float64 on this CPU; the log's: 1/1000 of dense
TARGETS = {"gpt2-117m": (1.15, 1.1), "resnet18": (1.15, 1.1)}


def seconds(t: float) -> str:
    return f"{t:.1f} s" if t >= 1 else f"{t * 1e3:.1f} ms"  # a GPU's float64 step takes milliseconds


def machine(device: str = "cpu") -> str:
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    gpu = f"; device {device} ({torch.cuda.get_device_name(device)})" if device.startswith("cuda") else ""
    return (f"{cpu}, {os.cpu_count()} cores, torch {torch.__version__} ({torch.get_num_threads()} threads, "
            f"{torch.backends.cpu.get_cpu_capability()}), Python {platform.python_version()}{gpu}")


def bench(name: str, steps: int, shared: str, device: str = "cpu", warmup: int = 1) -> dict:
    task_ref, make_config, description = WORKLOADS[name]
    r = measure(task_ref, make_config(shared), steps, progress=lambda line: print(f"  {name}{line}", flush=True),
                device=device, warmup=warmup)
    return {"name": name, "description": description, **r}


def spread(r: dict, mode: str) -> str:
    """A mode's median ratio to plain float64 and, where several steps were counted, the range of the per-step
    ratios: on these 2-core machines the plain float64 step alone swings by a third between steps and processes
    (docs/SPEED-RECORD.md), so a median near a target says little without it."""
    ratios = r["ratios"][mode]
    if len(ratios) < 2:
        return f"{r['ratio'][mode]:.2f}x"
    return f"{r['ratio'][mode]:.2f}x ({min(ratios):.2f}-{max(ratios):.2f}x)"


def markdown(results: list, command: str, device: str = "cpu") -> str:
    lines = ["# Benchmarks", "", "Written by `bench/bench_engine.py`. Per-step times are medians over the counted steps; "
             "ratios are per-step ratios to plain float64 measured in the same process, then the median, with the "
             "smallest and largest of them in brackets. "
             "Timings on a shared 2-core machine swing; compare ratios, not absolute times.", "",
             f"Command: `{command}`", "", f"Machine: {machine(device)}", "",
             "## Per-step cost", "",
             "| workload | steps | fp32 / fp64 | trainer / fp64 | auditor / fp64 | fp64 step (median) "
             "| rounded values | log entries | log bytes | dense 1.6-bit encoding | log / dense |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in results:
        lines.append(
            f"| {r['description']} | {r['steps']} | {r['ratio']['fp32']:.2f}x | {spread(r, 'trainer')} "
            f"| {spread(r, 'auditor')} | {seconds(r['median_s']['fp64'])} | {r['rounded']:.3g} "
            f"| {r['entries']:.0f} | {r['log_bytes'] / 1e3:.1f} KB | {r['dense_bytes'] / 1e6:.1f} MB "
            f"| 1/{1 / r['log_fraction']:.0f} |")
    lines += ["", "Targets (issue 12, set for this project's 2-core CPU), as multiples of plain float64: " + "; ".join(
        f"{w} trainer <= {t[0]}x, auditor <= {t[1]}x" for w, t in TARGETS.items())
        + "; log <= 1/1000 of the dense encoding.", ""]
    for r in results:
        limits = dict(zip(("trainer", "auditor"), TARGETS[r["name"]]))
        misses = [f"{m} {r['ratio'][m]:.2f}x > {limits[m]}x" for m in limits if r["ratio"][m] > limits[m]]
        if r["log_fraction"] > 1e-3:
            misses.append(f"log 1/{1 / r['log_fraction']:.0f} of dense > 1/1000")
        verdict = "all targets met" if not misses else "not met: " + "; ".join(misses)
        within = ", ".join(f"{m} {sum(x <= limits[m] for x in r['ratios'][m])} of {len(r['ratios'][m])}" for m in limits)
        lines.append(f"- {r['name']}: {verdict} (steps within the target: {within}). "
                     f"Auditor corrections over the run: {r['corrections']}, "
                     f"suspicious entries: {r['suspicious']}.")
    lines += ["", "## Notes", "",
              "- Rounded values: every element of every floating-point op output in a step (forward, backward, "
              "optimizer), the count the paper's dense log would encode; the log holds only the entries of docs/ROUNDING.md.",
              "- The baseline to beat, the paper's own code on this CPU (GPT-2 2x128, batch 8x64): trainer 6x and auditor "
              "9-13x a plain float64 step, 11 MB of log per step.",
              "- Plain float64 is PyTorch's eager float64 step; the trainer evaluates every op in float64 too and "
              "in addition rounds every result, scans it for near-midpoint values and writes the log; the auditor rounds, "
              "applies the log and checks its entries. Timings on this 2-core machine vary between runs (the fp64 "
              "step itself ranged 4.6-9.2 s in one run); ratios are medians of same-step pairs.", ""]
    return "\n".join(lines) + "\n"


OWN_SECTIONS = ("## Per-step cost", "## Notes")


def merged(old: str, ours: str) -> str:
    """``ours`` in place of what this script wrote at the top of ``old`` (its title, its own sections), every
    section after that kept as it was: the experiments' (bench/run_experiments.py), the profiles', the GPU
    sessions'. (It had kept only what followed the experiments' marker, and so dropped the sections other
    scripts had written between.)"""
    lines = old.split("\n")
    for i, line in enumerate(lines):
        if line.startswith("<!-- experiments:") or line.startswith("## ") and line.strip() not in OWN_SECTIONS:
            return ours + "\n" + "\n".join(lines[i:])
    return ours


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workloads", default="gpt2-117m,resnet18", help=f"comma-separated: {', '.join(WORKLOADS)}")
    ap.add_argument("--steps", type=int, default=4, help="counted steps per workload")
    ap.add_argument("--warmup", type=int, default=1,
                    help="uncounted steps before them (default 1: the compiled kernels' first calls; GPT-2 117M's "
                         "plain float64 step took about 3 more to settle here)")
    ap.add_argument("--shared", default=os.path.join(ROOT, "..", "shared", "data"))
    ap.add_argument("--out", default=os.path.join(HERE, "RESULTS.md"))
    ap.add_argument("--no-write", action="store_true")
    ap.add_argument("--device", default="cpu", metavar="cpu|cuda[:N]", help="where every mode runs (default cpu)")
    ap.add_argument("--force-compiled", action="store_true",
                    help="the compiled paths on for every op, on any device, whatever the compiler check says "
                         "(the library keeps them to CPUs): their speed on a GPU, before they are shown to conform "
                         "there (bench/compiled_conformance.py)")
    args = ap.parse_args(argv)
    if args.steps < 1 or args.warmup < 1:
        ap.error(f"--steps and --warmup must be at least 1 (got {args.steps} and {args.warmup})")
    hardware.apply_process_settings()
    try:
        device = str(hardware.parse_device(args.device))
    except hardware.DeviceError as e:
        ap.error(str(e))
    names = [w for w in args.workloads.split(",") if w]
    for w in names:
        if w not in WORKLOADS:
            ap.error(f"unknown workload {w!r}; known: {', '.join(WORKLOADS)}")
    from compiled_conformance import compiled_paths  # here: it imports this module

    results = []
    with compiled_paths(True) if args.force_compiled else contextlib.nullcontext():
        for w in names:
            print(f"{w}:", flush=True)
            results.append(bench(w, args.steps, args.shared, device, args.warmup))
    text = markdown(results, "python bench/bench_engine.py " + " ".join(argv if argv is not None else sys.argv[1:]),
                    device)
    print(text)
    if not args.no_write:
        old = open(args.out).read() if os.path.exists(args.out) else ""
        with open(args.out, "w") as f:
            f.write(merged(old, text))


if __name__ == "__main__":
    main()
