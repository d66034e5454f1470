"""Fused elementwise kernels (fused.FusedKernels) with float scalars that change from call to call, as an
optimizer's step size does every step: one compiled kernel serves every value (the scalars are its arguments),
and its results and log are the eager engine's for each value."""

import os
import re

import pytest
import torch

from veritrain import engine, fused, hardware
from veritrain.engine import EngineConfig, step_context
from veritrain.logformat import StepLogReader, StepLogWriter, read_records, write_records

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


@pytest.fixture(autouse=True)
def own_kernels(monkeypatch):
    """Each test here compiles its own fused kernels. An op's quota (MAX_KERNELS_PER_OP) counts every kernel the
    process built for it at one threshold and role, so kernels of tests run earlier in the same worker (another
    structure, the same threshold) could use it up, and a test that asserts its kernels ran would find the eager
    engine instead."""
    monkeypatch.setattr(engine, "_FUSED_CACHE", {})


@pytest.fixture
def builds(monkeypatch):
    """(op, (whether it scans, the operand it writes in place)) of every fused kernel built while the test runs."""
    built = []
    real_build = fused.FusedKernels._build
    monkeypatch.setattr(fused.FusedKernels, "_build",
                        lambda self, func, plan, scale_fn, c, want, into=None:
                        built.append((func, (want, into))) or real_build(self, func, plan, scale_fn, c, want, into))
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


def test_an_ops_quota_is_counted_per_threshold_and_role(tmp_path, monkeypatch, builds):
    """A process that trains and audits under several thresholds (a calibration, a sweep, a notebook) builds an
    op's kernels for each threshold and role: each is within its own quota, so none runs eagerly for want of
    the others'. (Counted per op, the third threshold's kernel here was never built.)"""
    monkeypatch.setattr(fused.FusedKernels, "MAX_KERNELS_PER_OP", 2)
    monkeypatch.setenv("VERITRAIN_COMPILE", "1")
    x = torch.rand(64, 64, generator=torch.Generator().manual_seed(3)) + 0.5
    thresholds = [2.0**20, 2.0**22, 2.0**25]
    for c in thresholds:
        config = EngineConfig(thresholds={"elementwise": c})
        log = str(tmp_path / f"{c}.vtlog")
        w = StepLogWriter(log, 0, 32)
        with step_context(config, 0, writer=w):
            trained = [x.exp(), x.pow(1.5), x.pow(2.5)]
        w.close()
        with StepLogReader(log, expect_step=0, expect_bits=32) as r, step_context(config, 0, reader=r) as mode:
            audited = [x.exp(), x.pow(1.5), x.pow(2.5)]
        assert mode.stats.suspicious_count == 0 and all(map(torch.equal, trained, audited))
    exps = [how for f, how in builds if f is torch.ops.aten.exp.default]
    assert sorted(exps) == sorted([(True, None), (False, None)] * len(thresholds)), exps
    pows = [how for f, how in builds if f is torch.ops.aten.pow.Tensor_Scalar]
    assert len(pows) == 2 * 2 * len(thresholds), pows  # two exponents, each role, each threshold


def test_a_kernel_compiles_once_whatever_the_callers_grad_mode(monkeypatch):
    """The engine calls its kernels below autograd, with the caller's grad mode: on in a forward, off in an
    optimizer step. torch.compile guards on it, so a kernel called in both compiled twice (fused.compile_kernel
    calls every kernel with autograd off)."""
    from torch._dynamo.utils import counters

    monkeypatch.setenv("VERITRAIN_COMPILE", "1")
    monkeypatch.setattr(engine, "_FUSED_CACHE", {})  # a kernel of its own, compiled in this test
    x = torch.rand(64, 64, generator=torch.Generator().manual_seed(2)) + 0.5
    assert hardware.compiled_path(x.numel(), x.device, "VERITRAIN_COMPILE_MIN_NUMEL", 1)  # its compiler check: before
    before = counters["stats"]["unique_graphs"]
    with step_context(WIDE, 0):
        with torch.enable_grad():
            on = x.exp()
        with torch.no_grad():
            off = x.exp()
    assert torch.equal(on, off)
    assert counters["stats"]["unique_graphs"] - before == 1


