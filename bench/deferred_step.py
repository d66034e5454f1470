"""The deferred route to one program per step, tried on the small models: the step's Python runs as it is, every
op it issues is checked against the first step's stream and handed back as an unfilled buffer, and the ops run
together, as one compiled program, where Python first reads a value (docs/SPEED.md, "Deferred, not skipped").

    python bench/deferred_step.py                                 # resnet (default size), digits-cnn
    python bench/deferred_step.py --workloads resnet --steps 6 --no-write

Runs, alternating in one process, on the task's plain float64 model (as bench/step_graph_bound.py):

* ``fp64``: the eager float64 step (the denominator);
* ``dispatch mode``: the same step under a dispatch mode that only calls each op it sees (bench/step_graph_bound.py's):
  what any route that keeps the step's Python under a dispatch mode pays before its own work, measured beside it;
* ``deferred``: the same step with its ops deferred and run, at each sync point, by the same eager aten calls in
  the same order: the deferral's mechanics; its weights must be ``fp64``'s, bit for bit, every step;
* ``deferred, rounded``: deferred, each segment run as one compiled program (traced by make_fx, then compiled by
  torch.compile) that computes what the engine computes: every result the engine rounds (its rule exact or
  approximate, as step_graph_bound.py picks it) rounded to float32 and back, every op's float scalars on float32,
  a decomposed op (BatchNorm, the softmaxes) as its decomposition's steps, each rounded. What an auditor's
  deferred step would cost where its log has no entry; its weights must lie on the float32 grid
  (tests/test_profile_bench.py holds them to a float32 copy trained under the engine's trainer, bit for bit);
* ``deferred, scanned``: the same programs with each approximate op's error scale (the engine's rule, traced) and
  near-midpoint test (rounding.stability_flag, as the compiled kernels run it), their candidates counted and
  read at each program's end: what a deferred trainer's step would cost before it classifies its candidates.

A cost measurement of the route, not a verified step: no classification of the candidates, log or entries; the
optimizer's in-place updates are rounded but not scanned; random ops, sync points and any op that differs from the
first step's stream run eagerly (rounded, not scanned) after the deferred ops before them. A segment seen before
is matched against its plan (``Plan``) as its ops come: each op's tensors checked by memory against the recorded
wiring, its constants by value, nothing else rebuilt; an op that differs ends the plan there. What the route
would still need is docs/SPEED.md's. Writes the "Deferred steps" section of bench/RESULTS.md unless --no-write.
``--native-composites --no-write``: the compiled runs with BatchNorm and the softmaxes as ATen's kernels (unrounded
inside), to see what the engine's decompositions cost in a program.
"""

from __future__ import annotations

import functools
import math
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import numpy as np  # noqa: E402
import torch  # noqa: E402
from torch.fx.experimental.proxy_tensor import make_fx  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

from profile_engine import workload_bench  # noqa: E402
from step_graph_bound import _PassThrough  # noqa: E402
from step_stream import SYNC_OPS, _name  # noqa: E402
from veritrain import decompositions, rules  # noqa: E402
from veritrain.capture import argument_source  # noqa: E402
from veritrain.engine import EngineConfig, _flatten_call, _named, _unflatten_call, rule_of  # noqa: E402
from veritrain.rounding import Grid, stability_flag  # noqa: E402
from veritrain.runner import _prepare_batch, _prepare_model  # noqa: E402
from veritrain.task import build  # noqa: E402

aten = torch.ops.aten
RUNS = ("fp64", "dispatch mode", "deferred", "deferred, rounded", "deferred, scanned")
THRESHOLDS = EngineConfig().thresholds


def _rule(func, args, kwargs):
    """``func``'s rule as the engine picks it (some rows choose by the arguments: an add with alpha 1 is exact)."""
    fixed = _fixed_rule(func)
    return fixed if fixed is not None else rule_of(func, args, kwargs)


def _rounds(func, args, kwargs) -> bool:
    """Whether the engine rounds ``func``'s float results (its rule exact or approximate)."""
    rule = _rule(func, args, kwargs)
    return rule is not rules.FALLBACK_RULE and rule.kind in (rules.EXACT, rules.APPROX)


def _addcdiv_by_tensors(self, t1, t2, scalars):
    """self + scalar * t1 / t2 per tensor, in ATen's order ((scalar * t1) / t2, then the sum), by ops that take the
    scalars as 0-d tensors (``_foreach_addcdiv_.Tensor`` wants its vector on the CPU, which a fake trace is not)."""
    quotients = aten._foreach_mul.List(t1, scalars)
    aten._foreach_div_.List(quotients, t2)
    return aten._foreach_add_.List(self, quotients)


