"""Captured composites (capture.py): a decomposed operator replayed as one function, compiled or run as
Python, gives the eager engine's results and log, bit for bit, for the trainer and the auditor; anything the
eager engine would log or check inside a region (a candidate, a log entry, a scalar entry, another record)
runs it step by step.

Every region here is below the size threshold: with VERITRAIN_COMPILE=1 each replays compiled, by default
("auto") each replays as Python."""

import hashlib
import math
import warnings

import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st

from veritrain import capture
from veritrain.engine import EngineConfig, logged_step
from veritrain.logformat import OutputEntries, StepLogReader, StepLogWriter, read_records, write_records

STEPS = 3


class Net(torch.nn.Module):
    """Every decomposition: BatchNorm (training and eval), LayerNorm, softmax and log-softmax, forward and
    backward."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.conv = torch.nn.Conv2d(3, 6, 3, padding=1)
        self.bn = torch.nn.BatchNorm2d(6)
        self.frozen = torch.nn.BatchNorm2d(6).eval()
        self.fc = torch.nn.Linear(6 * 8 * 8, 12)
        self.ln = torch.nn.LayerNorm(12)

    def forward(self, x):
        h = self.frozen(torch.relu(self.bn(self.conv(x)))).flatten(1)
        h = self.ln(self.fc(h))
        return torch.log_softmax(h, -1) + torch.softmax(h, -1)


def batch(step):
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(8, 3, 8, 8, generator=g), torch.randint(0, 12, (8,), generator=g)


def train(tmp_path, name, compile_mode, monkeypatch, config=None, replay_of=None):
    """Train (or, with ``replay_of``, replay that run's logs) STEPS steps; returns (weights digest, stats)."""
    monkeypatch.setenv("VERITRAIN_COMPILE", compile_mode)
    capture._CACHE.clear()
    capture._CALLS.clear()
    net = Net()
    opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    cfg = config or EngineConfig()
    stats = []
    for s in range(STEPS):
        x, y = batch(s)
        io = step_log(tmp_path, name, s, replay_of)
        with logged_step(cfg, s, **io) as mode:
            opt.zero_grad()
            out = net(x)
            loss = -out[torch.arange(8), y].mean()
            loss.backward()
            opt.step()
        stats.append(mode.stats)
    digest = hashlib.sha256(b"".join(t.detach().numpy().tobytes() for t in net.state_dict().values())).hexdigest()
    return digest, stats


def step_log(tmp_path, name, step, replay_of=None) -> dict:
    """``logged_step``'s log argument: a writer of run ``name``'s log of ``step``, or a reader of ``replay_of``'s."""
    if replay_of is None:
        return {"writer": StepLogWriter(str(tmp_path / f"{name}-{step}.vtlog"), step, 32)}
    return {"reader": StepLogReader(str(tmp_path / f"{replay_of}-{step}.vtlog"), expect_step=step, expect_bits=32)}


def regions():
    return {k[0].name(): (v.replays, v.fallbacks) for k, v in capture._CACHE.items() if isinstance(v, capture.Region)}


def compiled():
    """Whether each captured region's replays ran compiled, by the decomposition's name."""
    return {k[0].name(): v.compiled for k, v in capture._CACHE.items() if isinstance(v, capture.Region)}


BOTH = pytest.mark.parametrize("compile_mode", ["1", "auto"], ids=["compiled", "python"])


def log_bytes(tmp_path, name):
    return [(tmp_path / f"{name}-{s}.vtlog").read_bytes() for s in range(STEPS)]


@BOTH
def test_the_trainer_writes_the_eager_log_and_weights(tmp_path, monkeypatch, compile_mode):
    eager, eager_stats = train(tmp_path, "eager", "0", monkeypatch)
    assert not capture._CACHE  # VERITRAIN_COMPILE=0: the eager engine, nothing captured
    captured, captured_stats = train(tmp_path, "captured", compile_mode, monkeypatch)
    assert set(compiled().values()) == {compile_mode == "1"}
    replayed = regions()
    # every decomposition was captured and replayed (so the comparison below is not eager against eager)
    assert {"aten::native_batch_norm", "aten::native_batch_norm_backward", "aten::native_layer_norm",
            "aten::native_layer_norm_backward", "aten::_softmax", "aten::_log_softmax"} <= set(replayed)
    assert all(r > 0 for r, _ in replayed.values()), replayed
    assert captured == eager
    assert log_bytes(tmp_path, "captured") == log_bytes(tmp_path, "eager")
    assert [s.as_dict() for s in captured_stats] == [s.as_dict() for s in eager_stats]


def test_a_small_region_replays_as_python_and_is_compiled_once_its_signature_is_hot(tmp_path, monkeypatch):
    """Below the size threshold (every region here is) a signature is recorded at its first call and replayed
    from the next by its function run as Python, with nothing to compile; once it has been called
    VERITRAIN_CAPTURE_HOT_CALLS times it replays compiled, in the trainer and in the auditor. The eager engine's
    weights, log and statistics throughout. Each decomposition is called once a step here."""
    eager, eager_stats = train(tmp_path, "eager", "0", monkeypatch)
    default, default_stats = train(tmp_path, "default", "auto", monkeypatch)
    assert regions() and all(r == STEPS - 1 and f == 0 for r, f in regions().values()), regions()
    assert not any(compiled().values())  # 3 calls of each: far from the default's 5000
    assert default == eager
    assert log_bytes(tmp_path, "default") == log_bytes(tmp_path, "eager")
    assert [s.as_dict() for s in default_stats] == [s.as_dict() for s in eager_stats]
    monkeypatch.setenv("VERITRAIN_CAPTURE_HOT_CALLS", "2")
    hot, hot_stats = train(tmp_path, "hot", "auto", monkeypatch)
    assert all(compiled().values()) and all(r == STEPS - 1 for r, _ in regions().values()), regions()
    assert hot == eager
    assert log_bytes(tmp_path, "hot") == log_bytes(tmp_path, "eager")
    assert [s.as_dict() for s in hot_stats] == [s.as_dict() for s in eager_stats]
    eager_audit, eager_audit_stats = train(tmp_path, "x", "0", monkeypatch, replay_of="hot")
    audited, audit_stats = train(tmp_path, "x", "auto", monkeypatch, replay_of="hot")
    assert regions() and all(r == STEPS - 1 for r, _ in regions().values()) and all(compiled().values())
    assert audited == eager_audit == eager and not any(s.suspicious_count for s in audit_stats)
    assert [s.as_dict() for s in audit_stats] == [s.as_dict() for s in eager_audit_stats]
    monkeypatch.setenv("VERITRAIN_CAPTURE_HOT_CALLS", "0")  # never compiled
    assert train(tmp_path, "never", "auto", monkeypatch)[0] == eager
    assert regions() and not any(compiled().values())


def test_a_sum_in_a_region_run_as_python_is_certified_only_where_its_plain_scale_flags(tmp_path, monkeypatch):
    """A region run as Python tests a sum with its scale before the exactness certificate, and certifies it
    only where that test flags (the certified scale is 0 or the same, and the test is monotone in the scale).
    A tiny threshold for sums: nothing flags, so no certificate is computed while every region replays; a
    huge one: every sum flags, every one is certified, and since these sums are exact the regions still
    replay. The eager engine's weights and log in both."""
    tested, certified = [], []
    scale, lazily = capture._certified_scale, capture._certified_flag_lazily
    monkeypatch.setattr(capture, "_certified_scale", lambda *a: certified.append(1) or scale(*a))
    monkeypatch.setattr(capture, "_certified_flag_lazily", lambda *a: tested.append(1) or lazily(*a))
    for name, accumulate in (("tiny", 2.0**-30), ("huge", 2.0**40)):
        config = EngineConfig(thresholds={"accumulate": accumulate, "elementwise": 32.0})
        eager, _ = train(tmp_path, f"eager-{name}", "0", monkeypatch, config=config)
        tested.clear(), certified.clear()
        captured, _ = train(tmp_path, name, "auto", monkeypatch, config=config)
        assert regions() and all(r == STEPS - 1 and f == 0 for r, f in regions().values()), regions()
        assert captured == eager
        assert log_bytes(tmp_path, name) == log_bytes(tmp_path, f"eager-{name}")
        # BatchNorm's sums (its mean and variance forward, two sums backward) and the softmaxes' one
        assert len(tested) >= 4 * (STEPS - 1)
        # at the tiny threshold only sums of about zero flag (below float32's normal range any scale does)
        assert len(certified) < len(tested) / 2 if name == "tiny" else len(certified) == len(tested), \
            (name, len(tested), len(certified))


def test_the_lazy_certificate_gives_the_certified_tests_answer():
    """capture._certified_flag_lazily against the test of the certified scale itself, on sums of float32
    values that are exact (certified: scale 0) or not (a summand 2**-100 beside ones of about 1, or an
    infinite or NaN one), at thresholds that flag nothing, some or everything."""
    from veritrain.rounding import Grid, any_candidate

    rng = np.random.default_rng(0)
    flag = lambda y, s, c: any_candidate(y, s, c, Grid(32))  # noqa: E731
    answers = set()
    for case in range(300):
        x = (rng.standard_normal((4, 6, 5)) * 2.0 ** rng.integers(-20, 20, (4, 1, 1))).astype(np.float32)
        if case % 3 == 0:
            x[rng.integers(4), rng.integers(6), 0] = 2.0**-100
        if case % 10 == 5:  # a sum that is infinite or NaN: never certified
            x[rng.integers(4), rng.integers(6), 1] = (np.inf, -np.inf, np.nan)[case % 3]
        x = torch.from_numpy(x).to(torch.float64)
        dims, keep = ([0, 2], False) if case % 2 else ([2], True)
        a = x.abs()
        t = a.sum(dims, keepdim=keep)
        s, y = math.sqrt(x.numel() / t.numel()) * t, x.sum(dims, keepdim=keep)
        for c in (2.0**-30, 8.0, 2.0**20, 2.0**40):
            with np.errstate(invalid="ignore"):  # inf - inf in the NumPy test: NaN, as it means to
                want = flag(y, capture._certified_scale(a, t, s, dims, keep), c)
                assert capture._certified_flag_lazily(flag, y, s, a, t, (dims, keep), c) == want, (case, c)
                answers.add((want, flag(y, s, c)))
    assert answers == {(False, False), (False, True), (True, True)}  # each way the two tests can go


def test_any_flag_finds_one_candidate_anywhere():
    """capture._any_flag reduces each flag along its last dimension first (so that inductor fuses it into the
    op's loop): still true for a single flagged value at any position of flags of every rank, false for none, an
    empty flag beside them changing nothing; the same compiled."""
    shapes = [(), (7,), (3, 5), (2, 3, 4, 5), (0, 3)]
    flags = [torch.zeros(s) for s in shapes]
    assert not bool(capture._any_flag(flags)) and not bool(capture._any_flag([flags[-1]]))
    for f in flags:
        for i in range(f.numel()):
            f.view(-1)[i] = 1.0
            assert bool(capture._any_flag(flags)), (tuple(f.shape), i)
            f.view(-1)[i] = 0.0
    compiled = torch.compile(lambda *fs: capture._any_flag(list(fs)), dynamic=False, fullgraph=True)
    assert not bool(compiled(*flags))
    flags[3][1, 2, 3, 4] = 1.0
    assert bool(compiled(*flags))


@BOTH
def test_the_auditor_replays_an_eager_trainer_with_capture(tmp_path, monkeypatch, compile_mode):
    trained, _ = train(tmp_path, "run", "0", monkeypatch)
    eager, eager_stats = train(tmp_path, "x", "0", monkeypatch, replay_of="run")
    audited, audit_stats = train(tmp_path, "x", compile_mode, monkeypatch, replay_of="run")
    assert all(r > 0 for r, _ in regions().values()) and regions()
    assert set(compiled().values()) == {compile_mode == "1"}
    assert audited == trained == eager
    assert [s.as_dict() for s in audit_stats] == [s.as_dict() for s in eager_stats]
    assert not any(s.suspicious_count for s in audit_stats)


@pytest.mark.parametrize("compiled_call", ["runs", "fails"])
def test_the_auditor_matches_a_regions_honest_records_as_one_byte_string(tmp_path, monkeypatch, compiled_call):
    """A replay consumes its region's records by comparing the log's bytes with their honest encoding
    (``StepLogReader.skip_quiet``); where the compiled call then fails, the records are given back, so the eager
    engine reads and applies them as it would have: the same weights and statistics as the eager auditor."""
    train(tmp_path, "run", "0", monkeypatch)
    eager, eager_stats = train(tmp_path, "x", "0", monkeypatch, replay_of="run")
    matched = []
    skip = StepLogReader.skip_quiet
    monkeypatch.setattr(StepLogReader, "skip_quiet", lambda self, run: matched.append(skip(self, run)) or matched[-1])
    if compiled_call == "fails":
        def fail(self, tensors, compiled):
            raise RuntimeError("a compiled call that fails after its records were read")
        monkeypatch.setattr(capture.Region, "run", fail)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the failure's warning
        audited, stats = train(tmp_path, "x", "1", monkeypatch, replay_of="run")
    assert sum(matched) > 0, matched
    assert audited == eager
    assert [s.as_dict() for s in stats] == [s.as_dict() for s in eager_stats]
    if compiled_call == "fails":
        assert regions() and all(r == 0 for r, _ in regions().values())


@BOTH
def test_a_candidate_inside_a_region_runs_it_step_by_step(tmp_path, monkeypatch, compile_mode):
    """Thresholds so wide that every sum and rsqrt is a candidate: the trainer's region function (compiled or
    run as Python) finds them, so each region with a sum falls back, and the eager engine logs them (the same
    log as without capture)."""
    wide = EngineConfig(thresholds={"accumulate": 2.0**40, "elementwise": 2.0**40})
    eager, _ = train(tmp_path, "eager", "0", monkeypatch, config=wide)
    # a recorded call with entries is not captured (its replays would fall back): capture them anyway
    monkeypatch.setattr(capture, "_entries", lambda stats: 0)
    captured, stats = train(tmp_path, "captured", compile_mode, monkeypatch, config=wide)
    fell_back = regions()
    assert set(compiled().values()) == {compile_mode == "1"}
    assert captured == eager
    assert log_bytes(tmp_path, "captured") == log_bytes(tmp_path, "eager")
    assert fell_back["aten::native_batch_norm"][1] > 0 and fell_back["aten::native_layer_norm"][1] > 0, fell_back
    assert sum(s.entries_total for s in stats) > 0


def _forge(tmp_path, name, step, op_name, edit):
    """Rewrite one step's log with ``edit`` applied to the first and the last record named ``op_name`` (the
    last one's name already has its id when a region reads it)."""
    path = str(tmp_path / f"{name}-{step}.vtlog")
    _, bits, records = read_records(path)
    named = [i for i, r in enumerate(records) if r.name == op_name]
    for k in {named[0], named[-1]}:
        edit(records[k])
    write_records(path, step, bits, records)


@BOTH
@pytest.mark.parametrize("forgery", ["direction entry", "scalar entry"])
def test_a_forged_entry_inside_a_region_is_checked_as_without_capture(tmp_path, monkeypatch, forgery, compile_mode):
    """A dishonest log with an entry for an op inside a captured region (a BatchNorm mean far from any
    midpoint; a scalar entry for eps that rounds it the other way): the auditor with capture runs the region
    step by step and names the same suspicious entries as the eager auditor."""
    train(tmp_path, "run", "0", monkeypatch)

    def direction(rec):
        rec.outputs[0] = OutputEntries(rec.outputs[0].shape, np.array([0], np.int64), np.array([True]))

    def scalar(rec):
        rec.scalars = [(1, True)]  # add.Tensor(var, eps): eps is not near a float32 midpoint

    edit, op = (direction, "aten.mean.dim") if forgery == "direction entry" else (scalar, "aten.add.Tensor")
    for s in range(1, STEPS):
        _forge(tmp_path, "run", s, op, edit)
    eager, eager_stats = train(tmp_path, "x", "0", monkeypatch, replay_of="run")
    audited, audit_stats = train(tmp_path, "x", compile_mode, monkeypatch, replay_of="run")
    # the regions with a forged record ran step by step, the others replayed
    replays = [(v.replays, v.fallbacks) for v in capture._CACHE.values() if isinstance(v, capture.Region)]
    assert any(r > 0 for r, _ in replays) and any(f > 0 for _, f in replays), replays
    assert [s.suspicious_count for s in audit_stats] == [s.suspicious_count for s in eager_stats]
    assert sum(s.suspicious_count for s in audit_stats) >= STEPS - 1
    assert [[(x.op, x.kind, x.position) for x in s.suspicious] for s in audit_stats] == \
        [[(x.op, x.kind, x.position) for x in s.suspicious] for s in eager_stats]
    assert audited == eager


def test_a_log_that_ends_inside_a_region_is_a_replay_mismatch(tmp_path, monkeypatch):
    from veritrain.engine import ReplayMismatchError

    train(tmp_path, "run", "0", monkeypatch)
    path = str(tmp_path / "run-1.vtlog")
    _, bits, records = read_records(path)
    cut = max(i for i, r in enumerate(records) if r.name == "aten.rsqrt.default")
    write_records(path, 1, bits, records[:cut])
    with pytest.raises(ReplayMismatchError, match="log ends before this op"):
        train(tmp_path, "x", "1", monkeypatch, replay_of="run")


def test_a_reader_gives_back_records_in_order(tmp_path):
    path = str(tmp_path / "a.vtlog")
    w = StepLogWriter(path, 0, 32)
    for name in ("a", "b", "c"):
        w.op(name, [], [OutputEntries((2,))], 2)
    w.close()
    r = StepLogReader(path)
    got = [r.next_op(), r.next_op()]
    r.unread(got)
    assert [r.next_op().name for _ in range(3)] == ["a", "b", "c"]
    assert r.next_op() is None
    r.unread([])
    assert r.next_op() is None


# --- row-local regions: the rows with something to log or check run step by step, the others replay ------------

ROWS, WIDTH = 64, 64
# thresholds at which a few of the 64 rows of each softmax region have a candidate in most steps
SOME_ROWS = EngineConfig(thresholds={"accumulate": 2.0**18, "elementwise": 2.0**18})


def train_rows(tmp_path, name, compile_mode, monkeypatch, replay_of=None):
    """A linear layer under a log-softmax over 64 rows of 64 (forward and backward: row-local regions),
    trained or replayed STEPS + 1 steps; returns (weights digest, stats, suspicious entries)."""
    monkeypatch.setenv("VERITRAIN_COMPILE", compile_mode)
    capture._CACHE.clear()
    capture._CALLS.clear()
    torch.manual_seed(0)
    fc = torch.nn.Linear(16, WIDTH)
    opt = torch.optim.SGD(fc.parameters(), lr=0.1)
    stats = []
    for s in range(STEPS + 1):
        g = torch.Generator().manual_seed(s)
        x, y = torch.randn(ROWS, 16, generator=g), torch.randint(0, WIDTH, (ROWS,), generator=g)
        io = step_log(tmp_path, name, s, replay_of)
        with logged_step(SOME_ROWS, s, **io) as mode:
            opt.zero_grad()
            loss = -torch.log_softmax(fc(x), -1)[torch.arange(ROWS), y].mean()
            loss.backward()
            opt.step()
        stats.append(mode.stats)
    digest = hashlib.sha256(b"".join(t.detach().numpy().tobytes() for t in fc.state_dict().values())).hexdigest()
    suspicious = [[(x.op_index, x.op, x.kind, x.slot, x.position) for x in s.suspicious] for s in stats]
    return digest, [s.as_dict() for s in stats], suspicious


def row_replays():
    """Each captured region's (replays, of which by rows, fallbacks), by the decomposition's name."""
    return {k[0].name(): (v.replays, v.row_replays, v.fallbacks) for k, v in capture._CACHE.items()
            if isinstance(v, capture.Region)}


def rows_log_bytes(tmp_path, name):
    return [(tmp_path / f"{name}-{s}.vtlog").read_bytes() for s in range(STEPS + 1)]


def test_a_trainers_row_local_region_runs_only_the_rows_with_candidates_step_by_step(tmp_path, monkeypatch):
    """The compiled log-softmax regions flag candidates in a few rows: only those rows run under the eager
    engine, and the log (entries at their positions in the whole call), the weights and the statistics are the
    eager engine's, bit for bit."""
    eager = train_rows(tmp_path, "eager", "0", monkeypatch)
    captured = train_rows(tmp_path, "captured", "1", monkeypatch)
    replays = row_replays()
    assert set(replays) == {"aten::_log_softmax", "aten::_log_softmax_backward_data"}, replays
    assert all(rows > 0 and fell_back == 0 for _, rows, fell_back in replays.values()), replays
    assert sum(sum(s["entries_direction"].values()) for s in captured[1]) > 0
    assert captured == eager
    assert rows_log_bytes(tmp_path, "captured") == rows_log_bytes(tmp_path, "eager")


@BOTH
def test_an_auditors_row_local_region_runs_only_the_rows_with_entries_step_by_step(tmp_path, monkeypatch,
                                                                                   compile_mode):
    """Compiled, the regions run only their rows with entries step by step; run as Python (small regions), the
    whole call, which costs about as much. The eager auditor's weights and statistics either way."""
    train_rows(tmp_path, "run", "0", monkeypatch)
    eager = train_rows(tmp_path, "x", "0", monkeypatch, replay_of="run")
    audited = train_rows(tmp_path, "x", compile_mode, monkeypatch, replay_of="run")
    replays = row_replays()
    assert replays and all((rows > 0 and fell_back == 0) if compile_mode == "1" else (rows == 0 and fell_back > 0)
                           for _, rows, fell_back in replays.values()), replays
    assert audited == eager
    assert not any(audited[2])


@BOTH
def test_a_forged_entry_in_a_row_local_region_is_named_where_it_is_in_the_whole_call(tmp_path, monkeypatch,
                                                                                     compile_mode):
    """A dishonest log adds direction entries far from any midpoint to the log-softmax's exp, in rows that had
    no entry: the auditor runs those rows step by step and names each forged entry by its position in the
    whole output, as the eager auditor does."""
    train_rows(tmp_path, "run", "0", monkeypatch)
    forged = [70, 1000, ROWS * WIDTH - 1]

    def add_entries(rec):
        o = rec.outputs[0]
        had = dict(zip(o.dir_pos.tolist(), o.dir_bits.tolist()))
        pos = np.union1d(o.dir_pos, forged).astype(np.int64)
        rec.outputs[0] = OutputEntries(o.shape, pos, np.array([had.get(p, True) for p in pos.tolist()]),
                                       o.val_pos, o.val_bits)

    for s in range(1, STEPS + 1):
        path = str(tmp_path / f"run-{s}.vtlog")
        _, bits, records = read_records(path)
        add_entries(next(r for r in records if r.name == "aten.exp.default"))  # the forward's
        write_records(path, s, bits, records)
    eager = train_rows(tmp_path, "x", "0", monkeypatch, replay_of="run")
    audited = train_rows(tmp_path, "x", compile_mode, monkeypatch, replay_of="run")
    assert row_replays()["aten::_log_softmax"][1] == (STEPS if compile_mode == "1" else 0), row_replays()
    named = [sorted(p for _, op, kind, _, p in step if op == "aten.exp.default") for step in audited[2][1:]]
    assert all(set(forged) <= set(positions) for positions in named), named
    assert audited == eager


@pytest.mark.parametrize("role", ["trainer", "auditor"])
def test_rows_whose_stream_is_not_the_regions_run_the_whole_call_step_by_step(tmp_path, monkeypatch, role):
    """Where the rows' run under the engine writes or reads other records than the region's (it never does:
    here one more op is forced into it), nothing it did is kept: the whole call runs step by step, with the eager
    engine's log, weights and statistics."""
    train_rows(tmp_path, "run", "0", monkeypatch)
    eager = train_rows(tmp_path, "x", "0", monkeypatch, replay_of="run" if role == "auditor" else None)
    real = capture.fallback

    def one_more_op(mode, func, args, kwargs):
        if args[0].shape[0] < ROWS:  # the rows' run
            with mode:
                torch.ones(3).exp()
        return real(mode, func, args, kwargs)

    monkeypatch.setattr(capture, "fallback", one_more_op)
    captured = train_rows(tmp_path, "x", "1", monkeypatch, replay_of="run" if role == "auditor" else None)
    replays = row_replays()
    assert all(rows == 0 and fell_back > 0 for _, rows, fell_back in replays.values()) and replays, replays
    assert captured == eager
    if role == "trainer":
        assert rows_log_bytes(tmp_path, "x") == rows_log_bytes(tmp_path, "run")


def test_an_auditors_rows_apply_a_worst_case_trainers_corrections(tmp_path, monkeypatch):
    """The trainer runs on the worst hardware the error model allows (``perturb``, where capture is off), so some
    of its entries in the regions' rows contradict this CPU's rounding: the compiled auditor's rows' runs apply
    them, reaching the eager auditor's weights and statistics, corrections included, with nothing suspicious."""
    monkeypatch.setenv("VERITRAIN_EMULATE", "perturb")
    trained = train_rows(tmp_path, "run", "0", monkeypatch)
    monkeypatch.delenv("VERITRAIN_EMULATE")
    eager = train_rows(tmp_path, "x", "0", monkeypatch, replay_of="run")
    in_rows = []
    real = capture._replay_rows

    def counted(mode, *args, **kwargs):
        before = sum(mode.stats.corrections.values())
        done = real(mode, *args, **kwargs)
        in_rows.append(sum(mode.stats.corrections.values()) - before if done else 0)
        return done

    monkeypatch.setattr(capture, "_replay_rows", counted)
    audited = train_rows(tmp_path, "x", "1", monkeypatch, replay_of="run")
    replays = row_replays()
    assert replays and all(rows > 0 and fell_back == 0 for _, rows, fell_back in replays.values()), replays
    assert sum(in_rows) > 0, "perturb never crossed a midpoint in the rows' runs: the check is vacuous"
    assert audited == eager and not any(audited[2])
    assert audited[0] == trained[0]


@pytest.mark.parametrize("role", ["trainer", "auditor"])
def test_a_region_with_candidates_or_entries_in_many_rows_runs_the_whole_call_step_by_step(tmp_path, monkeypatch,
                                                                                          role):
    train_rows(tmp_path, "run", "0", monkeypatch)
    eager = train_rows(tmp_path, "x", "0", monkeypatch, replay_of="run" if role == "auditor" else None)
    monkeypatch.setattr(capture, "MAX_ROW_SHARE", 0.0)
    captured = train_rows(tmp_path, "x", "1", monkeypatch, replay_of="run" if role == "auditor" else None)
    replays = row_replays()
    assert all(rows == 0 for _, rows, _ in replays.values()) and any(f for _, _, f in replays.values()), replays
    assert captured == eager


@settings(max_examples=200, deadline=None)
@given(st.data())
def test_entries_move_between_a_whole_output_and_its_rows_part_and_back(data):
    """capture._to_rows and capture._in_rows on random outputs (rows of n values, or one per row, behind any
    leading shape), picked rows and entries in them: each entry keeps its row and column, the positions stay
    strictly increasing, and the round trip gives the whole output's entries back."""
    lead = data.draw(st.lists(st.integers(1, 6), min_size=1, max_size=3))
    rows = int(np.prod(lead))
    width = data.draw(st.sampled_from([1, data.draw(st.integers(1, 40))]))
    picked = np.array(sorted(data.draw(st.sets(st.integers(0, rows - 1), min_size=1))), np.int64)
    shape = tuple(lead) + (width,)
    candidates = (picked[:, None] * width + np.arange(width)).reshape(-1)
    chosen = np.array(sorted(data.draw(st.sets(st.sampled_from(candidates.tolist())))), np.int64)
    split = data.draw(st.lists(st.booleans(), min_size=len(chosen), max_size=len(chosen)))
    is_dir = np.array(split, bool)
    whole = OutputEntries(shape, chosen[is_dir], np.ones(int(is_dir.sum()), bool), chosen[~is_dir],
                          np.arange(int((~is_dir).sum()), dtype=np.uint32))
    part_shape = (len(picked),) + (1,) * (len(shape) - 2) + (width,)
    part = capture._to_rows(whole, part_shape, picked)
    for pos, sub in ((whole.dir_pos, part.dir_pos), (whole.val_pos, part.val_pos)):
        assert (np.diff(sub) > 0).all() and ((sub >= 0) & (sub < len(picked) * width)).all()
        assert (picked[sub // width] == pos // width).all() and (sub % width == pos % width).all()
    back = capture._in_rows(part, shape, picked)
    assert back.shape == shape
    for a, b in ((whole.dir_pos, back.dir_pos), (whole.val_pos, back.val_pos), (whole.dir_bits, back.dir_bits),
                 (whole.val_bits, back.val_bits)):
        assert np.array_equal(a, b)
