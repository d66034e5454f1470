"""A dishonest trainer against an operator whose error scale is its own result (rules.RelScale).

Elementwise functions (sqrt, exp, ...), a division by a scalar and the NLL/MSE loss backward have the scale
|y|: neither side stores it, the trainer's epilogue computes it while rounding and the auditor at the few
positions the log names (engine._EagerSlot.scale_at, fused._FusedSlot). If either were too large on the
auditor's side, a trainer could override roundings that no honest machine makes. Random training data
almost never lands between tau and slack * tau of a midpoint on such an operator (about 2^-24 of values at
c = 32), so the inputs here are found by a search: float32 square roots, which IEEE 754 rounds correctly
in float64, the same on every machine.
"""

import numpy as np
import pytest
import torch

from veritrain import engine
from veritrain.engine import EngineConfig, step_context
from veritrain.fused import FusedKernels
from veritrain.logformat import StepLogReader, StepLogWriter, read_records, write_records
from veritrain.rounding import UNIT_ROUNDOFF, Grid
from veritrain.rules import DEFAULT_THRESHOLDS

GRID = Grid(32)
C = DEFAULT_THRESHOLDS["elementwise"]
# sqrt(x) lies 1.78 tau from a float32 midpoint (found by scanning every float32 in [2^-6, 2^8)); its
# copies scaled by 4 are the same case in other binades
BETWEEN_TAU_AND_SLACK_TAU = [0x3CFC114A, 0x3DFC114A, 0x3EFC114A, 0x3FFC114A, 0x40FC114A, 0x41FC114A, 0x42FC114A]
# 0.5 and 0.125 tau from a midpoint: an honest trainer logs these
WITHIN_TAU = [0x3C800001, 0x3F800001, 0x407FFFFF, 0x437FFFFF]


def as_float32(bits: list) -> torch.Tensor:
    return torch.tensor(bits, dtype=torch.int32).view(torch.float32)


def distance_in_tau(x: torch.Tensor) -> torch.Tensor:
    y = torch.sqrt(x.double())
    return GRID.midpoint_distance(y) / (C * UNIT_ROUNDOFF * y.abs())


def inputs(n: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(x, positions to flip, positions the honest trainer logs): the cases spread over n values of 2.0,
    whose square root is far from any midpoint."""
    x = torch.full((n,), 2.0)
    flip = torch.arange(len(BETWEEN_TAU_AND_SLACK_TAU)) * (n // 16) + 3
    honest = torch.arange(len(WITHIN_TAU)) * (n // 16) + 5
    x[flip], x[honest] = as_float32(BETWEEN_TAU_AND_SLACK_TAU), as_float32(WITHIN_TAU)
    return x, flip, honest


def run(x, **io):
    with step_context(EngineConfig(), 0, **io):
        return torch.sqrt(x)


@pytest.mark.parametrize("n", [64, 1 << 17], ids=["eager scale", "fused kernel"])
def test_a_rounding_flipped_beyond_a_relative_error_bound_is_rejected(tmp_path, n, monkeypatch):
    monkeypatch.setenv("VERITRAIN_COMPILE", "auto")
    fused = FusedKernels.enabled_for(n, "cpu")
    assert fused == (n >= 1 << 16)
    slots = []  # which kind of slot the auditor checks the entries against
    for kind in (engine._EagerSlot, engine._FusedSlot):
        monkeypatch.setattr(kind, "scale_at", lambda self, idx, f=kind.scale_at: slots.append(type(self)) or f(self, idx))
    x, flip, honest = inputs(n)
    r = distance_in_tau(x)
    assert bool(((r[flip] > 1.1) & (r[flip] < 1.9)).all()) and bool((r[honest] < 0.6).all()), "premise"

    path = str(tmp_path / "step.vtlog")
    w = StepLogWriter(path, 0, 32)
    y_trainer = run(x, writer=w)
    w.close()
    step, bits, ops = read_records(path)
    out = ops[-1].outputs[0]
    assert set(out.dir_pos.tolist()) == set(honest.tolist()), "the honest trainer logs exactly the cases within tau"

    with StepLogReader(path, expect_step=0, expect_bits=32) as reader:
        with step_context(EngineConfig(), 0, reader=reader) as mode:
            y = torch.sqrt(x)
    assert mode.stats.suspicious_count == 0 and torch.equal(y.view(torch.int32), y_trainer.view(torch.int32))

    # the attacker rounds every case between tau and 1.9 tau the other way; slack * tau (2 tau) tolerates
    # where an entry is, not which way it may override the auditor's own rounding
    natural = GRID.round(torch.sqrt(x.double()))
    away = ~(natural.double() > torch.sqrt(x.double()))[flip]  # the other neighbour
    pos = np.concatenate([out.dir_pos, flip.numpy()])
    order = np.argsort(pos)
    out.dir_pos, out.dir_bits = pos[order], np.concatenate([out.dir_bits, away.numpy()])[order]
    write_records(path, step, bits, ops)
    with StepLogReader(path, expect_step=0, expect_bits=32) as reader:
        with step_context(EngineConfig(), 0, reader=reader) as mode:
            torch.sqrt(x)
    assert mode.stats.suspicious_count == len(flip), mode.stats.suspicious[:3]
    assert set(slots) == {engine._FusedSlot if fused else engine._EagerSlot}
    assert {s.position for s in mode.stats.suspicious} == set(flip.tolist())
    assert all(s.kind == "direction" for s in mode.stats.suspicious)