def _div_by_tensors(self, scalars):
    return aten._foreach_div_.List(self, scalars)


# Ops whose float list changes every step (AdamW's step sizes and bias corrections: bench/step_stream.py), run with
# their floats as a program input: each float as a 0-d tensor (of a float64 vector the program takes), through the
# op's overload that takes tensors. torch.compile would specialize the floats (a compile a step); the others stay
# constants
_FLOATS_AS_INPUT = {aten._foreach_addcdiv_.ScalarList: _addcdiv_by_tensors,
                    aten._foreach_div_.ScalarList: _div_by_tensors}
_VARYING = object()  # a float of such an op in a segment's key: any float matches


def _float32_scalars(args, kwargs):
    """The call's float arguments rounded to float32, as the engine rounds an op's scalars (its near-midpoint ones
    logged: not here)."""
    leaves, spec = _flatten_call(args, kwargs)
    return _unflatten_call([float(np.float32(x)) if type(x) is float and math.isfinite(x) else x for x in leaves], spec)


NATIVE_COMPOSITES = False  # --native-composites: BatchNorm and the softmaxes as ATen's kernels, for comparison


def _decomposes(func, args, kwargs) -> bool:
    """Whether the engine computes ``func`` as its decomposition's steps (BatchNorm, the softmaxes: decompositions.py)."""
    return not NATIVE_COMPOSITES and _rule(func, args, kwargs).kind == rules.DECOMPOSE \
        and decompositions.lookup(func) is not None


class _Rounding(TorchDispatchMode):
    """Inside a program's trace: each op's float64 results rounded as the engine rounds them and, ``scanned``, each
    approximate op's near-midpoint test with its error scale counted in ``flags`` (a decomposition's steps)."""

    def __init__(self, scanned: bool):
        super().__init__()
        self.scanned, self.flags = scanned, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        rule = _rule(func, args, kwargs)
        if rule is rules.FALLBACK_RULE or rule.kind not in (rules.EXACT, rules.APPROX):
            return func(*args, **kwargs)
        args, kwargs = _float32_scalars(args, kwargs)
        out = func(*args, **kwargs)
        outs = list(_as_tuple(out))
        if self.scanned and rule.kind == rules.APPROX and not func._schema.is_mutable:
            for y, scale in zip(outs, _scaler(func, rule)(out, *args, **kwargs)):
                if isinstance(y, torch.Tensor) and y.dtype == torch.float64 and scale is not None:
                    self.flags.append(stability_flag(y, scale, THRESHOLDS[rule.op_class]).sum())
        for w in _written(func, args, kwargs):
            if w.dtype == torch.float64:
                w.copy_(_round(w))
        if func._schema.is_mutable:
            return out
        outs = [_round(o) if isinstance(o, torch.Tensor) and o.dtype == torch.float64 else o for o in outs]
        return type(out)(outs) if isinstance(out, (tuple, list)) else outs[0]


def _decomposed(func, scanned: bool):
    """``func`` computed as the engine computes it, for a program to trace: its decomposition's steps, each rounded
    (and, ``scanned``, tested); returns (its result, the count of its candidates: 0 where it does not scan)."""
    decomposition = decompositions.lookup(func)

    def run(*args, **kwargs):
        mode = _Rounding(scanned)
        with mode:
            out = decomposition(*args, **kwargs)
        return out, (torch.stack(mode.flags).sum() if mode.flags else torch.zeros((), dtype=torch.float32))
    run.scanned = scanned
    return run


def _scaler(func, rule):
    """A function of (the op's result, its arguments) giving each float64 output's error scale at full size, by the
    engine's rule (rules.scale_for), for a program to trace."""
    def scale(out, *args, **kwargs):
        outs = list(out) if isinstance(out, (tuple, list)) else [out]
        scales = []
        for y, s in zip(outs, rules.scale_for(rule, rules.Call(func, args, kwargs, outs))):
            scales.append(rules.materialize_scale(s, y) if isinstance(y, torch.Tensor) and s is not None else None)
        return scales
    return scale


@functools.lru_cache(maxsize=None)
def _fixed_rule(func):
    """``func``'s rule where it does not depend on the arguments (a row that is not a rules.Choose), else None."""
    return None if isinstance(rules.RULES.get(rules.base_name(func)), rules.Choose) else rules.lookup(func, None)


