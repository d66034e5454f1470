"""The engine: a TorchDispatchMode that makes a training step reproducible bit for bit.

Inside a step every floating-point value lies on the model's grid (rounding.Grid). Each aten op is
handled by its row in rules.py:

* passthrough ops run natively;
* exact ops are one correctly rounded IEEE operation: computed in float64 and rounded (at b = 32 the
  float32 kernel gives the same bits, because rounding float64 results of +, -, * and / to float32 is
  innocuous, so it runs natively);
* approx ops are computed in float64 and rounded; the trainer logs the results that sit within the
  op's threshold of a rounding midpoint, or whose cell is undetermined; the auditor forces those
  decisions and checks that each entry is plausible;
* random ops draw from the counter-based generator keyed by (seed, step, op index).

``VerifiedMode`` computes and rounds, the same in both roles; what differs is in two small classes:
``TrainerHalf`` (which results need a log entry, and the log it writes) and ``AuditorHalf`` (the log it
reads, each entry checked against the error model, then forced or named as suspicious).

In-place and ``out=`` variants run as their functional op on float64 copies and are copied back;
ops that mutate arguments (BatchNorm running statistics) are given float64 copies that are rounded and
written back. Python float scalars are rounded to float32 as float32 kernels do (near-midpoint scalars
are logged too). User code never sees a dtype change.
"""

from __future__ import annotations

import contextlib
import json
import math
from dataclasses import dataclass, field

import numpy as np
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_unflatten

from . import accelerator, blocked, capture, convolution, hardware, randomness, rules
from .fused import Epilogues, FusedKernels, FusedSums, Unfusable, rows_of
from .logformat import OpRecord, OutputEntries, StepLogReader, StepLogWriter
from .rounding import UNIT_ROUNDOFF, Grid, mask_positions

aten = torch.ops.aten
_FLOAT_OK = (torch.float32, torch.float64)
_REFUSED_DTYPES = (torch.float16, torch.bfloat16, torch.complex64, torch.complex128, torch.complex32)
# scalars within this relative distance of a float32 midpoint are logged (2**17 float64 ulps)
SCALAR_THRESHOLD = 2.0**-36
# an honest trainer's result lies within tau of the auditor's (the threshold's error model); the factor
# covers the two sides' float64 evaluation of tau itself, which can differ in its last bits
HONEST_TAU = 1.0 + 2.0**-20
MAX_SUSPICIOUS_DETAILS = 50
MODES = ("verified", "nolog", "fp64", "fp32")
PHASES = ("forward", "backward", "optimizer")


class VeritrainError(RuntimeError):
    """Base class for errors that name what went wrong in a run."""


class UnsupportedOpError(VeritrainError):
    pass


class ReplayMismatchError(VeritrainError):
    """The auditor's op stream differs from the one in the trainer's log."""


@dataclass
class Suspicious:
    step: int
    op_index: int
    op: str
    slot: int
    position: int
    kind: str  # "direction", "value" or "scalar"
    detail: str


@dataclass
class StepStats:
    step: int = 0
    ops: int = 0
    rounded: dict = field(default_factory=lambda: dict.fromkeys(PHASES, 0))
    analysed: int = 0
    entries_dir: dict = field(default_factory=lambda: dict.fromkeys(PHASES, 0))
    entries_val: dict = field(default_factory=lambda: dict.fromkeys(PHASES, 0))
    entries_scalar: int = 0
    corrections: dict = field(default_factory=lambda: dict.fromkeys(PHASES, 0))
    suspicious: list = field(default_factory=list)  # the first MAX_SUSPICIOUS_DETAILS, with details
    suspicious_count: int = 0
    fallback_ops: set = field(default_factory=set)
    log: dict | None = None
    # the trainer's remaining freedom, as the auditor saw it: entries it accepted and how wide a window
    # of values each value entry left open (absolute, and in grid cells at the auditor's result)
    freedom_direction: int = 0
    freedom_value: int = 0
    freedom_value_window: float = 0.0
    freedom_value_cells: float = 0.0

    @property
    def rounded_total(self):
        return sum(self.rounded.values())

    @property
    def entries_total(self):
        return sum(self.entries_dir.values()) + sum(self.entries_val.values()) + self.entries_scalar

    @property
    def corrections_total(self):
        return sum(self.corrections.values())

    def as_dict(self):
        return {"step": self.step, "ops": self.ops, "rounded": dict(self.rounded), "analysed": self.analysed,
                "entries_direction": dict(self.entries_dir), "entries_value": dict(self.entries_val),
                "entries_scalar": self.entries_scalar, "corrections": dict(self.corrections),
                "suspicious": self.suspicious_count, "fallback_ops": sorted(self.fallback_ops),
                "log": self.log, "freedom": self.freedom()}

    def freedom(self) -> dict:
        return {"direction_entries": self.freedom_direction, "value_entries": self.freedom_value,
                "value_window_total": self.freedom_value_window, "value_window_cells": self.freedom_value_cells}


@dataclass
class EngineConfig:
    mode: str = "verified"
    bits: int = 32
    seed: int = 0
    thresholds: dict = field(default_factory=lambda: dict(rules.DEFAULT_THRESHOLDS))
    slack: float = 2.0  # an entry is suspicious beyond slack * tau from a midpoint

    def __post_init__(self):
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {', '.join(MODES)}, got {self.mode!r}")
        Grid(self.bits)  # validates
        unknown = set(self.thresholds) - set(rules.DEFAULT_THRESHOLDS)
        if unknown:
            raise ValueError(f"unknown threshold classes: {', '.join(sorted(unknown))}")
        for k, v in self.thresholds.items():
            try:  # an integer too large for a float is no threshold either (not an OverflowError)
                ok = isinstance(v, (int, float)) and math.isfinite(v) and v > 0
            except OverflowError:
                ok = False
            if not ok:
                raise ValueError(f"threshold for class {k!r} must be a positive number, got {v!r}")
        self.thresholds = {**rules.DEFAULT_THRESHOLDS, **{k: float(v) for k, v in self.thresholds.items()}}


# --- schema helpers (cached per op) -------------------------------------------------------------


class _OpInfo:
    __slots__ = ("label", "names", "defaults", "mutated", "functional", "variant", "targets", "has_dtype")

    def __init__(self, func):
        self.label = str(func)  # the op's name in the log
        schema = func._schema
        self.names = [a.name for a in schema.arguments]
        # the dispatcher leaves out arguments equal to their default (dtype/layout/device defaults come
        # back as enum integers: leave those out, the engine treats them as "not given")
        self.defaults = {a.name: a.default_value for a in schema.arguments if a.has_default_value()
                         and a.name not in ("dtype", "layout", "device", "memory_format", "pin_memory")}
        self.mutated = [a.name for a in schema.arguments if a.alias_info is not None and a.alias_info.is_write]
        self.has_dtype = "dtype" in self.names
        self.functional, self.variant, self.targets = None, "plain", []
        if not self.mutated:
            return
        packet = func._overloadpacket
        name = packet.__name__
        if name.endswith("_") and self.mutated == [schema.arguments[0].name]:
            base = getattr(aten, name[:-1], None)
            if base is not None and func._overloadname in base.overloads():
                self.functional = getattr(base, func._overloadname)
                self.variant, self.targets = "inplace", [schema.arguments[0].name]
                return
        outs = [a.name for a in schema.arguments if a.kwarg_only and a.alias_info is not None and a.alias_info.is_write]
        if outs and outs == self.mutated:
            want = [a.name for a in schema.arguments if a.name not in outs]
            for ov in packet.overloads():
                cand = getattr(packet, ov)
                if cand is func or cand._schema.is_mutable:
                    continue
                if [a.name for a in cand._schema.arguments] == want:
                    self.functional, self.variant, self.targets = cand, "out", outs
                    return
        self.variant = "mutating"


_INFO: dict = {}


def _info(func) -> _OpInfo:
    info = _INFO.get(func)
    if info is None:
        info = _INFO[func] = _OpInfo(func)
    return info


def _named(func, args, kwargs) -> dict:
    """Arguments by schema name, defaults filled in."""
    info = _info(func)
    d = dict(info.defaults)
    d.update(zip(info.names, args))
    d.update(kwargs)
    return d


def rule_of(func, args, kwargs, name: str | None = None) -> rules.Rule:
    """``func``'s rule as the engine picks it: a rules.Choose row chooses by the named arguments (an add with
    alpha 1 is exact); the arguments are named only for such rows. ``name``: rules.base_name(func), if known."""
    row = rules.RULES.get(name or rules.base_name(func))
    return rules.lookup(func, _named(func, args, kwargs) if isinstance(row, rules.Choose) else None)


# extra mutations the schema does not declare
_UNDECLARED_MUTATIONS = {
    "native_batch_norm": lambda a: ["running_mean", "running_var"] if a.get("training")
    and a.get("running_mean") is not None else [],
}


def _picked_nll(func, args, kwargs):
    """An NLL loss over a (rows, classes) input reads one element per row, input[i, target[i]]: the call on
    those elements alone, as a one-column input (class 0; ignored rows stay ignored), gives the same float64
    values, without the float64 copy of a language model's vocabulary-wide log-probabilities. Returns
    (narrowed named arguments, the picked columns, the number of classes), or None where this does not
    apply (class weights, ignore_index 0, a target out of range: the op itself reports that)."""
    named = _named(func, args, kwargs)
    x, target = named["self"], named["target"]
    if named.get("weight") is not None or named["ignore_index"] == 0 or x.dim() != 2 or x.shape[1] < 2 \
            or x.dtype != torch.float32 or target.dim() != 1 or target.shape[0] != x.shape[0]:
        return None
    keep = target != named["ignore_index"]
    if bool((keep & ((target < 0) | (target >= x.shape[1]))).any()):
        return None
    cols = torch.where(keep, target, 0)
    narrowed = {**named, "self": x.gather(1, cols.unsqueeze(1)), "target": torch.where(keep, 0, target)}
    return narrowed, cols, x.shape[1]


_PICKED = {aten.nll_loss_forward.default, aten.nll_loss_backward.default}
_IGNORED_NAMESPACES = ("profiler",)
_NOT_FUSED = object()
_NO_POSITIONS = torch.zeros(0, dtype=torch.int64)  # a part of a packed result without candidates (_PartSlot)
_FUSED_CACHE: dict = {}
_EPILOGUE_CACHE: dict = {}
_SUMS_CACHE: dict = {}


def _flatten_call(args, kwargs):
    """(leaves, spec) of an op call, in ``tree_flatten((args, kwargs))``'s order (scalar positions in the log
    are indices into these leaves). aten arguments nest one level (Tensor[], int[], float[]): this walks
    them directly, several times cheaper per op than the general pytree; anything deeper goes to pytree."""
    leaves, shape = [], []
    for part in (args, kwargs.values()):
        for a in part:
            if isinstance(a, (list, tuple)) and not hasattr(a, "_fields"):  # torch.Size too, not namedtuples
                if any(isinstance(x, (list, tuple, dict)) for x in a):
                    flat, spec = tree_flatten((args, kwargs))
                    return flat, ("pytree", spec)
                shape.append((tuple if isinstance(a, tuple) else list, len(a)))
                leaves.extend(a)
            elif isinstance(a, (list, tuple, dict)):
                flat, spec = tree_flatten((args, kwargs))
                return flat, ("pytree", spec)
            else:
                shape.append(None)
                leaves.append(a)
    return leaves, ("call", len(args), tuple(kwargs), shape)


