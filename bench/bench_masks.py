"""What the trainer's near-midpoint test costs inside a compiled elementwise kernel, by the format of its output:
one float64 division of float32 values rounded to float32, alone and with the test, compiled as the engine
compiles its kernels (fused.compile_kernel), then the candidates' positions found from that output.

    python bench/bench_masks.py                 # 38.6M values (GPT-2's token embedding), 9 repeats
    python bench/bench_masks.py --numel 4194304

Variants: ``round`` the float32 result alone (what the auditor's kernel writes); ``int8 mask`` the bit test
(rounding.candidate_mask, the kernels' test on coarser grids) written as one byte per value, positions by
rounding.mask_positions; ``stability`` the kernels' test on the float32 grid (rounding.stability_mask), one
byte per value, positions alike;
``float32 test`` the same test's sign written as a float32 value, positions from its sign bits; ``row flags``
the test's count per row of 256 values (a reduction in the same kernel), positions only where a row is
flagged (the exact test on those rows, not timed: candidates are rare). Prints medians in ms.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from veritrain import fused, hardware
from veritrain.rounding import (FLOAT32_MIN_NORMAL, _TWO_52, _TWO_52_BITS, Grid, candidate_mask,
                                mask_positions, stability_mask)

GRID = Grid(32)
C = 4.0  # a threshold (EngineConfig's elementwise class is of this size)


def _test(y):
    """candidate_mask's signed distance: negative where y is a candidate (the scale |y|, as for a division)."""
    low = ((y.view(torch.int64) & GRID.low_mask) | _TWO_52_BITS).view(torch.float64) - _TWO_52
    dev = (low - float(GRID.half)).abs().clamp(max=float(GRID.value_units))
    ay = y.abs()
    bound = ay * C
    return torch.where(ay < FLOAT32_MIN_NORMAL, 0.0 - bound, dev * ay - bound)


def round_only(t, s):
    return (t.to(torch.float64) / s).to(torch.float32)


def int8_mask(t, s):
    y = t.to(torch.float64) / s
    return y.to(torch.float32), candidate_mask(y, y.abs(), C, GRID.low_mask, GRID.half, GRID.value_units)


def stability(t, s):
    y = t.to(torch.float64) / s
    return y.to(torch.float32), stability_mask(y, y.abs(), C)


def float32_test(t, s):
    y = t.to(torch.float64) / s
    return y.to(torch.float32), _test(y).to(torch.float32)


def row_flags(t, s):
    y = t.to(torch.float64) / s
    return y.to(torch.float32), torch.where(_test(y) < 0, 1.0, 0.0).sum(-1)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--numel", type=int, default=50257 * 768)
    ap.add_argument("--repeats", type=int, default=9)
    args = ap.parse_args(argv)
    hardware.apply_process_settings()
    n = args.numel - args.numel % 256
    x = torch.randn(n, generator=torch.Generator().manual_seed(0))
    s = torch.tensor(1.7, dtype=torch.float64)
    kernels = {f.__name__: fused.compile_kernel(f) for f in (round_only, int8_mask, stability, float32_test, row_flags)}

    def positions(name, out):
        if name in ("int8_mask", "stability"):
            return mask_positions(out[1])
        if name == "float32_test":  # sign bits, two values to an int64 word
            words = (out[1].view(torch.int64) & -0x7FFFFFFF7FFFFFFF - 1).nonzero().squeeze(1)
            return words
        if name == "row_flags":
            return out[1].nonzero().squeeze(1)
        return None

    times = {k: ([], []) for k in kernels}
    for i in range(args.repeats + 1):
        for name, k in kernels.items():
            arg = x.view(-1, 256) if name == "row_flags" else x
            t0 = time.perf_counter()
            out = k(arg, s)
            t1 = time.perf_counter()
            positions(name, out)
            t2 = time.perf_counter()
            if i:
                times[name][0].append(t1 - t0)
                times[name][1].append(t2 - t1)
    print(f"{n} values, torch {torch.__version__}, {torch.get_num_threads()} threads; medians of {args.repeats} (ms)")
    print(f"{'variant':14s} {'kernel':>8s} {'positions':>10s} {'total':>8s}")
    for name, (kt, pt) in times.items():
        k_ms, p_ms = statistics.median(kt) * 1e3, statistics.median(pt) * 1e3
        print(f"{name:14s} {k_ms:8.1f} {p_ms:10.1f} {k_ms + p_ms:8.1f}")


if __name__ == "__main__":
    main()
