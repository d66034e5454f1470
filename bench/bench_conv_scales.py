"""The error scales of a convolution and its backward (rules.scale_for) at the default-size ResNet's
shapes (batch 16, width 8) and two of ResNet-18's, median microseconds per call: in full (the trainer's scan needs every element's),
and at four positions of each output (the auditor reads the outputs with log entries); then the sums of squares those scales are made of
(fused.sum_of_squares, fused.vector_norm) compiled and eager, at sizes around fused.SQUARES_MIN_NUMEL; then a
transposed operand's norms over its strided dimension; then a
weight gradient's channel norms and an output's patch norms at some positions against in full, at ResNet-18's
shapes (the auditor's checks of entries ask for them; where the gather stops paying, rules.GATHER_SHARE,
GATHER_NUMPY_NUMEL and PATCH_GATHER_COST): the figures docs/SPEED.md quotes.

    python bench/bench_conv_scales.py [--reps 30]

Prints a table; nothing is written. Compare versions by running it in each checkout, alternately."""

import argparse
import statistics
import time

import torch

from veritrain import fused, rules

aten = torch.ops.aten
SHAPES = [(16, 8, 32, 32, 8, 1), (16, 16, 16, 16, 16, 1), (16, 32, 8, 8, 32, 1), (16, 64, 4, 4, 64, 1),
          (16, 8, 32, 32, 16, 2)]  # input N, C, H, W; output channels; stride (3x3 kernels, padding 1)
FULL_SIZE = [(16, 256, 8, 8, 256, 1), (16, 512, 4, 4, 512, 1)]  # two of ResNet-18's (standard width) layers


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
    print("| input | stride | forward scale (us) | backward scales (us) | forward, at 4 positions (us) | "
          "backward, at 4 positions of each (us) |\n| --- | --- | --- | --- | --- | --- |")
    totals = [0.0] * 4
    for n, c, h, w, o, s in SHAPES + FULL_SIZE:
        x, wt = torch.randn(n, c, h, w, dtype=torch.float64), torch.randn(o, c, 3, 3, dtype=torch.float64)
        conv = (wt, None, [s, s], [1, 1], [1, 1], False, [0, 0], 1)
        y = aten.convolution(x, *conv)
        go = torch.randn_like(y)
        back = (go, x, *conv[:1], None, *conv[2:], [True, True, False])
        fwd = rules.Call(aten.convolution.default, (x, *conv), {}, [y])
        bwd = rules.Call(aten.convolution_backward.default, back, {}, list(aten.convolution_backward(*back)))
        rf, rb = rules.lookup(aten.convolution.default), rules.lookup(aten.convolution_backward.default)
        times = [median_us(lambda: full_scales(rf, fwd), reps), median_us(lambda: full_scales(rb, bwd), reps),
                 median_us(lambda: scales_at(rf, fwd), reps), median_us(lambda: scales_at(rb, bwd), reps)]
        if (n, c, h, w, o, s) in SHAPES:
            totals = [a + b for a, b in zip(totals, times)]
        print(f"| {n} x {c} x {h} x {w} | {s} | " + " | ".join(f"{t:.0f}" for t in times) + " |")
        if (n, c, h, w, o, s) == SHAPES[-1]:
            print("| all five | | " + " | ".join(f"{t:.0f}" for t in totals) + " |")
    squares(reps)
    transposed(reps)
    factors_at(reps)
    print(f"\n{torch.__version__}, {torch.get_num_threads()} threads, {torch.backends.cpu.get_cpu_capability()}")


def _resolved(rule, call):
    return [s.compute() if isinstance(s, rules.Deferred) else s for s in rules.scale_for(rule, call)]


def full_scales(rule, call):
    """Every output's scale in full, as the trainer's scan takes it (a LazyScale's factors, patch norms included)."""
    return [s.full_terms() if isinstance(s, rules.LazyScale) else s for s in _resolved(rule, call) if s is not None]


