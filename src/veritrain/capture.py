"""Captured composites: a decomposed operator recorded once as the engine runs it, then replayed as one
function while its signature (the shapes, strides and dtypes of its tensors, its other arguments) stays the
same.

Why: decompositions.py computes BatchNorm, LayerNorm and the softmaxes as their steps, each step rounded,
so that their full-size steps are exact and never logged. That is about twenty engine ops per BatchNorm
call, forward or backward, each paying the dispatch mode's per-op work and its own passes over memory;
on small models that per-op work, not float64 arithmetic, is most of a verified step (docs/SPEED.md).

How: the first call with a signature runs under the engine as before and is recorded: every op the engine
handled, which earlier tensors fed it, and the log record it wrote (name, scalar entries, output shapes).
Each op is then lowered to what the engine computes for it (``LOWERINGS``): a view or copy as itself, an
exact op as its float32 kernel (at b = 32 the same bits as float64 rounded, ROUNDING.md), an approximate
op in float64 with its error scale, rounded to the grid, with the near-midpoint test (the auditor's
function has no scale or test: it does not scan). The whole sequence is one generated function. Later calls
with that signature run it and write the same records, in the same order, as the eager ops would: compiled
by ``torch.compile`` where the region is large (``enabled_for``) or, in the trainer, hot (``_hot``);
otherwise as Python, its ops eager aten calls without the engine's per-op work around each, which costs
nothing to compile and does most of what compiling gains on small regions (docs/SPEED.md). Either is an
evaluation of each approximate op in float64, as the eager engine's is.

It replays only where the eager engine would log nothing in the region; otherwise the decomposition runs
step by step under the engine, exactly as without capture (``fallback``):

* the trainer's function finds a candidate (a result near a rounding midpoint) in any of the region's
  approximate ops: the eager engine classifies and logs it. (Its float64 result, compiled or eager, is another
  correct evaluation of the op, as for the fused kernels: where it finds no candidate, no machine within the
  error model rounds any result differently, so no entry is needed; fused.py. That holds for the CPU's
  compiled code; on CUDA it did not, and capture runs on CPUs only: hardware.compiled_path, ``replays_on``.)
* the auditor's log has an entry, a scalar entry other than the one an honest trainer writes, or a record
  that differs from the template for any of the region's ops: the eager engine applies and checks them
  (and names any problem, as it always does).
* anything the lowering does not cover (random ops, writes other than a copy into an argument, float64
  operands, other grids than float32, a tensor from outside the call): that signature stays eager.

A row-local region (the softmaxes along the last dimension, forward and backward: ``ROW_LOCAL``), compiled,
narrows the first two to rows (``_replay_rows``): its trainer's function flags candidates by rows, and the
auditor finds the rows its records' entries lie in; where those are at most a quarter of the rows, only they
run step by step under the engine, which logs, applies and checks there as always, and replace theirs in the
function's result. A language model's log-softmax over its vocabulary has entries in a few of its rows in
most steps; it ran step by step whole before.

The trainer writes a replayed region's records as one byte string and the auditor matches them as one
(logformat.QuietRun): the records of ~20 ops cost a dict lookup and a comparison, not ~20 encodings or parses.
Bytes other than the honest ones are parsed record by record and compared with the templates, as above.

A signature whose recorded calls needed log entries (unless it is row-local), or whose replays keep falling
back, stays eager. ``enabled_for`` says where
capture runs; tests/test_capture.py holds it to the eager engine.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import itertools
import math
import threading

import numpy as np
import torch

from . import decompositions, hardware, rules
from .fused import KEEP_ROUNDINGS, FusedKernels, _round_to_grid, define
from .hardware import compiled_path
from .logformat import OpRecord, OutputEntries, QuietRun
from .rounding import any_candidate as _any_candidate, kernel_flag

aten = torch.ops.aten
MIN_TRIES = 4  # replays before a region's fallback share is judged
MAX_FALLBACK_SHARE = 0.5  # beyond it, the region stays eager from then on
# decompositions whose every value in a row (along the last dimension) depends on that row alone: a replay
# with a candidate runs only the candidates' rows step by step (``_replay_rows``)
ROW_LOCAL = frozenset({aten._softmax.default, aten._log_softmax.default, aten._softmax_backward_data.default,
                       aten._log_softmax_backward_data.default})
MAX_ROW_SHARE = 0.25  # more rows than this with a candidate: the whole call runs step by step
_ATOMIC = (bool, int, float, str, type(None), torch.dtype, torch.device, torch.memory_format, torch.layout)


class Uncapturable(Exception):
    """The recorded stream holds something the lowering does not cover."""


class _Template:
    """What the eager engine writes to the log for one op: its name, scalar entries and output shapes, and
    what its statistics count."""

    __slots__ = ("label", "scalars", "shapes", "entries", "rounded", "analysed")

    def __init__(self, label, scalars, shapes, rounded, analysed):
        self.label, self.scalars, self.shapes = label, scalars, shapes
        self.entries = [OutputEntries(s) for s in shapes]
        self.rounded, self.analysed = rounded, analysed


class Region:
    """One signature's recorded stream, lowered and compiled."""

    _ids = itertools.count()

    def __init__(self, n_inputs, lines, env, templates, results, mutations, want_cand, rows=None):
        self.n_inputs, self.templates, self.results, self.mutations = n_inputs, templates, results, mutations
        self.rows = rows  # (rows, row length) of a row-local region (ROW_LOCAL), else None
        self.quiet = QuietRun((t.label, t.scalars, t.shapes, t.rounded) for t in templates)  # their log records
        self.analysed = sum(t.analysed for t in templates)
        self.want_cand = want_cand
        self.source = "\n".join(lines)
        self._env = env
        self._python = self._fn = None
        self.replays = 0
        self.row_replays = 0  # of the replays, those that ran the rows with a candidate step by step
        self.fallbacks = 0
        self.broken = False

    def program(self, compiled: bool):
        """The region's function: compiled by torch.compile, or (``compiled`` False) its source run as Python,
        each op an eager aten call in float64 (another correct evaluation of the approximate ops, as the
        compiled one is; the exact ops' float32 kernels give the same bits either way)."""
        if not compiled:
            if self._python is None:
                self._python = self.function(for_python=True)
            return self._python
        if self._fn is None:
            self._fn = torch.compile(self.function(for_python=False), dynamic=False, fullgraph=True,
                                     options=KEEP_ROUNDINGS)
        return self._fn

    def function(self, for_python: bool):
        """The generated function, uncompiled, with the helpers for running it as Python (the eager engine's
        NumPy candidate test) or for torch.compile (the kernels' stability_flag)."""
        env = dict(self._env)
        python = env.pop("PYTHON")
        if for_python:
            env.update(python)
        define(self.source, f"<veritrain captured region {next(self._ids)}>", env)
        return env["program"]

    def run(self, tensors, compiled: bool = True):
        """(the call's results, the new values of the arguments it writes, the trainer's candidate flag)."""
        with torch.no_grad():
            return self.program(compiled)(*tensors)

    @property
    def compiled(self) -> bool:
        """Whether its function has been compiled (a region replays as Python until it is large or hot)."""
        return self._fn is not None

    @property
    def worn_out(self) -> bool:
        tries = self.replays + self.fallbacks
        return self.broken or tries >= MIN_TRIES and self.fallbacks > MAX_FALLBACK_SHARE * tries


