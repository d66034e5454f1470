"""A matrix product with a large float32 operand under the engine: block by block (blocked.py) against the
eager path (the whole operand copied to float64 first), on GPT-2 2x128's vocabulary-wide products, in one
process with the two alternating, trainer and auditor.

    python bench/bench_blocked.py                 # batch 8 x 64 tokens, vocabulary 50257, width 128
    python bench/bench_blocked.py --reps 3 --no-write

Each product runs as the engine runs it inside a step (trainer: writes its log record; auditor: replays that
record); the plain float64 product (operands already float64, as in a plain float64 step) is timed beside it.

    python bench/bench_blocked.py --steps 8       # and whole steps, the logits' split on and off

``--steps``: whole training steps of a workload (bench/profile_engine.py's; GPT-2 2x128 unless --workload), the
trainer and the auditor with the logits' product split along N and with it eager, alternating in one process
beside plain float64 steps. This machine's plain float64 step swings by 2x between processes and minutes
(docs/SPEED.md), so the comparison of the two routes is the same-step ratios within one process.
Writes the "Matrix products block by block" section of bench/RESULTS.md unless --no-write.
"""

from __future__ import annotations

import argparse
import os
import shlex
import statistics
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import torch  # noqa: E402

from veritrain import blocked  # noqa: E402
from veritrain.engine import EngineConfig, step_context  # noqa: E402
from veritrain.logformat import StepLogReader, StepLogWriter  # noqa: E402

OFF = str(1 << 60)  # VERITRAIN_BLOCK_MIN_NUMEL that no operand reaches: the eager path


def products(tokens: int, vocab: int, width: int) -> dict:
    """name -> (a, b, what it is): the last hidden states h (tokens x width) times the tied embedding's transpose
    W^T (a transposed view, as a linear layer passes it), the logits' gradient G (tokens x vocab) times W, and
    G^T times h (a transposed view, as autograd passes it)."""
    g = torch.Generator().manual_seed(0)
    grad = torch.randn(tokens, vocab, generator=g) * 1e-4
    weight = torch.randn(vocab, width, generator=g) * 0.02
    hidden = torch.randn(tokens, width, generator=g)
    return {
        "logits h @ W^T": (hidden, weight.t(), f"({tokens} x {width}) @ ({width} x {vocab}), split along N"),
        "input gradient G @ W": (grad, weight, f"({tokens} x {vocab}) @ ({vocab} x {width}), split along K"),
        "weight gradient G^T @ h": (grad.t(), hidden, f"({vocab} x {tokens}) @ ({tokens} x {width}), split along M"),
    }


def _engine_mm(a, b, path, role):
    t0 = time.perf_counter()
    if role == "trainer":
        w = StepLogWriter(path, 0, 32)
        with step_context(EngineConfig(), 0, writer=w):
            torch.mm(a, b)
        w.close()
    else:
        with StepLogReader(path, expect_step=0, expect_bits=32) as r:
            with step_context(EngineConfig(), 0, reader=r) as mode:
                torch.mm(a, b)
        assert mode.stats.suspicious_count == 0
    return time.perf_counter() - t0


def measure(a, b, reps: int) -> dict:
    times = {k: [] for k in ("fp64", "trainer eager", "trainer blocked", "auditor eager", "auditor blocked")}
    a64, b64 = a.double(), b.double()
    with tempfile.TemporaryDirectory() as d:
        for rep in range(reps + 1):  # the first round warms up (compiled epilogues)
            order = ("eager", "blocked") if rep % 2 else ("blocked", "eager")
            for how in order:
                os.environ["VERITRAIN_BLOCK_MIN_NUMEL"] = OFF if how == "eager" else "0"
                path = os.path.join(d, f"{how}.vtlog")
                t_train = _engine_mm(a, b, path, "trainer")
                t_audit = _engine_mm(a, b, path, "auditor")
                if rep:
                    times[f"trainer {how}"].append(t_train)
                    times[f"auditor {how}"].append(t_audit)
            t0 = time.perf_counter()
            torch.mm(a64, b64)
            if rep:
                times["fp64"].append(time.perf_counter() - t0)
    os.environ.pop("VERITRAIN_BLOCK_MIN_NUMEL", None)
    return {k: statistics.median(v) for k, v in times.items()}


STEP_RUNS = ("fp64", "trainer", "auditor", "trainer, logits eager", "auditor, logits eager")


