"""A float64 forward convolution by ATen's forward kernel and by its input-gradient kernel (convolution.py), on
the convolutions of the benchmarks' models and a grid around them, alternating in one process.

    python bench/bench_conv_route.py                 # batch 16, 9 repeats
    python bench/bench_conv_route.py --batch 32 --reps 5 --no-write

For each shape: one sample's unfolded patches (input channels x kernel window x output positions, the number
convolution.MIN_PATCH_NUMEL is compared with), whether the engine takes the input-gradient kernel at the default
threshold, and the medians of both kernels in ms. Writes the "Forward convolutions by the input-gradient kernel"
section of bench/RESULTS.md unless --no-write.
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

from veritrain import convolution  # noqa: E402

aten = torch.ops.aten

# (what, input channels, output channels, spatial size, kernel): stride 1, "same" padding, no bias
SHAPES = [
    ("ResNet-18 layer1 3x3", 64, 64, 32, 3),
    ("ResNet-18 layer2 3x3", 128, 128, 16, 3),
    ("ResNet-18 layer3 3x3", 256, 256, 8, 3),
    ("ResNet-18 layer4 3x3", 512, 512, 4, 3),
    ("ResNet-18 stem 3x3", 3, 64, 32, 3),
    ("default ResNet layer1 3x3", 8, 8, 32, 3),
    ("default ResNet layer2 3x3", 16, 16, 16, 3),
    ("digits-cnn conv2 3x3", 8, 16, 4, 3),
    ("32 channels at 32 x 32", 32, 32, 32, 3),
    ("64 channels at 16 x 16", 64, 64, 16, 3),
    ("256 channels at 16 x 16", 256, 256, 16, 3),
    ("1x1, 64 channels at 32 x 32", 64, 64, 32, 1),
]


def _time(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def measure(batch: int, c: int, o: int, size: int, k: int, reps: int) -> dict:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(batch, c, size, size, generator=g, dtype=torch.float64)
    w = torch.randn(o, c, k, k, generator=g, dtype=torch.float64)
    args = (x, w, None, [1, 1], [(k - 1) // 2] * 2, [1, 1], False, [0, 0], 1)
    times = {"forward kernel": [], "input-gradient kernel": []}
    for rep in range(reps + 1):  # the first round warms up
        pair = [("forward kernel", lambda: aten.convolution(*args)),
                ("input-gradient kernel", lambda: convolution.forward(*args))]
        for name, fn in pair if rep % 2 else pair[::-1]:
            t = _time(fn)
            if rep:
                times[name].append(t)
    out = {k: statistics.median(v) for k, v in times.items()}
    out["patches"] = c * k * k * size * size
    out["routed"] = convolution.routed(*args)
    return out


def markdown(batch: int, results: dict, command: str, machine: str) -> str:
    lines = ["## Forward convolutions by the input-gradient kernel (issue 12)", "", f"Command: `{command}`", "",
             f"Machine: {machine}", "",
             "Written by `bench/bench_conv_route.py`: a float64 forward convolution (stride 1, \"same\" padding, no "
             f"bias, batch {batch}) by ATen's forward kernel and by its input-gradient kernel with the kernel window "
             "reversed and the channel dimensions swapped (`convolution.py`), alternating in one process; medians in "
             "ms. `patches`: one sample's unfolded patches (input channels x window x output positions); `routed`: "
             f"whether the engine takes the input-gradient kernel (patches >= {convolution.MIN_PATCH_NUMEL}).", "",
             "| convolution | in -> out channels | size | patches | routed | forward kernel | input-gradient kernel "
             "| ratio |", "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for (what, c, o, size, k), r in results.items():
        f, b = r["forward kernel"], r["input-gradient kernel"]
        lines.append(f"| {what} | {c} -> {o} | {size} x {size} | {r['patches']} | {'yes' if r['routed'] else 'no'} | "
                     f"{1e3 * f:.2f} | {1e3 * b:.2f} | {b / f:.2f} |")
    return "\n".join(lines) + "\n"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--reps", type=int, default=9)
    ap.add_argument("--no-write", action="store_true")
    args = ap.parse_args(argv)
    from bench_engine import machine
    from profile_engine import write_section

    os.environ.pop("VERITRAIN_CONV_MIN_NUMEL", None)  # `routed` at the default threshold
    results = {}
    for shape in SHAPES:
        r = measure(args.batch, *shape[1:], args.reps)
        results[shape] = r
        print(f"{shape[0]}: forward {1e3 * r['forward kernel']:.2f} ms, input-gradient "
              f"{1e3 * r['input-gradient kernel']:.2f} ms", flush=True)
    command = "python bench/bench_conv_route.py " + shlex.join(argv if argv is not None else sys.argv[1:])
    section = markdown(args.batch, results, command.strip(), machine())
    print(section)
    if not args.no_write:
        write_section(os.path.join(HERE, "RESULTS.md"), section)


if __name__ == "__main__":
    main()
