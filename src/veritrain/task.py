"""The task contract: how users hand their training code to veritrain.

A task is a Python callable ``module:function`` that takes a config dict and returns a ``Task``. The
module is found on the Python path. ``batch(step)`` must return the same tensors for the same step on
every machine (use ``veritrain.randomness`` for shuffling and augmentation).
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib
import inspect
import math
from dataclasses import dataclass
from typing import Any, Callable

import torch

BUILTIN_TASKS = {
    "digits-cnn": "veritrain.tasks.digits_cnn:make_task",
    "gpt2-text": "veritrain.tasks.gpt2_text:make_task",
    "resnet-cifar10": "veritrain.tasks.resnet_cifar10:make_task",
    "gpt2-shakespeare": "veritrain.tasks.gpt2_shakespeare:make_task",
}


class TaskError(ValueError):
    """The task reference, its config or what it returned is not usable."""


@dataclass
class Task:
    """What a task function returns.

    ``loss(model, batch)`` returns a scalar; veritrain then runs zero_grad, backward and the optimizer
    step. Or ``train_step(model, optimizer, batch)`` does the whole step (clipping, several optimizers,
    accumulation) and returns the loss. The scheduler, if any, is stepped after each step.
    ``evaluate(model) -> dict`` optionally reports a metric on held-out data.
    ``batch_indices(step)`` optionally names the examples a step consumes (for the run's data records).
    ``data_sha256`` optionally maps config keys that name data files to a hash of the bytes read for each
    (``commitments.data_hash``): a run commits to it, and an auditor whose own copy hashes otherwise refuses.

    Devices (``--device cpu|cuda[:N]``): build everything on the CPU, as usual. veritrain builds the task
    on the CPU (so the initial state is the same everywhere), then moves the model's parameters and
    buffers and the optimizer's state to the device, and moves the tensors that ``batch(step)`` returns
    (in tensors, dicts, lists and tuples). Tensors a task creates itself later, inside ``loss``,
    ``train_step`` or ``evaluate`` (held-out data, masks), belong on ``veritrain.task.current_device()``.
    """

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    batch: Callable[[int], Any]
    loss: Callable[[torch.nn.Module, Any], torch.Tensor] | None = None
    train_step: Callable[[torch.nn.Module, torch.optim.Optimizer, Any], torch.Tensor] | None = None
    scheduler: Any = None
    evaluate: Callable[[torch.nn.Module], dict] | None = None
    batch_indices: Callable[[int], list] | None = None
    data_sha256: dict | None = None

    def __post_init__(self):
        if (self.loss is None) == (self.train_step is None):
            raise TaskError("a Task needs exactly one of loss= or train_step=")
        if not isinstance(self.model, torch.nn.Module):
            raise TaskError(f"Task.model must be a torch.nn.Module, got {type(self.model).__name__}")
        if not isinstance(self.optimizer, torch.optim.Optimizer):
            raise TaskError(f"Task.optimizer must be a torch.optim.Optimizer, got {type(self.optimizer).__name__}")
        if not callable(self.batch):
            raise TaskError("Task.batch must be callable as batch(step)")
        from .commitments import is_digest_map

        if self.data_sha256 is not None and not is_digest_map(self.data_sha256):
            raise TaskError("Task.data_sha256 must map config keys to SHA-256 hex digests")

    def run_step(self, batch):
        """One optimizer step; returns the loss as a float."""
        if self.train_step is not None:
            loss = self.train_step(self.model, self.optimizer, batch)
        else:
            self.optimizer.zero_grad(set_to_none=True)
            loss = self.loss(self.model, batch)
            loss.backward()
            self.optimizer.step()
        if self.scheduler is not None:
            self.scheduler.step()
        return float(loss.detach()) if isinstance(loss, torch.Tensor) else float(loss)

    def replay_step(self, engine, step: int, batch, reader=None, trace=None):
        """``run_step`` under the engine, as a replay of the verification game runs it; returns (loss, the
        step's engine statistics). An own loop's task (loop.py) runs the step in the script's loop instead."""
        from .engine import step_context

        with step_context(engine, step, reader=reader, trace=trace) as st:
            loss = self.run_step(batch)
        return loss, st.stats

    def hold(self):
        """Make this task's state the one in its model and optimizer. A no-op: only the tasks of an own loop
        (loop.py), several views over the script's one model, swap their states in and out."""


_device = torch.device("cpu")


def current_device() -> torch.device:
    """The device veritrain trains, replays or evaluates on (``--device``; the CPU by default)."""
    return _device


@contextlib.contextmanager
def using_device(device):
    """Make ``device`` the one ``current_device()`` names, for the duration (the runner sets it)."""
    global _device
    prev, _device = _device, torch.device(device)
    try:
        yield _device
    finally:
        _device = prev


def resolve(ref: str) -> str:
    return BUILTIN_TASKS.get(ref, ref)


# task functions and built Tasks handed to the Python API in this process, by reference (register)
_REGISTERED: dict[str, Callable] = {}


def register(task) -> str:
    """The reference under which the runner finds ``task``: a string as it is; a task function that can be
    imported by name as 'module:function'; any other function (a lambda, a closure, one defined in
    ``__main__``) and a built ``Task`` as 'python:module:name', found in this process only. A built Task
    is used as it is (its model's current weights are the run's initial state), so an auditor in the same
    process gives a freshly built one; both get the same reference from the code that defines them."""
    if isinstance(task, str):
        return task
    if isinstance(task, Task):
        code = task.train_step or task.loss
        ref = f"python:{getattr(code, '__module__', '?')}:{getattr(code, '__qualname__', '?')}:task"
        fn = lambda config: task  # noqa: E731
        fn.__module__, fn.__qualname__ = getattr(code, "__module__", __name__), getattr(code, "__qualname__", "task")
        _REGISTERED[ref] = fn
        return ref
    if not callable(task):
        raise TaskError(f"a task is a name, 'module:function', a function config -> Task or a Task, not "
                        f"{type(task).__name__}")
    module, name = getattr(task, "__module__", None), getattr(task, "__qualname__", "")
    if module and module != "__main__" and name.isidentifier():
        with contextlib.suppress(ImportError):
            if getattr(importlib.import_module(module), name, None) is task:
                return f"{module}:{name}"
    ref = f"python:{module}:{name}"
    _REGISTERED[ref] = task
    return ref


def register_builder(ref: str, fn: Callable):
    """Make ``ref`` build its task with ``fn`` in this process (the game's views of an own loop, loop.py)."""
    _REGISTERED[ref] = fn


def load_function(ref: str) -> Callable:
    if ref in _REGISTERED:
        return _REGISTERED[ref]
    if ref.startswith("loop:"):
        raise TaskError(f"{ref} is a run of an own loop (veritrain.Run): it is replayed by running its script, "
                        f"e.g. `veritrain audit RUN -- python {ref[5:]} ...` (and `veritrain dispute` / `veritrain "
                        f"serve` with the same `-- python {ref[5:]} ...`)")
    if ref.startswith("python:"):
        raise TaskError(f"task {ref!r} was handed to veritrain's Python API in another process; pass the same "
                        f"function or Task to this one")
    target = resolve(ref)
    if ":" not in target:
        raise TaskError(f"task {ref!r} is neither a built-in task ({', '.join(BUILTIN_TASKS)}) nor "
                        f"'module:function'")
    module_name, func_name = target.split(":", 1)
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        hint = ""
        if isinstance(e, ModuleNotFoundError) and e.name and (module_name + ".").startswith(e.name + "."):
            # the task's own module (or its package) is not on the path, not a dependency it imports
            hint = " (is its folder on PYTHONPATH? e.g. PYTHONPATH=/path/to/dir veritrain train ...)"
        raise TaskError(f"cannot import task module {module_name!r}: {e}{hint}") from None
    fn = getattr(module, func_name, None)
    if not callable(fn):
        raise TaskError(f"module {module_name!r} has no callable {func_name!r}")
    return fn


def source_hash(ref: str) -> str:
    """SHA-256 of the source file of the task's module (the auditor must run the same code)."""
    fn = load_function(ref)
    try:
        src = inspect.getsource(inspect.getmodule(fn))
    except (OSError, TypeError):
        src = fn.__qualname__
    return hashlib.sha256(src.encode()).hexdigest()


def default_config(ref: str) -> dict:
    fn = load_function(ref)
    defaults = getattr(fn, "defaults", None) or getattr(inspect.getmodule(fn), "DEFAULTS", None)
    return dict(defaults or {})


def data_paths(ref: str) -> dict | None:
    """The config keys a task reads data files from (``make_task.data_paths``), each as {"words": the values it
    takes as no path ("bytes"), "within": the subfolders it reads under a folder}; None where the task does not
    say (any string may be a path)."""
    paths = getattr(load_function(ref), "data_paths", None)
    if not isinstance(paths, dict):
        return None
    return {k: {"words": tuple(v.get("words", ())), "within": tuple(v.get("within", ()))} for k, v in paths.items()}


def build(ref: str, config: dict) -> Task:
    fn = load_function(ref)
    task = fn(dict(config))
    if not isinstance(task, Task):
        raise TaskError(f"task function {resolve(ref)} returned {type(task).__name__}, not veritrain.Task")
    normalize_optimizer(task.optimizer)
    return task


def shown_value(v, limit: int = 80) -> str:
    r = repr(v)
    return r if len(r) <= limit else f"{r[:limit]}… ({len(r)} characters)"


def check_ranges(task: str, cfg: dict, ranges: dict):
    """Each numeric setting of a built-in task inside its range, an interval as written in ``ranges``
    ("[1, inf)", "[0, 1)"; a bound "inf" admits finite values only): a config that builds and trains but means
    nothing (seq_len 0, a learning rate of inf, NaN dropout, no held-out data) is refused, naming the key."""
    for key, interval in ranges.items():
        v = cfg[key]
        low, high = (float(b) for b in interval[1:-1].split(","))
        try:  # an integer too large for a float (JSON has any size) is outside every range
            ok = (isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
                  and (v >= low if interval[0] == "[" else v > low) and (v <= high if interval[-1] == "]" else v < high))
        except OverflowError:
            ok = False
        if not ok:
            raise TaskError(f"{task}: config {key!r} = {shown_value(v)} is outside {interval}")


def normalize_optimizer(optimizer):
    """Pin the optimizer to its foreach implementation, on every device: torch picks foreach, fused or
    single-tensor kernels by device when left to choose, so a GPU trainer and a CPU auditor would otherwise
    run different ops. Foreach rather than single-tensor because the engine then rounds and scans each
    update formula once for all parameters rather than once per parameter (a small model's optimizer step
    was most of its ops: bench/RESULTS.md); the results are the same bits. Optimizers without a foreach
    implementation keep theirs; fused ones are refused (their kernels differ by device)."""
    for group in optimizer.param_groups:
        if group.get("fused"):
            raise TaskError(f"{type(optimizer).__name__}(fused=True) is not supported: the fused kernel differs "
                            f"by device; construct the optimizer without fused=True")
    for settings in (*optimizer.param_groups, optimizer.defaults):
        if "foreach" in settings:
            settings["foreach"] = True
        if "capturable" in settings:
            settings["capturable"] = False
        if "fused" in settings:
            settings["fused"] = None


def parse_overrides(pairs: list[str], defaults: dict) -> dict:
    """``key=value`` strings onto a config; values parse as JSON where they can, else stay strings."""
    import json

    config = dict(defaults)
    for pair in pairs or []:
        if "=" not in pair:
            raise TaskError(f"--set expects key=value, got {pair!r}")
        key, value = pair.split("=", 1)
        key = key.strip()
        if not key:
            raise TaskError(f"--set expects key=value, got {pair!r}")
        try:
            parsed = json.loads(value)
        except json.JSONDecodeError:
            parsed = value
        config[key] = parsed
    return config
