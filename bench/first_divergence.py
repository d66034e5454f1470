"""Where do two devices first disagree? Replays one step of a run on two devices in one process, with an
operator trace on each, and names the first operator whose inputs or rounded outputs differ.

    python bench/first_divergence.py RUN_DIR --step 0 --devices cuda,cpu

The step must start at a checkpoint of the run (train with --checkpoint-every 1). For that operator it
then captures the call on both devices and prints how its float32 inputs and outputs differ, and how far
apart the two devices' float64 evaluations of the same inputs are. A diagnostic for the GPU checks
(bench/gpu_check.sh); the verification game (`veritrain dispute`) does the same between two parties.
"""

from __future__ import annotations

import argparse
import json

import torch

from veritrain import policy, store
from veritrain.engine import OpTrace, load_call
from veritrain.protocol import Replayer


# random ops fill a tensor whose old contents (uninitialised memory) are an input: not compared
RANDOM = ("bernoulli", "uniform", "normal", "random", "exponential", "geometric", "cauchy", "randperm", "multinomial")


def replay(run_dir: str, step: int, device: str, capture: int | None = None) -> OpTrace:
    m = store.load_manifest(run_dir)
    rep = Replayer(policy.trusted(m), lambda s: store.read_run_file(run_dir, store.ckpt_name(s)),
                   lambda s: store.read_run_file(run_dir, store.log_name(s)), device)
    rep.load(step)
    trace = OpTrace(capture=capture)
    rep.run_step(step, trace)
    return trace


def describe_difference(name: str, a: torch.Tensor, b: torch.Tensor) -> str:
    a, b = a.detach().cpu(), b.detach().cpu()
    if a.shape != b.shape or a.dtype != b.dtype:
        return f"{name}: {tuple(a.shape)} {a.dtype} vs {tuple(b.shape)} {b.dtype}"
    if not a.is_floating_point():
        n = int((a != b).sum())
        return f"{name}: {a.dtype} {tuple(a.shape)}, {n} of {a.numel()} elements differ"
    diff = (a.double() - b.double()).abs()
    bits = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]  # same dtype: checked
    n = int((a.reshape(-1).view(bits) != b.reshape(-1).view(bits)).sum())
    return (f"{name}: {a.dtype} {tuple(a.shape)}, {n} of {a.numel()} elements differ, max |diff| {float(diff.max()):.3g} "
            f"(max |value| {float(a.double().abs().max()):.3g})")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("run_dir")
    ap.add_argument("--step", type=int, default=0)
    ap.add_argument("--devices", default="cuda,cpu")
    args = ap.parse_args(argv)
    da, db = args.devices.split(",")
    ta, tb = replay(args.run_dir, args.step, da), replay(args.run_dir, args.step, db)
    print(f"step {args.step}: {len(ta.entries)} traced operators on {da}, {len(tb.entries)} on {db}")
    first = None
    for k, (ea, eb) in enumerate(zip(ta.entries, tb.entries)):
        inputs_differ = ea["inputs"] != eb["inputs"] and not any(r in ea["op"] for r in RANDOM)
        if ea["op"] != eb["op"] or inputs_differ or ea["outputs"] != eb["outputs"]:
            first = k
            break
    if first is None:
        print("no operator differs" + ("" if len(ta.entries) == len(tb.entries) else " (but the counts differ)"))
        return 0
    ea, eb = ta.entries[first], tb.entries[first]
    what = "op" if ea["op"] != eb["op"] else "outputs" if ea["outputs"] != eb["outputs"] else "inputs"
    print(f"first difference: traced operator {first + 1} ({what} differ)")
    for side, e in ((da, ea), (db, eb)):
        print(f"  {side}: {e['op']} at {e['where']}; inputs from {e['sources']}")
    ca = replay(args.run_dir, args.step, da, capture=first + 1).captured
    cb = replay(args.run_dir, args.step, db, capture=first + 1).captured
    fa, argsa, kwa, _, xa = load_call(ca)
    fb, argsb, kwb, _, xb = load_call(cb)
    for i, (x, y) in enumerate(zip(xa, xb)):
        print("  input " + describe_difference(str(i), x, y))
    # the same inputs (the first device's) evaluated in float64 on both devices
    def f64(device):
        from torch.utils._pytree import tree_map

        def move(t):
            if isinstance(t, torch.Tensor):
                t = t.to(device)
                return t.double() if t.is_floating_point() else t
            return t
        out = fa(*tree_map(move, argsa), **tree_map(move, kwa))
        return [t for t in (out if isinstance(out, (tuple, list)) else [out]) if isinstance(t, torch.Tensor)]
    for i, (x, y) in enumerate(zip(f64(da), f64(db))):
        print("  float64 output " + describe_difference(str(i), x, y))
    print(json.dumps({"first": first + 1, "op": ea["op"], "where": ea["where"], "what": what}))
    return 1


if __name__ == "__main__":
    raise SystemExit(main())
