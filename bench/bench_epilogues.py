"""A matrix product's epilogue in the trainer (fused.Epilogues: the float64 result rounded to float32, its error
scale evaluated from the operands' norms, the near-midpoint test, in one compiled pass) at GPT-2 117M's
linear-layer shapes: what it costs after the product that made the result, as a step runs it, against the same
pass on a result already in cache; and the product split by blocks of rows, each block's epilogue run right
after its product while the block is in cache (a route the engine does not take: this measures whether it
would pay).

    python bench/bench_epilogues.py [--reps 30] [--rows 256,128,64] [--no-write]

Each repetition runs every variant once, in rotated order, in one process; the table gives medians in ms.
`fp64` is the plain float64 product; `+ round` adds the auditor's rounding; `+ epilogue` the trainer's pass;
`epilogue in cache` is that pass alone, run again on the result it has just read. The operands' norms are
computed beforehand (the profile's `scale` category, not timed here). Writes its section of bench/RESULTS.md
unless --no-write."""

from __future__ import annotations

import argparse
import math
import os
import shlex
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import torch  # noqa: E402

from veritrain import fused, rules  # noqa: E402
from veritrain.rounding import Grid  # noqa: E402

# (tokens, in, out): GPT-2 117M's products at batch 8 x 64: the attention's qkv and projection, the MLP's two
# layers (forward), and a weight gradient (768 x 512 @ 512 x 3072)
SHAPES = [(512, 768, 2304), (512, 768, 768), (512, 768, 3072), (512, 3072, 768), (768, 512, 3072)]


class Product:
    """One product's operands, norms and the epilogue that rounds and tests its result."""

    def __init__(self, m: int, k: int, n: int, epilogues: fused.Epilogues, seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        # float32 values in float64, as the engine's upcast operands are
        self.a = torch.randn(m, k, generator=g).double()
        self.b = torch.randn(k, n, generator=g).double()
        self.rows = torch.linalg.vector_norm(self.a, dim=1, keepdim=True)
        self.cols = torch.linalg.vector_norm(self.b, dim=0, keepdim=True)
        self.coef = math.sqrt(k)
        self.epilogues = epilogues

    def epilogue(self, y, rows=None):
        scale = rules.LazyScale([(self.coef, [self.rows if rows is None else rows, self.cols])])
        out = self.epilogues.run(y, scale, 1.0)
        if out is None:
            raise RuntimeError("the epilogue did not compile here (VERITRAIN_COMPILE=0 or no working compiler)")
        return out

    def whole(self):
        return self.epilogue(self.a @ self.b)

    def by_rows(self, block: int):
        """The product block by block of ``block`` rows, each block's epilogue right after its product."""
        m, n = self.a.shape[0], self.b.shape[1]
        y32 = torch.empty(m, n, dtype=torch.float32)
        mask = torch.empty(m, n, dtype=torch.int8)
        for i in range(0, m, block):
            part = slice(i, min(i + block, m))
            y32[part], mask[part] = self.epilogue(self.a[part] @ self.b, self.rows[part])
        return y32, mask


def measure(p: Product, grid: Grid, reps: int, row_blocks: list) -> dict:
    y = p.a @ p.b  # the result the in-cache variant reads again and again

    def in_cache():
        p.epilogue(y)
        t0 = time.perf_counter()
        p.epilogue(y)
        return time.perf_counter() - t0

    def timed(fn):
        def run():
            t0 = time.perf_counter()
            fn()
            return time.perf_counter() - t0
        return run

    variants = {"fp64": timed(lambda: p.a @ p.b), "+ round": timed(lambda: grid.round(p.a @ p.b)),
                "+ epilogue": timed(p.whole), "epilogue in cache": in_cache}
    for r in row_blocks:
        variants[f"by {r} rows"] = timed(lambda r=r: p.by_rows(r))
    names = list(variants)
    for name in names:  # compile and warm up
        variants[name]()
    times = {name: [] for name in names}
    for rep in range(reps):
        for name in names[rep % len(names):] + names[:rep % len(names)]:
            times[name].append(variants[name]())
    return {name: statistics.median(t) for name, t in times.items()}


def markdown(results: dict, command: str, machine: str) -> str:
    names = list(next(iter(results.values())).keys())
    lines = ["## A matrix product's epilogue, after its product and in cache (issue 12)", "", f"Command: `{command}`", "",
             f"Machine: {machine}", "",
             "Written by `bench/bench_epilogues.py` (its docstring defines each column): GPT-2 117M's products, "
             "medians in ms of variants run in rotated order in one process. `epilogue ns/value`: the trainer's pass "
             "after its product ((`+ epilogue` - `fp64`) per result value) and alone on a result in cache.", "",
             "| product | " + " | ".join(names) + " | epilogue ns/value (after product, in cache) |",
             "| --- | " + " | ".join("---" for _ in names) + " | --- |"]
    for shape, t in results.items():
        m, k, n = shape
        values = m * n
        after = 1e9 * (t["+ epilogue"] - t["fp64"]) / values
        cached = 1e9 * t["epilogue in cache"] / values
        cells = " | ".join(f"{1e3 * t[name]:.2f}" for name in names)
        lines.append(f"| ({m} x {k}) @ ({k} x {n}) | {cells} | {after:.2f}, {cached:.2f} |")
    return "\n".join(lines) + "\n"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--rows", default="256,128,64", help="blocks of rows to try, comma-separated")
    ap.add_argument("--shapes", default=None, help="products as MxKxN, comma-separated (default: GPT-2 117M's)")
    ap.add_argument("--no-write", action="store_true")
    args = ap.parse_args(argv)
    from bench_engine import machine
    from profile_engine import write_section

    shapes = SHAPES if args.shapes is None else [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]
    row_blocks = [int(r) for r in args.rows.split(",") if r]
    grid = Grid(32)
    epilogues = fused.Epilogues(grid)
    results = {}
    for shape in shapes:
        results[shape] = measure(Product(*shape, epilogues), grid, args.reps, row_blocks)
        print(f"{shape}: " + ", ".join(f"{k} {1e3 * v:.2f} ms" for k, v in results[shape].items()), flush=True)
    command = "python bench/bench_epilogues.py " + shlex.join(argv if argv is not None else sys.argv[1:])
    section = markdown(results, command.strip(), machine())
    print(section)
    if not args.no_write:
        write_section(os.path.join(HERE, "RESULTS.md"), section)


if __name__ == "__main__":
    main()
