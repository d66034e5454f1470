"""Scalar entries may override the auditor's rounding of a Python float argument only as an honest trainer's
could (SECURITY.md row 21).

An honest trainer logs a scalar (a step size, a scale) only within SCALAR_THRESHOLD (relative) of a float32
midpoint, in the direction of its own rounding; another machine's scalar (libm, float64 tensor values read
with .item()) may lie on the other side of the midpoint only if it is closer to it than that. Before, the
auditor accepted a scalar entry in either direction anywhere within slack * SCALAR_THRESHOLD, silently (not
even as a correction): a flip between 1x and 2x the threshold, which no honest trainer makes, steered the
scalar by one float32 ulp.
"""

import numpy as np
import torch

from veritrain.engine import SCALAR_THRESHOLD, EngineConfig, step_context
from veritrain.logformat import StepLogReader, StepLogWriter, read_records, write_records

MID = 1.0 + 2.0**-24  # the float32 midpoint between 1 and 1 + 2**-23
X = MID + 1.5 * SCALAR_THRESHOLD * MID  # rounds up to 1 + 2**-23; too far from the midpoint for an entry


def test_a_scalar_flipped_beyond_the_scalar_threshold_is_rejected(tmp_path):
    t = torch.ones(16)
    fn = lambda a: torch.mul(a, X)  # noqa: E731
    path = str(tmp_path / "step.vtlog")
    w = StepLogWriter(path, 0, 32)
    with step_context(EngineConfig(), 0, writer=w):
        honest = fn(t)
    w.close()
    step, bits, ops = read_records(path)
    assert ops[-1].scalars == [] and float(honest[0]) == float(np.float32(1.0 + 2.0**-23)), \
        "an honest trainer neither logs this scalar nor rounds it down"
    ops[-1].scalars.append((1, False))  # the dishonest trainer: the scalar rounded toward zero, to 1.0
    write_records(path, step, bits, ops)
    with StepLogReader(path, expect_step=0, expect_bits=32) as reader:
        with step_context(EngineConfig(), 0, reader=reader) as mode:
            replayed = fn(t)
    assert float(replayed[0]) == 1.0, "the forced direction was applied"
    assert mode.stats.suspicious_count == 1, (
        f"a scalar entry overriding the auditor's rounding ({X!r} -> 1.0 instead of {float(honest[0])!r}, "
        f"{abs(X - MID) / MID / SCALAR_THRESHOLD:.2f} * SCALAR_THRESHOLD from the midpoint) was accepted")
    assert mode.stats.corrections["forward"] == 1


def test_a_scalar_flipped_within_the_threshold_is_an_honest_correction(tmp_path):
    """The same flip 0.5 thresholds from the midpoint: another machine's scalar could lie on the other side
    (the freedom the threshold gives), so the auditor accepts it and counts it as a correction."""
    x = MID + 0.5 * SCALAR_THRESHOLD * MID
    t = torch.ones(16)
    path = str(tmp_path / "step.vtlog")
    w = StepLogWriter(path, 0, 32)
    with step_context(EngineConfig(), 0, writer=w):
        torch.mul(t, x)
    w.close()
    step, bits, ops = read_records(path)
    assert ops[-1].scalars == [(1, True)], "the honest trainer logs this scalar, rounded up (its own rounding)"
    ops[-1].scalars[0] = (1, False)
    write_records(path, step, bits, ops)
    with StepLogReader(path, expect_step=0, expect_bits=32) as reader:
        with step_context(EngineConfig(), 0, reader=reader) as mode:
            replayed = torch.mul(t, x)
    assert float(replayed[0]) == 1.0 and mode.stats.suspicious_count == 0
    assert mode.stats.corrections["forward"] == 1


def test_an_unneeded_scalar_entry_that_agrees_is_rejected_as_another_machine_would(tmp_path):
    """A scalar entry names a neighbour on the scalar's own side of its float32 rounding, so one that agrees with the
    auditor's rounding far from any midpoint can contradict another honest auditor's, whose scalar lies within
    SCALAR_THRESHOLD on the other side of a float32 value g. Logged "away" for a scalar just below g, it gives g (this
    auditor's own rounding) and, to the other, the float32 value after g. Both must reject it: that one because it
    contradicts far from any midpoint, this one only because no entry is needed there (AuditorHalf.force_scalar)."""
    g = 1.0 + 2.0**-23
    below, above = g * (1 - 2.0**-40), g * (1 + 2.0**-40)
    assert abs(above - below) < SCALAR_THRESHOLD * g
    t = torch.ones(16)
    path = str(tmp_path / "step.vtlog")
    w = StepLogWriter(path, 0, 32)
    with step_context(EngineConfig(), 0, writer=w):
        torch.mul(t, below)
    w.close()
    step, bits, ops = read_records(path)
    assert ops[-1].scalars == [], "an honest trainer logs nothing this far from a midpoint"
    ops[-1].scalars.append((1, True))
    write_records(path, step, bits, ops)
    for x, forced in ((below, g), (above, g + 2.0**-23)):
        with StepLogReader(path, expect_step=0, expect_bits=32) as reader:
            with step_context(EngineConfig(), 0, reader=reader) as mode:
                replayed = torch.mul(t, x)
        assert float(replayed[0]) == float(np.float32(forced))
        assert mode.stats.suspicious_count == 1, (x, [s.detail for s in mode.stats.suspicious])
