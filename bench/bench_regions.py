"""Captured regions (capture.py) of a workload's verified step, each timed as it replays: its function run as
Python with the NumPy candidate test (what a small region runs by default), the same with the compiled
function's torch test (stability_flag, every sum's certificate computed), compiled (a large region, or a trainer's
hot one), and compiled with the trainer's candidate flags reduced whole at once, as capture._any_flag did before
it reduced each by rows (an auditor's function has no flags: the same as compiled).

    python bench/bench_regions.py                                   # resnet and digits, trainer and auditor
    python bench/bench_regions.py --workloads digits --repeats 10 --no-write

A few verified steps record every region of the workload (the trainer's and the auditor's are distinct:
the auditor's function has no scale or test); each region's inputs from its last call are kept and the
variants are timed on them in turn, in a shuffled order each repetition, in one process. Medians in microseconds.
`per step` weights each region by its calls in one step; `in step` times the calls the engine made. The variants must give the same results (the same
float32 values, the rounding of the same float64 op); where they differ the script exits with an error.
Writes the "Captured regions" section of bench/RESULTS.md unless --no-write.
"""

from __future__ import annotations

import argparse
import os
import random
import shlex
import statistics
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import torch  # noqa: E402

from profile_engine import (_prepare_batch, _prepare_model, _step, build, each_workload, place_task,  # noqa: E402
                            write_section)
from veritrain import capture  # noqa: E402
from veritrain.fused import KEEP_ROUNDINGS, define  # noqa: E402
from veritrain.engine import EngineConfig  # noqa: E402
from veritrain.rounding import Grid  # noqa: E402

VARIANTS = ("python", "python, torch test", "compiled", "compiled, flags whole")


def _whole_flags(flags):
    """The trainer's candidate test reduced as capture._any_flag did before it reduced each flag by rows."""
    return torch.stack([f.any() for f in flags]).any()


def _compiled(region, any_flag):
    """The region's function compiled as Region.program compiles it, its flags reduced by ``any_flag``; compiled
    here for both compiled variants alike (the region's own was compiled in the steps, with autograd on, and
    carries a second set of guards into the no-grad calls timed here)."""
    env = dict(region._env)
    env.pop("PYTHON")
    env["ANY"] = any_flag
    define(region.source, "<bench_regions>", env)
    return torch.compile(env["program"], dynamic=False, fullgraph=True, options=KEEP_ROUNDINGS)


def _variants(region) -> dict:
    """The region's function four ways (see the module's docstring)."""
    return {"python": region.program(False), "python, torch test": region.function(for_python=False),
            "compiled": _compiled(region, capture._any_flag), "compiled, flags whole": _compiled(region, _whole_flags)}


def record(task_ref: str, config: dict, steps: int) -> dict:
    """{region: [its inputs, calls in the last step, role, the variant the engine ran, its calls' times after the
    first step]} for the trainer's and the auditor's regions."""
    seen, calls, ran, took = {}, {}, {}, {}
    run = capture.Region.run

    def keep(self, tensors, compiled=True):
        seen[self] = [t.clone() for t in tensors]
        calls[self] = calls.get(self, 0) + 1
        ran[self] = "compiled" if compiled else "python"
        t0 = time.perf_counter()
        out = run(self, tensors, compiled)
        took.setdefault(self, []).append(time.perf_counter() - t0)
        return out

    grid, cfg = Grid(32), EngineConfig()
    tasks = {}
    for role in ("trainer", "auditor"):
        t = build(task_ref, config)
        _prepare_model(t, "fp32", grid)
        tasks[role] = place_task(t, torch.device("cpu"))
    capture.Region.run = keep
    try:
        with tempfile.TemporaryDirectory() as d:
            for step in range(steps):
                calls.clear()
                for role in ("trainer", "auditor"):
                    batch = _prepare_batch(tasks[role].batch(step), "fp32", grid)
                    _step(tasks[role], role, step, batch, os.path.join(d, f"{step}.vtlog"), cfg)
    finally:
        capture.Region.run = run
    return {r: [x, calls.get(r, 0), "trainer" if r.want_cand else "auditor", ran[r], took[r][calls.get(r, 0):]]
            for r, x in seen.items()}