def measure_steps(workload: str, steps: int, shared: str) -> dict:
    """Per-step times of STEP_RUNS (one warm-up step first): each run its own model, each auditor replaying its
    own trainer's log; the logits' split off ("logits eager") by taking "n" out of blocked.split's answers."""
    from profile_engine import _step, workloads
    from veritrain.rounding import Grid
    from veritrain.runner import _prepare_batch, _prepare_model, place_task
    from veritrain.task import build

    ref, config, _ = workloads(shared)[workload]
    grid, cfg = Grid(32), EngineConfig()
    tasks = {}
    for run in STEP_RUNS:
        t = build(ref, config)
        _prepare_model(t, "fp64" if run == "fp64" else "fp32", grid)
        tasks[run] = place_task(t, torch.device("cpu"))
    split = blocked.split
    logits_eager = lambda a, b: None if split(a, b) == "n" else split(a, b)  # noqa: E731
    times = {r: [] for r in STEP_RUNS}
    try:
        with tempfile.TemporaryDirectory() as d:
            for step in range(steps + 1):
                order = STEP_RUNS if step % 2 else STEP_RUNS[:1] + STEP_RUNS[3:] + STEP_RUNS[1:3]
                for run in order:
                    blocked.split = logits_eager if "eager" in run else split
                    mode = run.split(",")[0]
                    batch = _prepare_batch(tasks[run].batch(step), mode if mode == "fp64" else "fp32", grid)
                    path = os.path.join(d, f"{step}{'e' if 'eager' in run else ''}.vtlog")
                    elapsed = _step(tasks[run], mode, step, batch, path, cfg)
                    if step:
                        times[run].append(elapsed)
                if step:
                    print(f"  step {step}: " + ", ".join(f"{r} {times[r][-1]:.2f}s" for r in STEP_RUNS), flush=True)
    finally:
        blocked.split = split
    fp64 = times["fp64"]
    return {"median_s": {r: statistics.median(v) for r, v in times.items()},
            "over_fp64": {r: statistics.median(t / f for t, f in zip(v, fp64)) for r, v in times.items()}}


def markdown(results: dict, command: str, machine: str, steps: dict | None = None) -> str:
    lines = ["## Matrix products block by block (issue 12)", "", f"Command: `{command}`", "", f"Machine: {machine}", "",
             "Written by `bench/bench_blocked.py`: the engine's matrix product on GPT-2 2x128's three vocabulary-wide "
             "products (the logits and the two that read their gradient), eager (the float32 operand copied to "
             "float64 whole, the result rounded and scanned whole) and block by block (`blocked.py`), alternating in "
             "one process; medians in ms; `fp64` is the plain float64 product on operands already in float64. "
             f"Operand blocks of the split along K: {blocked.BLOCK_NUMEL} float64 elements; the splits along M and N "
             f"(blocks of the result, rounded and scanned as they come): {blocked.RESULT_BLOCK_NUMEL}.", "",
             "| product | shapes | fp64 | trainer eager | trainer blocked | auditor eager | auditor blocked |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for name, (shapes, t) in results.items():
        cells = " | ".join(f"{1e3 * t[k]:.0f}" for k in ("fp64", "trainer eager", "trainer blocked", "auditor eager",
                                                          "auditor blocked"))
        lines.append(f"| {name} | {shapes} | {cells} |")
    if steps:
        workload, t = steps["workload"], steps["result"]
        lines += ["", f"Whole steps of `{workload}` ({steps['count']} counted), alternating in one process: medians, "
                  "and medians of same-step ratios to the plain float64 step.", "",
                  "| run | median step | over plain fp64 |", "| --- | --- | --- |"]
        for run in STEP_RUNS:
            lines.append(f"| {run} | {t['median_s'][run]:.3f} s | {t['over_fp64'][run]:.2f}x |")
    return "\n".join(lines) + "\n"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--vocab", type=int, default=50257)
    ap.add_argument("--width", type=int, default=128)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--block", type=int, default=blocked.BLOCK_NUMEL, help="float64 elements per operand block")
    ap.add_argument("--result-block", type=int, default=blocked.RESULT_BLOCK_NUMEL,
                    help="float64 elements per block of the splits along M and N (operand copy or result, the larger)")
    ap.add_argument("--steps", type=int, default=0, help="also time this many whole steps (0: products only)")
    ap.add_argument("--workload", default="gpt2", help="bench/profile_engine.py's workload for --steps")
    ap.add_argument("--shared", default=os.path.join(os.path.dirname(os.path.dirname(HERE)), "shared", "data"))
    ap.add_argument("--no-write", action="store_true")
    args = ap.parse_args(argv)
    from bench_engine import machine
    from profile_engine import write_section

    blocked.BLOCK_NUMEL, blocked.RESULT_BLOCK_NUMEL = args.block, args.result_block
    results = {}
    for name, (a, b, shapes) in products(args.tokens, args.vocab, args.width).items():
        t = measure(a, b, args.reps)
        results[name] = (shapes, t)
        print(f"{name}: " + ", ".join(f"{k} {1e3 * v:.0f} ms" for k, v in t.items()), flush=True)
    steps = None
    if args.steps:
        steps = {"workload": args.workload, "count": args.steps,
                 "result": measure_steps(args.workload, args.steps, args.shared)}
    command = "python bench/bench_blocked.py " + shlex.join(argv if argv is not None else sys.argv[1:])
    section = markdown(results, command.strip(), machine(), steps)
    print(section)
    if not args.no_write:
        write_section(os.path.join(HERE, "RESULTS.md"), section)


if __name__ == "__main__":
    main()
