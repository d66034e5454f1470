"""The faster ways the engine computes error scales give what the rules' definitions give.

Each shortcut here was added after profiling (bench/profile_engine.py): a sum's scale and exactness
certificate in one compiled pass, the NLL loss's scale from the elements it reads, the op call flattened
without the general pytree."""

import collections
import math

import numpy as np
import pytest
import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

from veritrain import rules
from veritrain.engine import EngineConfig, _flatten_call, _unflatten_call, step_context
from veritrain.logformat import StepLogReader, StepLogWriter, read_records
from veritrain.fused import REDUCTIONS, SQUARES, abs_sum_and_min, merged_view, sum_of_squares, vector_norm
from veritrain.rounding import mask_positions

aten = torch.ops.aten


def _reference_sum_scale(x, dims, keep, n):
    """rules._reduction_sum's definition, written out with eager ops: sqrt(n) * sum |x|, zero where the sum
    is certified exact (sum |x| < 2**52 times the float32 ulp of the smallest nonzero |x|)."""
    ax = x.abs()
    s = ax.sum(dims, keepdim=keep)
    smallest = ax.masked_fill(ax == 0, math.inf).amin(dims, keepdim=keep)
    return torch.where(s < 2.0**52 * rules._quantum(smallest), torch.zeros_like(s), math.sqrt(n) * s)


@pytest.mark.parametrize("shape,dims,keep", [((64, 3000), [1], True), ((3000, 64), [0], False),
                                             ((8, 64, 300), [2], True), ((8, 64, 300), [0, 1], False),
                                             ((16, 8, 24, 24), [0, 2, 3], False), ((1, 70000), [-1], True),
                                             ((70000,), [0], False), ((8, 16, 24, 24), [1, 3], True)])
def test_a_sums_scale_and_certificate_follow_the_definition(shape, dims, keep):
    torch.manual_seed(0)
    x = torch.randn(shape, dtype=torch.float64)
    x.view(-1)[::97] = 0
    exact = (torch.randint(-50, 50, shape) * 2.0**-20).to(torch.float64)  # float32 multiples of 2**-20: exact sums
    for values in (x, exact):
        n = math.prod(values.shape[d] for d in dims)
        call = rules.Call(aten.sum.dim_IntList, (values, dims, keep), {}, [values.sum(dims, keepdim=keep)])
        got = rules._reduction_sum(call)[0]
        want = _reference_sum_scale(values, dims, keep, n)
        assert got.shape == want.shape
        assert torch.equal(got == 0, want == 0)  # the same sums certified exact
        assert torch.allclose(got, want, rtol=1e-12, atol=0)
        if values is exact:
            assert not got.any()  # every one of these sums is certified
    sizes, reduced = merged_view(shape, [d % len(shape) for d in dims])
    assert callable(REDUCTIONS.get((len(sizes), reduced)))  # the compiled pass ran (large inputs), no fallback


def test_a_float32_quantum_follows_its_definition():
    """rules._quantum (from the exponent bits) is float32's ulp at each float64 magnitude: 2**(e - 23) for
    values in [2**e, 2**(e + 1)), 2**-149 at least (float64 subnormals included), inf for 0, inf and NaN."""
    rng = np.random.default_rng(5)
    values = np.abs(rng.standard_normal(4000)) * 2.0 ** rng.integers(-1074, 1024, 4000).astype(np.float64)
    edges = [2.0 ** k for k in range(-1074, 1024, 7)] + [np.nextafter(2.0 ** k, 0) for k in range(-1000, 1000, 13)]
    specials = [0.0, math.inf, math.nan, 5e-324, 2.0 ** -1022, 2.0 ** -149, 2.0 ** -126, 1.0, 1.5, np.finfo(np.float64).max]
    x = np.concatenate([values[np.isfinite(values)], edges, specials])
    want = [math.inf if v == 0 or not math.isfinite(v) else 2.0 ** max(math.frexp(v)[1] - 1 - 23, -149) for v in x]
    got = rules._quantum(torch.from_numpy(x)).numpy()
    assert got.tolist() == want


def test_pooling_windows_per_position_follow_the_definition():
    """rules._windows_per_position (a pooling backward's terms per input, the error scale's n) is the most windows
    of kernel k, stride s, dilation d that cover one position, counted position by position along a long row."""
    for k in range(1, 5):
        for s in range(1, 5):
            for d in range(1, 4):
                covering = collections.Counter(w * s + j * d for w in range(60) for j in range(k))
                most = max(n for p, n in covering.items() if (k - 1) * d < p < 60 * s - (k - 1) * d)
                assert rules._windows_per_position([k, 1], [s, 1], [d, 1]) == most, (k, s, d)
    assert rules._windows_per_position(2, [], None) == 1  # stride defaults to the kernel