@functools.lru_cache(maxsize=None)
def _deferrable(func) -> bool:
    """Random ops run eagerly, in the stream's order."""
    return func.namespace == "aten" and _name(str(func)) not in SYNC_OPS \
        and torch.Tag.nondeterministic_seeded not in func.tags


@functools.lru_cache(maxsize=None)
def _aliases(func) -> tuple:
    """Per result of ``func``: "write" (the argument an in-place op writes), "view" (a view of an argument) or None."""
    return tuple(None if r.alias_info is None else "write" if r.alias_info.is_write else "view"
                 for r in func._schema.returns)


class Segment:
    """The deferred ops between two sync points as the source of one function, written as the ops come: its
    inputs are the tensors from before the segment (parameters, the batch, tensors of earlier segments), its other
    arguments constants, and at its end it fills the buffers handed back to Python that anything still holds
    (through ``.data``: autograd has saved some of them, and a write through the tensor itself would count as an
    in-place change of a saved value). Tensors are known by their
    memory (storage, offset, shape, strides, dtype), not as Python objects: autograd hands a saved result back
    as a new tensor object over the same memory. The segment holds the results' storages, not the tensors:
    autograd takes over a gradient that no other tensor holds (AccumulateGrad, its input buffers) and copies one
    that another does, so holding the tensors would change the stream it issues."""

    def __init__(self, start: int = 0):
        self.start = start  # the stream index of its first op
        self.inputs, self.ops, self.key, self.outs = [], [], [], []
        self.names = {}  # _memory(tensor) -> its name in the function
        self.floats = []  # per op of _FLOATS_AS_INPUT, its floats: the program's inputs q0, q1, ...
        self.buffers = []  # (storage, offset, shape, strides, dtype, name) of the results handed back

    def name_of(self, x) -> str:
        return self._leaf(x)[0]

    def _leaf(self, x):
        """A tensor's name and how it reads its memory (its part of the key); any other argument as itself."""
        if not isinstance(x, torch.Tensor):
            return x, x
        key = _memory(x)
        name = self.names.get(key)
        if name is None:
            name = self.names[key] = f"i{len(self.inputs)}"
            self.inputs.append(x)
        return name, (name,) + key[1:]

    def add(self, func, leaves, spec, args, kwargs, out, rounded: bool, scanned: bool = False):
        """Names the op's tensors and results; the function's source is written only for a stream not seen before
        (``program``): a step that repeats one pays for the names and the key alone."""
        j = len(self.key)
        named = [self._leaf(x) for x in leaves]
        rounds = rounded and _rounds(func, args, kwargs)
        if func in _FLOATS_AS_INPUT:  # its floats: the program's next input, a vector q{n}
            n, k = len(self.floats), 0
            self.add_floats(leaves, rounds)
            for i, x in enumerate(leaves):
                if type(x) is float:
                    named[i], k = (f"q{n}[{k}]", _VARYING), k + 1
        exprs = tuple(e for e, _ in named)
        decomposed = _decomposed(func, scanned) if rounded and _decomposes(func, args, kwargs) else None
        rule = _rule(func, args, kwargs) if scanned and rounds else None
        # the trainer's scan: each approximate op's new results (not an in-place op's: the optimizer's updates)
        scan = (_scaler(func, rule), THRESHOLDS[rule.op_class]) if rule is not None and rule.kind == rules.APPROX \
            and not func._schema.is_mutable else None
        written = tuple(self.name_of(t) for t in _written(func, args, kwargs) if t.dtype == torch.float64) \
            if rounds else ()
        results, outs = [], []
        aliases = _aliases(func) + (None,) * len(_as_tuple(out))
        for m, o in enumerate(_as_tuple(out)):
            if not isinstance(o, torch.Tensor) or aliases[m] == "write":
                continue  # nothing, or an in-place op's result: the tensor it wrote, named already
            value = f"r{j}" if not isinstance(out, (tuple, list)) else f"r{j}[{m}]"
            rounded_value = rounds and o.dtype == torch.float64 and aliases[m] is None
            name = f"v{j}_{m}" if rounded_value else value
            results.append((value, name if rounded_value else None, m))
            outs.append((m, name, aliases[m] is None))  # a view was taken of its buffer already
        if rounds:  # the engine computes the op with its scalars on float32 (a decomposition: each step's own)
            exprs = tuple(float(np.float32(e)) if type(e) is float and math.isfinite(e) else e for e in exprs)
        self.ops.append((func, exprs, spec, written, results, scan, decomposed))
        self.key.append((func, tuple(k for _, k in named)))
        self.outs.append(tuple(outs))
        self.handed_back(out, outs)

    def add_floats(self, leaves, rounds: bool):
        """Keeps an op's floats (on float32 where the engine rounds them) as the program's next input."""
        self.floats.append([float(np.float32(x)) if rounds else x for x in leaves if type(x) is float])

    def handed_back(self, out, outs):
        """Names an op's results by their memory, and holds the storage of each that is a new buffer."""
        out = _as_tuple(out)
        for m, name, buffered in outs:
            o = out[m]
            self.names[_memory(o)] = name
            if buffered:
                self.buffers.append((o.untyped_storage(), o.storage_offset(), tuple(o.shape), tuple(o.stride()),
                                     o.dtype, name))

    def held(self):
        """[(buffer, its name)] for the results handed back that anything still holds: the program fills those at
        its end, after every in-place op. A result whose storage only this segment holds is read by nothing after
        it: not filled."""
        return [(torch.empty(0, dtype=dtype).set_(st, offset, shape, stride), name)
                for st, offset, shape, stride, dtype, name in self.buffers if torch._C._storage_Use_Count(st._cdata) > 1]

    def source(self, held):
        """(the program's source, its environment). The program returns its candidates' count (a scanned segment's:
        each approximate result's near-midpoint test with its error scale, as the engine's kernels run it), or None."""
        env, lines, flags = {"ROUND": _round, "FLAG": stability_flag, "torch": torch}, [], []
        for j, (func, exprs, spec, written, results, scan, decomposed) in enumerate(self.ops):
            env[f"F{j}"] = func
            args = []
            for k, e in enumerate(exprs):
                if isinstance(e, str):
                    args.append(e)
                else:
                    env[f"L{j}_{k}"] = e
                    args.append(f"L{j}_{k}")
            if decomposed is not None:  # its steps rounded (and tested) as the engine's
                env[f"D{j}"] = decomposed
                lines.append(f"    r{j}, d{j} = D{j}({argument_source(spec, args)})")
                if decomposed.scanned:
                    flags.append(f"d{j}")
            else:
                if func in _FLOATS_AS_INPUT:
                    env[f"F{j}"] = _FLOATS_AS_INPUT[func]
                lines.append(f"    r{j} = F{j}({argument_source(spec, args)})")
            if scan is not None:
                env[f"SCALE{j}"], c = scan
                lines.append(f"    s{j} = SCALE{j}(r{j}, {argument_source(spec, args)})")
                for value, name, m in results:
                    if name is not None:
                        lines.append(f"    f{j}_{m} = FLAG({value}, s{j}[{m}], {c!r}).sum()")
                        flags.append(f"f{j}_{m}")
            lines += [f"    {w}.copy_(ROUND({w}))" for w in written]
            lines += [f"    {name} = ROUND({value})" for value, name, _ in results if name is not None]
        params = [f"i{k}" for k in range(len(self.inputs))] + [f"b{k}" for k in range(len(held))] + \
            [f"q{k}" for k in range(len(self.floats))]
        tensors = self.inputs + [b for b, _ in held]
        # a 0-d float64 tensor comes in as a one-element view (_program_arguments), taken back to 0-d here
        lines[:0] = [f"    {p} = {p}.view(())" for p, t in zip(params, tensors) if _scalar64(t)]
        tail = [f"    b{k}.copy_({name})" for k, (_, name) in enumerate(held)]
        count = f"torch.stack([{', '.join(flags)}]).sum()" if flags else "None"
        return "\n".join([f"def program({', '.join(params)}):"] + lines + tail + [f"    return {count}"]), env