def _any_flag(flags):
    """Whether any of the compiled function's flags (stability_flag's float32 1 / 0) marks a candidate. Each flag
    is reduced along its last dimension first: a reduction over the rows the op that computes the flag runs
    through, which inductor fuses into that op's loop. Reduced whole at once, a flag was a loop of its own, and
    inductor stored the op's float64 result to read it there: in GPT-2's log-softmax backward, the exp of
    512 x 50257 log-probabilities, 206 MB written and read again each step (`python bench/bench_regions.py`)."""
    parts = [(f.flatten(0, -2).amax(-1) if f.dim() >= 2 else f.reshape(-1)).amax() > 0 for f in flags if f.numel()]
    return torch.stack(parts).any() if parts else torch.zeros((), dtype=torch.bool)


def _row_flags(flags, rows: int):
    """For a row-local region (ROW_LOCAL): whether each of its ``rows`` rows holds a candidate of any of the
    compiled function's flags, as a bool vector. Each flag is reduced along its row, which inductor fuses into
    the loop that computes it, as in ``_any_flag``."""
    parts = [f.reshape(rows, -1).amax(-1) for f in flags if f.numel()]
    return torch.stack(parts).amax(0) > 0 if parts else torch.zeros(rows, dtype=torch.bool)


_EAGER = object()  # a signature that is not captured
# signature -> Region, _EAGER, or the number of its recorded calls that had log entries (recorded again)
_CACHE: dict = {}
NOISY_CALLS = 3  # recorded calls with log entries after which a signature stays eager
_LOCK = threading.Lock()


def applies(mode) -> bool:
    """Capture runs for verified steps on the float32 grid, without the emulated accelerator, calibration
    probes or the verification game's per-op traces (those want every op under the eager engine)."""
    return mode.grid.drop == 0 and mode.emulate is None and mode.probe is None and mode.trace is None


def enabled_for(numel: int, device) -> bool:
    """Whether a region replays compiled: ``VERITRAIN_COMPILE`` as for the fused kernels (1 always, 0 never);
    by default, regions whose largest tensor has at least ``VERITRAIN_CAPTURE_MIN_NUMEL`` elements (65536, as
    the fused kernels), and smaller ones once their signature is hot (``_hot``). CPU only
    (hardware.compiled_path)."""
    return compiled_path(numel, device, "VERITRAIN_CAPTURE_MIN_NUMEL", 1 << 16)


