"""Data parallelism whose result does not depend on the number of processes (docs/DISTRIBUTED.md).

A step's global batch is a fixed number G of micro-batches, numbered 0..G-1, whatever the world size N:
micro-batch g of step s is the task's ``batch(s * G + g)``. Each micro-batch's forward and backward run
under the engine alone, in an op stream of its own (engine domain ``micro_domain(g)``: its randomness
and its rounding log are keyed by g, not by the rank that ran it), which leaves that micro-batch's
gradient on the grid. The step's gradient is then

    G_step = round( ((((g_0 + g_1) + g_2) + ... + g_{G-1}) / G )     float64, in micro-batch order

Every float64 addition and the division are correctly rounded (IEEE 754) and elementwise, so on any
hardware the result is the same float64 value, and so is its rounding to the grid: the reduction needs no
log and no error scale. What makes it independent of N is that the additions are the same ones in the
same order whichever rank holds which micro-batch: ranks hold contiguous blocks, and rank r continues the
float64 running sum of ranks 0..r-1 over its own block and passes it on (``chained_reduce``), never
pre-summing its block on its own (a partial sum's grouping would depend on N). The last rank divides, rounds
and broadcasts the grid values. Floating-point buffers (BatchNorm's running statistics) are handled the same way:
each micro-batch's forward starts from the step's buffers, and the step's new buffers are the mean of
the G micro-batches' results. The optimizer step (the "update" part, its own op stream and log) then runs
on every rank on the same gradient and state.

The trainer's ranks may sit on different machines: each update's rounding decisions are rank 0's (its
log is broadcast and the other ranks replay it, as an auditor would), so the ranks cannot drift apart.
"""

from __future__ import annotations

import atexit
import hashlib
import time
from dataclasses import dataclass, field
from typing import NoReturn

import torch

from .commitments import batch_hash
from .rounding import Grid

UPDATE_DOMAIN = "update"


def micro_domain(g: int) -> str:
    """The engine domain of micro-batch ``g``'s forward and backward (randomness and log are keyed by it)."""
    return f"micro/{int(g)}"


def part_of(domain: str) -> int | None:
    """The micro-batch a domain names (``micro/g`` -> g), None for the update."""
    return int(domain.split("/", 1)[1]) if domain.startswith("micro/") else None


