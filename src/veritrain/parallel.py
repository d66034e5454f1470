"""Data parallelism whose result does not depend on the number of processes (issue 11, first part).

A step's global batch is a fixed number G of micro-batches, numbered 0..G-1, whatever the world size N.
Each micro-batch's forward and backward run under the engine alone (its own op stream: engine domain
``micro_domain(g)``, so its randomness and its log are keyed by g, not by the rank that ran it), which
leaves that micro-batch's gradient on the grid. The step's gradient is then

    G_step = round( (((g_0 + g_1) + g_2) + ... + g_{G-1}) )     float64 additions in micro-batch order

Every float64 addition is correctly rounded (IEEE 754) and elementwise, so on any hardware the sum is the
same float64 value, and so is its rounding to the grid: the reduction needs no log and no error scale.
What makes it independent of N is that every rank sums the same G grid tensors in the same order: the
micro-batch gradients are all-gathered (float32 on the wire), never pre-summed per rank in float64 (a
partial sum's grouping would depend on which rank held which micro-batch).

Communication per step and rank: all-gather of G x P float32 values (P parameters), against a ring
all-reduce's ~2 x P for DistributedDataParallel; bench/ measures it.
"""

from __future__ import annotations

import torch

from .rounding import Grid


def micro_domain(g: int) -> str:
    """The engine domain of micro-batch ``g``'s forward and backward (randomness and log are keyed by it)."""
    return f"micro/{int(g)}"


def assignment(num_micro: int, world: int) -> list[range]:
    """Which micro-batches each rank runs: contiguous blocks, as even as possible (rank r: ranges[r])."""
    if num_micro <= 0 or world <= 0:
        raise ValueError(f"need a positive number of micro-batches and ranks, got G={num_micro}, N={world}")
    if world > num_micro:
        raise ValueError(f"{world} ranks for {num_micro} micro-batches: each rank needs at least one")
    return [range(r * num_micro // world, (r + 1) * num_micro // world) for r in range(world)]


def flatten(grads: list[torch.Tensor | None], params: list[torch.Tensor]) -> torch.Tensor:
    """One float32 vector of a micro-batch's gradients (a missing gradient is zeros)."""
    return torch.cat([(g if g is not None else torch.zeros_like(p)).reshape(-1).float() for g, p in zip(grads, params)])


def reduce_in_order(flat: list[torch.Tensor], grid: Grid) -> torch.Tensor:
    """The step's gradient from the G micro-batch gradients (in micro-batch order): float64 additions in that
    order, then one rounding to the grid (float32)."""
    acc = flat[0].double().clone()
    for f in flat[1:]:
        acc.add_(f.double())
    return grid.round(acc)


def gather(local: dict[int, torch.Tensor], num_micro: int, group=None) -> list[torch.Tensor]:
    """All ranks' micro-batch gradients (flat float32 vectors, keyed by micro-batch), on every rank, in
    micro-batch order. Without torch.distributed initialised, ``local`` must hold all of them."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        missing = sorted(set(range(num_micro)) - set(local))
        if missing:
            raise ValueError(f"micro-batches {missing[:5]} were not computed and no process group is initialised")
        return [local[g] for g in range(num_micro)]
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    ranges = assignment(num_micro, world)
    if sorted(local) != list(ranges[rank]):
        raise ValueError(f"rank {rank} holds micro-batches {sorted(local)}, its share is {list(ranges[rank])}")
    width = max(len(r) for r in ranges)
    size = next(iter(local.values())).numel()
    mine = torch.zeros(width, size, dtype=torch.float32)
    for i, g in enumerate(ranges[rank]):
        mine[i] = local[g]
    out = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(out, mine, group=group)
    return [out[r][i] for r in range(world) for i in range(len(ranges[r]))]


def unflatten_into(flat: torch.Tensor, params: list[torch.Tensor]):
    """Set each parameter's .grad from the step's flat gradient."""
    offset = 0
    for p in params:
        n = p.numel()
        p.grad = flat[offset:offset + n].view_as(p).to(p.dtype).clone()
        offset += n