HOT_CALLS = 5000  # default of VERITRAIN_CAPTURE_HOT_CALLS
_CALLS: dict = {}  # signature of a region below the size threshold -> its calls so far


def _hot(key) -> bool:
    """Whether a small region's signature has been called ``VERITRAIN_CAPTURE_HOT_CALLS`` times (5000; 0
    never), after which the trainer or auditor compiles it. Compiling the default ResNet's small regions cost its
    trainer 12.7 s with a cold compile cache and 1.2 s with a warm one (bench/RESULTS.md, session 21). Run as
    Python, with a sum's certificate computed only where it can change the test (``_certified_flag_lazily``),
    they take about 5 ms of its step and compiled 2-3 ms (`python bench/bench_regions.py`, session 25; about
    12 ms as Python before that change): a cold compile pays for itself about 5000 steps later, a warm one
    about 500. An auditor's small regions, without scales or tests, took 3.7 ms of its step as Python and about
    1.2 ms compiled, run alone (`python bench/bench_regions.py --workloads resnet`, session 39). Short runs (and
    the test suite) never pay for a compile; long runs get the gain."""
    n = _CALLS[key] = _CALLS.get(key, 0) + 1
    hot = int(hardware.setting("VERITRAIN_CAPTURE_HOT_CALLS", HOT_CALLS))
    return 0 < hot <= n


def run(mode, func, args, kwargs):
    """``func``'s decomposition under ``mode``: replayed from its capture where one applies; otherwise run
    step by step by the engine (and recorded, the first time its signature is seen)."""
    from .engine import _flatten_call

    leaves, spec = _flatten_call(args, kwargs)
    tensors = [x for x in leaves if isinstance(x, torch.Tensor)]
    devices = {t.device for t in tensors if t.device.type != "cpu"} or {torch.device("cpu")}
    if len(devices) > 1:
        return fallback(mode, func, args, kwargs)
    device = devices.pop()
    key = _signature(mode, func, leaves, spec, tensors)
    if key is None or not replays_on(device):
        return fallback(mode, func, args, kwargs)
    # large, or hot: the compiled function; otherwise its source run as Python (nothing to compile). An
    # auditor's small regions hold no scale or test, but compiled they still take about a third of their time
    # as Python (the default ResNet's BatchNorm regions, python bench/bench_regions.py, session 39)
    compiled = enabled_for(max((t.numel() for t in tensors), default=0), device) \
        or (_hot(key) and enabled_for(1 << 62, device))
    region = _CACHE.get(key, _EAGER)
    if key not in _CACHE or isinstance(region, int):
        return _record(mode, func, args, kwargs, key, tensors)
    if region is _EAGER or region.worn_out:
        return fallback(mode, func, args, kwargs)
    return _replay(mode, func, args, kwargs, region, tensors, compiled)


def replays_on(device) -> bool:
    """Whether regions are captured and replayed on ``device`` at all: on a CPU (as every compiled path,
    hardware.compiled_path) unless ``VERITRAIN_COMPILE`` is 0."""
    return device.type == "cpu" and hardware.setting("VERITRAIN_COMPILE", "auto") != "0"


def fallback(mode, func, args, kwargs):
    with mode:  # every step of the decomposition goes through the engine again
        return decompositions.lookup(func)(*args, **kwargs)


def _signature(mode, func, leaves, spec, tensors):
    """A hashable key that fixes everything the decomposition's Python reads (shapes, flags, scalars) and
    everything the compiled function depends on; None where the call cannot be captured."""
    if spec[0] != "call":
        return None
    parts = [func, spec[1], spec[2], tuple(spec[3]), mode.writer is not None, tuple(sorted(mode.config.thresholds.items()))]
    first = {}
    for x in leaves:
        if isinstance(x, torch.Tensor):
            parts.append((x.dtype, tuple(x.shape), x.stride(), x.storage_offset(), x.device,
                          first.setdefault(id(x), len(first))))
        elif isinstance(x, float):
            parts.append(("float", x.hex()))
        elif isinstance(x, _ATOMIC):
            parts.append((type(x).__name__, x))
        else:
            return None
    # distinct tensors that share memory (one a view of another) would be read and written as if apart
    storages = {}
    for t in tensors:
        ptr = t.untyped_storage().data_ptr() if t.numel() else None
        if ptr is not None and storages.setdefault(ptr, id(t)) != id(t):
            return None
    return tuple(parts)


# --- recording ------------------------------------------------------------------------------------------


class Recorder:
    """Collects the ops the engine handles while one call of a decomposition runs (engine.VerifiedMode
    calls ``add`` after each)."""

    def __init__(self, mode, tensors):
        self.mode = mode
        self.inputs = list(tensors)  # kept alive, so their ids stay theirs
        self.refs = {id(t): f"i{k}" for k, t in enumerate(tensors)}
        self.keep = []
        self.ops = []  # (func, rule, leaves, spec, outputs, logged)
        self.problem = None
        self.records = []  # what the trainer's writer received, to check the templates against

    def add(self, func, args, kwargs, out, logged):
        from .engine import _flatten_call, _flatten_result

        if self.problem is not None:
            return
        leaves, spec = _flatten_call(args, kwargs)
        outs = _flatten_result(out)
        self.keep.append(outs)
        self.ops.append((func, leaves, spec, outs, logged))


