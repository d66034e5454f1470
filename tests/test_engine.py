"""The engine's semantics, op by op."""

import math
import os

import numpy as np
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from veritrain.engine import (AuditorHalf, EngineConfig, OpTrace, ReplayMismatchError, TrainerHalf,
                              UnsupportedOpError, logged_step, step_context)
from veritrain.logformat import StepLogReader, StepLogWriter
from veritrain.rounding import Grid

aten = torch.ops.aten


def run_step(fn, tmp_path, bits=32, step=0, seed=0, replay_of=None, trace=False):
    """Run fn() under the engine as trainer (writing a log) or, with replay_of, as auditor."""
    cfg = EngineConfig(bits=bits, seed=seed)
    path = str(tmp_path / f"step{step}.vtlog")
    writer = None if replay_of else StepLogWriter(path, step, bits)
    reader = StepLogReader(replay_of, expect_step=step) if replay_of else None
    with step_context(cfg, step, writer=writer, reader=reader, trace=OpTrace() if trace else None) as mode:
        out = fn()
    if writer:
        writer.close()
    return out, mode, path


def outputs(modes):
    return [[(e["op"], e["outputs"]) for e in m.trace.entries] for m in modes]


def on_grid(t, bits):
    return bool(Grid(bits).on_grid(t.detach()).all())


def test_exact_ops_at_b32_run_natively_with_the_same_bits():
    """+, -, * and / of float32 values: float64-then-round equals the float32 kernel."""
    g = torch.Generator().manual_seed(0)
    a = torch.randn(20000, generator=g) * torch.logspace(-30, 30, 20000)
    b = torch.randn(20000, generator=g) * torch.logspace(30, -30, 20000)
    a[:50] = torch.tensor(1e-40)  # subnormal operands and results
    grid = Grid(32)
    for f in (torch.add, torch.sub, torch.mul, torch.div):
        assert torch.equal(f(a, b), grid.round(f(a.double(), b.double())))


def test_sqrt_is_not_treated_as_exact():
    """PyTorch's CPU sqrt goes through MKL's vector math library, which is not correctly rounded (seen
    on this machine), so sqrt is an approx op with a log, not an exact one."""
    from veritrain import rules

    assert rules.lookup(aten.sqrt.default).kind == rules.APPROX
    assert rules.lookup(aten._foreach_sqrt.default).kind == rules.APPROX


@pytest.mark.parametrize("dims,kernel,stride,dilation,padding,ceil,exact", [
    (2, 2, 2, 1, 0, False, True), (2, 3, 3, 1, 1, True, True), (2, [2, 3], [2, 4], [1, 1], [1, 0], False, True),
    (2, 2, 3, 2, 1, False, True), (3, 2, 2, 1, 0, True, True),
    (2, 3, 2, 1, 1, False, False),  # windows overlap: a sum
    (2, 2, 2, 2, 0, False, False),  # dilated windows overlap (0, 2) and (2, 4)
])
def test_a_max_pools_gradient_is_exact_where_its_windows_do_not_overlap(dims, kernel, stride, dilation, padding, ceil,
                                                                         exact):
    """Where no two windows share an input position, a max pool's gradient puts one term or zero at each input:
    an exact op (its float32 kernel gives the float64 result rounded, bit for bit); overlapping windows stay
    approximate, their count of windows per position (the error scale's n) from the definition."""
    from veritrain import rules

    g = torch.Generator().manual_seed(1)
    size = (2, 3) + (9,) * dims
    x = torch.randint(-3, 4, size, generator=g).float()  # ties inside windows: the picked index matters
    pool = F.max_pool2d if dims == 2 else F.max_pool3d
    out, idx = pool(x, kernel, stride, padding, dilation, ceil, return_indices=True)
    go = torch.randn(out.shape, generator=g) * torch.logspace(-20, 20, out.numel()).view(out.shape)
    func = aten.max_pool2d_with_indices_backward.default if dims == 2 else aten.max_pool3d_with_indices_backward.default
    per_dim = (lambda v: list(v) if isinstance(v, list) else [v] * dims)
    args = (go, x, per_dim(kernel), per_dim(stride), per_dim(padding), per_dim(dilation), ceil, idx)
    from veritrain.engine import _named

    rule = rules.lookup(func, _named(func, args, {}))
    assert (rule.kind == rules.EXACT) == exact
    if exact:
        assert torch.equal(func(*args), func(go.double(), x.double(), *args[2:]).float())
    else:
        assert rule.kind == rules.APPROX


