"""A dishonest trainer against the auditor's compiled sum pass, the auditor on another CPU variant.

Sums over 65536 values or more are computed in one compiled pass (fused.FusedSums) with their error scale
(sqrt(n) * sum |x|) and their exactness certificate (sum |x| < 2**52 * the float32 ulp of the smallest nonzero
|x|), not by the eager definition; the values and scales at logged positions come from those outputs' rows. The attacker computes both from the definition and
crafts one step, a row sum of 6 x 65536 float32 values built so that every partial sum is exact in float64
(the result is the same in any summation order): two rows land 0.5 tau from a float32 midpoint (the
honest trainer must log them), two 1.5 tau from one (no honest trainer could round them the other way),
and two exactly on a tie with the sum certified exact (rounding to even decides). The attacker flips the
last four. The auditor replays in a child process under `isa-default`, with the compiled pass checked to
run there; the same rows as a BatchNorm-like sum over (N, L) of an (N, C, L) batch take another kernel.
"""

import json
import math
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from veritrain.engine import EngineConfig, step_context
from veritrain.hardware import KNOBS, variant_env
from veritrain.logformat import StepLogWriter, read_records, write_records
from veritrain.rounding import UNIT_ROUNDOFF, Grid
from veritrain.rules import DEFAULT_THRESHOLDS

N = 1 << 16
GRID = Grid(32)
C = DEFAULT_THRESHOLDS["accumulate"]


def tau_by_definition(row: torch.Tensor) -> float:
    return C * UNIT_ROUNDOFF * math.sqrt(N) * float(row.double().abs().sum())


def certified_by_definition(row: torch.Tensor) -> bool:
    a = row.double().abs()
    smallest = float(a[a > 0].min())
    ulp = 2.0 ** (math.frexp(smallest)[1] - 24)
    return float(a.sum()) < 2.0**52 * ulp


def midpoint_near(v: float) -> float:
    spacing = float(GRID.spacing_at(torch.tensor([v], dtype=torch.float64)))
    return (math.floor(v / spacing) + 0.5) * spacing


def row_near_a_midpoint(g, k: float) -> torch.Tensor:
    """Multiples of 2**-20 in [-1/4, 1/4], and a last value that puts the sum k * tau from a midpoint.
    Every partial sum is a multiple of 2**-40 below 2**12: exact in float64, in any order."""
    a = torch.randint(-(1 << 18), 1 << 18, (N,), generator=g).double() * 2.0**-20
    a[-1] = 0.0
    rest = float(a[:-2].sum())
    m = midpoint_near(rest)
    a[-2] = m - rest
    d = round(k * tau_by_definition(a) * 2.0**40) * 2.0**-40
    a[-1] = d
    return a.float()


def row_on_a_certified_tie(g) -> torch.Tensor:
    """Magnitudes in [2**-26, 2**-14), multiples of 2**-38: sum |x| is about 2, below 2**52 times the ulp
    of the smallest (2**-49), so the sum is certified exact; the last value puts it on a float32 tie."""
    mags = torch.randint(1 << 12, 1 << 24, (N,), generator=g).double()
    signs = torch.randint(0, 2, (N,), generator=g).double() * 2 - 1
    a = mags * signs * 2.0**-38
    rest = float(a[:-1].sum())
    a[-1] = midpoint_near(rest + 2.0**-20) - rest  # about 2**-20: does not lower the smallest magnitude
    return a.float()


CHILD = r"""
import json, sys, torch
from veritrain.engine import EngineConfig, step_context
from veritrain.fused import FusedSums
from veritrain.logformat import StepLogReader
dims = json.loads(sys.argv[2])
x = torch.load(sys.argv[1])
calls = [0]
compiled = FusedSums.run
def counted(self, *a, **k):
    out = compiled(self, *a, **k)
    calls[0] += out is not None
    return out
FusedSums.run = counted
result = {}
for name in sys.argv[3:]:
    with StepLogReader(name, expect_step=0, expect_bits=32) as reader:
        with step_context(EngineConfig(), 0, reader=reader) as mode:
            out = torch.sum(x, dims)
    result[name] = {"suspicious": mode.stats.suspicious_count,
                    "rows": sorted({s.position for s in mode.stats.suspicious}),
                    "bits": out.view(torch.int32).tolist()}
result["compiled_calls"] = calls[0]
print(json.dumps(result))
"""