def _record(mode, func, args, kwargs, key, tensors):
    rec = Recorder(mode, tensors)
    writer = mode.writer
    if writer is not None:
        write = writer.op

        def op(name, scalars, outputs, rounded):
            rec.records.append((name, [(int(p), bool(b)) for p, b in scalars], [tuple(o.shape) for o in outputs],
                                rounded))
            return write(name, scalars, outputs, rounded)

        def quiet_ops(run):  # a region replayed inside this call: its records one by one, as the eager engine's
            for name, scalars, shapes, rounded in run.records:
                op(name, scalars, [OutputEntries(shape) for shape in shapes], rounded)

        writer.op, writer.quiet_ops = op, quiet_ops
    entries = _entries(mode.stats)
    mode.recorder = rec
    try:
        out = fallback(mode, func, args, kwargs)
    finally:
        mode.recorder = None
        if writer is not None:
            del writer.op, writer.quiet_ops
    rows = _rows(func, args, kwargs, tensors)
    noisy = _entries(mode.stats) > entries
    try:
        region = None if noisy and rows is None else _lower(mode, rec, out, rows)
    except Uncapturable:
        region = _EAGER
    if noisy and (region is None or region is not _EAGER and region.rows is None):
        # a call that needed log entries: its replay would fall back; capture a later, quiet call instead (a
        # row-local region replays with them: _replay_rows)
        calls = _CACHE.get(key, 0) + 1
        region = calls if calls < NOISY_CALLS else _EAGER
    with _LOCK:
        _CACHE[key] = region
    return out


def _rows(func, args, kwargs, tensors):
    """(rows, row length) where ``func`` is row-local (ROW_LOCAL) along the last dimension of its tensors, all
    of one shape and contiguous, with at least two rows; otherwise None."""
    from .engine import _named

    if func not in ROW_LOCAL or not tensors:
        return None
    shape = tuple(tensors[0].shape)
    if not shape or any(tuple(t.shape) != shape or not t.is_contiguous() for t in tensors):
        return None
    dim = _named(func, args, kwargs).get("dim")
    if not isinstance(dim, int) or dim % len(shape) != len(shape) - 1:
        return None
    n = shape[-1]
    rows = math.prod(shape[:-1])
    return (rows, n) if n and rows >= 2 else None


def _entries(stats) -> int:
    """Tensor entries the step has written or read so far."""
    return sum(stats.entries_dir.values()) + sum(stats.entries_val.values())


# --- lowering -------------------------------------------------------------------------------------------