def test_digits_cnns_pooling_gradient_as_an_exact_op_gives_the_approximate_ops_run(tmp_path, monkeypatch):
    """digits-cnn pools 2 x 2 with stride 2. Its pooling gradient as an exact op (the float32 kernel) gives the
    weights and log bytes it gave as an approximate op (float64, rounded and scanned: its exact results were never
    candidates), with fewer values analysed."""
    from veritrain import rules
    from veritrain.engine import logged_step
    from veritrain.runner import _prepare_batch, _prepare_model
    from veritrain.task import build

    def train(name):
        task = build("digits-cnn", {})
        _prepare_model(task, "verified", Grid(32))
        analysed = 0
        for step in range(2):
            writer = StepLogWriter(str(tmp_path / f"{name}{step}.vtlog"), step, 32)
            with logged_step(EngineConfig(), step, writer=writer) as mode:
                task.run_step(_prepare_batch(task.batch(step), "verified", Grid(32)))
            analysed += mode.stats.analysed
        logs = [(tmp_path / f"{name}{step}.vtlog").read_bytes() for step in range(2)]
        return [t.clone() for t in task.model.state_dict().values()], logs, analysed

    exact = train("exact")
    monkeypatch.setitem(rules.RULES, "max_pool2d_with_indices_backward",
                        rules._acc(rules._linear_op_of_abs(rules._pool_overlap)))
    approx = train("approx")
    assert all(torch.equal(a, b) for a, b in zip(exact[0], approx[0]))
    assert exact[1] == approx[1]
    assert exact[2] < approx[2]


def test_model_step_keeps_dtypes_and_values_on_a_coarse_grid(tmp_path):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(1, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(), nn.Flatten(),
                          nn.Dropout(0.2), nn.Linear(4 * 6 * 6, 3))
    grid = Grid(27)
    with torch.no_grad():
        for p in list(model.parameters()) + list(model.buffers()):
            if p.is_floating_point():
                p.copy_(grid.round(p.double()))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    x = grid.round(torch.randn(8, 1, 6, 6).double())
    y = torch.randint(0, 3, (8,))

    def step():
        opt.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        return loss

    loss, mode, _ = run_step(step, tmp_path, bits=27)
    assert loss.dtype == torch.float32
    tensors = list(model.parameters()) + [t for t in model.buffers() if t.is_floating_point()]
    tensors += [v for st in opt.state.values() for k, v in st.items() if k != "step"]
    for t in tensors:
        assert t.dtype == torch.float32
        assert on_grid(t, 27), "a value left the b=27 grid"
    assert mode.stats.rounded["optimizer"] > 0 and mode.stats.rounded["backward"] > 0


def test_inplace_out_and_functional_forms_agree(tmp_path):
    g = torch.Generator().manual_seed(1)
    a, b = (torch.randn(1000, generator=g) for _ in range(2))
    c = torch.rand(1000, generator=g) + 1

    def forms():
        r1 = torch.addcdiv(a, b, c, value=0.3)
        r2 = a.clone()
        r2.addcdiv_(b, c, value=0.3)
        r3 = torch.empty(0)
        torch.addcdiv(a, b, c, value=0.3, out=r3)
        return r1, r2, r3

    (r1, r2, r3), _, _ = run_step(forms, tmp_path)
    assert torch.equal(r1, r2) and torch.equal(r1, r3)
    expected = Grid(32).round(torch.addcdiv(a.double(), b.double(), c.double(), value=float(np.float32(0.3))))
    assert (r1.view(torch.int32) - expected.view(torch.int32)).abs().max() <= 1  # near-midpoint cases may differ


def test_foreach_ops_round_each_tensor(tmp_path):
    ts = [torch.randn(100), torch.randn(7, 3)]
    others = [torch.randn(100), torch.randn(7, 3)]

    def f():
        xs = [t.clone() for t in ts]
        torch._foreach_add_(xs, others, alpha=0.37)
        norms = torch._foreach_norm(xs)
        return xs, norms

    (xs, norms), mode, _ = run_step(f, tmp_path)
    for x, t, o in zip(xs, ts, others):
        assert x.dtype == torch.float32 and x.shape == t.shape
        ref = Grid(32).round(t.double() + float(np.float32(0.37)) * o.double())
        assert (x.view(torch.int32) - ref.view(torch.int32)).abs().max() <= 1
    assert all(n.dtype == torch.float32 for n in norms)


