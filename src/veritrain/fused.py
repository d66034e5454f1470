"""Fused kernels for elementwise operators: float32 in, float64 inside, float32 and candidates out.

Computing an elementwise op in float64 with eager torch ops costs an upcast per input, the op, the error
scale, the near-midpoint test and the rounding: about ten passes over memory, against one for the op.
Here the same computation is generated as one small Python function per (op, argument structure) and
compiled with torch.compile (C++/OpenMP; on CPUs only, hardware.compiled_path: on a GPU under torch 2.11 two
captured regions did not conform, KEEP_ROUNDINGS below), so it reads each float32 input once and writes the
float32 result and a candidate mask.

The compiled kernel is just another correct float64 implementation of the op (its libm and operation
order may differ from ATen's, within the op's threshold). For the few candidates the trainer recomputes
the op eagerly from the same Python function and uses those values both for the log entry and for the
rounded result, so its output is always consistent with its log. The auditor does the same for the
positions its log names. Anything the kernel cannot handle falls back to the eager engine.
"""

from __future__ import annotations

import itertools
import linecache
import math
import os
import platform
import threading
import warnings

import torch

from .hardware import compiled_path
from .rounding import FLOAT32_MIN_NORMAL, Grid, kernel_flag

aten = torch.ops.aten


# the target the C++ compiler gets for the vector ISA that ATEN_CPU_CAPABILITY asks for: the code of a real
# machine with that ISA, not -march=native with narrower vectors
ISA_TARGETS = {"avx2": "x86-64-v3"}


def isolate_compile_cache() -> str:
    """Give compiled kernels a cache of their own per vector ISA, and the compiler target of that ISA.

    torch.compile's CPU code generator picks its vector ISA from ATEN_CPU_CAPABILITY, but its on-disk
    cache does not tell ISAs apart: a process that loads kernels cached by a process with another
    setting can compute garbage or corrupt memory (seen here). And it still compiles for -march=native:
    on an AVX-512 machine, AVX2 code so compiled (GCC 12, torch 2.13) returned float64 values unchanged
    through a rounding to float32 and back, which a real AVX2 machine's code rounds (seen here: a captured
    softmax's sum of rounded values took the unrounded ones, and audits under isa-avx2 failed). So an
    ISA named there compiles for that ISA's own target (ISA_TARGETS). Called before anything is compiled."""
    from torch._inductor import config
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    base = os.environ.get("VERITRAIN_COMPILE_CACHE") or default_cache_dir()
    isa = os.environ.get("ATEN_CPU_CAPABILITY") or "auto"
    path = os.path.join(base, f"veritrain-torch{torch.__version__}-isa-{isa}")
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = path
    if isa in ISA_TARGETS and platform.machine() in ("x86_64", "AMD64") and config.cpp.march is None:
        config.cpp.march = ISA_TARGETS[isa]
    return path


isolate_compile_cache()


_DEFINED = itertools.count()  # tells apart generated sources that got the same name


def define(source: str, filename: str, env: dict) -> dict:
    """Run generated ``source`` in ``env`` (returned), its text registered under ``filename`` in linecache.

    Registered, a generated function has a source file as far as ``inspect`` can tell: tracebacks show its
    lines, and torch.compile before 2.13 compiles it as itself. Those versions wrapped every function
    without a source file in one shared wrapper, so all our kernels shared one recompile budget (8) and,
    past the eighth, fell back to eager ops (seen with torch 2.11 on the GPU machine's CPU)."""
    lines = source.splitlines(True)
    if linecache.cache.get(filename, (None, None, lines))[2] != lines:  # another source under this name
        filename = f"{filename} #{next(_DEFINED)}"
    linecache.cache[filename] = (len(source), None, lines, filename)
    exec(compile(source, filename, "exec"), env)
    return env


# Compiled for every size, a kernel's C++ took whether to run its loop on several threads from the size of its
# first call (inductor's size hint), kept it for every later size, and the on-disk cache kept it for every
# later process on the machine: a formula whose cached code had been compiled for 640 values ran 25.7M-value
# calls on one thread, at half the speed (docs/SPEED.md). With dynamic threads every loop is an OpenMP region
# and the runtime picks the threads at each call. (The values are the same either way but for a sum's order,
# which its error scale covers as any evaluation's.)
# Inductor's pattern passes are off for our kernels: before torch 2.13 one of them (joint_graph.pointless_convert,
# "remove chain of dtype conversions often created by AMP") rewrote a float64 -> float32 -> float64 round trip as
# no conversion at all, so a kernel's rounded intermediate kept its float64 bits. Seen under torch 2.11 on the
# GPU machine, on its CPU and its GPU alike: the compiler check got every value back unrounded, and the
# log-softmax region left the eager bits (docs/SPEED.md, "The compiled path"). Under torch 2.13, which keeps
# the narrower intermediate, the option changes none of our kernels' generated code.
KEEP_ROUNDINGS = {"pattern_matcher": False}
COMPILE_OPTIONS = {"cpp.dynamic_threads": True, **KEEP_ROUNDINGS}


