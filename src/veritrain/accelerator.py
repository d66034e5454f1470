"""Hardware that really disagrees, on one CPU: an emulated accelerator and the worst case the error model allows.

The CPU variants in hardware.py change which CPU kernels run, but in float64 they agree on all but ~1e-9
of the values, so the log is almost never needed between them. Two emulations make the disagreement
real (selected with ``--variant reorder`` / ``--variant perturb``, read from ``VERITRAIN_EMULATE``):

* ``reorder`` evaluates approximate ops in float64 the way a GPU library would, with real arithmetic:
  matrix products and convolutions split along the reduction (split-K), each slice summed in reverse
  order, slices added in a tree, the bias added last (a GEMM epilogue); sums and means over 32 strided
  lanes added in a tree; ``a + b*c`` shapes (addcmul, addcdiv, lerp, add with alpha) fused into one
  multiply-add where this CPU's kernels do not fuse, and associated differently or left unfused where
  they do; division by a scalar as multiplication by its reciprocal; and library functions (exp,
  log, tanh, erf, ...) from a different faithful implementation: the CPU's result moved by one float64
  ulp on about a quarter of the inputs (chosen by a hash of the result; possibly exact results are kept),
  so within 2 ulp of the truth.
* ``perturb`` moves every approximate float64 result by a pseudo-random amount of up to 0.9 x its
  threshold before rounding: any further and an honest trainer's log would no longer be guaranteed to
  cover the auditor. Verified replay must still match bit for bit; rounding without a log must not.

Both only change what the engine computes for ``approx`` rows (rules.py). Exact ops are the same on
every conforming machine and are left alone.
"""

from __future__ import annotations

import hashlib
import os

import torch

from .rounding import UNIT_ROUNDOFF

aten = torch.ops.aten
EMULATIONS = ("reorder", "perturb")
PERTURB_FRACTION = 0.9  # of the threshold tau = c * u * scale
SPLIT_K = 4  # cuBLAS/CUTLASS split-K uses a handful of slices
LANES = 32  # one warp's worth of partial sums in a reduction


def active() -> str | None:
    """The emulation this process runs under, or None."""
    name = os.environ.get("VERITRAIN_EMULATE", "")
    if not name:
        return None
    if name not in EMULATIONS:
        raise ValueError(f"VERITRAIN_EMULATE={name!r} is not one of {', '.join(EMULATIONS)}")
    return name


# --- perturb ------------------------------------------------------------------------------------


def perturb(y: torch.Tensor, scale: torch.Tensor, c: float, key: tuple) -> torch.Tensor:
    """``y`` moved by up to PERTURB_FRACTION * c * u * scale, uniformly at random (seeded by ``key``)."""
    seed = int.from_bytes(hashlib.sha256(repr(key).encode()).digest()[:8], "little") >> 1
    g = torch.Generator().manual_seed(seed)
    r = torch.rand(y.shape, generator=g, dtype=torch.float64).to(y.device) * 2 - 1
    bound = PERTURB_FRACTION * c * UNIT_ROUNDOFF * scale.expand(y.shape)
    moved = y + r * bound
    # the addition rounds: step back one ulp where that took it past the bound
    moved = torch.where((moved - y).abs() > bound, torch.nextafter(moved, y), moved)
    return torch.where(torch.isfinite(moved) & torch.isfinite(y), moved, y)


# --- reorder: the pieces ------------------------------------------------------------------------


def _tree_sum(parts: torch.Tensor) -> torch.Tensor:
    """Sum along dim 0 pairwise (the order of a parallel reduction)."""
    while parts.shape[0] > 1:
        if parts.shape[0] % 2:
            parts = torch.cat([parts, torch.zeros_like(parts[:1])])
        parts = parts[0::2] + parts[1::2]
    return parts[0]


