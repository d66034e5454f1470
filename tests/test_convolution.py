"""A forward convolution computed by ATen's input-gradient kernel (convolution.py): the same function as
aten.convolution within the error model, taken only where its conditions hold, and a run trained one way is
accepted by an auditor that computes the other way."""

import math

import pytest
import torch

from veritrain import convolution
from veritrain.rounding import UNIT_ROUNDOFF
from veritrain.runner import TrainOptions, audit, train

aten = torch.ops.aten


def _args(x, w, bias=None, stride=1, padding=1, dilation=1, transposed=False, groups=1):
    return (x, w, bias, [stride] * 2, padding if isinstance(padding, list) else [padding] * 2, [dilation] * 2,
            transposed, [0, 0], groups)


@pytest.mark.parametrize("n,c,o,h,w,k,pad,bias", [
    (2, 3, 5, 9, 7, (3, 3), [1, 1], True),
    (1, 4, 2, 6, 6, (3, 3), [0, 2], False),
    (3, 2, 3, 8, 11, (5, 3), [4, 0], True),
    (2, 5, 4, 5, 5, (1, 1), [0, 0], False),
    (1, 1, 1, 1, 1, (1, 1), [0, 0], True),
    (2, 64, 8, 12, 12, (3, 3), [1, 1], False),
])
def test_the_input_gradient_kernel_computes_the_convolution_within_its_error_bound(n, c, o, h, w, k, pad, bias):
    """Every output against ATen's forward kernel: the two differ by less than twice the worst-case bound of a
    sum of m terms in any order, 2 m u sum|terms| (m = c * prod(k)), so each is the convolution up to the
    error model's order freedom; and their bits differ somewhere in the largest case (another order of the
    additions, not ATen's forward kernel under another name)."""
    g = torch.Generator().manual_seed(n * 1000 + c * 100 + h)
    x = torch.randn(n, c, h, w, generator=g, dtype=torch.float64)
    wt = torch.randn(o, c, *k, generator=g, dtype=torch.float64)
    b = torch.randn(o, generator=g, dtype=torch.float64) if bias else None
    args = _args(x, wt, b, padding=pad)
    want = aten.convolution(*args)
    got = convolution.forward(*args)
    assert got.shape == want.shape and got.dtype == torch.float64
    m = c * math.prod(k)
    terms = aten.convolution(x.abs(), wt.abs(), None if b is None else b.abs(), *args[3:])
    assert ((got - want).abs() <= 2 * m * UNIT_ROUNDOFF * terms).all()
    if c == 64:
        assert (got != want).any()


def test_the_route_is_taken_only_where_its_conditions_hold(monkeypatch):
    monkeypatch.setenv("VERITRAIN_CONV_MIN_NUMEL", "0")
    x = torch.randn(2, 3, 8, 8, dtype=torch.float64)
    w = torch.randn(4, 3, 3, 3, dtype=torch.float64)
    assert convolution.routed(*_args(x, w))
    assert convolution.routed(*_args(x, w, torch.zeros(4, dtype=torch.float64), padding=[0, 2]))
    assert not convolution.routed(*_args(x, w, stride=2))
    assert not convolution.routed(*_args(x, w, dilation=2))
    assert not convolution.routed(*_args(x, w, padding=3))  # beyond the kernel's size less one
    assert not convolution.routed(*_args(x, torch.randn(3, 4, 3, 3, dtype=torch.float64), transposed=True))
    assert not convolution.routed(*_args(torch.randn(2, 4, 8, 8, dtype=torch.float64),
                                         torch.randn(4, 2, 3, 3, dtype=torch.float64), groups=2))
    assert not convolution.routed(*_args(x.float(), w.float()))  # float64 arguments only (the engine's)
    assert not convolution.routed(*_args(x, w, torch.zeros(4)))  # a float32 bias
    assert not convolution.routed(*_args(torch.randn(2, 3, 2, 2, dtype=torch.float64), w, padding=0))  # no output
    assert not convolution.routed(torch.randn(2, 3, 8, dtype=torch.float64), torch.randn(4, 3, 3, dtype=torch.float64),
                                  None, [1], [1], [1], False, [0], 1)  # 1-d: not measured
    # by size: one sample's unfolded patches, 3 channels x 9 x 64 output positions
    monkeypatch.setenv("VERITRAIN_CONV_MIN_NUMEL", str(3 * 9 * 64))
    assert convolution.routed(*_args(x, w))
    monkeypatch.setenv("VERITRAIN_CONV_MIN_NUMEL", str(3 * 9 * 64 + 1))
    assert not convolution.routed(*_args(x, w))
    monkeypatch.delenv("VERITRAIN_CONV_MIN_NUMEL")
    assert not convolution.routed(*_args(x, w))  # the default threshold
    assert convolution.routed(*_args(torch.randn(1, 64, 32, 32, dtype=torch.float64),
                                     torch.randn(8, 64, 3, 3, dtype=torch.float64)))  # ResNet-18's first layers


def test_a_run_trained_by_one_kernel_is_accepted_by_an_auditor_on_the_other(tmp_path, monkeypatch):
    """digits-cnn's two convolutions (with biases) by the input-gradient kernel in the trainer, by ATen's forward
    kernel in the auditor, and the other way round: both audits accept, and the two kernels' float64 results
    differed (so the logs had real disagreement to cover, not two names for one computation)."""
    taken, differed = [], []
    orig = convolution.forward

    def spy(*args):
        y = orig(*args)
        taken.append(1)
        differed.append(bool((y != aten.convolution(*args)).any()))
        return y

    monkeypatch.setattr(convolution, "forward", spy)
    runs = {}
    for name, threshold in (("route", "0"), ("aten", str(1 << 62))):
        monkeypatch.setenv("VERITRAIN_CONV_MIN_NUMEL", threshold)
        before = len(taken)
        runs[name] = tmp_path / name
        train(TrainOptions(task="digits-cnn", out=str(runs[name]), steps=3, checkpoint_every=3, progress=False))
        assert (len(taken) > before) == (name == "route")
    assert any(differed)
    for run, auditor in (("route", str(1 << 62)), ("aten", "0")):
        monkeypatch.setenv("VERITRAIN_CONV_MIN_NUMEL", auditor)
        r = audit(str(runs[run]), progress=False)
        assert r.accepted and r.suspicious == 0, (run, r.suspicious_details[:3])
