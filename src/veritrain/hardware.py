"""Hardware variants: the CPUs an auditor may have, emulated on one machine.

Each variant is a set of settings applied before torch is imported (environment knobs that change the
kernels PyTorch, oneDNN and MKL pick) or right after (threads, mkldnn). They change floating-point
results of real kernels, so plain float32 training under two variants ends with different weights.
Variants are applied by re-running the command in a child process (``--variant NAME``).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys

VARIANTS: dict[str, dict[str, str]] = {
    "native": {},
    "isa-default": {"ATEN_CPU_CAPABILITY": "default"},
    "isa-avx2": {"ATEN_CPU_CAPABILITY": "avx2"},
    "onednn-avx2": {"ONEDNN_MAX_CPU_ISA": "AVX2"},
    "onednn-sse41": {"ONEDNN_MAX_CPU_ISA": "SSE41"},
    "mkl-compatible": {"MKL_CBWR": "COMPATIBLE"},
    "threads-1": {"VERITRAIN_THREADS": "1"},
    "threads-2": {"VERITRAIN_THREADS": "2"},
    "no-mkldnn": {"VERITRAIN_MKLDNN": "0"},
    "combo": {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "SSE41", "MKL_CBWR": "COMPATIBLE",
              "VERITRAIN_THREADS": "1", "VERITRAIN_MKLDNN": "0"},
    # not CPU settings: the engine's float64 evaluation itself changes (accelerator.py)
    "reorder": {"VERITRAIN_EMULATE": "reorder"},  # an emulated GPU library: other orders, FMAs, libm
    "perturb": {"VERITRAIN_EMULATE": "perturb"},  # the worst the error model allows: moves up to 0.9 tau
}
# what `calibrate` and the thresholds experiment compare against by default: every CPU variant that can
# differ from this machine, and the emulated accelerator (perturb is left out: its differences are 0.9 of
# the thresholds by construction, so calibrating on it would only return the thresholds)
CALIBRATION_VARIANTS = "isa-default,isa-avx2,onednn-sse41,mkl-compatible,threads-1,no-mkldnn,combo,reorder"
KNOBS = ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA", "MKL_CBWR", "VERITRAIN_THREADS", "VERITRAIN_MKLDNN",
         "VERITRAIN_EMULATE")
APPLIED = "VERITRAIN_VARIANT_APPLIED"


def variant_env(name: str) -> dict[str, str]:
    if name not in VARIANTS:
        raise ValueError(f"unknown hardware variant {name!r}; known: {', '.join(VARIANTS)}")
    env = dict(VARIANTS[name])
    if "VERITRAIN_THREADS" in env:
        env["OMP_NUM_THREADS"] = env["MKL_NUM_THREADS"] = env["VERITRAIN_THREADS"]
    return env


def run_in_variant(name: str, argv: list[str]) -> int:
    """Run ``python -m veritrain.cli argv`` in a child process with the variant's settings."""
    env = dict(os.environ)
    for k in list(env):
        if k in KNOBS:
            del env[k]
    env.update(variant_env(name))
    env[APPLIED] = name
    # -P (Python >= 3.11): the working directory is not put on sys.path, so a folder the auditor happens
    # to run in cannot shadow a module
    safe = ["-P"] if sys.version_info >= (3, 11) else []
    child = subprocess.Popen([sys.executable, *safe, "-m", "veritrain.cli", *argv], env=env)
    while True:  # the child's exit code is ours, Ctrl-C included (130, with the child's own message)
        try:
            return child.wait()
        except KeyboardInterrupt:
            _pass_on_interrupt(child)


def _pass_on_interrupt(child: subprocess.Popen):
    """Ctrl-C in a terminal reaches the child too (one process group); a SIGINT sent to this process
    alone is passed on once the child has had a moment to act on its own. No traceback here, and the
    child is never killed: it stops cleanly and says how to resume."""
    try:
        child.wait(timeout=1.0)
    except (subprocess.TimeoutExpired, KeyboardInterrupt):
        if child.poll() is None:
            child.send_signal(signal.SIGINT)