def compile_kernel(fn, fullgraph: bool = True):
    """``fn`` compiled for every size (torch.compile, dynamic shapes; ``COMPILE_OPTIONS``), always called with
    autograd off. The engine calls its kernels from inside the dispatch mode, below autograd, where the grad
    mode is whatever the caller's is (on in a forward, off in an optimizer step); torch.compile guards on it,
    so each kernel compiled twice in a step. Its values do not depend on it."""
    return torch.no_grad()(torch.compile(fn, dynamic=True, fullgraph=fullgraph, options=COMPILE_OPTIONS))


def compiled_code_rounds(device="cpu") -> bool:
    """Whether this process's compiled code for ``device`` rounds float64 values to float32 as the eager ops do, by
    compiling the rounding and its way back to float64 and comparing on values of every kind (between grid
    points, at midpoints, subnormal, huge, infinite, NaN). The compiled paths take the compiled code as
    another correct float64 evaluation; a compiler that breaks that (AVX2 code built for an AVX-512 target
    skipped the rounding: ISA_TARGETS) would make an honest trainer's run fail its audit, or an auditor
    reject one. hardware.compiled_path asks once per process and, where this is False (or nothing
    compiles), keeps the compiled paths off: the eager engine gives the same bits, slower. The compiled paths
    run on CPUs only; ``device`` "cuda" asks the same of a GPU's compiled code (Triton), the first thing a GPU
    path would need (bench/gpu_check.sh reports it)."""
    g = Grid(32)
    rounded = f"ROUND(y, {g.drop}, {g.cell_bits}, {g.half}, {g.low_mask}, {g.min_spacing!r})"
    source = f"def round_trip(y):\n    return {rounded}.to(torch.float64)\n"
    try:
        env = define(source, "<veritrain compiler check>", {"torch": torch, "ROUND": _round_to_grid})
        y = torch.cat([torch.linspace(-3.0, 3.0, 4099, dtype=torch.float64) / 3.0,
                       torch.tensor([1.0 + 2.0 ** -24, 2.0 ** -140 * 1.3, 3.4e38, 1e300, -1e-300, math.inf, math.nan],
                                    dtype=torch.float64)]).to(device)
        got = compile_kernel(env["round_trip"])(y)
        want = y.to(torch.float32).to(torch.float64)
        if got.shape != want.shape or got.dtype != want.dtype:
            warnings.warn(f"veritrain: this process's compiled code returned {got.dtype} {tuple(got.shape)} for a "
                          f"rounding of {tuple(y.shape)} float64 values; compiled kernels are off (same results, "
                          f"slower)")
            return False
        differ = (got.view(torch.int64) != want.view(torch.int64)).nonzero().flatten().tolist()
    except Exception as exc:
        FusedKernels.warn_once(None, exc)
        return False
    if not differ:
        return True
    # which values, so that a machine seen once (a lent GPU machine's CPU) tells what its compiler does
    examples = "; ".join(f"{float(y[i]).hex()} -> {float(got[i]).hex()}, eager {float(want[i]).hex()}"
                         for i in differ[:3])
    warnings.warn(f"veritrain: this process's compiled code does not round float64 values to float32 as eager ops "
                  f"do ({len(differ)} of {y.numel()} values of the check differ: {examples}); compiled kernels are "
                  f"off (same results, slower)")
    return False


# Ops whose float scalar arguments change from call to call (learning rates, weights) get a formula that
# takes the scalars as 0-d float64 tensors; scalars are float32 values already (the engine rounds them).
_FORMULAS = {
    "lerp": "torch.where(S0 < 0.5, A0 + S0 * (A1 - A0), A1 - (A1 - A0) * (1 - S0))",
    "addcmul": "A0 + S0 * (A1 * A2)",
    "addcdiv": "A0 + S0 * (A1 / A2)",
    "add": "A0 + S0 * A1",
    "sub": "A0 - S0 * A1",
    "div": "A0 / S0",
}
# arguments that are Scalars in these ops' schemas, in the order the formula's S0.. expects
_FORMULA_SCALARS = {"lerp": ("weight",), "addcmul": ("value",), "addcdiv": ("value",), "add": ("alpha",),
                    "sub": ("alpha",), "div": ("other",)}

