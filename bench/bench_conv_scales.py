"""The error scales of a convolution and its backward (rules.scale_for) at the default-size ResNet's
shapes (batch 16, width 8), median microseconds per call, the figure docs/SPEED.md quotes for the sums of
squares the scales are made of (fused.sum_of_squares, fused.vector_norm).

    python bench/bench_conv_scales.py [--reps 30]

Prints a table; nothing is written. Compare versions by running it in each checkout, alternately."""

import argparse
import statistics
import time

import torch

from veritrain import rules

aten = torch.ops.aten
SHAPES = [(16, 8, 32, 32, 8, 1), (16, 16, 16, 16, 16, 1), (16, 32, 8, 8, 32, 1), (16, 64, 4, 4, 64, 1),
          (16, 8, 32, 32, 16, 2)]  # input N, C, H, W; output channels; stride (3x3 kernels, padding 1)


def median_us(fn, reps):
    for _ in range(3):
        fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e6


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=30)
    reps = ap.parse_args().reps
    torch.manual_seed(0)
    print("| input | stride | forward scale (us) | backward scales (us) |\n| --- | --- | --- | --- |")
    totals = [0.0, 0.0]
    for n, c, h, w, o, s in SHAPES:
        x, wt = torch.randn(n, c, h, w, dtype=torch.float64), torch.randn(o, c, 3, 3, dtype=torch.float64)
        conv = (wt, None, [s, s], [1, 1], [1, 1], False, [0, 0], 1)
        y = aten.convolution(x, *conv)
        go = torch.randn_like(y)
        back = (go, x, *conv[:1], None, *conv[2:], [True, True, False])
        fwd = rules.Call(aten.convolution.default, (x, *conv), {}, [y])
        bwd = rules.Call(aten.convolution_backward.default, back, {}, list(aten.convolution_backward(*back)))
        rf, rb = rules.lookup(aten.convolution.default), rules.lookup(aten.convolution_backward.default)
        tf, tb = median_us(lambda: rules.scale_for(rf, fwd), reps), median_us(lambda: rules.scale_for(rb, bwd), reps)
        totals[0] += tf
        totals[1] += tb
        print(f"| {n} x {c} x {h} x {w} | {s} | {tf:.0f} | {tb:.0f} |")
    print(f"| all five | | {totals[0]:.0f} | {totals[1]:.0f} |")
    print(f"\n{torch.__version__}, {torch.get_num_threads()} threads, {torch.backends.cpu.get_cpu_capability()}")


if __name__ == "__main__":
    main()
