"""b-bit rounding against an exact reference, and the near-midpoint analysis."""

import math
import struct
from fractions import Fraction

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from veritrain.rounding import UNIT_ROUNDOFF, Grid, reference_round

BITS = list(range(23, 33))
F32_MAX = struct.unpack("<f", struct.pack("<I", 0x7F7FFFFF))[0]
F32_TINY = 2.0**-149


def f32(bits: int) -> float:
    return struct.unpack("<f", struct.pack("<I", bits))[0]


def grid_max(b: int) -> float:
    return f32(0x7F7FFFFF & ~((1 << (32 - b)) - 1))


def edge_values(b: int):
    drop = 32 - b
    spacing_at_one = 2.0 ** (-23 + drop)
    vals = [0.0, -0.0, 1.0, -1.0, F32_TINY, -F32_TINY, F32_TINY / 2, F32_TINY * 1.5, 2.0**-126,
            2.0**-126 * (1 - 2.0**-30), 2.0**-150, 2.0**-149 * 3.5, 1e-300, -1e-300,
            F32_MAX, grid_max(b), 1e39, -1e39, 2.0**128, 2.0**127 * (2 - 2.0 ** (-24 + drop)),
            math.inf, -math.inf]
    # exact ties between grid points, on both sides of zero and at binade crossings
    for base in [1.0, 1.0 + spacing_at_one, 3.0, 2.0**-100, 2.0**100]:
        vals += [base + spacing_at_one * base / 2, -(base + spacing_at_one * base / 2)]
    vals += [2.0 - spacing_at_one / 2, 2.0 - spacing_at_one / 4, 2.0 - spacing_at_one * 0.75]
    # ties in the subnormal range and the largest value that still rounds to a finite number
    vals += [2.0 ** (-149 + drop) * 0.5, 2.0 ** (-149 + drop) * 1.5, 2.0 ** (-149 + drop) * 2.5]
    top_spacing = 2.0 ** (127 - 23 + drop)
    vals += [grid_max(b) + top_spacing / 2, grid_max(b) + top_spacing / 2 * (1 - 2.0**-40),
             -(grid_max(b) + top_spacing / 2)]
    return vals


def check_against_reference(values, b):
    grid = Grid(b)
    got = grid.round(torch.tensor(values, dtype=torch.float64)).tolist()
    for x, g in zip(values, got):
        want = reference_round(x, b)
        if math.isnan(want):
            assert math.isnan(g)
        else:
            assert g == want, (b, x, g, want)
            assert math.copysign(1, g) == math.copysign(1, want), (b, x)


@pytest.mark.parametrize("b", BITS)
def test_edge_values_match_exact_reference(b):
    check_against_reference(edge_values(b), b)


def test_nan_stays_nan():
    for b in BITS:
        assert math.isnan(Grid(b).round(torch.tensor([math.nan], dtype=torch.float64)).item())


@settings(max_examples=300, deadline=None)
@given(st.lists(st.floats(allow_nan=False, width=64), min_size=1, max_size=50), st.sampled_from(BITS))
def test_random_values_match_exact_reference(values, b):
    check_against_reference(values, b)


@settings(max_examples=200, deadline=None)
@given(st.integers(min_value=0, max_value=2**32 - 1), st.sampled_from(BITS))
def test_grid_values_are_fixed_points(pattern, b):
    v = f32(pattern)
    if math.isnan(v):
        return
    grid = Grid(b)
    snapped = reference_round(v, b)
    r = grid.round(torch.tensor([snapped], dtype=torch.float64)).item()
    assert r == snapped
    assert bool(grid.on_grid(torch.tensor([r])).all())


def test_b32_is_plain_float32_conversion():
    x = torch.randn(10000, dtype=torch.float64) * torch.logspace(-40, 38, 10000, dtype=torch.float64)
    assert torch.equal(Grid(32).round(x), x.to(torch.float32))


