"""Matrix products with a large float32 operand computed block by block (blocked.py, engine._try_blocked_mm):
each split gives the float64 product and the operands' norms within float64's own error, the engine's results
and log bytes are the eager path's, each side replays the other's log, and the auditor's check of an entry in
a blocked product uses the rule's error scale (a forged decision beyond it is caught)."""

import pytest
import torch

from conftest import forge_wrong_directions
from veritrain import blocked, rules
from veritrain.engine import EngineConfig, step_context
from veritrain.logformat import StepLogReader, StepLogWriter
from veritrain.rounding import UNIT_ROUNDOFF, Grid

aten = torch.ops.aten
C = 2.0**25  # about one result in eight is a log entry: the comparisons cover entries
WIDE = EngineConfig(thresholds={"accumulate": C})


def _operands(case, seed=0, mixed=True):
    """(a, b) for the three splits: "k" a layer-input gradient's shape (K long), "m" a weight gradient's (a^T of
    a wide gradient: a transposed view, as autograd passes it), "n" the logits' (h @ W^T, W^T a transposed
    view, as a linear layer passes it)."""
    g = torch.Generator().manual_seed(seed)
    wide = torch.randn(*{"k": (48, 3001), "m": (256, 3001), "n": (3001, 56)}[case], generator=g)
    other = torch.randn({"k": (3001, 40), "m": (256, 24), "n": (24, 56)}[case], generator=g)
    if mixed:
        wide = wide * torch.exp(2 * torch.randn(wide.shape, generator=g))  # mixed magnitudes: varied scales
        wide.view(-1)[::97] = 0.0
    else:  # positive: every result well away from 0, so tau is a steady share of its grid spacing
        wide, other = wide.exp(), other.exp()
    return {"k": (wide, other), "m": (wide.t(), other), "n": (other, wide.t())}[case]


def _by_blocks(a, b, how, block, norms=True):
    """blocked.mm_in_blocks' blocks put together: (y, rows, cols), and where each block starts. The buffers it
    hands over are reused by the next block, so each is copied out at once."""
    y = torch.full((a.shape[0], b.shape[1]), float("nan"), dtype=torch.float64)
    rows = torch.full((a.shape[0], 1), float("nan"), dtype=torch.float64)
    cols = torch.full((1, b.shape[1]), float("nan"), dtype=torch.float64)
    starts = []

    def finish(r, c, block_y, block_rows, block_cols):
        starts.append(r.start if how == "m" else c.start)
        assert block_y.shape == y[r, c].shape
        y[r, c] = block_y
        if norms:
            rows[r] = block_rows
            cols[:, c] = block_cols
        else:
            assert block_rows is None and block_cols is None
    blocked.mm_in_blocks(a, b, how, finish, norms, block)
    return y, (rows, cols) if norms else (None, None), starts


