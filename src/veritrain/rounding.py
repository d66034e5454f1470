"""Rounding float64 results onto the model's grid, and finding the results that sit near a midpoint.

The grid is float32 with its lowest ``32 - bits`` mantissa bits forced to zero (``bits = 32`` is plain
float32, as in the paper's "rounding amount" b). Every value is rounded to the nearest grid point, ties
to the even one. Subnormals follow the same rule on their bit pattern; values past the largest grid
point round to infinity exactly as an IEEE conversion would.

The trainer also asks, for each result y, whether another correct float64 implementation could round it
the other way. With an error bound ``tau`` on |y - y'| (see ``rules.py`` for where it comes from):

* ``direction`` entry: y lies within ``tau`` of a midpoint between two grid points; we log which
  neighbour we took (1 = the one of larger magnitude).
* ``value`` entry: ``tau`` is not small against the grid spacing at y (at least 1/8 of a cell), so the
  cell itself is not determined (a mathematically-zero result made of rounding noise, say); we log the
  grid value.

The bulk test works on float64 bit patterns: for y in float32's normal range, the low ``29 + drop``
bits of the float64 significand are y's position inside its grid cell, in float64 ulps of y. Elements
that pass the cheap test (a superset) are classified exactly on the few survivors.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from .hardware import compiled_path

UNIT_ROUNDOFF = 2.0**-53  # u for float64: |fl(x) - x| <= u |x|
_TWO_52 = 2.0**52
_TWO_52_BITS = 0x4330000000000000  # the bit pattern of 2.0**52
FLOAT32_MIN_NORMAL = 2.0**-126
_INT64 = torch.int64


def _on_host(method):
    """A Grid method written for NumPy arrays, also callable with torch tensors: these are moved to the host
    and the results (arrays, or tuples of them) back to the first tensor's device. NumPy arrays and cells
    (tuples of arrays) pass through as they are."""

    def wrapper(self, *args):
        device = next((a.device for a in args if isinstance(a, torch.Tensor)), None)
        if device is None:
            return method(self, *args)
        host = [a.detach().cpu().numpy() if isinstance(a, torch.Tensor)
                else tuple(t.detach().cpu().numpy() for t in a) if isinstance(a, tuple) else a for a in args]
        out = method(self, *host)
        back = lambda r: torch.from_numpy(np.ascontiguousarray(r)).to(device)  # noqa: E731
        return tuple(back(r) for r in out) if isinstance(out, tuple) else back(out)

    wrapper.__name__, wrapper.__doc__, wrapper.__wrapped__ = method.__name__, method.__doc__, method
    return wrapper


class Grid:
    """The set of float32 values whose lowest ``32 - bits`` mantissa bits are zero."""

    def __init__(self, bits: int = 32):
        if not isinstance(bits, int) or not 23 <= bits <= 32:
            raise ValueError(f"rounding amount must be an integer in 23..32, got {bits!r}")
        self.bits = bits
        self.drop = 32 - bits
        # float64 significand bits below the grid's last bit, for values in float32's normal range
        self.cell_bits = 29 + self.drop
        self.low_mask = (1 << self.cell_bits) - 1
        self.half = 1 << (self.cell_bits - 1)
        # tau >= cell/8 means the cell is undetermined (value entry); in float64-ulp units of y
        self.value_units = 1 << (self.cell_bits - 3)
        self.min_spacing = 2.0 ** (-149 + self.drop)

    def __repr__(self) -> str:
        return f"Grid(bits={self.bits})"

    # --- rounding -------------------------------------------------------------------------------

    def round(self, y: torch.Tensor) -> torch.Tensor:
        """Round a float64 tensor to the grid; returns float32 (same shape and layout)."""
        if y.dtype != torch.float64:
            y = y.to(torch.float64)
        if self.drop == 0:
            return y.to(torch.float32)
        bits = y.view(_INT64)
        # round-to-nearest-even at bit ``cell_bits`` of the significand; a carry moves to the next binade
        odd = torch.bitwise_right_shift(bits, self.cell_bits).bitwise_and_(1)
        rounded = (bits + (self.half - 1)).add_(odd).bitwise_and_(~self.low_mask)
        out = rounded.view(torch.float64)
        tiny = y.abs() < FLOAT32_MIN_NORMAL
        if bool(tiny.any()):
            # below float32's normal range the grid spacing is fixed
            sub = torch.round(y[tiny] / self.min_spacing) * self.min_spacing
            out = out.clone()
            out[tiny] = sub
        out = torch.where(torch.isnan(y), y, out)
        return out.to(torch.float32)

    def round_into(self, y: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """``round(y)`` written into the float32 tensor ``out`` (same shape; a view of a larger result, say). On
        float32's own grid the rounding is the float64 -> float32 conversion, which ``copy_`` makes while it
        writes (the same round-to-nearest-even as ``.to``): no float32 temporary written and read back."""
        if self.drop == 0 and y.dtype == torch.float64:
            return out.copy_(y)
        return out.copy_(self.round(y))

    def round_scalar(self, x: float) -> float:
        return float(self.round(torch.tensor([x], dtype=torch.float64))[0])

    def on_grid(self, v):
        """Which float32 values lie on this grid (non-finite values count as on it); torch or NumPy."""
        if isinstance(v, np.ndarray):
            ints, finite = v.astype(np.float32, copy=False).view(np.int32), np.isfinite(v)
        else:
            v = v.to(torch.float32)
            ints, finite = v.view(torch.int32), torch.isfinite(v)
        if self.drop == 0:
            return finite | ~finite
        return (ints & ((1 << self.drop) - 1) == 0) | ~finite

    # --- exact neighbourhood of a value (used on the few candidates and log entries) ------------
    # In NumPy: they run on a handful of values per output, where a NumPy operation costs a fraction of a
    # torch operation's dispatch (the auditor's checks of one output's entries were ~60 torch operations).
    # torch tensors are accepted too (tests, benchmarks): moved to the host and the results moved back.

    @_on_host
    def round_host(self, y: np.ndarray) -> np.ndarray:
        """``round`` for float64 NumPy values: the same bit operations, one for one."""
        with np.errstate(over="ignore", invalid="ignore"):
            if self.drop == 0:
                return y.astype(np.float32)  # IEEE round-to-nearest-even, as torch's conversion
            bits = y.view(np.int64)
            odd = (bits >> self.cell_bits) & 1
            out = ((bits + (self.half - 1) + odd) & ~self.low_mask).view(np.float64)
            tiny = np.abs(y) < FLOAT32_MIN_NORMAL
            if tiny.any():
                out = out.copy()
                out[tiny] = np.round(y[tiny] / self.min_spacing) * self.min_spacing  # ties to even, as torch
            return np.where(np.isnan(y), y, out).astype(np.float32)

    @_on_host
    def cell(self, y: np.ndarray):
        """For float64 ``y``: (lower, upper, spacing) of the grid cell containing |y|, in magnitude."""
        ay = np.abs(y)
        _, e = np.frexp(ay)  # ay = m * 2**e with m in [0.5, 1)
        e = np.where(ay == 0, -1000, e)
        spacing = np.ldexp(1.0, np.maximum(e - 1, -126) - 23 + self.drop)  # exact
        with np.errstate(invalid="ignore"):
            lower = np.floor(ay / spacing) * spacing
        return lower, lower + spacing, spacing

    @_on_host
    def classify(self, y: np.ndarray, tau: np.ndarray):
        """Exact decision for candidate elements.

        Returns (is_value, is_direction, away) as bool arrays: whether the element needs a value
        entry, a direction entry, and whether rounding ``y`` to nearest-even went away from zero.
        """
        lower, upper, spacing = self.cell(y)
        ay = np.abs(y)
        mid = lower + spacing / 2
        with np.errstate(invalid="ignore"):
            finite = np.isfinite(y) & (ay < 2.0**128)
            is_value = finite & (tau >= spacing / 8)
            is_direction = finite & ~is_value & (np.abs(ay - mid) < tau)
            away = np.abs(self.round_host(y).astype(np.float64)) > ay
        return is_value, is_direction, away

    @_on_host
    def apply_direction(self, y: np.ndarray, away: np.ndarray, cell=None) -> np.ndarray:
        """Round float64 ``y`` to the lower or upper (in magnitude) neighbour of its cell (``cell``: this
        y's ``self.cell(y)``, where the caller has it)."""
        lower, upper, _ = self.cell(y) if cell is None else cell
        with np.errstate(over="ignore"):
            return np.copysign(np.where(away, upper, lower), y).astype(np.float32)

    @_on_host
    def midpoint_distance(self, y: np.ndarray, cell=None) -> np.ndarray:
        """|y - midpoint of its cell|, exact, float64."""
        lower, _, spacing = self.cell(y) if cell is None else cell
        with np.errstate(invalid="ignore"):
            return np.abs(np.abs(y) - (lower + spacing / 2))

    @_on_host
    def spacing_at(self, y: np.ndarray) -> np.ndarray:
        return self.cell(y)[2]

    # --- the bulk test --------------------------------------------------------------------------

    def candidates(self, y: torch.Tensor, scale: torch.Tensor | float, c: float) -> torch.Tensor:
        """Mask (nonzero = candidate), a superset of the elements that need a log entry for
        tau = c*u*scale.

        In float64-ulp units of y, tau is below ``c scale / |y|``; an element is a candidate if its
        distance to the midpoint (clamped at the value-entry level) is below that, or if |y| is below
        float32's normal range (where the bit test does not apply) and its scale is not zero.
        """
        return _candidates(y, scale, c, self)

    def candidate_positions(self, y: torch.Tensor, scale: torch.Tensor | float, c: float) -> torch.Tensor:
        """The flat positions (int64, ascending) of ``candidates``' nonzero elements. Where NumPy scans (small
        results) NumPy finds them too: torch's nonzero costs more than the scan itself there."""
        return _candidates(y, scale, c, self, positions=True)


def power_of_two(exponent: torch.Tensor) -> torch.Tensor:
    """2.0**exponent as float64, built from the bit pattern (exact; exponent in -1022..1023)."""
    return (exponent.to(_INT64) + 1023).bitwise_left_shift_(52).view(torch.float64)


def candidate_mask(y, scale, c: float, low_mask: int, half: int, value_units: int):
    """int8 mask (-1 = candidate, 0 = not) of the bulk near-midpoint test on float64 ``y``.

    The mask is the sign bit of ``dev * |y| - c * scale`` (and of ``0 - c * scale`` below float32's
    normal range): written without booleans, because compiled CPU kernels that combine or store
    float64 comparison masks run several times slower.

    ``dev`` = min(|low bits - half|, value_units) is computed in float64, exactly: the low bits (below
    2**38) become a float64 by placing them in the significand of 2**52 and subtracting 2**52, and every
    later value is an integer below 2**52. AVX2 has no int64 abs, min or conversion to float64, so the
    same steps on int64 compiled to scalar code: the trainer's fused kernels ran 2-3x slower than the
    auditor's (docs/SPEED.md). ``_mask_numpy`` keeps the int64 steps; tests compare the two.
    """
    low = ((y.view(_INT64) & low_mask) | _TWO_52_BITS).view(torch.float64) - _TWO_52
    dev = (low - float(half)).abs().clamp(max=float(value_units))
    ay = y.abs()
    bound = scale * c
    d = torch.where(ay < FLOAT32_MIN_NORMAL, 0.0 - bound, dev * ay - bound)
    return (d.view(_INT64) >> 63).to(torch.int8)


def stability_flag(y, scale, c: float):
    """float32 flag (1 = candidate, 0 = not) of a near-midpoint test for the float32 grid (bits = 32) that
    compiled kernels run at about 60% of candidate_mask's cost: y is a candidate where its rounding changes
    within b = tau (1 + 2**-40) + |y| 2**-50 of it (tau = c u scale; b = 0 where the scale is 0, so an exact
    tie of an exact result is no candidate), or where b 2**27 >= |y|.

    A superset of the elements that need an entry (docs/ROUNDING.md, "The kernels' test"). Direction: y within
    tau of a midpoint m puts y + b and y - b on either side of m, each at least b - tau >= |y| 2**-50 away,
    four float64 ulps of y and more than the rounding error of b and of y +- b; so their float32 conversions
    (the grid's rounding when bits = 32, ties and subnormals included) are the two neighbours or beyond, and
    differ by at least 2**-149. Value: tau >= spacing/8 > |y| 2**-27 (in float32's normal range; below it
    spacing/8 = 2**-152 > |y| 2**-27), so b 2**27 - |y| > 0, and it is more than 2**-166 (scaled by 2**200
    before its conversion to float32, it does not underflow). Neither part needs a float64 comparison or int64
    arithmetic, which AVX2 lacks in vectors (candidate_mask's bit test needs both or their emulation). The two
    parts are added, scaled to at least 1 where either is positive, and capped at 1 by fmin, which also gives
    1 for NaN (y or its scale NaN, y past float32's range): classify gives such results no entry.
    """
    ay = y.abs()
    # |y| 2**-50, or 0 where the scale is 0 (a nonzero scale times 2**1200 is at least 2**126, more than
    # |y| 2**-50 for every y in float32's range)
    floor = torch.minimum(ay * 2.0**-50, scale * 2.0**600 * 2.0**600)
    b = scale * (c * UNIT_ROUNDOFF * (1.0 + 2.0**-40)) + floor
    moved = (y + b).to(torch.float32) - (y - b).to(torch.float32)  # >= 0: rounding is monotone
    wide = ((b * 2.0**27 - ay) * 2.0**200).to(torch.float32).clamp(min=0.0)
    flag = moved * 2.0**100 * 2.0**100 + wide
    return torch.fmin(flag, torch.ones_like(flag))


def stability_mask(y, scale, c: float):
    """stability_flag as a one-byte mask (1 = candidate)."""
    return stability_flag(y, scale, c).to(torch.int8)


def kernel_flag(grid: "Grid"):
    """The near-midpoint test compiled kernels run for ``grid``, as a function of (y, scale, c) giving a float32
    flag (1 = candidate, 0 = not; a float, so that a kernel can also select by it at vector speed): the
    stability test where the grid is float32 itself, candidate_mask's bit test on coarser grids."""
    if grid.drop == 0:
        return stability_flag
    low_mask, half, value_units = grid.low_mask, grid.half, grid.value_units

    def bit_test(y, scale, c: float):
        return -candidate_mask(y, scale, c, low_mask, half, value_units).to(torch.float32)

    return bit_test


def mask_positions(mask: torch.Tensor) -> torch.Tensor:
    """Flat positions (int64, ascending) of a one-byte mask's nonzero elements: ``mask.reshape(-1).nonzero()``,
    found faster when they are rare, as candidates are. torch's nonzero reads
    the mask byte by byte; this first finds the nonzero 8-byte words, then the bytes inside those words."""
    flat = mask.reshape(-1)
    n = flat.numel()
    if n < _WORD_SCAN_MIN_NUMEL or flat.element_size() != 1 or flat.storage_offset() % 8 or flat.device.type != "cpu":
        return flat.nonzero().squeeze(1)
    head = n - n % 8
    words = flat[:head].view(torch.int64).nonzero().squeeze(1)
    if words.numel() * 8 > head // 4:  # not rare after all: the byte scan is cheaper than gathering
        return flat.nonzero().squeeze(1)
    inside = flat[:head].view(-1, 8)[words].nonzero()
    pos = words[inside[:, 0]] * 8 + inside[:, 1]
    if head < n:
        pos = torch.cat([pos, flat[head:].nonzero().squeeze(1) + head])
    return pos


_WORD_SCAN_MIN_NUMEL = 1 << 12


def _candidates_eager(y, scale, c2: float, low_mask: int, half: int, value_units: int, positions: bool = False):
    if y.device.type == "cpu" and y.numel() <= _NUMPY_MAX_NUMEL and y.dtype == scale.dtype == torch.float64:
        near = _near_numpy(y, scale, c2, low_mask, half, value_units)
        if positions:
            return torch.from_numpy(np.flatnonzero(near).astype(np.int64, copy=False))
        return torch.from_numpy(np.negative(near.view(np.int8))).view(y.shape)
    mask = candidate_mask(y, scale, c2, low_mask, half, value_units)
    return mask_positions(mask) if positions else mask


def _candidate_mask_numpy(y, scale, c: float, low_mask: int, half: int, value_units: int):
    return torch.from_numpy(_mask_numpy(y, scale, c, low_mask, half, value_units)).view(y.shape)


def _mask_numpy(y, scale, c: float, low_mask: int, half: int, value_units: int) -> np.ndarray:
    """candidate_mask in NumPy (1-D int8, -1 = candidate): the sign bits of ``_near_numpy``'s differences."""
    return np.negative(_near_numpy(y, scale, c, low_mask, half, value_units).view(np.int8))


def _near_numpy(y, scale, c: float, low_mask: int, half: int, value_units: int) -> np.ndarray:
    """candidate_mask's arithmetic in NumPy (1-D bool, True = candidate), with its distance kept in int64 (the
    reference the float64 form is tested against): on small tensors a NumPy op costs less dispatch than a
    torch op, and the scan of a small model's results is a sixth of its verified step (bench/profile_engine.py,
    the `scan` category). Same values as candidate_mask, sign bits included (the sign of ``dev * |y| - bound``
    where ``|y|`` is NaN is that NaN's), computed in place: fewer passes, fewer fresh buffers."""
    yn, sn = y.detach().reshape(-1).numpy(), scale.detach().reshape(-1).numpy()  # 1-D: arrays, not scalars
    dev = yn.view(np.int64) & low_mask
    dev -= half
    np.abs(dev, out=dev)
    np.minimum(dev, value_units, out=dev)
    ay = np.abs(yn)
    tiny = ay < FLOAT32_MIN_NORMAL  # below float32's normal range the bit test does not apply: -bound
    bound = sn * c
    d = np.multiply(dev, ay, out=ay)  # dev converted to float64 (exact: below 2**52), times |y|
    d -= bound
    if tiny.any():
        d[tiny] = 0.0 - bound[tiny]
    return np.signbit(d)


_NUMPY_MAX_NUMEL = 1 << 18


def any_candidate(y, scale, c: float, grid: Grid) -> bool:
    """Whether any element of float64 ``y`` is a candidate by the eager engine's bulk test (candidate_mask,
    in NumPy up to 2**18 values as ``_candidates_eager``). A captured region run as Python asks only this of
    each approximate op (capture.py): in NumPy it costs less than stability_flag's ~20 torch ops on the small
    results such regions have (8 to 32768 values; `python bench/bench_regions.py`, its two Python columns)."""
    c = float(c)
    scale = _scale_like(scale, y)
    if y.device.type == "cpu" and y.numel() <= _NUMPY_MAX_NUMEL and y.dtype == scale.dtype == torch.float64:
        return bool(_near_numpy(y, scale, c, grid.low_mask, grid.half, grid.value_units).any())
    return bool(candidate_mask(y.contiguous(), scale.contiguous(), c, grid.low_mask, grid.half, grid.value_units).any())


def _scale_like(scale, y: torch.Tensor) -> torch.Tensor:
    """A scale (a number, or a tensor that broadcasts) at y's shape, as float64; one already of that shape as it is."""
    if not isinstance(scale, torch.Tensor) or scale.shape != y.shape:
        scale = torch.as_tensor(scale, dtype=torch.float64, device=y.device).expand(y.shape)
    return scale


_compiled = None


def _candidates(y, scale, c, grid: Grid, positions: bool = False):
    # tau / ulp64(y) = c * u * scale / ulp64(y) < c * scale / |y|, because ulp64(y) > u * |y|
    c2 = float(c)
    scale = _scale_like(scale, y)
    y = y.contiguous()
    scale = scale.contiguous()
    if compiled_path(y.numel(), y.device, "VERITRAIN_COMPILE_MIN_NUMEL", 1 << 20):
        fn = _get_compiled()
        if fn is not None:
            mask = fn(y.reshape(-1), scale.reshape(-1), c2, grid.low_mask, grid.half, grid.value_units)
            return mask_positions(mask) if positions else mask.view(y.shape)
    return _candidates_eager(y, scale, c2, grid.low_mask, grid.half, grid.value_units, positions)


def _get_compiled():
    """A fused kernel of the same computation (torch.compile), or None if it cannot be built here."""
    global _compiled
    if _compiled is None:
        from .fused import compile_kernel, isolate_compile_cache

        isolate_compile_cache()
        try:
            fn = compile_kernel(candidate_mask, fullgraph=False)
            probe = torch.tensor([1.0, 0.0, 1.5], dtype=torch.float64)
            fn(probe, probe, 2.0, (1 << 29) - 1, 1 << 28, 1 << 26)
            _compiled = fn
        except Exception as exc:  # no C++ compiler, unsupported platform, ...
            import warnings

            warnings.warn(f"veritrain: fused rounding kernel unavailable ({exc}); using eager ops")
            _compiled = False
    return _compiled or None


# --- exact references (tests and documentation) --------------------------------------------------


def reference_round(x, bits: int = 32) -> float:
    """Round a Python float / Fraction exactly to the b-bit float32 grid (slow, exact)."""
    from fractions import Fraction

    if isinstance(x, float):
        if math.isnan(x):
            return x
        if math.isinf(x):
            return x
    q = Fraction(x)
    if q == 0:
        return math.copysign(0.0, x) if isinstance(x, float) else 0.0
    sign = -1 if q < 0 else 1
    a = abs(q)
    drop = 32 - bits
    # exponent e with 2**e <= a < 2**(e+1)
    e = a.numerator.bit_length() - a.denominator.bit_length()
    if Fraction(2) ** e > a:
        e -= 1
    elif Fraction(2) ** (e + 1) <= a:
        e += 1
    spacing_exp = max(e, -126) - 23 + drop
    spacing = Fraction(2) ** spacing_exp
    k, rem = divmod(a, spacing)
    k = int(k)
    if rem * 2 > spacing or (rem * 2 == spacing and k % 2 == 1):
        k += 1
    value = k * spacing
    if value >= Fraction(2) ** 128:
        return sign * math.inf
    return sign * float(value)
