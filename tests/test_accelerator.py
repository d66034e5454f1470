"""The emulated accelerator (``reorder``) and the worst-case auditor (``perturb``): accelerator.py.

Both must really disagree with this CPU (a check that cannot fail proves nothing) and must stay inside
the error model the thresholds are built on (or the log could not cover them)."""

import math
from fractions import Fraction

import numpy as np
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from veritrain import accelerator, rules
from veritrain.engine import EngineConfig, OpTrace, _named, step_context
from veritrain.logformat import StepLogReader, StepLogWriter
from veritrain.rounding import UNIT_ROUNDOFF

aten = torch.ops.aten
finite = st.floats(min_value=-1e30, max_value=1e30, allow_nan=False, allow_infinity=False)


@settings(max_examples=300, deadline=None)
@given(finite, finite, finite)
def test_fma_rounds_once(a, b, c):
    got = accelerator.fma(torch.tensor([a], dtype=torch.float64), torch.tensor([b], dtype=torch.float64),
                          torch.tensor([c], dtype=torch.float64)).item()
    exact = Fraction(a) * Fraction(b) + Fraction(c)
    # within half an ulp of the exact result (a correctly rounded FMA), up to the last bit
    assert abs(Fraction(got) - exact) <= Fraction(math.ulp(got)) * Fraction(1, 2) * Fraction(1025, 1024) \
        or abs(Fraction(got) - exact) <= Fraction(math.ulp(abs(float(exact)) or 5e-324))


def _scale(func, args, kwargs, y):
    rule = rules.lookup(func, _named(func, args, kwargs))
    s = rules.scale_for(rule, rules.Call(func, args, kwargs, [y]))[0]
    return rules.materialize_scale(s, y), rule.op_class


def _cases():
    g = torch.Generator().manual_seed(0)

    def r(*shape):  # operands are grid values, as inside a step, over a range of binades (else sums are exact)
        return (torch.randn(*shape, generator=g) * 2.0 ** torch.randint(-20, 20, shape, generator=g)).double()

    def n(*shape):  # arguments of library functions
        return torch.randn(*shape, generator=g).double() * 4

    return [
        (aten.mm.default, (r(64, 300), r(300, 40)), {}),
        (aten.addmm.default, (r(40), r(64, 300), r(300, 40)), {}),
        (aten.bmm.default, (r(3, 16, 200), r(3, 200, 8)), {}),
        (aten.sum.dim_IntList, (r(8, 100, 33), [1, 2]), {}),
        (aten.sum.default, (r(5000),), {}),
        (aten.mean.dim, (r(8, 100, 33), [0]), {"keepdim": True}),
        (aten.convolution.default, (r(4, 8, 12, 12), r(16, 8, 3, 3), r(16), [1, 1], [1, 1], [1, 1], False, [0, 0], 1), {}),
        (aten.addcmul.default, (r(5000), r(5000), r(5000)), {"value": 0.001}),
        (aten.addcdiv.default, (r(5000), r(5000), r(5000).abs() + 0.1), {"value": 0.01}),
        (aten.lerp.Scalar, (r(5000), r(5000), 0.1), {}),
        (aten.add.Tensor, (r(5000), r(5000)), {"alpha": 0.3}),
        (aten.exp.default, (n(5000),), {}),
        (aten.tanh.default, (n(5000),), {}),
        (aten.gelu.default, (n(5000),), {}),
    ]


@pytest.mark.parametrize("func,args,kwargs", _cases(), ids=lambda x: str(x) if hasattr(x, "_schema") else "")
def test_reorder_disagrees_with_this_cpu_inside_the_error_scales(func, args, kwargs):
    cpu = func(*args, **kwargs)
    emulated = accelerator.reorder_kernel(func)(*args, **kwargs)
    assert emulated.shape == cpu.shape and emulated.dtype == torch.float64
    differing = (emulated != cpu).double().mean().item()
    assert differing > 0.001, f"{func}: the emulated accelerator computes the same bits as this CPU"
    scale, op_class = _scale(func, args, kwargs, cpu)
    diff = (emulated - cpu).abs()
    assert bool((diff[scale == 0] == 0).all()), f"{func}: a certified-exact result changed"
    ratio = (diff / (UNIT_ROUNDOFF * scale))[scale > 0].max().item()
    c = rules.DEFAULT_THRESHOLDS[op_class]
    # a realistic accelerator stays well inside the threshold (measured margins: docs/ROUNDING.md)
    assert ratio <= c / 4, f"{func}: difference {ratio:.3g} u*scale, threshold {c}"