FOREACH = {  # the optimizers' foreach updates that engine._FOREACH_AS_SINGLE computes by a single op's kernel
    "add.List": lambda xs, t1, t2: torch._foreach_add_(xs, t1, alpha=-0.0123),
    "lerp.Scalar": lambda xs, t1, t2: torch._foreach_lerp_(xs, t1, 0.1),
    "addcmul.Scalar": lambda xs, t1, t2: torch._foreach_addcmul_(xs, t1, t2, 0.001),
    "addcdiv.ScalarList": lambda xs, t1, t2: torch._foreach_addcdiv_(xs, t1, t2, [-3e-3 * (k + 1) for k in range(len(xs))]),
    "sqrt": lambda xs, t1, t2: torch._foreach_sqrt_(xs),
    "div.ScalarList": lambda xs, t1, t2: torch._foreach_div_(xs, [0.3 + k for k in range(len(xs))]),
}


def _foreach_operands(seed, sizes, name):
    """(xs, t1, t2) for a foreach op: normal starts (positive for sqrt), normal t1, t2 in [0.5, 1.5)."""
    g = torch.Generator().manual_seed(seed)
    xs = [torch.randn(s, generator=g) for s in sizes]
    if name == "sqrt":
        xs = [x.abs() for x in xs]
    return xs, [torch.randn(s, generator=g) for s in sizes], [torch.rand(s, generator=g) + 0.5 for s in sizes]


def _trained_both_ways(tmp_path, monkeypatch, update, xs0, t1, t2):
    """compile mode -> (the updated tensors, the log's bytes), for the compiled paths ("auto") and the eager
    engine ("0")."""
    runs = {}
    for compile_mode in ("auto", "0"):
        monkeypatch.setenv("VERITRAIN_COMPILE", compile_mode)
        xs = [x.clone() for x in xs0]
        path = tmp_path / f"{compile_mode}.vtlog"
        with engine.logged_step(WIDE, 0, writer=StepLogWriter(str(path), 0, 32)):
            update(xs, t1, t2)
        runs[compile_mode] = (xs, path.read_bytes())
    return runs


@pytest.mark.parametrize("name", FOREACH)
def test_a_foreach_updates_large_tensors_by_the_single_ops_kernel_with_the_eager_log(tmp_path, monkeypatch, name):
    """A foreach op's large tensors go through their single-tensor op's fused kernel, its small ones through
    that op eagerly; the results and the log's bytes must be the eager foreach op's (VERITRAIN_COMPILE=0),
    with many entries in both kinds of output."""
    monkeypatch.setenv("VERITRAIN_COMPILE_MIN_NUMEL", "4096")
    xs0, t1, t2 = _foreach_operands(1, [(64, 100), (7,), (5000,), (3, 3, 3), (80, 80)], name)
    fused_slots = []
    real = engine.VerifiedMode._fused_slot
    monkeypatch.setattr(engine.VerifiedMode, "_fused_slot",
                        lambda self, *a: (lambda slot: fused_slots.append(slot) or slot)(real(self, *a)))
    runs = _trained_both_ways(tmp_path, monkeypatch, FOREACH[name], xs0, t1, t2)
    assert sum(s is not None for s in fused_slots) == 3, fused_slots  # the three large tensors, compiled
    assert all(torch.equal(a, b) for a, b in zip(runs["auto"][0], runs["0"][0]))
    assert runs["auto"][1] == runs["0"][1]
    with StepLogReader(str(tmp_path / "auto.vtlog"), expect_step=0) as r:
        entries = [o.n_entries for o in r.next_op().outputs]
    assert entries[0] > 0 and entries[1] + entries[3] > 0, entries  # a large output's and a small one's


PACKED = {  # as FOREACH, the ScalarList variants' values repeating (the tensors of each value are packed together)
    **FOREACH,
    "addcdiv.ScalarList": lambda xs, t1, t2: torch._foreach_addcdiv_(xs, t1, t2, [-3e-3 * (k % 2 + 1) for k in range(len(xs))]),
    "div.ScalarList": lambda xs, t1, t2: torch._foreach_div_(xs, [0.3 + k % 2 for k in range(len(xs))]),
    "add.List, not in place": lambda xs, t1, t2: [x.copy_(y) for x, y in zip(xs, torch._foreach_add(xs, t1, alpha=0.37))],
}