def _scalar64(t) -> bool:
    return t.dim() == 0 and t.dtype == torch.float64


def _program_arguments(seg: Segment, held) -> list:
    """The tensors a segment's program takes (its inputs, then the buffers it fills), as their ``.data``: a 0-d
    float64 one as a one-element view. torch.compile (2.13, AOT autograd: inductor and aot_eager alike) drops an
    in-place write to a 0-d float64 input (float32 and other dtypes are written), and the program writes some (the
    loss's buffer)."""
    return [x.data.view(1) if _scalar64(x) else x.data for x in seg.inputs + [b for b, _ in held]] + \
        [torch.tensor(f, dtype=torch.float64) for f in seg.floats]


class Plan:
    """A segment seen before, as a later step must repeat it to run its program: per op, the function, the key its
    tensors (by name and view) and constants must match, and the results it hands back. Following it, an op costs
    its check and its buffers, nothing rebuilt (no rule looked up, no source, no key of the whole segment hashed);
    its programs are found by the names of the buffers still held at its end."""

    def __init__(self, seg: Segment):
        self.ops, self.key, self.outs = seg.ops, seg.key, seg.outs
        self.programs = {}


_MISMATCH = object()


def _memory(x):
    """What a tensor is to a segment: where its memory starts and how it reads it (two tensors alike in all four
    read the same values; the segment holds every storage it names, so no address is reused meanwhile)."""
    return x.data_ptr(), x.shape, x.stride(), x.dtype