def _unflatten_call(leaves, spec):
    """(args, kwargs) from ``_flatten_call``'s leaves (possibly changed) and spec."""
    if spec[0] == "pytree":
        return tree_unflatten(leaves, spec[1])
    _, n_args, keys, shape = spec
    values, i = [], 0
    for entry in shape:
        if entry is None:
            values.append(leaves[i])
            i += 1
        else:
            kind, n = entry
            values.append(kind(leaves[i:i + n]))
            i += n
    return tuple(values[:n_args]), dict(zip(keys, values[n_args:]))


def _is_float_tensor(x) -> bool:
    return isinstance(x, torch.Tensor) and x.is_floating_point()


def _check_dtypes(func, leaves):
    for x in leaves:
        dt = x.dtype if isinstance(x, torch.Tensor) else x if isinstance(x, torch.dtype) else None
        if dt in _REFUSED_DTYPES:
            raise UnsupportedOpError(
                f"{func}: {dt} values inside a verified step are not supported; veritrain keeps every "
                f"floating value on a float32 grid (run the model in float32, without autocast)")


def _host(t: torch.Tensor) -> np.ndarray:
    """A few values as a NumPy array (on the host)."""
    return t.detach().cpu().numpy()


def _to_model_dtype(y32: torch.Tensor, dtype) -> torch.Tensor:
    return y32 if dtype == torch.float32 else y32.to(dtype)


class _Analysis:
    """Per-op state shared between the slots of one op: the call and its (lazily computed) scales."""

    __slots__ = ("call", "rule", "scales")

    def __init__(self, call, rule):
        self.call, self.rule, self.scales = call, rule, None

    def scale(self, slot, shape):
        if self.scales is None:
            self.scales = list(rules.scale_for(self.rule, self.call))
        s = self.scales[slot] if slot < len(self.scales) else None
        if isinstance(s, rules.Deferred):
            s = self.scales[slot] = s.compute()
        if s is None:
            raise VeritrainError(f"{self.call.func}: rule gives no error scale for output {slot}")
        if isinstance(s, (rules.LazyScale, rules.RowSubset, rules.RelScale)):
            return s
        device = next((y.device for y in self.call.outputs if isinstance(y, torch.Tensor)), None)
        if not isinstance(s, torch.Tensor):
            s = torch.tensor(float(s), dtype=torch.float64)
        return s.to(device=device, dtype=torch.float64).expand(shape)


class _ExactSlot:
    """An output that needs no analysis (exact op, or a float32 kernel result)."""

    op_class = None

    def __init__(self, y, grid):
        self.shape = tuple(y.shape)
        self.y32 = y if y.dtype == torch.float32 else grid.round(y)