# ops whose float scalars are call-site constants (baked into the kernel: one kernel per value)
_CONSTANT_SCALARS = {"pow", "softplus", "elu", "celu", "float_power"}


def _round_to_grid(y, drop: int, cell_bits: int, half: int, low_mask: int, min_spacing: float):
    if drop == 0:
        return y.to(torch.float32)
    bits = y.view(torch.int64)
    odd = (bits >> cell_bits) & 1
    r = ((bits + (half - 1) + odd) & ~low_mask).view(torch.float64)
    r = torch.where(y.abs() < FLOAT32_MIN_NORMAL, torch.round(y / min_spacing) * min_spacing, r)
    return torch.where(torch.isnan(y), y, r).to(torch.float32)


class Unfusable(Exception):
    pass


class Plan:
    __slots__ = ("key", "shape", "tensors", "scalars", "consts", "layout", "formula", "kw")

    def __init__(self, key, shape, tensors, scalars, consts, layout, formula, kw):
        self.key, self.shape, self.tensors, self.scalars, self.consts = key, shape, tensors, scalars, consts
        self.layout, self.formula, self.kw = layout, formula, kw

    def operands(self):
        """The kernel's tensor arguments: flattened to 1-D; 0-d tensors unchanged."""
        return [t.reshape(-1) if t.dim() else t for t in self.tensors]