def _lower(mode, rec: Recorder, out, rows=None) -> Region:
    """The recorded stream as the source of one function ``program(i0, i1, ...)`` returning the call's
    results, the new values of the arguments it wrote, and (trainer) whether any result is a candidate: for a
    row-local region (``rows``: its rows and their length), compiled, in which rows."""
    from .engine import _flatten_result, _info, _named, _scalar_entry

    grid = mode.grid
    refs = dict(rec.refs)
    flag, python_flag = kernel_flag(grid), functools.partial(_any_candidate, grid=grid)
    env = {"torch": torch, "ROUND": _round_to_grid, "FLAG": flag, "ANY": _any_flag,
           "SUMFLAG": functools.partial(_certified_flag, flag),
           # run as Python: the eager engine's own bulk test, in NumPy (rounding.any_candidate), one bool an op
           "ROWS": _row_flags,
           "PYTHON": {"FLAG": python_flag, "ANY": any, "ROWS": lambda flags, rows: any(flags),
                      "SUMFLAG": functools.partial(_certified_flag_lazily, python_flag)}}
    lines = [f"def program({', '.join(f'i{k}' for k in range(len(rec.inputs)))}):"]
    templates, cands, mutations, written = [], [], [], set()
    want = mode.writer is not None
    round_args = f"{grid.drop}, {grid.cell_bits}, {grid.half}, {grid.low_mask}, {grid.min_spacing!r}"

    for j, (func, leaves, spec, outs, logged) in enumerate(rec.ops):
        if spec[0] != "call":
            raise Uncapturable(f"{func}: nested arguments")
        names = []
        for x in leaves:
            if isinstance(x, torch.Tensor):
                r = refs.get(id(x))
                if r is None:
                    raise Uncapturable(f"{func}: a tensor from outside the call")
                if r in written:
                    raise Uncapturable(f"{func}: reads an argument the region wrote")
                names.append(r)
            else:
                names.append(None)
        named = _named(func, *_unflatten(leaves, spec))
        rule = rules.lookup(func, named if isinstance(rules.RULES.get(rules.base_name(func)), rules.Choose) else None)
        info = _info(func)
        float_out = [o for o in outs if isinstance(o, torch.Tensor) and o.is_floating_point()]
        results = [f"v{j}_{m}" for m in range(len(outs))]

        if rule.kind == rules.PASSTHROUGH or (logged == 0 and rule.kind in (rules.EXACT, rules.APPROX)):
            if logged:
                raise Uncapturable(f"{func}: logged")
            if func is aten.copy_.default and names[0] in rec.refs.values() and names[1] is not None:
                mutations.append((int(names[0][1:]), names[1]))  # the argument's new value, applied after
                written.add(names[0])
                refs[id(outs[0])] = names[1]
                continue
            if func._schema.is_mutable:
                raise Uncapturable(f"{func}: writes its arguments")
            call = _render(func, leaves, spec, names, env, j, upcast=False)
            lines.append(f"    {_targets(results)} = {call}")
        elif rule.kind in (rules.EXACT, rules.APPROX):
            if logged != 1 or info.variant != "plain" or named.get("dtype") is not None:
                raise Uncapturable(f"{func}: not a plain op")
            if any(isinstance(x, torch.Tensor) and x.is_floating_point() and x.dtype != torch.float32 for x in leaves) \
                    or any(o.dtype != torch.float32 for o in float_out) or len(float_out) != len(outs):
                raise Uncapturable(f"{func}: operands or results other than float32")
            scalars = []
            rounded = list(leaves)
            for i, x in enumerate(leaves):
                if type(x) is float and math.isfinite(x):
                    away = _scalar_entry(x)
                    if away is not None:
                        scalars.append((i, away))
                    rounded[i] = float(np.float32(x))
            n = sum(o.numel() for o in outs)
            templates.append(_Template(info.label, scalars, [tuple(o.shape) for o in outs], n,
                                       n if rule.kind == rules.APPROX else 0))
            if rule.kind == rules.EXACT:  # the float32 kernel: the same bits at b = 32 (ROUNDING.md)
                lines.append(f"    {_targets(results)} = {_render(func, rounded, spec, names, env, j, upcast=False)}")
            else:
                if len(outs) != 1:
                    raise Uncapturable(f"{func}: several outputs")
                c = float(mode.config.thresholds[rule.op_class])
                approx, certified = _lower_approx(func, rule, rounded, spec, names, env, j, want)
                lines += approx
                lines.append(f"    {results[0]} = ROUND(y{j}, {round_args})")
                if want:
                    lines.append(f"    c{j} = SUMFLAG(y{j}, s{j}, a{j}, t{j}, {certified}, {c!r})" if certified
                                 else f"    c{j} = FLAG(y{j}, s{j}, {c!r})")
                    cands.append(f"c{j}")
        else:
            raise Uncapturable(f"{func}: {rule.kind} op")
        for m, o in enumerate(outs):
            if isinstance(o, torch.Tensor):
                refs.setdefault(id(o), results[m])

    result_names = []
    for o in _flatten_result(out):
        if o is None:
            result_names.append(None)
        elif isinstance(o, torch.Tensor) and id(o) in refs:
            result_names.append(refs[id(o)])
        else:
            raise Uncapturable("a result the region did not compute")
    got = [r for r in result_names if r is not None and not r.startswith("i")]
    muts = [r for _, r in mutations]
    if rows is not None and (len(got) != 1 or muts or any(
            s[:-1] != tuple(rec.inputs[0].shape[:-1]) or s[-1] not in (rows[1], 1) for t in templates for s in t.shapes)):
        rows = None  # not one result, or an op's result not laid out by the input's rows
    flag = "None" if not cands else f"ROWS([{', '.join(cands)}], {rows[0]})" if rows else f"ANY([{', '.join(cands)}])"
    lines.append(f"    return ({', '.join(got)}{',' if got else ''}), ({', '.join(muts)}{',' if muts else ''}), {flag}")

    if want:  # the templates must be what the eager engine wrote (entries aside)
        seen = [(t.label, t.scalars, t.shapes, t.rounded) for t in templates]
        if seen != rec.records:
            raise Uncapturable("the templates differ from the records written")
    structure = (type(out), [r is not None for r in result_names]) if isinstance(out, (tuple, list)) else None
    return Region(len(rec.inputs), lines, env, templates, (structure, result_names),
                  [k for k, _ in mutations], want, rows)


