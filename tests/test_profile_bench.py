"""bench/profile_engine.py wraps the engine's functions by name: it must keep up with the engine, and its
timer stack must account for the whole step (each category exclusive, together the step's time)."""

import os
import sys

import pytest

from conftest import REPO

sys.path.insert(0, os.path.join(REPO, "bench"))

import profile_engine  # noqa: E402


def test_the_profile_accounts_for_the_whole_step_once():
    for owner, name, _ in profile_engine._targets():
        assert name in owner.__dict__, f"{owner.__name__}.{name} is gone: update bench/profile_engine.py"
    r = profile_engine.measure("digits-cnn", {}, 1, progress=None)
    for run in ("trainer*", "auditor*"):
        total = sum(r["share"][run].values())
        assert 0.9 <= total <= 1.0 + 1e-9, (run, r["share"][run])  # exclusive: nothing counted twice
        assert r["share"][run]["kernel"] > 0 and r["share"][run]["log"] > 0
    assert r["share"]["trainer*"]["scan"] > 0 and r["share"]["auditor*"]["scan"] == 0  # only the trainer scans
    assert set(r["in_fp64_steps"]) == {"trainer", "auditor"}


def test_the_optimizer_bench_steps_the_trainer_and_the_auditor_to_the_same_bits(capsys):
    """bench/bench_optimizer.py: AdamW over GPT-2's parameter shapes in every mode; it exits with an error where
    the auditor's parameters differ from the trainer's or its replay finds a suspicious entry."""
    import torch

    import bench_optimizer

    shapes = bench_optimizer.gpt2_shapes(2, 8)
    assert len(shapes) == 2 + 12 * 2 + 2 and shapes[0] == (50257, 8)
    bench_optimizer.main(["--layers", "1", "--width", "8", "--repeats", "1", "--fresh"])
    out = capsys.readouterr().out
    assert "same parameters, bit for bit" in out and "auditor-fresh" in out
    with bench_optimizer.fresh_results():  # the comparison's engine writes no result in place
        assert not bench_optimizer.VerifiedMode._writes_in_place(None, None, 0, torch.zeros(3))


def test_the_mask_bench_times_each_format_and_finds_the_same_candidates(capsys):
    """bench/bench_masks.py: every variant compiles and runs; the one-byte mask and the per-row flags agree
    on which rows hold candidates (the test is the same, only its output differs)."""
    import torch

    import bench_masks

    bench_masks.main(["--numel", "65536", "--repeats", "1"])
    out = capsys.readouterr().out
    assert all(v in out for v in ("round_only", "int8_mask", "stability", "float32_test", "row_flags"))
    x = torch.randn(1 << 16, generator=torch.Generator().manual_seed(1)) * 1e-3
    x[[5, 6, 700, 40000]] = 1e-39  # below float32's normal range: candidates (the bulk test's rule there)
    s = torch.tensor(1.7, dtype=torch.float64)
    mask = bench_masks.int8_mask(x, s)[1]
    flags = bench_masks.row_flags(x.view(-1, 256), s)[1]
    assert torch.equal(mask.view(-1, 256).ne(0).sum(1).to(flags.dtype), flags)
    assert flags.nonzero().squeeze(1).tolist() == [0, 2, 156]
    # the kernels' test flags none of these (their scale |y| / 1.7 leaves no rounding in doubt), nor others
    assert not bench_masks.stability(x, s)[1].any()


def test_the_graph_bound_rounds_what_the_engine_rounds_and_scans_its_approximate_ops(monkeypatch):
    """bench/step_graph_bound.py's rewrite of an aten graph: every result the engine rounds (its rule exact or
    approximate, as the engine picks it) comes out on the float32 grid; only approximate ops get a scale and a
    test, and views are left alone."""
    import torch
    from torch.fx.experimental.proxy_tensor import make_fx

    import step_graph_bound

    monkeypatch.setenv("VERITRAIN_COMPILE", "0")

    def step(x, w, b):
        y = torch.nn.functional.conv2d(x, w) + b  # convolution: approximate; add (alpha 1): exact
        return (y * y).sum(), y.view(-1)  # mul: exact; sum: approximate; view: neither

    g = torch.Generator().manual_seed(0)
    args = [torch.randn(s, generator=g).double() for s in ((2, 3, 6, 6), (4, 3, 3, 3), (4, 1, 1))]
    graph = make_fx(step)(*args)
    for scan in (False, True):
        seen = {"approximate ops": 0, "exact ops": 0, "no rule": set()}
        run = step_graph_bound._Rounding(graph, scan, seen)
        loss, y = run.run(*args)
        assert seen == {"approximate ops": 2, "exact ops": 2, "no rule": set()}, seen
        assert len(run.flags) == (2 if scan else 0)
        for t in (loss, y):
            assert t.dtype == torch.float64 and torch.equal(t, t.float().double())
        plain = step(*args)
        assert not torch.equal(plain[1], plain[1].float().double())  # so the rounding took place