class FusedKernels:
    """Builds, compiles and caches the kernels of one engine configuration."""

    _lock = threading.Lock()
    _failed: set = set()
    _warned = False

    def __init__(self, grid: Grid):
        self.grid = grid
        self._cache: dict = {}
        self._per_op: dict = {}  # (op, threshold, scans, in place) -> kernels compiled for it
        self._ids = itertools.count()

    @staticmethod
    def enabled_for(numel: int, device) -> bool:
        return compiled_path(numel, device, "VERITRAIN_COMPILE_MIN_NUMEL", 1 << 16)

    def plan(self, name: str, func, named: dict, scale_fn):
        """The kernel's argument structure for a call of ``func`` with arguments ``named`` (by schema
        name, defaults filled, float scalars already on float32), or raise Unfusable.

        Operands are passed flattened to 1-D (elementwise ops only)."""
        tensors, consts, layout = [], [], []
        shape = None
        floats = {}
        kw = {}
        for a in func._schema.arguments:
            x = named.get(a.name)
            if not isinstance(x, torch.Tensor):
                kw[a.name] = x
            if isinstance(x, torch.Tensor):
                if not x.is_floating_point() or x.dtype != torch.float32 or not x.is_contiguous():
                    raise Unfusable("operand")
                if x.dim() > 0:
                    if shape is None:
                        shape = tuple(x.shape)
                    elif tuple(x.shape) != shape:
                        raise Unfusable("broadcast")
                layout.append((a.name, a.kwarg_only, "T", len(tensors)))
                tensors.append(x)
            elif isinstance(x, (list, tuple)) and any(isinstance(t, torch.Tensor) for t in x):
                raise Unfusable("tensor list")
            elif type(x) is float:
                floats[a.name] = x
                layout.append((a.name, a.kwarg_only, "F", x))
            else:
                if x is torch.float32:  # dtype arguments (e.g. input_dtype): the kernel computes in float64
                    x = kw[a.name] = torch.float64
                layout.append((a.name, a.kwarg_only, "C", len(consts)))
                consts.append(x)
        if shape is None:
            raise Unfusable("no full-size operand")
        formula, scalars = _FORMULAS.get(name), []
        if formula is not None:
            vals = [named.get(arg) for arg in _FORMULA_SCALARS[name]]
            if any(isinstance(v, bool) or not isinstance(v, (int, float)) for v in vals) \
                    or set(floats) - set(_FORMULA_SCALARS[name]):
                formula = None  # e.g. a tensor weight: call the op itself
            else:
                scalars = [float(v) for v in vals]
        if formula is None and floats and name not in _CONSTANT_SCALARS:
            raise Unfusable("varying float scalars")
        # a formula's scalars are the kernel's arguments, not part of its code: one kernel for every value (an
        # optimizer's step size changes every step; keyed by value, each step compiled a kernel of its own)
        key = (func, tuple((nm, k, kind, None if kind == "T" or (kind == "F" and formula) else v)
                           for nm, k, kind, v in layout if kind != "C"),
               tuple(repr(c) for c in consts), scale_fn, formula is not None)
        return Plan(key, shape, tensors, scalars, consts, layout, formula, kw)

    # kernels one op may compile (its constant scalars and argument structures) for one threshold and role (a
    # trainer's kernel scans, an auditor's does not; in place or not); past that it runs eagerly: a scalar baked
    # into the kernel (pow's exponent, say) that changes every call would compile every call. Counted per
    # threshold and role, not per op: a process that trains, audits and calibrates (thresholds of its own) would
    # otherwise use up an op's quota and run it eagerly from then on, several times slower and without a word
    MAX_KERNELS_PER_OP = 8

    def kernel(self, plan, func, scale_fn, c, want_cand, into=None):
        """(compiled kernel, eager compute) for ``plan``, or None where ``func`` has compiled its quota. ``into``:
        the position of a tensor operand the kernel writes its rounded result into (an in-place op's ``self``):
        with ``want_cand`` it leaves the candidates' old values there and returns the candidates (the trainer
        evaluates them again from the operands, then writes their results); without, it returns nothing."""
        full_key = (plan.key, c, want_cand, into)
        k = self._cache.get(full_key)
        if k is None:
            quota = (func, c, want_cand, into)
            if self._per_op.get(quota, 0) >= self.MAX_KERNELS_PER_OP:
                return None
            self._per_op[quota] = self._per_op.get(quota, 0) + 1
            k = self._cache[full_key] = self._build(func, plan, scale_fn, c, want_cand, into)
        return k

    def _build(self, func, plan, scale_fn, c, want_cand, into=None):
        layout, consts, scalars, formula = plan.layout, plan.consts, plan.scalars, plan.formula
        g = self.grid
        n_t = sum(1 for e in layout if e[2] == "T")
        params = [f"t{i}" for i in range(n_t)] + ([f"s{i}" for i in range(len(scalars))] if formula else [])
        lines = [f"def compute({', '.join(params)}):"]
        lines += [f"    A{i} = t{i}.to(torch.float64)" for i in range(n_t)]
        if formula:
            lines += [f"    S{i} = s{i}" for i in range(len(scalars))]
            lines.append(f"    Y = {formula}")
        else:
            pos, kw = [], []
            for name, kwarg_only, kind, v in layout:
                expr = f"A{v}" if kind == "T" else repr(v) if kind == "F" else f"C{v}"
                (kw if kwarg_only else pos).append(f"{name}={expr}" if kwarg_only else expr)
            lines.append(f"    Y = FUNC({', '.join(pos + kw)})")
        tensor_args = ", ".join(f"A{i}" for i in range(n_t))
        lines.append(f"    return Y, SCALE(Y, ({tensor_args},), KW)")
        lines.append(f"def kernel({', '.join(params)}):")
        lines.append(f"    y, s = compute({', '.join(params)})")
        lines.append(f"    y32 = ROUND(y, {g.drop}, {g.cell_bits}, {g.half}, {g.low_mask}, {g.min_spacing!r})")
        if into is not None and want_cand:  # written where the operand is, but at the candidates
            lines.append(f"    f = FLAG(y, s, {float(c)!r})")
            lines.append(f"    t{into}.copy_(torch.where(f > 0.0, t{into}, y32))")
            lines.append("    return f.to(torch.int8)")
        elif into is not None:  # written where the operand is: no float32 result to allocate and copy back
            lines.append(f"    t{into}.copy_(y32)")
        elif want_cand:
            lines.append(f"    return y32, FLAG(y, s, {float(c)!r}).to(torch.int8)")
        else:
            lines.append("    return y32")
        env = {"torch": torch, "FUNC": func, "ROUND": _round_to_grid, "FLAG": kernel_flag(g), "SCALE": scale_fn,
               "KW": plan.kw, **{f"C{i}": v for i, v in enumerate(consts)}}
        define("\n".join(lines), f"<veritrain fused kernel {next(self._ids)}: {func}>", env)
        return compile_kernel(env["kernel"]), env["compute"]

    @staticmethod
    def warn_once(func, exc):
        if not FusedKernels._warned:
            FusedKernels._warned = True
            warnings.warn(f"veritrain: fused kernels unavailable ({type(exc).__name__}: {exc}); using eager "
                          f"float64 ops (same results, slower)")


