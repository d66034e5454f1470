"""Composite operators computed as their steps, each step rounded onto the grid.

A fused kernel such as BatchNorm's backward subtracts per-channel sums over N*H*W values from each
element. Its result can cancel heavily, and the sums themselves differ between implementations by about
sqrt(N*H*W) float64 ulps, so many of its outputs would need a log entry. Computed step by step, the sums
become small rounded vectors (a few entries at most), and every full-size step is a single IEEE
operation on grid values (subtract, multiply, add): exact, never logged, and at b = 32 as fast as
float32. Only reductions and library functions (exp, log, rsqrt) are left to log.

Each function takes the aten op's arguments and returns what the op returns (same shapes and dtypes);
the engine runs it with itself active, so every op inside is rounded and logged. Autograd still sees
the original op. The steps are this file's, not a backend's, so the op stream is the same on every
device.
"""

from __future__ import annotations

import torch

aten = torch.ops.aten


def _bshape(x, c_dim=1):
    return [1] * c_dim + [-1] + [1] * (x.dim() - c_dim - 1)


def _channel_dims(x):
    return [0] + list(range(2, x.dim()))


def batch_norm(input, weight, bias, running_mean, running_var, training, momentum, eps):
    """aten.native_batch_norm: (out, save_mean, save_invstd); updates running stats when training."""
    dims = _channel_dims(input)
    view = _bshape(input)
    n = input.numel() // input.shape[1]
    if training:
        mean = input.mean(dims)
        xmu = input - mean.view(view)
        var = (xmu * xmu).mean(dims)
        invstd = torch.rsqrt(var + eps)
        if running_mean is not None:
            running_mean.copy_(running_mean * (1 - momentum) + mean * momentum)
            unbiased = var * (n / max(n - 1, 1))
            running_var.copy_(running_var * (1 - momentum) + unbiased * momentum)
        save_mean, save_invstd = mean, invstd
    else:
        xmu = input - running_mean.view(view)
        invstd = torch.rsqrt(running_var + eps)
        save_mean = input.new_empty((0,))
        save_invstd = input.new_empty((0,))
    out = xmu * invstd.view(view)
    if weight is not None:
        out = out * weight.view(view)
    if bias is not None:
        out = out + bias.view(view)
    return out, save_mean, save_invstd


def batch_norm_legit(input, weight, bias, running_mean, running_var, training, momentum, eps):
    return batch_norm(input, weight, bias, running_mean, running_var, training, momentum, eps)


def batch_norm_legit_no_stats(input, weight, bias, training, momentum, eps):
    return batch_norm(input, weight, bias, None, None, True, momentum, eps)


def batch_norm_legit_no_training(input, weight, bias, running_mean, running_var, momentum, eps):
    return batch_norm(input, weight, bias, running_mean, running_var, False, momentum, eps)


def batch_norm_backward(grad_out, input, weight, running_mean, running_var, save_mean, save_invstd, train, eps,
                        output_mask):
    dims = _channel_dims(input)
    view = _bshape(input)
    n = input.numel() // input.shape[1]
    if train:
        mean, invstd = save_mean, save_invstd
    else:
        mean, invstd = running_mean, torch.rsqrt(running_var + eps)
    xmu = input - mean.view(view)
    sum_dy = grad_out.sum(dims)
    dot_p = (grad_out * xmu).sum(dims)
    grad_input = grad_weight = grad_bias = None
    if output_mask[0]:
        scale = invstd if weight is None else invstd * weight
        if train:
            proj = xmu * (dot_p * (invstd * invstd) / n).view(view)
            grad_input = (grad_out - proj - (sum_dy / n).view(view)) * scale.view(view)
        else:
            grad_input = grad_out * scale.view(view)
    if output_mask[1]:
        grad_weight = dot_p * invstd
    if output_mask[2]:
        grad_bias = sum_dy
    return grad_input, grad_weight, grad_bias


def layer_norm(input, normalized_shape, weight, bias, eps):
    """aten.native_layer_norm: (out, mean, rstd), statistics kept with size-1 normalized dims."""
    dims = list(range(input.dim() - len(normalized_shape), input.dim()))
    mean = input.mean(dims, keepdim=True)
    xmu = input - mean
    rstd = torch.rsqrt((xmu * xmu).mean(dims, keepdim=True) + eps)
    out = xmu * rstd
    if weight is not None:
        out = out * weight
    if bias is not None:
        out = out + bias
    return out, mean, rstd


def layer_norm_backward(grad_out, input, normalized_shape, mean, rstd, weight, bias, output_mask):
    dims = list(range(input.dim() - len(normalized_shape), input.dim()))
    lead = list(range(input.dim() - len(normalized_shape)))
    n = 1
    for d in dims:
        n *= input.shape[d]
    xhat = (input - mean) * rstd
    grad_input = grad_weight = grad_bias = None
    if output_mask[0]:
        g = grad_out if weight is None else grad_out * weight
        mean_g = g.sum(dims, keepdim=True) / n
        mean_gx = (g * xhat).sum(dims, keepdim=True) / n
        grad_input = (g - mean_g - xhat * mean_gx) * rstd
    if output_mask[1] and weight is not None:
        grad_weight = (grad_out * xhat).sum(lead) if lead else grad_out * xhat
    if output_mask[2] and bias is not None:
        grad_bias = grad_out.sum(lead) if lead else grad_out.clone()
    return grad_input, grad_weight, grad_bias


def softmax(x, dim, half_to_float):
    shifted = x - x.amax(dim, keepdim=True)
    e = shifted.exp()
    return e / e.sum(dim, keepdim=True)


def log_softmax(x, dim, half_to_float):
    shifted = x - x.amax(dim, keepdim=True)
    return shifted - shifted.exp().sum(dim, keepdim=True).log()


def softmax_backward(grad_output, output, dim, input_dtype):
    t = grad_output * output
    return t - output * t.sum(dim, keepdim=True)


def log_softmax_backward(grad_output, output, dim, input_dtype):
    return grad_output - output.exp() * grad_output.sum(dim, keepdim=True)


TABLE = {
    "native_batch_norm": batch_norm,
    "_native_batch_norm_legit": None,  # chosen by overload below
    "_native_batch_norm_legit_no_training": batch_norm_legit_no_training,
    "native_batch_norm_backward": batch_norm_backward,
    "native_layer_norm": layer_norm,
    "native_layer_norm_backward": layer_norm_backward,
    "_softmax": softmax,
    "_log_softmax": log_softmax,
    "_softmax_backward_data": softmax_backward,
    "_log_softmax_backward_data": log_softmax_backward,
}


def lookup(func):
    name = func._overloadpacket.__name__
    if name == "_native_batch_norm_legit":
        return batch_norm_legit_no_stats if func._overloadname == "no_stats" else batch_norm_legit
    return TABLE.get(name)