def assignment(num_micro: int, world: int) -> list[range]:
    """Which micro-batches each rank runs: contiguous blocks, as even as possible (rank r: ranges[r])."""
    if num_micro <= 0 or world <= 0:
        raise ValueError(f"need a positive number of micro-batches and ranks, got G={num_micro}, N={world}")
    if world > num_micro:
        raise ValueError(f"{world} processes for {num_micro} micro-batches per step: each process needs at least "
                         f"one (use at most {num_micro} processes, or more micro-batches)")
    return [range(r * num_micro // world, (r + 1) * num_micro // world) for r in range(world)]


def world() -> tuple[int, int]:
    """(rank, world size) of this process: (0, 1) without an initialised torch.distributed process group."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def flatten(tensors: list[torch.Tensor | None], like: list[torch.Tensor]) -> torch.Tensor:
    """One vector of ``tensors`` (a missing one is zeros), in the dtype of the first of ``like``."""
    dtype = like[0].dtype if like else torch.float32
    return torch.cat([(t if t is not None else torch.zeros_like(p)).reshape(-1).to(dtype) for t, p in zip(tensors, like)]) \
        if like else torch.zeros(0, dtype=dtype)


def reduce_in_order(flat: list[torch.Tensor], grid: Grid | None, count: int | None = None) -> torch.Tensor:
    """The sum of ``flat`` (in that order) in float64, divided by ``count`` when given, then rounded once to
    the grid (float32); ``grid=None`` keeps the float64 result (fp64 runs)."""
    acc = flat[0].double().clone()
    for f in flat[1:]:
        acc.add_(f.double())
    if count is not None and count != 1:
        acc.div_(count)
    return acc if grid is None else grid.round(acc)


def gather(local: dict[int, torch.Tensor], num_micro: int, group=None, alone: bool = False) -> list[torch.Tensor]:
    """All ranks' micro-batch vectors (keyed by micro-batch), on every rank, in micro-batch order. Without
    torch.distributed initialised (or ``alone``), ``local`` must hold all of them."""
    import torch.distributed as dist

    if alone or not (dist.is_available() and dist.is_initialized()):
        missing = sorted(set(range(num_micro)) - set(local))
        if missing:
            raise ValueError(f"micro-batches {missing[:5]} were not computed and no process group is initialised")
        return [local[g] for g in range(num_micro)]
    size_world, rank = dist.get_world_size(group), dist.get_rank(group)
    ranges = assignment(num_micro, size_world)
    if sorted(local) != list(ranges[rank]):
        raise ValueError(f"rank {rank} holds micro-batches {sorted(local)}, its share is {list(ranges[rank])}")
    width = max(len(r) for r in ranges)
    first = next(iter(local.values()))
    mine = torch.zeros(width, first.numel(), dtype=first.dtype, device=first.device)
    for i, g in enumerate(ranges[rank]):
        mine[i] = local[g]
    out = [torch.empty_like(mine) for _ in range(size_world)]
    dist.all_gather(out, mine, group=group)
    return [out[r][i] for r in range(size_world) for i in range(len(ranges[r]))]


def chained_reduce(local: dict[int, torch.Tensor], num_micro: int, grid: Grid | None, chunk: int = 1 << 20,
                   alone: bool = False) -> torch.Tensor:
    """``reduce_in_order`` of all ranks' micro-batch vectors without gathering them: rank r adds its
    contiguous block of micro-batches, in order, to the float64 running sum of ranks 0..r-1 and passes it to
    rank r+1, a chunk at a time (so the ranks work on different chunks at once); the last rank divides,
    rounds and broadcasts the result. The same float64 additions in the same order as one process makes, so
    the same bits; about 8 x P bytes sent per rank and 4 x P received, whatever G."""
    import torch.distributed as dist

    if alone or not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return reduce_in_order(gather(local, num_micro, alone=True), grid, num_micro)
    rank, size = dist.get_rank(), dist.get_world_size()
    mine = list(assignment(num_micro, size)[rank])
    if sorted(local) != mine:
        raise ValueError(f"rank {rank} holds micro-batches {sorted(local)}, its share is {mine}")
    first = local[mine[0]]
    n, device = first.numel(), first.device
    total = torch.empty(n, dtype=torch.float64, device=device) if rank == size - 1 else None
    sends = []
    for lo in range(0, n, chunk):
        hi = min(n, lo + chunk)
        if rank == 0:
            acc, rest = local[mine[0]][lo:hi].to(torch.float64, copy=True), mine[1:]
        else:
            acc, rest = torch.empty(hi - lo, dtype=torch.float64, device=device), mine
            dist.recv(acc, src=rank - 1)
        for g in rest:
            acc.add_(local[g][lo:hi].double())
        if rank < size - 1:
            sends.append((dist.isend(acc, dst=rank + 1), acc))
        else:
            total[lo:hi] = acc
    for work, _ in sends:
        work.wait()
    if rank == size - 1:
        out = total.div_(num_micro) if num_micro != 1 else total
        out = out if grid is None else grid.round(out)
    else:
        out = torch.empty(n, dtype=torch.float64 if grid is None else torch.float32, device=device)
    dist.broadcast(out, src=size - 1)
    return out


def gather_objects(local: dict[int, object], num_micro: int, alone: bool = False) -> list:
    """``gather`` for small picklable objects (each micro-batch's record fields)."""
    import torch.distributed as dist

    if alone or not (dist.is_available() and dist.is_initialized()):
        return [local[g] for g in range(num_micro)]
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, local)
    merged = {g: v for d in out for g, v in d.items()}
    return [merged[g] for g in range(num_micro)]


def broadcast_bytes(data: bytes | None) -> bytes:
    """Rank 0's ``data`` on every rank (itself without a process group)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return data
    box = [data]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def barrier():
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()


@dataclass
class StepParts:
    """What one data-parallel step gave: every micro-batch's record fields (in micro-batch order, gathered
    from all ranks), the step's loss, and the engine statistics of the parts this process ran."""
    micro: list[dict]
    loss: float
    update_log: bytes | None = None  # the update's rounding log (a trainer's, verified mode)
    stats: list = field(default_factory=list)  # (micro-batch or None for the update, engine StepStats)
    batches: dict = field(default_factory=dict)  # this process's micro-batches (g -> batch), for callers
    comm_seconds: float = 0.0  # wall time in this step's collectives (waiting for the other ranks included)


class PartLogs:
    """Where the rounding log of each part of a step goes (the trainer: ``writer(part)``) or comes from (a
    replay: ``reader(part)``); a part is a micro-batch number or None for the update. The base class
    keeps no log (nolog, fp32 and fp64 runs)."""

    def writer(self, part):
        return None

    def reader(self, part):
        return None

    def sha256(self, part) -> str | None:
        """The SHA-256 of the log ``reader(part)`` reads (a replay's record names it)."""
        return None


def _float_buffers(model) -> list[torch.Tensor]:
    return [b for b in model.buffers() if b.is_floating_point()]


def run_step(task, engine, step: int, num_micro: int, mode: str, grid: Grid, logs: PartLogs,
             trace=None, probe=None, on_batch=None, alone: bool = False) -> StepParts:
    """One data-parallel step of ``task`` on this process's share of the G micro-batches, then the
    reduction and the update on every rank. ``logs`` gives each part's log writer (trainer) or reader
    (replay); ``trace`` (single-process replays of the verification game) collects the parts' ops in
    order: micro-batch 0 .. G-1, then the update. ``on_batch(g, batch)`` sees each micro-batch as prepared.
    ``alone``: run every part in this process, whatever process group it belongs to (the game's replays)."""
    from .engine import ReplayMismatchError, logged_step
    from .logformat import LogFormatError
    from .runner import _prepare_batch
    from .task import TaskError

    if task.loss is None:
        raise TaskError("a data-parallel run (micro_batches > 1) needs a task with loss=: veritrain runs each "
                        "micro-batch's backward and the optimizer step itself (train_step= does both at once)")
    model, opt = task.model, task.optimizer
    rank, size = (0, 1) if alone else world()
    mine = assignment(num_micro, size)[rank]
    params = [p for p in model.parameters() if p.requires_grad]
    buffers = _float_buffers(model)
    start = [b.detach().clone() for b in model.buffers()]
    local, meta, stats, batches = {}, {}, [], {}
    grad_dtype = params[0].dtype if params else torch.float32
    for g in mine:
        with torch.no_grad():
            for b, b0 in zip(model.buffers(), start):
                b.copy_(b0)
        try:
            with logged_step(engine, step, writer=logs.writer(g), reader=logs.reader(g), trace=trace, probe=probe,
                             domain=micro_domain(g)) as st:
                batch = _prepare_batch(task.batch(step * num_micro + g), mode, grid)
                if trace is not None:
                    from .protocol import batch_leaves

                    trace.add_sources(batch_leaves(batch), f"batch/{g}")
                for p in params:
                    p.grad = None
                loss = task.loss(model, batch)
                loss.backward()
        except (ReplayMismatchError, LogFormatError) as e:
            # a replay that does not follow the log: every rank must learn it after the gather, not hang in it
            meta[g] = {"error": f"step {step}, micro-batch {g}: {e}"}
            local[g] = torch.zeros(sum(p.numel() for p in params) + sum(b.numel() for b in buffers), dtype=grad_dtype,
                                   device=params[0].device if params else None)
            continue
        if on_batch is not None:
            on_batch(g, batch)
        batches[g] = batch
        stats.append((g, st.stats))
        grads = [p.grad for p in params]
        local[g] = torch.cat([flatten(grads, params).to(grad_dtype), flatten(buffers, buffers).to(grad_dtype)])
        indices = task.batch_indices(step * num_micro + g) if task.batch_indices else None
        meta[g] = {"batch_sha256": batch_hash(batch), "batch_indices": indices,
                   "loss": float(loss.detach()), "has_grad": [x is not None for x in grads]}
        if st.writer is not None:
            meta[g]["log"] = _log_bytes(st.writer)
            meta[g]["log_sha256"] = hashlib.sha256(meta[g]["log"]).hexdigest()
        elif st.reader is not None:
            meta[g]["log_sha256"] = logs.sha256(g)
        else:
            meta[g]["log_sha256"] = None
    t_comm = time.perf_counter()
    micro = gather_objects(meta, num_micro, alone)
    failed = next((m["error"] for m in micro if "error" in m), None)
    if failed is not None:  # every rank knows it now, and stops alike
        raise ReplayMismatchError(failed)
    reduced = chained_reduce(local, num_micro, grid if grad_dtype == torch.float32 else None,
                             alone=alone).to(grad_dtype)
    comm = time.perf_counter() - t_comm
    offset = 0
    with torch.no_grad():
        for j, p in enumerate(params):
            n = p.numel()
            p.grad = reduced[offset:offset + n].view_as(p).to(p.dtype).clone() \
                if any(m["has_grad"][j] for m in micro) else None
            offset += n
        for b in buffers:  # the mean of the micro-batches' buffers (integer buffers: the same on every rank)
            n = b.numel()
            b.copy_(reduced[offset:offset + n].view_as(b))
            offset += n
    step_loss = float(sum(m["loss"] for m in micro) / num_micro)
    # the update: a trainer's rank 0 decides its rounding and the other ranks replay its log (they may be
    # other hardware); a replay reads the run's update log on every rank
    update_log, reader = None, logs.reader(None)
    if reader is None and engine.mode == "verified":
        writer = logs.writer(None) if rank == 0 else None
        if rank == 0:
            _update(engine, step, opt, task.scheduler, writer, None, trace, probe, stats)
            if writer is not None:
                update_log = _log_bytes(writer)
        t_comm = time.perf_counter()
        update_log = update_log if alone else broadcast_bytes(update_log)
        comm += time.perf_counter() - t_comm
        if rank != 0 and update_log is not None:
            from .logformat import StepLogReader

            _update(engine, step, opt, task.scheduler, None,
                    StepLogReader(update_log, expect_step=step, expect_bits=engine.bits), trace, probe, stats)
    else:
        _update(engine, step, opt, task.scheduler, None, reader, trace, probe, stats)
    for m in micro:
        m.pop("has_grad", None)
    return StepParts(micro=micro, loss=step_loss, update_log=update_log, stats=stats, batches=batches,
                     comm_seconds=comm)


def _log_bytes(writer) -> bytes:
    """The bytes of a closed log writer's file (removed: the caller stores them where they belong)."""
    import os

    with open(writer.path, "rb") as f:
        data = f.read()
    os.remove(writer.path)
    return data


def _update(engine, step, opt, scheduler, writer, reader, trace, probe, stats):
    from .engine import logged_step

    with logged_step(engine, step, writer=writer, reader=reader, trace=trace, probe=probe,
                     domain=UPDATE_DOMAIN) as st:
        opt.step()
        if scheduler is not None:
            scheduler.step()
    stats.append((None, st.stats))


# --- processes ---------------------------------------------------------------------------------

LAUNCH_ENV = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def launched() -> bool:
    """Whether this process is one of several started by ``torchrun`` or ``launch`` (their variables set)."""
    import os

    return all(k in os.environ for k in LAUNCH_ENV) and int(os.environ["WORLD_SIZE"]) > 1


def init_from_env(device: str) -> str:
    """Join the process group ``torchrun`` (or ``launch``) described in the environment: gloo on CPUs, NCCL on
    GPUs. Returns the device this rank runs on (``cuda`` becomes ``cuda:LOCAL_RANK``)."""
    import datetime
    import os

    import torch.distributed as dist

    if dist.is_initialized():
        return device
    cuda = device.startswith("cuda")
    if cuda and device == "cuda":
        device = f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}"
    if cuda:
        torch.cuda.set_device(torch.device(device))
    minutes = float(os.environ.get("VERITRAIN_DIST_TIMEOUT_MIN", "30"))
    dist.init_process_group("nccl" if cuda else "gloo", init_method="env://",
                            timeout=datetime.timedelta(minutes=minutes))
    atexit.register(_destroy_process_group)  # a rank that leaves some other way than finish_rank
    return device