@pytest.mark.parametrize("min_numel", ["4096", "65536"])
@pytest.mark.parametrize("name", PACKED)
def test_a_foreach_ops_small_tensors_laid_end_to_end_give_the_eager_results_and_log(tmp_path, monkeypatch, name,
                                                                                     min_numel):
    """A foreach op's small tensors are computed as one (engine._packed_groups): by the single op's kernel where
    the group reaches the compile threshold (4096 here), eagerly below it. Each tensor's results and the log's
    bytes must be the eager foreach op's, tensor by tensor (VERITRAIN_COMPILE=0), with entries in several
    small tensors; and each run's auditor, packed or not, must replay the other's log to the same bits."""
    monkeypatch.setenv("VERITRAIN_COMPILE_MIN_NUMEL", min_numel)
    sizes = [(7,), (64, 100), (3, 3, 3), (40, 60), (3000,), (16,), (1200,), (2, 900)]  # (64, 100) alone is large
    xs0, t1, t2 = _foreach_operands(2, sizes, name)
    parts = []
    real = engine._PartSlot.__init__
    monkeypatch.setattr(engine._PartSlot, "__init__",
                        lambda self, whole, *a: parts.append(type(whole)) or real(self, whole, *a))
    runs = _trained_both_ways(tmp_path, monkeypatch, PACKED[name], xs0, t1, t2)
    whole = engine._FusedSlot if min_numel == "4096" else engine._EagerSlot
    assert len(parts) >= 4 and set(parts) == {whole}, parts
    assert all(torch.equal(a, b) for a, b in zip(runs["auto"][0], runs["0"][0]))
    assert runs["auto"][1] == runs["0"][1]
    with StepLogReader(str(tmp_path / "auto.vtlog"), expect_step=0) as r:
        entries = [o.n_entries for o in r.next_op().outputs]
    assert sum(e > 0 for i, e in enumerate(entries) if i != 1) >= 4, entries
    for compile_mode, log in (("auto", "0"), ("0", "auto")):
        monkeypatch.setenv("VERITRAIN_COMPILE", compile_mode)
        xs = [x.clone() for x in xs0]
        with StepLogReader(str(tmp_path / f"{log}.vtlog"), expect_step=0) as r, \
                engine.step_context(WIDE, 0, reader=r) as mode:
            PACKED[name](xs, t1, t2)
        assert mode.stats.suspicious_count == 0
        assert all(torch.equal(a, b) for a, b in zip(xs, runs["0"][0]))


def test_a_foreach_ops_results_have_memory_of_their_own(monkeypatch):
    """Packed tensors' results are views of one buffer inside the engine; the op hands back tensors that share
    memory with nothing, as torch's do."""
    monkeypatch.setenv("VERITRAIN_COMPILE", "auto")
    xs, ys = [torch.randn(5), torch.randn(3, 4)], [torch.randn(5), torch.randn(3, 4)]
    with engine.logged_step(EngineConfig(), 0):
        out = torch._foreach_add(xs, ys, alpha=0.5)
    assert len({t.untyped_storage().data_ptr() for t in out}) == 2
    assert all(t.storage_offset() == 0 and t.is_contiguous() for t in out)


def test_every_generated_kernel_has_its_own_source_for_torch_compile(tmp_path, monkeypatch):
    """torch.compile before 2.13 wrapped each function without a source file in one shared wrapper, so every
    kernel drew on one recompile budget: past the eighth, all fell back to eager ops (torch 2.11, seen on the
    GPU machine's CPU). Every function the engine compiles has its generated source registered."""
    import inspect

    for table in ("_FUSED_CACHE", "_EPILOGUE_CACHE", "_SUMS_CACHE"):  # kernels built by earlier tests: built anew
        monkeypatch.setattr(engine, table, {})
    monkeypatch.setattr(fused, "REDUCTIONS", {})
    monkeypatch.setattr(fused, "SQUARES", {})
    compiled = []
    real_compile = torch.compile
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: compiled.append(fn) or real_compile(fn, **kw))
    _run(tmp_path, True, monkeypatch)
    with step_context(WIDE, 0):  # a fused reduction kernel too (the error scale of a large sum)
        torch.randn(300, 300, generator=torch.Generator().manual_seed(1)).sum(dim=1)
    assert len(compiled) >= 3, compiled
    for fn in compiled:
        name = inspect.getsourcefile(fn)
        assert name and name.startswith("<veritrain"), (fn, name)
        assert f"def {fn.__name__}(" in inspect.getsource(fn)
    names = [inspect.getsourcefile(fn) for fn in compiled]
    assert len(set(names)) == len(names), names  # one name, one source