def test_each_split_is_the_float64_product_and_its_norms(monkeypatch):
    monkeypatch.setenv("VERITRAIN_COMPILE", "1")
    for case, laid_out in (("k", False), ("m", False), ("m", True), ("n", False), ("n", True)):
        a, b = _operands(case)
        if laid_out and case == "m":  # a weight gradient's a stored in its own row order, not as a transposed view
            a = a.contiguous()
        if laid_out and case == "n":  # a b stored in its own order, not a linear layer's W^T
            b = b.contiguous()
        assert a.is_contiguous() == (case in "kn" or laid_out)
        assert b.t().is_contiguous() == (case == "n" and not laid_out)
        assert blocked.split(a, b) == case
        a64, b64 = a.double(), b.double()
        ref = a64 @ b64
        (m, k), n = a.shape, b.shape[1]
        for block in (1000, 1 << 14, 1 << 30):  # many blocks with a remainder, a few, one
            if case == "k":
                y_only = blocked.mm(a, b, block, norms=False)
                assert y_only[1:] == (None, None) and torch.equal(y_only[0], blocked.mm(a, b, block)[0])
                y, rows, cols = blocked.mm(a, b, block)
            else:
                y_only, no_norms, _ = _by_blocks(a, b, case, block, norms=False)
                y, (rows, cols), starts = _by_blocks(a, b, case, block)
                assert no_norms == (None, None) and torch.equal(y_only, y)
                step = max(1, block // max(k, n)) if case == "m" else max(1, block // max(m, k))
                assert starts == list(range(0, m if case == "m" else n, step))
            assert y.dtype == torch.float64 and y.shape == ref.shape and y.is_contiguous()
            assert torch.allclose(rows, torch.linalg.vector_norm(a64, dim=1, keepdim=True), rtol=1e-13, atol=0)
            assert torch.allclose(cols, torch.linalg.vector_norm(b64, dim=0, keepdim=True), rtol=1e-13, atol=0)
            # another summation order: within float64's error bound for a dot product of length k
            bound = a.shape[1] * 2.0**-53 * (a64.abs() @ b64.abs())
            assert bool(((y - ref).abs() <= bound).all())
    with pytest.raises(ValueError, match="unknown split"):
        blocked.mm_in_blocks(a, b, "k", lambda *args: None)


def test_the_split_follows_the_large_operands_long_dimension(monkeypatch):
    monkeypatch.setenv("VERITRAIN_COMPILE", "auto")
    monkeypatch.setenv("VERITRAIN_BLOCK_MIN_NUMEL", "1000")
    wide = torch.zeros(16, 5000)
    assert blocked.split(wide, torch.zeros(5000, 8)) == "k"  # a's long side is K: the layer input's gradient
    assert blocked.split(wide.t(), torch.zeros(16, 8)) == "m"  # a's long side is M: the weight's gradient
    assert blocked.split(torch.zeros(8, 16), wide) == "n"  # b's long side is N: the logits
    assert blocked.split(torch.zeros(8, 16), torch.zeros(5000, 16).t()) == "n"  # as a linear layer passes W^T
    assert blocked.split(torch.zeros(8, 5000), wide.t()) == "k"  # b large, its long side K
    assert blocked.split(wide.double(), torch.zeros(5000, 8, dtype=torch.float64)) is None
    assert blocked.split(torch.zeros(4, 5), torch.zeros(5, 3)) is None  # below the threshold
    monkeypatch.setenv("VERITRAIN_COMPILE", "0")
    assert blocked.split(wide, torch.zeros(5000, 8)) is None


def _blocking(monkeypatch, on: bool, compile="auto"):
    """``compile`` "1": a block of the logits' split is rounded and scanned by the compiled epilogue, as at full
    size; "auto": its blocks are below the fused kernels' size, so by the eager rounding and scan. Off is "auto"
    ("1" blocks every product)."""
    monkeypatch.setenv("VERITRAIN_COMPILE", compile if on else "auto")
    monkeypatch.setenv("VERITRAIN_BLOCK_MIN_NUMEL", "0" if on else str(1 << 60))
    monkeypatch.setattr(blocked, "BLOCK_NUMEL", 1000)  # many blocks
    monkeypatch.setattr(blocked, "RESULT_BLOCK_NUMEL", 1000)


def _spy(monkeypatch):
    """The blocked products the engine runs, as (split, whether its blocks take the norms)."""
    calls = []
    real, real_in_blocks = blocked.mm, blocked.mm_in_blocks
    monkeypatch.setattr(blocked, "mm", lambda *args, **kw: calls.append(("k", kw["norms"])) or real(*args, **kw))
    monkeypatch.setattr(blocked, "mm_in_blocks",
                        lambda *args, **kw: calls.append((args[2], kw["norms"])) or real_in_blocks(*args, **kw))
    return calls


def _train(path, a, b, config=WIDE):
    w = StepLogWriter(str(path), 0, 32)
    with step_context(config, 0, writer=w) as mode:
        y = torch.mm(a, b)
    w.close()
    return y, mode


def _audit(path, a, b, config=WIDE):
    with StepLogReader(str(path), expect_step=0, expect_bits=32) as reader:
        with step_context(config, 0, reader=reader) as mode:
            y = torch.mm(a, b)
    return y, mode


# (split, threshold, whether the auditor's blocks take the norms, compile): entries on a quarter of the large
# operand's rows or more (48 rows of a in "k", 3001 in "m", 3001 columns of b in "n") make it take them in the
# blocks; fewer, it reads them at its entries from the float32 operands (6, 381 and 5 entries here; GPT-2 2 x 128's
# logits have 17-150 over 50257 columns). "1": the "m" and "n" blocks are rounded and scanned by the compiled
# epilogue, as at full size; "auto", by the eager rounding and scan (they are below the fused kernels' size)
@pytest.mark.parametrize("case,c,auditor_norms,compile", [
    ("k", C, True, "auto"), ("m", C, True, "auto"), ("m", C, True, "1"), ("k", 64.0, False, "auto"),
    ("m", 1024.0, False, "auto"), ("n", C, True, "auto"), ("n", C, True, "1"), ("n", 64.0, False, "1")])
def test_a_blocked_product_gives_the_eager_results_and_log(tmp_path, monkeypatch, case, c, auditor_norms, compile):
    config = EngineConfig(thresholds={"accumulate": c})
    a, b = _operands(case)
    calls = _spy(monkeypatch)
    _blocking(monkeypatch, True, compile)
    y_b, mode_b = _train(tmp_path / "b.vtlog", a, b, config)
    assert calls == [(case, True)], "the blocked path ran, taking the norms the trainer's scan reads"
    _blocking(monkeypatch, False, compile)
    y_e, mode_e = _train(tmp_path / "e.vtlog", a, b, config)
    assert calls == [(case, True)]
    assert mode_e.stats.entries_total > 0, "the comparison covers log entries"
    assert torch.equal(y_b.view(torch.int32), y_e.view(torch.int32))
    assert (tmp_path / "b.vtlog").read_bytes() == (tmp_path / "e.vtlog").read_bytes()
    for blocked_auditor in (True, False):
        _blocking(monkeypatch, blocked_auditor, compile)
        for log in ("b.vtlog", "e.vtlog"):
            y_a, mode_a = _audit(tmp_path / log, a, b, config)
            assert mode_a.stats.suspicious_count == 0
            assert mode_a.stats.entries_total == mode_e.stats.entries_total
            assert torch.equal(y_a.view(torch.int32), y_e.view(torch.int32))
    assert calls[1:] == [(case, auditor_norms)] * 2


# tau about 1/16 of half a spacing at 2**17 and 2**19; at 2**14 the auditor has few entries (about 240 over 3001
# rows or columns), so it reads the scale at them from the float32 operands, not from the blocks' norms
@pytest.mark.parametrize("case,c,auditor_norms", [("k", 2.0**17, True), ("m", 2.0**19, True), ("m", 2.0**14, False),
                                                  ("n", 2.0**17, True), ("n", 2.0**14, False)])
def test_a_forged_decision_beyond_a_blocked_products_bound_is_caught(tmp_path, monkeypatch, case, c, auditor_norms):
    """The attacker adds direction entries that round the wrong way where the result lies between 1.2 and 1.9
    thresholds from a midpoint: inside the auditor's slack window (2 tau), so only the error scale the blocked
    product's norms give tells that no honest machine rounds there that way."""
    grid = Grid(32)
    config = EngineConfig(thresholds={"accumulate": c})
    a, b = _operands(case, seed=1, mixed=False)
    _blocking(monkeypatch, True)
    _train(tmp_path / "t.vtlog", a, b, config)

    a64, b64 = a.double(), b.double()
    y64 = a64 @ b64
    scale = rules.materialize_scale(rules._mm(rules.Call(aten.mm.default, (a64, b64), {}, [y64]))[0], y64)
    tau = (c * UNIT_ROUNDOFF * scale).reshape(-1)
    dist = grid.midpoint_distance(y64).reshape(-1)
    targets = ((dist > 1.2 * tau) & (dist < 1.9 * tau)).nonzero().flatten()
    assert len(targets) >= 5
    forge_wrong_directions(tmp_path / "t.vtlog", tmp_path / "forged.vtlog", targets, y64, tau)

    calls = _spy(monkeypatch)
    _, mode = _audit(tmp_path / "forged.vtlog", a, b, config)
    assert calls == [(case, auditor_norms)]
    assert mode.stats.suspicious_count == len(targets)  # every forged entry, and nothing else
    assert {s.position for s in mode.stats.suspicious} <= set(targets.tolist())  # the first few, in detail


@pytest.mark.parametrize("how", ["m", "n"])
def test_a_blocks_epilogue_writes_its_rounded_values_where_the_block_lies_in_the_result(monkeypatch, how):
    """The compiled epilogue (and the auditor's rounding, Grid.round_into) write a block's rounded values into its
    view of the result (engine._mm_in_blocks), not into a block of their own then copied: the same bits and flags
    as the block's own result, nothing written outside the view, and one kernel for every block's place in the
    result (a kernel compiled again for each would reach torch.compile's recompile limit and run eagerly)."""
    from torch._dynamo.utils import counters

    from veritrain.fused import Epilogues

    monkeypatch.setenv("VERITRAIN_COMPILE", "1")
    grid, g = Grid(32), torch.Generator().manual_seed(4)
    m, n = (700, 96) if how == "m" else (96, 700)
    result = torch.full((m, n), 7.0)
    epilogues = Epilogues(grid)
    graphs = counters["stats"]["unique_graphs"]
    starts = list(range(0, m if how == "m" else n, 64))
    for i, start in enumerate(starts):
        size = min(64, (m if how == "m" else n) - start)
        where = (slice(start, start + size), slice(None)) if how == "m" else (slice(None), slice(start, start + size))
        y = torch.randn(result[where].shape, generator=g, dtype=torch.float64) * 2.0 ** torch.randint(
            -30, 30, result[where].shape, generator=g)
        rows = torch.rand(y.shape[0], 1, generator=g, dtype=torch.float64) + 1
        cols = torch.rand(1, y.shape[1], generator=g, dtype=torch.float64) + 1
        scale = rules.LazyScale([(rules._sqrt(24), [rows, cols])])
        own_y32, own_flags = epilogues.run(y, scale, 2.0**25)
        if i % 2:  # the auditor's blocks: rounding only
            grid.round_into(y, result[where])
        else:
            into, flags = epilogues.run(y, scale, 2.0**25, into=result[where])
            assert into.data_ptr() == result[where].data_ptr() and torch.equal(flags, own_flags)
        assert torch.equal(result[where].view(torch.int32), own_y32.view(torch.int32))
        assert torch.equal(own_y32, grid.round(y))
        result[where].fill_(7.0)
    assert bool((result == 7.0).all()), "nothing was written outside the blocks' views"
    assert counters["stats"]["unique_graphs"] - graphs <= 4, "one kernel each for fresh and in-place blocks, " \
        "each compiled again at most once (a first specialisation dropped)"