def test_a_batch_norms_sum_over_n_h_w_takes_the_compiled_pass():
    """Reduced dimensions that are not adjacent (a BatchNorm's statistics and gradients) are merged into
    runs, (N, C, H*W) reduced over 0 and 2: one compiled pass, not the eager ops; and every pattern keeps
    its own kernel (one shared function hit torch.compile's recompile limit after eight patterns and
    fell back to eager ops for good)."""
    torch.manual_seed(1)
    x = torch.randn(16, 8, 24, 24, dtype=torch.float64)
    for shape, dims in [((4, 70000), [1]), ((70000, 4), [0]), ((70000,), [0]), ((8, 16, 24, 24), [1, 3]),
                        ((1, 8, 100, 100), [0, 2, 3]), ((16, 1, 70, 70), [0, 2, 3]), ((3, 70000), [0, 1]),
                        ((2, 70000, 1), [0]), ((1, 2, 70000), [2]), ((2, 3, 70000, 1), [0, 2])]:
        y = torch.randn(shape, dtype=torch.float64)
        assert torch.equal(abs_sum_and_min(y, dims, False)[1], y.abs().amin(dims))
    abs_sum_and_min(x, [0, 2, 3], False)
    key = (3, (0, 2))
    compiled = REDUCTIONS[key]
    assert callable(compiled)
    assert not [k for k, fn in REDUCTIONS.items() if fn is False and k[1]]  # no pattern fell back
    views = []

    def spy(v):
        views.append(tuple(v.shape))
        return compiled(v)

    REDUCTIONS[key] = spy
    try:
        s, smallest = abs_sum_and_min(x, [0, 2, 3], False)
    finally:
        REDUCTIONS[key] = compiled
    assert views == [(16, 8, 576)]
    assert torch.allclose(s, x.abs().sum((0, 2, 3)), rtol=1e-13, atol=0)
    assert torch.equal(smallest, x.abs().amin((0, 2, 3)))


def test_the_compiled_pass_matches_eager_ops_where_every_value_is_zero_or_not_finite():
    x = torch.zeros(4, 70000, dtype=torch.float64)
    x[1, 5], x[2, 7], x[3, 9] = math.inf, math.nan, -2.5
    s, smallest = abs_sum_and_min(x, [1], False)
    assert s[0] == 0 and smallest[0] == math.inf  # nothing nonzero: no quantum, no certificate
    assert s[1] == math.inf and math.isnan(smallest[2]) and smallest[3] == 2.5


@pytest.mark.parametrize("ignore", [-100, 0, 7])
@pytest.mark.parametrize("reduction", [0, 1, 2])
def test_the_nll_loss_scale_reads_only_the_picked_elements(reduction, ignore):
    torch.manual_seed(1)
    x = torch.randn(64, 1000, dtype=torch.float64)
    target = torch.randint(0, 1000, (64,))
    target[::5] = ignore  # ignored rows stay ignored
    target[1::5] = 0  # class 0 is an ordinary class unless it is the ignored one
    out = aten.nll_loss_forward.default(x, target, None, reduction, ignore)
    got = rules._nll_loss_forward(rules.Call(aten.nll_loss_forward.default, (x, target, None, reduction, ignore), {},
                                             list(out)))
    full_loss, full_total = aten.nll_loss_forward.default(-x.abs(), target, None, reduction, ignore)
    n = target.numel() if reduction != 0 else 1
    want = [math.sqrt(n) * full_loss.abs() + out[0].abs(), math.sqrt(target.numel()) * full_total.abs()]
    for g, w in zip(got, want):
        assert torch.equal(g, w)


NT = collections.namedtuple("NT", "a b")


@pytest.mark.parametrize("args,kwargs", [
    ((torch.zeros(2), 1.5, [1, 2], None), {"alpha": 0.5, "out": torch.ones(1)}),
    ((torch.Size([2, 3]), [torch.zeros(1), None], 0.25), {"dtype": torch.float32}),
    ((NT(1, 2.0), 3.0), {"x": [3]}),
    (([[1, 2.5], 3],), {}),
    ((1.0,), {"d": {"k": 1.0}, "e": 2.0}),
    ((), {}),
])
def test_an_op_call_flattens_in_pytrees_order(args, kwargs):
    # the log names a scalar by its index among these leaves: the order is part of the format
    ref_leaves, ref_spec = tree_flatten((args, kwargs))
    leaves, spec = _flatten_call(args, kwargs)
    assert len(leaves) == len(ref_leaves) and all(a is b for a, b in zip(leaves, ref_leaves))
    changed = [x * 2 if type(x) is float else x for x in leaves]
    a, k = _unflatten_call(changed, spec)
    ra, rk = tree_unflatten([x * 2 if type(x) is float else x for x in ref_leaves], ref_spec)
    assert repr((a, k)) == repr((ra, rk)) and type(a) is tuple and list(k) == list(rk)