def _round(y):
    return y.to(torch.float32).to(torch.float64)


class Deferring(TorchDispatchMode):
    """Records the first step's stream; in later steps hands back each matching op's buffers unfilled and runs the
    deferred ops at each sync point (``compiled``: one program per segment, compiled; otherwise the same aten
    calls, eagerly). A segment that ran a program is kept as a ``Plan``, which the next step's segment from the
    same stream index follows while its ops match."""

    def __init__(self, compiled: bool, rounded: bool, scanned: bool = False):
        super().__init__()
        self.compiled, self.rounded, self.scanned = compiled, rounded, scanned
        self.candidates = 0  # a scanned run's, all steps
        self.stream = None  # the first step's (func, output metadata, floats) per op
        self.programs = {}  # (the segment's key, the names of the buffers it fills) -> its program
        self.plans = {}  # stream index of a segment's first op -> Plan
        self.plan = None  # the plan the current segment follows
        self.step_ops = []
        self.segment = Segment()
        self.eager_ops = 0  # after the first step: ops run eagerly (sync points, random ops, changed floats)
        self.eager_funcs = set()  # which, in the step now or last run
        self.deferred_ops = 0
        self.followed_ops = 0  # of those, the ops checked against a plan
        self.program_s = self.own_s = 0.0  # seconds in the programs (their compiles too), in the mode's own work

    def start_step(self):
        self.step_ops, self.segment, self.plan, self.index = [], Segment(), None, 0
        self.eager_funcs = set()
        self.diverged = self.stream is None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        t0, before = time.perf_counter(), self.program_s
        try:
            return self._dispatch(func, args, kwargs or {})
        finally:  # the mode's own time: its bookkeeping and the ops it runs eagerly, not the programs it calls
            self.own_s += time.perf_counter() - t0 - (self.program_s - before)

    def _dispatch(self, func, args, kwargs):
        if not self.diverged and (self.index >= len(self.stream) or self.stream[self.index][0] is not func):
            self.diverged = True  # the rest of this step runs eagerly; its stream is the next step's recording
        if func.namespace == "profiler":  # record_function's markers (zero_grad, optimizer.step): no values read
            out = func(*args, **kwargs)
            self.step_ops.append((func, None, ()))
            self.index += 1
            return out
        if self.plan is None and not self.segment.key and not self.diverged:
            self.plan, self.plan_pos, self.segment.start = self.plans.get(self.index), 0, self.index
        if self.plan is not None:
            out = _MISMATCH if self.diverged else self._follow(func, args, kwargs)
            if out is not _MISMATCH:
                return out
            self._leave_plan()  # the ops that matched are the segment; this one goes the general way
        leaves, spec = _flatten_call(args, kwargs)
        floats = tuple(x for x in leaves if type(x) is float)
        # an op whose float arguments changed since the last step runs eagerly: a program takes its floats as
        # constants (torch.compile specializes an aten op's scalar arguments: each step would compile again), except
        # the ops of _FLOATS_AS_INPUT (AdamW's step sizes), which take theirs as a program input
        if self.diverged or not _deferrable(func) or spec[0] != "call" or \
                (floats != self.stream[self.index][2] and func not in _FLOATS_AS_INPUT):
            self.flush()
            out = self._eager(func, args, kwargs)
            self.step_ops.append((func, _meta(out), floats))
            self.index += 1
            if self.stream is not None:
                self.eager_ops += 1
                self.eager_funcs.add(func)
            return out
        if not self.segment.key:
            self.segment.start = self.index
        out, _ = self._hand_back(func, args, kwargs, self.stream[self.index][1])
        self.step_ops.append(self.stream[self.index])
        self.index += 1
        self.deferred_ops += 1
        self.segment.add(func, leaves, spec, args, kwargs, out, self.rounded, self.scanned)
        return out

    def _follow(self, func, args, kwargs):
        """The op's results, handed back unfilled, where it is the plan's next op with the same tensors (by the names
        their memory has in this segment, and their views) and constants; else _MISMATCH, with nothing changed."""
        plan, k = self.plan, self.plan_pos
        if k >= len(plan.key):
            return _MISMATCH
        planned, want = plan.key[k]
        if func is not planned:
            return _MISMATCH
        leaves, spec = _flatten_call(args, kwargs)
        if len(leaves) != len(want) or spec != plan.ops[k][2]:
            return _MISMATCH
        seg = self.segment
        names, new = seg.names, {}
        for x, w in zip(leaves, want):
            if w is _VARYING:
                if type(x) is not float:
                    return _MISMATCH
            elif isinstance(x, torch.Tensor):
                m = _memory(x)
                name = names.get(m)
                if name is None:  # a tensor from before the segment: the program's next input
                    name, _ = new.get(m) or new.setdefault(m, (f"i{len(seg.inputs) + len(new)}", x))
                if w != (name,) + m[1:]:
                    return _MISMATCH
            elif type(x) is not type(w) or x != w:
                return _MISMATCH
        for m, (name, x) in new.items():
            names[m] = name
            seg.inputs.append(x)
        if func in _FLOATS_AS_INPUT:
            seg.add_floats(leaves, self.rounded and _rounds(func, args, kwargs))
        out, _ = self._hand_back(func, args, kwargs, self.stream[self.index][1])
        seg.handed_back(out, plan.outs[k])
        self.step_ops.append(self.stream[self.index])
        self.index += 1
        self.plan_pos += 1
        self.deferred_ops += 1
        self.followed_ops += 1
        return out

    def _leave_plan(self):
        """The plan's ops matched so far become the segment's own."""
        plan, k, seg = self.plan, self.plan_pos, self.segment
        self.plan = None
        seg.ops, seg.key, seg.outs = (plan.ops, plan.key, plan.outs) if k == len(plan.key) else \
            (plan.ops[:k], plan.key[:k], plan.outs[:k])

    def _hand_back(self, func, args, kwargs, meta):
        """(the op's result, its outputs as a list): new buffers as the stream's metadata says, unfilled; an
        in-place op's argument; a view taken now of the buffer it views."""
        outs = []
        aliases = _aliases(func)
        for m, md in enumerate(meta):
            if md is None:
                outs.append(None)
            elif m < len(aliases) and aliases[m] is not None:
                outs.append(_alias(func, m, args, kwargs))
            else:
                shape, stride, dtype = md
                outs.append(torch.empty_strided(shape, stride, dtype=dtype))
        return (None if not aliases else outs[0] if len(aliases) == 1 and len(outs) == 1 else tuple(outs)), outs

    def _eager(self, func, args, kwargs):
        """``func`` run now; in a rounded run, as the engine computes it: its scalars on float32, its results rounded
        (in place where the op wrote its argument), a decomposed op as its steps, each rounded."""
        if self.rounded and _decomposes(func, args, kwargs):
            return _decomposed(func, scanned=False)(*args, **kwargs)[0]
        rounds = self.rounded and _rounds(func, args, kwargs)
        out = func(*_float32_scalars(args, kwargs)[0], **_float32_scalars(args, kwargs)[1]) if rounds else \
            func(*args, **kwargs)
        if rounds:
            for o in list(_as_tuple(out)) + _written(func, args, kwargs):
                if isinstance(o, torch.Tensor) and o.dtype == torch.float64:
                    o.data.copy_(_round(o.data))
        return out

    def end_step(self):
        self.flush()
        if self.diverged:  # the first step, or one whose stream differed (the optimizer's first step makes its state)
            self.stream = self.step_ops
        self.step_ops = None

    def flush(self):
        """Runs the deferred ops: the plan's program where the segment followed its plan to the end; otherwise the
        segment's own (compiled the first time its key is seen), kept as the plan for its stream index."""
        plan, seg = self.plan, self.segment
        if plan is not None:
            self._leave_plan()
            if len(seg.key) < len(plan.key):
                plan = None
        if not seg.key:
            return
        self.segment = Segment()
        held = seg.held()
        filled = tuple(name for _, name in held)
        program = plan.programs.get(filled) if plan is not None else None
        if program is None:
            key = (tuple(seg.key), filled)
            program = self.programs.get(key)
            if program is None:
                source, env = seg.source(held)
                ns = dict(env)
                exec(compile(source, f"<deferred segment {len(self.programs)}>", "exec"), ns)
                program = ns["program"]
                if self.compiled:  # the rules' and decompositions' Python traced to aten ops first (on fake
                    # tensors: a rule that read a value would fail here), then compiled: torch.compile's own tracer
                    # follows neither the rules nor a dispatch mode
                    program = make_fx(program, tracing_mode="fake")(*_program_arguments(seg, held))
                    program = torch.compile(program, dynamic=False, fullgraph=True)
                self.programs[key] = program
            if plan is None:
                plan = self.plans[seg.start] = Plan(seg)
            plan.programs[filled] = program
        t0 = time.perf_counter()
        with torch.no_grad():
            count = program(*_program_arguments(seg, held))
        if count is not None:  # read here, as a trainer would (its candidates classified after the program)
            self.candidates += int(count)
        self.program_s += time.perf_counter() - t0


