"""What a verified step could cost as one compiled graph: the float64 step with every result the engine rounds
rounded to the float32 grid, and the approximate ones tested for near-midpoint candidates with the engine's error
scales, compiled whole by torch.compile, against the plain float64 step the engine's ratios are measured against.

    python bench/step_graph_bound.py                                  # resnet (default size), digits-cnn
    python bench/step_graph_bound.py --workloads digits --steps 10 --no-write

Why: on the small models the engine is 2.5-6x plain float64 (bench/profile_engine.py), and what is left is per-op
work around the kernels (docs/SPEED.md). This measures the step without that per-op work, to tell whether the
issue's 1.5x / 1.3x targets are within reach of one graph per step or bounded by the rounding and scans themselves.

Runs, alternating in one process (medians of same-step ratios to ``fp64``):

* ``fp64``: the task's plain float64 step, eager (the denominator of every ratio in bench/RESULTS.md);
* ``fp64, dispatch mode``: the same eager step under a ``TorchDispatchMode`` that only calls each op it sees: the
  floor of any engine that works op by op in Python, as veritrain's dispatch mode does, before it does any work;
* ``fp64 compiled``: the same step through ``torch.compile`` (inductor);
* ``rounded``: compiled, each op's float64 result rounded to float32 and back where the engine rounds it (its
  rule, rules.py, is exact or approximate: an exact op's float32 kernel gives its float64 value rounded once),
  what an auditor's graph computes where its log has no entry;
* ``rounded + scanned``: also each approximate op's error scale (``rules.scale_for``, the engine's own rules,
  traced into the graph) and the near-midpoint test the engine's compiled kernels run (``rounding.stability_flag``),
  summed into a candidate count the step returns (a trainer's graph).

A custom torch.compile backend gets the forward, backward and optimizer graphs at the aten level (AOT autograd
with inductor's decompositions), re-traces each with the rounding (and scan) after every op the engine rounds,
and compiles the result with inductor. The script checks that the rounding took place (the rounded steps'
weights lie on the float32 grid) and stops where it did not: GPT-2 2 x 128 (``--workloads gpt2``) stops there after a few steps, its weights
off the grid, so part of its optimizer's work ran outside the rewritten graphs (``TORCH_LOGS=graph_breaks``
shows dynamo breaking the graph at its scheduler-wrapped ``Adam.step``; which part ran eagerly was not pinned
down; that workload meets its targets in the engine itself). It is a cost bound, not a verified step: the ops are inductor's
decomposition (BatchNorm's steps are not decompositions.py's), ops without an engine rule (inductor's prims)
are left as they are, random ops run eagerly, and nothing classifies the candidates, checks a log's entries or
writes a log. Writes the "One graph per step" section of bench/RESULTS.md unless --no-write.
"""

from __future__ import annotations

import argparse
import os
import shlex
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import torch  # noqa: E402
import torch._inductor.config as inductor_config  # noqa: E402
from torch._dynamo.backends.common import aot_autograd  # noqa: E402
from torch._inductor.compile_fx import compile_fx_inner  # noqa: E402
from torch._inductor.decomposition import select_decomp_table  # noqa: E402
from torch.fx.experimental.proxy_tensor import make_fx  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

from profile_engine import each_workload, write_section  # noqa: E402
from veritrain import rules  # noqa: E402
from veritrain.engine import EngineConfig, rule_of  # noqa: E402
from veritrain.rounding import Grid, stability_flag  # noqa: E402
from veritrain.runner import _prepare_batch, _prepare_model  # noqa: E402
from veritrain.task import build  # noqa: E402

RUNS = ("fp64", "fp64, dispatch mode", "fp64 compiled", "rounded", "rounded + scanned")
THRESHOLDS = EngineConfig().thresholds