@pytest.mark.parametrize("numel", [4096, 1 << 17])  # eager ops, and the compiled epilogue (>= 65536)
def test_a_relative_scale_gives_what_the_stored_one_gives(numel):
    """rules._rel's scale |y| is computed by the kernel that rounds y (or at the positions asked for):
    the same rounding, candidates and taus as with |y| stored at full size."""
    from veritrain.engine import _Analysis, _EagerSlot
    from veritrain.fused import Epilogues
    from veritrain.rounding import Grid

    torch.manual_seed(0)
    grid = Grid(32)
    y = torch.randn(numel, dtype=torch.float64)
    # a fifth of the values 1 to 1024 float64 ulps from a float32 midpoint: around the candidate bound
    near = y[::5]
    offset = 2.0 ** (-29 + 10 * torch.rand(len(near), dtype=torch.float64))
    y[::5] = grid.round(near).double() + grid.spacing_at(near) * (0.5 + offset)
    y[::7] = 0
    call = rules.Call(aten.nll_loss_backward.default, (), {}, [y])
    assert isinstance(rules._rel(call)[0], rules.RelScale)
    stored = rules.Rule(rules.APPROX, "softmax", lambda c: [c.outputs[0].abs()])
    slots = [_EagerSlot(y, _Analysis(call, rule), 0, grid, Epilogues(grid))
             for rule in (rules.Rule(rules.APPROX, "softmax", rules._rel), stored)]
    idx = [s.candidate_indices(16.0) for s in slots]
    assert len(idx[0]) > 100 and torch.equal(idx[0], idx[1])
    assert torch.equal(slots[0].y32.view(torch.int32), slots[1].y32.view(torch.int32))
    assert torch.equal(slots[0].scale_at(idx[0]), slots[1].scale_at(idx[1]))
    assert torch.equal(slots[0].scale(), y.abs())


def test_a_sum_of_float64_values_off_the_float32_grid_is_never_certified(tmp_path):
    """The certificate counts in float32 ulps. A float64 tensor from outside the engine (a user's float64
    data summed inside the step) need not hold float32 values, and its float64 sum is then inexact: it gets
    an error scale, so a row that lands near a float32 midpoint is logged and replays. (Certified, tau 0:
    the trainer logged nothing, and another machine's sum could round the other way.)"""
    g = torch.Generator().manual_seed(0)
    x = 1 + torch.rand(4, 64, dtype=torch.float64, generator=g)  # 53-bit values
    partial = x[:, :63].sum(1)
    m32 = (partial + 1.5).float()
    midpoint = m32.double() + (torch.nextafter(m32, torch.tensor(math.inf)).double() - m32.double()) / 2
    x[:, 63] = midpoint - partial  # each row's sum is a float32 midpoint, up to float64 rounding
    y = x.sum(1)
    for on_grid, certified in ((True, True), (False, False)):
        scale = rules._reduction_sum(rules.Call(aten.sum.dim_IntList, (x, [1]), {}, [y], on_grid))[0]
        assert bool((scale == 0).all()) == certified

    path = str(tmp_path / "step.vtlog")
    w = StepLogWriter(path, 0, 32)
    with step_context(EngineConfig(), 0, writer=w):
        y_trainer = x.sum(1)
    w.close()
    out = read_records(path)[2][-1].outputs[0]
    assert len(out.dir_pos) == 4, "every row is within its error bound of a midpoint"
    with StepLogReader(path, expect_step=0, expect_bits=32) as reader:
        with step_context(EngineConfig(), 0, reader=reader) as mode:
            y_auditor = x.sum(1)
    assert mode.stats.suspicious_count == 0 and torch.equal(y_auditor, y_trainer)
    w = StepLogWriter(str(tmp_path / "grid.vtlog"), 0, 32)
    with step_context(EngineConfig(), 0, writer=w) as mode:
        x.float().double().sum(1)  # the same sums of float32 values are exact: certified, nothing to log
    w.close()
    assert mode.stats.entries_total == 0


@pytest.mark.parametrize("shape,transpose", [((768, 3072), False), ((3072, 512), True), ((96, 64, 64), False),
                                             ((96, 64, 64), True), ((16, 64, 32, 32), False), ((4, 1, 300, 70), True),
                                             ((70000, 3), True)])