def _lower_approx(func, rule, leaves, spec, names, env, j, scaled: bool):
    """(source lines, certificate) computing ``y{j}`` (the float64 result) and, where ``scaled`` (the trainer's
    near-midpoint test needs it; the auditor's replay does not), ``s{j}`` (its error scale), as the eager engine
    defines them (rules.py): sums and means as fused.FusedSums computes them, elementwise ops by their shared
    scale function. A sum's exactness certificate is not in the lines: ``certificate`` holds its dimensions and
    keepdim, for the test (``SUMFLAG``) to apply it to ``s{j}``; None where it has none."""
    from .engine import _named

    named = _named(func, *_unflatten(leaves, spec))
    if func in (aten.sum.dim_IntList, aten.mean.dim):
        x = named["self"]
        if not x.dim() or not x.numel():
            raise Uncapturable(f"{func}: a 0-d or empty operand")
        xn = names[[i for i, v in enumerate(leaves) if v is x][0]]
        dims = sorted(set(rules._dims(x, named.get("dim"))))
        keep = bool(named.get("keepdim"))
        n = rules._count(x, dims)
        mean = func is aten.mean.dim
        out = [f"    x{j} = {xn}.to(torch.float64)",
               f"    y{j} = x{j}.sum({dims!r}, keepdim={keep})"]
        if mean:
            out.append(f"    y{j} = y{j} / {float(n)!r}")
        if not scaled:
            return out, None
        out += [f"    a{j} = x{j}.abs()",
                f"    t{j} = a{j}.sum({dims!r}, keepdim={keep})",
                f"    s{j} = {rules._sqrt(n)!r} * t{j}" + (f" / {float(max(n, 1))!r}" if mean else "")]
        # the exactness certificate (rules._reduction_sum, fused.FusedSums), applied by the test (SUMFLAG)
        return out, ((dims, keep) if not mean or n & (n - 1) == 0 else None)
    if rule.fused is None:
        raise Uncapturable(f"{func}: no scale the compiled function can compute")
    env[f"SCALE{j}"] = rule.fused
    tensor_args, kw = [], {}
    for a in func._schema.arguments:
        v = named.get(a.name)
        if isinstance(v, torch.Tensor):
            tensor_args.append(names[[i for i, x in enumerate(leaves) if x is v][0]] + ".to(torch.float64)")
        elif isinstance(v, (list, tuple)) and any(isinstance(t, torch.Tensor) for t in v):
            raise Uncapturable(f"{func}: a tensor list")
        else:
            kw[a.name] = v
    env[f"KW{j}"] = kw
    out = [f"    y{j} = {_render(func, leaves, spec, names, env, j, upcast=True)}"]
    if scaled:
        out.append(f"    s{j} = SCALE{j}(y{j}, ({', '.join(tensor_args)}{',' if tensor_args else ''}), KW{j})")
    return out, None


def _certified_scale(a, t, s, dims, keep):
    """A sum's scale ``s`` with its exactness certificate (rules._reduction_sum): 0 where the sum ``t`` of the
    summands' magnitudes ``a`` stays below 2**52 times the quantum of the smallest nonzero one, so that the
    float64 sum is exact in any order."""
    return torch.where(t < rules._EXACT_LIMIT * rules._min_quantum(a, dims, keep), 0.0, s)


def _certified_flag(flag, y, s, a, t, certificate, c):
    """The near-midpoint test of a sum with its certified scale (a compiled region: one kernel computes both)."""
    return flag(y, _certified_scale(a, t, s, *certificate), c)


def _certified_flag_lazily(flag, y, s, a, t, certificate, c):
    """The same answer for a region run as Python, the certificate computed only where it can change it: the
    certified scale is 0 or ``s`` at each position, and the test only flags more positions as the scale grows
    (candidate_mask: the distance to the midpoint against c times the scale), so where ``s`` itself flags
    none the certified scale flags none. So it is in most calls (the default ResNet's trainer, 20 steps: 57 of
    830 sums needed the certificate), which costs a masked minimum over the summed dimensions and four more
    passes: about half of a small BatchNorm region's cost as Python (`python bench/bench_regions.py`)."""
    return flag(y, s, c) and flag(y, _certified_scale(a, t, s, *certificate), c)


def _render(func, leaves, spec, names, env, j, upcast):
    """The source of one call ``F{j}(...)``: tensors by name (float ones upcast to float64 when asked), the
    other arguments as constants in ``env``."""
    env[f"F{j}"] = func
    exprs = []
    for i, x in enumerate(leaves):
        if names[i] is not None:
            exprs.append(f"{names[i]}.to(torch.float64)" if upcast and x.is_floating_point() else names[i])
        else:
            env[f"K{j}_{i}"] = x
            exprs.append(f"K{j}_{i}")
    return f"F{j}({argument_source(spec, exprs)})"


def argument_source(spec, exprs) -> str:
    """The argument list of an op call, as source: engine._flatten_call's ``spec`` ("call" form) with an expression
    for each leaf."""
    _, n_args, keys, shape = spec
    values, i = [], 0
    for entry in shape:
        if entry is None:
            values.append(exprs[i])
            i += 1
        else:
            kind, n = entry
            inner = ", ".join(exprs[i:i + n])
            values.append(f"[{inner}]" if kind is list else f"({inner}{',' if n == 1 else ''})")
            i += n
    return ", ".join(values[:n_args] + [f"{k}={v}" for k, v in zip(keys, values[n_args:])])


def _targets(results):
    return results[0] if len(results) == 1 else "(" + ", ".join(results) + (",)" if len(results) == 1 else ")")