class _PassThrough(TorchDispatchMode):
    """Calls each op it sees and nothing else: what a dispatch mode costs before its own work."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


def _under_dispatch_mode(step):
    def run(batch):
        with _PassThrough():
            return step(batch)

    return run


class _Rounding(torch.fx.Interpreter):
    """Runs an aten graph, rounding the float64 results of each op the engine rounds (exact and approximate
    ops) to float32 and back; with ``scan``, also adds each approximate result's candidate count to ``self.flags``.
    Counts what it did in ``seen``."""

    def __init__(self, gm, scan: bool, seen: dict):
        super().__init__(gm)
        self.scan, self.seen, self.flags = scan, seen, []

    def call_function(self, target, args, kwargs):
        out = super().call_function(target, args, kwargs)
        outs = list(out) if isinstance(out, (tuple, list)) else [out]
        if not isinstance(target, torch._ops.OpOverload) or \
                not any(isinstance(o, torch.Tensor) and o.dtype == torch.float64 for o in outs):
            return out
        rule = rule_of(target, args, kwargs)
        if rule is rules.FALLBACK_RULE:  # no rule of the engine's (inductor's prims): left as it is
            self.seen["no rule"].add(str(target))
            return out
        if rule.kind not in (rules.EXACT, rules.APPROX):
            return out
        # an exact op is rounded too (the engine runs it in float32: its float64 value rounded once), not scanned
        scan = self.scan and rule.kind == rules.APPROX
        self.seen["approximate ops" if rule.kind == rules.APPROX else "exact ops"] += 1
        scales = list(rules.scale_for(rule, rules.Call(target, args, kwargs, outs))) if scan else []
        scales += [None] * (len(outs) - len(scales))
        for k, (y, s) in enumerate(zip(outs, scales)):
            if not (isinstance(y, torch.Tensor) and y.dtype == torch.float64):
                continue
            if scan:
                if s is None:
                    raise RuntimeError(f"{target}: the rule gives no scale for output {k}")
                self.flags.append(stability_flag(y, rules.materialize_scale(s, y), THRESHOLDS[rule.op_class]).sum())
            outs[k] = y.to(torch.float32).to(torch.float64)
        return type(out)(outs) if isinstance(out, (tuple, list)) else outs[0]


def rounding_backend(scan: bool, seen: dict, candidates: list):
    """A torch.compile backend: each aten graph re-traced through _Rounding, then compiled by inductor. With
    ``scan``, the graph also returns its candidate count, which the wrapper appends to ``candidates``."""

    def compiler(gm, example_inputs):
        def rounded(*args):
            run = _Rounding(gm, scan, seen)
            outs = run.run(*args)
            if not scan:
                return outs
            count = torch.stack(run.flags).sum() if run.flags else torch.zeros((), dtype=torch.float32)
            return (*outs, count)

        # traced on real tensors of the inputs' shapes (the graph holds real constants, which a trace on the
        # fake example inputs refuses; with the inputs' strides, some of the graph's views would not apply);
        # nothing in the rounding or the scales depends on values
        zeros = [torch.zeros(x.shape, dtype=x.dtype) for x in example_inputs]
        traced = make_fx(rounded, decomposition_table=select_decomp_table())(*zeros)
        traced.graph.eliminate_dead_code()
        traced.recompile()
        compiled = compile_fx_inner(traced, example_inputs)
        if not scan:
            return compiled

        def run(args):
            outs = compiled(args)
            candidates.append(outs[-1])
            return outs[:-1]

        run._boxed_call = True
        return run

    return aot_autograd(fw_compiler=compiler, bw_compiler=compiler, decompositions=select_decomp_table())


def measure(task_ref: str, config: dict, steps: int, progress=print) -> dict:
    grid = Grid(32)
    seen = {"approximate ops": 0, "exact ops": 0, "no rule": set()}
    candidates: list = []
    tasks, runs = {}, {}
    for name in RUNS:
        task = build(task_ref, config)
        _prepare_model(task, "fp64", grid)
        tasks[name] = task
    runs["fp64"] = tasks["fp64"].run_step
    runs["fp64, dispatch mode"] = _under_dispatch_mode(tasks["fp64, dispatch mode"].run_step)
    runs["fp64 compiled"] = torch.compile(tasks["fp64 compiled"].run_step, dynamic=False)
    runs["rounded"] = torch.compile(tasks["rounded"].run_step, backend=rounding_backend(False, seen, []), dynamic=False)
    runs["rounded + scanned"] = torch.compile(tasks["rounded + scanned"].run_step,
                                              backend=rounding_backend(True, seen, candidates), dynamic=False)
    times = {r: [] for r in RUNS}
    warm = 2  # the first steps compile (the first optimizer step too)
    per_step = []
    for step in range(steps + warm):
        order = RUNS[step % len(RUNS):] + RUNS[:step % len(RUNS)]
        for name in order:
            batch = _prepare_batch(tasks[name].batch(step), "fp64", grid)
            before = len(candidates)
            t0 = time.perf_counter()
            runs[name](batch)
            elapsed = time.perf_counter() - t0
            if step >= warm:
                times[name].append(elapsed)
                if name == "rounded + scanned":
                    per_step.append(sum(float(c) for c in candidates[before:]))
        if step >= warm and progress:
            progress("  step %d: %s" % (step, ", ".join(f"{r} {times[r][-1] * 1000:.1f} ms" for r in RUNS)))
    # the rounding took place: the rounded steps' weights (last written by their optimizer's rounded ops) lie
    # on the float32 grid, the plain float64 step's do not
    for name in RUNS:
        off = [n for n, p in tasks[name].model.named_parameters() if not bool((p == p.float().double()).all())]
        if bool(off) == name.startswith("rounded"):
            raise RuntimeError(f"{name}: weights {'off' if off else 'on'} the float32 grid"
                               + (f" ({', '.join(off[:4])}{', ...' if len(off) > 4 else ''})" if off else ""))
    fp64 = times["fp64"]
    return {"median_ms": {r: statistics.median(t) * 1000 for r, t in times.items()},
            "over_fp64": {r: statistics.median(t / f for t, f in zip(times[r], fp64)) for r in RUNS},
            "candidates": statistics.median(per_step), "no rule": sorted(seen["no rule"])}


def markdown(results: dict, descriptions: dict, command: str, machine: str) -> str:
    lines = ["## One graph per step: what it would cost (issue 12)", "", f"Command: `{command}`", "",
             f"Machine: {machine}", "",
             "Written by `bench/step_graph_bound.py`. Each step index ran every variant once, in rotated order, in "
             "one process; ratios are medians of same-step ratios to the eager plain float64 step (the "
             "denominator of bench/profile_engine.py). `dispatch mode`: the eager float64 step under a dispatch "
             "mode that only calls each op (the floor of an engine that works op by op in Python, before its "
             "work). `rounded`: the step compiled whole by torch.compile with "
             "every result the engine rounds (exact and approximate ops) rounded to float32 (an auditor's graph "
             "where its log has no entry); `rounded + scanned`: also the engine's error scale and near-midpoint "
             "test of every approximate op's result (a trainer's graph). A cost bound, not a verified step: "
             "inductor's decomposition of the ops, no classification of the candidates, no log (the script's "
             "docstring). Candidates: the test's count a step, a superset of the entries the engine's "
             "classification keeps.", "",
             "| workload | fp64 (eager) | dispatch mode | fp64 compiled | rounded | rounded + scanned | candidates a step "
             "(the test's) |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for name, r in results.items():
        o = r["over_fp64"]
        lines.append(f"| {name} | 1.00x ({r['median_ms']['fp64']:.3g} ms) | {o['fp64, dispatch mode']:.2f}x | "
                     f"{o['fp64 compiled']:.2f}x | "
                     f"{o['rounded']:.2f}x | {o['rounded + scanned']:.2f}x | {r['candidates']:.0f} |")
    lines += ["", "Ops without an engine rule, left unrounded: " + "; ".join(
        f"{name}: {', '.join(r['no rule']) or 'none'}" for name, r in results.items()) + ".", "",
        "Workloads: " + "; ".join(f"{k}: {v}" for k, v in descriptions.items()) + ".", ""]
    return "\n".join(lines)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workloads", default="resnet,digits")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--shared", default=os.path.join(os.path.dirname(os.path.dirname(HERE)), "shared", "data"))
    ap.add_argument("--no-write", action="store_true")
    args = ap.parse_args(argv)
    from bench_engine import machine
    from veritrain import hardware

    # the rules' helpers (sums of squares, norms) as eager ops, so that they trace into the step's graph
    os.environ["VERITRAIN_COMPILE"] = "0"
    hardware.apply_process_settings()
    inductor_config.fallback_random = True  # random ops as eager ATen calls (veritrain draws its own anyway)
    results, descriptions = each_workload(ap, args.workloads, args.shared, measure, args.steps)
    command = "python bench/step_graph_bound.py " + shlex.join(argv if argv is not None else sys.argv[1:])
    section = markdown(results, descriptions, command.strip(), machine("cpu"))
    print(section)
    if not args.no_write:
        write_section(os.path.join(HERE, "RESULTS.md"), section)


if __name__ == "__main__":
    main()