def test_the_graph_bounds_dispatch_mode_sees_every_op_and_changes_nothing(monkeypatch):
    """bench/step_graph_bound.py's per-op floor: the step under a dispatch mode that only calls each op gives
    the plain step's values bit for bit, and every op goes through the mode (else it would time less than a
    per-op engine pays)."""
    import torch

    import step_graph_bound

    seen = []
    real = step_graph_bound._PassThrough.__torch_dispatch__

    def counting(self, func, types, args=(), kwargs=None):
        seen.append(str(func))
        return real(self, func, types, args, kwargs)

    monkeypatch.setattr(step_graph_bound._PassThrough, "__torch_dispatch__", counting)
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(8, 5, generator=g).double(), torch.randn(5, 3, generator=g).double()

    def step(batch):
        return torch.tanh(batch @ w).sum()

    assert torch.equal(step_graph_bound._under_dispatch_mode(step)(x), step(x))
    assert {"aten.mm.default", "aten.tanh.default", "aten.sum.default"} <= set(seen), seen


def test_the_regions_bench_times_every_captured_region_each_way(capsys):
    """bench/bench_regions.py: every region of digits-cnn's steps, the trainer's and the auditor's, timed as
    Python (NumPy test, torch test) and compiled; it exits with an error where the variants' results differ."""
    import bench_regions

    rows = bench_regions.measure("digits-cnn", {}, repeats=1, steps=2)
    assert {r["role"] for r in rows} == {"trainer", "auditor"}
    assert {r["first op"] for r in rows} >= {"aten.mean.dim", "aten.exp.default"}  # BatchNorm, log-softmax
    assert all(set(r["us"]) == set(bench_regions.VARIANTS) and r["per_step"] >= 1 for r in rows)
    assert {r["ran"] for r in rows} == {"python", "compiled"}  # digits-cnn's regions are below and above 65536
    text = bench_regions.markdown({"digits": rows}, "cmd", "machine")
    assert text.count("**per step**") == 2


def test_the_profile_counts_its_steps_after_the_warm_up_steps_asked_for(monkeypatch, capsys):
    """profile_engine --warmup N: N step indices run in every run uncounted, then --steps are profiled, in both the
    category profile and the per-op one; neither may be below 1."""
    import pytest

    monkeypatch.setenv("VERITRAIN_COMPILE", "0")
    profile_engine.main(["--workloads", "digits", "--steps", "1", "--warmup", "2", "--no-write"])
    out = capsys.readouterr().out
    assert [line.split(":")[0] for line in out.splitlines() if "  step " in line] == ["digits  step 2"]
    steps, real = [], profile_engine._step
    monkeypatch.setattr(profile_engine, "_step", lambda task, mode, step, *a, **k: steps.append(step) or real(
        task, mode, step, *a, **k))
    profile_engine.main(["--workloads", "digits", "--steps", "1", "--warmup", "2", "--per-op", "3", "--no-write"])
    assert sorted(set(steps)) == [0, 1, 2] and len(steps) == 3 * 3  # fp64, trainer, auditor at each index
    for bad in (["--warmup", "0"], ["--steps", "0"]):
        with pytest.raises(SystemExit):
            profile_engine.main(["--workloads", "digits", "--no-write", *bad])
    assert "must be at least 1" in capsys.readouterr().err