@pytest.mark.parametrize("compiled", [True, False], ids=["compiled", "eager"])
def test_norms_and_energies_follow_the_definition(shape, transpose, compiled, monkeypatch):
    """A matrix product's row and column norms (NormFactor.full) and a convolution's energies and channel
    norms (rules._convolution, _convolution_backward) are sums of squares over some dimensions: the compiled
    sum for reductions over outer dimensions, in any layout a transposed operand has, gives the eager ops'
    values up to summation order, in their shape."""
    # the compiled sums at every size (by default from 2**20 elements), or the eager ops at every size
    monkeypatch.setenv("VERITRAIN_COMPILE_MIN_NUMEL", "0" if compiled else str(1 << 62))
    torch.manual_seed(2)
    x = torch.randn(shape, dtype=torch.float64)
    if transpose:
        x = x.transpose(0, -1)
    patterns = [[d] for d in range(x.dim())] + ([[1], [0, 2, 3]] if x.dim() == 4 else [])
    for dims in patterns:
        if len(dims) == 1:
            got = rules.NormFactor(x, dims[0]).full()
        else:
            got = vector_norm(x, dims)
        want = torch.linalg.vector_norm(x, dim=dims, keepdim=True)
        assert got.shape == want.shape
        assert torch.allclose(got, want, rtol=1e-13, atol=0)
        assert torch.allclose(sum_of_squares(x, dims), (x * x).sum(dims, keepdim=True), rtol=1e-13, atol=0)
    if compiled and not transpose:  # a reduction over the outermost dimension took the compiled kernel
        sizes, reduced = merged_view(x.shape, [0])
        assert callable(SQUARES.get((len(sizes), reduced)))


@pytest.mark.parametrize("dims", [[0, 2, 3], [0, 3], [-1, 0], [1, 3], [0, 1, 2, 3], [2, 3], [1]])
@pytest.mark.parametrize("layout", ["contiguous", "transposed"])
def test_the_eager_sum_of_squares_over_trailing_dimensions_first_is_the_sum_of_squares(dims, layout):
    """fused._eager_squares sums a contiguous tensor's trailing reduced dimensions first, then the others (a
    channel norm over an NCHW activation: [2, 3], then [0]): the same values as one sum, up to summation
    order, in the same keepdim shape; a transposed tensor in its memory's order, the same way."""
    from veritrain.fused import _eager_squares

    torch.manual_seed(4)
    x = torch.randn(6, 5, 7, 9, dtype=torch.float64)
    if layout == "transposed":
        x = x.transpose(1, 3)
    got = _eager_squares(x, dims)
    want = (x * x).sum(dims, keepdim=True)
    assert got.shape == want.shape
    assert torch.allclose(got, want, rtol=1e-14, atol=0)


@pytest.mark.parametrize("stored,dims", [((300, 70), [0]), ((300, 70), [1]), ((5, 40, 30), [1]), ((5, 40, 30), [2]),
                                         ((5, 40, 30), [0, 1])])
def test_a_transposed_operands_norms_are_taken_in_its_memorys_order(stored, dims, monkeypatch):
    """A transposed matrix product operand's column norms (GPT-2's tied embedding, transposed for the logits) are
    its stored matrix's row norms: ATen's norm over the memory's innermost dimension reads it once, where the
    eager sum of squares over the strided view ran 6x slower at GPT-2's vocabulary (python
    bench/bench_conv_scales.py, its third table). The eager ops only, so the strided sum would be taken without
    this; the values are the definition's, in the view's keepdim shape."""
    monkeypatch.setenv("VERITRAIN_COMPILE_MIN_NUMEL", str(1 << 62))
    torch.manual_seed(5)
    x = torch.randn(stored, dtype=torch.float64).transpose(-2, -1)
    strided, strided_norms = [], []
    orig_mul, orig_norm = torch.Tensor.__mul__, torch.linalg.vector_norm

    def mul(a, b):
        strided.append(not a.is_contiguous())
        return orig_mul(a, b)

    def norm(a, dim=None, **kw):
        # ATen's norm runs at memory speed where it reduces the memory's innermost dimension, strided otherwise
        reduced = [d % a.dim() for d in ([dim] if isinstance(dim, int) else dim or range(a.dim()))]
        strided_norms.append(not any(a.stride(d) == 1 or a.shape[d] == 1 for d in reduced))
        return orig_norm(a, dim=dim, **kw)

    monkeypatch.setattr(torch.Tensor, "__mul__", mul)
    monkeypatch.setattr(torch.linalg, "vector_norm", norm)
    got = vector_norm(x, dims)
    energy = sum_of_squares(x, dims)
    monkeypatch.undo()
    assert not any(strided), "a sum of squares over the strided view"
    assert not any(strided_norms), "ATen's norm over a dimension that is not the memory's innermost"
    want = torch.linalg.vector_norm(x, dim=dims, keepdim=True)
    assert got.shape == energy.shape == want.shape and got.is_contiguous()
    assert torch.allclose(got, want, rtol=1e-13, atol=0)
    assert torch.allclose(energy, (x * x).sum(dims, keepdim=True), rtol=1e-13, atol=0)