def measure(task_ref: str, config: dict, repeats: int, steps: int = 4) -> list:
    rows = []
    for region, (inputs, per_step, role, ran, in_step) in record(task_ref, config, steps).items():
        fns = _variants(region)
        with torch.no_grad():
            outs = {v: fn(*inputs) for v, fn in fns.items()}  # also the compile, untimed
            first = outs["python"]
            for v, out in outs.items():
                if not all(torch.equal(a, b) for a, b in zip(first[0] + first[1], out[0] + out[1])):
                    raise SystemExit(f"{region.templates[0].label}: the {v!r} function's results differ from Python's")
            times = {v: [] for v in VARIANTS}
            for k in range(repeats):
                # a shuffled order each time: a rotation keeps each variant after the same one, and a variant
                # timed after one that leaves the caches cold (the Python ones) was slower for it
                for v in random.Random(k).sample(VARIANTS, len(VARIANTS)):
                    t0 = time.perf_counter()
                    fns[v](*inputs)
                    times[v].append(time.perf_counter() - t0)
        rows.append({"role": role, "first op": region.templates[0].label, "ops": len(region.templates),
                     "numel": max(t.numel() for t in inputs), "per_step": per_step, "ran": ran,
                     "in_step": 1e6 * statistics.median(in_step) if in_step else float("nan"),
                     "us": {v: 1e6 * statistics.median(t) for v, t in times.items()}})
    return sorted(rows, key=lambda r: (r["role"] != "trainer", -r["numel"]))


def markdown(results: dict, command: str, machine: str) -> str:
    lines = ["## Captured regions: as Python and compiled (issue 12)", "", f"Command: `{command}`", "",
             f"Machine: {machine}", "",
             "Written by `bench/bench_regions.py`: each captured region of the workloads' verified steps timed on "
             "its last call's inputs, in microseconds (medians, the variants in a shuffled order each repetition, "
             "in one process). `python` is "
             "what a region below `VERITRAIN_CAPTURE_MIN_NUMEL` runs (its generated function as Python, the "
             "eager engine's candidate test in NumPy, a sum's exactness certificate only where its plain scale "
             "flags); `python, torch test` the same with the compiled function's test (stability_flag, every "
             "sum certified); `compiled` what a large region, or a trainer's hot one, runs; `compiled, flags whole` "
             "the same with the trainer's candidate flags each reduced whole at once (`capture._any_flag` before it "
             "reduced them by rows first). `in "
             "step`: the same region's calls inside the verified steps (after the first), by the variant the "
             "engine chose (`runs`), with the replay's own work around the call.", ""]
    head = ["workload", "role", "region (first op)", "logged ops", "largest tensor", "calls / step", *VARIANTS,
            "runs", "in step"]
    lines += ["| " + " | ".join(head) + " |", "| " + " | ".join("---" for _ in head) + " |"]
    for name, rows in results.items():
        for r in rows:
            lines.append(f"| {name} | {r['role']} | {r['first op']} | {r['ops']} | {r['numel']} | {r['per_step']} | "
                         + " | ".join(f"{r['us'][v]:.0f}" for v in VARIANTS) + f" | {r['ran']} | {r['in_step']:.0f} |")
        for role in ("trainer", "auditor"):
            total = {v: sum(r["us"][v] * r["per_step"] for r in rows if r["role"] == role) for v in VARIANTS}
            in_step = sum(r["in_step"] * r["per_step"] for r in rows if r["role"] == role)
            lines.append(f"| {name} | {role} | **per step** | | | | "
                         + " | ".join(f"**{total[v]:.0f}**" for v in VARIANTS) + f" | | **{in_step:.0f}** |")
    return "\n".join(lines + [""])


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workloads", default="resnet,digits")
    ap.add_argument("--repeats", type=int, default=30)
    ap.add_argument("--shared", default=os.path.join(os.path.dirname(os.path.dirname(HERE)), "shared", "data"))
    ap.add_argument("--no-write", action="store_true")
    args = ap.parse_args(argv)
    from bench_engine import machine
    from veritrain import hardware

    hardware.apply_process_settings()
    results, _ = each_workload(ap, args.workloads, args.shared,
                               lambda ref, config, repeats, progress: measure(ref, config, repeats), args.repeats)
    command = "python bench/bench_regions.py " + shlex.join(argv if argv is not None else sys.argv[1:])
    section = markdown(results, command.strip(), machine("cpu"))
    print(section)
    if not args.no_write:
        write_section(os.path.join(HERE, "RESULTS.md"), section)


if __name__ == "__main__":
    main()
