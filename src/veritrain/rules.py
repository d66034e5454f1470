"""The per-operator rules: one row per aten op, in the style of torch/utils/flop_counter.py.

Each op the engine sees falls in one kind:

* ``passthrough`` - creates no new floating value: views, data movement, selection, comparisons,
  integer results. Runs natively on the float32 tensors.
* ``exact``       - one correctly rounded IEEE operation (add, sub, mul, div by a tensor) or a
  conversion; float64 gives the same bits on every conforming machine, so nothing is logged. (sqrt is
  not here: PyTorch's CPU kernel calls MKL's vector math library, which is not correctly rounded.)
* ``approx``      - anything else. The engine computes it in float64, rounds it, and logs the results
  that another correct implementation could round differently. The row names a threshold class and
  an *error scale*: a tensor broadcastable to each output such that any two correct float64
  implementations differ by well under ``c * u * scale`` (u = 2**-53, c from the class).
* ``random``      - draws from the counter-based generator (randomness.py).
* ``decompose``   - computed as its steps (decompositions.py), each step rounded by its own row: for
  normalization and softmax, whose fused kernels would otherwise need many log entries.
* ``unsupported`` - refused with an error that names the op and what to do instead.

Error scales (see docs/ROUNDING.md for the reasoning): a sum of n terms computed in any order is within
``lambda * sqrt(n) * u * sum|terms|`` of the exact value with overwhelming probability (Higham & Mary,
2019), so accumulations use ``sqrt(n) * sum|terms|``; for matrix products and convolutions
``sum|a*b|`` is bounded cheaply by Cauchy-Schwarz, ``||a_row|| * ||b_col||``. Short elementwise
formulas use the magnitudes of their terms (for ``self + t`` that is ``|self| + |result|``), and
library functions (exp, tanh, ...) their result, except where the formula can cancel (gelu uses |x|).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np
import torch

from .fused import abs_sum_and_min, sum_of_squares, vector_norm

aten = torch.ops.aten

PASSTHROUGH, EXACT, APPROX, RANDOM, DECOMPOSE, UNSUPPORTED = ("passthrough", "exact", "approx", "random", "decompose",
                                                            "unsupported")

# Default threshold constants c per class: tau = c * u * scale. Measured differences across the
# hardware variants stay far below these (docs/ROUNDING.md, `veritrain calibrate`).
DEFAULT_THRESHOLDS = {
    "accumulate": 8.0,      # matmul, convolution, sums, pooling/embedding gradients
    "elementwise": 32.0,    # short formulas and library functions, scalar-divisor division
    "normalization": 16.0,  # layer/batch/group norm, variance
    "softmax": 16.0,        # softmax, log-softmax, losses
    "random": 16.0,         # normal, exponential, ... (transcendental transforms of uniforms)
    "fallback": 64.0,       # ops without a rule of their own
}


@dataclass(frozen=True)
class Rule:
    kind: str
    op_class: str = ""
    scale: Callable | None = None
    why: str = ""
    # a scale function f(y, a, kw) that fused.py can compute inside one kernel (see s_rel below)
    fused: Callable | None = None


class Call:
    """One invocation as the engine evaluated it: float64 inputs (scalars already on float32) and
    the float64 results, one per output slot (``None`` where the op returned no tensor). ``on_grid``: every
    float input holds float32 values, which the exactness certificate relies on. Float32 operands and the
    engine's own results always do; a float64 tensor from outside the engine need not, so the engine passes
    its float64 operands and they are checked when a certificate asks (``on_grid`` None)."""

    __slots__ = ("func", "args", "kwargs", "outputs", "_on_grid", "_float64_operands", "_index")

    def __init__(self, func, args, kwargs, outputs, on_grid: bool | None = True, float64_operands=()):
        self.func, self.args, self.kwargs, self.outputs = func, args, kwargs, outputs
        self._on_grid, self._float64_operands = on_grid, float64_operands
        self._index = _arg_index(func)

    @property
    def on_grid(self) -> bool:
        if self._on_grid is None:
            self._on_grid = all(bool(((x.to(torch.float32).to(x.dtype) == x) | x.isnan()).all())
                                for x in self._float64_operands)
        return self._on_grid

    def arg(self, name, default=None):
        if name in self.kwargs:
            return self.kwargs[name]
        pos, schema_default = self._index.get(name, (None, default))
        if pos is not None and pos < len(self.args):
            return self.args[pos]
        return default if schema_default is None else schema_default


_ARG_INDEX: dict = {}


def _arg_index(func):
    idx = _ARG_INDEX.get(func)
    if idx is None:
        idx = {}
        for i, a in enumerate(func._schema.arguments):
            d = a.default_value if a.has_default_value() else None
            idx[a.name] = (None if a.kwarg_only else i, d)
        _ARG_INDEX[func] = idx
    return idx


# --- lazy scales --------------------------------------------------------------------------------


class NormFactor:
    """||x|| along ``dim``, kept with a size-1 ``dim`` so that it broadcasts against the output (the
    row norms of a matrix product's left operand, the column norms of its right one). Computed in full
    only when every element needs its scale (the trainer); at a few positions otherwise. Always in float64:
    ``x`` may be a float32 operand the engine never copied whole (a blocked product's, blocked.py)."""

    __slots__ = ("x", "dim", "_full")

    def __init__(self, x: torch.Tensor, dim: int):
        self.x, self.dim, self._full = x, dim % x.dim(), None

    def full(self) -> torch.Tensor:
        if self._full is None:
            self._full = vector_norm(self.x.to(torch.float64), [self.dim])
        return self._full

    def at(self, coords) -> torch.Tensor:
        if self._full is not None:  # the trainer's kernel needed every norm: they are computed already
            return self._full[tuple(torch.zeros_like(c) if n == 1 else c for c, n in zip(coords, self._full.shape))]
        x = self.x.movedim(self.dim, -1)
        index = [c if self.x.shape[d] != 1 else torch.zeros_like(c) for d, c in enumerate(coords) if d != self.dim]
        outer = x.shape[:-1]
        flat = torch.zeros_like(coords[0])
        for c, size in zip(index, outer):
            flat = flat * size + c
        rows, inverse = torch.unique(flat, return_inverse=True)
        if rows.numel() * 4 >= flat.new_tensor(outer).prod().item():  # most rows: one pass over x
            return self.full().reshape(-1)[flat]
        # gather the rows by their coordinates: x.reshape(-1, n) would copy all of x where dim is not its last
        picked = x[torch.unravel_index(rows, outer)].to(torch.float64).contiguous()
        return torch.linalg.vector_norm(picked, dim=-1)[inverse]


GATHER_SHARE = 0.25  # a lazy factor at a few positions gathers their values while they are below this share of x
GATHER_NUMPY_NUMEL = 1 << 16  # ChannelNorm.at gathers up to this many values in NumPy, more in torch
# a patch value gathered costs about this many of the full norms' values (NumPy's fancy index over a window and all
# channels, against a sum of squares and a one-channel convolution): python bench/bench_conv_scales.py, its last table
PATCH_GATHER_COST = 2.5


class PatchNorm:
    """The norm of the patch of ``x`` that each output position of a convolution reads (all input channels,
    the kernel's window; zero padding adds nothing), with a size-1 channel dimension: (N, 1, *output spatial).
    ``backward``: the same for a convolution's input gradient, whose value at an input position sums over the
    output positions whose window covers it (``x`` is the output gradient, the positions the input's, of
    spatial size ``out_spatial``). Computed in full by a one-channel convolution where every element needs
    its scale (the trainer's scan); otherwise at the few positions asked for, from their patches alone (the
    auditor's entries, the trainer's candidates where nothing was computed in full)."""

    __slots__ = ("x", "kernel", "stride", "padding", "dilation", "backward", "out_spatial", "_full")

    def __init__(self, x, kernel, stride, padding, dilation, backward=False, out_spatial=None):
        n = len(kernel)
        self.x, self.kernel, self.backward = x, tuple(int(k) for k in kernel), backward
        self.stride, self.padding, self.dilation = (_per_dim(v, n) for v in (stride, padding, dilation))
        self.out_spatial = tuple(out_spatial) if backward else None
        self._full = None

    def full(self) -> torch.Tensor:
        if self._full is None:
            x, k = self.x, self.kernel
            ones = torch.ones((1, 1) + k, dtype=x.dtype, device=x.device)
            energy = sum_of_squares(x, [1])
            if self.backward:
                probe = torch.zeros((), dtype=x.dtype, device=x.device).expand((x.shape[0], 1) + self.out_spatial)
                energy = aten.convolution_backward(energy, probe, ones, None, self.stride, self.padding,
                                                   self.dilation, False, [0] * len(k), 1, [True, False, False])[0]
            else:
                energy = aten.convolution(energy, ones, None, self.stride, self.padding, self.dilation, False,
                                          [0] * len(k), 1)
            self._full = energy.clamp_(min=0).sqrt_()
        return self._full

    def at(self, host) -> torch.Tensor:
        """The norms at output positions given by their coordinates (batch, channel, *spatial) as NumPy arrays."""
        x, dev = self.x, self.x.device
        n, spatial = host[0], host[2:]
        if self._full is not None:  # the trainer's kernel needed every norm: they are computed already
            return _element_at(self._full, host, len(n))
        offsets = _window(self.kernel)  # (dims, window)
        if PATCH_GATHER_COST * len(n) * offsets.shape[1] * x.shape[1] >= GATHER_SHARE * x.numel():  # many: in full
            self.full()
            return self.at(host)
        valid = np.ones((len(n), offsets.shape[1]), bool)
        index = []
        for d, c in enumerate(spatial):
            reach = offsets[d] * self.dilation[d]
            size = x.shape[2 + d]
            if self.backward:  # the output positions o with o * stride - padding + reach == c
                num = c[:, None] + self.padding[d] - reach
                at = num // self.stride[d]
                valid &= num == at * self.stride[d]
            else:  # the input positions read by output position c
                at = c[:, None] * self.stride[d] - self.padding[d] + reach
            valid &= (at >= 0) & (at < size)
            index.append(np.minimum(np.maximum(at, 0), size - 1))  # (np.clip costs several times more)
        # the gather in NumPy where x is on the host (a few positions: NumPy's dispatch costs less than torch's)
        on_host = dev.type == "cpu"
        put = (lambda a: a) if on_host else (lambda a: torch.from_numpy(a).to(dev))  # noqa: E731
        src = x.detach().numpy() if on_host else x
        patches = src[(put(n[:, None]), slice(None), *map(put, index))]  # (positions, window, channels)
        energy = ((patches * patches).sum(2) * put(valid)).sum(1)
        return torch.from_numpy(np.sqrt(energy)) if on_host else energy.sqrt_()


@functools.lru_cache(maxsize=64)
def _window(kernel):
    """The offsets of a kernel's window, (dims, positions), read-only."""
    out = np.indices(kernel).reshape(len(kernel), -1)
    out.flags.writeable = False
    return out


def _per_dim(v, n):
    v = [int(v)] if isinstance(v, int) else [int(e) for e in v]
    return v * n if len(v) == 1 else v


class ChannelNorm:
    """||x|| over every dimension but the channel (1), as a factor along dimension ``axis`` of an ``ndim``-d
    output (a convolution's weight gradient: the output gradient's channel norms along its dimension 0, the
    input's along 1). With ``groups`` > 1, the largest of the groups' norms for each of the ``C / groups``
    channel positions. Computed in full where every element needs its scale; for the channels asked for
    otherwise."""

    __slots__ = ("x", "axis", "groups", "ndim", "_full")

    def __init__(self, x, axis, groups, ndim):
        self.x, self.axis, self.groups, self.ndim, self._full = x, axis, int(groups), ndim, None

    def full(self) -> torch.Tensor:
        if self._full is None:
            norms = vector_norm(self.x, [0, *range(2, self.x.dim())]).reshape(self.groups, -1).amax(0)
            self._full = norms.view([-1 if d == self.axis else 1 for d in range(self.ndim)])
        return self._full

    def at(self, host) -> torch.Tensor:
        """The norms at output positions given by their coordinates as NumPy arrays."""
        ch = host[self.axis]
        dev = self.x.device
        if self._full is not None:
            return _element_at(self._full, host, len(ch))
        wanted = np.unique(ch)
        if len(wanted) * self.groups >= GATHER_SHARE * self.x.shape[1]:  # most channels: one pass over x
            self.full()
            return self.at(host)
        inverse = np.searchsorted(wanted, ch)  # (np.unique's return_inverse costs several times more)
        per_group = self.x.shape[1] // self.groups
        rows = (np.arange(self.groups)[:, None] * per_group + wanted).reshape(-1)
        x = self.x.detach()
        others = (0, *range(2, x.dim()))
        if dev.type == "cpu" and len(rows) * (x.numel() // x.shape[1]) <= GATHER_NUMPY_NUMEL:
            sel = x.numpy()[:, rows]  # a few values: NumPy's dispatch costs less than torch's
            norms = np.sqrt((sel * sel).sum(others)).reshape(self.groups, -1).max(0)
            return torch.from_numpy(norms[inverse])
        # more: the channels' rows of positions copied whole (each contiguous in an NCHW x), each row's norm over
        # its positions at memory speed, the batch's summed. NumPy's gather of a middle axis and its sum over
        # outer ones took 3x the full norms' time for 8 of 64 channels (python bench/bench_conv_scales.py)
        sel = x.reshape(x.shape[0], x.shape[1], -1).index_select(1, torch.from_numpy(rows).to(dev))
        norms = torch.linalg.vector_norm(sel, dim=2).square_().sum(0).sqrt_().reshape(self.groups, -1).amax(0)
        return norms[torch.from_numpy(inverse).to(dev)]


class Deferred:
    """One output's scale, computed when the engine first asks for it (an op's other outputs may need none:
    the auditor reads the scales of outputs with log entries only)."""

    __slots__ = ("compute",)

    def __init__(self, compute):
        self.compute = compute


class LazyScale:
    """A scale kept as a sum of products of small broadcastable factors, sum_t coef_t * prod(factors_t)
    (e.g. sqrt(k) * ||row_i|| * ||col_j|| for a matrix product), so that it never has to exist at full
    size: the engine evaluates it inside the kernel that rounds the result, or only where needed.
    Factors are tensors or NormFactors."""

    __slots__ = ("terms",)

    def __init__(self, terms):
        self.terms = [(float(c), [f if isinstance(f, _LAZY_FACTORS) else f.to(torch.float64) for f in fs])
                      for c, fs in terms]

    def full_terms(self):
        """The terms with every factor as a tensor."""
        return [(c, [f.full() if isinstance(f, _LAZY_FACTORS) else f for f in fs]) for c, fs in self.terms]

    def materialize(self, shape) -> torch.Tensor:
        out = None
        for c, fs in self.full_terms():
            t = fs[0] * c
            for f in fs[1:]:
                t = t * f
            out = t if out is None else out + t
        return out.expand(shape)

    def at(self, idx: torch.Tensor, shape) -> torch.Tensor:
        """The scale at flat (row-major) positions ``idx`` of a tensor of ``shape``."""
        # the coordinates on the host: a handful of positions, where NumPy's index arithmetic costs a fraction
        # of torch's (torch.unravel_index is Python over several torch operations)
        host = np.unravel_index(idx.detach().cpu().numpy(), tuple(shape)) if len(shape) else ()
        coords = None  # as tensors, for NormFactor.at
        out = None
        for c, fs in self.terms:
            t = None
            for f in fs:
                if isinstance(f, NormFactor):
                    if coords is None:
                        coords = [torch.from_numpy(np.ascontiguousarray(h)).to(idx.device) for h in host]
                    v = f.at(coords[len(shape) - f.x.dim():])
                elif isinstance(f, (PatchNorm, ChannelNorm)):
                    v = f.at(host)
                else:
                    v = _element_at(f, host, idx.numel())
                t = v * c if t is None else t * v
            out = t if out is None else out + t
        return out


def _element_at(f: torch.Tensor, host, count: int) -> torch.Tensor:
    """A tensor broadcastable to an output, at ``count`` output positions given by their coordinates as NumPy
    arrays (``host``): each position's element by its flat index in ``f``, size-1 dimensions left out."""
    lead, flat = len(host) - f.dim(), np.zeros(count, np.int64)
    for d, n in enumerate(f.shape):
        if n != 1:
            flat = flat * n + host[lead + d]
    return f.reshape(-1)[torch.from_numpy(flat).to(f.device)]


_LAZY_FACTORS = (NormFactor, PatchNorm, ChannelNorm)  # factors LazyScale computes when needed


class RelScale:
    """The scale |result|: computed from the result by the kernel that rounds it (or at the positions
    asked for), so a large output's scale is never stored at full size."""

    __slots__ = ()

    def materialize(self, y: torch.Tensor) -> torch.Tensor:
        return y.abs()


REL_SCALE = RelScale()


def materialize_scale(s, y: torch.Tensor) -> torch.Tensor:
    """Any scale scale_for gives (a tensor or number, LazyScale, RowSubset, RelScale, or a Deferred one) at full
    size for the float64 result ``y``."""
    if isinstance(s, Deferred):
        s = s.compute()
    if isinstance(s, RelScale):
        return s.materialize(y)
    if isinstance(s, (LazyScale, RowSubset)):
        return s.materialize(y.shape).contiguous()
    return torch.as_tensor(s, dtype=torch.float64, device=y.device).expand(y.shape).contiguous()


class RowSubset:
    """A scale that is zero outside some rows (dimension 0): e.g. an embedding gradient, where only
    the rows of tokens in the batch are not exactly zero. The engine analyses just those rows."""

    __slots__ = ("rows", "scale")

    def __init__(self, rows: torch.Tensor, scale: torch.Tensor):
        self.rows, self.scale = rows, scale.to(torch.float64)

    def materialize(self, shape) -> torch.Tensor:
        out = torch.zeros(shape, dtype=torch.float64, device=self.scale.device)
        out[self.rows] = self.scale.expand((len(self.rows),) + tuple(shape[1:]))
        return out

    def at(self, idx: torch.Tensor, shape) -> torch.Tensor:
        width = math.prod(shape[1:])
        row, col = idx // width, idx % width
        where = torch.searchsorted(self.rows, row).clamp(max=max(len(self.rows) - 1, 0))
        hit = self.rows.numel() > 0 and (self.rows[where] == row)
        full = self.scale.expand((len(self.rows),) + tuple(shape[1:])).reshape(len(self.rows), width)
        vals = full[where, col] if len(self.rows) else torch.zeros_like(idx, dtype=torch.float64)
        return torch.where(hit, vals, torch.zeros_like(vals)) if len(self.rows) else vals


# --- helpers ------------------------------------------------------------------------------------


def _abs(x):
    return x.abs() if isinstance(x, torch.Tensor) else abs(float(x))


def _dims(x, dim):
    if dim is None or (isinstance(dim, (list, tuple)) and len(dim) == 0):
        return list(range(x.dim()))
    if isinstance(dim, int):
        dim = [dim]
    return [d % max(x.dim(), 1) for d in dim]


def _count(x, dims):
    return math.prod(x.shape[d] for d in dims) if x.dim() else 1


def _sqrt(n):
    return math.sqrt(max(n, 1))


def _norm(x, dim):
    return torch.linalg.vector_norm(x, dim=dim)


# --- exactness certificate -----------------------------------------------------------------------
# A float64 sum of addends that are all multiples of a quantum q (float32 values are multiples of their
# own ulp) is exact in any order while every partial sum stays below 2**53 q. Such results are the same
# on every machine, so their scale is 0: nothing to log. Small sums (batch sums of gradients, embedding
# gradients) are usually exact, and often land exactly on a float32 tie.

_EXACT_LIMIT = 2.0**52  # one bit of margin below 2**53


def _quantum(absx: torch.Tensor) -> torch.Tensor:
    """float32 ulp of each float64 magnitude (2**-149 below the normal range); inf for 0 and inf. From the
    exponent bits (absx in [2**e, 2**(e+1)) has ulp 2**(e-23)), not torch.frexp: the same values (float64
    subnormals clamp to 2**-149 either way), and torch.compile's vectorised CPU code for frexp does not
    compile (torch 2.13: bench/step_graph_bound.py traces these scales into one graph)."""
    e = ((absx.view(torch.int64) >> 52) & 2047) - 1023
    q = ((torch.clamp(e - 23, min=-149) + 1023) << 52).view(torch.float64)
    return torch.where((absx == 0) | ~torch.isfinite(absx), torch.full_like(absx, math.inf), q)


def _min_quantum(absx: torch.Tensor, dims, keepdim) -> torch.Tensor:
    return _quantum(absx.masked_fill(absx == 0, math.inf).amin(dims, keepdim=keepdim))


def _certify(call: Call, scale: torch.Tensor, abs_total: torch.Tensor, quantum: torch.Tensor) -> torch.Tensor:
    """Zero the scale where the sum is provably exact. Only for addends on the float32 grid: a float64
    value is a multiple of its float64 ulp, not of its float32 one, so its sums are never certified."""
    if not call.on_grid:
        return scale
    return torch.where(abs_total < _EXACT_LIMIT * quantum, torch.zeros_like(scale), scale)


# --- scales shared with the fused kernels --------------------------------------------------------
# f(y, a, kw): y the float64 result, a the op's tensor arguments (float64, schema order), kw its other
# arguments by name. The same Python function runs eagerly here and inside a compiled kernel (fused.py).


def s_rel(y, a, kw):
    return y.abs()


def s_self_plus(y, a, kw):  # self + t, with |t| <= |self| + |result|
    return a[0].abs() + y.abs()


def s_plus_one(y, a, kw):
    return y.abs() + 1.0


def s_grad_times_1(y, a, kw):  # grad * f'(x) with |f'| <= 1 + |x|
    return a[0].abs() * (1.0 + a[1].abs()) + y.abs()


def s_grad_times_2(y, a, kw):
    return a[0].abs() * (2.0 + a[1].abs()) + y.abs()


def s_tanh_bw(y, a, kw):  # grad * (1 - out^2): out^2 carries u * out^2
    return y.abs() + a[0].abs() * a[1] * a[1]


def _tensor_scale(fn):
    """The engine-side rule for a shared scale: call it with the call's tensors and arguments."""

    def scale(call):
        a, kw = [], {}
        for arg in call.func._schema.arguments:
            v = call.arg(arg.name)
            if isinstance(v, torch.Tensor):
                a.append(v)
            else:
                kw[arg.name] = v
        return [fn(call.outputs[0], a, kw)]

    return scale


def _rel(call):  # scale = |result| for every output
    return [None if y is None else REL_SCALE for y in call.outputs]


# --- accumulations ------------------------------------------------------------------------------


def _mm(call):
    a, b = call.arg("self"), call.arg("mat2")
    return [LazyScale([(_sqrt(a.shape[-1]), [NormFactor(a, -1), NormFactor(b, -2)])])]


def _addmm(call):
    bias, a, b = call.arg("self"), call.arg("mat1"), call.arg("mat2")
    beta, alpha = call.arg("beta", 1), call.arg("alpha", 1)
    return [LazyScale([(abs(float(beta)), [bias.abs()]),
                       (abs(float(alpha)) * _sqrt(a.shape[-1]), [NormFactor(a, -1), NormFactor(b, -2)])])]


def _baddbmm(call):
    bias, a, b = call.arg("self"), call.arg("batch1"), call.arg("batch2")
    beta, alpha = call.arg("beta", 1), call.arg("alpha", 1)
    return [LazyScale([(abs(float(beta)), [bias.abs()]),
                       (abs(float(alpha)) * _sqrt(a.shape[-1]), [NormFactor(a, -1), NormFactor(b, -2)])])]


def _mv(call):
    a, v = call.arg("self"), call.arg("vec")
    return [_sqrt(a.shape[-1]) * _norm(a, -1) * _norm(v, -1)]


def _addmv(call):
    bias, a, v = call.arg("self"), call.arg("mat"), call.arg("vec")
    beta, alpha = call.arg("beta", 1), call.arg("alpha", 1)
    return [abs(float(beta)) * bias.abs() + abs(float(alpha)) * _sqrt(a.shape[-1]) * _norm(a, -1) * _norm(v, -1)]


def _dot(call):
    a, b = call.args[0], call.args[1]
    return [_sqrt(a.numel()) * _norm(a, None) * _norm(b, None)]


def _convolution(call):
    x, w, b = call.arg("input"), call.arg("weight"), call.arg("bias")
    stride, padding, dilation = call.arg("stride"), call.arg("padding"), call.arg("dilation")
    transposed, output_padding, groups = call.arg("transposed"), call.arg("output_padding"), call.arg("groups")
    k = tuple(w.shape[2:])
    if transposed:
        # rare: the exact sum of |terms| (one more convolution of the same size)
        n = w.shape[0] // groups * math.prod(k)
        s = aten.convolution(x.abs(), w.abs(), None, stride, padding, dilation, True, output_padding, groups)
        s = _sqrt(n) * s
    else:
        n = w.shape[1] * math.prod(k)
        # ||patch of x|| (over all input channels: an upper bound when groups > 1) times ||w_o||
        wn = _norm(w.flatten(1), 1).view((1, -1) + (1,) * len(k))
        terms = [(_sqrt(n), [PatchNorm(x, k, stride, padding, dilation), wn])]
        if b is not None:
            terms.append((1.0, [b.abs().view((1, -1) + (1,) * len(k))]))
        return [LazyScale(terms)]
    if b is not None:
        s = s + b.abs().view((1, -1) + (1,) * len(k))
    return [s]


def _convolution_backward(call):
    go, x, w = call.arg("grad_output"), call.arg("input"), call.arg("weight")
    stride, padding, dilation = call.arg("stride"), call.arg("padding"), call.arg("dilation")
    transposed, output_padding, groups = call.arg("transposed"), call.arg("output_padding"), call.arg("groups")
    mask = call.arg("output_mask")
    k = tuple(w.shape[2:])
    spatial = tuple(range(2, go.dim()))
    gi, gw, gb = call.outputs[:3]
    out = [None, None, None]
    if transposed:
        exact = aten.convolution_backward(go.abs(), x.abs(), w.abs(), call.arg("bias_sizes"), stride, padding,
                                          dilation, True, output_padding, groups, mask)
        n_in = x.shape[1] // groups * math.prod(k)
        n_w = go.shape[0] * math.prod(x.shape[2:])
        for i, (t, n) in enumerate(zip(exact, (n_in, n_w, n_w))):
            if t is not None and call.outputs[i] is not None:
                out[i] = _sqrt(n) * t
        return out
    bcast = (1, -1) + (1,) * len(k)
    n_pos = go.shape[0] * math.prod(go.shape[2:])

    def input_scale():  # each input channel's weights' norm, over every output channel and the kernel
        if groups == 1:  # computed for the channels asked for (an auditor's entries: one ResNet-18 weight is 2.4M)
            wn = ChannelNorm(w, 1, 1, w.dim())
        else:  # each group's input channels take the norm over all output channels (an upper bound)
            wn = vector_norm(w, [0, *spatial]).reshape(-1).repeat(groups).view(bcast)
        n = w.shape[0] // groups * math.prod(k)
        return LazyScale([(_sqrt(n), [PatchNorm(go, k, stride, padding, dilation, True, x.shape[2:]), wn])])

    def weight_scale():  # ||go_o|| times ||x_c|| (over batch and positions), the largest over groups for x
        nd = 2 + len(k)
        return LazyScale([(_sqrt(n_pos), [ChannelNorm(go, 0, 1, nd), ChannelNorm(x, 1, groups, nd)])])

    def bias_scale():
        ago = go.abs()
        total = ago.sum([0, *spatial])
        return _certify(call, _sqrt(n_pos) * total, total, _min_quantum(ago, [0, *spatial], False))

    return [None if o is None else Deferred(f) for o, f in zip((gi, gw, gb), (input_scale, weight_scale, bias_scale))]


def _reduction_sum(call):
    x = call.arg("self")
    dims = _dims(x, call.arg("dim"))
    keep = call.arg("keepdim", False)
    n = _count(x, dims)
    if x.dim():
        s, smallest = abs_sum_and_min(x, dims, keep)
        q = _quantum(smallest)
    else:
        s = x.abs()
        q = _quantum(s)
    if call.func._overloadpacket in (aten.mean, aten.nanmean):
        scale = _sqrt(n) * s / max(n, 1)  # the division (or a multiplication by 1/n) is one more rounding
        if n & (n - 1) == 0 and call.func._overloadpacket is aten.mean:
            # dividing by a power of two is exact, before or after summing: an exact sum gives an exact
            # mean on every machine (average pooling over 2x2, 4x4, ... windows, means over 2**k rows)
            scale = _certify(call, scale, s, q)
        return [scale.reshape(call.outputs[0].shape)]
    return [_certify(call, _sqrt(n) * s, s, q).reshape(call.outputs[0].shape)]


def _cumsum(call):
    x, dim = call.arg("self"), call.arg("dim")
    return [_sqrt(x.shape[dim] if x.dim() else 1) * x.abs().cumsum(dim)]


def _prod(call):
    x = call.arg("self")
    n = _count(x, _dims(x, call.arg("dim")))
    return [_sqrt(n) * 2 * call.outputs[0].abs()]


def _linear_op_of_abs(n_terms: Callable):
    """For ops linear in their float inputs: scale = sqrt(n) * op(|inputs|) = sqrt(n) * sum|terms|."""

    def scale(call):
        args = [a.abs() if isinstance(a, torch.Tensor) and a.is_floating_point() else a for a in call.args]
        kwargs = {k: (v.abs() if isinstance(v, torch.Tensor) and v.is_floating_point() else v)
                  for k, v in call.kwargs.items()}
        res = call.func(*args, **kwargs)
        res = list(res) if isinstance(res, (tuple, list)) else [res]
        n = n_terms(call)
        return [None if r is None or y is None else _sqrt(n) * r for r, y in zip(res, call.outputs)]

    return scale


def _pool_overlap(call):
    return _windows_per_position(call.arg("kernel_size"), call.arg("stride"), call.arg("dilation"))


def _windows_per_position(kernel, stride, dilation=None) -> int:
    """The most pooling windows that cover one input position (a pooling op's backward sums that many terms
    there). Per dimension, window w covers w * s + j * d for j < k: a position p is in window w for the j with
    j * d = p (mod s), one in every s / gcd(d, s) consecutive j, so at most ceil(k * gcd(d, s) / s) windows
    (ceil(k / s) without dilation: a dilated window, d = 2, k = 2, s = 2, shares a position with the next)."""
    k = list(kernel) if isinstance(kernel, (list, tuple)) else [kernel]
    stride = stride or k
    stride = list(stride) if isinstance(stride, (list, tuple)) else [stride]
    n = max(len(k), len(stride))
    dilation = dilation or [1]
    dilation = list(dilation) if isinstance(dilation, (list, tuple)) else [dilation]
    k, stride, dilation = (v * n if len(v) == 1 else v for v in (k, stride, dilation))
    out = 1
    for ki, si, di in zip(k, stride, dilation):
        si = max(int(si), 1)
        out *= -(-int(ki) * math.gcd(max(int(di), 1), si) // si)
    return out


def _max_pool_backward_rule(a):
    """A max pool's gradient scatters each output's gradient to the input position its window picked: where no
    two windows share a position, each input's gradient is one term or zero, which the float32 kernel gives
    exactly (no sum, so no rounding an error model must bound). Overlapping windows sum several terms. (Indices
    the task's code made up rather than took from the forward could point several outputs at one input; both
    sides run that code, and only such a sum of three or more terms could round differently.)"""
    kernel = a.get("kernel_size")
    if kernel is not None and _windows_per_position(kernel, a.get("stride"), a.get("dilation")) == 1:
        return EXACT_RULE
    return _acc(_linear_op_of_abs(_pool_overlap))


def _pool_window(call):
    k = call.arg("kernel_size")
    return math.prod(k) if isinstance(k, (list, tuple)) else int(k) ** 2


def _adaptive_window(call):
    x = call.args[0]
    out = call.outputs[0]
    return math.prod(-(-x.shape[d] // max(out.shape[d], 1)) + 1 for d in range(2, x.dim()))


def _embedding_dense_backward(call):
    go, idx = call.arg("grad_output"), call.arg("indices")
    # the only rows that are not exactly zero: the batch's tokens. The sums of |grad| are taken by the same op
    # on those rows alone (indices renumbered in the same order), not over the whole vocabulary
    rows, inverse, counts = torch.unique(idx.reshape(-1), sorted=True, return_inverse=True, return_counts=True)
    hit = (rows == call.arg("padding_idx")).nonzero()  # the padding row's new number, if it is in the batch
    pad = int(hit[0, 0]) if hit.numel() else -1
    by_freq = call.arg("scale_grad_by_freq")
    ago = go.abs()
    absum = aten.embedding_dense_backward(ago, inverse.view(idx.shape), len(rows), pad, by_freq)
    scale = counts.to(go.dtype).sqrt().unsqueeze(1) * absum
    if by_freq:
        return [RowSubset(rows, scale)]
    # quantum per embedding row: the smallest quantum of any gradient row that lands in it
    grad_rows = ago.reshape(-1, ago.shape[-1])
    row_q = _min_quantum(grad_rows, [1], False)
    q = torch.full((len(rows),), math.inf, dtype=go.dtype, device=go.device).scatter_reduce(0, inverse, row_q, "amin")
    return [RowSubset(rows, _certify(call, scale, absum, q.unsqueeze(1)))]


def _index_put(call):
    self_, values = call.arg("self"), call.arg("values")
    acc = aten.index_put(torch.zeros_like(self_), call.arg("indices"), values.abs(), True)
    return [self_.abs() + _sqrt(values.numel()) * acc]


def _scatter_add(call):
    self_, src = call.arg("self"), call.arg("src")
    acc = aten.scatter_add(torch.zeros_like(self_), call.arg("dim"), call.arg("index"), src.abs())
    return [self_.abs() + _sqrt(src.numel()) * acc]


def _index_add(call):
    self_, src = call.arg("self"), call.arg("source")
    alpha = abs(float(call.arg("alpha", 1)))
    acc = aten.index_add(torch.zeros_like(self_), call.arg("dim"), call.arg("index"), src.abs())
    return [self_.abs() + alpha * _sqrt(src.numel()) * acc]


def _logsumexp(call):
    x = call.arg("self")
    dims = _dims(x, call.arg("dim"))
    n = _count(x, dims)
    m = x.abs().amax(dims, keepdim=call.arg("keepdim", False))
    return [call.outputs[0].abs() + m + math.log(max(n, 1)) + _sqrt(n)]


# --- variance and norms --------------------------------------------------------------------------


def _correction(call):
    c = call.arg("correction")
    if c is None:
        unbiased = call.arg("unbiased", True)
        c = 1 if unbiased is None or unbiased else 0
    return float(c)


def _var_like(call):
    x = call.arg("self")
    dims = _dims(x, call.arg("dim"))
    keep = call.arg("keepdim", False)
    n = _count(x, dims)
    denom = max(n - _correction(call), 1.0)
    sq = (x * x).sum(dims, keepdim=keep)
    s_var = _sqrt(n) * sq / denom
    packet = call.func._overloadpacket
    out = []
    y0 = call.outputs[0]
    if packet in (aten.std, aten.std_mean):
        out.append(s_var / (2 * y0.abs()) + y0.abs())
    else:
        out.append(s_var + y0.abs())
    if packet in (aten.var_mean, aten.std_mean):
        out.append(_sqrt(n) * x.abs().sum(dims, keepdim=keep) / max(n, 1))
    return out


def _vector_norm(call):
    x = call.args[0]
    ord_ = call.arg("ord", 2)
    dims = _dims(x, call.arg("dim"))
    n = _count(x, dims)
    p = float(ord_) if ord_ is not None else 2.0
    return [(_sqrt(n) + 4 * max(1.0, abs(p) if math.isfinite(p) else 1.0)) * call.outputs[0].abs()]


# --- softmax and losses --------------------------------------------------------------------------


def _nll_loss_forward(call):
    x, target = call.arg("self"), call.arg("target")
    weight, reduction, ignore = call.arg("weight"), call.arg("reduction"), call.arg("ignore_index")
    absw = weight.abs() if weight is not None else None
    if weight is None and x.dim() == 2 and ignore != 0 and call.func._overloadpacket is aten.nll_loss_forward:
        # the loss reads one element per row, x[i, target[i]]: the same call on those alone (class 0 of a
        # one-column input, ignored rows kept ignored: ignore_index is not 0 here) instead of on |x| at full
        # size (a language model's vocabulary-wide logits)
        keep = target != ignore
        picked = x.gather(1, torch.where(keep, target, 0).unsqueeze(1))
        x, target = picked, torch.where(keep, 0, target)
    loss, total = call.func(-x.abs(), target, absw, reduction, ignore)
    n = target.numel() if reduction != 0 else 1
    return [_sqrt(n) * loss.abs() + call.outputs[0].abs(), _sqrt(target.numel()) * total.abs()]


def _mse_loss(call):
    n = call.arg("self").numel() if call.arg("reduction", 1) != 0 else 1
    return [(_sqrt(n) + 2) * call.outputs[0].abs()]


# --- normalization ------------------------------------------------------------------------------


def _group_norm(call):
    x, w, b = call.arg("input"), call.arg("weight"), call.arg("bias")
    N, C, HxW, G = call.arg("N"), call.arg("C"), call.arg("HxW"), call.arg("group")
    out, mean, rstd = call.outputs[:3]
    xg = x.reshape(N, G, -1)
    n = xg.shape[-1]
    sq = (xg * xg).mean(-1, keepdim=True)
    mabs = xg.abs().mean(-1, keepdim=True)
    r = rstd.reshape(N, G, 1)
    kappa = 4 + _sqrt(n) * sq * r * r
    shape_c = (1, C) + (1,) * (x.dim() - 2)
    wv = 1.0 if w is None else w.abs().view(shape_c)
    bv = 0.0 if b is None else b.abs().view(shape_c)
    centred = (out - (0.0 if b is None else b.view(shape_c))).abs()
    per_group = lambda t: t.expand(N, G, C // G * HxW).reshape(x.shape)  # noqa: E731
    s_out = centred * per_group(kappa) + wv * _sqrt(n) * per_group(mabs * r) + bv + out.abs()
    return [s_out, (_sqrt(n) * mabs).reshape(mean.shape), (r * kappa).reshape(rstd.shape)]


def _group_norm_backward(call):
    go, x, mean, rstd, w = (call.arg("grad_out"), call.arg("input"), call.arg("mean"), call.arg("rstd"),
                            call.arg("weight"))
    N, C, G = call.arg("N"), call.arg("C"), call.arg("group")
    shape_c = (1, C) + (1,) * (x.dim() - 2)
    g = go if w is None else go * w.view(shape_c)
    xg, gg = x.reshape(N, G, -1), g.reshape(N, G, -1)
    r, m = rstd.reshape(N, G, 1), mean.reshape(N, G, 1)
    xhat = (xg - m) * r
    n = xg.shape[-1]
    gi, gw, gb = call.outputs[:3]
    out = [None, None, None]
    if gi is not None:
        mg = gg.abs().mean(-1, keepdim=True)
        mgx = (gg * xhat).abs().mean(-1, keepdim=True)
        out[0] = (r * (4 * gg.abs() + _sqrt(n) * (mg + xhat.abs() * mgx) + 4 * xg.abs() * r * mgx)).reshape(x.shape) + gi.abs()
    dims = [0] + list(range(2, x.dim()))
    n_w = _count(x, dims)
    xh = xhat.reshape(x.shape)
    if gw is not None:
        out[1] = _sqrt(n_w) * (go.abs() * (xh.abs() + 2 * (xg.abs() * r).reshape(x.shape))).sum(dims)
    if gb is not None:
        out[2] = _sqrt(n_w) * go.abs().sum(dims)
    return out


# --- elementwise --------------------------------------------------------------------------------


def _rsub(call):
    other = call.arg("other")
    return [_abs(other) + call.outputs[0].abs()]


def _arange(call):
    start = call.arg("start", 0)
    step = call.arg("step", 1)
    return [call.outputs[0].abs() + abs(float(start)) + abs(float(step))]


def _linspace(call):
    return [call.outputs[0].abs() + abs(float(call.arg("start"))) + abs(float(call.arg("end")))]


def _foreach(base: Callable):
    """Apply a per-tensor scale to each tensor of a foreach op."""

    def scale(call):
        selfs = call.args[0]
        out = []
        for i, y in enumerate(call.outputs):
            if y is None:
                out.append(None)
                continue
            out.append(base(selfs[i] if i < len(selfs) else None, y))
        return out

    return scale


def _foreach_norm_scale(self_i, y):
    n = self_i.numel() if self_i is not None else 1
    return (_sqrt(n) + 4) * y.abs()


# --- dynamic choices -----------------------------------------------------------------------------


def _is_one(v) -> bool:
    try:
        return float(v) == 1.0
    except (TypeError, ValueError):
        return False


def _is_scalar_operand(v) -> bool:
    return not isinstance(v, torch.Tensor) or (v.dim() == 0 and v.device.type == "cpu")


class Choose:
    """A row whose rule depends on the call's arguments (given by schema name)."""

    def __init__(self, pick: Callable):
        self.pick = pick


def _alpha_rule(exact: Rule, approx: Rule):
    return Choose(lambda a: exact if _is_one(a.get("alpha", 1)) else approx)


def _div_rule(a):
    if a.get("rounding_mode") not in (None,):
        return EXACT_RULE
    # CUDA divides by a CPU scalar by multiplying with its reciprocal: two roundings, not one
    return APPROX_REL if _is_scalar_operand(a.get("other")) else EXACT_RULE


def _copy_rule(a):
    src, dst = a.get("src"), a.get("self")
    if isinstance(src, torch.Tensor) and isinstance(dst, torch.Tensor) and src.dtype == dst.dtype:
        return PASS_RULE
    return EXACT_RULE


def _to_copy_rule(a):
    src, dtype = a.get("self"), a.get("dtype")
    if dtype is None or (isinstance(src, torch.Tensor) and src.dtype == dtype):
        return PASS_RULE
    return EXACT_RULE


def _index_put_rule(a):
    return Rule(APPROX, "accumulate", _index_put) if a.get("accumulate") else PASS_RULE


def _scalar_other_rule(a):
    return EXACT_RULE if not isinstance(a.get("value", a.get("other")), torch.Tensor) else PASS_RULE


PASS_RULE = Rule(PASSTHROUGH)
EXACT_RULE = Rule(EXACT)
APPROX_REL = Rule(APPROX, "elementwise", _rel, fused=s_rel)
SELF_PLUS = Rule(APPROX, "elementwise", _tensor_scale(s_self_plus), fused=s_self_plus)


def _acc(fn):
    return Rule(APPROX, "accumulate", fn)


def _ew(fn, fused=None):
    return Rule(APPROX, "elementwise", fn, fused=fused)


def _shared(op_class, fn):
    return Rule(APPROX, op_class, _tensor_scale(fn), fused=fn)


def _unsupported(why):
    return Rule(UNSUPPORTED, why=why)


_PASSTHROUGH_NAMES = """
view _unsafe_view _reshape_alias reshape t transpose permute expand expand_as squeeze unsqueeze select
slice narrow as_strided unfold diagonal alias detach unbind split split_with_sizes chunk view_as
movedim clone contiguous lift_fresh lift_fresh_copy empty empty_like empty_strided new_empty
new_empty_strided zeros zeros_like ones ones_like new_zeros new_ones zero cat stack hstack vstack
index_select gather index _unsafe_index take masked_select repeat flip roll tril triu embedding
slice_backward select_backward diagonal_backward unsqueeze_copy squeeze_copy view_copy
relu threshold_backward abs neg sign sgn positive floor ceil round trunc
eq ne lt le gt ge logical_and logical_or logical_not logical_xor isnan isinf isfinite isneginf isposinf
bitwise_and bitwise_or bitwise_xor bitwise_not __and__ __or__ __xor__
max_pool1d_with_indices max_pool2d_with_indices max_pool3d_with_indices max_pool2d max_pool3d
max amax min amin maximum minimum fmax fmin argmax argmin sort topk kthvalue argsort msort
any all count_nonzero nonzero nonzero_static unique _unique2 unique_consecutive unique_dim
one_hot bincount histc bucketize searchsorted
_local_scalar_dense item is_nonzero equal is_same_size resize_ resize_as_ set_ _has_compatible_shallow_copy_type
scalar_tensor_ detach_ _to_dense sym_size sym_stride sym_numel sym_storage_offset
hardtanh_backward _foreach_zero _foreach_zero_ _foreach_copy _foreach_copy_
fill_diagonal_ expand_copy permute_copy transpose_copy t_copy slice_copy select_copy split_copy unbind_copy
index_fill masked_scatter pixel_shuffle pixel_unshuffle channel_shuffle
""".split()

_EXACT_NAMES = """
mul reciprocal fill full full_like new_full scalar_tensor constant_pad_nd threshold hardtanh
leaky_relu leaky_relu_backward clamp clamp_min clamp_max fmod
_foreach_mul _foreach_neg _foreach_abs _foreach_maximum _foreach_minimum
_foreach_clamp_min _foreach_clamp_max _foreach_reciprocal _foreach_sign
""".split()

_ELEMENTWISE_REL = """
sqrt exp exp2 expm1 log log2 log10 log1p sigmoid tanh erf erfc rsqrt sinh cosh asinh acosh atanh atan asin
acos pow float_power softplus elu celu selu silu logit erfinv lgamma digamma remainder floor_divide
xlogy special_xlog1py reciprocal_ softplus_backward sigmoid_backward logit_backward
_foreach_sqrt _foreach_exp _foreach_log _foreach_pow _foreach_sigmoid _foreach_tanh _foreach_erf _foreach_log1p _foreach_expm1
""".split()

RULES: dict[str, object] = {}

for _n in _PASSTHROUGH_NAMES:
    RULES[_n] = PASS_RULE
for _n in _EXACT_NAMES:
    RULES[_n] = EXACT_RULE
for _n in _ELEMENTWISE_REL:
    RULES[_n] = APPROX_REL

RULES.update({
    # selection with a scalar is exact but the scalar must land on the grid
    "where": Choose(lambda a: EXACT_RULE if not all(isinstance(a.get(k), torch.Tensor) for k in ("self", "other"))
                    else PASS_RULE),
    "masked_fill": Choose(_scalar_other_rule),
    "fill_": Choose(_scalar_other_rule),
    "scatter": Choose(lambda a: EXACT_RULE if "value" in a and not isinstance(a.get("value"), torch.Tensor) else PASS_RULE),
    "index_put": Choose(_index_put_rule),
    "copy": Choose(_copy_rule),
    "_to_copy": Choose(_to_copy_rule),
    "add": _alpha_rule(EXACT_RULE, SELF_PLUS),
    "sub": _alpha_rule(EXACT_RULE, SELF_PLUS),
    "rsub": Choose(lambda a: EXACT_RULE if _is_one(a.get("alpha", 1)) else _ew(_rsub)),
    "div": Choose(_div_rule),
    "true_divide": Choose(_div_rule),
    "_foreach_add": _alpha_rule(EXACT_RULE, _ew(_foreach(lambda s, y: s.abs() + y.abs()))),
    "_foreach_sub": _alpha_rule(EXACT_RULE, _ew(_foreach(lambda s, y: s.abs() + y.abs()))),
    "_foreach_div": Choose(lambda a: _ew(_foreach(lambda s, y: y.abs()))
                           if not isinstance(a.get("other", a.get("scalar", a.get("scalars"))), (list, tuple))
                           or not all(isinstance(t, torch.Tensor) for t in a.get("other", []) or [None])
                           else EXACT_RULE),
    "_foreach_addcmul": _ew(_foreach(lambda s, y: s.abs() + y.abs())),
    "_foreach_addcdiv": _ew(_foreach(lambda s, y: s.abs() + y.abs())),
    "_foreach_lerp": _ew(_foreach(lambda s, y: s.abs() + y.abs())),
    "_foreach_norm": Rule(APPROX, "accumulate", _foreach(_foreach_norm_scale)),
    # short elementwise formulas
    "addcmul": SELF_PLUS, "addcdiv": SELF_PLUS, "lerp": SELF_PLUS, "addr": SELF_PLUS,
    "gelu": _shared("elementwise", s_self_plus), "mish": _shared("elementwise", s_self_plus),
    "hardswish": _shared("elementwise", s_self_plus), "hardsigmoid": _shared("elementwise", s_self_plus),
    "sin": _shared("elementwise", s_plus_one), "cos": _shared("elementwise", s_plus_one),
    "tan": _shared("elementwise", s_plus_one),
    "gelu_backward": _shared("elementwise", s_grad_times_2),
    "silu_backward": _shared("elementwise", s_grad_times_1),
    "mish_backward": _shared("elementwise", s_grad_times_2),
    "hardswish_backward": _shared("elementwise", s_grad_times_1),
    "hardsigmoid_backward": _shared("elementwise", s_grad_times_1),
    "elu_backward": _shared("elementwise", s_grad_times_2),
    "tanh_backward": _shared("elementwise", s_tanh_bw),
    "arange": _ew(_arange),
    "linspace": _ew(_linspace),
    # accumulations
    "mm": _acc(_mm), "bmm": _acc(_mm), "addmm": _acc(_addmm), "_addmm_activation": _acc(_addmm),
    "baddbmm": _acc(_baddbmm), "mv": _acc(_mv), "addmv": _acc(_addmv), "dot": _acc(_dot), "vdot": _acc(_dot),
    "convolution": _acc(_convolution), "convolution_backward": _acc(_convolution_backward),
    "sum": _acc(_reduction_sum), "mean": _acc(_reduction_sum), "nansum": _acc(_reduction_sum),
    "nanmean": _acc(_reduction_sum),
    "cumsum": _acc(_cumsum), "prod": _acc(_prod), "cumprod": _acc(_prod), "logsumexp": _acc(_logsumexp),
    "embedding_dense_backward": _acc(_embedding_dense_backward),
    "scatter_add": _acc(_scatter_add), "index_add": _acc(_index_add),
    "avg_pool1d": _acc(_linear_op_of_abs(_pool_window)),
    "avg_pool2d": _acc(_linear_op_of_abs(_pool_window)), "avg_pool3d": _acc(_linear_op_of_abs(_pool_window)),
    "avg_pool2d_backward": _acc(_linear_op_of_abs(_pool_overlap)),
    "avg_pool3d_backward": _acc(_linear_op_of_abs(_pool_overlap)),
    "max_pool2d_with_indices_backward": Choose(_max_pool_backward_rule),
    "max_pool3d_with_indices_backward": Choose(_max_pool_backward_rule),
    "_adaptive_avg_pool2d": _acc(_linear_op_of_abs(_adaptive_window)),
    "_adaptive_avg_pool3d": _acc(_linear_op_of_abs(_adaptive_window)),
    "_adaptive_avg_pool2d_backward": _acc(_linear_op_of_abs(lambda c: 4)),
    "_adaptive_avg_pool3d_backward": _acc(_linear_op_of_abs(lambda c: 8)),
    "upsample_nearest2d": PASS_RULE, "upsample_nearest1d": PASS_RULE,
    "upsample_nearest2d_backward": _acc(_linear_op_of_abs(lambda c: 16)),
    "upsample_bilinear2d": _acc(_linear_op_of_abs(lambda c: 4)),
    "upsample_bilinear2d_backward": _acc(_linear_op_of_abs(lambda c: 16)),
    # normalization, variance, norms
    "var": Rule(APPROX, "normalization", _var_like), "std": Rule(APPROX, "normalization", _var_like),
    "var_mean": Rule(APPROX, "normalization", _var_like), "std_mean": Rule(APPROX, "normalization", _var_like),
    "linalg_vector_norm": Rule(APPROX, "accumulate", _vector_norm), "norm": Rule(APPROX, "accumulate", _vector_norm),
    **{n: Rule(DECOMPOSE) for n in """native_layer_norm native_layer_norm_backward native_batch_norm
       _native_batch_norm_legit _native_batch_norm_legit_no_training native_batch_norm_backward""".split()},
    "native_group_norm": Rule(APPROX, "normalization", _group_norm),
    "native_group_norm_backward": Rule(APPROX, "normalization", _group_norm_backward),
    # softmax and losses
    **{n: Rule(DECOMPOSE) for n in "_softmax _log_softmax _softmax_backward_data _log_softmax_backward_data".split()},
    "nll_loss_forward": Rule(APPROX, "softmax", _nll_loss_forward),
    "nll_loss2d_forward": Rule(APPROX, "softmax", _nll_loss_forward),
    "nll_loss_backward": Rule(APPROX, "softmax", _rel), "nll_loss2d_backward": Rule(APPROX, "softmax", _rel),
    "mse_loss": Rule(APPROX, "softmax", _mse_loss), "mse_loss_backward": Rule(APPROX, "softmax", _rel),
    # random ops are drawn by the engine from the counter-based generator
    **{n: Rule(RANDOM) for n in """bernoulli rand rand_like randn randn_like randint randint_like randperm
       normal uniform multinomial native_dropout exponential random cauchy log_normal geometric""".split()},
    # refused: these pick their algorithm by device, or keep their state on a device generator
    **{n: _unsupported("fused optimizer kernels differ by device; veritrain runs optimizers with "
                       "foreach=False, fused=False (construct the optimizer without fused=True)")
       for n in "_fused_adam _fused_adamw _fused_sgd _fused_adagrad".split()},
    **{n: _unsupported("the fused attention backend depends on the device; veritrain forces the math backend, "
                       "so this op should not appear (call F.scaled_dot_product_attention, not the backend op)")
       for n in """_scaled_dot_product_flash_attention _scaled_dot_product_efficient_attention
       _scaled_dot_product_cudnn_attention _scaled_dot_product_flash_attention_for_cpu _flash_attention_forward
       _efficient_attention_forward""".split()},
    **{n: _unsupported("sampling from this distribution is not implemented by veritrain's counter-based generator")
       for n in "poisson binomial _standard_gamma _sample_dirichlet rrelu_with_noise _fused_dropout".split()},
    **{n: _unsupported("cudnn/miopen kernels are device-specific; veritrain disables cudnn inside a step")
       for n in "cudnn_batch_norm miopen_batch_norm cudnn_convolution miopen_convolution".split()},
})

FALLBACK_RULE = Rule(APPROX, "fallback", None, why="no rule for this op")


def _fallback_scale(call):
    """|result| plus, for each float input, its magnitude where shapes match, else its maximum."""
    scales = []
    inputs = [a for a in _leaves(call.args) + _leaves(list(call.kwargs.values()))
              if isinstance(a, torch.Tensor) and a.is_floating_point()]
    for y in call.outputs:
        if y is None:
            scales.append(None)
            continue
        s = y.abs()
        for t in inputs:
            try:
                s = s + torch.broadcast_to(t.abs(), y.shape)
            except RuntimeError:
                s = s + (t.abs().max() if t.numel() else 0.0)
        scales.append(s)
    return scales


def _leaves(xs):
    out = []
    for x in xs:
        if isinstance(x, (list, tuple)):
            out.extend(_leaves(list(x)))
        else:
            out.append(x)
    return out


def base_name(func) -> str:
    """``aten.add_.Tensor`` -> ``add``; in-place and out= variants share the functional op's row."""
    name = _BASE_NAMES.get(func)
    if name is None:  # once per operator: the engine asks several times for every op it runs
        name = func._overloadpacket.__name__
        if name.endswith("_") and not name.startswith("__") and name not in RULES:
            name = name[:-1]
        _BASE_NAMES[func] = name
    return name


_BASE_NAMES: dict = {}


def lookup(func, named_args: dict | None = None) -> Rule:
    row = RULES.get(base_name(func))
    if row is None:
        if func.namespace != "aten":
            return PASS_RULE if not _returns_tensors(func) else FALLBACK_RULE
        return PASS_RULE if _is_view_or_nontensor(func) else FALLBACK_RULE
    if isinstance(row, Choose):
        return row.pick(named_args or {})
    return row


def scale_for(rule: Rule, call: Call) -> Sequence:
    """Per output: a tensor broadcastable to it, a LazyScale, a RowSubset, a RelScale, a Deferred (one of those,
    computed on first use: _Analysis.scale), or None (materialize_scale gives any of them at full size)."""
    fn = rule.scale or _fallback_scale
    return fn(call)


def _returns_tensors(func) -> bool:
    return any(isinstance(r.type, torch.TensorType) or "Tensor" in str(r.type) for r in func._schema.returns)


def _is_view_or_nontensor(func) -> bool:
    schema = func._schema
    if not _returns_tensors(func):
        return True
    # a view: returns alias an input without writing it
    return all(r.alias_info is not None and not r.alias_info.is_write for r in schema.returns)