def test_two_generated_sources_under_one_name_keep_their_own_lines():
    import inspect

    a = fused.define("def kernel(x):\n    return x + 1\n", "<veritrain same name>", {})["kernel"]
    b = fused.define("def kernel(x):\n    return x - 1\n", "<veritrain same name>", {})["kernel"]
    assert "x + 1" in inspect.getsource(a) and "x - 1" in inspect.getsource(b)
    again = fused.define("def kernel(x):\n    return x + 1\n", "<veritrain same name>", {})["kernel"]
    assert inspect.getsourcefile(again) == inspect.getsourcefile(a)


def _lerp_tensors(shape=(64, 64)):
    """(starts, ends) for lerp with weight 0.5, (start + end) / 2 exactly in float64: the first pair's ends are
    neighbouring float32 values, so every result is a midpoint and has a log entry; the second's end is about
    2**-23 of its start, so the result's 23 bits below the float32 grid come from the end and put it near a
    midpoint about once in millions (no entry)."""
    g = torch.Generator().manual_seed(4)
    a, c = torch.rand(shape, generator=g) + 1.0, torch.rand(shape, generator=g) + 1.0
    return [a, c], [torch.nextafter(a, torch.full_like(a, 2.0)), (torch.rand(shape, generator=g) + 1.0) * 1e-7]


def test_an_in_place_op_writes_its_result_where_its_operand_is(tmp_path, monkeypatch, builds):
    """An in-place op (an optimizer's foreach update) on a tensor that shares memory with no operand: its kernel
    writes the rounded result into the tensor itself, no float32 result allocated and copied back (AdamW's
    foreach updates of GPT-2 117M took the auditor 2x plain float64 before, about 1x after). The trainer's
    kernel leaves the old values at its candidates (here every value of the first tensor: all are midpoints),
    evaluates them again from the operands and writes them; the auditor's writes in place where the log has
    no entry, and an output with entries takes the kernel that leaves its operand alone (the entries are
    applied and checked from its old values). Both give the eager engine's bits and log."""
    monkeypatch.setattr(engine, "_FUSED_CACHE", {})
    starts, ends = _lerp_tensors()
    runs = {}
    for compile_mode in ("1", "0"):
        monkeypatch.setenv("VERITRAIN_COMPILE", compile_mode)
        trained = [t.clone() for t in starts]
        w = StepLogWriter(str(tmp_path / f"{compile_mode}.vtlog"), 0, 32)
        with step_context(EngineConfig(), 0, writer=w) as mode:
            torch._foreach_lerp_(trained, ends, 0.5)
        w.close()
        runs[compile_mode] = (trained, (tmp_path / f"{compile_mode}.vtlog").read_bytes())
    assert mode.stats.entries_dir["optimizer"] + mode.stats.entries_dir["forward"] >= 64 * 64  # the midpoints
    assert all(torch.equal(a, b) for a, b in zip(runs["1"][0], runs["0"][0]))
    assert runs["1"][1] == runs["0"][1]
    monkeypatch.setenv("VERITRAIN_COMPILE", "1")
    audited = [t.clone() for t in starts]
    with StepLogReader(str(tmp_path / "1.vtlog"), expect_step=0, expect_bits=32) as r:
        with step_context(EngineConfig(), 0, reader=r) as mode:
            torch._foreach_lerp_(audited, ends, 0.5)
    assert mode.stats.suspicious_count == 0
    assert all(torch.equal(a, t) for a, t in zip(audited, runs["1"][0]))
    lerps = [how for f, how in builds if f is torch.ops.aten.lerp.Scalar]
    assert (True, 0) in lerps and (True, None) not in lerps, lerps  # the trainer's, in place
    assert (False, 0) in lerps and (False, None) in lerps, lerps  # the auditor's: in place, and not