def test_a_foreach_ops_outputs_scanned_together_log_what_one_scan_each_logs(tmp_path, monkeypatch):
    """The trainer scans a foreach op's small results laid end to end (TrainerHalf.scan_jointly); each
    output's entries, and the log's bytes, must be those of one scan per output. Wide thresholds give many
    entries, scattered over the outputs; sizes straddle the scan's chunks."""
    gen = torch.Generator().manual_seed(3)
    sizes = [1, 5, 100, 3000, 40000, 30000, 7, 70000]
    xs0 = [torch.randn(n, generator=gen) for n in sizes]
    t1 = [torch.randn(n, generator=gen) for n in sizes]
    t2 = [torch.rand(n, generator=gen) + 0.5 for n in sizes]
    cfg = EngineConfig(thresholds={"elementwise": 2.0**21})

    def step(path):
        xs = [x.clone() for x in xs0]
        with logged_step(cfg, 0, writer=StepLogWriter(str(path), 0, 32)) as mode:
            torch._foreach_addcdiv_(xs, t1, t2, [0.1 * (k + 1) for k in range(len(sizes))])
        return xs, mode.stats, open(path, "rb").read()

    scanned = []
    orig = TrainerHalf.scan_jointly

    def spy(self, slots):
        orig(self, slots)
        scanned.extend(getattr(s, "found", None) is not None for s in slots)

    monkeypatch.setattr(TrainerHalf, "scan_jointly", spy)
    joint = step(tmp_path / "joint.vtlog")
    assert sum(scanned) >= 6, scanned  # every output below the fused kernels' size, in more than one chunk
    monkeypatch.setattr(TrainerHalf, "scan_jointly", lambda self, slots: None)
    alone = step(tmp_path / "alone.vtlog")
    assert joint[2] == alone[2]
    assert all(torch.equal(a, b) for a, b in zip(joint[0], alone[0]))
    reader = StepLogReader(str(tmp_path / "joint.vtlog"), expect_step=0)
    per_output = [o.n_entries for o in reader.next_op().outputs]
    assert sum(n > 0 for n in per_output) >= 5 and sum(per_output) > 100, per_output


def test_batchnorm_running_stats_are_updated_and_rounded(tmp_path):
    bn = nn.BatchNorm1d(5)
    x = torch.randn(16, 5)
    _, mode, _ = run_step(lambda: bn(x), tmp_path, bits=25)
    assert bn.num_batches_tracked.item() == 1
    assert not torch.equal(bn.running_mean, torch.zeros(5))
    expect_mean = 0.1 * x.double().mean(0)
    assert torch.allclose(bn.running_mean.double(), expect_mean, rtol=1e-4)
    assert on_grid(bn.running_mean, 25) and on_grid(bn.running_var, 25)


def test_random_ops_depend_on_seed_step_and_order_not_torch_generators(tmp_path):
    def draws():
        return (torch.rand(1000), torch.randn(1000), torch.empty(1000).bernoulli_(0.3), torch.randint(0, 7, (1000,)),
                torch.randperm(50), F.dropout(torch.ones(1000), 0.5, training=True))

    torch.manual_seed(1)
    a, _, _ = run_step(draws, tmp_path, seed=5, step=3)
    torch.manual_seed(2)  # torch's own generator is not used
    b, _, _ = run_step(draws, tmp_path, seed=5, step=3)
    c, _, _ = run_step(draws, tmp_path, seed=5, step=4)
    d, _, _ = run_step(draws, tmp_path, seed=6, step=3)
    for x, y in zip(a, b):
        assert torch.equal(x, y)
    for other in (c, d):
        assert not any(torch.equal(x, y) for x, y in zip(a[:4], other[:4]))
    u, z, mask, ints, perm, drop = a
    assert 0 <= u.min() and u.max() < 1 and abs(u.mean() - 0.5) < 0.05
    assert abs(z.mean()) < 0.15 and abs(z.std() - 1) < 0.1
    assert abs(mask.mean() - 0.3) < 0.05 and set(mask.unique().tolist()) <= {0.0, 1.0}
    assert ints.min() >= 0 and ints.max() < 7 and ints.dtype == torch.int64
    assert sorted(perm.tolist()) == list(range(50))
    assert set(drop.unique().tolist()) <= {0.0, 2.0}


def test_native_dropout_is_lowered_to_the_cpu_composite(tmp_path):
    """A GPU's F.dropout calls native_dropout; the engine turns it into the CPU's op sequence, so the
    op stream and the bits match on every device."""
    x = torch.randn(64, 32, requires_grad=True)

    def composite():
        y = F.dropout(x, 0.25, training=True)
        y.sum().backward()
        return y.detach(), x.grad.clone()

    def native():
        x.grad = None
        y, _ = torch.native_dropout(x, 0.25, True)
        y.sum().backward()
        return y.detach(), x.grad.clone()

    (y1, g1), m1, p1 = run_step(composite, tmp_path, step=0)
    x.grad = None
    (y2, g2), m2, _ = run_step(native, tmp_path, replay_of=p1)  # replays the composite's log
    assert torch.equal(y1, y2) and torch.equal(g1, g2)


