"""Cost of a verified optimizer step alone: AdamW's foreach update of a model's parameters, plain float32,
plain float64, the trainer (records the log) and the auditor (replays it), in one process.

    python bench/bench_optimizer.py                          # GPT-2 117M's 148 parameter shapes (124M values)
    python bench/bench_optimizer.py --layers 2 --width 128 --repeats 9
    python bench/bench_optimizer.py --fresh    # also each in-place update through a fresh result, as before

The parameters have GPT-2's shapes (token and position embeddings, and per layer two LayerNorms, the
attention's and the MLP's matrices and biases); gradients are random and the same in every mode. The trainer
and the auditor update copies of the same state and must end with the same bits (checked). Each repeat runs
every mode once, in rotated order; the first repeat is not counted. Prints medians per step and per-step
ratios to plain float64 (their median): the optimizer's share of a step, apart from the model's ops.
``--fresh`` adds the trainer and the auditor with every in-place update written to a fresh float32 result and
copied back (the engine before its kernels wrote in place: ``VerifiedMode._writes_in_place`` answering no), an
A/B of that change in one process.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from contextlib import nullcontext
from unittest import mock

import torch

from veritrain import hardware
from veritrain.engine import EngineConfig, VerifiedMode, step_context
from veritrain.logformat import StepLogReader, StepLogWriter


def gpt2_shapes(layers: int, width: int, vocab: int = 50257, context: int = 1024) -> list:
    """The shapes of an HF GPT-2's parameters (the LM head shares the token embedding)."""
    per_layer = [(width,), (width,), (width, 3 * width), (3 * width,), (width, width), (width,),
                 (width,), (width,), (width, 4 * width), (4 * width,), (4 * width, width), (width,)]
    return [(vocab, width), (context, width)] + per_layer * layers + [(width,), (width,)]


def make_state(shapes, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    params = [torch.nn.Parameter((torch.randn(s, generator=g) * 0.02).to(dtype)) for s in shapes]
    opt = torch.optim.AdamW(params, lr=1e-4, weight_decay=0.01, foreach=True)
    return params, opt


def set_grads(params, step):
    g = torch.Generator().manual_seed(1000 + step)
    for p in params:
        p.grad = (torch.randn(p.shape, generator=g) * 1e-3).to(p.dtype)


def fresh_results():
    """Every in-place update through a fresh result and a copy back, for comparison."""
    return mock.patch.object(VerifiedMode, "_writes_in_place", lambda self, record, k, target: False)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--width", type=int, default=768)
    ap.add_argument("--repeats", type=int, default=5, help="counted steps (one more runs first)")
    ap.add_argument("--fresh", action="store_true", help="also the trainer and auditor without in-place kernels")
    args = ap.parse_args(argv)
    hardware.apply_process_settings()
    shapes = gpt2_shapes(args.layers, args.width)
    modes = ("fp32", "fp64", "trainer", "auditor") + (("trainer-fresh", "auditor-fresh") if args.fresh else ())
    state = {m: make_state(shapes, torch.float64 if m == "fp64" else torch.float32) for m in modes}
    times = {m: [] for m in modes}
    cfg = EngineConfig()
    with tempfile.TemporaryDirectory() as d:
        for step in range(args.repeats + 1):
            order = modes[step % len(modes):] + modes[:step % len(modes)]  # each auditor after its trainer
            order = sorted(order, key=lambda m: (order.index(m.replace("auditor", "trainer")), m.startswith("auditor")))
            for m in order:
                params, opt = state[m]
                set_grads(params, step)
                log = os.path.join(d, f"{step}{'-fresh' if 'fresh' in m else ''}.vtlog")
                t0 = time.perf_counter()
                if m in ("fp32", "fp64"):
                    opt.step()
                elif m.startswith("trainer"):
                    w = StepLogWriter(log, step, 32)
                    with step_context(cfg, step, writer=w), fresh_results() if "fresh" in m else nullcontext():
                        opt.step()
                    w.close()
                else:
                    with StepLogReader(log, expect_step=step, expect_bits=32) as r, \
                            step_context(cfg, step, reader=r) as mode, \
                            fresh_results() if "fresh" in m else nullcontext():
                        opt.step()
                    if mode.stats.suspicious_count:
                        sys.exit(f"step {step}: the auditor found {mode.stats.suspicious_count} suspicious entries")
                if step:
                    times[m].append(time.perf_counter() - t0)
    for m in modes[3:]:
        if not all(torch.equal(a, b) for a, b in zip(state["trainer"][0], state[m][0])):
            sys.exit(f"the {m}'s parameters differ from the trainer's")
    n = sum(p.numel() for p in state["fp32"][0])
    print(f"AdamW (foreach) over {len(shapes)} GPT-2 parameter tensors ({args.layers} x {args.width}), {n / 1e6:.1f}M "
          f"values; {args.repeats} counted steps; torch {torch.__version__}, {torch.get_num_threads()} threads")
    for m in modes:
        ratio = statistics.median(t / f for t, f in zip(times[m], times["fp64"]))
        print(f"  {m:13s} {statistics.median(times[m]) * 1e3:8.1f} ms   {ratio:.2f}x plain float64")
    print(f"  the {', '.join(modes[2:])}: the same parameters, bit for bit")


if __name__ == "__main__":
    main()
