"""What a whole-step replay would have to follow: the op stream the trainer's engine sees in each step of a
workload, where Python reads a value in it, and how much of it stays the same from step to step.

    python bench/step_stream.py                                    # gpt2 2x128, resnet default, digits-cnn
    python bench/step_stream.py --workloads digits --steps 4 --no-write

Why: docs/SPEED.md ("The compiled path") names the hard part of capturing a whole step: a replay that skips the
step's Python must guard everything that Python reads. The route it sets out instead keeps the Python running and
defers the engine's work: each top-level op is checked against the recorded stream as the Python issues it, and
the ops are run together, as one compiled program, where Python first reads a value they produce (a sync point)
or the step ends. This measures what that route would meet on the built-in tasks, under the trainer's engine:

* ``ops``: the engine's top-level ops a step (its own decompositions' ops are not counted: a deferred replay
  would run them inside their operator's lowering, as capture.py does today);
* ``syncs``: the top-level ops whose result Python reads (``aten._local_scalar_dense``: ``.item()``, ``float()``;
  ``is_nonzero``, ``equal``) or whose output shape depends on values (``nonzero``, ``masked_select``, ...);
  ``segments``: the runs of ops between them that hold any op, and the largest one's share of the step's ops;
* ``same structure``: whether every counted step has the first counted step's stream, op for op (the op, its
  tensors' shapes and dtypes, which earlier op of the step made each tensor or which tensor from outside the step
  it is, and its other arguments but floats), so one recorded program per workload would cover every step;
* ``floats that vary``: float arguments whose value changes between steps (learning rates, bias corrections):
  a program must take them as inputs, not constants (as fused.FusedKernels does for its scalars);
* ``ops to lower``: the distinct top-level ops without a lowering in capture.py today (a view, copy or exact op,
  an elementwise approximate op with a compiled scale, a sum or mean, or a decomposed operator it captures).

Reads of tensor memory that do not go through the dispatcher (``.numpy()``, ``.tolist()``, a C extension) are not
seen here; a deferred replay could not see them either (docs/SPEED.md). Writes the "A step's op stream" section of
bench/RESULTS.md unless --no-write.
"""

from __future__ import annotations

import collections
import os
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import torch  # noqa: E402

from profile_engine import workload_bench  # noqa: E402
from veritrain import engine, rules  # noqa: E402
from veritrain.engine import EngineConfig, logged_step  # noqa: E402
from veritrain.logformat import StepLogWriter  # noqa: E402
from veritrain.rounding import Grid  # noqa: E402
from veritrain.runner import _prepare_batch, _prepare_model, place_task  # noqa: E402
from veritrain.task import build  # noqa: E402

aten = torch.ops.aten
# ops whose result Python reads, or whose output's shape depends on the values of their operands
SYNC_OPS = {"_local_scalar_dense", "is_nonzero", "equal", "nonzero", "masked_select", "_unique2", "unique_dim",
            "unique_consecutive", "repeat_interleave", "argwhere"}


def _lowered_today(func, named) -> bool:
    """Whether capture.py lowers ``func`` (called with arguments ``named``) as its regions' ops: a view, an exact
    op as itself, an approximate op with a compiled scale or a sum or mean in float64, a copy into an argument,
    or a decomposed operator (a region). Other ops that write their arguments (in-place ops, an optimizer's
    foreach updates) and random ops are not lowered there."""
    rule = rules.lookup(func, named if isinstance(rules.RULES.get(rules.base_name(func)), rules.Choose) else None)
    if func is aten.copy_.default or rule.kind == rules.DECOMPOSE:
        return True
    if func._schema.is_mutable:
        return False
    if rule.kind in (rules.PASSTHROUGH, rules.EXACT):
        return True
    return rule.kind == rules.APPROX and (rule.fused is not None or func in (aten.sum.dim_IntList, aten.mean.dim))


class StreamRecorder:
    """Records the engine's top-level ops of one step: each op's structure (op, tensor shapes and dtypes, where
    each tensor came from, its non-float arguments) and its float arguments."""

    def __init__(self):
        self.ops = []  # (name, structure, floats)
        self.unlowered = set()  # the ops capture.py does not lower
        self.origin = {}  # id(tensor) -> ("op", index) / ("outside", index)
        self.keep = []  # the step's tensors, alive until the step ends (ids are not reused meanwhile)
        self.outside = 0
        self.depth = 0

    def _where(self, t):
        where = self.origin.get(id(t))
        if where is None:
            where = self.origin[id(t)] = ("outside", self.outside)
            self.outside += 1
            self.keep.append(t)
        return where

    def before(self, func, args, kwargs):
        leaves, _ = engine._flatten_call(args, kwargs or {})
        structure, floats = [], []
        for x in leaves:
            if isinstance(x, torch.Tensor):
                structure.append((tuple(x.shape), x.dtype, self._where(x)))
            elif type(x) is float:
                structure.append("float")
                floats.append(x)
            else:
                structure.append(repr(x))
        self.ops.append((str(func), tuple(structure), tuple(floats)))
        if _name(str(func)) not in SYNC_OPS and not _lowered_today(func, engine._named(func, args, kwargs or {})):
            self.unlowered.add(str(func).removeprefix("aten."))
        return len(self.ops) - 1

    def after(self, index, out):
        for o in (out if isinstance(out, (tuple, list)) else [out]):
            if isinstance(o, torch.Tensor):
                self.origin.setdefault(id(o), ("op", index))
                self.keep.append(o)