def test_the_per_op_profile_times_the_same_ops_in_every_run():
    """profile_engine --per-op: each op's time per step in the trainer and the auditor, split into the
    profile's categories, and in a plain float64 step, by the same aten names (the engine's top-level ops and a
    plain step's ops); only the trainer scans, and the time between ops is Python and log I/O."""
    r = profile_engine.per_op("digits-cnn", {}, 1)
    assert set(r) == {"fp64", "trainer", "auditor"}
    for op in ("aten.convolution.default", "aten.convolution_backward.default"):
        assert r["fp64"][op] > 0
        for run in ("trainer", "auditor"):
            assert set(r[run][op]) == set(profile_engine.CATEGORIES) and r[run][op]["kernel"] > 0
    assert sum(c["scan"] for c in r["trainer"].values()) > 0 and sum(c["scan"] for c in r["auditor"].values()) == 0
    assert {c for c, t in r["trainer"][None].items() if t > 0} <= {"python", "log"}
    text = profile_engine.per_op_markdown({"digits": r}, "cmd", "machine", 3)
    assert text.count("| digits |") == 2 * (3 + 2) and text.count("**every op**") == 2


def test_the_engine_bench_rewrites_its_own_sections_and_keeps_every_other():
    """bench/bench_engine.py writes the top of bench/RESULTS.md; the sections other scripts wrote after it stay."""
    import bench_engine

    old = ("# Benchmarks\n\nCommand: `old`\n\n## Per-step cost\n\n| old row |\n\n## Notes\n\n- old note\n\n"
           "## Residual freedom of a dishonest trainer (issue 8)\n\nkept 1\n\n## Notes\n\n- kept 2\n\n"
           "<!-- experiments: written by bench/run_experiments.py -->\n\n## Experiments\n\nkept 3\n")
    ours = "# Benchmarks\n\nCommand: `new`\n\n## Per-step cost\n\n| new row |\n\n## Notes\n\n- new note\n"
    text = bench_engine.merged(old, ours)
    assert text.startswith(ours)
    assert "old row" not in text and "old note" not in text and "Command: `old`" not in text
    assert all(f"kept {k}" in text for k in (1, 2, 3)) and text.count("## Residual freedom") == 1
    assert bench_engine.merged("", ours) == ours and bench_engine.merged(ours, ours) == ours


def test_the_conformance_check_finds_the_cpus_compiled_paths_conform_op_by_op():
    import torch

    import compiled_conformance

    ops = ["exp", "add, alpha", "sum over rows", "mm", "layer norm (region)"]
    rows = compiled_conformance.check(torch.device("cpu"), ops)
    assert [r["op"] for r in rows] == ops
    assert compiled_conformance.conforms(rows), rows
    assert all(r["entries"][1] > 0 for r in rows[:4] if r["op"] != "sum over rows")  # the logs compared hold decisions
    assert rows[-1]["replays"] == 2  # the region replayed, by the trainer and by the auditor


def test_the_conformance_check_reports_an_op_whose_compiled_run_differs(monkeypatch):
    """A stand-in for a nonconforming kernel: an op whose result depends on whether the compiled paths are on."""
    import torch

    import compiled_conformance

    def op(x, y, p):
        return torch.exp(x + (2.0**-20 if os.environ.get("VERITRAIN_COMPILE") == "1" else 0.0))

    monkeypatch.setattr(compiled_conformance, "OPS", {"exp, off on compiled runs": op})
    rows = compiled_conformance.check(torch.device("cpu"))
    (row,) = rows
    assert row["differ"] > 0 and not row["same_log"] and not row["audit_ok"] and row["examples"].count("/") == 6
    assert not compiled_conformance.conforms(rows)
    assert "do not conform" in compiled_conformance.markdown(rows, "cmd", torch.device("cpu"))


def test_the_conformance_check_lifts_the_cpu_only_rule_for_its_compiled_runs_alone(monkeypatch):
    import compiled_conformance
    from veritrain import blocked, capture, fused, hardware, rounding

    monkeypatch.setenv("VERITRAIN_COMPILE", "0")
    cuda, modules, replays_on = __import__("torch").device("cuda"), (fused, blocked, rounding, capture), capture.replays_on
    assert not fused.compiled_path(1 << 20, cuda, "VERITRAIN_COMPILE_MIN_NUMEL", 1) and not replays_on(cuda)
    with compiled_conformance.compiled_paths(True):
        assert all(m.compiled_path(1 << 20, cuda, "VERITRAIN_COMPILE_MIN_NUMEL", 1) for m in modules)
        assert capture.replays_on(cuda)
    assert all(m.compiled_path is hardware.compiled_path for m in modules) and capture.replays_on is replays_on
    assert os.environ["VERITRAIN_COMPILE"] == "0"
    with compiled_conformance.compiled_paths(False):
        assert not fused.compiled_path(1 << 20, "cpu", "VERITRAIN_COMPILE_MIN_NUMEL", 1)