class Epilogues:
    """Compiled "round and test" kernels for results computed by eager float64 ops (matrix products,
    convolutions, reductions): one pass over the float64 result that evaluates its (lazy) error scale,
    rounds it and marks the candidates."""

    _ids = itertools.count()

    def __init__(self, grid: Grid):
        self.grid = grid
        self._cache: dict = {}
        self._failed: set = set()

    def run(self, y: torch.Tensor, scale, c: float, into: torch.Tensor | None = None):
        """(y32, mask) or None (not compiled here: the caller uses eager ops). ``into``: a float32 tensor of y's
        shape (a block of a larger result) the kernel writes the rounded values into as it makes them, returned
        as y32: no float32 block allocated, then read and copied (a block of GPT-2's logits is 2 MB)."""
        from .rules import LazyScale, RelScale

        if isinstance(scale, LazyScale):
            terms = scale.full_terms()
        elif isinstance(scale, RelScale):
            terms = [(1.0, None)]  # |y|, computed in the kernel
        else:
            terms = [(1.0, [scale])]
        key = (y.dim(), tuple(None if fs is None else tuple(f.dim() for f in fs) for _, fs in terms), float(c),
               into is not None)
        if key in self._failed:
            return None
        k = self._cache.get(key)
        try:
            if k is None:
                k = self._cache[key] = self._build(len(y.shape), [None if fs is None else len(fs) for _, fs in terms], c,
                                                   into is not None)
            coefs = torch.tensor([t[0] for t in terms], dtype=torch.float64, device=y.device)
            factors = [f for _, fs in terms for f in fs or ()]
            if into is None:
                return k(y, coefs, *factors)
            return into, k(y, coefs, *factors, into)
        except Exception as exc:
            self._failed.add(key)
            FusedKernels.warn_once(None, exc)
            return None

    def _build(self, ndim, n_factors, c, into=False):
        g = self.grid
        names, terms, i = [], [], 0
        for t, n in enumerate(n_factors):
            if n is None:  # the scale |y| (rules.RelScale)
                terms.append(f"coefs[{t}] * y.abs()")
                continue
            fs = [f"f{i + j}" for j in range(n)]
            names += fs
            i += n
            terms.append(" * ".join([f"coefs[{t}]"] + fs))
        src = "\n".join([
            f"def epilogue({', '.join(['y', 'coefs'] + names + (['into'] if into else []))}):",
            f"    s = {' + '.join(terms)}",
            f"    y32 = ROUND(y, {g.drop}, {g.cell_bits}, {g.half}, {g.low_mask}, {g.min_spacing!r})",
            f"    flag = FLAG(y, s, {float(c)!r}).to(torch.int8)",
        ] + ([
            "    into.copy_(y32)",
            "    return flag",
        ] if into else [
            "    return y32, flag",
        ]))
        env = {"torch": torch, "ROUND": _round_to_grid, "FLAG": kernel_flag(g)}
        define(src, f"<veritrain epilogue {next(self._ids)}>", env)
        return compile_kernel(env["epilogue"])


def abs_sum_and_min(x: torch.Tensor, dims: list, keepdim: bool):
    """(sum of |x|, smallest nonzero |x|, inf where every |x| is 0) over ``dims``: a sum's error scale and
    its exactness certificate (rules._reduction_sum). One compiled pass over x for large inputs instead of
    five eager ones (abs, sum, compare, fill, min); eager ops where nothing is compiled. Both are error-model
    inputs, not results: another summation order changes the sum in its last bits, which the auditor's
    tolerance (engine.HONEST_TAU) absorbs; below the certificate's threshold the sum of float32 values is
    exact in any order, so the certificate is the same on every machine (docs/ROUNDING.md).

    The compiled kernel sees a view of a contiguous x without its size-1 dimensions, the adjacent ones
    merged where all are reduced or all kept: (rows, columns) for a sum over a matrix's rows, (N, C, H*W)
    reduced over 0 and 2 for a BatchNorm's sum over (N, H, W). Each such pattern gets a kernel of its own,
    compiled once for every size (no size is 1, so torch.compile does not specialise on sizes)."""
    dims = sorted(d % x.dim() for d in dims) if x.dim() else []
    if dims and x.numel() and x.is_contiguous() and FusedKernels.enabled_for(x.numel(), x.device):
        sizes, reduced = merged_view(x.shape, dims)
        out = _run_pattern(REDUCTIONS, (len(sizes), reduced), "reduction", "_abs_sum_and_min(x, {reduced!r}, False)",
                           x.view(sizes))
        if out is not None:
            out_shape = [1 if d in dims else n for d, n in enumerate(x.shape)] if keepdim \
                else [n for d, n in enumerate(x.shape) if d not in dims]
            return out[0].view(out_shape), out[1].view(out_shape)
    return _abs_sum_and_min(x, tuple(dims), bool(keepdim))