def test_convolution_backward_reorders_all_three_gradients():
    g = torch.Generator().manual_seed(1)
    x, w = torch.randn(8, 6, 10, 10, generator=g, dtype=torch.float64), torch.randn(12, 6, 3, 3, generator=g,
                                                                                     dtype=torch.float64)
    go = torch.randn(8, 12, 10, 10, generator=g, dtype=torch.float64)
    args = (go, x, w, [12], [1, 1], [1, 1], [1, 1], False, [0, 0], 1, [True, True, True])
    cpu = aten.convolution_backward.default(*args)
    emu = accelerator.reorder_kernel(aten.convolution_backward.default)(*args)
    for a, b in zip(cpu, emu):
        assert a.shape == b.shape and not torch.equal(a, b)
        assert torch.allclose(a, b, rtol=1e-12, atol=1e-12)


def test_other_libm_is_faithful_and_deterministic():
    y = torch.exp(torch.linspace(-20, 20, 100001, dtype=torch.float64))
    z = accelerator._other_libm(y)
    ulps = ((z - y).abs() / torch.from_numpy(np.spacing(y.numpy()))).max().item()
    assert ulps <= 1 and 0.15 < (z != y).double().mean().item() < 0.35
    assert torch.equal(z, accelerator._other_libm(y.clone()))


def test_perturb_stays_within_the_bound_and_repeats_with_its_key():
    g = torch.Generator().manual_seed(2)
    y = torch.randn(100000, generator=g, dtype=torch.float64) * torch.logspace(-20, 20, 100000, dtype=torch.float64)
    scale = y.abs() * 3
    c = 8.0
    a = accelerator.perturb(y, scale, c, ("op", 0, 1, 0))
    bound = accelerator.PERTURB_FRACTION * c * UNIT_ROUNDOFF * scale
    assert bool(((a - y).abs() <= bound).all())
    assert ((a - y).abs() / bound).max().item() > 0.8  # it uses the room it has
    assert torch.equal(a, accelerator.perturb(y, scale, c, ("op", 0, 1, 0)))
    assert not torch.equal(a, accelerator.perturb(y, scale, c, ("op", 0, 2, 0)))
    zero = accelerator.perturb(y, torch.zeros_like(y), c, ("op", 0, 1, 0))  # certified-exact results stay put
    assert torch.equal(zero, y)


def test_unknown_emulation_is_refused(monkeypatch):
    monkeypatch.setenv("VERITRAIN_EMULATE", "warp-drive")
    with pytest.raises(ValueError, match="warp-drive"):
        accelerator.active()


# --- the log is needed, and sufficient, against the worst hardware the error model allows ---------------


def _mlp():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 256), nn.Tanh(), nn.Linear(256, 256), nn.GELU(), nn.Linear(256, 10))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3)


def _train(tmp_path, logs=None, record=False):
    """Three steps; trainer (record=True) writes logs, auditor replays ``logs`` (or none: float64 + rounding
    without a log). Returns the final weights, the steps' stats and every op's output digests."""
    model, opt = _mlp()
    g = torch.Generator().manual_seed(0)
    stats, outputs = [], []
    for step in range(3):
        x, y = torch.randn(128, 64, generator=g), torch.randint(0, 10, (128,), generator=g)
        path = str(tmp_path / f"step{step}.vtlog")
        writer = StepLogWriter(path, step, 32) if record else None
        reader = StepLogReader(logs[step], expect_step=step) if logs else None
        with step_context(EngineConfig(bits=32, seed=0), step, writer=writer, reader=reader, trace=OpTrace()) as mode:
            opt.zero_grad()
            F.cross_entropy(model(x), y).backward()
            opt.step()
        if writer:
            writer.close()
        stats.append(mode.stats)
        outputs += [e["outputs"] for e in mode.trace.entries]
    return [p.detach().clone() for p in model.parameters()], stats, outputs, \
        [str(tmp_path / f"step{s}.vtlog") for s in range(3)]


def test_worst_case_auditor_needs_the_log_and_the_log_suffices(tmp_path, monkeypatch):
    """The trainer runs on this CPU; the auditor under ``perturb`` moves every approximate result by up to
    0.9 x its threshold. With the trainer's log it reaches the same bits (after real corrections); ignoring
    the log, it does not. Fails if the auditor ignores the log, or if the trainer logs too little."""
    trained, t_stats, t_out, logs = _train(tmp_path, record=True)
    assert sum(s.entries_total for s in t_stats) > 0
    monkeypatch.setenv("VERITRAIN_EMULATE", "perturb")
    replayed, a_stats, a_out, _ = _train(tmp_path, logs=logs)
    assert sum(s.corrections_total for s in a_stats) > 0, "perturb never crossed a midpoint: the check is vacuous"
    assert sum(s.suspicious_count for s in a_stats) == 0
    assert a_out == t_out  # every op's output, bit for bit
    assert all(torch.equal(a, b) for a, b in zip(trained, replayed))
    _, _, u_out, _ = _train(tmp_path, logs=None)
    differ = sum(a != b for a, b in zip(t_out, u_out))
    assert differ > 0, "without the log the worst-case auditor still computed every op's bits"