def test_the_engine_bench_forces_the_compiled_paths_on_any_device_only_when_asked(monkeypatch, capsys):
    """bench/bench_engine.py --force-compiled: its steps run with the compiled paths on for every op on any device
    (what a GPU's step would cost with them, before they conform there); without it, the library's rule."""
    import torch

    import bench_engine
    from veritrain import capture, fused

    monkeypatch.setenv("VERITRAIN_COMPILE", "0")
    monkeypatch.setattr(bench_engine, "WORKLOADS", {"digits": ("digits-cnn", lambda shared: {}, "digits-cnn")})
    monkeypatch.setattr(bench_engine, "TARGETS", {"digits": (9.0, 9.0)})
    seen, real = [], bench_engine.measure

    def measure(*args, **kw):
        cuda = torch.device("cuda")
        seen.append(fused.compiled_path(1 << 20, cuda, "VERITRAIN_COMPILE_MIN_NUMEL", 1) and capture.replays_on(cuda))
        return real(*args, **kw)

    monkeypatch.setattr(bench_engine, "measure", measure)
    for flags in (["--force-compiled"], []):
        bench_engine.main(["--workloads", "digits", "--steps", "1", "--no-write", *flags])
    assert seen == [True, False]
    out = capsys.readouterr().out
    assert "--force-compiled" in out and "| digits-cnn | 1 |" in out


def test_the_engine_bench_counts_its_steps_after_the_warm_up_steps_asked_for(monkeypatch, capsys):
    """bench/bench_engine.py --warmup N: the first N step indices run in every mode uncounted (a large model's plain
    float64 step takes several to settle), then --steps are timed; neither may be below 1."""
    import pytest

    import bench_engine

    monkeypatch.setenv("VERITRAIN_COMPILE", "0")
    monkeypatch.setattr(bench_engine, "WORKLOADS", {"digits": ("digits-cnn", lambda shared: {}, "digits-cnn")})
    monkeypatch.setattr(bench_engine, "TARGETS", {"digits": (99.0, 99.0)})
    bench_engine.main(["--workloads", "digits", "--steps", "1", "--warmup", "3", "--no-write"])
    out = capsys.readouterr().out
    assert [line.split(":")[0].strip() for line in out.splitlines() if "  step " in line] == ["digits  step 3"]
    assert "| digits-cnn | 1 |" in out and "--warmup 3" in out
    for bad in (["--warmup", "0"], ["--steps", "0"]):
        with pytest.raises(SystemExit):
            bench_engine.main(["--workloads", "digits", "--no-write", *bad])
    assert "must be at least 1" in capsys.readouterr().err


def test_the_forced_command_line_runs_veritrain_with_the_compiled_paths_on_any_device(monkeypatch):
    """bench/force_compiled.py (bench/gpu_check.sh trains and audits with it on a GPU): veritrain's command line,
    its arguments passed on, its exit code returned, with every compiled path on for every device while it runs."""
    import runpy

    import pytest
    import torch

    from veritrain import capture, cli, fused, hardware

    monkeypatch.setenv("VERITRAIN_COMPILE", "0")
    seen = []

    def main(argv):
        cuda = torch.device("cuda")
        seen.append((argv, fused.compiled_path(1 << 20, cuda, "VERITRAIN_COMPILE_MIN_NUMEL", 1)
                     and capture.replays_on(cuda)))
        return 3

    monkeypatch.setattr(cli, "main", main)
    monkeypatch.setattr(sys, "argv", ["bench/force_compiled.py", "audit", "runs/x", "--device", "cuda"])
    with pytest.raises(SystemExit) as exited:
        runpy.run_path(os.path.join(REPO, "bench", "force_compiled.py"), run_name="__main__")
    assert exited.value.code == 3 and seen == [(["audit", "runs/x", "--device", "cuda"], True)]
    assert fused.compiled_path is hardware.compiled_path  # put back afterwards


