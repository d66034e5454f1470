"""An NLL loss and its gradient computed on the picked elements alone (engine._picked_nll, _PickedSlot): the
same float32 results and the same log bytes as the op on the whole (rows, classes) input, on both sides, and
a hostile entry where the gradient is exactly zero is still caught."""

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from veritrain import engine
from veritrain.engine import EngineConfig, step_context
from veritrain.logformat import StepLogReader, StepLogWriter, read_records

aten = torch.ops.aten
# a threshold this large makes about one result in eight a log entry: the comparison covers entries too
WIDE = EngineConfig(thresholds={"softmax": 2.0**25})


def _loss_step(x, target, reduction, ignore, grad_scale):
    x = x.clone().requires_grad_(True)
    loss = F.nll_loss(x, target, reduction=reduction, ignore_index=ignore)
    (loss * (grad_scale if reduction == "none" else grad_scale[0])).sum().backward()
    return loss.detach(), x.grad


def _inputs(rows=512, classes=300, ignore=-100, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.log_softmax(torch.randn(rows, classes, generator=g), 1)
    target = torch.randint(0, classes, (rows,), generator=g)
    target[::7] = ignore
    target[1::7] = 0
    grad_scale = 1 + torch.rand(rows, generator=g)  # each row's gradient differs
    # a mean's gradient is -g / (rows kept) in every kept row: choose g so that it lies near a float32
    # midpoint, and every one of them is a log entry
    kept = float((target != ignore).sum())
    for k in range(4096):
        q = (1 + k / 4096) / kept
        f = torch.tensor(q, dtype=torch.float64).float().double()
        spacing = float(torch.nextafter(f.float(), torch.tensor(float("inf"))).double() - f)
        mid = float(f) + spacing / 2 if q >= float(f) else float(f) - spacing / 2
        if abs(q - mid) < 2.0**-30 * q:
            grad_scale[0] = 1 + k / 4096
            break
    return x, target, grad_scale


def _trainer(path, x, target, reduction, ignore, grad_scale, picked: bool, monkeypatch):
    monkeypatch.setattr(engine, "_PICKED", engine._PICKED if picked else set())
    w = StepLogWriter(str(path), 0, 32)
    with step_context(WIDE, 0, writer=w) as mode:
        out = _loss_step(x, target, reduction, ignore, grad_scale)
    w.close()
    return out, mode, path.read_bytes()


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("ignore", [-100, 7])
def test_the_picked_loss_gives_the_full_ops_results_and_log(tmp_path, monkeypatch, reduction, ignore):
    x, target, grad_scale = _inputs(ignore=ignore)
    seen, real = [], engine._PickedSlot

    class Spy(real):
        def __init__(self, inner, cols, width):
            seen.append(width)
            super().__init__(inner, cols, width)

    monkeypatch.setattr(engine, "_PickedSlot", Spy)
    (loss_p, grad_p), _, log_p = _trainer(tmp_path / "p.vtlog", x, target, reduction, ignore, grad_scale, True,
                                          monkeypatch)
    assert seen == [x.shape[1]], "the gradient was analysed on the picked column"
    (loss_f, grad_f), _, log_f = _trainer(tmp_path / "f.vtlog", x, target, reduction, ignore, grad_scale, False,
                                          monkeypatch)
    assert torch.equal(loss_p.view(torch.int32), loss_f.view(torch.int32))
    assert torch.equal(grad_p.view(torch.int32), grad_f.view(torch.int32))
    assert log_p == log_f
    records = read_records(str(tmp_path / "p.vtlog"))[2]
    backward = [r for r in records if r.name == "aten.nll_loss_backward.default"][0].outputs[0]
    assert backward.shape == tuple(x.shape)
    if reduction == "mean":
        assert backward.n_entries == int((target != ignore).sum()), "the comparison covers log entries"

    # each side replays the other's log: no suspicious entry, the same bits
    for picked in (True, False):
        monkeypatch.setattr(engine, "_PICKED", {aten.nll_loss_forward.default, aten.nll_loss_backward.default}
                            if picked else set())
        with StepLogReader(str(tmp_path / "f.vtlog"), expect_step=0, expect_bits=32) as reader:
            with step_context(WIDE, 0, reader=reader) as mode:
                loss_a, grad_a = _loss_step(x, target, reduction, ignore, grad_scale)
        assert mode.stats.suspicious_count == 0
        assert torch.equal(grad_a.view(torch.int32), grad_f.view(torch.int32))
        assert torch.equal(loss_a.view(torch.int32), loss_f.view(torch.int32))


def test_an_entry_where_the_picked_gradient_is_zero_is_suspicious(tmp_path):
    """The attacker moves a logged decision of the gradient to a column the loss never read (an exact zero
    there): the auditor, analysing only the picked column, must still see a zero with scale 0 there."""
    x, target, grad_scale = _inputs()
    path = tmp_path / "t.vtlog"
    w = StepLogWriter(str(path), 0, 32)
    with step_context(WIDE, 0, writer=w):
        _, grad_t = _loss_step(x, target, "mean", -100, grad_scale)
    w.close()
    _, _, records = read_records(str(path))
    i = next(k for k, r in enumerate(records) if r.name == "aten.nll_loss_backward.default")
    out = records[i].outputs[0]
    assert len(out.dir_pos) or len(out.val_pos)
    pos = out.dir_pos if len(out.dir_pos) else out.val_pos
    row = int(pos[0]) // x.shape[1]
    other = (int(target[row]) + 1) % x.shape[1]
    moved = row * x.shape[1] + other
    forged = np.sort(np.concatenate([pos[1:], [moved]])).astype(np.int64)

    w = StepLogWriter(str(tmp_path / "forged.vtlog"), 0, 32)
    for k, r in enumerate(records):
        if k == i:
            if len(out.dir_pos):
                order = np.argsort(np.concatenate([out.dir_pos[1:], [moved]]))
                out.dir_pos, out.dir_bits = forged, np.concatenate([out.dir_bits[1:], out.dir_bits[:1]])[order]
            else:
                order = np.argsort(np.concatenate([out.val_pos[1:], [moved]]))
                out.val_pos, out.val_bits = forged, np.concatenate([out.val_bits[1:], out.val_bits[:1]])[order]
        w.op(r.name, r.scalars, r.outputs, sum(int(np.prod(o.shape)) for o in r.outputs))
    w.close()
    with StepLogReader(str(tmp_path / "forged.vtlog"), expect_step=0, expect_bits=32) as reader:
        with step_context(WIDE, 0, reader=reader) as mode:
            _loss_step(x, target, "mean", -100, grad_scale)
    details = [s for s in mode.stats.suspicious if s.position == moved]
    assert details, "the entry on a column the loss never read is suspicious"