def _unflatten(leaves, spec):
    from .engine import _unflatten_call

    return _unflatten_call(list(leaves), spec)


# --- replay ---------------------------------------------------------------------------------------------


def _replay(mode, func, args, kwargs, region: Region, tensors, compiled: bool):
    reader, writer = mode.reader, mode.writer
    read, entry_rows = [], None
    if reader is not None:
        if reader.skip_quiet(region.quiet):  # the honest bytes: they parse to the templates
            read = None
        else:
            for t in region.templates:
                rec = reader.next_op()
                if rec is not None:
                    read.append(rec)
                if rec is None or rec.name != t.label or [tuple(o.shape) for o in rec.outputs] != t.shapes \
                        or [(int(p), bool(b)) for p, b in rec.scalars] != t.scalars:
                    reader.unread(read)  # the eager engine reads them again, and applies and checks what they say
                    region.fallbacks += 1
                    return fallback(mode, func, args, kwargs)
            if any(o.n_entries for r in read for o in r.outputs):
                # entries: the rows that hold them run step by step (a compiled row-local region, few such
                # rows; as Python, the function costs about what it saves), or the whole call does
                entry_rows = _rows_with_entries(region, read) if region.rows is not None and compiled else None
                if entry_rows is None or len(entry_rows) > MAX_ROW_SHARE * region.rows[0]:
                    reader.unread(read)
                    region.fallbacks += 1
                    return fallback(mode, func, args, kwargs)
    try:
        results, new_values, flag = region.run(tensors, compiled)
    except Exception as exc:  # compile or run failure: eager from now on, same results
        region.broken = True
        FusedKernels.warn_once(func, exc)
        if reader is not None:  # the records consumed, as the eager engine will read them
            reader.unread(read if read is not None else
                          [OpRecord(t.label, list(t.scalars), list(t.entries)) for t in region.templates])
        return fallback(mode, func, args, kwargs)
    if entry_rows is not None:  # the auditor's rows with entries
        if _replay_rows(mode, func, args, kwargs, region, results[0], torch.from_numpy(entry_rows), read):
            region.replays += 1
            region.row_replays += 1
            return _results(region, tensors, results, new_values)
        reader.unread(read)
        region.fallbacks += 1
        return fallback(mode, func, args, kwargs)
    if flag is not None and bool(flag.any() if isinstance(flag, torch.Tensor) else flag):  # a candidate
        # the eager engine classifies and logs it: in the rows that hold one (a compiled row-local region's
        # flags are by rows, few such rows), or in the whole call
        if isinstance(flag, torch.Tensor) and flag.dim() and flag.sum() <= MAX_ROW_SHARE * region.rows[0] \
                and _replay_rows(mode, func, args, kwargs, region, results[0], flag.nonzero().squeeze(1)):
            region.replays += 1
            region.row_replays += 1
            return _results(region, tensors, results, new_values)
        region.fallbacks += 1
        return fallback(mode, func, args, kwargs)
    region.replays += 1
    stats, quiet = mode.stats, region.quiet  # what the eager engine counts for these ops, all at once
    mode.op_index += len(quiet.records)
    stats.ops += len(quiet.records)
    stats.rounded[mode._phase()] += quiet.rounded
    if writer is not None or reader is not None:
        stats.entries_scalar += quiet.n_scalar
    if writer is not None:
        stats.analysed += region.analysed
        writer.quiet_ops(quiet)
    return _results(region, tensors, results, new_values)


def _results(region, tensors, results, new_values):
    """What the call returns, from the function's results; the arguments it writes written."""
    for k, value in zip(region.mutations, new_values):
        tensors[k].copy_(value)
    structure, names = region.results
    it = iter(results)
    values = [None if n is None else tensors[int(n[1:])] if n.startswith("i") else next(it) for n in names]
    if structure is None:
        return values[0]
    kind, _ = structure
    return kind(values)


def _rows_with_entries(region: Region, records) -> np.ndarray:
    """The rows (ascending) in which the auditor's ``records`` for a row-local region have entries. Every
    record's shapes are the templates' (checked), and the reader holds each position inside its output."""
    found = [np.concatenate([o.dir_pos, o.val_pos]) // shape[-1]
             for r, t in zip(records, region.templates) for o, shape in zip(r.outputs, t.shapes) if o.n_entries]
    return np.unique(np.concatenate(found))