def test_the_stream_bench_follows_where_each_tensor_comes_from_and_what_changes_between_steps():
    """bench/step_stream.py: on digits-cnn (AdamW) the trainer's top-level stream has the same structure every
    step, Python reads values in it (the loss, AdamW's step counts), and AdamW's step sizes change from step to
    step; its summary finds a step whose stream differs, and the recorder names which op made each tensor."""
    import torch

    import step_stream

    r = step_stream.measure("digits-cnn", {}, 2, progress=None)
    assert r["differs_at"] == [] and r["ops"][0] == r["ops"][1] > 50
    assert r["sync_names"]["_local_scalar_dense"] >= 2 and r["segments"][0] >= 1
    assert r["varying"].get("_foreach_addcdiv_", 0) > 0  # the step size: an input of a program, not a constant
    assert "convolution.default" in r["to_lower"] and "view.default" not in r["to_lower"]

    rec = step_stream.StreamRecorder()
    x = torch.ones(3)
    i = rec.before(torch.ops.aten.mul.Tensor, (x, 2.5), {})
    y = x * 2.5
    rec.after(i, y)
    rec.before(torch.ops.aten.add.Tensor, (y, x), {})
    (_, first, floats), (_, second, _) = rec.ops
    assert first[0][2] == ("outside", 0) and floats == (2.5,)
    assert second[0][2] == ("op", 0) and second[1][2] == ("outside", 0)  # x is the same tensor from outside

    steps = [rec.ops, list(rec.ops)]
    assert step_stream.summarize(steps)["differs_at"] == []
    name, structure, floats = steps[1][1]
    steps[1] = [steps[1][0], (name, (((4,), torch.float32, ("op", 0)),) + structure[1:], floats)]
    assert step_stream.summarize(steps)["differs_at"] == [1]
    steps[1] = [(steps[0][0][0], steps[0][0][1], (3.5,)), steps[0][1]]
    assert step_stream.summarize(steps)["varying"] == {"mul": 1}


def _deferred_steps(compiled, steps=4, factors=(), swapped=(), scanned=False, engine_dir=None, adamw=False):
    """A small float64 model trained eagerly and under bench/deferred_step.py's Deferring, step for step (step k's
    scalar factor ``factors[k]``, else 2.0; in the steps ``swapped``, a difference's operands the other way round).
    With ``engine_dir``, a third copy, in float32, trains under the engine as a trainer (logs in that folder) and
    takes the eager copy's place in what each step yields. ``adamw``: AdamW (foreach) rather than SGD."""
    import torch

    import deferred_step
    from veritrain.engine import EngineConfig, step_context
    from veritrain.logformat import StepLogWriter

    def make(dtype=torch.float64):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.BatchNorm1d(8), torch.nn.ReLU(),
                                    torch.nn.Linear(8, 3)).to(dtype)
        if adamw:
            return model, torch.optim.AdamW(model.parameters(), lr=0.1, weight_decay=1e-2, foreach=True)
        return model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-3, foreach=True)

    def step(model, opt, x, y, factor, swap):
        opt.zero_grad(set_to_none=True)
        h = model[2](model[1](model[0](x)))
        g = (h * factor).relu_().t().t()  # views, an in-place op
        loss = torch.nn.functional.cross_entropy(model[3](g - h if swap else h - g), y)
        loss.backward()
        opt.step()
        return float(loss)  # a sync point

    eager, deferred = make(torch.float32 if engine_dir else torch.float64), make()
    mode = deferred_step.Deferring(compiled=compiled, rounded=compiled, scanned=scanned)
    for k in range(steps):
        g = torch.Generator().manual_seed(k)
        x = torch.randn(5, 6, generator=g).double()  # on the float32 grid
        batch = x, torch.randint(0, 3, (5,), generator=g)
        factor = factors[k] if k < len(factors) else 2.0
        if engine_dir:
            writer = StepLogWriter(os.path.join(engine_dir, f"{k}.vtlog"), k, 32)
            with step_context(EngineConfig(), k, writer=writer):
                a = step(*eager, x.float(), batch[1], factor, k in swapped)
            writer.close()
        else:
            a = step(*eager, *batch, factor, k in swapped)
        mode.start_step()
        with mode:
            b = step(*deferred, *batch, factor, k in swapped)
        mode.end_step()
        yield a, b, eager[0], deferred[0], mode


