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


T = torch.ones(16)


def scaled_log(tmp_path, x: float):
    """An honest trainer's log of one op, ``T * x``: (its path, its records, the result)."""
    path = str(tmp_path / "step.vtlog")
    w = StepLogWriter(path, 0, 32)
    with step_context(EngineConfig(), 0, writer=w):
        honest = torch.mul(T, x)
    w.close()
    return path, read_records(path), honest


def replayed(path, records, x: float):
    """``T * x`` replayed from ``records`` (written to ``path`` first): (the step's statistics, the result)."""
    write_records(path, *records)
    with StepLogReader(path, expect_step=0, expect_bits=32) as reader:
        with step_context(EngineConfig(), 0, reader=reader) as mode:
            out = torch.mul(T, x)
    return mode.stats, out


def test_a_scalar_flipped_beyond_the_scalar_threshold_is_rejected(tmp_path):
    path, records, honest = scaled_log(tmp_path, X)
    ops = records[2]
    assert ops[-1].scalars == [] and float(honest[0]) == float(np.float32(1.0 + 2.0**-23)), \
        "an honest trainer neither logs this scalar nor rounds it down"
    ops[-1].scalars.append((1, False))  # the dishonest trainer: the scalar rounded toward zero, to 1.0
    stats, replay = replayed(path, records, X)
    assert float(replay[0]) == 1.0, "the forced direction was applied"
    assert stats.suspicious_count == 1, (
        f"a scalar entry overriding the auditor's rounding ({X!r} -> 1.0 instead of {float(honest[0])!r}, "
        f"{abs(X - MID) / MID / SCALAR_THRESHOLD:.2f} * SCALAR_THRESHOLD from the midpoint) was accepted")
    assert stats.corrections["forward"] == 1


def test_a_scalar_flipped_within_the_threshold_is_an_honest_correction(tmp_path):
    """The same flip 0.5 thresholds from the midpoint: another machine's scalar could lie on the other side
    (the freedom the threshold gives), so the auditor accepts it and counts it as a correction."""
    x = MID + 0.5 * SCALAR_THRESHOLD * MID
    path, records, _ = scaled_log(tmp_path, x)
    ops = records[2]
    assert ops[-1].scalars == [(1, True)], "the honest trainer logs this scalar, rounded up (its own rounding)"
    ops[-1].scalars[0] = (1, False)
    stats, replay = replayed(path, records, x)
    assert float(replay[0]) == 1.0 and stats.suspicious_count == 0
    assert stats.corrections["forward"] == 1


def test_an_unneeded_scalar_entry_that_agrees_is_rejected_as_another_machine_would(tmp_path):
    """A scalar entry names a neighbour on the scalar's own side of its float32 rounding, so one that agrees with the
    auditor's rounding far from any midpoint can contradict another honest auditor's, whose scalar lies within
    SCALAR_THRESHOLD on the other side of a float32 value g. Logged "away" for a scalar just below g, it gives g (this
    auditor's own rounding) and, to the other, the float32 value after g. Both must reject it: that one because it
    contradicts far from any midpoint, this one only because no entry is needed there (AuditorHalf.force_scalar)."""
    g = 1.0 + 2.0**-23
    below, above = g * (1 - 2.0**-40), g * (1 + 2.0**-40)
    assert abs(above - below) < SCALAR_THRESHOLD * g
    path, records, _ = scaled_log(tmp_path, below)
    ops = records[2]
    assert ops[-1].scalars == [], "an honest trainer logs nothing this far from a midpoint"
    ops[-1].scalars.append((1, True))
    for x, forced in ((below, g), (above, g + 2.0**-23)):
        stats, replay = replayed(path, records, x)
        assert float(replay[0]) == float(np.float32(forced))
        assert stats.suspicious_count == 1, (x, [d.detail for d in stats.suspicious])