class _EagerSlot:
    """A float64 result computed by eager ops, with its error scale (a tensor or a LazyScale)."""

    def __init__(self, y64, analysis: _Analysis, index: int, grid: Grid, epilogues=None):
        self.y64 = y64.contiguous()
        self.shape = tuple(y64.shape)
        self.analysis, self.index = analysis, index
        self.op_class = analysis.rule.op_class
        self.grid = grid
        self._epilogues = epilogues
        self._y32 = None
        self._scale = None
        self.found = None  # candidate positions, where TrainerHalf.scan_jointly found them

    @property
    def y32(self):
        if self._y32 is None:
            self._y32 = self.grid.round(self.y64)
        return self._y32

    def perturb(self, c, key):
        """Worst-case hardware (accelerator.perturb): move the float64 result within 0.9 of its threshold."""
        self.y64 = accelerator.perturb(self.y64, self.scale(), c, key).contiguous()
        self._y32 = None

    def _scale_obj(self):
        if self._scale is None:
            self._scale = self.analysis.scale(self.index, self.y64.shape)
        return self._scale

    def scale(self):
        return rules.materialize_scale(self._scale_obj(), self.y64)

    def candidate_indices(self, c):
        """Flat positions that may need a log entry."""
        if self.found is not None:
            return self.found
        s = self._scale_obj()
        if isinstance(s, rules.RowSubset):
            if not len(s.rows):
                return torch.zeros(0, dtype=torch.int64, device=self.y64.device)
            width = math.prod(self.shape[1:])
            sub = self.y64[s.rows].contiguous()
            local = self.grid.candidate_positions(sub, s.scale.expand(sub.shape).contiguous(), c)
            return s.rows[local // width] * width + local % width
        if self._epilogues is not None and FusedKernels.enabled_for(self.y64.numel(), self.y64.device):
            out = self._epilogues.run(self.y64, s, c)
            if out is not None:
                self._y32, mask = out
                return mask_positions(mask)
        return self.grid.candidate_positions(self.y64, self.scale(), c)

    def values_at(self, idx):
        return self.y64.reshape(-1)[idx]

    def scale_at(self, idx):
        s = self._scale_obj()
        if isinstance(s, rules.RelScale):
            return s.materialize(self.values_at(idx))
        if isinstance(s, (rules.LazyScale, rules.RowSubset)):
            return s.at(idx, self.shape)
        return s.contiguous().reshape(-1)[idx]


class _PickedSlot:
    """nll_loss_backward's gradient, zero except at one column per row: the rows' values analysed as a
    one-column result (``inner``), every other element exactly zero (scale 0, never an entry)."""

    def __init__(self, inner: _EagerSlot, cols: torch.Tensor, width: int):
        self.inner, self.cols, self.width = inner, cols, width
        self.shape = (inner.shape[0], width)
        self.op_class = inner.op_class
        self._y32 = None

    @property
    def y32(self):
        if self._y32 is None:
            self._y32 = torch.zeros(self.shape, dtype=torch.float32, device=self.cols.device)
            self._y32.scatter_(1, self.cols.unsqueeze(1), self.inner.y32)
        return self._y32

    def candidate_indices(self, c):
        rows = self.inner.candidate_indices(c)
        return rows * self.width + self.cols[rows]

    def _picked(self, idx):
        rows = idx // self.width
        return rows, (idx % self.width) == self.cols[rows]

    def values_at(self, idx):
        rows, hit = self._picked(idx)
        return torch.where(hit, self.inner.values_at(rows), 0.0)

    def scale_at(self, idx):
        rows, hit = self._picked(idx)
        return torch.where(hit, self.inner.scale_at(rows), 0.0)


class _PartSlot:
    """One tensor's share (``n`` values from ``start``) of a result computed for several tensors laid end to end
    (``_packed_groups``): its float32 values a view of the whole's, its positions the whole's less ``start``.
    The whole is scanned once, for all its parts (``found``, shared by them)."""

    def __init__(self, whole, start: int, shape, found: list):
        self.whole, self.start, self.shape, self.found = whole, start, tuple(shape), found
        self.n = math.prod(self.shape)
        self.op_class = whole.op_class

    @property
    def y32(self):
        return self.whole.y32.view(-1)[self.start:self.start + self.n].view(self.shape)

    def candidate_indices(self, c):
        if not self.found:
            self.found.append(_host(self.whole.candidate_indices(c)).astype(np.int64, copy=False))
        found = self.found[0]
        if not len(found):  # the usual case: no candidate in the whole, so none in any part
            return _NO_POSITIONS
        lo, hi = np.searchsorted(found, (self.start, self.start + self.n))
        return torch.from_numpy(found[lo:hi] - self.start)

    def values_at(self, idx):
        return self.whole.values_at(idx + self.start)

    def scale_at(self, idx):
        return self.whole.scale_at(idx + self.start)


class _FusedSlot:
    """The result of a fused kernel: float32 values and candidates; float64 values recomputed eagerly
    (by the kernel's own Python function) only at the positions that need them."""

    def __init__(self, y32, cand, compute, operands, extra, shape, op_class):
        self.y32, self.cand, self.shape, self.op_class = y32, cand, tuple(shape), op_class
        self._compute, self._operands, self._extra = compute, operands, extra
        self._memo = None

    def _eval(self, idx):
        if self._memo is not None and self._memo[0] is idx:
            return self._memo[1]
        if self._compute is None:  # written in place over an operand (_fused_slot's ``into``): nothing to recompute
            raise RuntimeError("a result computed in place over its operand cannot be evaluated again")
        sub = [t[idx] if t.dim() else t for t in self._operands]
        y, s = self._compute(*sub, *self._extra)
        y = y.to(torch.float64).reshape(-1)
        s = torch.as_tensor(s, dtype=torch.float64, device=y.device).expand(y.shape)
        self._memo = (idx, (y, s))
        return y, s

    def candidate_indices(self, c):
        return mask_positions(self.cand)

    def values_at(self, idx):
        return self._eval(idx)[0]

    def scale_at(self, idx):
        return self._eval(idx)[1]


class _SumSlot(_FusedSlot):
    """A compiled sum's result (FusedSums): its candidates' values and scales recomputed by the aten op on
    their rows alone, the scale by the rule's own definition (rules._reduction_sum)."""

    def __init__(self, y32, cand, func, x, dims, shape, op_class):
        super().__init__(y32, cand, None, (), (), shape, op_class)
        self._func, self._x, self._dims, self._rows = func, x, dims, None

    def _eval(self, idx):
        if self._memo is not None and self._memo[0] is idx:
            return self._memo[1]
        if self._rows is None:
            self._rows = rows_of(self._x, self._dims)
        rows = self._rows[idx].to(torch.float64)
        y = self._func(rows, [1])
        s = rules._reduction_sum(rules.Call(self._func, (rows, [1]), {}, [y]))[0]
        self._memo = (idx, (y, s))
        return y, s


class _ProductSlot:
    """A matrix product rounded and scanned block by block (blocked.mm_in_blocks), so that its float64 values
    never exist whole: its float32 values and candidates' positions; the float64 value at a position that needs
    it recomputed as the dot product of a's row and b's column (another correct evaluation, as for the fused
    kernels: TrainerHalf.record rounds the recomputed values where it classifies them), the scale as rules._mm's."""

    def __init__(self, y32, found, a, b, scale, op_class):
        self.y32, self.found, self.a, self.b, self._scale = y32, found, a, b, scale
        self.shape, self.op_class = tuple(y32.shape), op_class
        self._memo = None

    def candidate_indices(self, c):
        return self.found

    def values_at(self, idx):
        if self._memo is not None and self._memo[0] is idx:
            return self._memo[1]
        i, j = idx // self.shape[1], idx % self.shape[1]
        y = (self.a[i].to(torch.float64) * self.b.t()[j].to(torch.float64)).sum(1)
        self._memo = (idx, y)
        return y

    def scale_at(self, idx):
        return self._scale.at(idx, self.shape)


_FUSED_SUMS = {aten.sum.dim_IntList, aten.mean.dim}  # computed by FusedSums where it can


def _each(**names):
    """The named arguments of a foreach op's single-tensor op for tensor i: ``names`` maps each of the op's
    arguments to the foreach op's (a list: its i-th element; else the value itself)."""
    def arguments(named, i):
        out = {}
        for mine, theirs in names.items():
            v = named[theirs]
            out[mine] = v[i] if isinstance(v, (list, tuple)) else v
        return out
    return arguments


# foreach ops (the optimizers' updates, task.normalize_optimizer) whose result for each tensor is a single-tensor
# op's, with the same error scale (rules.py: |self| + |result|, or |result|): that op's fused kernel computes
# a large tensor's (_try_fused_foreach). tests/test_fused_kernels.py holds the two to the same bits and log.
_FOREACH_AS_SINGLE = {
    aten._foreach_add.List: (aten.add.Tensor, _each(self="self", other="other", alpha="alpha")),
    aten._foreach_sub.List: (aten.sub.Tensor, _each(self="self", other="other", alpha="alpha")),
    aten._foreach_lerp.Scalar: (aten.lerp.Scalar, _each(self="self", end="tensors1", weight="weight")),
    aten._foreach_addcmul.Scalar: (aten.addcmul.default, _each(self="self", tensor1="tensor1", tensor2="tensor2",
                                                               value="value")),
    aten._foreach_addcmul.ScalarList: (aten.addcmul.default, _each(self="self", tensor1="tensor1",
                                                                   tensor2="tensor2", value="scalars")),
    aten._foreach_addcdiv.Scalar: (aten.addcdiv.default, _each(self="self", tensor1="tensor1", tensor2="tensor2",
                                                               value="value")),
    aten._foreach_addcdiv.ScalarList: (aten.addcdiv.default, _each(self="self", tensor1="tensor1",
                                                                   tensor2="tensor2", value="scalars")),
    aten._foreach_sqrt.default: (aten.sqrt.default, _each(self="self")),
    aten._foreach_div.Scalar: (aten.div.Scalar, _each(self="self", other="scalar")),
    aten._foreach_div.ScalarList: (aten.div.Scalar, _each(self="self", other="scalars")),
}
_JOINT_MAX_NUMEL = 1 << 16  # outputs scanned together (TrainerHalf.scan_jointly): smaller ones, this many values a scan


class TrainerHalf:
    """The trainer's half of the engine: which of an op's rounded results lie near a rounding midpoint, and the
    log entries that record its decisions there (docs/ROUNDING.md). The mode computes and rounds; this reads its
    float64 results and writes the step's log (``mode.writer``)."""

    def __init__(self, mode: VerifiedMode):
        self.mode = mode

    def write(self, func, scalars, entries, n_rounded):
        self.mode.writer.op(_info(func).label, scalars, entries, n_rounded)

    def scan_jointly(self, slots):
        """The candidate positions of a many-output op's small float64 results (a foreach op's, one
        per parameter) from one scan of them laid end to end, kept in each slot for ``record``. The bulk test
        is elementwise, so each position gets the answer its own output's scan gives; but a scan per output
        costs more to call than to run. Outputs that a fused epilogue scans, or whose scale covers some rows
        only, keep their own scan."""
        if len(slots) < 2:
            return
        group = [s for s in slots if type(s) is _EagerSlot and s.y64.device.type == "cpu"
                 and s.y64.numel() < _JOINT_MAX_NUMEL and not FusedKernels.enabled_for(s.y64.numel(), "cpu")
                 and not isinstance(s._scale_obj(), rules.RowSubset)]
        if len(group) < 2:
            return
        c = self.mode.config.thresholds[group[0].op_class]  # one rule, so one class, for all of an op's outputs
        start = 0
        while start < len(group):
            end, total = start, 0
            while end < len(group) and total < _JOINT_MAX_NUMEL:  # copies of a few hundred KB at most
                total += group[end].y64.numel()
                end += 1
            chunk, start = group[start:end], end
            bounds = np.cumsum([0] + [s.y64.numel() for s in chunk])
            y = torch.cat([s.y64.reshape(-1) for s in chunk])
            scale = torch.cat([s.scale().reshape(-1) for s in chunk])
            pos = self.mode.grid.candidate_positions(y, scale, c).numpy()
            cuts = np.searchsorted(pos, bounds)
            for k, s in enumerate(chunk):
                s.found = torch.from_numpy(pos[cuts[k]:cuts[k + 1]] - bounds[k])

    def record(self, slot, c) -> OutputEntries:
        """Find the entries of one output (and keep its float32 result consistent with them). The
        candidates' classification runs in NumPy (rounding.Grid: few values, where torch's dispatch dominates)."""
        grid = self.mode.grid
        e = OutputEntries(slot.shape)
        idx = slot.candidate_indices(c)
        if not idx.numel():
            return e
        yc = slot.values_at(idx)
        tau = c * UNIT_ROUNDOFF * _host(slot.scale_at(idx))
        is_val, is_dir, away = grid.classify(_host(yc), tau)
        flat = slot.y32.view(-1)
        if not isinstance(slot, _EagerSlot):
            flat[idx] = grid.round(yc)  # the rounded result comes from the same values as the entries
        idx = _host(idx).astype(np.int64, copy=False)
        e.dir_pos = idx[is_dir]
        e.dir_bits = away[is_dir]
        e.val_pos = idx[is_val]
        e.val_bits = _host(flat[torch.from_numpy(e.val_pos).to(flat.device)]).view(np.uint32) if len(e.val_pos) \
            else np.zeros(0, np.uint32)
        return e


class AuditorHalf:
    """The auditor's half of the engine: the trainer's log read op by op (``mode.reader``), each decision in it
    checked against the error model and forced where it is plausible; the implausible ones are counted and named
    as suspicious (docs/SECURITY.md). Everything it reads comes from the trainer."""

    def __init__(self, mode: VerifiedMode):
        self.mode = mode

    def open(self, func):
        """(the log's record for the op the mode runs now, its scalar decisions by argument position)."""
        mode = self.mode
        rec = mode.reader.next_op()
        if rec is None:
            raise ReplayMismatchError(
                f"step {mode.step}, op #{mode.op_index} {func}: the trainer's log ends before this op; "
                f"the replay runs different code than the trainer did")
        if rec.name != _info(func).label:
            raise ReplayMismatchError(
                f"step {mode.step}, op #{mode.op_index}: replay runs {func} but the log has {rec.name} here "
                f"(a different task, code version or op stream)")
        return rec, dict(rec.scalars)

    def check_shapes(self, func, record: OpRecord, slots):
        """The log's output shapes must be the op's: its entries' positions are read against them."""
        shapes = [s.shape for s in slots if s is not None]
        got = [tuple(o.shape) for o in record.outputs]
        if shapes != got:
            raise ReplayMismatchError(
                f"step {self.mode.step}, op #{self.mode.op_index} {func}: output shapes {shapes} differ from the "
                f"log's {got} (a different task, configuration or batch)")

    def force_scalar(self, x, away, pos):
        """The float32 value the log's decision gives the scalar ``x`` (argument ``pos``), checked as a tensor
        entry is: only near a float32 midpoint, and against our own rounding only within the threshold."""
        x32 = float(np.float32(x))
        other = float(np.nextafter(np.float32(x32), np.float32(math.copysign(math.inf, x - x32)))) if x32 != x else x32
        lo, hi = sorted((abs(x32), abs(other)))
        mid = (lo + hi) / 2
        dist = abs(abs(x) - mid)
        if hi == lo or dist > self.mode.config.slack * SCALAR_THRESHOLD * abs(x):
            self.suspicious(pos, 0, "scalar", f"scalar {x!r} is not near a float32 midpoint")
        elif bool(away) != (abs(x32) > abs(x)):
            # an entry that overrides our rounding must be one an honest trainer could have made: it logs
            # within SCALAR_THRESHOLD, and its scalar is on the other side of the midpoint only if ours is
            # closer to it than that (as for tensor entries, docs/SECURITY.md rows 1 and 19)
            self.mode.stats.corrections[self.mode._phase()] += 1
            if dist > SCALAR_THRESHOLD * HONEST_TAU * abs(x):
                self.suspicious(pos, 0, "scalar", f"scalar {x!r} rounded {'away from' if away else 'toward'} zero, "
                                f"against its own rounding, {dist / abs(x):.3g} (relative) from a float32 "
                                f"midpoint: beyond the scalar threshold {SCALAR_THRESHOLD:.3g}")
        return math.copysign(hi if away else lo, x)

    def unused_forced(self, func, forced, used):
        """Scalar entries for positions that are not finite float scalars: no honest trainer writes them."""
        for pos in forced:
            if pos not in used:
                self.suspicious(pos, 0, "scalar", f"{func}: scalar entry for argument {pos}, which is not a "
                                f"finite float scalar", op=str(func))

    def replay(self, func, slot, entries: OutputEntries, phase, c, index):
        """Force the trainer's decisions for one output and check each is plausible. The checks run
        in NumPy on the entries' values (few per output, where torch's per-operation dispatch dominates); the
        direction and value entries' values, scales and grid cells are fetched together, once per output (each
        fetch costs more to call than to run: bench/profile_engine.py --per-op, the auditor's `classify`)."""
        if not entries.n_entries:
            return
        grid = self.mode.grid
        slack = self.mode.config.slack
        flat = slot.y32.view(-1)
        dev = flat.device
        n_dir = len(entries.dir_pos)
        positions = np.concatenate([entries.dir_pos, entries.val_pos]) if n_dir and len(entries.val_pos) \
            else entries.dir_pos if n_dir else entries.val_pos
        at_all = torch.from_numpy(positions).to(dev)
        y_all = _host(slot.values_at(at_all))
        tau_all = c * UNIT_ROUNDOFF * _host(slot.scale_at(at_all))
        cell_all = grid.cell(y_all)
        with np.errstate(invalid="ignore", over="ignore"):
            if n_dir:
                at = at_all[:n_dir]
                pos = entries.dir_pos
                yc, tau = y_all[:n_dir], tau_all[:n_dir]
                cell = tuple(part[:n_dir] for part in cell_all)
                away = entries.dir_bits.astype(bool)
                forced = grid.apply_direction(yc, away, cell)
                natural = grid.round_host(yc)
                contradicts = forced.view(np.int32) != natural.view(np.int32)
                self.mode.stats.corrections[phase] += int(contradicts.sum())
                dist = grid.midpoint_distance(yc, cell)
                # needed only within slack * tau of a midpoint; NaN or infinite results never need one. An
                # entry that *overrides* our rounding must be one an honest trainer could have made: its result
                # lies within tau of ours (the error model), so ours is within tau of the midpoint it crossed. A
                # result with tau 0 (certified exact) is the same on every machine: rounding decides even at a
                # tie, so no honest entry contradicts it
                bad = ~(dist <= slack * tau) | ~np.isfinite(yc) | (np.abs(yc) >= 2.0**128) \
                    | (contradicts & ~((dist <= tau * HONEST_TAU) & (tau > 0)))
                self.mode.stats.freedom_direction += len(pos)
                for j in np.flatnonzero(bad).tolist():
                    self.suspicious(int(pos[j]), index, "direction",
                                    f"{func}: value {float(yc[j])!r} is {float(dist[j]):.3g} from a midpoint, "
                                    f"threshold {float(tau[j]):.3g}", op=str(func))
                flat[at] = torch.from_numpy(forced).to(dev)
            if len(entries.val_pos):
                at = at_all[n_dir:]
                pos = entries.val_pos
                vals = entries.val_bits.view(np.float32)
                yc, tau, spacing = y_all[n_dir:], tau_all[n_dir:], cell_all[2][n_dir:]
                natural = grid.round_host(yc)
                contradicts = vals.view(np.int32) != natural.view(np.int32)
                self.mode.stats.corrections[phase] += int(contradicts.sum())
                v64 = vals.astype(np.float64)
                window = slack * tau
                # the auditor's own classification: a value entry is needed only where the error bound is not
                # small against the grid spacing anywhere in the window (the trainer's result lies within tau
                # of ours, so its spacing is at least the spacing at |y| - tau)
                low = np.maximum(np.abs(yc) - window, 0.0)
                needed = np.isfinite(yc) & (np.abs(yc) < 2.0**128) & (window >= grid.spacing_at(low) / 8)
                # the value must be a grid point the honest trainer could have produced: round(y') for some
                # y' within tau of ours (the error model); an entry that agrees with our own rounding changes
                # nothing and only has to be needed
                honest = tau * HONEST_TAU
                lo, hi = grid.round_host(yc - honest).astype(np.float64), grid.round_host(yc + honest).astype(np.float64)
                inside = (v64 >= lo) & (v64 <= hi)
                on_grid = grid.on_grid(vals)
                bad = ~needed | (contradicts & ~inside) | ~on_grid | ~np.isfinite(v64)
                self.mode.stats.freedom_value += len(pos)
                ok = ~bad
                if ok.any():  # the trainer could have logged any grid value in [lo, hi]
                    width = (hi - lo)[ok]
                    self.mode.stats.freedom_value_window += float(width.sum())
                    self.mode.stats.freedom_value_cells += float((width / spacing[ok]).sum())
                for j in np.flatnonzero(bad).tolist():
                    self.suspicious(int(pos[j]), index, "value",
                                    f"{func}: logged value {float(vals[j])!r} but the computed value is "
                                    f"{float(yc[j])!r} (threshold {float(tau[j]):.3g})", op=str(func))
                flat[at] = torch.from_numpy(np.where(on_grid, vals, grid.round_host(v64))).to(dev)

    def suspicious(self, position, slot, kind, detail, op=""):
        """Counts an implausible entry (the audit fails on any) and names the first few."""
        stats = self.mode.stats  # the mode's current counts: a captured region's row run swaps them
        stats.suspicious_count += 1
        if len(stats.suspicious) < MAX_SUSPICIOUS_DETAILS:
            stats.suspicious.append(Suspicious(self.mode.step, self.mode.op_index, op, slot, position, kind, detail))

    def suspicious_block(self, func, slot, entries, why):
        """Every entry of an output that can have none (an exact op's) is suspicious."""
        positions = np.concatenate([entries.dir_pos, entries.val_pos])
        for p in positions[:MAX_SUSPICIOUS_DETAILS]:  # details for the first few; every one is counted
            self.suspicious(int(p), slot, "exact", f"{func}: {why}", op=str(func))
        self.mode.stats.suspicious_count += max(0, len(positions) - MAX_SUSPICIOUS_DETAILS)


class VerifiedMode(TorchDispatchMode):
    """One training step under the engine. ``writer`` (trainer) or ``reader`` (auditor) or neither."""

    def __init__(self, config: EngineConfig, step: int, writer: StepLogWriter | None = None,
                 reader: StepLogReader | None = None, domain: str = "op"):
        super().__init__()
        self.domain = domain  # "op" inside a training step, "init" while the task is built
        self.config = config
        self.grid = Grid(config.bits)
        self.step = step
        self.writer, self.reader = writer, reader
        # the two roles' halves: the trainer's writes the log, the auditor's reads, checks and applies it
        self.trainer = TrainerHalf(self) if writer is not None else None
        self.auditor = AuditorHalf(self) if reader is not None else None
        self.stats = StepStats(step=step)
        self.random_index = 0
        self.op_index = 0
        self.in_optimizer = False
        self.rounding = config.mode in ("verified", "nolog")
        self.trace: OpTrace | None = None  # per-op digests (dispute game), when enabled
        self.probe = None  # calibration: called with each approx result before rounding
        self._fk = None
        self._ep = None
        self._sums = None
        self.emulate = accelerator.active()  # an emulated accelerator or worst-case hardware (accelerator.py)
        self.recorder: capture.Recorder | None = None  # records the ops of a decomposition being captured
        self.closed_log: dict | None = None  # logged_step: the writer's summary once the step completed

    # --- entry ----------------------------------------------------------------------------------

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        rec = self.recorder
        if rec is None:
            return self._dispatch(func, args, kwargs)
        self.recorder = None  # what this op runs through the engine in turn is part of it, not of the region
        before = self.op_index
        try:
            out = self._dispatch(func, args, kwargs)
        finally:
            self.recorder = rec
        rec.add(func, args, kwargs, out, self.op_index - before)
        return out

    def _dispatch(self, func, args, kwargs):
        if func.namespace in _IGNORED_NAMESPACES or _on_meta(args):
            return func(*args, **kwargs)  # meta tensors (e.g. a model being loaded) hold no values to round
        name = rules.base_name(func)
        if name in ("native_dropout", "native_dropout_backward"):
            return self._lower_dropout(func, args, kwargs)
        rule = rule_of(func, args, kwargs, name)
        if rule.kind == rules.PASSTHROUGH:
            return func(*args, **kwargs)
        if rule.kind == rules.UNSUPPORTED:
            raise UnsupportedOpError(f"step {self.step}: {func} is not supported: {rule.why}")
        if rule.kind == rules.DECOMPOSE:
            if not self.rounding:
                return func(*args, **kwargs)
            if capture.applies(self):  # replayed as one compiled function where it can be (capture.py)
                return capture.run(self, func, args, kwargs)
            return capture.fallback(self, func, args, kwargs)  # every step through the engine again
        if not self.rounding:
            if rule.kind == rules.RANDOM:
                return self._random(func, args, kwargs)
            if self.emulate and rule.kind == rules.APPROX:
                return self._emulated_plain(func, args, kwargs)
            return func(*args, **kwargs)
        if self.trace is not None:
            return self._traced(func, rule, args, kwargs)
        if rule.kind == rules.RANDOM:
            return self._random(func, args, kwargs)
        return self._compute(func, rule, args, kwargs)

    def _traced(self, func, rule, args, kwargs):
        """Run one op and add its digests to the trace (inputs hashed before in-place ops change them)."""
        tr = self.trace
        before, random_before = self.op_index, self.random_index
        inputs = [_tensor_digest(x).hex() for x in _tensor_leaves((args, kwargs))]
        bound = call_args_digest(func, args, kwargs)  # the non-tensor arguments, before scalars are rounded
        position = len(tr.entries) + 1  # in the step's trace: a data-parallel step's parts follow one another
        call = dump_call(func, args, kwargs, random_before) if tr.capture == position else None
        out = self._random(func, args, kwargs) if rule.kind == rules.RANDOM else self._compute(func, rule, args, kwargs)
        if self.op_index == before + 1:  # this call was one rounded op (not integer work)
            outputs = [_tensor_digest(x).hex() for x in _tensor_leaves(out)]
            for d in outputs:
                tr.sources.setdefault(d, f"op:{position}")
            entry = {"index": self.op_index, "part": self.domain, "op": str(func), "where": tr.where(self), "args": bound,
                     "random_index": random_before, "inputs": inputs,
                     "sources": [tr.sources.get(d) for d in inputs], "outputs": outputs}
            entry["chain"] = OpTrace.link(tr.entries[-1]["chain"] if tr.entries else "", entry)
            tr.entries.append(entry)
            if call is not None:
                tr.captured = call
        return out

    def _emulated_plain(self, func, args, kwargs):
        """Plain float32/float64 runs on the emulated accelerator: its kernels in the op's own dtype (perturb
        is defined on the engine's float64 results; plain runs under it use the same accelerator)."""
        info = _info(func)
        if info.variant not in ("plain", "inplace"):
            return func(*args, **kwargs)
        run = info.functional if info.variant == "inplace" else func
        kernel = accelerator.reorder_kernel(run)
        if kernel is None:
            return func(*args, **kwargs)
        floats = [x for x in tree_flatten((args, kwargs))[0] if _is_float_tensor(x)]
        dtype = kwargs.get("dtype") or (floats[0].dtype if floats else torch.get_default_dtype())
        flat, spec = tree_flatten(kernel(*args, **kwargs))
        result = tree_unflatten([x.to(dtype) if _is_float_tensor(x) else x for x in flat], spec)
        if info.variant == "inplace":
            target = _named(func, args, kwargs)[info.targets[0]]
            return target.copy_(result)
        return result

    def _phase(self) -> str:
        if self.in_optimizer:
            return "optimizer"
        if torch._C._current_autograd_node() is not None:
            return "backward"
        return "forward"

    # --- scalars ----------------------------------------------------------------------------------

    def _round_scalars(self, func, leaves, record_scalars, forced):
        """Round Python float leaves to float32 in place; trainer notes near-midpoint ones, the auditor forces
        the log's decisions (and flags those for positions that are not finite float scalars)."""
        used = set()
        for i, x in enumerate(leaves):
            if type(x) is not float or not math.isfinite(x):
                continue
            if i in forced:
                leaves[i] = self.auditor.force_scalar(x, forced[i], i)
                used.add(i)
                continue
            if record_scalars is not None:
                away = _scalar_entry(x)
                if away is not None:
                    record_scalars.append((i, away))
            leaves[i] = float(np.float32(x))
        if forced:
            self.auditor.unused_forced(func, forced, used)

    # --- compute ----------------------------------------------------------------------------------

    def _compute(self, func, rule, args, kwargs):
        picked = None
        if func in _PICKED and self.emulate is None and self.probe is None:
            picked = _picked_nll(func, args, kwargs)
            if picked is not None:
                args, kwargs = _from_named(func, picked[0], len(_info(func).names))
        leaves, spec = _flatten_call(args, kwargs)
        _check_dtypes(func, leaves)
        info = _info(func)
        float_pos = [i for i, x in enumerate(leaves) if _is_float_tensor(x)]
        explicit = kwargs.get("dtype") if info.has_dtype else None
        has_float_scalar = any(type(x) is float for x in leaves)
        if not float_pos and not (isinstance(explicit, torch.dtype) and explicit.is_floating_point) \
                and not (info.has_dtype and explicit is None and has_float_scalar) \
                and not any(isinstance(x, torch.dtype) and x.is_floating_point for x in leaves):
            return func(*args, **kwargs)  # integer/bool work: nothing to round

        record, forced = self._open_op(func)
        scalars = [] if self.writer is not None else None
        self._round_scalars(func, leaves, scalars, forced)

        if isinstance(explicit, torch.dtype) and explicit.is_floating_point:
            out_dtype = explicit
        else:
            out_dtype = torch.float64 if any(leaves[i].dtype == torch.float64 for i in float_pos) else torch.float32

        # exact ops at b = 32 on float32 operands: the float32 kernel gives the same bits
        if rule.kind == rules.EXACT and self.grid.drop == 0 and out_dtype == torch.float32 \
                and all(leaves[i].dtype == torch.float32 for i in float_pos) and explicit != torch.float64:
            args2, kwargs2 = _unflatten_call(leaves, spec)
            result = func(*args2, **kwargs2)
            slots = self._native_slots(func, info, result, args2, kwargs2)
            self._finish_op(func, record, scalars, [None if y is None else _ExactSlot(y, self.grid) for y in slots])
            return result

        # the fused paths' size test on the largest operand of all first, before their own work: where it fails
        # theirs would too (they test that tensor, on its device; off the CPU they are off, and a GPU's ops
        # never ask the compiler check: on the H200 machine it cost each CUDA process a CPU compile)
        largest = max((x for x in leaves if isinstance(x, torch.Tensor)), key=torch.Tensor.numel, default=None)
        fusable = self.probe is None and self.emulate is None and largest is not None \
            and FusedKernels.enabled_for(largest.numel(), largest.device)
        if fusable and rule.kind == rules.APPROX and rule.fused:
            done = self._try_fused(func, rule, info, leaves, spec, args, kwargs, record, scalars)
            if done is not _NOT_FUSED:
                return done
        packs = rule.kind == rules.APPROX and (info.functional or func) in _FOREACH_AS_SINGLE and self.probe is None \
            and self.emulate is None and _packs(leaves)
        if packs or fusable and rule.kind == rules.APPROX and (info.functional or func) in _FOREACH_AS_SINGLE:
            done = self._try_fused_foreach(func, rule, info, leaves, spec, args, kwargs, record, scalars, packs)
            if done is not _NOT_FUSED:
                return done
        if fusable and func in _FUSED_SUMS:
            done = self._try_fused_sum(func, rule, args, kwargs, record, scalars)
            if done is not _NOT_FUSED:
                return done
        if func is aten.mm.default and self.probe is None and self.emulate is None:
            done = self._try_blocked_mm(func, rule, leaves, record, scalars)
            if done is not _NOT_FUSED:
                return done

        # upcast to float64
        up = list(leaves)
        for i in float_pos:
            if up[i].dtype == torch.float32:
                up[i] = up[i].to(torch.float64)
        for i, x in enumerate(up):
            if isinstance(x, torch.dtype) and x == torch.float32:
                up[i] = torch.float64
        args64, kwargs64 = _unflatten_call(up, spec)
        if info.has_dtype and explicit is None and not float_pos and has_float_scalar:
            kwargs64 = {**kwargs64, "dtype": torch.float64}

        named64 = _named(func, args64, kwargs64)
        extra = _UNDECLARED_MUTATIONS.get(rules.base_name(func))
        mutated = list(info.mutated) + (extra(named64) if extra else [])
        run, variant, targets = func, "plain", []
        if info.variant in ("inplace", "out"):
            run, variant, targets = info.functional, info.variant, info.targets
        elif mutated:
            variant, targets = "mutating", mutated

        if variant == "out":
            call_args, call_kwargs = args64, {k: v for k, v in kwargs64.items() if k not in targets}
        elif variant == "mutating":
            # the op writes into these: give it copies, keep the inputs for the error scale
            call_named = dict(named64)
            for t in targets:
                call_named[t] = _clone_floats(call_named[t])
            call_args, call_kwargs = _from_named(func, call_named, len(args64))
        else:
            call_args, call_kwargs = args64, kwargs64
        kernel = accelerator.reorder_kernel(run) if self.emulate == "reorder" and rule.kind == rules.APPROX \
            and variant != "mutating" else None
        if run is aten.convolution.default and self.emulate is None and self.probe is None \
                and convolution.routed(**named64):
            kernel = convolution.forward  # ATen's input-gradient kernel: faster where the patches outgrow the cache
        try:
            result = (kernel or run)(*call_args, **call_kwargs)
        except (NotImplementedError, RuntimeError) as e:
            err = _device_error(self.step, func, leaves, e)
            if err is None:
                raise
            raise err from e

        outputs = _flatten_result(result)
        if variant == "mutating":
            outputs = [o for o in outputs] + [t for name in targets for t in _as_list(_named(func, call_args, call_kwargs)[name])]
        outputs64 = [o if _is_float_tensor(o) else None for o in outputs]
        # a float64 operand from outside the engine may hold values off the float32 grid (certificates)
        float64_operands = [leaves[i] for i in float_pos if leaves[i].dtype == torch.float64]
        analysis = _Analysis(rules.Call(run, args64, {k: v for k, v in kwargs64.items() if k not in targets}
                                        if variant == "out" else kwargs64, outputs64,
                                        None if float64_operands else True, float64_operands), rule)
        if rule.kind == rules.FALLBACK_RULE.kind and rule is rules.FALLBACK_RULE:
            self.stats.fallback_ops.add(str(func))
        slots = []
        for i, y in enumerate(outputs64):
            if y is None:
                slots.append(None)
            elif rule.kind == rules.APPROX:
                slots.append(_EagerSlot(y, analysis, i, self.grid, None if self.probe else self._epilogues()))
                if picked is not None and func is aten.nll_loss_backward.default:
                    slots[-1] = _PickedSlot(slots[-1], picked[1], picked[2])
            else:
                slots.append(_ExactSlot(y, self.grid))
        finals = self._finish_op(func, record, scalars, slots)

        # hand results back in the op's own dtypes and places
        n_ret = len(outputs) - (sum(len(_as_list(named64[t])) for t in targets) if variant == "mutating" else 0)
        if variant in ("inplace", "out"):
            originals = [t for name in targets for t in _as_list(_named(func, args, kwargs)[name])]
            for orig, y32 in zip(originals, finals):
                _write_back(orig, y32)
            rets = func._schema.returns
            if not rets:
                return None
            orig_named = _named(func, args, kwargs)
            vals = [orig_named[name] for name in targets]
            return vals[0] if len(rets) == 1 else tuple(vals)
        if variant == "mutating":
            originals = [t for name in targets for t in _as_list(_named(func, args, kwargs)[name])]
            for orig, y32 in zip(originals, finals[n_ret:]):
                _write_back(orig, y32)
        return _rebuild(result, [(_to_model_dtype(f, out_dtype) if f is not None else o)
                                 for f, o in zip(finals[:n_ret], outputs[:n_ret])])

    def _try_fused(self, func, rule, info, leaves, spec, args, kwargs, record, scalars):
        if info.variant not in ("plain", "inplace", "out") or rules.base_name(func) in _UNDECLARED_MUTATIONS:
            return _NOT_FUSED
        run = info.functional if info.variant in ("inplace", "out") else func
        args2, kwargs2 = _unflatten_call(leaves, spec)
        named = _named(func, args2, kwargs2)
        if info.variant == "out":
            named = {k: v for k, v in named.items() if k not in info.targets}
        target = _named(func, args, kwargs)[info.targets[0]] if info.variant in ("inplace", "out") else None
        into = target if info.variant == "inplace" and self._writes_in_place(record, 0, target) else None
        slot = self._fused_slot(func, run, rule, named, into)
        if slot is None:
            return _NOT_FUSED
        final = self._finish_op(func, record, scalars, [slot])[0].view(slot.shape)
        if target is not None:
            _write_back(target, final)
            return target if func._schema.returns else None
        return final

    def _writes_in_place(self, record, k, target) -> bool:
        """Whether the kernel of output ``k`` of an in-place op on ``target`` may write into ``target`` itself
        (no float32 result allocated and copied back). The trainer's kernel leaves its candidates' old values
        there, for TrainerHalf.record to evaluate them again and then overwrite them. The auditor's writes every
        value, so only where the log (if any) has an output of this shape there with no entries, and nothing
        needs the operand's old values after the kernel: a log that says otherwise takes the usual path, where
        _finish_op checks it."""
        if not isinstance(target, torch.Tensor):
            return False
        if self.writer is not None or record is None:
            return True
        return k < len(record.outputs) and not record.outputs[k].n_entries \
            and tuple(record.outputs[k].shape) == tuple(target.shape)

    def _fused_slot(self, func, run, rule, named, into=None):
        """``run``'s result for arguments ``named`` (float scalars on float32) from a fused kernel, or None where
        none applies (too small, not elementwise, not compiled here). ``into``: the tensor an in-place op
        writes (``_writes_in_place``); the kernel writes the rounded result there where it is the op's ``self``
        operand itself and shares memory with no other operand (the trainer's: but at its candidates)."""
        tensors = [x for x in named.values() if isinstance(x, torch.Tensor)]
        numel = max((x.numel() for x in tensors), default=0)
        if not tensors or not FusedKernels.enabled_for(numel, max(tensors, key=torch.Tensor.numel).device):
            return None
        fk = self._fused_kernels()
        try:
            plan = fk.plan(rules.base_name(run), run, named, rule.fused)
        except Unfusable:
            return None
        if plan.key in fk._failed:
            return None
        c = self.config.thresholds[rule.op_class]
        want = self.writer is not None
        operands = plan.operands()
        device = operands[0].device
        extra = [torch.tensor(v, dtype=torch.float64, device=device) for v in plan.scalars] if plan.formula else []
        target = _inplace_operand(plan, into) if into is not None else None
        try:
            built = fk.kernel(plan, run, rule.fused, c, want, target)
            if built is None:  # this op has compiled its quota of kernels
                return None
            kernel, compute = built
            out = kernel(*operands, *extra)
        except Exception as exc:  # compile or run failure: remember it, use the eager engine
            fk._failed.add(plan.key)
            fk.warn_once(func, exc)
            return None
        if target is not None:  # the result is in ``into``; the trainer's kernel returns its candidates
            return _FusedSlot(into.reshape(-1), out.reshape(-1) if want else None, compute if want else None,
                              operands, extra, plan.shape, rule.op_class)
        y32, cand = (out[0], out[1]) if want else (out, None)
        return _FusedSlot(y32.reshape(-1), None if cand is None else cand.reshape(-1), compute, operands, extra,
                          plan.shape, rule.op_class)

    def _try_fused_foreach(self, func, rule, info, leaves, spec, args, kwargs, record, scalars, packs):
        """A foreach op (an optimizer's update of every parameter) with large tensors: each tensor's result is
        its single-tensor op's (``_FOREACH_AS_SINGLE``: the same value, the same error scale and class), from
        that op's fused kernel where the tensor is large and eagerly otherwise, in one record with an output
        per tensor, as the eager engine writes it."""
        run = info.functional if info.variant == "inplace" else func
        single = _FOREACH_AS_SINGLE.get(run)
        if single is None or info.variant not in ("plain", "inplace"):
            return _NOT_FUSED
        op, arguments = single
        named = _named(func, *_unflatten_call(leaves, spec))
        calls = [arguments(named, i) for i in range(len(named["self"]))]
        if not calls or any(_is_float_tensor(v) and v.dtype != torch.float32 for c in calls for v in c.values()):
            return _NOT_FUSED
        large = [FusedKernels.enabled_for(c["self"].numel(), c["self"].device) for c in calls]
        packs = _packed_groups(calls, large) if packs else []
        if not any(large) and not packs:
            return _NOT_FUSED
        op_rule = rules.lookup(op, calls[0])
        if op_rule.kind != rules.APPROX or op_rule.op_class != rule.op_class or op_rule.fused is None:
            return _NOT_FUSED
        # in place only where no tensor the op writes is read by another tensor's update: each kernel writes its
        # tensor before the next runs, and the trainer evaluates its candidates after all of them
        in_place = info.variant == "inplace" and _writes_apart(calls)
        slots = [None] * len(calls)
        for group in packs:  # small tensors laid end to end: one op, one scale, one rounding and scan for all
            packed = {k: torch.cat([calls[i][k].reshape(-1) for i in group]) if isinstance(v, torch.Tensor) else v
                      for k, v in calls[group[0]].items()}
            whole = self._fused_slot(func, op, op_rule, packed) or self._single_op(op, op_rule, packed)
            start, found = 0, []
            for i in group:
                slots[i] = _PartSlot(whole, start, calls[i]["self"].shape, found)
                start += slots[i].n
        for i, call in enumerate(calls):
            if slots[i] is not None:
                continue
            into = call["self"] if in_place and self._writes_in_place(record, i, call["self"]) else None
            # small, or not compiled here: the single op in float64
            slots[i] = self._fused_slot(func, op, op_rule, call, into) or self._single_op(op, op_rule, call)
        finals = self._finish_op(func, record, scalars, slots)
        results = [f.view(t.shape) for f, t in zip(finals, named["self"])]
        if info.variant == "inplace":
            _write_back_all(_named(func, args, kwargs)["self"], results)
            return None
        # a packed tensor's result is a view of its group's: each result gets memory of its own, as the op's do
        return [y.clone() if isinstance(slot, _PartSlot) else y for y, slot in zip(results, slots)]

    def _single_op(self, op, rule, call):
        """``op`` on the named arguments ``call`` in float64, as an eager slot."""
        up = {k: v.to(torch.float64) if _is_float_tensor(v) else v for k, v in call.items()}
        a64, k64 = _from_named(op, up, len([a for a in op._schema.arguments if not a.kwarg_only]))
        y = op(*a64, **k64)
        return _EagerSlot(y, _Analysis(rules.Call(op, a64, k64, [y]), rule), 0, self.grid, self._epilogues())

    def _try_fused_sum(self, func, rule, args, kwargs, record, scalars):
        named = _named(func, args, kwargs)
        x = named["self"]
        if named.get("dtype") is not None or x.dtype != torch.float32 or not x.is_contiguous() or not x.dim() \
                or not x.numel() or not FusedKernels.enabled_for(x.numel(), x.device):
            return _NOT_FUSED
        dims = sorted(set(rules._dims(x, named["dim"])))
        keep = bool(named.get("keepdim"))
        out_shape = tuple(1 if d in dims else n for d, n in enumerate(x.shape)) if keep \
            else tuple(n for d, n in enumerate(x.shape) if d not in dims)
        if self._sums is None:
            self._sums = _SUMS_CACHE.setdefault((self.grid.bits,), FusedSums(self.grid))
        out = self._sums.run(x, dims, func is aten.mean.dim, self.config.thresholds[rule.op_class],
                             self.writer is not None)
        if out is None:
            return _NOT_FUSED
        y32, cand = out
        slot = _SumSlot(y32, cand, func, x, dims, out_shape, rule.op_class)
        return self._finish_op(func, record, scalars, [slot])[0].view(out_shape)

    def _try_blocked_mm(self, func, rule, leaves, record, scalars):
        """A matrix product with a large float32 operand, block by block without its float64 copy (blocked.py)."""
        a, b = leaves
        how = blocked.split(a, b)
        if how is None:
            return _NOT_FUSED
        # rules._mm's scale, sqrt(k) ||row_i(a)|| ||col_j(b)||: the trainer scans every value, so the blocks
        # take the norms while in cache. An auditor reads the scale at its entries alone, from those rows and
        # columns of the float32 operands (rules.NormFactor), unless they reach a quarter of the large operand's
        # (as in GPT-2's input gradient of the logits' product, ~480 entries over 512 rows), where the blocks' norms
        # cost less than gathering them (NormFactor.at would take them all, from a whole float64 copy)
        entries = sum(o.n_entries for o in record.outputs) if record is not None else 0
        lines = b.shape[1] if b.numel() > a.numel() else a.shape[0]
        norms = self.writer is not None or 4 * entries >= lines
        if how != "k":
            return self._mm_in_blocks(func, rule, a, b, how, norms, record, scalars)
        y, rows, cols = blocked.mm(a, b, norms=norms)
        if not norms:
            rows, cols = rules.NormFactor(a, -1), rules.NormFactor(b, -2)
        analysis = _Analysis(rules.Call(func, (a, b), {}, [y]), rule)
        analysis.scales = [rules.LazyScale([(rules._sqrt(a.shape[1]), [rows, cols])])]
        slot = _EagerSlot(y, analysis, 0, self.grid, self._epilogues())
        return self._finish_op(func, record, scalars, [slot])[0]

    def _mm_in_blocks(self, func, rule, a, b, how, norms, record, scalars):
        """A matrix product split by blocks of its result's rows or columns (blocked.mm_in_blocks: a weight's
        gradient, a language model's logits), each block rounded and, by the trainer, scanned while it is in
        cache. Without the blocks' ``norms`` (an auditor with few entries) the scale at an entry comes from the
        float32 operands (rules.NormFactor)."""
        (m, k), n = a.shape, b.shape[1]
        grid, trainer = self.grid, self.writer is not None
        c = self.config.thresholds[rule.op_class]
        y32 = torch.empty((m, n), dtype=torch.float32, device=a.device)
        row_norms = torch.empty((m, 1), dtype=torch.float64, device=a.device) if norms else None
        col_norms = torch.empty((1, n), dtype=torch.float64, device=a.device) if norms else None
        found = []

        def finish(rows, cols, y, block_rows, block_cols):
            into = y32[rows, cols]
            if norms:
                row_norms[rows] = block_rows
                col_norms[:, cols] = block_cols
            if not trainer:
                grid.round_into(y, into)
                return
            scale = rules.LazyScale([(rules._sqrt(k), [block_rows, block_cols])])
            out = self._epilogues().run(y, scale, c, into=into) \
                if FusedKernels.enabled_for(y.numel(), y.device) else None
            if out is None:  # nothing compiled here: the eager rounding and scan, the same answers
                grid.round_into(y, into)
                local = grid.candidate_positions(y, scale.materialize(y.shape), c)
            else:
                local = mask_positions(out[1])
            if local.numel():
                w = y.shape[1]
                found.append((rows.start + local // w) * n + cols.start + local % w)

        blocked.mm_in_blocks(a, b, how, finish, norms=norms)
        factors = [row_norms, col_norms] if norms else [rules.NormFactor(a, -1), rules.NormFactor(b, -2)]
        scale = rules.LazyScale([(rules._sqrt(k), factors)])
        positions = torch.sort(torch.cat(found)).values if found else torch.zeros(0, dtype=torch.int64)
        slot = _ProductSlot(y32, positions, a, b, scale, rule.op_class)
        return self._finish_op(func, record, scalars, [slot])[0]

    def _epilogues(self):
        if self._ep is None:
            self._ep = _EPILOGUE_CACHE.setdefault((self.grid.bits,), Epilogues(self.grid))
        return self._ep

    def _fused_kernels(self):
        if self._fk is None:
            self._fk = _FUSED_CACHE.setdefault((self.grid.bits,), FusedKernels(self.grid))
        return self._fk

    def _native_slots(self, func, info, result, args, kwargs):
        if info.variant in ("inplace", "out", "mutating") and info.mutated:
            named = _named(func, args, kwargs)
            outs = [t for n in info.mutated for t in _as_list(named[n])]
        else:
            outs = _flatten_result(result)
        return [o if _is_float_tensor(o) else None for o in outs]

    # --- per-op log handling ----------------------------------------------------------------------

    def _open_op(self, func):
        """(the auditor's record for this op or None, forced scalar decisions)."""
        self.op_index += 1
        return self.auditor.open(func) if self.auditor is not None else (None, {})

    def _finish_op(self, func, record: OpRecord | None, scalars, slots):
        """Round each slot; write or apply entries. Returns the float32 results (None for non-float)."""
        phase = self._phase()
        stats = self.stats
        stats.ops += 1
        entries, finals = [], []
        n_rounded = 0
        trainer, auditor = self.trainer, self.auditor
        if record is not None:
            auditor.check_shapes(func, record, slots)
        if trainer is not None and self.emulate != "perturb" and self.probe is None:
            trainer.scan_jointly(slots)
        k = 0
        for i, slot in enumerate(slots):
            if slot is None:
                finals.append(None)
                continue
            n = math.prod(slot.shape)
            n_rounded += n
            if slot.op_class is None:
                if record is not None and record.outputs[k].n_entries:
                    auditor.suspicious_block(func, i, record.outputs[k], "entries for an exact op")
                entries.append(OutputEntries(slot.shape))
            else:
                if self.emulate == "perturb" and isinstance(slot, _EagerSlot):
                    slot.perturb(self.config.thresholds[slot.op_class], (self.domain, self.step, self.op_index, i))
                if self.probe is not None and isinstance(slot, _EagerSlot):
                    self.probe(self.step, self.op_index, str(func), slot.op_class, i, slot.y64, slot.scale)
                c = self.config.thresholds[slot.op_class]
                if trainer is not None:
                    entries.append(trainer.record(slot, c))
                    stats.analysed += n
                elif record is not None and record.outputs[k].n_entries:  # most outputs have none
                    auditor.replay(func, slot, record.outputs[k], phase, c, i)
            finals.append(slot.y32)
            k += 1
        stats.rounded[phase] += n_rounded
        seen = record.outputs if record is not None else entries
        if record is not None:
            stats.entries_scalar += len(record.scalars)
        for e in seen:
            stats.entries_dir[phase] += len(e.dir_pos)
            stats.entries_val[phase] += len(e.val_pos)
        if trainer is not None:
            stats.entries_scalar += len(scalars)
            trainer.write(func, scalars, entries, n_rounded)
        return finals

    # --- random ops -------------------------------------------------------------------------------

    def _stream(self):
        s = randomness.Stream(self.config.seed, self.step, self.random_index, self.domain)
        self.random_index += 1
        return s

    def _random(self, func, args, kwargs):
        leaves, spec = _flatten_call(args, kwargs)
        _check_dtypes(func, leaves)
        record, forced = self._open_op(func) if self.rounding else (None, {})
        scalars = [] if self.writer is not None else None
        self._round_scalars(func, leaves, scalars, forced)
        args, kwargs = _unflatten_call(leaves, spec)
        a = _named(func, args, kwargs)
        name = rules.base_name(func)
        stream = self._stream()
        packet = func._overloadpacket.__name__
        inplace = packet.endswith("_")
        target = a.get("self") if inplace else None

        src = a.get("self")
        dtype = a.get("dtype") or (src.dtype if isinstance(src, torch.Tensor) else torch.get_default_dtype())
        device = a.get("device") or (src.device if isinstance(src, torch.Tensor) else torch.device("cpu"))
        size = a.get("size")
        shape = tuple(src.shape) if isinstance(src, torch.Tensor) else (tuple(size) if size is not None else None)
        value, scale = None, None  # float64 result and its error scale (approx draws)
        exact_out = None
        if name == "bernoulli":
            p = a.get("p", None)
            if p is None:
                p = a["self"]
            exact_out = randomness.bernoulli_mask(stream, shape, p, device).to(torch.float64)
        elif name in ("rand", "rand_like"):
            exact_out = randomness.uniform(stream, shape, device, bits=24 - self.grid.drop if dtype == torch.float32 else 53)
        elif name == "uniform":
            lo, hi = float(a.get("from", 0.0)), float(a.get("to", 1.0))
            exact_out = randomness.uniform(stream, shape, device) * (hi - lo) + lo
        elif name in ("randn", "randn_like", "normal"):
            z, zs = randomness.normal(stream, shape, device)
            mean, std = a.get("mean", 0.0), a.get("std", 1.0)
            if isinstance(mean, torch.Tensor) or isinstance(std, torch.Tensor):
                mean_t = mean.double() if isinstance(mean, torch.Tensor) else mean
                std_t = std.double() if isinstance(std, torch.Tensor) else std
                shape = torch.broadcast_shapes(getattr(mean, "shape", ()), getattr(std, "shape", ()))
                z, zs = randomness.normal(stream, shape, device)
                value = mean_t + std_t * z
                scale = _abs(mean_t) + _abs(std_t) * zs
                dtype = (mean if isinstance(mean, torch.Tensor) else std).dtype
            else:
                value = float(mean) + float(std) * z
                scale = abs(float(mean)) + abs(float(std)) * zs
        elif name == "exponential":
            value, scale = randomness.exponential(stream, shape, device, float(a.get("lambd", 1.0)))
        elif name == "log_normal":
            z, zs = randomness.normal(stream, shape, device)
            value = torch.exp(float(a.get("mean", 1.0)) + float(a.get("std", 2.0)) * z)
            scale = value.abs() * (4 + abs(float(a.get("mean", 1.0))) + abs(float(a.get("std", 2.0))) * zs)
        elif name == "cauchy":
            u = randomness.uniform(stream, shape, device)
            t = torch.tan(math.pi * (u - 0.5))
            value = float(a.get("median", 0.0)) + float(a.get("sigma", 1.0)) * t
            scale = value.abs() + abs(float(a.get("sigma", 1.0))) * (t.abs() + 1) * (1 + t * t)
        elif name == "random":
            lo = int(a.get("from", 0))
            hi = a.get("to")
            if hi is None:
                hi = 2 ** (24 - self.grid.drop) + 1 if dtype.is_floating_point else torch.iinfo(dtype).max
            exact_out = torch.from_numpy(stream.integers(math.prod(shape), lo, int(hi))).reshape(shape).to(device)
            exact_out = exact_out.to(torch.float64) if dtype.is_floating_point else exact_out.to(dtype)
        elif name in ("randint", "randint_like"):
            low, high = a.get("low", 0), a.get("high")
            if name == "randint":
                shape = tuple(a["size"])
                dtype = a.get("dtype") or torch.int64
                device = a.get("device") or torch.device("cpu")
            ints = torch.from_numpy(stream.integers(math.prod(shape), int(low), int(high))).reshape(shape).to(device)
            exact_out = ints.to(torch.float64) if dtype.is_floating_point else ints.to(dtype)
        elif name == "randperm":
            n = int(a["n"])
            dtype = a.get("dtype") or torch.int64
            device = a.get("device") or torch.device("cpu")
            exact_out = randomness.randperm(stream, n, device).to(dtype)
            shape = (n,)
        elif name == "multinomial":
            exact_out = randomness.multinomial(stream, a["self"], int(a["num_samples"]), bool(a.get("replacement", False)))
            dtype = torch.int64
            shape = tuple(exact_out.shape)
        else:
            raise UnsupportedOpError(f"step {self.step}: {func}: random op not implemented by veritrain")

        if not self.rounding:  # plain fp32 / fp64 runs: same draws, no grid
            out = (exact_out if exact_out is not None else value).to(dtype)
            if target is not None:
                target.copy_(out)
                return target
            return out

        if exact_out is not None and not exact_out.is_floating_point():
            self._finish_op(func, record, scalars, [])
            out = exact_out
        else:
            if exact_out is not None:
                slot = _ExactSlot(exact_out, self.grid)
            else:
                value = value.to(torch.float64)
                s = scale if isinstance(scale, torch.Tensor) else torch.tensor(float(scale), dtype=torch.float64)
                call = rules.Call(func, (), {}, [value])
                slot = _EagerSlot(value, _Analysis(call, rules.Rule(rules.APPROX, "random", lambda c, s=s: [s])), 0,
                                  self.grid)
            finals = self._finish_op(func, record, scalars, [slot])
            out = _to_model_dtype(finals[0], dtype) if dtype.is_floating_point else finals[0].to(dtype)
        if target is not None:
            target.copy_(out)
            return target
        return out

    def _lower_dropout(self, func, args, kwargs):
        """native_dropout (what F.dropout uses on GPUs) as the composite F.dropout runs on CPUs, so the
        op stream and the bits are the same on every device."""
        a = _named(func, args, kwargs)
        if rules.base_name(func) == "native_dropout":
            x, p, train = a["input"], float(a["p"]), a.get("train")
            if not train or p == 0:
                return x.clone(), torch.ones_like(x, dtype=torch.bool)
            noise = torch.empty_like(x)
            noise = self.__torch_dispatch__(aten.bernoulli_.float, (), (noise, 1 - p), {})
            noise = self.__torch_dispatch__(aten.div_.Scalar, (), (noise, 1 - p), {})
            out = self.__torch_dispatch__(aten.mul.Tensor, (), (x, noise), {})
            return out, noise != 0
        # the composite's backward is one multiplication by the saved noise, mask / (1 - p) rounded
        g, mask, scale = a["grad_output"], a["mask"], float(a["scale"])
        keep = float(np.float32(1.0 / scale))
        value = self.grid.round(torch.tensor([1.0 / keep], dtype=torch.float64)).to(g.dtype)
        noise = mask.to(g.dtype) * value.to(g.device)
        return self.__torch_dispatch__(aten.mul.Tensor, (), (g, noise), {})


# --- small helpers ------------------------------------------------------------------------------


def _scalar_entry(x: float):
    """For a finite Python float scalar: whether its float32 rounding goes away from zero, where it lies
    within SCALAR_THRESHOLD of a float32 midpoint (the trainer logs that decision); None elsewhere."""
    x32 = float(np.float32(x))
    if x32 == x:
        return None
    other = float(np.nextafter(np.float32(x32), np.float32(math.copysign(math.inf, x - x32))))
    mid = (x32 + other) / 2 if math.isfinite(other) else x32
    return abs(x32) > abs(x) if abs(x - mid) < SCALAR_THRESHOLD * abs(x) else None


def _device_error(step, func, leaves, e):
    """An UnsupportedOpError naming the op and the device when ``e`` says the op has no float64 kernel
    there (or mixes devices); None for any other failure."""
    if isinstance(e, VeritrainError):
        return None
    devices = sorted({str(x.device) for x in leaves if isinstance(x, torch.Tensor)}
                     | {str(x) for x in leaves if isinstance(x, torch.device)}) or ["cpu"]
    msg = str(e)
    words = ("backend", "not implemented", "device", *{d.split(":")[0] for d in devices})
    if not any(w in msg.lower() for w in words):
        return None
    return UnsupportedOpError(f"step {step}: {func} cannot run on {', '.join(devices)} in float64: "
                              f"{msg.strip().splitlines()[0][:300] if msg.strip() else type(e).__name__}")


def _on_meta(args) -> bool:
    for x in args:
        if isinstance(x, torch.Tensor):
            return x.is_meta
        if isinstance(x, (list, tuple)) and x and isinstance(x[0], torch.Tensor):
            return x[0].is_meta
    return False


def _abs(x):
    return x.abs() if isinstance(x, torch.Tensor) else abs(float(x))


def _as_list(x):
    if x is None:
        return []
    return list(x) if isinstance(x, (list, tuple)) else [x]


def _clone_floats(x):
    if isinstance(x, (list, tuple)):
        return [_clone_floats(t) for t in x]
    return x.clone() if _is_float_tensor(x) else x


def _from_named(func, named, n_positional):
    names = _info(func).names
    args = [named[n] for n in names[:n_positional]]
    kwargs = {n: named[n] for n in names[n_positional:] if n in named}
    return tuple(args), kwargs


def _flatten_result(res):
    if res is None:
        return []
    if isinstance(res, torch.Tensor):
        return [res]
    out = []
    for r in res:
        if isinstance(r, (list, tuple)):
            out.extend(r)
        else:
            out.append(r)
    return out


def _rebuild(res, flat):
    if res is None:
        return None
    if isinstance(res, torch.Tensor):
        return flat[0]
    it = iter(flat)
    out = []
    for r in res:
        if isinstance(r, (list, tuple)):
            out.append([next(it) for _ in r])
        else:
            out.append(next(it))
    return type(res)(out) if isinstance(res, tuple) else out


def _write_back(orig: torch.Tensor, y32: torch.Tensor):
    if orig.shape != y32.shape:
        orig.resize_(y32.shape)
    if y32.data_ptr() == orig.data_ptr() and y32.stride() == orig.stride() and y32.dtype == orig.dtype:
        return  # the kernel wrote the result in place (_fused_slot's ``into``)
    orig.copy_(y32)


def _write_back_all(origs, results):
    """``_write_back`` of a foreach op's results: the plain copies (most of them: an optimizer's small
    parameters, computed laid end to end) in one foreach call rather than a call each."""
    dst, src = [], []
    for orig, y32 in zip(origs, results):
        if orig.shape != y32.shape or orig.dtype != y32.dtype or y32.data_ptr() == orig.data_ptr():
            _write_back(orig, y32)
        else:
            dst.append(orig)
            src.append(y32)
    if dst:
        torch._foreach_copy_(dst, src)


def _packs(leaves) -> bool:
    """Whether a foreach op's small tensors are computed laid end to end (``_packed_groups``): on the CPU, unless
    ``VERITRAIN_COMPILE`` is 0 (the eager engine: every op as itself, a foreach op tensor by tensor)."""
    return hardware.setting("VERITRAIN_COMPILE", "auto") != "0" \
        and all(x.device.type == "cpu" for x in leaves if isinstance(x, torch.Tensor))


def _packed_groups(calls, large) -> list:
    """The small tensors' single-op calls of a foreach op that can run as one call on their operands laid end
    to end: every tensor operand of the shape of ``self`` (elementwise, nothing broadcast), the same other
    arguments (a ScalarList's values may differ: one group per value). Each tensor's result is then what its
    own call gives, element for element (an elementwise op; its error scale too), at the cost of one op, one
    scale, one rounding and one scan for all of them, where a tensor each cost more to dispatch than to run
    (an optimizer's biases and norm weights). Groups of two or more, in order."""
    groups = {}
    for i, call in enumerate(calls):
        shape = call["self"].shape
        if large[i] or any(isinstance(v, torch.Tensor) and v.shape != shape for v in call.values()):
            continue
        key = tuple((k, v.hex() if type(v) is float else v) for k, v in call.items() if not isinstance(v, torch.Tensor))
        try:
            groups.setdefault(key, []).append(i)
        except TypeError:  # an unhashable argument: left as it is
            continue
    return [g for g in groups.values() if len(g) > 1]


def _writes_apart(calls) -> bool:
    """Whether the ``self`` tensors of a foreach op's single-tensor calls share memory with no other tensor of
    any call (nor with each other)."""
    selves = [c["self"].untyped_storage().data_ptr() for c in calls]
    others = {v.untyped_storage().data_ptr() for c in calls for k, v in c.items()
              if k != "self" and isinstance(v, torch.Tensor)}
    return len(set(selves)) == len(selves) and not others.intersection(selves)


def _inplace_operand(plan, into: torch.Tensor):
    """The position among ``plan``'s tensor operands of the in-place op's ``self``, where it is ``into`` itself
    (contiguous float32, as every fused operand is) and overlaps no other operand; else None."""
    pos = next((v for name, _, kind, v in plan.layout if kind == "T" and name == "self"), None)
    if pos is None or plan.tensors[pos].data_ptr() != into.data_ptr() or not into.is_contiguous() \
            or tuple(into.shape) != tuple(plan.tensors[pos].shape):
        return None
    base = into.untyped_storage().data_ptr()
    if any(t.untyped_storage().data_ptr() == base for i, t in enumerate(plan.tensors) if i != pos):
        return None
    return pos


def _tensor_digest(t: torch.Tensor) -> bytes:
    import hashlib

    t = t.detach().contiguous().cpu()
    h = hashlib.sha256(str(t.dtype).encode() + str(tuple(t.shape)).encode())
    h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.digest()


# --- the step context ---------------------------------------------------------------------------


@contextlib.contextmanager
def step_context(config: EngineConfig, step: int, writer=None, reader=None, trace: OpTrace | None = None, probe=None,
                 check_trailing: bool = True, domain: str = "op"):
    """Run one training step under the engine. Yields the VerifiedMode (its ``stats`` after exit).

    ``trace`` collects per-operator digests (the verification game); ``check_trailing=False`` lets a
    replay of part of a step (the referee's single operator) leave the rest of the log unread.

    Also pins the device-dependent choices that would change the op stream between machines:
    scaled-dot-product attention uses its math backend and cudnn is off inside the step.
    """
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

    mode = VerifiedMode(config, step, writer=writer, reader=reader, domain=domain)
    mode.trace = trace
    mode.probe = probe

    def pre(opt, a, k):
        mode.in_optimizer = True

    def post(opt, a, k):
        mode.in_optimizer = False

    h1, h2 = register_optimizer_step_pre_hook(pre), register_optimizer_step_post_hook(post)
    try:
        with sdpa_kernel([SDPBackend.MATH]), torch.backends.cudnn.flags(enabled=False), hardware.pinned_settings(), \
                mode:
            yield mode
    finally:
        h1.remove()
        h2.remove()
    if reader is not None and check_trailing:
        trailing = reader.next_op()
        if trailing is not None:
            raise ReplayMismatchError(
                f"step {step}: the replay finished but the trainer's log has more ops (next: {trailing.name}); "
                f"the replay runs different code than the trainer did")


@contextlib.contextmanager
def logged_step(config: EngineConfig, step: int, writer: StepLogWriter | None = None,
                reader: StepLogReader | None = None, **options):
    """``step_context`` that also ends the step's log: the writer is closed when the step completes (its
    summary, ``StepLogWriter.close``'s dict, in ``mode.closed_log``) and aborted (its partial file removed)
    when the step raises; the reader is closed either way. Every trainer and replay step goes through it."""
    try:
        with step_context(config, step, writer=writer, reader=reader, **options) as mode:
            yield mode
        mode.closed_log = writer.close() if writer is not None else None
    except BaseException:
        if writer is not None:
            writer.abort()
        raise
    finally:
        if reader is not None:
            reader.close()


# --- operator traces (verification game, phase 3) -------------------------------------------------


class OpTrace:
    """Per-operator records of one step: op name, where it ran, the digest of its non-tensor arguments
    (``call_args_digest``), its random-op index, input and output digests, and the running hash ``chain``
    (``link``) that binds all but the inputs.

    ``sources`` labels digests known before the step (the batch's tensors, the state's tensors) so a
    disputed input can be traced to what produced it; ``capture = k`` keeps a copy of operator k's call
    (``captured``, in ``dump_call`` format) for the referee.
    """

    def __init__(self, capture: int | None = None):
        self.entries: list[dict] = []
        self.capture = capture
        self.captured: bytes | None = None
        self.sources: dict[str, str] = {}
        self.modules: list[str] = []

    @staticmethod
    def link(prev: str, entry: dict) -> str:
        """The running hash after ``entry``: the previous one, the op's name, the digest of its non-tensor
        arguments, its random-op index and its output digests. Bisection on it finds the first difference
        (monotone), and an entry can be checked against the hash it was answered with. (Input digests are
        not bound: an op's real inputs are earlier outputs, agreed state or data, and some ops take
        uninitialised memory that they overwrite, e.g. the mask tensor of ``bernoulli_``.)"""
        import hashlib

        fields = [prev, entry.get("op"), entry.get("args"), entry.get("random_index"), entry.get("outputs")]
        try:
            data = json.dumps(fields, separators=(",", ":"), allow_nan=False)
        except (TypeError, ValueError, RecursionError):
            return ""  # a malformed entry links to nothing
        return hashlib.sha256(data.encode()).hexdigest()

    def add_sources(self, tensors: dict, kind: str):
        for name, t in tensors.items():
            if isinstance(t, torch.Tensor):
                self.sources.setdefault(_tensor_digest(t).hex(), f"{kind}:{name}")

    def where(self, mode) -> str | None:
        if mode.in_optimizer:
            return "optimizer"
        node = torch._C._current_autograd_node()
        if node is not None:
            return f"backward:{node.name()}"
        return self.modules[-1] if self.modules else None


def _tensor_leaves(tree) -> list:
    return [x for x in tree_flatten(tree)[0] if isinstance(x, torch.Tensor)]


def _encode_arg(x, func, strict: bool = True):
    """A non-tensor argument of an op call as JSON (``dump_call``'s encoding)."""
    if isinstance(x, torch.dtype):
        return {"dtype": str(x).replace("torch.", "")}
    if isinstance(x, torch.device):
        return {"device": str(x)}
    if isinstance(x, (torch.memory_format, torch.layout)):
        return {type(x).__name__: str(x).replace("torch.", "")}
    if isinstance(x, float):
        return {"float": repr(float(x))}
    if x is None or isinstance(x, (bool, int, str)):
        return {"value": x}
    if strict:
        raise ValueError(f"cannot serialise an argument of type {type(x).__name__} of {func}")
    return {"other": type(x).__name__}


def _call_structure(x, func):
    if isinstance(x, torch.Tensor):
        return {"tensor": None}
    if isinstance(x, torch.device):
        return {"device": None}  # where it ran is not part of the computation (a GPU trainer, a CPU auditor)
    if isinstance(x, (list, tuple)):
        return [_call_structure(y, func) for y in x]
    if isinstance(x, dict):
        return {str(k): _call_structure(v, func) for k, v in x.items()}
    return _encode_arg(x, func, strict=False)


def call_args_digest(func, args, kwargs) -> str:
    """SHA-256 (hex) of an op call's non-tensor arguments and of where its tensors go: what an op trace
    binds beside its tensors' digests, so the verification game can tell two calls of one op apart
    (another step size, another dimension, another dtype)."""
    import hashlib

    data = json.dumps([str(func), _call_structure(list(args), func), _call_structure(dict(kwargs), func)],
                      sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(data.encode()).hexdigest()


def dump_call(func, args, kwargs, random_index: int) -> bytes:
    """An operator call as bytes: safetensors holding its tensor arguments, the rest as JSON metadata."""
    from safetensors.torch import save
    from torch.utils._pytree import treespec_dumps

    leaves, spec = tree_flatten((args, kwargs))
    tensors, encoded = {}, []
    for i, x in enumerate(leaves):
        if isinstance(x, torch.Tensor):
            tensors[f"t{i}"] = x.detach().cpu().contiguous().clone()
            encoded.append({"tensor": f"t{i}", "device": str(x.device)})
        else:
            encoded.append(_encode_arg(x, func))
    meta = {"func": str(func), "spec": treespec_dumps(spec), "leaves": json.dumps(encoded),
            "random_index": str(random_index)}
    return save(tensors, metadata=meta)


def load_call_tensors(data: bytes) -> list:
    """Only the tensor arguments (in call order) of ``dump_call`` bytes: what the verification game takes
    from the other side's payload. Nothing in it is resolved or imported (no op, no argument)."""
    from safetensors.torch import load

    tensors = load(bytes(data))
    n = int.from_bytes(data[:8], "little")
    meta = json.loads(data[8:8 + n]).get("__metadata__", {})
    leaves = json.loads(meta["leaves"])
    if not isinstance(leaves, list):
        raise ValueError("malformed call metadata")
    names = [e["tensor"] for e in leaves if isinstance(e, dict) and "tensor" in e]
    if sorted(names) != sorted(tensors) or len(set(names)) != len(names):
        raise ValueError("the call's tensors and its metadata disagree")
    return [tensors[name] for name in names]


def load_call(data: bytes):
    """(func, args, kwargs, random_index, tensor arguments in order) from ``dump_call`` bytes; each tensor on
    the device it was captured on (a call this side captured itself)."""
    from safetensors.torch import load
    from torch.utils._pytree import treespec_loads

    tensors = load(data)
    n = int.from_bytes(data[:8], "little")
    meta = json.loads(data[8:8 + n]).get("__metadata__", {})
    ns, name, overload = meta["func"].split(".")
    func = getattr(getattr(getattr(torch.ops, ns), name), overload)
    leaves, ordered = [], []
    for e in json.loads(meta["leaves"]):
        if "tensor" in e:
            t = tensors[e["tensor"]].to(e.get("device", "cpu"))
            leaves.append(t)
            ordered.append(t)
        elif "dtype" in e:
            leaves.append(getattr(torch, e["dtype"]))
        elif "device" in e:
            leaves.append(torch.device(e["device"]))
        elif "memory_format" in e:
            leaves.append(getattr(torch, e["memory_format"]))
        elif "layout" in e:
            leaves.append(getattr(torch, e["layout"]))
        elif "float" in e:
            leaves.append(float(e["float"]))
        else:
            leaves.append(e["value"])
    args, kwargs = tree_unflatten(leaves, treespec_loads(meta["spec"]))
    return func, tuple(args), dict(kwargs), int(meta["random_index"]), ordered