def test_replay_reproduces_the_trainer_and_counts_corrections(tmp_path):
    torch.manual_seed(0)
    w = torch.randn(64, 64) / 8
    x = torch.randn(32, 64)

    def f():
        return torch.tanh(x @ w).softmax(-1).log()

    y1, m1, path = run_step(f, tmp_path)
    y2, m2, _ = run_step(f, tmp_path, replay_of=path)
    assert torch.equal(y1, y2)
    assert m2.stats.suspicious_count == 0


def test_replay_of_other_code_fails_naming_step_and_op(tmp_path):
    x = torch.randn(10, 10)
    _, _, path = run_step(lambda: torch.exp(x), tmp_path)
    with pytest.raises(ReplayMismatchError, match=r"step 0, op #1: replay runs aten.tanh.default but the log has "
                                                  r"aten.exp.default"):
        run_step(lambda: torch.tanh(x), tmp_path, replay_of=path)
    with pytest.raises(ReplayMismatchError, match=r"output shapes \[\(5, 10\)\] differ"):
        run_step(lambda: torch.exp(x[:5]), tmp_path, replay_of=path)
    with pytest.raises(ReplayMismatchError, match="log ends before this op"):
        run_step(lambda: (torch.exp(x), torch.exp(x)), tmp_path, replay_of=path)
    with pytest.raises(ReplayMismatchError, match="log has more ops"):
        run_step(lambda: x.clone(), tmp_path, replay_of=path)


def test_a_logged_step_closes_its_log_or_leaves_none_behind(tmp_path):
    x = torch.randn(10, 10)
    path = str(tmp_path / "ok.vtlog")
    with logged_step(EngineConfig(), 0, writer=StepLogWriter(path, 0, 32)) as st:
        torch.exp(x)
    assert st.closed_log["bytes"] == os.path.getsize(path)
    # a step that fails leaves no log and no partial file; its reader is closed whatever happens
    bad = str(tmp_path / "bad.vtlog")
    with pytest.raises(ZeroDivisionError), logged_step(EngineConfig(), 1, writer=StepLogWriter(bad, 1, 32)):
        torch.exp(x)
        1 / 0
    assert os.listdir(tmp_path) == ["ok.vtlog"]
    reader = StepLogReader(path, expect_step=0, expect_bits=32)
    with pytest.raises(ReplayMismatchError), logged_step(EngineConfig(), 0, reader=reader):
        torch.tanh(x)
    assert reader._file._f.closed


def test_half_precision_and_fused_optimizers_are_refused(tmp_path):
    with pytest.raises(UnsupportedOpError, match="torch.float16"):
        run_step(lambda: torch.randn(4).half() * 2, tmp_path)
    from veritrain.task import TaskError, normalize_optimizer

    p = nn.Parameter(torch.randn(3))
    with pytest.raises(TaskError, match="fused=True"):
        normalize_optimizer(torch.optim.AdamW([p], fused=True))
    opt = torch.optim.AdamW([p], foreach=False)
    normalize_optimizer(opt)
    assert opt.param_groups[0]["foreach"] is True and opt.defaults["foreach"] is True


@pytest.mark.parametrize("make", [
    lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, weight_decay=5e-4),
    lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1),
    lambda ps: torch.optim.Adam(ps, lr=1e-2),
    lambda ps: torch.optim.RMSprop(ps, lr=1e-2, momentum=0.5),
], ids=["sgd", "adamw", "adam", "rmsprop"])
def test_optimizers_run_foreach_in_a_few_ops_with_the_single_tensor_bits(tmp_path, make):
    """normalize_optimizer pins foreach: each update formula is one engine op for all parameters, not one
    per parameter, and the verified steps end with the bits of the single-tensor implementation."""
    from veritrain.task import normalize_optimizer

    gen = torch.Generator().manual_seed(0)
    shapes = [(8, 3, 3, 3), (8,), (8,), (16, 8, 3, 3), (16,), (10, 64), (10,)]
    init = [torch.randn(s, generator=gen) for s in shapes]
    grads = [[torch.randn(s, generator=gen) for s in shapes] for _ in range(3)]
    states, ops = [], []
    for foreach in (True, False):
        ps = [nn.Parameter(t.clone()) for t in init]
        opt = make(ps)
        if foreach:
            normalize_optimizer(opt)
        else:
            for g in opt.param_groups:
                g["foreach"] = False
        n = 0
        for step, gs in enumerate(grads):
            for p_, g in zip(ps, gs):
                p_.grad = g.clone()
            with step_context(EngineConfig(), step) as mode:
                opt.step()
            n += mode.stats.ops
        states.append([p_.detach().clone() for p_ in ps])
        ops.append(n)
    assert all(torch.equal(a, b) for a, b in zip(*states))
    assert ops[0] * 3 < ops[1], ops


