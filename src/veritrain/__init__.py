"""veritrain: training that an auditor on different hardware can reproduce bit for bit.

The Python API (api.py): ``train``, ``audit``, ``verify``, ``dispute``, ``inspect``; ``Run`` and ``init``
make an own training loop verifiable (loop.py); ``Task`` is what a task function returns (task.py);
``veritrain.data`` indexes a dataset's batches by step.
"""

__version__ = "0.1.0"
__all__ = ["Task", "Run", "init", "train", "audit", "verify", "dispute", "inspect", "TrainResult", "AuditResult",
           "VerifyResult", "DisputeResult", "InspectResult", "__version__"]

# torch is imported lazily, on first use of a name below, so that `veritrain --help` is fast and
# `veritrain --variant ...` can set hardware knobs before torch loads
_LAZY = {"Task": "task", "Run": "loop", "init": "loop", "train": "api", "audit": "api", "verify": "api",
         "dispute": "api", "inspect": "api", "TrainResult": "api", "AuditResult": "api", "VerifyResult": "api",
         "DisputeResult": "api", "InspectResult": "api"}


def __getattr__(name):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
    raise AttributeError(f"module 'veritrain' has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(_LAZY))