@settings(max_examples=100, deadline=None)
@given(st.lists(st.floats(width=64), min_size=1, max_size=40), st.sampled_from(BITS))
def test_rounding_into_a_view_of_a_larger_tensor_is_round(values, b):
    """Grid.round_into (a matrix product's blocks, engine._mm_in_blocks) writes round's bits into a strided view
    and nothing beside it; on float32's grid by a converting copy, NaN, infinities, subnormals and ties included."""
    grid = Grid(b)
    y = torch.tensor(values + edge_values(b), dtype=torch.float64)
    out = torch.full((3, y.numel()), 5.0)
    grid.round_into(y, out[1])
    grid.round_into(y.view(-1, 1), out[2:, :].t())
    assert torch.equal(out[1].view(torch.int32), grid.round(y).view(torch.int32))
    assert torch.equal(out[2].view(torch.int32), grid.round(y).view(torch.int32))
    assert bool((out[0] == 5.0).all())


@settings(max_examples=300, deadline=None)
@given(st.lists(st.floats(width=64), min_size=1, max_size=40), st.sampled_from(BITS))
def test_the_hosts_rounding_is_the_tensors(values, b):
    """Grid.round_host (NumPy, for the few values the trainer classifies and the auditor checks) gives
    Grid.round's bits (torch, for whole results), NaN, infinities, subnormals and ties included."""
    grid = Grid(b)
    y = torch.tensor(values + edge_values(b), dtype=torch.float64)
    got = grid.round_host(y.numpy())
    want = grid.round(y)
    assert got.dtype == np.float32
    same = torch.from_numpy(got.view(np.int32)) == want.view(torch.int32)
    assert bool((same | (want.isnan() & torch.from_numpy(np.isnan(got)))).all())