def test_scalars_are_rounded_to_float32_and_near_midpoint_ones_logged(tmp_path):
    x = torch.ones(4)
    mid = float(np.float32(1.1)) + 2.0**-24 * 1.0000000000001  # just above a float32 midpoint near 1.1
    (y,), mode, path = run_step(lambda: (x * mid,), tmp_path)
    r = StepLogReader(path)
    op = r.next_op()
    assert op.scalars == [(1, True)]
    assert torch.equal(y, torch.full((4,), float(np.float32(mid))))


def test_unknown_ops_fall_back_and_are_reported(tmp_path):
    x = torch.rand(100) + 0.5
    y, mode, _ = run_step(lambda: torch.special.i0(x), tmp_path)
    assert "aten.special_i0.default" in mode.stats.fallback_ops or "aten.i0.default" in mode.stats.fallback_ops
    assert y.dtype == torch.float32


def test_variance_and_norms_of_constant_data_are_exact(tmp_path):
    x = torch.full((64,), 0.3)
    (v, n), _, _ = run_step(lambda: (x.var(), torch.linalg.vector_norm(x)), tmp_path)
    assert v.item() == 0.0
    assert math.isclose(n.item(), math.sqrt(64) * float(np.float32(0.3)), rel_tol=1e-6)


def test_the_log_corrects_an_auditor_that_rounds_the_other_way(tmp_path, monkeypatch):
    """Another correct implementation may land on the other side of a rounding midpoint. Simulate the
    worst case: for every value the trainer logged, the auditor's float64 result is the trainer's
    reflected across the midpoint (same distance, so not suspicious). With the log the auditor still
    reaches the trainer's bits; without it, it does not."""
    from veritrain.engine import _EagerSlot

    grid = Grid(32)

    def make():
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(64, 512), nn.Tanh(), nn.Linear(512, 512), nn.Tanh(), nn.Linear(512, 10))
        return model, torch.optim.AdamW(model.parameters(), lr=1e-3)

    g = torch.Generator().manual_seed(0)
    data = [(torch.randn(128, 64, generator=g), torch.randint(0, 10, (128,), generator=g)) for _ in range(3)]

    def train(model, opt, logs, replay):
        for step, (x, y) in enumerate(data):
            def f():
                opt.zero_grad()
                F.cross_entropy(model(x), y).backward()
                opt.step()
            _, mode, path = run_step(f, tmp_path, step=step, replay_of=logs[step] if replay else None, trace=True)
            logs.append(path) if not replay else None
            yield mode

    trainer, t_opt = make()
    logs = []
    t_modes = list(train(trainer, t_opt, logs, replay=False))
    assert sum(m.stats.entries_total for m in t_modes) > 0

    original = AuditorHalf.replay

    def other_side(self, func, slot, log_entries, phase, c, index, apply=True):
        if len(log_entries.dir_pos) and isinstance(slot, _EagerSlot):
            flat = slot.y64.view(-1)
            pos = torch.from_numpy(log_entries.dir_pos)
            y = flat[pos]
            lower, _, spacing = grid.cell(y)
            mid = torch.copysign(lower + spacing / 2, y)
            flat[pos] = 2 * mid - y
            slot._y32 = None
        if apply:
            original(self, func, slot, log_entries, phase, c, index)

    monkeypatch.setattr(AuditorHalf, "replay", other_side)
    auditor, a_opt = make()
    a_modes = list(train(auditor, a_opt, list(logs), replay=True))
    assert sum(m.stats.corrections_total for m in a_modes) > 0 and sum(m.stats.suspicious_count for m in a_modes) == 0
    assert outputs(a_modes) == outputs(t_modes)  # every op's output, bit for bit
    assert all(torch.equal(a, b) for a, b in zip(trainer.state_dict().values(), auditor.state_dict().values()))

    monkeypatch.setattr(AuditorHalf, "replay", lambda *a: other_side(*a, apply=False))
    unlogged, u_opt = make()
    u_modes = list(train(unlogged, u_opt, list(logs), replay=True))
    assert outputs(u_modes) != outputs(t_modes)