def configure_allocator() -> bool:
    """Keep freed memory in the process (glibc): large tensors otherwise come from fresh mmap'd pages
    whose first touch costs a page fault each, which dominates memory-bound float64 work on a CPU.
    Set VERITRAIN_MALLOC=system to leave malloc alone. Returns whether the setting was applied."""
    if os.environ.get("VERITRAIN_MALLOC", "heap") == "system" or not sys.platform.startswith("linux"):
        return False
    import ctypes
    import ctypes.util

    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # not glibc
        return False
    M_TRIM_THRESHOLD, M_TOP_PAD, M_MMAP_MAX = -1, -2, -4
    ok = mallopt(M_MMAP_MAX, 0) == 1
    ok &= mallopt(M_TRIM_THRESHOLD, 2**31 - 1) == 1
    ok &= mallopt(M_TOP_PAD, 256 << 20) == 1
    return bool(ok)


def apply_process_settings():
    """Settings that take effect after import (threads, mkldnn, malloc); call once torch is imported."""
    import torch

    configure_allocator()
    threads = os.environ.get("VERITRAIN_THREADS")
    if threads:
        torch.set_num_threads(int(threads))
    if os.environ.get("VERITRAIN_MKLDNN") == "0":
        torch.backends.mkldnn.enabled = False


def describe() -> dict:
    import platform

    import torch

    return {
        "variant": os.environ.get(APPLIED, "native"),
        "env": {k: os.environ[k] for k in KNOBS if k in os.environ},
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "threads": torch.get_num_threads(),
        "mkldnn": bool(torch.backends.mkldnn.enabled),
        "machine": platform.machine(),
        "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        **_device_description(),
    }


# --- devices (--device cpu|cuda[:N]) -------------------------------------------------------------
# The device changes only where the float64 evaluation runs: run files never name it, and the
# description above (informational, outside every commitment) does.

_device_settings: dict = {}  # what configure_device applied last, for describe()


class DeviceError(ValueError):
    """A --device that this machine cannot use."""


def parse_device(spec):
    """``cpu``, ``cuda`` or ``cuda:N`` as a torch.device this machine has; DeviceError (naming the device
    and the reason) otherwise. Called before a command writes anything."""
    import torch

    if isinstance(spec, torch.device):
        spec = str(spec)
    text = str(spec).strip()
    kind, _, index = text.partition(":")
    if kind not in ("cpu", "cuda") or (index and not index.isdigit()) or (kind == "cpu" and index not in ("", "0")):
        raise DeviceError(f"--device {text!r}: unknown device (expected cpu, cuda or cuda:N)")
    if kind == "cpu":
        return torch.device("cpu")
    if not torch.cuda.is_available():
        why = "this PyTorch build has no CUDA support" if torch.version.cuda is None else "no CUDA GPU is visible"
        raise DeviceError(f"--device {text!r}: CUDA is not available here (torch.cuda.is_available() is False: {why})")
    count = torch.cuda.device_count()
    n = int(index) if index else torch.cuda.current_device()
    if n >= count:
        raise DeviceError(f"--device {text!r}: no such CUDA device (this machine has {count}: "
                          f"cuda:0..cuda:{count - 1})")
    return torch.device("cuda", n)