def merged_view(shape, dims):
    """(sizes, reduced positions) of the view abs_sum_and_min's kernels see: size-1 dimensions left out,
    runs of reduced or of kept dimensions merged."""
    sizes, reduced, last = [], [], None
    for d, n in enumerate(shape):
        if n == 1:
            continue
        r = d in dims
        if r == last:
            sizes[-1] *= n
        else:
            sizes.append(n)
            if r:
                reduced.append(len(sizes) - 1)
        last = r
    return sizes, tuple(reduced)


def _run_pattern(table: dict, key: tuple, name: str, body: str, view: torch.Tensor):
    """Run the compiled kernel ``body`` (an expression in x; ``{reduced}`` stands for the reduced positions)
    for one pattern ``key`` = (dimensions, reduced positions) on ``view``, or return None: nothing to reduce
    after leaving out size-1 dimensions (the eager ops are cheap), or no kernel here (no compiler, or an
    input it cannot handle: eager ops for this pattern from now on). Each pattern is compiled once into
    ``table`` as a function of its own: torch.compile's recompile limit counts per function, and every
    pattern must keep its kernel."""
    fn = table.get(key)
    if fn is None:
        ndim, reduced = key
        fn = False
        if reduced:
            env = {"_abs_sum_and_min": _abs_sum_and_min}
            src = f"def kernel(x):\n    return {body.format(reduced=reduced)}\n"
            define(src, f"<veritrain {name} {ndim}-d over {reduced}>", env)
            fn = compile_kernel(env["kernel"])
        table[key] = fn
    if fn is False:
        return None
    try:
        return fn(view)
    except Exception as exc:
        table[key] = False
        FusedKernels.warn_once(None, exc)
        return None


def _abs_sum_and_min(x, dims, keepdim):
    ax = x.abs()
    return ax.sum(dims, keepdim=keepdim), torch.where(ax == 0, torch.inf, ax).amin(dims, keepdim=keepdim)


REDUCTIONS: dict = {}  # (dimensions, reduced positions) -> its compiled kernel, or False where none


def sum_of_squares(x: torch.Tensor, dims) -> torch.Tensor:
    """sum of x**2 over ``dims``, keepdim: the energies and norms error scales are built from (rules: a matrix
    product's row and column norms, a convolution's patch energies). ATen's norm over dimensions that are not
    the innermost ones runs several times slower than a sum over them, and ``(x * x).sum(dims)`` writes x**2
    in full first; a compiled sum of squares reads x once, in any layout (docs/SPEED.md has the measured
    change). Another summation order changes the result in its last bits, which the auditor's tolerance
    (engine.HONEST_TAU) absorbs."""
    out = _compiled_squares(x, dims)
    return _eager_squares(x, dims) if out is None else out


def _eager_squares(x: torch.Tensor, dims) -> torch.Tensor:
    """(x * x).sum(dims, keepdim=True), over the innermost of ``dims`` first where those are x's last dimensions
    and x is contiguous: ATen's norm over contiguous trailing dimensions reads x once at memory speed, where
    ``x * x`` writes a temporary as large as x first; what is left after it is small. A channel's norm over an
    NCHW activation's batch and positions took a third to a half of the time of one sum over all three, and the
    norm over the trailing dimensions (squared) a third of the time of their sum of squares (python
    bench/bench_conv_scales.py, its second table). The square of a norm differs from the sum of squares in its
    last bits, as another summation order does (an error-model input: the auditor's tolerance absorbs it)."""
    nd = x.dim()
    dims = sorted({d % nd for d in dims}) if nd else []
    laid = _in_memory_order(_eager_squares, x, dims)
    if laid is not None:
        return laid
    inner = 0
    while inner < len(dims) and dims[-1 - inner] == nd - 1 - inner:
        inner += 1
    if inner and x.is_contiguous():
        energy = torch.linalg.vector_norm(x, dim=dims[-inner:], keepdim=True).square_()
        return energy.sum(dims[:-inner], keepdim=True) if inner < len(dims) else energy
    return (x * x).sum(dims, keepdim=True)