def test_a_trainer_that_drops_an_in_place_outputs_entries_and_trains_on_the_other_rounding_is_caught(
        tmp_path, monkeypatch, builds):
    """The attacker's side of the auditor's in-place kernels: a trainer that rounds the midpoints of a foreach
    update the other way (as if on hardware that disagrees) and drops their log entries. The output then has
    no entries, so the auditor's kernel writes its own rounding of every value into the tensor, and its
    weights differ from the trainer's at every dropped entry: the checkpoint hashes disagree. An auditor
    kernel that left its tensor's old values where it found candidates (as the trainer's does, for _record to
    fill in) would be caught here too: its bits would not be the eager engine's."""
    monkeypatch.setattr(engine, "_FUSED_CACHE", {})
    monkeypatch.setenv("VERITRAIN_COMPILE", "1")
    starts, ends = _lerp_tensors()
    honest = [t.clone() for t in starts]
    w = StepLogWriter(str(tmp_path / "honest.vtlog"), 0, 32)
    with step_context(EngineConfig(), 0, writer=w):
        torch._foreach_lerp_(honest, ends, 0.5)
    w.close()
    step, bits, ops = read_records(str(tmp_path / "honest.vtlog"))
    (first,) = [o for op in ops for o in op.outputs if o.n_entries == starts[0].numel()]  # every value a midpoint
    assert len(first.dir_pos) == starts[0].numel()
    first.dir_pos, first.dir_bits = first.dir_pos[:0], first.dir_bits[:0]  # dropped
    write_records(str(tmp_path / "dropped.vtlog"), step, bits, ops)
    # the trainer's weights: the other neighbour of every midpoint
    claimed = torch.where(honest[0] == starts[0], ends[0], starts[0])
    assert not torch.equal(claimed, honest[0]) and torch.equal(claimed.double() + honest[0].double(),
                                                                starts[0].double() + ends[0].double())

    audited = {}
    for compile_mode in ("1", "0"):
        monkeypatch.setenv("VERITRAIN_COMPILE", compile_mode)
        replay = [t.clone() for t in starts]
        with StepLogReader(str(tmp_path / "dropped.vtlog"), expect_step=0, expect_bits=32) as r:
            with step_context(EngineConfig(), 0, reader=r) as mode:
                torch._foreach_lerp_(replay, ends, 0.5)
        assert mode.stats.suspicious_count == 0  # no entry to judge: the weights tell
        audited[compile_mode] = replay
    assert (False, 0) in [how for f, how in builds if f is torch.ops.aten.lerp.Scalar]  # the auditor wrote in place
    assert all(torch.equal(a, b) for a, b in zip(audited["1"], audited["0"]))  # = the eager engine
    assert torch.equal(audited["1"][0], honest[0])  # its own rounding (no entry said otherwise)...
    assert (audited["1"][0] != claimed).all()  # ...so every dropped entry shows in the weights
    assert torch.equal(audited["1"][1], honest[1])


def test_a_foreach_op_on_tensors_that_are_each_others_operands_updates_each_from_the_old_values(tmp_path,
                                                                                              monkeypatch):
    """_foreach_add_([a, b], [b, a]): written in place kernel by kernel, b's update would read the new a. The
    engine evaluates every update from the old values, compiled or not: the fused path writes such tensors
    through a fresh result, and gives the eager engine's bits and log, trainer and auditor."""
    g = torch.Generator().manual_seed(5)
    pair = [torch.randn(64, 64, generator=g), torch.randn(64, 64, generator=g)]
    runs = {}
    for compile_mode in ("1", "0"):
        monkeypatch.setenv("VERITRAIN_COMPILE", compile_mode)
        a, b = (t.clone() for t in pair)
        log = tmp_path / f"{compile_mode}.vtlog"
        w = StepLogWriter(str(log), 0, 32)
        with step_context(WIDE, 0, writer=w):
            torch._foreach_add_([a, b], [b, a], alpha=0.25)
        w.close()
        runs[compile_mode] = (a, b, log.read_bytes())
    assert torch.equal(runs["0"][0], (pair[0].double() + 0.25 * pair[1].double()).float())  # from the old b
    assert torch.equal(runs["0"][1], (pair[1].double() + 0.25 * pair[0].double()).float())  # from the old a
    assert torch.equal(runs["1"][0], runs["0"][0]) and torch.equal(runs["1"][1], runs["0"][1])
    assert runs["1"][2] == runs["0"][2]
    a, b = (t.clone() for t in pair)
    with StepLogReader(str(tmp_path / "1.vtlog"), expect_step=0, expect_bits=32) as r:
        with step_context(WIDE, 0, reader=r) as mode:
            torch._foreach_add_([a, b], [b, a], alpha=0.25)
    assert mode.stats.suspicious_count == 0
    assert torch.equal(a, runs["0"][0]) and torch.equal(b, runs["0"][1])