def _replay_rows(mode, func, args, kwargs, region: Region, result, picked, records=None) -> bool:
    """A row-local region (ROW_LOCAL) with something to log or check in a few of its rows (``picked``, ascending):
    those rows alone run step by step under the eager engine, and replace theirs in the function's ``result``.

    Trainer (``records`` None; the rows in which its function found candidates): the eager engine classifies
    and logs their candidates, and the region's records are written with those entries at their positions in
    the whole call. Auditor (``records``: the region's records, read from the log, with their entries in these
    rows): the eager engine applies and checks each entry, reading the records with the entries at their
    positions in the rows' part (and names a suspicious entry by its position in the whole call).

    The other rows keep the function's values. Each row's values depend on that row alone, and in a row
    without a candidate no machine within the error model rounds any value differently (as in a region
    without any); a row without entries is one an honest trainer found no candidate in, and the auditor's own
    rounding is what the eager engine would apply there too. Where the rows' stream is not the region's (never
    seen), nothing is written and the statistics are as before: False sends the whole call step by step."""
    n_rows, n = region.rows
    k = len(picked)
    if not result.is_contiguous():
        return False

    def rows_of(x):
        if isinstance(x, torch.Tensor):
            return x.reshape(n_rows, n).index_select(0, picked).reshape((k,) + (1,) * (x.dim() - 2) + (n,))
        return x

    def part(shape):  # an output's shape in the rows' run
        return (k,) + (1,) * (len(shape) - 2) + (shape[-1],)

    sub_args, sub_kwargs = [rows_of(x) for x in args], {key: rows_of(v) for key, v in kwargs.items()}
    templates, at = region.templates, picked.numpy()
    phase, op_index = mode._phase(), mode.op_index
    before = copy.deepcopy(mode.stats)  # what the rows' run counts is undone, or corrected to the whole call's

    def restore():
        mode.stats, mode.op_index = before, op_index

    written = []
    if records is None:
        writer = mode.writer
        writer.op = lambda name, scalars, outputs, rounded: written.append((name, scalars, outputs))
        try:
            sub = fallback(mode, func, sub_args, sub_kwargs)
        finally:
            del writer.op
        if len(written) != len(templates) or any(
                name != t.label or [(int(p), bool(b)) for p, b in scalars] != t.scalars
                or [tuple(o.shape) for o in outputs] != [part(s) for s in t.shapes]
                for t, (name, scalars, outputs) in zip(templates, written)):
            restore()
            return False
        for t, (_, scalars, outputs) in zip(templates, written):
            writer.op(t.label, scalars, [_in_rows(o, shape, at) for o, shape in zip(outputs, t.shapes)], t.rounded)
        mode.stats.analysed = before.analysed + region.analysed
    else:
        from .engine import ReplayMismatchError

        reader = mode.reader
        mode.reader = _RowRecords([OpRecord(r.name, r.scalars, [_to_rows(o, part(shape), at)
                                                               for o, shape in zip(r.outputs, t.shapes)])
                                   for r, t in zip(records, templates)])
        try:
            sub = fallback(mode, func, sub_args, sub_kwargs)
            done = mode.reader.done
        except ReplayMismatchError:
            done = False
        finally:
            mode.reader = reader
        if not done or mode.op_index != op_index + len(templates):
            restore()
            return False
        suspicious = mode.stats.suspicious
        for j, x in enumerate(suspicious[len(before.suspicious):], start=len(before.suspicious)):
            t = x.op_index - op_index - 1  # its position in the whole call
            if 0 <= t < len(templates) and x.slot < len(templates[t].shapes):
                suspicious[j] = dataclasses.replace(
                    x, position=int(_in_rows_positions(np.array([x.position]), templates[t].shapes[x.slot], at)[0]))
    # the sizes the eager engine counts for the whole call; the entries and ops were counted by the rows' run
    mode.stats.rounded[phase] = before.rounded[phase] + region.quiet.rounded
    result.view(n_rows, n)[picked] = sub.reshape(k, n)
    return True


class _RowRecords:
    """The log records a row-local region's rows read in the auditor's ``_replay_rows``, in order."""

    def __init__(self, records):
        self._records = list(reversed(records))

    def next_op(self):
        return self._records.pop() if self._records else None

    def skip_quiet(self, run) -> bool:
        return False

    def unread(self, records):
        self._records.extend(reversed(records))

    @property
    def done(self) -> bool:
        return not self._records


def _in_rows_positions(pos, shape, rows: np.ndarray):
    """Positions in the picked ``rows``' part of an output -> positions in the whole output of ``shape``."""
    width = shape[-1]
    return rows[pos // width] * width + pos % width


def _in_rows(entries: OutputEntries, shape, rows: np.ndarray) -> OutputEntries:
    """The entries of the picked ``rows``' part of an output, at their positions in the whole output of
    ``shape`` (the rows are ascending, so the positions stay so)."""
    return OutputEntries(tuple(shape), _in_rows_positions(entries.dir_pos, shape, rows), entries.dir_bits,
                         _in_rows_positions(entries.val_pos, shape, rows), entries.val_bits)


def _to_rows(entries: OutputEntries, part_shape, rows: np.ndarray) -> OutputEntries:
    """The inverse of ``_in_rows``: entries of a whole output, all in the picked ``rows``, at their positions in
    the rows' part (of ``part_shape``)."""
    width = part_shape[-1]

    def place(pos):
        return np.searchsorted(rows, pos // width) * width + pos % width

    return OutputEntries(tuple(part_shape), place(entries.dir_pos), entries.dir_bits, place(entries.val_pos),
                         entries.val_bits)