def test_norms_at_a_few_positions_reuse_the_full_norms_once_computed():
    """NormFactor.at: the trainer's kernel computed every norm (full()); the scales of its few candidates are
    read from those, not gathered and computed again from the operand (which cost about 1.5 ms per matrix
    product at GPT-2 117M's sizes). Before full(), at() computes the norms of the rows it needs."""
    torch.manual_seed(3)
    x = torch.randn(768, 3072, dtype=torch.float64)
    coords = [torch.tensor([0, 5, 5]), torch.tensor([7, 7, 3071])]  # (row, column) of three output positions
    for dim in (0, 1):
        f = rules.NormFactor(x, dim)
        before = f.at(coords)  # only the needed norms, from x
        full = f.full()
        want = full[tuple(torch.zeros_like(c) if n == 1 else c for c, n in zip(coords, full.shape))]
        assert torch.allclose(before, want, rtol=1e-13, atol=0)
        f.x = torch.full_like(x, float("nan"))  # after full(), x is not read again
        assert torch.equal(f.at(coords), want)


def test_norms_of_a_float32_operand_are_taken_in_float64():
    """An auditor's blocked matrix product (blocked.py) gives NormFactor its float32 operands, never copied to
    float64 whole: the norms, at a few positions or in full, are still float64's (float32's own would overflow
    past 1.8e19 and round to float32), for a transposed operand too."""
    torch.manual_seed(4)
    x = torch.randn(40, 300) * torch.tensor(1e30) ** torch.rand(40, 1)  # rows up to 1e30: float32 squares overflow
    coords = [torch.tensor([0, 5, 5, 39]), torch.tensor([7, 7, 2, 0])]
    for op in (x, x.t().contiguous().t()):
        for dim in (0, 1):
            want = torch.linalg.vector_norm(op.double(), dim=dim, keepdim=True)
            full = rules.NormFactor(op, dim).full()
            assert full.dtype == torch.float64 and torch.allclose(full, want, rtol=1e-13, atol=0)
            at = rules.NormFactor(op, dim).at(coords)
            picked = want[tuple(torch.zeros_like(c) if n == 1 else c for c, n in zip(coords, want.shape))]
            assert at.dtype == torch.float64 and torch.allclose(at, picked, rtol=1e-13, atol=0)


