"""Hardware variants: the CPUs an auditor may have, emulated on one machine.

Each variant is a set of settings applied before torch is imported (environment knobs that change the
kernels PyTorch, oneDNN and MKL pick) or right after (threads, mkldnn). They change floating-point
results of real kernels, so plain float32 training under two variants ends with different weights.
Variants are applied by re-running the command in a child process (``--variant NAME``).
"""

from __future__ import annotations

import os
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
}
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
        if k in ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA", "MKL_CBWR", "VERITRAIN_THREADS", "VERITRAIN_MKLDNN"):
            del env[k]
    env.update(variant_env(name))
    env[APPLIED] = name
    # -P (Python >= 3.11): the working directory is not put on sys.path, so a folder the auditor happens
    # to run in cannot shadow a module
    safe = ["-P"] if sys.version_info >= (3, 11) else []
    return subprocess.call([sys.executable, *safe, "-m", "veritrain.cli", *argv], env=env)


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
        "env": {k: os.environ[k] for k in ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA", "MKL_CBWR",
                                           "VERITRAIN_THREADS", "VERITRAIN_MKLDNN") if k in os.environ},
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "threads": torch.get_num_threads(),
        "mkldnn": bool(torch.backends.mkldnn.enabled),
        "machine": platform.machine(),
        "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
    }