def _destroy_process_group():
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()


def finish_rank(code: int) -> NoReturn:
    """End a rank of the CLI (its files are written and closed) with exit status ``code``, skipping the
    interpreter's shutdown. Even after ``destroy_process_group``, gloo's threads are torn down unjoined at
    shutdown and a process of a finished two-process run aborts with SIGABRT ("terminate called without an
    active exception"): seen in the fresh-clone CI, and in 3 of 30 runs of plain DDP on this 2-core machine
    with three other busy processes (tests/test_distributed.py's script; an abort with no Python frame,
    after destroy_process_group had returned in both ranks)."""
    import os
    import sys

    _destroy_process_group()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)


def launch(argv: list[str], nproc: int) -> int:
    """Run ``veritrain ARGV`` as ``nproc`` processes on this machine, the way torchrun would (RANK, WORLD_SIZE,
    MASTER_ADDR/PORT, LOCAL_RANK). When one fails, the others are stopped. Returns the first failure's exit
    code (128 + the signal for a process killed by one), or 0."""
    import os
    import signal
    import socket
    import subprocess
    import sys
    import time

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    threads = max(1, (os.cpu_count() or 1) // nproc)
    procs = []
    for r in range(nproc):
        env = {**os.environ, "RANK": str(r), "LOCAL_RANK": str(r), "WORLD_SIZE": str(nproc),
               "LOCAL_WORLD_SIZE": str(nproc), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
        env.setdefault("OMP_NUM_THREADS", str(threads))  # the cores shared out, as torchrun does
        procs.append(subprocess.Popen([sys.executable, "-m", "veritrain.cli", *argv], env=env,
                                      stdout=None if r == 0 else subprocess.DEVNULL))
    try:
        while True:
            codes = [p.poll() for p in procs]
            failed = [(r, c) for r, c in enumerate(codes) if c not in (None, 0)]
            # a rank killed by a signal is the cause; the others then find the group broken and exit with 2
            bad = min(failed, key=lambda rc: (rc[1] > 0, rc[0]), default=None)
            if bad is not None:
                for p in procs:
                    if p.poll() is None:
                        p.terminate()
                for p in procs:
                    p.wait()
                r, c = bad
                why = f"was killed by {signal.Signals(-c).name}" if c < 0 else f"exited with status {c}"
                print(f"veritrain: the process of rank {r} {why}; the other {nproc - 1} were stopped", file=sys.stderr)
                return 128 - c if c < 0 else c
            if all(c == 0 for c in codes):
                return 0
            time.sleep(0.2)
    except KeyboardInterrupt:
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGINT)
        for p in procs:
            p.wait()
        raise