def _as_tuple(x):
    return x if isinstance(x, (tuple, list)) else (x,)


def _meta(out):
    return [(tuple(o.shape), tuple(o.stride()), o.dtype) if isinstance(o, torch.Tensor) else None
            for o in _as_tuple(out)]


def _written(func, args, kwargs) -> list:
    """The tensors ``func`` writes in place (its arguments marked as written in its schema)."""
    if not func._schema.is_mutable:
        return []
    named = _named(func, args, kwargs)
    out = []
    for a in func._schema.arguments:
        if a.alias_info is not None and a.alias_info.is_write:
            v = named.get(a.name)
            out += list(v) if isinstance(v, (list, tuple)) else [v]
    return [t for t in out if isinstance(t, torch.Tensor)]


def _alias(func, m, args, kwargs):
    """The tensor an aliasing result is: the argument an in-place op writes, or a view taken now (it reads no
    values) of the buffer it views."""
    alias = func._schema.returns[m].alias_info
    if alias.is_write:
        named = _named(func, args, kwargs)
        for a in func._schema.arguments:
            if a.alias_info is not None and a.alias_info.before_set == alias.before_set:
                return named[a.name]
    return func(*args, **kwargs)


def measure(task_ref: str, config: dict, steps: int, progress=print) -> dict:
    grid = Grid(32)
    modes = {"deferred": Deferring(False, False), "deferred, rounded": Deferring(True, True),
             "deferred, scanned": Deferring(True, True, scanned=True)}
    compiled = [name for name, m in modes.items() if m.compiled]
    tasks = {}
    for name in RUNS:
        task = build(task_ref, config)
        _prepare_model(task, "fp64", grid)
        tasks[name] = task
    times = {r: [] for r in RUNS}
    # a compiled run's step: in its programs, in the mode's own work
    split = {name: {"programs": [], "mode": []} for name in compiled}
    warm = 3  # the first step records the stream, the second compiles the programs
    for step in range(steps + warm):
        order = RUNS[step % len(RUNS):] + RUNS[:step % len(RUNS)]
        for name in order:
            batch = _prepare_batch(tasks[name].batch(step), "fp64", grid)
            mode = modes.get(name)
            marks = (mode.program_s, mode.own_s) if mode is not None else None
            torch.manual_seed(step)  # dropout's masks from torch's generator: the same in every run of a step
            t0 = time.perf_counter()
            if mode is None and name == "dispatch mode":
                with _PassThrough():
                    tasks[name].run_step(batch)
            elif mode is None:
                tasks[name].run_step(batch)
            else:
                mode.start_step()
                with mode:
                    tasks[name].run_step(batch)
                mode.end_step()
            elapsed = time.perf_counter() - t0
            if step >= warm:
                times[name].append(elapsed)
                if name in split:
                    split[name]["programs"].append(mode.program_s - marks[0])
                    split[name]["mode"].append(mode.own_s - marks[1])
        plain = [p for p in tasks["fp64"].model.parameters()]
        for name in ("dispatch mode", "deferred"):
            if any(not torch.equal(a, b) for a, b in zip(plain, tasks[name].model.parameters())):
                raise RuntimeError(f"step {step}: the {name} step's weights differ from the eager step's")
        for name in compiled:
            off = [n for n, p in tasks[name].model.named_parameters() if not bool((p == p.float().double()).all())]
            if off:
                raise RuntimeError(f"step {step}: the {name} step's weights are off the float32 grid: {off[:4]}")
        if step >= warm and progress:
            progress("  step %d: %s" % (step, ", ".join(f"{r} {times[r][-1] * 1000:.1f} ms" for r in RUNS)))
    fp64 = times["fp64"]
    return {"median_ms": {r: statistics.median(t) * 1000 for r, t in times.items()},
            "over_fp64": {r: statistics.median(t / f for t, f in zip(times[r], fp64)) for r in RUNS},
            "split": {name: {k: statistics.median(t / f for t, f in zip(v, fp64)) for k, v in parts.items()}
                      for name, parts in split.items()},
            "eager_ops": {name: m.eager_ops for name, m in modes.items()},
            "programs": {name: len(modes[name].programs) for name in compiled},
            "followed": {name: m.followed_ops / max(m.deferred_ops, 1) for name, m in modes.items()},
            "candidates": modes["deferred, scanned"].candidates / (steps + warm - 2)}