@pytest.mark.parametrize("n", [0, 5, 4096, 4099, 1 << 20])
@pytest.mark.parametrize("density", [0.0, 1e-6, 1e-3, 0.3, 1.0])
def test_a_masks_positions_are_its_nonzero_elements(n, density):
    """rounding.mask_positions (the candidates' positions, found word by word) is torch's nonzero, on any
    offset, length and density (dense masks take the byte scan)."""
    g = torch.Generator().manual_seed(n)
    mask = -(torch.rand(n + 11, generator=g) < density).to(torch.int8)
    if n:
        mask[[n // 2, n - 1, n + 2, n + 7]] = -1  # a middle one, and each view's last (a length's tail)
    for view in (mask[:n], mask[3:n + 3], mask[8:n + 8].view(-1, 1)):
        assert torch.equal(mask_positions(view), view.reshape(-1).nonzero().squeeze(1))


def _reference_embedding_scale(go, idx, num, pad, by_freq):
    """The definition over the whole vocabulary: sqrt(count) * sum of |grad| per embedding row (the same op on
    |grad|), certified exact where that sum is small against the row's smallest quantum; nonzero rows only."""
    aten = torch.ops.aten
    flat = idx.reshape(-1)
    counts = torch.bincount(flat, minlength=num)
    rows = counts.nonzero().squeeze(1)
    absum = aten.embedding_dense_backward(go.abs(), idx, num, pad, by_freq)[rows]
    scale = counts[rows].double().sqrt().unsqueeze(1) * absum
    if by_freq:
        return rows, scale
    row_q = rules._min_quantum(go.abs().reshape(-1, go.shape[-1]), [1], False)
    q = torch.full((num,), math.inf, dtype=torch.float64).scatter_reduce(0, flat, row_q, "amin")
    return rows, torch.where(absum < rules._EXACT_LIMIT * q[rows].unsqueeze(1), 0.0, scale)


@pytest.mark.parametrize("pad", [-1, 7, 4000])  # none, a row in the batch, a row not in it
@pytest.mark.parametrize("by_freq", [False, True])
def test_an_embedding_gradients_scale_over_the_batchs_rows_follows_the_definition(pad, by_freq):
    g = torch.Generator().manual_seed(0)
    num = 5000
    idx = torch.randint(0, 60, (6, 40), generator=g) * 83 % num  # repeated tokens, rows far apart
    idx[0, :5] = 7
    go = torch.randn(6, 40, 16, generator=g) * torch.exp2(torch.randint(-60, 60, (6, 40, 16), generator=g).float())
    go = go.double()  # float32 values of wide range: some sums exact (certified), some not
    go[1] = torch.randint(-3, 4, (40, 16), generator=g).double()  # small integers: some rows certified exact
    func = torch.ops.aten.embedding_dense_backward.default
    y = func(go, idx, num, pad, by_freq)
    (got,) = rules._embedding_dense_backward(rules.Call(func, (go, idx, num, pad, by_freq), {}, [y]))
    rows, scale = _reference_embedding_scale(go, idx, num, pad, by_freq)
    assert torch.equal(got.rows, rows)
    assert torch.allclose(got.scale, scale, rtol=1e-15, atol=0)
    if not by_freq:
        assert bool((scale == 0).any()) and bool((scale > 0).any()), "the certificate is exercised"
    if pad == 7:
        assert float(got.scale[rows == 7].abs().max()) == 0.0  # the padding row gets no gradient


def test_an_embedding_gradients_scale_costs_nothing_per_vocabulary_row():
    """The scale reads only the batch's rows: a vocabulary of 10^12 rows (a full-size float64 sum of |grad|,
    as the definition is written, would need 10^14 bytes) gives the small vocabulary's scale."""
    func = torch.ops.aten.embedding_dense_backward.default
    idx = torch.tensor([[3, 9, 3], [0, 9, 12]])
    go = torch.randn(2, 3, 4, dtype=torch.float64)
    small = rules._embedding_dense_backward(rules.Call(func, (go, idx, 16, -1, False), {}, [None]))[0]
    huge = rules._embedding_dense_backward(rules.Call(func, (go, idx, 10**12, -1, False), {}, [None]))[0]
    assert torch.equal(huge.rows, small.rows) and torch.equal(huge.scale, small.scale)


@pytest.mark.parametrize("case", [((2, 3, 9, 7), (3, 3), 1, 1, 1), ((2, 3, 9, 7), (3, 3), 2, 1, 1),
                                  ((3, 4, 10, 11), (3, 2), (2, 1), (0, 1), (1, 2)), ((2, 5, 8, 8), (1, 1), 2, 0, 1),
                                  ((2, 2, 7, 7), (5, 5), 3, 2, 1), ((2, 3, 12), (3,), 2, 1, 2),
                                  ((1, 2, 5, 6, 4), (3, 3, 2), (1, 2, 1), 1, 1)])
def test_a_convolutions_patch_norms_at_a_few_positions_follow_the_definition(case, monkeypatch):
    """rules.PatchNorm: the norm of the patch each output of a convolution reads (forward), and of the output
    gradient's window over each input position (the input gradient's), by its definition, the convolution of
    the squares with a kernel of ones (and its transpose). At a few positions it gathers their patches (the
    auditor's entries) and gives the full computation's values, which later calls read instead."""
    shape, k, stride, padding, dilation = case
    torch.manual_seed(4)
    x = torch.randn(shape, dtype=torch.float64)
    nd = len(k)
    conv = [None, torch.nn.functional.conv1d, torch.nn.functional.conv2d, torch.nn.functional.conv3d][nd]
    ones = torch.ones((1, shape[1]) + k, dtype=torch.float64)
    want = conv(x * x, ones, stride=stride, padding=padding, dilation=dilation).sqrt()
    go = torch.randn((shape[0], 6) + tuple(want.shape[2:]), dtype=torch.float64)
    grad_input = torch.nn.grad.conv1d_input if nd == 1 else torch.nn.grad.conv2d_input if nd == 2 \
        else torch.nn.grad.conv3d_input
    want_back = grad_input((shape[0], 1) + shape[2:], torch.ones((1, 1) + k, dtype=torch.float64),
                           (go * go).sum(1, keepdim=True), stride=stride, padding=padding, dilation=dilation).sqrt()
    for f, ref, out_shape in ((rules.PatchNorm(x, k, stride, padding, dilation), want, (shape[0], 5) + want.shape[2:]),
                              (rules.PatchNorm(go, k, stride, padding, dilation, True, shape[2:]), want_back, shape)):
        every = torch.arange(math.prod(out_shape))
        host = np.unravel_index(every.numpy(), out_shape)
        expect = ref.expand(out_shape).reshape(-1)
        monkeypatch.setattr(rules, "GATHER_SHARE", math.inf)  # every position's patch gathered, however many
        assert torch.allclose(f.at(host), expect, rtol=1e-13, atol=0)
        assert f._full is None
        monkeypatch.setattr(rules, "GATHER_SHARE", 0.25)  # as many as here: one pass over x instead
        assert torch.allclose(f.at(host), expect, rtol=1e-13, atol=0)
        assert f._full is not None
        assert torch.allclose(f.full(), ref, rtol=1e-13, atol=0)
        f.x = torch.full_like(f.x, float("nan"))  # after full(), x is not read again
        assert torch.allclose(f.at(host), expect, rtol=1e-13, atol=0)


def test_a_convolution_backwards_scales_are_computed_for_the_outputs_asked_for():
    """The input, weight and bias gradients' scales (rules._convolution_backward) are Deferred: the auditor asks
    only for outputs with log entries, so an op whose weight gradient has none never takes the norms over
    the whole output gradient and input that its scale needs. Once computed, each is kept."""
    torch.manual_seed(5)
    x, w = torch.randn(4, 3, 8, 8, dtype=torch.float64), torch.randn(5, 3, 3, 3, dtype=torch.float64)
    go = torch.randn(4, 5, 8, 8, dtype=torch.float64)
    func = aten.convolution_backward.default
    outs = list(func(go, x, w, [5], [1, 1], [1, 1], [1, 1], False, [0, 0], 1, [True, True, True]))
    call = rules.Call(func, (go, x, w, [5], [1, 1], [1, 1], [1, 1], False, [0, 0], 1, [True, True, True]), {}, outs)
    scales = rules.scale_for(rules.lookup(func), call)
    assert all(isinstance(s, rules.Deferred) for s in scales)
    from veritrain.engine import _Analysis
    analysis = _Analysis(call, rules.lookup(func))
    calls = []
    analysis.scales = list(scales)
    computed = [s.compute for s in analysis.scales]
    for i, s in enumerate(analysis.scales):
        s.compute = (lambda i=i: calls.append(i) or computed[i]())
    first = analysis.scale(0, outs[0].shape)
    assert calls == [0] and analysis.scale(0, outs[0].shape) is first  # the weight and bias scales not taken
    weight = rules.materialize_scale(analysis.scale(1, outs[1].shape), outs[1])
    gon = torch.linalg.vector_norm(go, dim=[0, 2, 3]).view(-1, 1, 1, 1)
    xn = torch.linalg.vector_norm(x, dim=[0, 2, 3]).view(1, -1, 1, 1)
    assert calls == [0, 1] and torch.allclose(weight, 16 * gon * xn * torch.ones_like(outs[1]), rtol=1e-13, atol=0)


@pytest.mark.parametrize("groups", [1, 2])
@pytest.mark.parametrize("gather", ["numpy", "torch"])
def test_a_convolutions_channel_norms_at_a_few_positions_follow_the_definition(groups, gather, monkeypatch):
    """rules.ChannelNorm (a convolution weight gradient's scale factors): ||x|| over batch and positions per
    channel, the largest over the groups for a grouped convolution's input, along the output dimension it
    indexes. At a few positions only their channels are read (gathered in NumPy up to GATHER_NUMPY_NUMEL
    values, in torch beyond); the full norms give the same values, and once computed they are read instead of
    x."""
    monkeypatch.setattr(rules, "GATHER_NUMPY_NUMEL", 1 << 62 if gather == "numpy" else 0)
    torch.manual_seed(6)
    x = torch.randn(4, 6, 5, 7, dtype=torch.float64)
    want = torch.linalg.vector_norm(x, dim=[0, 2, 3]).reshape(groups, -1).amax(0)  # (6 / groups,)
    for axis in (0, 1):
        out_shape = [3, 3, 3, 3]
        out_shape[axis] = want.numel()
        f = rules.ChannelNorm(x, axis, groups, 4)
        positions = np.array([0, 5, 17, 40, 41, math.prod(out_shape) - 1])
        host = np.unravel_index(positions, out_shape)
        expect = want[torch.from_numpy(host[axis])]
        monkeypatch.setattr(rules, "GATHER_SHARE", math.inf)  # only the channels asked for
        assert torch.allclose(f.at(host), expect, rtol=1e-13, atol=0)
        assert f._full is None
        monkeypatch.setattr(rules, "GATHER_SHARE", 0.0)  # all of them, once
        assert torch.allclose(f.at(host), expect, rtol=1e-13, atol=0)
        assert f._full is not None
        full = f.full()
        assert full.shape == tuple(want.numel() if d == axis else 1 for d in range(4))
        assert torch.allclose(full.reshape(-1), want, rtol=1e-13, atol=0)
        f.x = torch.full_like(x, float("nan"))
        assert torch.allclose(f.at(host), expect, rtol=1e-13, atol=0)


@pytest.mark.parametrize("groups,stride", [(1, 1), (2, 2)])
def test_a_convolutions_scales_follow_their_definitions(groups, stride, monkeypatch):
    """rules._convolution and _convolution_backward, in full and at every position, against their definitions
    written out with eager ops: sqrt(n) ||patch of x|| ||w_o|| forward; sqrt(n) ||window of go|| ||w[:, c]||
    (over every output channel, the input channel's position within its group) for the input gradient;
    sqrt(N H W) ||go_o|| max_g ||x_(g, c)|| for the weight gradient."""
    torch.manual_seed(7)
    x, w = torch.randn(3, 4, 9, 9, dtype=torch.float64), torch.randn(6, 4 // groups, 3, 3, dtype=torch.float64)
    args = ([stride, stride], [1, 1], [1, 1], False, [0, 0], groups)
    y = aten.convolution(x, w, None, *args)
    go = torch.randn_like(y)
    ones = torch.ones((1, 1, 3, 3), dtype=torch.float64)
    patch = torch.nn.functional.conv2d((x * x).sum(1, keepdim=True), ones, stride=stride, padding=1).sqrt()
    want_y = math.sqrt(4 // groups * 9) * patch * torch.linalg.vector_norm(w.flatten(1), dim=1).view(1, -1, 1, 1)
    window = torch.nn.grad.conv2d_input((3, 1, 9, 9), ones, (go * go).sum(1, keepdim=True), stride=stride,
                                        padding=1).sqrt()
    wn = torch.linalg.vector_norm(w.transpose(0, 1).flatten(1), dim=1).repeat(groups).view(1, -1, 1, 1)
    want_gi = math.sqrt(6 // groups * 9) * window * wn
    xn = torch.linalg.vector_norm(x, dim=[0, 2, 3]).reshape(groups, -1).amax(0).view(1, -1, 1, 1)
    want_gw = math.sqrt(go.shape[0] * go.shape[2] * go.shape[3]) \
        * torch.linalg.vector_norm(go, dim=[0, 2, 3]).view(-1, 1, 1, 1) * xn * torch.ones_like(w)
    fwd = rules.Call(aten.convolution.default, (x, w, None, *args), {}, [y])
    back = (go, x, w, None, *args, [True, True, False])
    bwd = rules.Call(aten.convolution_backward.default, back, {}, list(aten.convolution_backward(*back)))
    cases = [(rules._convolution(fwd)[0], y, want_y)]
    cases += [(s.compute(), out, want) for s, out, want in zip(rules._convolution_backward(bwd), bwd.outputs,
                                                                (want_gi, want_gw))]
    for share in (math.inf, 0.0):  # each factor at the positions asked for, then in full
        monkeypatch.setattr(rules, "GATHER_SHARE", share)
        for scale, out, want in cases:
            at = scale.at(torch.arange(out.numel()), out.shape)
            assert torch.allclose(at, want.expand(out.shape).reshape(-1), rtol=1e-12, atol=0)
            assert torch.allclose(rules.materialize_scale(scale, out), want.expand(out.shape), rtol=1e-12, atol=0)


def test_a_sum_of_squares_over_a_contiguous_tensors_innermost_dimension_is_never_compiled(monkeypatch):
    """fused._compiled_squares leaves a reduction that includes a contiguous tensor's innermost dimension to the
    eager trailing-first sum (faster there: python bench/bench_conv_scales.py, its second table), and compiles
    the others where compiled paths are on: outer dimensions only, or a transposed tensor's."""
    from veritrain import fused

    monkeypatch.setenv("VERITRAIN_COMPILE", "1")
    compiled = []
    monkeypatch.setattr(fused, "_run_pattern", lambda *a: compiled.append(a[1]))  # None: the eager sum follows
    x = torch.randn(4, 5, 6, 7, dtype=torch.float64)
    for dims in ([0, 2, 3], [3], [1, 2, 3]):
        assert torch.allclose(fused.sum_of_squares(x, dims), (x * x).sum(dims, keepdim=True), rtol=1e-14, atol=0)
    assert compiled == []
    fused.sum_of_squares(x, [0, 1])
    fused.sum_of_squares(x.transpose(1, 3), [0, 2, 3])
    assert len(compiled) == 2