def test_the_deferred_step_gives_the_eager_steps_bits():
    """bench/deferred_step.py's mechanics: with every op handed back unfilled and run at the sync points by the same
    aten calls, the weights, BatchNorm's statistics and the loss are the eager step's, bit for bit, through
    autograd's saved tensors and gradients, views and in-place ops; and the ops were deferred (from the second
    step, once the optimizer has made its state, only the loss's read runs eagerly)."""
    import torch

    eager_ops = []
    for k, (a, b, eager, deferred, mode) in enumerate(_deferred_steps(compiled=False)):
        assert a == b, k
        for (name, p), q in zip(eager.state_dict().items(), deferred.state_dict().values()):
            assert torch.equal(p, q), (k, name)
        eager_ops.append(mode.eager_ops)
    assert eager_ops[-1] - eager_ops[-2] == eager_ops[-2] - eager_ops[-3] == 1, eager_ops  # the loss's read
    assert mode.deferred_ops > 100, mode.deferred_ops


def test_a_deferred_segment_seen_before_follows_its_plan_and_leaves_it_where_an_op_differs():
    """From the third step each segment is checked op by op against the one an earlier step ran (its Plan); where an
    op's constant differs (step 4's factor), the plan ends there: the ops that matched run as a program of their
    own, the op eagerly, and the step keeps the eager bits, as do the steps after it, which follow plans again.
    Step 8 issues the same ops with the same constants, but one takes its tensors the other way round: the plan
    ends there too (the check follows which tensor is which, not only the ops)."""
    import torch

    followed, eager_ops = [], []
    for k, (a, b, eager, deferred, mode) in enumerate(_deferred_steps(compiled=False, steps=9,
                                                                     factors=[2.0] * 4 + [3.0], swapped={8})):
        assert a == b, k
        for (name, p), q in zip(eager.state_dict().items(), deferred.state_dict().values()):
            assert torch.equal(p, q), (k, name)
        followed.append(mode.followed_ops)
        eager_ops.append(mode.eager_ops)
    per_step = [b - a for a, b in zip(followed, followed[1:])]
    assert followed[1] == 0 and per_step[1] > 50, followed  # the second step records the plans, the third follows
    # step 4 leaves its plan early, and so does step 5 (it follows the plan step 4 made of the ops that matched, then
    # goes on as a segment that is the whole plan again); step 6 follows that one to its end
    assert per_step[2] == per_step[5] and per_step[3] < per_step[2] and per_step[4] < per_step[2], per_step
    assert eager_ops[4] - eager_ops[3] == eager_ops[3] - eager_ops[2] + 2, eager_ops  # the factor's two muls
    assert per_step[6] == per_step[2] and per_step[7] < per_step[2], per_step


def test_adamws_changing_step_sizes_are_a_programs_input_not_an_eager_op():
    """AdamW's step sizes and bias corrections change every step; the two ops that take them (the foreach addcdiv and
    div) are deferred with their floats as the program's input, through ops that take them as tensors, and the
    weights stay the eager step's, bit for bit. Only the sync points (each parameter's step count read twice, and
    the loss) run eagerly."""
    import torch

    aten = torch.ops.aten
    for k, (a, b, eager, deferred, mode) in enumerate(_deferred_steps(compiled=False, steps=5, adamw=True)):
        assert a == b, k
        for (name, p), q in zip(eager.state_dict().items(), deferred.state_dict().values()):
            assert torch.equal(p, q), (k, name)
    assert mode.eager_funcs == {aten._local_scalar_dense.default}, mode.eager_funcs
    assert mode.followed_ops > 100, mode.followed_ops


@pytest.mark.parametrize("scanned, adamw", [(False, False), (True, False), (False, True)],
                         ids=["rounded", "scanned", "rounded-adamw"])
