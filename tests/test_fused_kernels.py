"""Fused elementwise kernels (fused.FusedKernels) with float scalars that change from call to call, as an
optimizer's step size does every step: one compiled kernel serves every value (the scalars are its arguments),
and its results and log are the eager engine's for each value."""

import pytest
import torch

from veritrain import engine, fused
from veritrain.engine import EngineConfig, step_context
from veritrain.logformat import StepLogReader, StepLogWriter

WIDE = EngineConfig(thresholds={"elementwise": 2.0**25})  # many log entries: the comparison covers them
VALUES = [-1e-3, -5.257894750684500e-3, -3.6826569121330976e-3, 0.0547448731958866]


def _ops(x, t1, t2, v):
    # AdamW's update (addcdiv with the step size) and its denominator (a division by a bias correction)
    return [x.addcdiv(t1, t2, value=v), t1 / abs(v), x.add(t1, alpha=v)]


def _run(path, compiled, monkeypatch, reader=False):
    monkeypatch.setenv("VERITRAIN_COMPILE", "1" if compiled else "0")
    g = torch.Generator().manual_seed(0)
    x, t1 = torch.randn(64, 64, generator=g), torch.randn(64, 64, generator=g)
    t2 = torch.rand(64, 64, generator=g) + 0.5
    outs = []
    for step, v in enumerate(VALUES):
        log = str(path / f"{step}.vtlog")
        if reader:
            with StepLogReader(log, expect_step=step, expect_bits=32) as r, step_context(WIDE, step, reader=r) as mode:
                outs += _ops(x, t1, t2, v)
            assert mode.stats.suspicious_count == 0
        else:
            w = StepLogWriter(log, step, 32)
            with step_context(WIDE, step, writer=w) as mode:
                outs += _ops(x, t1, t2, v)
            w.close()
            assert sum(mode.stats.entries_dir.values()) > 0  # the log bytes compared below hold decisions
    return outs


@pytest.fixture
def builds(monkeypatch):
    """(op, whether it scans) of every fused kernel built while the test runs."""
    built = []
    real_build = fused.FusedKernels._build
    monkeypatch.setattr(fused.FusedKernels, "_build",
                        lambda self, func, plan, *a: built.append((func, a[-1])) or real_build(self, func, plan, *a))
    return built


def test_a_changing_scalar_reuses_one_compiled_kernel(tmp_path, monkeypatch, builds):
    (tmp_path / "c").mkdir(), (tmp_path / "e").mkdir()
    compiled = _run(tmp_path / "c", True, monkeypatch)
    eager = _run(tmp_path / "e", False, monkeypatch)
    assert builds, "the fused kernels did not run"
    assert len(builds) == len(set(builds)), f"a kernel was built more than once per op: {builds}"
    assert all(torch.equal(a, b) for a, b in zip(compiled, eager))
    for step in range(len(VALUES)):
        assert (tmp_path / "c" / f"{step}.vtlog").read_bytes() == (tmp_path / "e" / f"{step}.vtlog").read_bytes()
    replayed = _run(tmp_path / "c", True, monkeypatch, reader=True)  # the auditor's kernels, same values
    assert all(torch.equal(a, b) for a, b in zip(replayed, compiled))
    assert len(builds) == len(set(builds))


def test_an_op_compiles_at_most_its_quota_of_kernels_then_runs_eagerly(tmp_path, monkeypatch, builds):
    """pow's exponent is baked into its kernel: an exponent that changes every call would compile every call.
    Past MAX_KERNELS_PER_OP kernels the op runs on the eager engine, with the same results and log."""
    monkeypatch.setattr(fused.FusedKernels, "MAX_KERNELS_PER_OP", 2)
    monkeypatch.setattr(engine, "_FUSED_CACHE", {})  # kernels of earlier tests in this process count too
    x = torch.rand(64, 64, generator=torch.Generator().manual_seed(1)) + 0.5
    exponents = [1.5, 2.5, 3.5, 0.75, 1.25]
    logs = {}
    for compiled in (True, False):
        monkeypatch.setenv("VERITRAIN_COMPILE", "1" if compiled else "0")
        log = str(tmp_path / f"{compiled}.vtlog")
        w = StepLogWriter(log, 0, 32)
        with step_context(WIDE, 0, writer=w):
            logs[compiled] = [x.pow(e) for e in exponents]
        w.close()
    pows = [f for f, _ in builds if f is torch.ops.aten.pow.Tensor_Scalar]
    assert len(pows) <= 2, pows
    assert all(torch.equal(a, b) for a, b in zip(logs[True], logs[False]))
    assert (tmp_path / "True.vtlog").read_bytes() == (tmp_path / "False.vtlog").read_bytes()


def test_a_kernel_compiles_once_whatever_the_callers_grad_mode(monkeypatch):
    """The engine calls its kernels below autograd, with the caller's grad mode: on in a forward, off in an
    optimizer step. torch.compile guards on it, so a kernel called in both compiled twice (fused.compile_kernel
    calls every kernel with autograd off)."""
    from torch._dynamo.utils import counters

    monkeypatch.setenv("VERITRAIN_COMPILE", "1")
    monkeypatch.setattr(engine, "_FUSED_CACHE", {})  # a kernel of its own, compiled in this test
    x = torch.rand(64, 64, generator=torch.Generator().manual_seed(2)) + 0.5
    before = counters["stats"]["unique_graphs"]
    with step_context(WIDE, 0):
        with torch.enable_grad():
            on = x.exp()
        with torch.no_grad():
            off = x.exp()
    assert torch.equal(on, off)
    assert counters["stats"]["unique_graphs"] - before == 1