def exact_cell(y: float, b: int):
    """Reference: (lower, upper, spacing) of the grid cell containing |y|, in exact arithmetic."""
    a = abs(Fraction(y))
    e = -1000 if a == 0 else a.numerator.bit_length() - a.denominator.bit_length()
    while a and Fraction(2) ** e > a:
        e -= 1
    while a and Fraction(2) ** (e + 1) <= a:
        e += 1
    spacing = Fraction(2) ** (max(e, -126) - 23 + 32 - b)
    lower = (a // spacing) * spacing
    return lower, lower + spacing, spacing


@settings(max_examples=200, deadline=None)
@given(st.lists(st.floats(min_value=-2.0**128, max_value=2.0**128, width=64), min_size=1, max_size=30),
       st.sampled_from(BITS))
def test_a_values_cell_and_midpoint_distance_are_exact(values, b):
    """Grid.cell (NumPy) against exact rational arithmetic, and midpoint_distance as the correctly rounded
    distance (one float64 subtraction from an exact midpoint), up to float32's range, on arrays and tensors."""
    grid = Grid(b)
    y = np.array(values + [v for v in edge_values(b) if math.isfinite(v)], dtype=np.float64)
    lower, upper, spacing = grid.cell(y)
    dist = grid.midpoint_distance(y)
    for i, v in enumerate(y.tolist()):
        lo, hi, sp = exact_cell(v, b)
        assert (Fraction(lower[i]), Fraction(upper[i]), Fraction(spacing[i])) == (lo, hi, sp), v
        assert dist[i] == float(abs(abs(Fraction(v)) - (lo + sp / 2))), v
    as_tensors = grid.cell(torch.from_numpy(y))
    assert all(isinstance(t, torch.Tensor) and np.array_equal(t.numpy(), a) for t, a in zip(as_tensors, (lower, upper, spacing)))


def test_rejects_bad_bits():
    for bad in [22, 33, 32.0, "32"]:
        with pytest.raises(ValueError):
            Grid(bad)


# --- the near-midpoint analysis --------------------------------------------------------------------


def exact_classification(y: float, tau: float, b: int):
    """Reference: (value?, direction?) from exact rational arithmetic."""
    q = Fraction(y)
    a = abs(q)
    drop = 32 - b
    if a == 0:
        spacing = Fraction(2) ** (-149 + drop)
    else:
        e = a.numerator.bit_length() - a.denominator.bit_length()
        while Fraction(2) ** e > a:
            e -= 1
        while Fraction(2) ** (e + 1) <= a:
            e += 1
        spacing = Fraction(2) ** (max(e, -126) - 23 + drop)
    lower = (a // spacing) * spacing
    mid = lower + spacing / 2
    t = Fraction(tau)
    is_value = t >= spacing / 8
    is_direction = (not is_value) and abs(a - mid) < t
    return is_value, is_direction


@pytest.mark.parametrize("b", [32, 30, 27, 23])
def test_classification_matches_exact_reference(b):
    gen = torch.Generator().manual_seed(b)
    grid = Grid(b)
    spacing = 2.0 ** (-23 + 32 - b)
    # values placed near midpoints, on grid points, and at random
    base = torch.rand(3000, generator=gen, dtype=torch.float64) + 1.0
    base32 = grid.round(base).double()
    near_mid = base32 + spacing * (0.5 + (torch.rand(3000, generator=gen, dtype=torch.float64) - 0.5) * 1e-6)
    y = torch.cat([near_mid, base32, base, -near_mid, torch.tensor([0.0, 2.0**-140, 1e-30])])
    tau = torch.rand(y.numel(), generator=gen, dtype=torch.float64) * spacing * 1e-6
    tau[::97] = spacing  # some with undetermined cells
    is_value, is_dir, _ = grid.classify(y, tau)
    for i in range(y.numel()):
        want = exact_classification(y[i].item(), tau[i].item(), b)
        assert (bool(is_value[i]), bool(is_dir[i])) == want, (i, y[i].item(), tau[i].item())


@pytest.mark.parametrize("b", [32, 28, 23])
@pytest.mark.parametrize("numel", [1000, 200000])
def test_bulk_candidates_are_a_superset(b, numel):
    gen = torch.Generator().manual_seed(numel + b)
    grid = Grid(b)
    y = torch.randn(numel, generator=gen, dtype=torch.float64) * 10.0 ** torch.randint(-45, 30, (numel,), generator=gen)
    y[::1000] = 0.0
    y[1::1000] = grid.round(y[1::1000]).double()
    # plant values exactly near midpoints so direction entries exist
    y32 = grid.round(y).double()
    cell = grid.spacing_at(y32)
    y[2::7] = (y32 + cell / 2 * (1 - 1e-9))[2::7]
    scale = y.abs() * torch.rand(numel, generator=gen, dtype=torch.float64) * 1e4
    scale[5::11] = y.abs().max()  # operands much larger than the result: heavy cancellation
    c = 16.0
    cand = grid.candidates(y, scale, c) != 0
    tau = c * UNIT_ROUNDOFF * scale
    is_value, is_dir, _ = grid.classify(y, tau)
    needed = is_value | is_dir
    assert bool((needed & ~cand).sum() == 0), "bulk test missed an element that needs an entry"
    assert int(is_dir.sum()) > 0 and int(is_value.sum()) > 0
    # and it is selective: most elements are not candidates
    assert cand.float().mean().item() < 0.6
    # the fused (compiled) kernel gives the same mask
    from veritrain import rounding
    fn = rounding._get_compiled()
    if fn is not None:
        fused = fn(y, scale, c, grid.low_mask, grid.half, grid.value_units) != 0
        assert torch.equal(fused, cand)


def test_apply_direction_reproduces_the_trainers_rounding():
    grid = Grid(32)
    y = torch.tensor([1.0 + 2.0**-24 * (1 + 1e-9), 1.0 + 2.0**-24 * (1 - 1e-9), -3.0 - 2.0**-23 * (1 + 1e-9)],
                     dtype=torch.float64)
    _, _, away = grid.classify(y, torch.full_like(y, 1e-20))
    assert torch.equal(grid.apply_direction(y, away), grid.round(y))
    # forcing the other neighbour gives the other grid point
    other = grid.apply_direction(y, ~away)
    assert not torch.equal(other, grid.round(y))
    assert torch.all((other.double() - y).abs() <= grid.spacing_at(y) / 2 * (1 + 1e-6))


@pytest.mark.parametrize("b", [32, 23])
def test_the_numpy_scan_of_small_results_is_the_torch_scan(b):
    """Small results are scanned by NumPy (less dispatch per op); its mask must be candidate_mask's, bit for
    bit, on zeros, signed zeros, subnormals, infinities, NaNs and zero or infinite scales."""
    from veritrain import rounding

    gen = torch.Generator().manual_seed(b)
    grid = Grid(b)
    y = torch.randn(5000, generator=gen, dtype=torch.float64) * 10.0 ** torch.randint(-45, 40, (5000,), generator=gen)
    y32 = grid.round(y).double()
    y[::3] = (y32 + grid.spacing_at(y32) / 2 * (1 - 1e-12))[::3]
    specials = torch.tensor([0.0, -0.0, 2.0**-1074, -2.0**-140, 2.0**-126, math.inf, -math.inf, math.nan, F32_MAX,
                             2.0**128, 1.0, -1.0 - 2.0**-24], dtype=torch.float64)
    y = torch.cat([y, specials, specials])
    scale = y.abs() * torch.rand(y.numel(), generator=gen, dtype=torch.float64) * 1e6
    scale[::5] = 0.0
    scale[1::5] = y[1::5].abs() * 10.0 ** (5 + 4 * torch.rand(len(y[1::5]), generator=gen, dtype=torch.float64))
    scale[-len(specials):] = torch.tensor([0.0, math.inf, math.nan] * 4, dtype=torch.float64)
    for c in (8.0, 64.0):
        args = (y, scale, c, grid.low_mask, grid.half, grid.value_units)
        want = rounding.candidate_mask(*args)
        got = rounding._candidate_mask_numpy(*args)
        assert got.dtype == want.dtype and torch.equal(got, want)
        assert torch.equal(rounding._candidates_eager(*args), want)
        compiled = rounding._get_compiled()  # the fused kernels' form of candidate_mask, compiled
        if compiled is not None:
            assert torch.equal(compiled(*args), want)
        positions = want.reshape(-1).nonzero().squeeze(1)
        assert torch.equal(grid.candidate_positions(y, scale, c), positions)  # NumPy finds them too
        big = (y.repeat(60), scale.repeat(60))  # over 2**18 values: torch scans and finds them
        assert big[0].numel() > rounding._NUMPY_MAX_NUMEL
        assert torch.equal(grid.candidate_positions(*big, c), (grid.candidates(*big, c) != 0).reshape(-1).nonzero().squeeze(1))
        assert torch.equal(grid.candidate_positions(*big, c)[:len(positions)], positions)
    assert int((want != 0).sum()) > 1000  # the near-midpoint third, at least
    for shape in ((), (3, 1, 4)):  # a 0-d result, and the mask keeps the result's shape
        y0 = y[:math.prod(shape)].reshape(shape)
        args = (y0, scale[:y0.numel()].reshape(shape), 8.0, grid.low_mask, grid.half, grid.value_units)
        assert torch.equal(rounding._candidates_eager(*args), rounding.candidate_mask(*args))


def test_any_candidate_asks_candidate_mask():
    """rounding.any_candidate, the test a captured region run as Python makes of each approximate op: whether
    candidate_mask flags any element, in NumPy up to 2**18 values and in torch beyond, with a scale of
    another shape broadcast (a scalar, a row)."""
    from veritrain import rounding

    grid = Grid(32)
    gen = torch.Generator().manual_seed(7)
    y = torch.randn(4000, generator=gen, dtype=torch.float64)
    y32 = grid.round(y).double()
    near = y32 + grid.spacing_at(y32) / 2 * (1 - 1e-12)  # a hair below a midpoint: a candidate at any scale
    scale = y.abs() * 1e-3
    args = (grid.low_mask, grid.half, grid.value_units)
    seen = []
    for values in (y, torch.cat([y, near[:1]]), y.repeat(70), torch.cat([y.repeat(70), near[:1]])):
        s = values.abs() * 1e-3
        want = bool(rounding.candidate_mask(values, s, 8.0, *args).any())
        assert rounding.any_candidate(values, s, 8.0, grid) is want
        seen.append(want)
    assert seen == [False, True, False, True]  # each path answers both ways
    assert rounding.any_candidate(near, scale, 8.0, grid)
    assert not rounding.any_candidate(y32, torch.zeros(()), 8.0, grid)  # on the grid, scale 0 (broadcast)
    assert rounding.any_candidate(near.view(40, 100), scale[:100], 8.0, grid)  # a row's scale
    assert not rounding.any_candidate(y32.view(40, 100), 0.0, 8.0, grid)  # a Python number


@pytest.mark.parametrize("b", [32, 27, 23])
def test_the_scans_midpoint_distance_is_exact_at_the_threshold(b):
    """candidate_mask computes the distance to the midpoint in float64 (no int64 conversion: AVX2 has none);
    with each scale set at that distance's threshold, one unit either way, the mask must still be the
    int64 reference's (``_mask_numpy``), eager and compiled: a distance off by one unit flips these."""
    from veritrain import rounding

    grid = Grid(b)
    gen = torch.Generator().manual_seed(100 + b)
    y = torch.randn(20000, generator=gen, dtype=torch.float64) * 10.0 ** torch.randint(-30, 30, (20000,), generator=gen)
    dev = ((y.view(torch.int64) & grid.low_mask) - grid.half).abs().clamp(max=grid.value_units)
    c = 8.0
    compiled = rounding._get_compiled()
    masks = []
    for delta in (-1, 0, 1):
        scale = (dev + delta).double() * y.abs() / c
        args = (y, scale, c, grid.low_mask, grid.half, grid.value_units)
        want = rounding._candidate_mask_numpy(*args)
        assert torch.equal(rounding.candidate_mask(*args), want)
        if compiled is not None:
            assert torch.equal(compiled(*args), want)
        masks.append(want)
    assert not torch.equal(masks[0], masks[2])  # the threshold is exercised


def stability_cases():
    """(y, scale, c) at the stability test's edges: results exactly at a midpoint and a few float64 ulps either
    side, with tau just above and below that distance (and far below a float64 ulp); tau at spacing/8 exactly,
    for results just below a power of two, tiny normals and subnormals included; zero results and scales;
    results near float32's largest value; both signs."""
    grid = Grid(32)
    gen = torch.Generator().manual_seed(7)
    n = 20000
    mag = 2.0 ** torch.randint(-149, 127, (n,), generator=gen).double()
    y = grid.round(torch.rand(n, generator=gen, dtype=torch.float64) * mag + mag).double()
    lower, _, spacing = grid.cell(y)
    mid = lower + spacing / 2
    steps = torch.randint(-6, 7, (n,), generator=gen)
    y = torch.nextafter(mid, torch.where(steps < 0, 0.0, math.inf).double())
    for _ in range(5):  # up to five more float64 ulps either side
        more = steps.abs() > 1
        y = torch.where(more, torch.nextafter(y, torch.where(steps < 0, 0.0, math.inf).double()), y)
        steps = torch.where(more, steps - steps.sign(), steps)
    y[::4] = mid[::4]  # exact ties
    dist = (y - mid).abs()
    c = 8.0
    unit = c * UNIT_ROUNDOFF
    scale = dist / unit * (1.0 + 2.0 ** -30 * torch.randint(-3, 4, (n,), generator=gen).double())
    scale[::4] = torch.rand(n // 4, generator=gen, dtype=torch.float64) * 1e-300  # a tie, tau far below an ulp
    scale[1::9] = 0.0
    cell = grid.spacing_at(y)
    scale[2::9] = (cell / 8 / unit)[2::9]  # value entry at its threshold
    below_pow2 = torch.nextafter(2.0 ** torch.randint(-125, 127, (n,), generator=gen).double(), torch.tensor(0.0).double())
    y[3::9], scale[3::9] = below_pow2[3::9], (grid.spacing_at(below_pow2) / 8 / unit)[3::9]
    special = torch.tensor([0.0, -0.0, F32_TINY, F32_TINY / 2, 2.0**-1074, F32_MAX, -F32_MAX, 2.0**128, math.inf,
                            math.nan, 2.0**-126, -(2.0**-126) * (1 - 2.0**-52)], dtype=torch.float64)
    y = torch.cat([y, -y, special, special])
    scale = torch.cat([scale, scale, torch.ones(len(special), dtype=torch.float64) * 1e-30,
                       torch.tensor([0.0, 1e-300, 1.0, math.inf, math.nan, 2.0**-160] * 2, dtype=torch.float64)])
    return grid, y, scale, c


def test_the_kernels_stability_test_finds_every_element_that_needs_an_entry():
    """Compiled kernels scan with rounding.stability_mask (the float32 grid): a candidate where y's rounding
    changes within b = tau (1 + 2**-40) + |y| 2**-50, or b 2**27 >= |y|. It must flag every element the exact
    classification gives an entry (ties with tau far below an ulp, the value threshold at tiny normals), eager
    and compiled alike, and not flag exact ties of exact results (scale 0), which captured regions replay, nor
    results below float32's normal range whose rounding is not in doubt (the bit test flags every one)."""
    from veritrain import fused, rounding

    grid, y, scale, c = stability_cases()
    is_value, is_dir, _ = grid.classify(y, c * UNIT_ROUNDOFF * scale)
    needed = is_value | is_dir
    assert int(is_dir.sum()) > 5000 and int(is_value.sum()) > 1000  # the edges are exercised
    mask = rounding.stability_mask(y, scale, c)
    assert mask.dtype == torch.int8 and set(mask.unique().tolist()) <= {0, 1}
    missed = (needed & (mask == 0)).nonzero().flatten()
    assert not len(missed), [(y[i].item(), scale[i].item()) for i in missed[:5]]
    compiled = fused.compile_kernel(rounding.stability_mask)(y, scale, c)
    assert torch.equal(compiled, mask)
    ties = (y == grid.cell(y)[0] + grid.spacing_at(y) / 2) & (scale == 0)
    assert int(ties.sum()) > 100 and not bool(mask[ties].any())
    # selective: on random results with an elementwise scale, about as many candidates as the bit test's
    gen = torch.Generator().manual_seed(8)
    r = torch.randn(200000, generator=gen, dtype=torch.float64)
    s = r.abs() * 1e6
    bits = rounding.candidate_mask(r, s, c, grid.low_mask, grid.half, grid.value_units) != 0
    assert int((rounding.stability_mask(r, s, c) != 0).sum()) <= int(bits.sum()) + 10
    # and below float32's normal range, where the bit test flags every result with a nonzero scale (its low bits
    # are not the grid's there): underflowing probabilities, AdamW's moments decaying to zero. The stability test
    # flags only those whose rounding is in doubt, which is why the kernels keep it where the bit test's kernel
    # is the cheaper one (docs/SPEED-RECORD.md, session 37)
    tiny = r * 2.0**-130
    tiny_scale = tiny.abs()
    is_value, is_dir, _ = grid.classify(tiny, c * UNIT_ROUNDOFF * tiny_scale)
    assert not bool((is_value | is_dir).any())
    assert bool((rounding.candidate_mask(tiny, tiny_scale, c, grid.low_mask, grid.half, grid.value_units) != 0).all())
    assert int((rounding.kernel_flag(grid)(tiny, tiny_scale, c) != 0).sum()) == 0


def test_kernels_on_coarser_grids_keep_the_bit_test():
    """The stability test reads float32's own rounding, so only the float32 grid uses it; the kernels' flag is a
    float32 1 where the test finds a candidate."""
    from veritrain import rounding

    assert rounding.kernel_flag(Grid(32)) is rounding.stability_flag
    grid = Grid(27)
    gen = torch.Generator().manual_seed(9)
    y = torch.randn(5000, generator=gen, dtype=torch.float64)
    y32 = grid.round(y).double()
    y[::2] = (y32 + grid.spacing_at(y32) / 2)[::2]  # midpoints: candidates
    s = y.abs() * 1e3
    want = rounding.candidate_mask(y, s, 8.0, grid.low_mask, grid.half, grid.value_units)
    flag = rounding.kernel_flag(grid)(y, s, 8.0)
    assert flag.dtype == torch.float32 and torch.equal(flag != 0, want != 0) and set(flag.unique().tolist()) == {0, 1}