def test_a_log_of_another_shape_leaves_the_tensor_of_an_in_place_op_unchanged(tmp_path, monkeypatch):
    """The auditor writes in place only where the log's output has the tensor's shape: a log of other shapes
    is refused (ReplayMismatchError, as always) before anything is written over the tensor."""
    monkeypatch.setenv("VERITRAIN_COMPILE", "1")
    starts, ends = _lerp_tensors()
    w = StepLogWriter(str(tmp_path / "0.vtlog"), 0, 32)
    with step_context(EngineConfig(), 0, writer=w):
        torch._foreach_lerp_([t.clone() for t in starts], ends, 0.5)
    w.close()
    other = [t.clone().view(32, 128) for t in starts]  # the same values and sizes, another shape
    before = [t.clone() for t in other]
    with StepLogReader(str(tmp_path / "0.vtlog"), expect_step=0, expect_bits=32) as r:
        with pytest.raises(engine.ReplayMismatchError, match="shapes"):
            with step_context(EngineConfig(), 0, reader=r):
                torch._foreach_lerp_(other, [e.view(32, 128) for e in ends], 0.5)
    assert all(torch.equal(a, b) for a, b in zip(other, before))


ROUND_TRIP = """
import sys, torch
from veritrain import fused  # before anything is compiled: the ISA's cache and compiler target
y = torch.linspace(-3.0, 3.0, 4099, dtype=torch.float64) / 3.0  # most values between float32 grid points
k = fused.compile_kernel(lambda y: fused._round_to_grid(y, 0, 29, 1 << 28, (1 << 29) - 1, 2.0 ** -149).to(torch.float64))
print(int((k(y) != y.to(torch.float32).to(torch.float64)).sum()))
"""