def vector_norm(x: torch.Tensor, dims) -> torch.Tensor:
    """||x|| over ``dims``, keepdim: the compiled sum of squares where sum_of_squares takes it; ATen's norm
    over the innermost dimension alone (memory speed there); else the eager sum of squares (ATen's norm over
    outer dimensions ran up to 30x slower here: python bench/bench_conv_scales.py). Innermost in memory, not only
    in the view: over a transposed operand's last dimension (a weight gradient's x^T, attention's K^T) ATen's norm
    reads a strided dimension, 3-8x the time of the sum over the memory's rows (python bench/bench_conv_scales.py,
    its third table)."""
    out = _compiled_squares(x, dims)
    if out is not None:
        return out.sqrt()
    if not x.dim() or ({d % x.dim() for d in dims} == {x.dim() - 1} and (x.stride(-1) == 1 or x.shape[-1] == 1)):
        return torch.linalg.vector_norm(x, dim=dims, keepdim=True)
    laid = _in_memory_order(vector_norm, x, dims)  # ATen's norm where that reduces the innermost dimension
    return _eager_squares(x, dims).sqrt_() if laid is None else laid


def _in_memory_order(reduce, x: torch.Tensor, dims):
    """``reduce(x, dims)`` (keepdim) taken on x permuted to its memory's order, where x is a permutation of a
    contiguous tensor but not contiguous itself (a transposed matrix product operand, whose column norms are its
    memory's row norms: as a sum of squares over the strided view, GPT-2's tied embedding took 110 ms against 17,
    python bench/bench_conv_scales.py --reps 20, its third table); else None."""
    if x.dim() < 2 or x.is_contiguous():
        return None
    nd = x.dim()
    order = sorted(range(nd), key=lambda d: (-x.stride(d), d))
    xc = x.permute(order)
    if not xc.is_contiguous():
        return None
    out = reduce(xc, [order.index(d % nd) for d in dims])
    return out.permute([order.index(d) for d in range(nd)]).contiguous()


# Below this many elements the eager sum of squares was faster than the compiled one on this project's CPUs
# (python bench/bench_conv_scales.py, its second table: a compiled call costs ~0.1-0.2 ms; at 393216 float64
# values the eager one took 206 us against 308 on an AVX2 machine, at 1572864 the compiled one 1104 against 1223
# there and 460-660 against 1110-1340 on an Intel Xeon with AVX-512, where it was faster from 393216 values). The
# eager one also writes x * x in full first, which in a step is fresh memory, not the bench's reused buffer.
SQUARES_MIN_NUMEL = 1 << 20


def _compiled_squares(x: torch.Tensor, dims):
    """The compiled sum of squares, or None where the eager ops are as fast or no kernel is available: x
    below SQUARES_MIN_NUMEL elements (VERITRAIN_COMPILE_MIN_NUMEL where set), not a permutation of a
    contiguous tensor (a transposed operand is one), or reduced over its innermost dimension (ATen's norms run
    at memory speed there, and _eager_squares takes them first on a contiguous x: a ResNet-18 weight's norms
    over [0, 2, 3] took 1.6 ms that way and 2.1 ms compiled, python bench/bench_conv_scales.py --reps 20,
    its second table)."""
    if not x.dim() or not x.numel() or not compiled_path(x.numel(), x.device, "VERITRAIN_COMPILE_MIN_NUMEL",
                                                         SQUARES_MIN_NUMEL):
        return None
    dims = sorted({d % x.dim() for d in dims})
    if dims and dims[-1] == x.dim() - 1 and x.is_contiguous():
        return None
    order = sorted(range(x.dim()), key=lambda d: (-x.stride(d), d))
    xc = x.permute(order)
    if not xc.is_contiguous():
        return None
    sizes, reduced = merged_view(xc.shape, [order.index(d) for d in dims])
    if reduced == (len(sizes) - 1,):
        return None
    out = _run_pattern(SQUARES, (len(sizes), reduced), "sum of squares", "(x * x).sum({reduced!r})", xc.view(sizes))
    if out is None:
        return None
    kept = [1 if d in dims else n for d, n in enumerate(x.shape)]
    return out.view([kept[d] for d in order]).permute([order.index(d) for d in range(x.dim())]).contiguous()


SQUARES: dict = {}  # (dimensions, reduced positions) -> its compiled sum of squares, or False where none