def test_the_deferred_steps_compiled_programs_compute_the_engines_step(tmp_path, scanned, adamw):
    """bench/deferred_step.py's compiled runs cost what they would cost only if they compute what the engine does:
    their weights, BatchNorm's statistics and losses are a float32 copy's under the engine's trainer, bit for bit,
    in every step. That needs every rounding the engine makes, a decomposition's steps (BatchNorm, the
    log-softmax) included, and the engine's float32 scalars. (A flipped rounding could differ only within the
    engine's logged margin of a midpoint: none on this model's values.) The scanned run also tests each result."""
    import torch

    for k, (a, b, engine, deferred, mode) in enumerate(_deferred_steps(compiled=True, steps=5, scanned=scanned,
                                                                        engine_dir=str(tmp_path), adamw=adamw)):
        assert a == b, k
        for (name, p), q in zip(engine.state_dict().items(), deferred.state_dict().values()):
            assert torch.equal(p.double(), q) if p.is_floating_point() else torch.equal(p, q), (k, name)
    assert mode.deferred_ops > 100 and (mode.candidates > 0) == scanned, (mode.deferred_ops, mode.candidates)


def test_the_deferred_steps_compiled_programs_round_and_compile_once():
    """bench/deferred_step.py's rounded run: its compiled programs leave the weights on the float32 grid, and a
    later step runs the programs an earlier one compiled (no compile per step)."""
    programs = []
    for a, b, eager, deferred, mode in _deferred_steps(compiled=True, steps=5):
        programs.append(len(mode.programs))
        for p in deferred.parameters():
            assert bool((p == p.float().double()).all())
    assert programs[-1] == programs[-2] == programs[-3] and mode.deferred_ops > 100, programs


def test_the_deferred_benchs_native_composites_run_is_a_comparison_that_keeps_atens_kernels(monkeypatch):
    """--native-composites (what the engine's decompositions cost in a program, by difference) turns them off and
    refuses to write the section, which holds the engine's semantics."""
    import torch

    import deferred_step

    monkeypatch.setattr(deferred_step, "NATIVE_COMPOSITES", False)
    x = torch.zeros(4, 3, dtype=torch.float64)
    args = (x, None, None, None, None, True, 0.1, 1e-5)
    assert deferred_step._decomposes(torch.ops.aten.native_batch_norm.default, args, {})
    with pytest.raises(SystemExit):
        deferred_step.main(["--native-composites", "--workloads", "resnet"])
    assert deferred_step.NATIVE_COMPOSITES
    assert not deferred_step._decomposes(torch.ops.aten.native_batch_norm.default, args, {})


def test_the_epilogue_bench_splits_a_product_by_rows_without_changing_its_bits(capsys):
    """bench/bench_epilogues.py: the product split by blocks of rows, each block rounded and tested by the epilogue
    with its rows' norms, gives the whole product's float32 result and candidate mask; every variant runs."""
    import torch

    import bench_epilogues
    from veritrain import fused
    from veritrain.rounding import Grid

    p = bench_epilogues.Product(96, 40, 72, fused.Epilogues(Grid(32)), seed=3)
    p.coef = 2.0 ** 18  # a scale wide enough that some values are candidates and most are not
    whole, blocks = p.whole(), p.by_rows(32)
    flagged = int(whole[1].ne(0).sum())
    assert 0 < flagged < whole[1].numel()
    assert torch.equal(whole[0], blocks[0]) and torch.equal(whole[1], blocks[1])
    bench_epilogues.main(["--shapes", "64x32x48", "--rows", "16", "--reps", "2", "--no-write"])
    out = capsys.readouterr().out
    assert "| (64 x 32) @ (32 x 48) |" in out and "by 16 rows" in out


