"""A convolution's float64 forward pass computed by ATen's input-gradient kernel, where that is faster.

Why: on the CPU, ATen's float64 forward convolution slows down several times once one sample's unfolded
patches (input channels x kernel window x output positions) outgrow the core's cache, while its input-gradient
kernel, which sums the same products, does not. ResNet-18's 3x3 convolutions over 64 channels at 32 x 32 took
42-50 ms forward and 14-15 ms by the input gradient at batch 16 (`python bench/bench_conv_route.py`, bench/
RESULTS.md "Forward convolutions by the input-gradient kernel"), a tenth of a plain float64 step each.

Why it is the same function: conv(x, w)[n, o, q] = sum over c, r of w[o, c, r] x[n, c, q + r - p] (stride 1,
dilation 1, padding p). The input gradient of a convolution with weight v, padding p', taken at output gradient
g, is sum over c, r of v[c, o, r] g[n, c, q + p' - r]. With v = w with its kernel window reversed and its two
channel dimensions swapped (v[c, o, r] = w[o, c, k - 1 - r]), p' = k - 1 - p and g = x, that is the sum above
term by term (r -> k - 1 - r). The same products, added in another order: another correct float64 evaluation
of the op, as the compiled kernels and the blocked products are (the error model's tau bounds any order of the
additions; docs/ROUNDING.md). The error scale (rules._convolution: the patch norms of x times the weight rows'
norms) is unchanged, and the engine treats the result like any float64 result.

The choice depends on the shapes only, never on a timing, so a run takes the same path every time on every
machine; a trainer and an auditor that choose differently disagree only as two machines do (the log covers
it: tests/test_convolution.py trains one way and audits the other).
"""

from __future__ import annotations

import math

import torch

from .hardware import setting
from .rules import _per_dim

aten = torch.ops.aten

# one sample's unfolded patches (float64 values) from which the input-gradient kernel is used: 2 MB, this
# machine's L2 per core (python bench/bench_conv_route.py: at and above it 0.29-0.64x of the forward kernel's
# time; below it from 0.4x to 1.8x, no rule) (VERITRAIN_CONV_MIN_NUMEL; set beyond any size to turn it off)
MIN_PATCH_NUMEL = 1 << 18


def routed(input, weight, bias, stride, padding, dilation, transposed, output_padding, groups) -> bool:
    """Whether ``aten.convolution`` with these float64 arguments is computed by ``forward``: a 2-d convolution
    on the CPU, not transposed, stride 1, dilation 1, one group, each padding at most the kernel's size less
    one, whose unfolded patches per sample number at least ``VERITRAIN_CONV_MIN_NUMEL``. (The parameters are
    aten.convolution's, by its schema's names.)"""
    x, w = input, weight
    if transposed or groups != 1 or x.dim() != 4 or w.dim() != 4 or x.device.type != "cpu" \
            or x.dtype != torch.float64 or w.dtype != torch.float64 or x.shape[1] != w.shape[1]:
        return False
    if bias is not None and (bias.dtype != torch.float64 or bias.shape != (w.shape[0],)):
        return False
    k = w.shape[2:]
    if any(s != 1 for s in _per_dim(stride, 2)) or any(d != 1 for d in _per_dim(dilation, 2)):
        return False
    pad = _per_dim(padding, 2)
    if any(not 0 <= p <= kk - 1 for p, kk in zip(pad, k)):
        return False
    out = [size + 2 * p - kk + 1 for size, p, kk in zip(x.shape[2:], pad, k)]
    if min(out) <= 0 or not x.shape[0] or not w.shape[0] or not x.shape[1]:
        return False
    return x.shape[1] * math.prod(k) * math.prod(out) >= int(setting("VERITRAIN_CONV_MIN_NUMEL", MIN_PATCH_NUMEL))


def forward(input, weight, bias, stride, padding, dilation, transposed, output_padding, groups):
    """``aten.convolution`` for arguments where ``routed`` holds, by the input-gradient kernel (see above)."""
    x, w = input, weight
    k = w.shape[2:]
    pad = _per_dim(padding, 2)
    out = (x.shape[0], w.shape[0]) + tuple(size + 2 * p - kk + 1 for size, p, kk in zip(x.shape[2:], pad, k))
    v = w.flip(2, 3).transpose(0, 1).contiguous()
    probe = x.new_zeros(()).expand(out)  # the input's shape; its values are not read
    y = aten.convolution_backward(x, probe, v, None, [1, 1], [kk - 1 - p for p, kk in zip(pad, k)], [1, 1], False,
                                  [0, 0], 1, [True, False, False])[0]
    if bias is not None:
        y.add_(bias.view(1, -1, 1, 1))
    return y

