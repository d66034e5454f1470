"""Table 5 of the paper: time per training step of plain float32, plain float64, the trainer (float64 +
rounding + log) and the auditor (replaying the log), as ratios measured in one process.

Every step index runs once in every mode; the order of the modes rotates from step to step (the auditor
after the trainer, whose log it replays) and the first step (compilation, warm-up) is not counted, or the
first ``warmup`` steps where more are asked for (a large model's plain float64 step took several steps to
settle on this project's CPUs: docs/SPEED-RECORD.md, session 56).
Ratios are per step (mode time / plain float64 time of the same step), then the median."""

from __future__ import annotations

import os
import statistics
import tempfile
import time

import torch

from .common import read_table, start, Output

MODES = ("fp32", "fp64", "trainer", "auditor")
ORDERS = [("fp32", "fp64", "trainer", "auditor"), ("fp64", "trainer", "auditor", "fp32"),
          ("trainer", "auditor", "fp32", "fp64"), ("trainer", "fp32", "auditor", "fp64")]
DENSE_BITS_PER_VALUE = 1.6


def measure(task_ref: str, config: dict, steps: int, progress=print, device="cpu", warmup: int = 1) -> dict:
    """Per-mode step times and log sizes of ``steps`` counted steps, after ``warmup`` uncounted ones, on
    ``device``."""
    from ..runner import on_device

    if steps < 1 or warmup < 1:
        raise ValueError(f"steps and warmup must be at least 1 (got {steps} and {warmup}): the first step compiles")
    with on_device(device) as device:
        return _measure(task_ref, config, steps, progress, device, warmup)


def _measure(task_ref: str, config: dict, steps: int, progress, device, warmup: int = 1) -> dict:
    from ..engine import EngineConfig, step_context
    from ..logformat import StepLogReader, StepLogWriter
    from ..rounding import Grid
    from ..runner import _prepare_batch, _prepare_model, place_task
    from ..task import build

    grid, engine = Grid(32), EngineConfig()
    tasks = {}
    for mode in MODES:
        t = build(task_ref, config)
        _prepare_model(t, "fp64" if mode == "fp64" else "fp32", grid)
        tasks[mode] = place_task(t, device)
    times = {m: [] for m in MODES}
    logs = []
    with tempfile.TemporaryDirectory() as log_dir:
        for step in range(warmup + steps):
            for mode in ORDERS[step % len(ORDERS)]:
                task = tasks[mode]
                batch = _prepare_batch(task.batch(step), "fp64" if mode == "fp64" else "fp32", grid)
                path = os.path.join(log_dir, f"{step}.vtlog")
                t0 = time.perf_counter()
                if mode in ("fp32", "fp64"):
                    task.run_step(batch)  # plain PyTorch, no dispatch mode: what the user would run anyway
                elif mode == "trainer":
                    writer = StepLogWriter(path, step, 32)
                    with step_context(engine, step, writer=writer) as st:
                        task.run_step(batch)
                    info = writer.close()
                else:
                    reader = StepLogReader(path, expect_step=step, expect_bits=32)
                    with step_context(engine, step, reader=reader) as audit_st:
                        task.run_step(batch)
                    reader.close()
                if device.type == "cuda":  # a GPU runs queued kernels after the Python call returns
                    torch.cuda.synchronize(device)
                elapsed = time.perf_counter() - t0
                if step >= warmup:
                    times[mode].append(elapsed)
                if mode == "trainer":
                    trainer_stats = st.stats
                if mode == "auditor":
                    logs.append({"bytes": info["bytes"], "rounded": trainer_stats.rounded_total,
                                 "entries": trainer_stats.entries_total,
                                 "corrections": audit_st.stats.corrections_total,
                                 "suspicious": audit_st.stats.suspicious_count})
            if progress and step >= warmup:
                progress(f"  step {step}: " + ", ".join(f"{m} {times[m][-1]:.2f}s" for m in MODES)
                         + f"; log {logs[-1]['bytes']} B, {logs[-1]['entries']} entries")
    counted = logs[warmup:]
    rounded = statistics.median(x["rounded"] for x in counted)
    log_bytes = statistics.median(x["bytes"] for x in counted)
    dense = rounded * DENSE_BITS_PER_VALUE / 8
    ratios = {m: [t / f for t, f in zip(times[m], times["fp64"])] for m in MODES}  # per counted step, in order
    return {"steps": steps, "ratio": {m: statistics.median(ratios[m]) for m in MODES}, "ratios": ratios,
            "median_s": {m: statistics.median(times[m]) for m in MODES}, "rounded": rounded, "log_bytes": log_bytes,
            "entries": statistics.median(x["entries"] for x in counted), "dense_bytes": dense,
            "log_fraction": log_bytes / dense, "corrections": sum(x["corrections"] for x in logs),
            "suspicious": sum(x["suspicious"] for x in logs)}


def run(args) -> Output:
    from .. import hardware

    hardware.apply_process_settings()
    loads, out = start(args, "time")
    rows = []
    for w, (task, config) in loads.items():
        r = measure(task, config, max(args.steps, 2), progress=None, device=args.device)
        rows.append({"workload": w, "fp32_over_fp64": r["ratio"]["fp32"], "trainer_over_fp64": r["ratio"]["trainer"],
                     "auditor_over_fp64": r["ratio"]["auditor"], "fp64_step_s": r["median_s"]["fp64"],
                     "trainer_over_fp32": r["median_s"]["trainer"] / r["median_s"]["fp32"],
                     "auditor_over_fp32": r["median_s"]["auditor"] / r["median_s"]["fp32"],
                     "log_bytes": r["log_bytes"], "dense_bytes": r["dense_bytes"], "steps": r["steps"]})
    cols = ["workload", "steps", "fp32_over_fp64", "trainer_over_fp64", "auditor_over_fp64", "trainer_over_fp32",
            "auditor_over_fp32", "fp64_step_s", "log_bytes", "dense_bytes"]
    out.table(rows, cols)
    plt = out.figure()
    fig, ax = plt.subplots(figsize=(6, 3.6))
    x = range(len(rows))
    for j, (k, label) in enumerate([("fp32_over_fp64", "plain float32"), ("trainer_over_fp64", "trainer"),
                                    ("auditor_over_fp64", "auditor")]):
        ax.bar([i + 0.25 * j for i in x], [r[k] for r in rows], 0.25, label=label)
    ax.axhline(1.0, color="k", lw=0.8)
    ax.set_xticks([i + 0.25 for i in x], [r["workload"] for r in rows])
    ax.set_ylabel("time per step / plain float64")
    ax.legend(fontsize=8)
    out.save_figure(plt)
    out.markdown("Time per step (paper Table 5)",
                 "Medians of per-step ratios in one process. The paper reports the trainer at 1.2-1.4x and the "
                 "auditor at 1.3-1.7x the original (float32 on GPU) time; its own code on this CPU takes 6x "
                 "(trainer) and 9-13x (auditor) a plain float64 step for GPT-2 2x128.", rows, cols)
    return out


def check(out_dir: str) -> list[str]:
    rows = read_table(out_dir, "time")
    return [f"{r['workload']}: non-positive ratio" for r in rows
            if min(float(r[k]) for k in ("fp32_over_fp64", "trainer_over_fp64", "auditor_over_fp64")) <= 0]