def _name(op: str) -> str:
    return op.split(".")[1] if op.startswith("aten.") else op


def summarize(steps: list, unlowered=()) -> dict:
    """The figures of the table from each counted step's recorded ops (and the ops capture.py does not lower)."""
    first = steps[0]
    counts, syncs, segments, largest = [], [], [], []
    sync_names = collections.Counter()
    for ops in steps:
        counts.append(len(ops))
        runs, run, n_sync = [], 0, 0
        for name, _, _ in ops:
            if _name(name) in SYNC_OPS:
                n_sync += 1
                sync_names[_name(name)] += 1
                if run:
                    runs.append(run)
                run = 0
            else:
                run += 1
        if run:
            runs.append(run)
        syncs.append(n_sync)
        segments.append(len(runs))
        largest.append(max(runs, default=0) / max(len(ops), 1))
    same = [i for i, ops in enumerate(steps) if [(n, s) for n, s, _ in ops] != [(n, s) for n, s, _ in first]]
    varying = collections.Counter()
    if not same:
        for k, (name, _, floats) in enumerate(first):
            for j in range(len(floats)):
                if any(ops[k][2][j] != floats[j] for ops in steps[1:]):
                    varying[_name(name)] += 1
    distinct = {name for ops in steps for name, _, _ in ops}
    return {"ops": counts, "syncs": syncs, "sync_names": dict(sync_names), "segments": segments,
            "largest": largest, "differs_at": same, "varying": dict(varying), "distinct": len(distinct),
            "to_lower": sorted(unlowered)}


def measure(task_ref: str, config: dict, steps: int, progress=print) -> dict:
    """Records ``steps`` counted trainer steps (after one uncounted step, which creates the optimizer's state)."""
    grid, cfg = Grid(32), EngineConfig()
    task = build(task_ref, config)
    _prepare_model(task, "fp32", grid)
    task = place_task(task, torch.device("cpu"))
    dispatch, current = engine.VerifiedMode._dispatch, [None]

    def top_level(self, func, args, kwargs):
        rec = current[0]
        if rec is None or rec.depth or func.namespace != "aten":  # the profiler's record_function ops, ...
            return dispatch(self, func, args, kwargs)
        index = rec.before(func, args, kwargs)
        rec.depth += 1
        try:
            out = dispatch(self, func, args, kwargs)
        finally:
            rec.depth -= 1
        rec.after(index, out)
        return out

    recorded, unlowered = [], set()
    engine.VerifiedMode._dispatch = top_level
    try:
        with tempfile.TemporaryDirectory() as d:
            for step in range(steps + 1):
                batch = _prepare_batch(task.batch(step), "fp32", grid)
                rec = current[0] = StreamRecorder() if step else None
                with logged_step(cfg, step, writer=StepLogWriter(os.path.join(d, f"{step}.vtlog"), step, 32,
                                                                 pending=[])):
                    task.run_step(batch)
                current[0] = None
                if rec is not None:
                    recorded.append(rec.ops)
                    unlowered |= rec.unlowered
                    if progress:
                        progress(f"  step {step}: {len(rec.ops)} top-level ops")
    finally:
        engine.VerifiedMode._dispatch = dispatch
    return summarize(recorded, unlowered)


def markdown(results: dict, descriptions: dict, command: str, machine: str) -> str:
    lines = ["## A step's op stream (issue 12: what a deferred whole-step replay would follow)", "",
             f"Command: `{command}`", "", f"Machine: {machine}", "",
             "Written by `bench/step_stream.py` (its docstring defines each column). The trainer's engine on the "
             "built-in tasks, one uncounted step first; medians where a figure differs between steps.", "",
             "| workload | top-level ops a step | syncs a step (which) | segments a step | largest segment "
             "| same structure every step | floats that vary (ops) | distinct ops | ops to lower |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for name, r in results.items():
        med = lambda v: sorted(v)[len(v) // 2]  # noqa: E731
        syncs = ", ".join(f"{k} {v // len(r['ops'])}" for k, v in sorted(r["sync_names"].items()))
        same = "yes" if not r["differs_at"] else f"no (counted step {r['differs_at'][0] + 1} differs)"
        varying = sum(r["varying"].values())
        vary = f"{varying} ({', '.join(f'{k} {v}' for k, v in sorted(r['varying'].items()))})" if varying else "0"
        lines.append(f"| {name} | {med(r['ops'])} | {med(r['syncs'])} ({syncs or 'none'}) | {med(r['segments'])} "
                     f"| {med(r['largest']):.0%} of the ops | {same} | {vary} | {r['distinct']} "
                     f"| {len(r['to_lower'])}: {', '.join(r['to_lower']) or '-'} |")
    lines += ["", "Workloads: " + "; ".join(f"{k}: {v}" for k, v in descriptions.items()) + ".", ""]
    return "\n".join(lines)


def main(argv=None):
    workload_bench("step_stream.py", __doc__.split("\n")[0], "gpt2,resnet,digits", 3, measure, markdown, argv)


if __name__ == "__main__":
    main()
