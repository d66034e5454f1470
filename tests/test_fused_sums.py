"""Sums and means of float32 tensors in one compiled pass (fused.FusedSums, engine._SumSlot): the same float32
results and log bytes as the eager ops, each side replays the other's log, and the auditor's check of an entry
in a compiled sum uses the rule's error scale (a forged decision beyond it is caught)."""

import pytest
import torch

from conftest import forge_wrong_directions
from veritrain import engine, rules
from veritrain.engine import EngineConfig, step_context
from veritrain.fused import FusedSums
from veritrain.logformat import StepLogReader, StepLogWriter
from veritrain.rounding import UNIT_ROUNDOFF, Grid

aten = torch.ops.aten
C = 2.0**25  # about one result in eight is a log entry: the comparisons cover entries
WIDE = EngineConfig(thresholds={"accumulate": C})
CASES = [((64, 4096), [1], False), ((64, 4096), [1], True), ((4096, 48), [0], False),
         ((16, 6, 32, 32), [0, 2, 3], False), ((16, 6, 32, 32), [0, 2, 3], True), ((64, 4096), [0, 1], False)]


def _data(shape, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g) * torch.exp(4 * torch.randn(shape, generator=g))  # certificates fail
    flat = x.view(-1)
    flat[: flat.numel() // 16] = torch.randint(-8, 8, (flat.numel() // 16,), generator=g).float()  # some exact
    flat[flat.numel() // 2 + 7] = float("nan")
    flat[flat.numel() // 3 + 5] = float("inf")
    flat[flat.numel() // 4: flat.numel() // 4 + 3] = -float("inf")
    return x


def _zeros_and_tiny(shape):
    """Rows of zeros, of float32's smallest subnormals, and of values of mixed binades (the certificate's edges)."""
    x = torch.zeros(shape)
    rows = x.view(shape[0], -1)
    rows[1::4] = 2.0**-149
    rows[2::4, ::3] = 2.0**-130
    rows[3::4] = torch.linspace(-3, 3, rows.shape[1]) * 2.0**-100
    return x


def _set_fused(monkeypatch, on: bool):
    monkeypatch.setattr(engine, "_FUSED_SUMS", {aten.sum.dim_IntList, aten.mean.dim} if on else set())


def _train(path, x, op, dims, keep):
    w = StepLogWriter(str(path), 0, 32)
    with step_context(WIDE, 0, writer=w) as mode:
        y = getattr(x, op)(dims, keepdim=keep)
    w.close()
    return y, mode


def _audit(path, x, op, dims, keep):
    with StepLogReader(str(path), expect_step=0, expect_bits=32) as reader:
        with step_context(WIDE, 0, reader=reader) as mode:
            y = getattr(x, op)(dims, keepdim=keep)
    return y, mode


@pytest.mark.parametrize("op", ["sum", "mean"])
@pytest.mark.parametrize("shape,dims,keep", CASES)
@pytest.mark.parametrize("data", ["wide", "zeros-and-tiny"])
def test_a_compiled_sum_gives_the_eager_results_and_log(tmp_path, monkeypatch, op, shape, dims, keep, data):
    x = _data(shape) if data == "wide" else _zeros_and_tiny(shape)
    runs = []
    real_run = FusedSums.run
    monkeypatch.setattr(FusedSums, "run", lambda self, *a: runs.append(real_run(self, *a)) or runs[-1])
    _set_fused(monkeypatch, True)
    y_f, mode_f = _train(tmp_path / "f.vtlog", x, op, dims, keep)
    assert len(runs) == 1 and runs[0] is not None, "the compiled pass ran"
    _set_fused(monkeypatch, False)
    y_e, mode_e = _train(tmp_path / "e.vtlog", x, op, dims, keep)
    assert len(runs) == 1
    assert y_f.shape == y_e.shape and torch.equal(y_f.view(torch.int32), y_e.view(torch.int32))
    assert (tmp_path / "f.vtlog").read_bytes() == (tmp_path / "e.vtlog").read_bytes()
    if y_e.numel() > 1 and data == "wide":
        assert mode_e.stats.entries_total > 0, "the comparison covers log entries"

    for fused_auditor in (True, False):
        _set_fused(monkeypatch, fused_auditor)
        y_a, mode_a = _audit(tmp_path / "e.vtlog", x, op, dims, keep)
        assert mode_a.stats.suspicious_count == 0
        assert torch.equal(y_a.view(torch.int32), y_e.view(torch.int32))


@pytest.mark.parametrize("fused_auditor", [True, False])
def test_a_forged_decision_beyond_a_compiled_sums_bound_is_caught(tmp_path, monkeypatch, fused_auditor):
    """The attacker adds direction entries that round the wrong way where the result lies between 1.2 and 1.9
    thresholds from a midpoint: within the auditor's slack window (2 tau), so only the error bound itself tells
    that no honest machine rounds there that way. (Means of positive values over 4000 columns: not
    certified, and tau is about 1/16 of half a grid spacing at this threshold.)"""
    c, dims, grid = 2.0**19, [1], Grid(32)
    config = EngineConfig(thresholds={"accumulate": c})
    x = torch.exp(torch.randn(256, 4000, generator=torch.Generator().manual_seed(3)))
    _set_fused(monkeypatch, True)
    w = StepLogWriter(str(tmp_path / "t.vtlog"), 0, 32)
    with step_context(config, 0, writer=w):
        x.mean(dims)
    w.close()

    y64 = x.double().mean(dims)
    scale = rules._reduction_sum(rules.Call(aten.mean.dim, (x.double(), dims), {}, [y64]))[0]
    tau = c * UNIT_ROUNDOFF * scale
    dist = grid.midpoint_distance(y64)
    targets = ((dist > 1.2 * tau) & (dist < 1.9 * tau)).nonzero().flatten()
    assert len(targets) >= 5
    forge_wrong_directions(tmp_path / "t.vtlog", tmp_path / "forged.vtlog", targets, y64, tau)

    _set_fused(monkeypatch, fused_auditor)
    with StepLogReader(str(tmp_path / "forged.vtlog"), expect_step=0, expect_bits=32) as reader:
        with step_context(config, 0, reader=reader) as mode:
            x.mean(dims)
    flagged = {s.position for s in mode.stats.suspicious}
    assert flagged == set(targets.tolist())
