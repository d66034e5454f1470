"""Communication of veritrain's data-parallel reduction (veritrain.parallel) against DistributedDataParallel's.

DDP all-reduces the P float32 gradient values of a step. veritrain's reduction must add the G micro-batch
gradients in micro-batch order in float64, whichever rank holds them; two ways: all-gather them (G x P
float32 values arrive at every rank, each sums them), or the chained running sum (rank r continues ranks
0..r-1's float64 sum over its block, chunk by chunk, and the last rank broadcasts the rounded result). This
measures the three with gloo on this machine, N processes, for a few P and G: medians of --repeats rounds,
and the ratios to the all-reduce, paired round by round in the same processes. Appends a section to
bench/RESULTS.md.

    python bench/parallel_comm.py --world 2 --sizes 1e6,6.6e6 --micro 2,4,8
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

HERE = os.path.dirname(os.path.abspath(__file__))


def worker(rank, world, store, sizes, micro, repeats, out):
    from veritrain import parallel
    from veritrain.rounding import Grid

    grid = Grid(32)

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    torch.set_num_threads(1)
    rows = []
    for p in sizes:
        grad = torch.randn(p)
        for g in micro:
            mine = {i: torch.randn(p) for i in parallel.assignment(g, world)[rank]}
            t_reduce, t_gather, t_chain = [], [], []
            for _ in range(repeats):  # alternate, so that load on the machine hits all three alike
                dist.barrier()
                t0 = time.perf_counter()
                dist.all_reduce(grad)
                t_reduce.append(time.perf_counter() - t0)
                dist.barrier()
                t0 = time.perf_counter()
                parallel.reduce_in_order(parallel.gather(mine, g), grid, g)
                t_gather.append(time.perf_counter() - t0)
                dist.barrier()
                t0 = time.perf_counter()
                parallel.chained_reduce(mine, g, grid)
                t_chain.append(time.perf_counter() - t0)
            rows.append((p, g, statistics.median(t_reduce), statistics.median(t_gather), statistics.median(t_chain),
                         statistics.median([b / a for a, b in zip(t_reduce, t_gather)]),
                         statistics.median([c / a for a, c in zip(t_reduce, t_chain)])))
    if rank == 0:
        torch.save(rows, out)
    parallel.finish_rank(0)  # gloo's threads can abort the interpreter's shutdown


def _cpu() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        return "CPU"


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--sizes", default="1e6,6.6e6", help="parameter counts P (comma-separated)")
    ap.add_argument("--micro", default="2,4,8", help="micro-batch counts G (comma-separated)")
    ap.add_argument("--repeats", type=int, default=9)
    ap.add_argument("--results", default=os.path.join(HERE, "RESULTS.md"))
    args = ap.parse_args()
    sizes = [int(float(x)) for x in args.sizes.split(",")]
    micro = [int(x) for x in args.micro.split(",")]
    with tempfile.TemporaryDirectory() as d:
        out = os.path.join(d, "rows.pt")
        mp.spawn(worker, args=(args.world, os.path.join(d, "store"), sizes, micro, args.repeats, out),
                 nprocs=args.world)
        rows = torch.load(out)
    lines = ["\n## Data-parallel communication (issue 11)\n",
             f"Command: `python bench/parallel_comm.py --world {args.world} --sizes {args.sizes} --micro {args.micro} "
             f"--repeats {args.repeats}` ({time.strftime('%Y-%m-%d')}). Machine: {_cpu()}, "
             f"{os.cpu_count()} cores, torch {torch.__version__}, gloo, {args.world} processes of 1 thread.\n",
             "| parameters P | micro-batches G | DDP all-reduce of P float32 | all-gather of G x P float32, then "
             "the sum | chained float64 running sum, then broadcast | all-gather / all-reduce | chained / all-reduce |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for p, g, a, b, c, rb, rc in rows:
        lines.append(f"| {p:.3g} | {g} | {a * 1e3:.1f} ms | {b * 1e3:.1f} ms | {c * 1e3:.1f} ms | {rb:.2f}x | "
                     f"{rc:.2f}x |")
    lines.append("\nBoth veritrain reductions give the same bits (the same float64 additions in the same order); "
                 "times include the float64 additions and the rounding. The all-gather carries G x P values to every "
                 "rank, so its cost grows with G; the chained sum sends about 8 x P bytes and receives 4 x P per "
                 "rank whatever G, one hop per rank (pipelined by chunks of 2^20 values).\n")
    text = "\n".join(lines)
    print(text)
    with open(args.results, "a") as f:
        f.write(text)


if __name__ == "__main__":
    sys.exit(main())