@pytest.mark.parametrize("variant", ["isa-avx2", "isa-default", "native"])
def test_compiled_code_under_every_vector_isa_rounds_to_float32_and_back_again(tmp_path, variant):
    """The kernels' code for each emulated vector ISA rounds a float64 value to float32 and back as a machine
    with that ISA does. torch.compile compiled AVX2 code with -march=native: on an AVX-512 machine (GCC 12,
    torch 2.13) it returned the float64 values unchanged through the round trip, so a captured softmax summed
    unrounded values and honest runs failed their audits under isa-avx2 (fused.ISA_TARGETS). On a machine
    without AVX-512 the native code is the AVX2 code, and this holds either way."""
    import os
    import subprocess
    import sys

    from veritrain.hardware import KNOBS, variant_env

    env = {k: v for k, v in os.environ.items() if k not in KNOBS and not k.startswith("VERITRAIN_COMPILE")}
    env.update(variant_env(variant))
    env["VERITRAIN_COMPILE_CACHE"] = str(tmp_path)  # compiled here, not loaded from another test's cache
    p = subprocess.run([sys.executable, "-c", ROUND_TRIP], capture_output=True, text=True, env=env, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    assert p.stdout.split()[-1] == "0", f"{variant}: {p.stdout.split()[-1]} of 4099 values not rounded"


# torch 2.11's inductor, in this torch: its joint-graph pattern pointless_convert without the guard 2.13 added
# ("a narrower intermediate can be worth materializing before upcasting"), so that a float64 -> float32 -> float64
# chain becomes one conversion, float64 to float64
INDUCTOR_BEFORE_2_13 = """
import sys, torch
import torch._inductor.fx_passes.joint_graph as joint_graph
def pointless_convert(match, arg, dtype1, dtype2):
    graph, node = match.graph, match.output_node()
    allowed = torch.float16, torch.bfloat16, torch.float32, torch.float64
    if not isinstance(arg.meta.get("val", None), torch.Tensor) or arg.meta["val"].dtype not in allowed:
        return
    if dtype1 in allowed and dtype2 in allowed:
        repl = graph.call_function(torch.ops.prims.convert_element_type.default, (arg, dtype2))
        repl.meta.update(node.meta)
        node.replace_all_uses_with(repl)
        match.erase_nodes()
joint_graph.pointless_convert.__code__ = pointless_convert.__code__  # the registered pattern calls this function

y = torch.linspace(-3.0, 3.0, 4099, dtype=torch.float64) / 3.0
dropped = torch.compile(lambda y: y.to(torch.float32).to(torch.float64), dynamic=True)(y)
print("round trips dropped by plain torch.compile:", int((dropped == y).sum()))
from veritrain import fused
print("compiler check:", fused.compiled_code_rounds())
sys.path.insert(0, sys.argv[1])
import compiled_conformance
for row in compiled_conformance.check(torch.device("cpu"), ["exp", "softmax (region)", "log-softmax (region)"]):
    print(row["op"], "differ:", row.get("differ", row.get("error")), "same log:", row.get("same_log"))
"""


def test_the_kernels_keep_their_roundings_where_inductor_drops_float32_round_trips(tmp_path):
    """Before torch 2.13 one of inductor's pattern passes rewrote x.to(float32).to(float64) as no conversion: on
    the GPU machine (torch 2.11), on its CPU and its GPU, the compiler check got every value back unrounded and
    a captured log-softmax left the eager bits. The kernels and regions compile without those passes
    (fused.KEEP_ROUNDINGS); here that old pass is put back into this torch, and the compiler check passes and the
    regions give the eager engine's bits and log."""
    import os
    import subprocess
    import sys

    from veritrain.hardware import KNOBS

    env = {k: v for k, v in os.environ.items() if k not in KNOBS and not k.startswith("VERITRAIN_COMPILE")}
    env.update(VERITRAIN_COMPILE_CACHE=str(tmp_path), TORCHINDUCTOR_FORCE_DISABLE_CACHES="1")  # compiled here
    bench = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench")
    p = subprocess.run([sys.executable, "-c", INDUCTOR_BEFORE_2_13, bench], capture_output=True, text=True, env=env,
                       timeout=900)
    assert p.returncode == 0, p.stderr[-3000:]
    lines = p.stdout.splitlines()
    assert lines[0] == "round trips dropped by plain torch.compile: 4099", p.stdout  # the old pass is in force
    assert lines[1] == "compiler check: True", p.stdout + p.stderr[-2000:]
    ops = ("exp", "softmax (region)", "log-softmax (region)")
    assert lines[2:] == [f"{op} differ: 0 same log: True" for op in ops], p.stdout


def test_the_compiler_check_where_its_comparison_cannot_run_answers_false(monkeypatch):
    """fused.compiled_code_rounds(device) for another device (bench/gpu_check.sh asks it of the GPU): where the
    check's code compiles but its comparison cannot run there (the meta device holds no values), the answer is
    False with the fused kernels' warning, not an error."""
    monkeypatch.setattr(fused.FusedKernels, "_warned", False)
    with pytest.warns(UserWarning, match="fused kernels unavailable"):
        assert fused.compiled_code_rounds("meta") is False


def test_compiled_paths_are_off_where_the_compiled_code_does_not_round(monkeypatch):
    """The first compiled path asked for checks the process's compiled code against the eager rounding
    (fused.compiled_code_rounds). A compiler that returns float64 values unchanged through the rounding (as
    AVX2 code built for an AVX-512 target did) turns every compiled path off, with a warning, and the engine
    runs its eager ops; where the code rounds, the paths stay on."""

    monkeypatch.setenv("VERITRAIN_COMPILE", "1")
    monkeypatch.setattr(hardware, "_compiler_ok", None)
    assert hardware.compiled_path(1, "cpu", "VERITRAIN_COMPILE_MIN_NUMEL", 1)  # this machine's compiler

    monkeypatch.setattr(hardware, "_compiler_ok", None)
    real = fused.compile_kernel
    monkeypatch.setattr(fused, "compile_kernel", lambda fn, **kw: real(lambda y: y) if fn.__name__ == "round_trip"
                        else real(fn, **kw))  # the miscompile: no rounding on the way
    with pytest.warns(UserWarning, match="does not round") as warned:
        assert not hardware.compiled_path(1, "cpu", "VERITRAIN_COMPILE_MIN_NUMEL", 1)
    # the warning says how many values differ and shows some: a value between float32's grid points comes
    # back unrounded (the miscompile) where the eager round trip gives a float32 value
    # (the one that says so: pytest.warns also records whatever else warns meanwhile, e.g. a ResourceWarning)
    message = next(str(w.message) for w in warned if "does not round" in str(w.message))
    assert re.search(r"\(\d+ of 4106 values of the check differ: ", message), message
    y = float.fromhex(message.split("differ: ")[1].split(" -> ")[0])
    assert y != float(torch.tensor(y).float()), message
    # compiled code that returns something other than the values asked for (a shorter result) is refused too,
    # with a warning, not an error
    monkeypatch.setattr(hardware, "_compiler_ok", None)
    monkeypatch.setattr(fused, "compile_kernel", lambda fn, **kw: real(lambda y: y[:5]) if fn.__name__ == "round_trip"
                        else real(fn, **kw))
    with pytest.warns(UserWarning, match=r"returned torch.float64 \(5,\) for a rounding of \(4106,\)"):
        assert not hardware.compiled_path(1, "cpu", "VERITRAIN_COMPILE_MIN_NUMEL", 1)
    assert not fused.FusedKernels.enabled_for(1 << 20, torch.device("cpu"))
    monkeypatch.setattr(engine, "_FUSED_CACHE", {})
    x = torch.rand(300, 300, generator=torch.Generator().manual_seed(2)) + 0.5
    with step_context(WIDE, 0):
        y = torch.exp(x)
    assert not engine._FUSED_CACHE or not any(fk._cache for fk in engine._FUSED_CACHE.values())
    assert torch.equal(y, torch.exp(x.double()).float())


def test_a_kernel_first_compiled_for_a_few_values_still_runs_its_loop_on_several_threads(monkeypatch):
    """Compiled for every size, a kernel's C++ took whether to use several threads from its first call's size
    and kept that for every later size (and the on-disk cache for every later process): a formula first
    compiled for 640 values ran 25.7M-value calls on one thread. fused.COMPILE_OPTIONS leaves it to the
    OpenMP runtime at each call."""
    from torch._inductor.graph import GraphLowering
    from torch._inductor.utils import fresh_cache

    codes = []
    monkeypatch.setattr(GraphLowering, "save_output_code", codes.append)
    source = "def kernel(x):\n    return x.to(torch.float64).exp().mul(0.5).to(torch.float32)\n"
    kernel = fused.compile_kernel(fused.define(source, "<veritrain test: threads>", {"torch": torch})["kernel"])
    with fresh_cache():  # compiled here, not loaded from another process's cache
        kernel(torch.randn(640))
    loops = [c for c in codes if "cpp_fused" in c]
    assert loops and all("#pragma omp parallel" in c for c in loops)


def test_a_compiled_paths_fallback_warning_fails_the_tests_here_and_in_the_processes_they_start(monkeypatch):
    """The suite's settings (pyproject.toml's filterwarnings, conftest.cli's PYTHONWARNINGS): the warning a compiled
    path gives when it falls back to the eager engine is an error, so a test of a compiled path cannot pass on the
    eager engine unnoticed; other warnings are not."""
    import subprocess
    import sys
    import warnings

    from conftest import COMPILED_PATH_WARNINGS_ARE_ERRORS

    monkeypatch.setattr(fused.FusedKernels, "_warned", False)
    with pytest.raises(UserWarning, match="fused kernels unavailable"):
        fused.FusedKernels.warn_once(None, RuntimeError("a kernel that does not compile"))
    with pytest.warns(UserWarning, match="something else"):
        warnings.warn("veritrain: something else")
    code = "from veritrain import fused; fused.FusedKernels.warn_once(None, RuntimeError('no compiler'))"
    for errors, rc in ((COMPILED_PATH_WARNINGS_ARE_ERRORS, 1), ("", 0)):
        p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                           env={**os.environ, "PYTHONWARNINGS": errors})
        assert p.returncode == rc and "fused kernels unavailable" in p.stderr, p.stderr[-2000:]