def _slices(n: int, parts: int = SPLIT_K, min_len: int = 16) -> list[slice]:
    k = max(1, min(parts, n // min_len))  # short reductions are not split
    bounds = [round(i * n / k) for i in range(k + 1)]
    return [slice(bounds[i], bounds[i + 1]) for i in range(k)]


def _mm(a, b):
    """a @ b (last dim of a against dim -2 of b) split-K, each slice in reverse order, tree-summed."""
    k = a.shape[-1]
    parts = [torch.matmul(a[..., s].flip(-1), b[..., s, :].flip(-2)) for s in _slices(k)]
    return _tree_sum(torch.stack(parts))


def _epilogue(prod, bias, beta, alpha):
    """GEMM epilogue: alpha * (a @ b) + beta * bias, added after the product (CPUs start from the bias)."""
    out = prod if alpha == 1 else prod * alpha
    if bias is None or beta == 0:
        return out
    return out + (bias if beta == 1 else bias * beta)


def _reduce(x, dims, keepdim):
    """Sum over ``dims`` in 32 strided lanes, the lanes added in a tree."""
    dims = sorted(d % x.dim() for d in dims) if dims else list(range(x.dim()))
    if not dims:
        return x.clone()
    keep = [d for d in range(x.dim()) if d not in dims]
    moved = x.permute(keep + dims).reshape([x.shape[d] for d in keep] + [-1])
    n = moved.shape[-1]
    pad = (-n) % LANES
    if pad:
        moved = torch.cat([moved, moved.new_zeros(moved.shape[:-1] + (pad,))], dim=-1)
    lanes = moved.reshape(moved.shape[:-1] + ((n + pad) // LANES, LANES)).sum(-2)
    out = _tree_sum(lanes.movedim(-1, 0))
    if keepdim:
        for d in dims:
            out = out.unsqueeze(d)
    return out


def _split(v: torch.Tensor):
    """Veltkamp's split of float64 values into two halves of 26 bits (exact products of halves)."""
    t = v * 134217729.0  # 2**27 + 1
    hi = t - (t - v)
    return hi, v - hi


def fma(a, b, c):
    """a * b + c with one rounding (to within float64's last bit), from error-free transformations:
    the product's exact error (Dekker) and the sum's (Knuth) are carried and added once at the end."""
    if not any(isinstance(x, torch.Tensor) and x.dtype == torch.float64 for x in (a, b, c)):
        # float32 operands (plain float32 runs): the float64 product is exact, one more rounding to float32
        return (torch.as_tensor(a, dtype=torch.float64) * torch.as_tensor(b, dtype=torch.float64)
                + torch.as_tensor(c, dtype=torch.float64)).float()
    a, b, c = torch.as_tensor(a, dtype=torch.float64), torch.as_tensor(b, dtype=torch.float64), \
        torch.as_tensor(c, dtype=torch.float64)
    p = a * b
    ah, al = _split(a)
    bh, bl = _split(b)
    e = ((ah * bh - p) + ah * bl + al * bh) + al * bl
    s = p + c
    bb = s - p
    t = (p - (s - bb)) + (c - bb)
    out = s + (t + e)
    return torch.where(torch.isfinite(out), out, p + c)  # huge or non-finite operands: plain evaluation


def _other_libm(y: torch.Tensor) -> torch.Tensor:
    """A different faithful implementation of a library function: ``y`` moved by one ulp on a quarter
    of the elements, chosen by a hash of its bits (so the same input always gives the same output)."""
    if y.dtype == torch.float32:  # plain float32 runs
        bits = y.contiguous().view(torch.int32)
        h = (bits * -1640531535) >> 29
    else:
        bits = y.contiguous().view(torch.int64)
        h = (bits * -7046029254386353131) >> 61  # top bits of a multiplicative hash: -4..3
    # a faithful function returns a representable result exactly (x**2 of a float32 value, sqrt of a
    # square): a result whose last 5 significand bits are zero may be one, so it is left alone
    inexact = (bits & 31) != 0
    up, down = (h == 1) & inexact, (h == -2) & inexact
    moved = torch.where(up, torch.nextafter(y, torch.full_like(y, float("inf"))), y)
    moved = torch.where(down, torch.nextafter(y, torch.full_like(y, float("-inf"))), moved)
    return torch.where(torch.isfinite(y) & (y != 0), moved, y)


# --- reorder: the table -------------------------------------------------------------------------


def _mm_op(self, mat2):
    return _mm(self, mat2)


def _addmm_op(bias, a, b, *, beta=1, alpha=1):  # addmm and baddbmm: the product, then the bias
    return _epilogue(_mm(a, b), bias, beta, alpha)


def _sum_op(x, dim=None, keepdim=False, *, dtype=None):
    return _reduce(x, list(dim) if dim is not None else None, keepdim)


def _mean_op(x, dim=None, keepdim=False, *, dtype=None):
    dims = list(dim) if dim is not None else list(range(x.dim()))
    n = 1
    for d in dims or range(x.dim()):
        n *= x.shape[d]
    return _reduce(x, dims, keepdim) / n


def _conv_ok(transposed, groups):
    return not transposed and groups == 1


def _convolution_op(x, w, bias, stride, padding, dilation, transposed, output_padding, groups):
    if not _conv_ok(transposed, groups):
        return None
    # split-K over input channels, each slice in reverse order
    parts = [aten.convolution(x[:, s].flip(1), w[:, s].flip(1), None, stride, padding, dilation, transposed,
                              output_padding, groups) for s in _slices(x.shape[1], min_len=4)]
    out = _tree_sum(torch.stack(parts))
    if bias is not None:
        out = out + bias.reshape((1, -1) + (1,) * (out.dim() - 2))
    return out


def _convolution_backward_op(go, x, w, bias_sizes, stride, padding, dilation, transposed, output_padding, groups,
                             output_mask):
    if not _conv_ok(transposed, groups):
        return None
    args = (stride, padding, dilation, transposed, output_padding, groups)
    gi = gw = gb = None
    if output_mask[0]:  # split over output channels, each slice reversed
        gi = _tree_sum(torch.stack([aten.convolution_backward(go[:, s].flip(1), x, w[s].flip(0), None, *args,
                                                              [True, False, False])[0]
                                    for s in _slices(w.shape[0], min_len=4)]))
    if output_mask[1]:  # split over the batch, as GPU weight-gradient kernels do, each slice reversed
        gw = _tree_sum(torch.stack([aten.convolution_backward(go[s].flip(0), x[s].flip(0), w, None, *args,
                                                              [False, True, False])[1]
                                    for s in _slices(x.shape[0], min_len=1)]))
    if output_mask[2]:
        gb = _reduce(go, [0] + list(range(2, go.dim())), False)
    return gi, gw, gb


# The CPU's vectorized kernels already fuse (value * t1) * t2 + self, lerp and add-with-alpha into one
# FMA each (measured: same bits as the fma below); the accelerator associates differently, or not at all.
def _addcmul_op(x, t1, t2, *, value=1):
    return fma(t1 * t2, value, x)


def _addcdiv_op(x, t1, t2, *, value=1):
    return fma(value, t1 / t2, x)


def _lerp_op(x, end, weight):
    diff = end - x
    w = torch.as_tensor(weight, dtype=torch.float64)
    return torch.where(w.abs() < 0.5, x + w * diff, end - diff * (1 - w))


def _add_op(x, other, *, alpha=1):
    if not isinstance(other, torch.Tensor) or alpha == 1:
        return None
    return x + other * alpha


def _sub_op(x, other, *, alpha=1):
    if not isinstance(other, torch.Tensor) or alpha == 1:
        return None
    return x - other * alpha


def _div_op(x, other, *, rounding_mode=None):
    if rounding_mode is not None:
        return None
    if isinstance(other, torch.Tensor) and other.numel() != 1:
        return None
    return x * (1.0 / (other.item() if isinstance(other, torch.Tensor) else float(other)))


def _libm(packet):
    def op(*args, **kwargs):
        return _other_libm(packet(*args, **kwargs))
    return op


LIBRARY_FUNCTIONS = ("exp", "exp2", "expm1", "log", "log2", "log10", "log1p", "tanh", "sigmoid", "erf", "erfc",
                     "sqrt", "rsqrt", "pow", "sin", "cos", "tan", "gelu", "gelu_backward", "silu", "silu_backward",
                     "tanh_backward", "sigmoid_backward", "softplus", "softplus_backward", "elu", "mish", "sinh",
                     "cosh", "asinh", "atan")

# functional op packet -> float64 implementation, or one that returns None to run the CPU kernel
REORDER = {
    "mm": _mm_op, "bmm": _mm_op, "addmm": _addmm_op, "baddbmm": _addmm_op,
    "sum": _sum_op, "mean": _mean_op,
    "convolution": _convolution_op, "convolution_backward": _convolution_backward_op,
    "addcmul": _addcmul_op, "addcdiv": _addcdiv_op, "lerp": _lerp_op,
    "add": _add_op, "sub": _sub_op, "div": _div_op,
}


def reorder_kernel(func):
    """The emulated accelerator's implementation of ``func`` (a functional aten overload), or None."""
    name = func._overloadpacket.__name__
    impl = REORDER.get(name)
    if impl is None and name in LIBRARY_FUNCTIONS:
        impl = _libm(func)
    if impl is None:
        return None

    def run(*args, **kwargs):
        out = impl(*args, **kwargs)
        return func(*args, **kwargs) if out is None else out
    return run