@pytest.mark.parametrize("what", ["classify", "scan", "checks"])
def test_the_per_output_bound_takes_out_only_what_it_names_and_puts_it_back(tmp_path, what):
    """bench/per_output_bound.py patches the engine for its runs without: each patch must take out its work
    (the eager results' entries, or the auditor's check of a forged entry) and nothing else, and put the
    engine back, or every later run in the process would time a broken engine."""
    import torch

    import per_output_bound
    from veritrain import engine
    from veritrain.engine import EngineConfig, step_context
    from veritrain.logformat import StepLogReader, StepLogWriter, read_records, write_records

    before = (engine.TrainerHalf.record, engine.AuditorHalf.replay, engine._EagerSlot.candidate_indices)
    config = EngineConfig(thresholds={"accumulate": 2.0**25, "elementwise": 2.0**25})
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(30, 40, generator=g), torch.randn(40, 20, generator=g)

    def trained(log, without=None):
        restore = per_output_bound._without(without)
        try:
            w = StepLogWriter(str(log), 0, 32)
            with step_context(config, 0, writer=w):
                y = torch.mm(a, b).exp()  # an eager product, then a (small: eager) elementwise op
            w.close()
        finally:
            restore()
        return y, [o.n_entries for r in read_records(str(log))[2] for o in r.outputs]

    y, entries = trained(tmp_path / "honest.vtlog")
    assert all(entries), entries
    if what != "checks":
        _, without = trained(tmp_path / "without.vtlog", what)
        assert without == [0, 0], without
    else:
        _, bits, records = read_records(str(tmp_path / "honest.vtlog"))
        out = records[0].outputs[0]
        out.dir_bits = ~out.dir_bits  # every entry of the product forged: directions the wrong way, values doubled
        out.val_bits = (out.val_bits.view("float32") * 2).view("uint32")
        write_records(str(tmp_path / "forged.vtlog"), 0, bits, records)
        counts = []
        for without in (None, "checks"):
            restore = per_output_bound._without(without)
            try:
                with StepLogReader(str(tmp_path / "forged.vtlog"), expect_step=0, expect_bits=32) as r, \
                        step_context(config, 0, reader=r) as mode:
                    torch.mm(a, b).exp()
            finally:
                restore()
            counts.append(mode.stats.suspicious_count)
        assert counts[0] > 0 and counts[1] == 0, counts
    assert (engine.TrainerHalf.record, engine.AuditorHalf.replay, engine._EagerSlot.candidate_indices) == before


def test_the_engine_bench_shows_how_far_the_per_step_ratios_spread_and_how_many_steps_meet_each_target():
    """bench/bench_engine.py's table gives each verified mode's median ratio with the smallest and largest per-step
    ratio, and its verdict counts the steps within each target: a median near a target on a machine whose plain
    float64 step swings by a third says little alone (docs/SPEED-RECORD.md, sessions 56 and 57)."""
    import bench_engine

    ratios = {"fp32": [0.5, 0.5, 0.5], "fp64": [1.0, 1.0, 1.0], "trainer": [1.30, 1.09, 1.45],
              "auditor": [1.10, 0.96, 1.24]}
    r = {"name": "gpt2-117m", "description": "GPT-2 117M", "steps": 3, "ratios": ratios,
         "ratio": {m: sorted(v)[1] for m, v in ratios.items()}, "median_s": {"fp64": 5.2}, "rounded": 2.1e9,
         "entries": 36000, "log_bytes": 118e3, "dense_bytes": 423e6, "log_fraction": 118e3 / 423e6,
         "corrections": 0, "suspicious": 0}
    text = bench_engine.markdown([r], "cmd")
    assert "| GPT-2 117M | 3 | 0.50x | 1.30x (1.09-1.45x) | 1.10x (0.96-1.24x) | 5.2 s |" in text
    assert "not met: trainer 1.30x > 1.15x (steps within the target: trainer 1 of 3, auditor 2 of 3)" in text
    one = dict(r, steps=1, ratios={m: v[:1] for m, v in ratios.items()}, ratio={m: v[0] for m, v in ratios.items()})
    assert "| GPT-2 117M | 1 | 0.50x | 1.30x | 1.10x | 5.2 s |" in bench_engine.markdown([one], "cmd")


def test_the_time_measurement_returns_every_counted_steps_ratio_in_order(monkeypatch):
    """timecost.measure: besides each mode's median ratio to plain float64, the per-step ratios it is the median
    of, one per counted step (the engine bench's ranges and counts of steps within a target come from them)."""
    import statistics

    from veritrain.experiments import timecost

    monkeypatch.setenv("VERITRAIN_COMPILE", "0")
    r = timecost.measure("digits-cnn", {}, 3, progress=None)
    assert set(r["ratios"]) == set(timecost.MODES)
    assert all(len(v) == 3 for v in r["ratios"].values()) and r["ratios"]["fp64"] == [1.0, 1.0, 1.0]
    assert all(r["ratio"][m] == statistics.median(v) for m, v in r["ratios"].items())