class FusedSums:
    """A sum or mean of a float32 tensor in one compiled pass: read float32, accumulate in float64, and in
    the same pass its error scale and exactness certificate (rules._reduction_sum's definitions), the rounding
    and the near-midpoint test. The eager path copies the whole input to float64 first and reads that copy
    three times (the sum, the scale, the rounding): on a language model's vocabulary-wide rows that was a
    large part of a step (docs/SPEED.md has the measured change).

    Like the elementwise kernels, this is another correct float64 evaluation of the op (its own summation
    order); the few candidates are recomputed by the aten op on those outputs' rows (``rows_of``,
    engine._SumSlot), and the
    trainer's entries and rounded results come from those values, the auditor's checks too."""

    _ids = itertools.count()

    def __init__(self, grid: Grid):
        self.grid = grid
        self._cache: dict = {}
        self._failed: set = set()

    def run(self, x: torch.Tensor, dims: list, mean: bool, c: float, want_cand: bool):
        """(y32 flat, candidate mask flat or None) for a contiguous float32 ``x`` summed
        over ``dims`` (sorted, non-empty), or None where no kernel is available (the caller uses eager ops)."""
        sizes, reduced = merged_view(x.shape, dims)
        if not reduced:
            return None
        n = math.prod(x.shape[d] for d in dims)
        certified = not mean or n & (n - 1) == 0  # a mean is certified only for a power-of-two count
        key = (len(sizes), reduced, mean, certified, float(c), want_cand)
        if key in self._failed:
            return None
        try:
            k = self._cache.get(key)
            if k is None:
                k = self._cache[key] = self._build(len(sizes), reduced, mean, certified, c, want_cand)
            coef = torch.tensor([math.sqrt(max(n, 1)), float(n)], dtype=torch.float64, device=x.device)
            out = k(x.view(sizes), coef)
        except Exception as exc:  # compile or run failure: eager ops for this pattern from now on
            self._failed.add(key)
            FusedKernels.warn_once(None, exc)
            return None
        y32, cand = (out[0], out[1]) if want_cand else (out, None)
        return y32.reshape(-1), None if cand is None else cand.reshape(-1)

    def _build(self, ndim, reduced, mean, certified, c, want_cand):
        from .rules import _EXACT_LIMIT

        g = self.grid
        dims = repr(list(reduced))
        lines = [
            "def kernel(x, coef):",
            "    x64 = x.to(torch.float64)",
            f"    y = x64.sum({dims})",
            "    ax = x64.abs()",
            f"    s = ax.sum({dims})",
            # the sum's scale sqrt(n) * sum|x| (a mean's divided by n: the division is one more rounding)
            "    scale = coef[0] * s / coef[1]" if mean else "    scale = coef[0] * s",
        ]
        if mean:
            lines.append("    y = y / coef[1]")
        if certified:
            # exact in any order below 2**52 float32 ulps of the smallest nonzero |x| (rules._certify); the
            # ulp from the float64 exponent bits, as rules._quantum computes it from frexp
            lines += [
                f"    smallest = torch.where(ax == 0, torch.inf, ax).amin({dims})",
                "    e = ((smallest.view(torch.int64) >> 52) & 2047) - 1023",
                "    q = ((torch.clamp(e - 23, min=-149) + 1023) << 52).view(torch.float64)",
                "    q = torch.where(torch.isfinite(smallest), q, torch.inf)",
                f"    scale = torch.where(s < {_EXACT_LIMIT!r} * q, 0.0, scale)",
            ]
        lines.append(f"    y32 = ROUND(y, {g.drop}, {g.cell_bits}, {g.half}, {g.low_mask}, {g.min_spacing!r})")
        if want_cand:
            lines.append(f"    return y32, FLAG(y, scale, {float(c)!r}).to(torch.int8)")
        else:
            lines.append("    return y32")
        env = {"torch": torch, "ROUND": _round_to_grid, "FLAG": kernel_flag(g)}
        define("\n".join(lines), f"<veritrain fused sum {next(self._ids)}: {ndim}-d over {reduced}>", env)
        return compile_kernel(env["kernel"])


def rows_of(x: torch.Tensor, dims: list) -> torch.Tensor:
    """x as (outputs, reduced elements): row i holds what output i (in the result's order) sums. A view
    where the reduced dimensions come last; a copy otherwise (only for the few candidates' rows)."""
    kept = [d for d in range(x.dim()) if d not in dims]
    n = math.prod(x.shape[d] for d in dims)
    return x.permute(kept + list(dims)).reshape(-1, n)