def scales_at(rule, call):
    """Each output's scale at four positions, as the auditor's checks of its entries take it."""
    out = []
    for s, y in zip(_resolved(rule, call), call.outputs):
        if s is not None:
            idx = torch.arange(4) * (y.numel() // 4)
            out.append(s.at(idx, y.shape) if isinstance(s, rules.LazyScale) else s.expand(y.shape).reshape(-1)[idx])
    return out


def squares(reps):
    """One sum of squares over some dimensions: the compiled kernel, the eager sum of squares in one sum and
    innermost dimensions first (fused._eager_squares: the "channel norms" over [0, 2, 3]), ATen's norm, and
    fused.sum_of_squares as it chooses between them by default, median microseconds per call."""
    print("\n| tensor | over | compiled (us) | eager (x * x).sum (us) | eager, innermost first (us) | ATen norm (us) | "
          "as chosen (us) |\n| --- | --- | --- | --- | --- | --- | --- |")
    for shape, dims in [((16, 8, 32, 32), [1]), ((16, 8, 32, 32), [0, 2, 3]), ((16, 16, 16, 16), [0, 2, 3]), ((8, 64, 768), [0]),
                        ((16, 64, 32, 32), [1]), ((768, 2304), [0]), ((512, 3072), [0]), ((64, 64, 32, 32), [0, 2, 3]), ((512, 512, 3, 3), [0, 2, 3])]:
        x = torch.randn(shape, dtype=torch.float64)
        sizes, reduced = fused.merged_view(x.shape, dims)
        view = x.view(sizes)
        kernel = lambda: fused._run_pattern(fused.SQUARES, (len(sizes), reduced), "sum of squares",  # noqa: E731
                                            "(x * x).sum({reduced!r})", view)
        compiled = median_us(kernel, reps)
        eager = median_us(lambda: (x * x).sum(dims, keepdim=True), reps)
        inner = median_us(lambda: fused._eager_squares(x, dims), reps)
        norm = median_us(lambda: torch.linalg.vector_norm(x, dim=dims, keepdim=True), reps)
        chosen = median_us(lambda: fused.sum_of_squares(x, dims), reps)
        name = " x ".join(map(str, shape))
        print(f"| {name} ({x.numel()} values) | {dims} | {compiled:.0f} | {eager:.0f} | {inner:.0f} | {norm:.0f} | "
              f"{chosen:.0f} |")


def transposed(reps):
    """A transposed matrix product operand's norms over its strided dimension (a column norm of b = W^T, e.g.
    GPT-2's tied embedding for the logits: the stored matrix's row norms; a row norm of a = x^T, a weight gradient's,
    or of attention's K^T: the stored matrix's column norms): the eager sum of squares on the view, ATen's norm on
    the view, and fused.vector_norm as it chooses (in the memory's order), median microseconds per call."""
    print("\n| stored | norm over | eager (x * x).sum (us) | ATen norm (us) | as chosen (us) |\n| --- | --- | --- | --- | "
          "--- |")
    for stored, dims in [((50257, 768), [0]), ((3072, 768), [0]), ((96, 64, 64), [1]), ((512, 3072), [1]),
                         ((512, 768), [1]), ((96, 64, 64), [2])]:
        x = torch.randn(stored, dtype=torch.float64).transpose(-2, -1)
        eager = median_us(lambda: (x * x).sum(dims, keepdim=True), reps)
        norm = median_us(lambda: torch.linalg.vector_norm(x, dim=dims, keepdim=True), reps)
        chosen = median_us(lambda: fused.vector_norm(x, dims), reps)
        name = " x ".join(map(str, stored))
        print(f"| {name}, transposed | {dims} | {eager:.0f} | {norm:.0f} | {chosen:.0f} |")


def factors_at(reps):
    """rules.ChannelNorm and rules.PatchNorm at a few positions (the auditor's entries): as the rules choose
    (gathered, or in full past their thresholds) and always gathered, against in full, median microseconds per
    call; a new factor each call, so nothing computed before is reused."""
    import numpy as np

    def at(make, host, gather_always):
        saved = rules.GATHER_SHARE
        rules.GATHER_SHARE = float("inf") if gather_always else saved
        try:
            return median_us(lambda: make().at(host), reps)
        finally:
            rules.GATHER_SHARE = saved

    print("\n| tensor (N x C x H x W) | factor | in full (us) | asked for | as chosen (us) | gathered (us) |"
          "\n| --- | --- | --- | --- | --- | --- |")
    rs = np.random.RandomState(0)
    for n, c, h, w in [(16, 64, 32, 32), (16, 128, 16, 16), (16, 256, 8, 8), (16, 512, 4, 4)]:
        x = torch.randn(n, c, h, w, dtype=torch.float64)
        name = f"{n} x {c} x {h} x {w}"
        channels = lambda: rules.ChannelNorm(x, 1, 1, 4)  # noqa: E731
        full = median_us(lambda: channels().full(), reps)
        for k in (1, c // 16, c // 8, c // 4):
            host = (np.zeros(k, np.int64), rs.choice(c, k, replace=False), np.zeros(k, np.int64), np.zeros(k, np.int64))
            print(f"| {name} | channel norms | {full:.0f} | {k} channels | {at(channels, host, False):.0f} | "
                  f"{at(channels, host, True):.0f} |")
        patches = lambda: rules.PatchNorm(x, (3, 3), 1, 1, 1)  # noqa: E731
        full = median_us(lambda: patches().full(), reps)
        for share in (0.01, 0.05, 0.1, 0.2):
            k = max(1, int(share * n * h * w / 9))  # positions whose patches hold this share of x's values
            host = (rs.randint(0, n, k), np.zeros(k, np.int64), rs.randint(0, h, k), rs.randint(0, w, k))
            print(f"| {name} | patch norms | {full:.0f} | {k} positions ({share:.0%} of x) | "
                  f"{at(patches, host, False):.0f} | {at(patches, host, True):.0f} |")


if __name__ == "__main__":
    main()