def audit_in_child(tmp_path, x, dims, *logs):
    torch.save(x, tmp_path / "x.pt")
    env = {k: v for k, v in os.environ.items() if k not in KNOBS and not k.startswith("VERITRAIN_COMPILE")}
    env.update(variant_env("isa-default"))
    p = subprocess.run([sys.executable, "-c", CHILD, str(tmp_path / "x.pt"), json.dumps(dims), *map(str, logs)],
                       capture_output=True, text=True, env=env, timeout=600)
    assert p.returncode == 0, p.stderr
    return json.loads(p.stdout.strip().splitlines()[-1])


def as_layout(rows: torch.Tensor, layout: str):
    """The step's input and summed dimensions: the rows of a matrix, or the channels of a (N, C, L) batch
    summed over N and L as a BatchNorm sums (dimensions that are not adjacent: another compiled kernel)."""
    if layout == "rows":
        return rows, [1]
    return rows.view(rows.shape[0], 2, -1).permute(1, 0, 2).contiguous(), [0, 2]


@pytest.mark.parametrize("layout", ["rows", "batch-norm"])
def test_flipped_roundings_of_large_sums_are_rejected_by_an_auditor_on_another_variant(tmp_path, layout):
    g = torch.Generator().manual_seed(7)
    x = torch.stack([row_near_a_midpoint(g, 0.5), row_near_a_midpoint(g, 0.5),
                     row_near_a_midpoint(g, 1.5), row_near_a_midpoint(g, 1.5),
                     row_on_a_certified_tie(g), row_on_a_certified_tie(g)])
    y = x.double().sum(1)
    dist = GRID.midpoint_distance(y)
    ratios = [float(dist[r]) / tau_by_definition(x[r]) for r in range(4)]
    assert [round(r, 3) for r in ratios] == [0.5, 0.5, 1.5, 1.5]
    assert [certified_by_definition(x[r]) for r in range(6)] == [False] * 4 + [True] * 2
    assert float(dist[4]) == float(dist[5]) == 0.0
    x, dims = as_layout(x, layout)

    honest = tmp_path / "honest.vtlog"
    w = StepLogWriter(str(honest), 0, 32)
    with step_context(EngineConfig(), 0, writer=w):
        trained = torch.sum(x, dims)
    w.close()
    step, bits, ops = read_records(str(honest))
    (out,) = ops[-1].outputs
    # the trainer's own compiled pass agrees with the definition: entries exactly where one is needed
    assert out.dir_pos.tolist() == [0, 1] and len(out.val_pos) == 0

    natural = GRID.round(y)
    flip = np.array([2, 3, 4, 5])
    away = ~(natural[flip].double().abs() > y[flip].abs())  # the other neighbour
    out.dir_pos = np.concatenate([out.dir_pos, flip]).astype(np.int64)
    out.dir_bits = np.concatenate([out.dir_bits, away.numpy()])
    attacked = tmp_path / "attacked.vtlog"
    write_records(str(attacked), step, bits, ops)

    r = audit_in_child(tmp_path, x, dims, honest, attacked)
    assert r["compiled_calls"] == 2  # both replays computed the sum by the compiled pass
    assert r[str(honest)]["suspicious"] == 0
    assert r[str(honest)]["bits"] == trained.view(torch.int32).tolist()
    assert r[str(attacked)]["suspicious"] == 4 and r[str(attacked)]["rows"] == [2, 3, 4, 5]