def configure_device(device) -> dict:
    """Settings for a run on ``device``; returns what it applied (written into describe()).

    On CUDA: no TF32 and no reduced-precision reductions in matrix products (they change float32
    results, and plain fp32 runs use them). cudnn stays off inside steps (engine.step_context), so
    convolutions take ATen's own im2col + GEMM path (no FFT or Winograd algorithms); cuBLAS may split
    reductions (split-K), and deterministic algorithms are not required: the engine's float64 results
    are rounded, and decisions near a midpoint are logged. Nothing to set on a CPU.
    """
    import torch

    global _device_settings
    device = torch.device(device)
    if device.type != "cuda":
        _device_settings = {}
        return {}
    matmul = torch.backends.cuda.matmul
    matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    matmul.allow_fp16_reduced_precision_reduction = False
    matmul.allow_bf16_reduced_precision_reduction = False
    applied = {"cuda.matmul.allow_tf32": False, "cudnn.allow_tf32": False,
               "cuda.matmul.allow_fp16_reduced_precision_reduction": False,
               "cuda.matmul.allow_bf16_reduced_precision_reduction": False}
    if hasattr(matmul, "allow_fp16_accumulation"):  # torch >= 2.7
        matmul.allow_fp16_accumulation = False
        applied["cuda.matmul.allow_fp16_accumulation"] = False
    applied.update({"cudnn_in_steps": False, "deterministic_algorithms": False})
    _device_settings = dict(applied)
    return applied


def _device_description() -> dict:
    """The device the runner uses (task.current_device()) and, on a GPU, its name and settings."""
    import torch

    from .task import current_device

    device = current_device()
    out = {"device": str(device)}
    if device.type == "cuda":
        out["device_name"] = torch.cuda.get_device_name(device)
        out["device_settings"] = dict(_device_settings)
    return out


def compiled_path(numel: int, device, min_numel_variable: str, default_min_numel: int) -> bool:
    """Whether an op on ``device`` (a torch.device or its name) whose largest tensor has ``numel`` elements
    takes a compiled path (fused kernels and sums, captured regions, blocked products, the compiled
    candidate scan) rather than the eager engine.

    Only on a CPU. On an H200 (bench/RESULTS.md, "GPU trainer, CPU auditor") digits-cnn trained with the
    compiled paths on CUDA left the CPU's bits within two steps, without a log entry to say so, and failed
    its CPU audit; the eager engine on CUDA gave the CPU's bits exactly. On a CPU ``VERITRAIN_COMPILE``
    decides: 1 always, 0 never; by default ops with at least ``min_numel_variable`` (an environment
    variable; ``default_min_numel`` if unset) elements. And only where this process's compiled code rounds
    as eager ops do (fused.compiled_code_rounds: checked once)."""
    if getattr(device, "type", device if isinstance(device, str) else "").split(":")[0] != "cpu":
        return False
    mode = setting("VERITRAIN_COMPILE", "auto")
    if mode == "0" or (mode != "1" and numel < int(setting(min_numel_variable, default_min_numel))):
        return False
    return _compiler_ok if _compiler_ok is not None else _check_compiler()


_compiler_ok: bool | None = None  # fused.compiled_code_rounds, asked the first time a compiled path is


def _check_compiler() -> bool:
    global _compiler_ok
    from . import fused

    _compiler_ok = False  # while it compiles: no compiled path meanwhile
    _compiler_ok = fused.compiled_code_rounds()
    return _compiler_ok


_pinned: dict | None = None  # the VERITRAIN_* settings while steps run (pinned_settings)


def setting(name: str, default):
    """A ``VERITRAIN_*`` variable as pinned for the running step (``pinned_settings``), else as set now."""
    return (_pinned if _pinned is not None else os.environ).get(name, default)
_pins = 0


@contextlib.contextmanager
def pinned_settings():
    """Read the ``VERITRAIN_*`` variables once for a step: ``compiled_path`` asks several times per op,
    and reading the environment was a few percent of a small model's verified step (bench/RESULTS.md). A
    setting changed while a step runs takes effect at the next step."""
    global _pinned, _pins
    if _pins == 0:
        _pinned = {k: v for k, v in os.environ.items() if k.startswith("VERITRAIN_")}
    _pins += 1
    try:
        yield
    finally:
        _pins -= 1
        if _pins == 0:
            _pinned = None
