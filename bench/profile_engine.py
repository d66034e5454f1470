"""Where a verified step's time goes: float64 kernels, rounding, the near-midpoint scan, error scales, the
exact classification of candidates, log I/O, and what is left (dispatch and Python), for the trainer and
the auditor, against plain float64 and float32 steps measured in the same process.

    python bench/profile_engine.py                                # gpt2 2x128, resnet default, digits-cnn
    python bench/profile_engine.py --workloads digits --steps 3 --no-write
    python bench/profile_engine.py --workloads gpt2-117m,resnet18 --steps 2 --section "full size"
    python bench/profile_engine.py --device cuda --workloads gpt2-117m --steps 2 --section "GPU"
    python bench/profile_engine.py --workloads resnet,digits --steps 3 --per-op 8   # each op's time per step
    python bench/profile_engine.py --workloads gpt2-117m --steps 5 --warmup 4 --no-write   # past the first, slow steps

Each category's time is exclusive (a timer stack: time inside a nested category counts there, not in
its parent). The engine's methods are wrapped for the instrumented runs only; the same steps also run
without the wrappers, so the table gives the instrumentation's own cost (``instrumented / plain``). On a GPU
(--device cuda) every timer boundary of the instrumented runs waits for the GPU, so a category holds its own
kernels' time rather than the next wait's; that adds waits, which the instrumented / plain column shows. Writes
the "Where the time goes" section of bench/RESULTS.md unless --no-write (with --per-op, the "Per op" section:
which ops the trainer's and the auditor's time goes to, against the same ops in a plain float64 step).
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import os
import shlex
import statistics
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import torch  # noqa: E402

from veritrain import blocked, capture, convolution, engine, fused, logformat, rounding, rules  # noqa: E402
from veritrain.engine import EngineConfig, logged_step  # noqa: E402
from veritrain.logformat import StepLogReader, StepLogWriter  # noqa: E402
from veritrain.rounding import Grid  # noqa: E402
from veritrain.runner import _prepare_batch, _prepare_model, place_task  # noqa: E402
from veritrain.task import build  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

CATEGORIES = {
    "kernel": "op kernels (float64; float32 where exact; views)",
    "fused": "fused kernels (float64 op or sum + scale + round + scan, compiled; captured regions)",
    "round": "rounding to the grid",
    "scan": "near-midpoint scan (bulk test)",
    "scale": "error scales",
    "classify": "exact classification / replay checks of candidates",
    "log": "log I/O (encode, write, read, decode)",
    "python": "dispatch, argument handling, upcast copies, Python",
}


def workloads(shared: str) -> dict:
    data = shared if os.path.isdir(shared) else os.path.join(os.path.dirname(os.path.dirname(HERE)), "shared", "data")
    return {
        "gpt2": ("gpt2-shakespeare", {"corpus": os.path.join(data, "shakespeare.txt"),
                                      "tokenizer": os.path.join(data, "gpt2-tokenizer"), "n_layer": 2, "n_embd": 128,
                                      "n_head": 4, "batch_size": 8, "seq_len": 64, "max_chars": 200000, "lr": 1e-3},
                 "GPT-2 2x128 (the experiments' gpt2 workload: HF GPT-2, BPE vocabulary 50257), batch 8 x 64, AdamW"),
        "resnet": ("resnet-cifar10", {"data": "digits", "arch": "resnet18", "width": 8, "batch_size": 16,
                                      "train_examples": 512, "eval_examples": 297},
                   "ResNet-18 width 8 (the experiments' default size), batch 16, SGD momentum"),
        "digits": ("digits-cnn", {}, "digits-cnn (the small built-in CNN), default config"),
        # the full-size targets (bench/run_experiments.py's GPT2_117M settings; the standard width)
        "gpt2-117m": ("gpt2-shakespeare", {"corpus": os.path.join(data, "shakespeare.txt"),
                                           "tokenizer": os.path.join(data, "gpt2-tokenizer"), "n_layer": 12,
                                           "n_embd": 768, "n_head": 12, "batch_size": 8, "seq_len": 64,
                                           "max_chars": 200000, "lr": 1e-3},
                      "GPT-2 117M (12 x 768, BPE vocabulary 50257), batch 8 x 64, AdamW"),
        "resnet18": ("resnet-cifar10", {"data": "digits", "arch": "resnet18", "width": 64, "batch_size": 16,
                                        "train_examples": 512, "eval_examples": 297},
                     "ResNet-18 (standard width 64, digits as 3x32x32), batch 16, SGD momentum"),
    }


class Profile:
    """Exclusive time per category: a stack of open categories; entering one pauses its parent."""

    def __init__(self, sync=None):
        self.sync = sync  # on a GPU: wait for queued kernels at each boundary
        self.seconds = dict.fromkeys(CATEGORIES, 0.0)
        self.calls = dict.fromkeys(CATEGORIES, 0)
        self.stack: list[list] = []  # [category, started]
        self.op = None  # --per-op: the engine's top-level op now running (None between ops)
        self.by_op = collections.defaultdict(float)  # (op, category) -> seconds

    def _add(self, cat, seconds):
        self.seconds[cat] += seconds
        self.by_op[(self.op, cat)] += seconds

    def enter(self, cat):
        if self.sync is not None:
            self.sync()
        now = time.perf_counter()
        if self.stack:
            top = self.stack[-1]
            self._add(top[0], now - top[1])
        self.stack.append([cat, now])
        self.calls[cat] += 1

    def leave(self):
        if self.sync is not None:
            self.sync()
        now = time.perf_counter()
        cat, started = self.stack.pop()
        self._add(cat, now - started)
        if self.stack:
            self.stack[-1][1] = now

    def timed(self, cat, fn, only_at_top=False):
        def wrapper(*args, **kwargs):
            # an aten call made by a rule or a rounding helper counts in that category, not as a kernel
            if only_at_top and self.stack and self.stack[-1][0] != "python":
                return fn(*args, **kwargs)
            self.enter(cat)
            try:
                return fn(*args, **kwargs)
            finally:
                self.leave()
        return wrapper


def _targets():
    """(owner, attribute, category) of every wrapped function."""
    return [
        (torch._ops.OpOverload, "__call__", "kernel"),
        (blocked, "mm", "kernel"),  # float64 matrix products block by block, their copies and norms
        (blocked, "mm_in_blocks", "kernel"),  # products by blocks of the result's rows or columns (epilogues: scan)
        (convolution, "forward", "kernel"),  # forward convolutions by the input-gradient kernel (an op packet's call)
        (rounding.Grid, "round", "round"),
        (rounding.Grid, "candidates", "scan"),
        (engine._EagerSlot, "candidate_indices", "scan"),
        (fused.Epilogues, "run", "scan"),
        (fused.FusedSums, "run", "fused"),
        (capture.Region, "run", "fused"),
        (engine._Analysis, "scale", "scale"),
        (rules.LazyScale, "materialize", "scale"),
        (rules.LazyScale, "at", "scale"),
        (rules.RowSubset, "materialize", "scale"),
        (rules.PatchNorm, "full", "scale"),  # a convolution's patch norms (inside the epilogue's call too)
        (rules.PatchNorm, "at", "scale"),
        (rules.RowSubset, "at", "scale"),
        (rules.RelScale, "materialize", "scale"),
        (engine._FusedSlot, "_eval", "classify"),
        (engine._SumSlot, "_eval", "classify"),
        (engine._ProductSlot, "values_at", "classify"),
        (rounding.Grid, "classify", "classify"),
        (rounding.Grid, "round_host", "classify"),
        (rounding.Grid, "apply_direction", "classify"),
        (rounding.Grid, "midpoint_distance", "classify"),
        (rounding.Grid, "spacing_at", "classify"),
        (engine.AuditorHalf, "replay", "classify"),
        (logformat.StepLogWriter, "op", "log"),
        (logformat.StepLogWriter, "quiet_ops", "log"),  # a captured region's records
        (logformat.StepLogWriter, "close", "log"),
        (logformat.StepLogReader, "next_op", "log"),
        (logformat.StepLogReader, "skip_quiet", "log"),
        (logformat.StepLogReader, "__init__", "log"),
    ]


@contextlib.contextmanager
def instrumented(profile: Profile):
    saved = []
    for owner, name, cat in _targets():
        fn = owner.__dict__[name]
        saved.append((owner, name, fn))
        setattr(owner, name, profile.timed(cat, fn, only_at_top=(cat == "kernel")))
    build_kernel = fused.FusedKernels.kernel

    def kernel(self, *a, **k):  # the compiled function it returns is the fused category
        fn, compute = build_kernel(self, *a, **k)
        return profile.timed("fused", fn), compute

    fused.FusedKernels.kernel = kernel
    saved.append((fused.FusedKernels, "kernel", build_kernel))
    try:
        profile.enter("python")
        yield profile
    finally:
        profile.leave()
        for owner, name, fn in saved:
            setattr(owner, name, fn)


def _step(task, mode, step, batch, path, cfg, profile=None, sync=None):
    if sync is not None:
        sync()
    t0 = time.perf_counter()
    ctx = instrumented(profile) if profile is not None else contextlib.nullcontext()
    with ctx:
        if mode in ("fp32", "fp64"):
            task.run_step(batch)
        elif mode == "trainer":
            # as a run writes a step's log: no fsync of its own (store.sync_files syncs an interval's files at
            # its checkpoint, which these steps do not time, as they do not time checkpoints)
            with logged_step(cfg, step, writer=StepLogWriter(path, step, 32, pending=[])):
                task.run_step(batch)
        else:
            with logged_step(cfg, step, reader=StepLogReader(path, expect_step=step, expect_bits=32)):
                task.run_step(batch)
    if sync is not None:
        sync()
    return time.perf_counter() - t0


RUNS = ("fp32", "fp64", "trainer", "auditor", "trainer*", "auditor*")  # * = instrumented


def measure(task_ref: str, config: dict, steps: int, progress=print, device="cpu", warmup: int = 1) -> dict:
    """Per-step times of every run and the instrumented runs' category breakdown (medians over ``steps``
    counted steps, after ``warmup`` uncounted ones) on ``device``."""
    from veritrain.runner import on_device

    with on_device(device) as device:
        return _measure(task_ref, config, steps, progress, device, warmup)


def _measure(task_ref, config, steps, progress, device, warmup=1):
    grid, cfg = Grid(32), EngineConfig()
    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else None
    tasks = {}
    for run in RUNS:
        t = build(task_ref, config)
        _prepare_model(t, "fp64" if run == "fp64" else "fp32", grid)
        tasks[run] = place_task(t, device)
    times = {r: [] for r in RUNS}
    shares = {r: {c: [] for c in CATEGORIES} for r in ("trainer*", "auditor*")}
    with tempfile.TemporaryDirectory() as d:
        for step in range(warmup + steps):
            order = RUNS[step % len(RUNS):] + RUNS[:step % len(RUNS)]
            # a replay needs its trainer's log: keep each auditor after its trainer
            order = sorted(order, key=lambda r: (order.index(r.replace("auditor", "trainer")), "auditor" in r))
            for run in order:
                mode = run.rstrip("*")
                batch = _prepare_batch(tasks[run].batch(step), "fp64" if mode == "fp64" else "fp32", grid)
                path = os.path.join(d, f"{step}{'i' if run.endswith('*') else ''}.vtlog")
                profile = Profile(sync) if run.endswith("*") else None
                elapsed = _step(tasks[run], mode, step, batch, path, cfg, profile, sync)
                if step < warmup:
                    continue
                times[run].append(elapsed)
                if profile is not None:
                    for c in CATEGORIES:
                        shares[run][c].append(profile.seconds[c] / elapsed)
            if progress and step >= warmup:
                progress("  step %d: %s" % (step, ", ".join(f"{r} {times[r][-1]:.2f}s" for r in RUNS)))
    fp64 = times["fp64"]
    out = {"median_s": {r: statistics.median(times[r]) for r in RUNS},
           "over_fp64": {r: statistics.median(t / f for t, f in zip(times[r], fp64)) for r in RUNS},
           "share": {r: {c: statistics.median(v) for c, v in shares[r].items()} for r in shares}}
    # each category as a multiple of the same step's plain float64 time (shares of the instrumented step
    # scaled by the uninstrumented step's ratio, so the columns add up to the trainer's / auditor's ratio)
    out["in_fp64_steps"] = {r: {c: out["share"][r + "*"][c] * out["over_fp64"][r] for c in CATEGORIES}
                            for r in ("trainer", "auditor")}
    return out


class _OpTimer(TorchDispatchMode):
    """Times each aten op of a plain step (the same names the engine's top-level ops have)."""

    def __init__(self):
        super().__init__()
        self.seconds = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        t0 = time.perf_counter()
        out = func(*args, **(kwargs or {}))
        self.seconds[str(func)] += time.perf_counter() - t0
        return out


def per_op(task_ref: str, config: dict, steps: int, warmup: int = 1) -> dict:
    """Each op's time per step by its aten name: in the trainer's and the auditor's steps the engine's top-level
    ops, split into the profile's categories (an op's whole handling; the ops of a decomposition it runs count
    in their caller; ``None`` is the time between ops: autograd, the optimizer's Python, the step's set-up),
    and in a plain float64 step the same ops (its kernels and the timer's own cost). Medians over ``steps``
    counted steps after one warm-up step: {"fp64": {op: s}, "trainer": {op: {category: s}}, "auditor": ...}."""
    grid, cfg = Grid(32), EngineConfig()
    tasks = {}
    for run in ("fp64", "trainer", "auditor"):
        t = build(task_ref, config)
        _prepare_model(t, "fp64" if run == "fp64" else "fp32", grid)
        tasks[run] = place_task(t, torch.device("cpu"))
    timed = {run: [] for run in tasks}
    dispatch, depth, profile = engine.VerifiedMode._dispatch, [0], [None]

    def top_level(self, func, args, kwargs):
        p = profile[0]
        depth[0] += 1
        if depth[0] == 1 and p is not None:
            p.enter("python")  # a boundary: the time before it is the previous op's
            p.op = str(func)
        try:
            return dispatch(self, func, args, kwargs)
        finally:
            depth[0] -= 1
            if depth[0] == 0 and p is not None:
                p.leave()
                p.op = None

    engine.VerifiedMode._dispatch = top_level
    try:
        with tempfile.TemporaryDirectory() as d:
            for step in range(warmup + steps):
                for run in tasks:
                    batch = _prepare_batch(tasks[run].batch(step), "fp64" if run == "fp64" else "fp32", grid)
                    if run == "fp64":
                        with _OpTimer() as timer:
                            _step(tasks[run], run, step, batch, None, cfg)
                        seconds = dict(timer.seconds)
                    else:
                        profile[0] = Profile()
                        _step(tasks[run], run, step, batch, os.path.join(d, f"{step}.vtlog"), cfg, profile[0])
                        seconds = {}
                        for (op, cat), t in profile[0].by_op.items():
                            seconds.setdefault(op, dict.fromkeys(CATEGORIES, 0.0))[cat] += t
                        profile[0] = None
                    if step >= warmup:
                        timed[run].append(seconds)
    finally:
        engine.VerifiedMode._dispatch = dispatch
    out = {}
    for run, runs in timed.items():
        ops = set().union(*(s.keys() for s in runs))
        if run == "fp64":
            out[run] = {op: statistics.median(s.get(op, 0.0) for s in runs) for op in ops}
        else:
            out[run] = {op: {c: statistics.median(s.get(op, {}).get(c, 0.0) for s in runs) for c in CATEGORIES}
                        for op in ops}
    return out


def per_op_markdown(results: dict, command: str, machine: str, top: int) -> str:
    lines = ["## Per op (issue 12: profile)", "", f"Command: `{command}`", "", f"Machine: {machine}", "",
             "Written by `bench/profile_engine.py --per-op`: milliseconds per step, medians over the counted "
             "steps, of the ops that take most of the trainer's step: in the trainer's and the auditor's "
             "instrumented steps each top-level op of the engine (all of its handling; the ops of a "
             "decomposition it runs count in their caller), split into the profile's categories, and the same "
             "op in a plain float64 step (timed by a dispatch mode of its own: its kernels and that mode's "
             "small cost). `(between ops)` is autograd, the optimizer's and the step's own Python.", ""]
    head = ["workload", "run", "op", "plain fp64", "total", *CATEGORIES]
    lines += ["| " + " | ".join(head) + " |", "| " + " | ".join("---" for _ in head) + " |"]
    for name, r in results.items():
        total = {run: {op: sum(cats.values()) for op, cats in r[run].items()} for run in ("trainer", "auditor")}
        ops = sorted((op for op in total["trainer"] if op is not None), key=lambda op: -total["trainer"][op])[:top]
        for run in ("trainer", "auditor"):
            for op in ops + [None]:
                cats = r[run].get(op, dict.fromkeys(CATEGORIES, 0.0))
                plain = f"{1e3 * r['fp64'].get(op, 0.0):.2f}" if op is not None else ""
                lines.append(f"| {name} | {run} | {op or '(between ops)'} | {plain} | {1e3 * sum(cats.values()):.2f} | "
                             + " | ".join(f"{1e3 * cats[c]:.2f}" for c in CATEGORIES) + " |")
            lines.append(f"| {name} | {run} | **every op** | **{1e3 * sum(r['fp64'].values()):.2f}** | "
                         f"**{1e3 * sum(total[run].values()):.2f}** |" + " |" * len(CATEGORIES))
    return "\n".join(lines + [""])


def markdown(results: dict, descriptions: dict, command: str, machine: str, section: str = "") -> str:
    lines = [f"## Where the time goes (issue 12: profile{', ' + section if section else ''})", "",
             f"Command: `{command}`", "", f"Machine: {machine}", "",
             "Written by `bench/profile_engine.py`. Each verified step ran twice per step index: plain, and with "
             "the engine's functions wrapped by an exclusive timer stack (a category's time excludes nested "
             "categories). Shares are medians over the counted steps of the instrumented step; the cells are those "
             "shares times the plain step's ratio to plain float64 (medians of same-step ratios), so a row's "
             "cells add up to its ratio. `python` is the rest: the dispatch mode's own work per op (schema "
             "lookup, pytree, scalars, the float64 copies of float32 operands, write-back), autograd and the "
             "optimizer's Python.", ""]
    head = ["workload", "run", "step / fp64", *CATEGORIES, "instrumented / plain"]
    lines += ["| " + " | ".join(head) + " |", "| " + " | ".join("---" for _ in head) + " |"]
    for name, r in results.items():
        lines.append(f"| {name} | plain fp32 | {r['over_fp64']['fp32']:.2f}x |" + " |" * len(CATEGORIES) + " |")
        lines.append(f"| {name} | plain fp64 | 1.00x ({r['median_s']['fp64']:.3g} s) |" + " |" * len(CATEGORIES) + " |")
        for run in ("trainer", "auditor"):
            cells = " | ".join(f"{r['in_fp64_steps'][run][c]:.2f}" for c in CATEGORIES)
            over = r["median_s"][run + "*"] / r["median_s"][run]
            lines.append(f"| {name} | {run} | {r['over_fp64'][run]:.2f}x | {cells} | {over:.2f}x |")
    lines += ["", "Categories: " + "; ".join(f"`{c}` {d}" for c, d in CATEGORIES.items()) + ".", "",
              "Workloads: " + "; ".join(f"{k}: {v}" for k, v in descriptions.items()) + ".", ""]
    return "\n".join(lines)


def write_section(path: str, section: str):
    title = section.splitlines()[0]
    text = open(path).read() if os.path.exists(path) else "# Benchmarks\n"
    if title in text:
        start = text.index(title)
        nxt = text.find("\n## ", start + len(title))
        text = text[:start] + section.rstrip() + "\n" + (text[nxt:] if nxt >= 0 else "")
    else:
        text = text.rstrip() + "\n\n" + section
    with open(path, "w") as f:
        f.write(text)


def each_workload(ap, names: str, shared: str, measure, steps: int):
    """``measure(task_ref, config, steps, progress=...)`` for each of the comma-separated workloads: (results,
    descriptions) by name; an unknown name is the argument parser's error."""
    known = workloads(shared)
    results, descriptions = {}, {}
    for name in names.split(","):
        if name not in known:
            ap.error(f"unknown workload {name!r}; known: {', '.join(known)}")
        task_ref, config, description = known[name]
        print(f"{name}: {description}", flush=True)
        results[name] = measure(task_ref, config, steps, progress=lambda s: print(f"{name}{s}", flush=True))
        descriptions[name] = description
    return results, descriptions


def workload_bench(script: str, description: str, workloads: str, steps: int, measure, markdown, argv=None):
    """The command line the workload benches share (--workloads, --steps, --shared, --no-write): ``measure`` on
    each workload, then ``markdown(results, descriptions, command, machine)`` printed and written into
    bench/RESULTS.md as its section unless --no-write."""
    from bench_engine import machine

    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("--workloads", default=workloads)
    ap.add_argument("--steps", type=int, default=steps)
    ap.add_argument("--shared", default=os.path.join(os.path.dirname(os.path.dirname(HERE)), "shared", "data"))
    ap.add_argument("--no-write", action="store_true")
    args = ap.parse_args(argv)
    results, descriptions = each_workload(ap, args.workloads, args.shared, measure, args.steps)
    command = shlex.join(["python", f"bench/{script}", *(sys.argv[1:] if argv is None else argv)])
    text = markdown(results, descriptions, command, machine())
    print(text)
    if not args.no_write:
        write_section(os.path.join(HERE, "RESULTS.md"), text)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workloads", default="gpt2,resnet,digits")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=1, help="uncounted steps before the counted ones (default 1; "
                    "GPT-2 117M's plain float64 step took about 4 to settle here: bench_engine.py --warmup)")
    ap.add_argument("--shared", default=os.path.join(os.path.dirname(os.path.dirname(HERE)), "shared", "data"))
    ap.add_argument("--no-write", action="store_true")
    ap.add_argument("--device", default="cpu", metavar="cpu|cuda[:N]", help="where every run goes (default cpu)")
    ap.add_argument("--section", default="", help="a name for the RESULTS.md section (runs of other workloads "
                    "keep their own section), e.g. --workloads gpt2-117m,resnet18 --section 'full size'")
    ap.add_argument("--per-op", type=int, default=0, metavar="N", help="instead, each op's time per step in the "
                    "trainer, the auditor and a plain float64 step: the N ops that take most of the trainer's (CPU)")
    args = ap.parse_args(argv)
    if args.steps < 1 or args.warmup < 1:
        ap.error(f"--steps and --warmup must be at least 1 (got {args.steps} and {args.warmup})")
    from bench_engine import machine
    from veritrain import hardware

    hardware.apply_process_settings()
    command = "python bench/profile_engine.py " + shlex.join(argv if argv is not None else sys.argv[1:])
    if args.per_op:
        results, _ = each_workload(ap, args.workloads, args.shared, lambda ref, cfg, steps, progress: per_op(ref, cfg, steps, args.warmup),
                                   args.steps)
        section = per_op_markdown(results, command.strip(), machine("cpu"), args.per_op)
        print(section)
        if not args.no_write:
            write_section(os.path.join(HERE, "RESULTS.md"), section)
        return
    results, descriptions = each_workload(ap, args.workloads, args.shared,
                                          lambda *a, **k: measure(*a, **k, device=args.device, warmup=args.warmup),
                                          args.steps)
    section = markdown(results, descriptions, command.strip(), machine(args.device), args.section)
    print(section)
    if not args.no_write:
        write_section(os.path.join(HERE, "RESULTS.md"), section)


if __name__ == "__main__":
    main()