def markdown(results: dict, descriptions: dict, command: str, machine: str) -> str:
    lines = ["## Deferred steps (issue 12: the route to one program per step, tried)", "", f"Command: `{command}`",
             "", f"Machine: {machine}", "",
             "Written by `bench/deferred_step.py` (its docstring defines each run). Each step index ran every run "
             "once, in rotated order, in one process; ratios are medians of same-step ratios to the eager plain "
             "float64 step. `dispatch mode` and `deferred` gave the eager step's weights bit for bit in every step; "
             "the compiled runs gave weights on the float32 grid in every step.", "",
             "| workload | fp64 (eager) | " + " | ".join(RUNS[1:]) + " |", "| --- " * len(RUNS) + "| --- |"]
    for name, r in results.items():
        o = r["over_fp64"]
        lines.append(f"| {name} | 1.00x ({r['median_ms']['fp64']:.3g} ms) | "
                     + " | ".join(f"{o[run]:.2f}x" for run in RUNS[1:]) + " |")
    lines += ["", "The compiled runs' steps split (medians, in plain float64 steps): the time in their compiled "
              "programs (a scanned run's reads of its candidate counts included), and the dispatch mode's own time "
              "(its bookkeeping per op and the ops it runs eagerly); the rest is the step's Python, autograd and the "
              "optimizer. `followed`: the share of the deferred ops (all steps) checked against a plan, a segment seen "
              "before. `candidates`: the scanned run's flagged results a step, which a trainer would classify.", "",
              "| workload | run | step | in its programs | in the mode's own work | programs | ops run eagerly "
              "(all steps) | followed | candidates a step |", "| --- " * 9 + "|"]
    for name, r in results.items():
        for run, split in r["split"].items():
            cands = f"{r['candidates']:.0f}" if "scanned" in run else ""
            lines.append(f"| {name} | {run} | {r['over_fp64'][run]:.2f}x | {split['programs']:.2f} | "
                         f"{split['mode']:.2f} | {r['programs'][run]} | {r['eager_ops'][run]} | "
                         f"{r['followed'][run]:.0%} | {cands} |")
    lines += ["", "Workloads: " + "; ".join(f"{k}: {v}" for k, v in descriptions.items()) + ".", ""]
    return "\n".join(lines)


def main(argv=None):
    global NATIVE_COMPOSITES
    import argparse

    from veritrain import hardware

    ap = argparse.ArgumentParser(add_help=False)
    ap.add_argument("--native-composites", action="store_true", help="the compiled runs' BatchNorm and softmaxes as "
                    "ATen's kernels, not the engine's decompositions: what those cost in a program, by difference")
    known, rest = ap.parse_known_args(argv)
    NATIVE_COMPOSITES = known.native_composites
    if NATIVE_COMPOSITES and "--no-write" not in rest:
        ap.error("--native-composites is a comparison run, not the section: add --no-write")
    os.environ["VERITRAIN_COMPILE"] = "0"  # the rules' helpers as eager ops (as bench/step_graph_bound.py)
    hardware.apply_process_settings()
    workload_bench("deferred_step.py", __doc__.splitlines()[0], "resnet,digits", 8, measure, markdown,
                   argv if argv is not None else rest)


if __name__ == "__main__":
    main()
