"""Train (and log) a task into a run directory; audit a run directory by replaying it.

Run directory (docs/FORMAT.md):

    manifest.json                          task, config, precision, thresholds, versions, checkpoints,
                                           the Merkle leaves and root
    checkpoints/step_XXXXXXXX.safetensors  the state after X steps (X = 0 is the initial state)
    logs/step_XXXXXXXX.vtlog               the rounding log of step X (mode "verified")
    records/step_XXXXXXXX.json             what step X consumed (batch hash and indices), its loss and log hash
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import platform
import re
import sys
import time
from dataclasses import dataclass, field

import torch

from . import __version__, hardware, parallel, store
from .checkpoint import CheckpointError, hash_state, load_checkpoint, save_checkpoint
from .commitments import batch_hash
from .engine import EngineConfig, ReplayMismatchError, UnsupportedOpError, logged_step, step_context
from .logformat import LogFormatError, StepLogReader, StepLogWriter
from .merkle import leaf_hash, verify_inclusion
from .rounding import Grid
from .policy import TASK_CODE_FAILURES, AdmittedRun, Policy, build_failure
from .store import (INIT_LOG, MANIFEST, FORMAT, RunError, RunRejected, ckpt_name, file_sha256, load_manifest,
                    log_name, record_name, write_json_atomic)
from .task import Task, TaskError, build, default_config, source_hash, using_device

__all__ = ["MANIFEST", "FORMAT", "RunError", "ckpt_name", "log_name", "record_name", "write_json_atomic",
           "file_sha256", "load_manifest", "train", "audit", "TrainOptions", "AuditResult", "UnsupportedOpError",
           "on_device", "place_task", "to_device"]


def versions() -> dict:
    """The versions a run records (an unverified claim of the trainer's). transformers' is read from its installed
    metadata, not by importing it: the import took 0.8 s of every run of a task that does not use it."""
    from importlib import metadata

    import numpy

    out = {"veritrain": __version__, "torch": torch.__version__, "numpy": numpy.__version__,
           "python": platform.python_version()}
    try:
        out["transformers"] = metadata.version("transformers")
    except metadata.PackageNotFoundError:
        pass
    return out


def _progress(total, desc, enabled, initial=0, every=1):
    """Steps, rate and ETA: a bar on a terminal, a plain line every ``every`` steps when stderr is piped
    (CI, nohup: a log file), nothing with --quiet."""
    from tqdm import tqdm

    if enabled and not sys.stderr.isatty():
        return _ProgressLines(total, desc, initial, every)
    return tqdm(total=total, initial=initial, desc=desc, unit="step", disable=not enabled, leave=False,
                dynamic_ncols=True)


class _ProgressLines:
    """The part of tqdm's interface the runner uses, as lines on stderr: one every ``every`` steps (a
    checkpoint, an audited interval), one at the end, and one at least every minute in between."""

    def __init__(self, total, desc, initial, every):
        self.total, self.desc, self.n, self.first, self.every = total, desc, initial, initial, max(1, int(every))
        self.postfix = {}
        self.t0 = self.last = time.perf_counter()

    def set_postfix(self, refresh=True, **values):
        self.postfix.update(values)

    def update(self, k=1):
        self.n += k
        now = time.perf_counter()
        if self.n % self.every and self.n < self.total and now - self.last < 60:
            return
        self.last, elapsed = now, now - self.t0
        eta = elapsed / max(self.n - self.first, 1) * (self.total - self.n)
        values = "".join(f" {k} {v}" for k, v in self.postfix.items())
        print(f"{self.desc}: step {self.n}/{self.total}{values} elapsed {_seconds(elapsed)} eta {_seconds(eta)}",
              file=sys.stderr, flush=True)

    def close(self):
        pass


def _seconds(t: float) -> str:
    """3.1s, 12m05s, 3h07m05s."""
    if t < 60:
        return f"{t:.1f}s"
    m, s = divmod(int(t), 60)
    return f"{m}m{s:02d}s" if m < 60 else f"{m // 60}h{m % 60:02d}m{s:02d}s"


def _prepare_model(task: Task, mode: str, grid: Grid):
    if mode == "fp64":
        task.model.double()
    elif mode in ("verified", "nolog") and grid.drop:
        with torch.no_grad():
            for t in list(task.model.parameters()) + list(task.model.buffers()):
                if t.is_floating_point():
                    t.copy_(grid.round(t.double()))


@contextlib.contextmanager
def on_device(device):
    """Check ``device`` (cpu, cuda, cuda:N; hardware.DeviceError before anything is written), apply its
    settings and make it task.current_device() for the duration. Yields the torch.device."""
    device = hardware.parse_device(device)
    hardware.configure_device(device)
    with using_device(device):
        yield device


def to_device(tree, device):
    """``tree`` (a tensor, or dicts, lists and tuples holding tensors) with every tensor on ``device``."""
    from torch.utils._pytree import tree_map

    return tree_map(lambda x: x.to(device) if isinstance(x, torch.Tensor) else x, tree)


def place_task(task: Task, device) -> Task:
    """Move a task built on the CPU to ``device``: the model's parameters and buffers, the optimizer's state
    and what batch(step) returns."""
    from collections import defaultdict

    device = torch.device(device)
    opt = task.optimizer
    before = dict(task.model.named_parameters(remove_duplicate=False))
    task.model.to(device)
    # Module.to keeps each Parameter object where it can swap its data (CPU <-> CUDA); where it makes new
    # ones instead, the optimizer is pointed at them
    new = {id(before[n]): p for n, p in task.model.named_parameters(remove_duplicate=False)}
    for group in opt.param_groups:
        group["params"] = [new.get(id(p), p) for p in group["params"]]
    opt.state = defaultdict(dict, {new.get(id(p), p): s for p, s in opt.state.items()})
    with torch.no_grad():
        for group in opt.param_groups:
            for p in group["params"]:
                if p.device != device:  # a parameter the optimizer holds outside the model
                    p.data = p.data.to(device)
    for state in opt.state.values():
        for k, v in state.items():
            # 'step' counters stay where the optimizer keeps them (the CPU: veritrain pins capturable=False)
            if isinstance(v, torch.Tensor) and k != "step":
                state[k] = v.to(device)
    batch = task.batch
    task.batch = lambda step: to_device(batch(step), device)
    return task


def _prepare_batch(batch, mode: str, grid: Grid):
    from torch.utils._pytree import tree_map

    def fix(t):
        if isinstance(t, torch.Tensor) and t.is_floating_point():
            if mode == "fp64":
                return t.double()
            if mode in ("verified", "nolog"):
                return grid.round(t.double()).to(t.dtype) if grid.drop or t.dtype != torch.float32 else t
        return t

    return tree_map(fix, batch)


@dataclass
class TrainOptions:
    task: str
    out: str
    steps: int = 20
    checkpoint_every: int = 10
    bits: int = 32
    seed: int = 0
    config: dict = field(default_factory=dict)
    mode: str = "verified"
    thresholds: dict | None = None
    progress: bool = True
    resume: bool = False
    device: str = "cpu"  # where steps run; nothing written depends on it
    micro_batches: int = 1  # G > 1: a data-parallel run (parallel.py), whatever the number of processes


def build_initial(ref: str, config: dict, engine: EngineConfig, writer=None, reader=None) -> Task:
    """Build the task under the engine, so that its initial state is the same on every machine: random
    initialisation draws from the counter-based generator (domain "init"), float ops are rounded to the
    grid, and near-midpoint decisions go to the initialisation log (``writer``) or come from it
    (``reader``). The auditor rebuilds the initial state this way instead of believing the trainer's."""
    # an own loop's task is a view of the state its script built under veritrain.init, which replayed the run's
    # log (checked against its commitment) there: building the view reads no log (given the log, the build
    # found it unread, and the game ruled every dispute about a loop's initial state against the trainer)
    loop = isinstance(ref, str) and ref.startswith("loop:")
    with step_context(engine, 0, writer=writer, reader=None if loop else reader, domain="init") as mode:
        task = build(ref, config)
    # an own loop's task was built by its script, under veritrain.init with the run's log: its statistics
    task.init_stats = getattr(task, "script_init_stats", None) or mode.stats
    return task


def _check_same_data(m: dict, task: Task):
    """A trainer's process (resuming, or a rank beside rank 0) read the data the run commits to."""
    problem = store.data_problem(m.get("data_sha256"), task.data_sha256)
    if problem:
        raise RunError(f"{problem}: this process read other data than the run started from (a changed file, or "
                       f"another copy on this machine); give it the run's data")


def _init_log_reader(run_dir: str, m: dict) -> StepLogReader:
    """The run's initialisation log, checked against the hash the manifest commits to."""
    p = os.path.join(run_dir, INIT_LOG)
    raw = store.read_run_file(run_dir, INIT_LOG, store.MAX_LOG_BYTES)
    if hashlib.sha256(raw).hexdigest() != m.get("init_log_sha256"):
        raise RunRejected(f"{p} is not the initialisation log the run commits to (altered, truncated or replaced)")
    try:
        reader = StepLogReader(raw, expect_step=0, expect_bits=int(m["bits"]))
    except LogFormatError as e:
        raise RunRejected(f"{p}: {e}") from None
    reader.source = p
    return reader


def _check_new_run_dir(path: str):
    if os.path.exists(path) and (not os.path.isdir(path) or os.listdir(path)):
        raise RunError(f"{path} already exists and is not empty; choose a new --out (nothing was overwritten)")


def _new_manifest(opts: TrainOptions, config: dict, engine: EngineConfig) -> dict:
    return {
        "format": FORMAT, "task": opts.task, "task_source_sha256": source_hash(opts.task), "config": config,
        "seed": opts.seed, "mode": opts.mode, "bits": opts.bits, "thresholds": engine.thresholds,
        "slack": engine.slack, "steps": opts.steps, "checkpoint_every": opts.checkpoint_every,
        "versions": versions(), "hardware": hardware.describe(), "checkpoints": [], "leaves": [],
        "steps_completed": 0, "complete": False, "root": None,
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        **({"micro_batches": opts.micro_batches} if opts.micro_batches > 1 else {}),
    }


def _resume_state(opts: TrainOptions, device, rank: int = 0):
    """(manifest, task, first step) of a run killed mid-way, restored from its last complete checkpoint. In a
    data-parallel run rank 0 reads the run and sends the other ranks what they need (the manifest, the
    initialisation log, the checkpoint): they may be on machines without the run folder."""
    if rank != 0:
        return _resume_from_rank0(device)
    m, task, step, gone = _resume_here(opts, device)
    if parallel.world()[1] > 1:
        parallel.broadcast_bytes(json.dumps(m).encode())
        if m["mode"] == "verified":
            parallel.broadcast_bytes(store.read_run_file(opts.out, INIT_LOG))
        parallel.broadcast_bytes(store.read_run_file(opts.out, ckpt_name(step)))
    return m, task, step, gone


def _resume_from_rank0(device):
    import tempfile

    m = json.loads(parallel.broadcast_bytes(None))
    engine = EngineConfig(mode=m["mode"], bits=int(m["bits"]), seed=int(m["seed"]), thresholds=m["thresholds"],
                          slack=float(m.get("slack", 2.0)))
    reader = None
    if m["mode"] == "verified":
        reader = StepLogReader(parallel.broadcast_bytes(None), expect_step=0, expect_bits=int(m["bits"]))
    try:
        task = build_initial(m["task"], m["config"], engine, reader=reader)
    finally:
        if reader is not None:
            reader.close()
    _check_same_data(m, task)
    _prepare_model(task, m["mode"], Grid(int(m["bits"])))
    place_task(task, device)
    with tempfile.NamedTemporaryFile(suffix=".safetensors") as f:
        f.write(parallel.broadcast_bytes(None))
        f.flush()
        step, _ = load_checkpoint(f.name, task.model, task.optimizer, task.scheduler)
    return m, task, step, []


def _resume_here(opts: TrainOptions, device):
    m = load_manifest(opts.out)
    if m.get("complete"):
        raise RunError(f"{opts.out} is a complete run; nothing to resume")
    if source_hash(m["task"]) != m.get("task_source_sha256"):
        raise RunError(f"the source of task {m['task']} changed since the run started; resume with the same code")
    gone = store.remove_stray_temporaries(opts.out)
    engine = EngineConfig(mode=m["mode"], bits=int(m["bits"]), seed=int(m["seed"]), thresholds=m["thresholds"],
                          slack=float(m.get("slack", 2.0)))
    reader = _init_log_reader(opts.out, m) if m["mode"] == "verified" else None
    try:
        task = build_initial(m["task"], m["config"], engine, reader=reader)
    finally:
        if reader is not None:
            reader.close()
    _check_same_data(m, task)
    grid = Grid(int(m["bits"]))
    _prepare_model(task, m["mode"], grid)
    place_task(task, device)
    last = m["checkpoints"][-1]
    try:  # read by its canonical name, as a regular file inside the run (store.open_run_file)
        if store.run_file_sha256(opts.out, ckpt_name(last["step"])) != last.get("file_sha256"):
            raise RunError(f"{last['file']}, the run's last committed checkpoint, is altered; cannot resume")
        with store.open_run_file(opts.out, ckpt_name(last["step"])) as f:
            step, h = load_checkpoint(f, task.model, task.optimizer, task.scheduler)
    except store.RunFileError as e:
        raise RunError(f"{last['file']}, the run's last committed checkpoint, {e.problem}; cannot resume") from None
    except CheckpointError as e:
        raise RunError(str(e)) from None
    if h != last["state_sha256"] or step != last["step"]:
        raise RunError(f"{last['file']} does not hold the committed state; cannot resume")
    if opts.task != m["task"]:
        raise RunError(f"--resume: {opts.out} is a run of task {m['task']!r}, not {opts.task!r}")
    m["leaves"] = m.get("leaves", [])[: len(m["checkpoints"]) - 1]  # one leaf per checkpoint after step 0
    m["steps_completed"] = step
    # files of steps after the checkpoint were written by the killed process: they are redone
    for s in range(step, m["steps"]):
        for name in (log_name(s), record_name(s), ckpt_name(s + 1)):
            p = os.path.join(opts.out, name)
            if os.path.exists(p):
                os.remove(p)
    logs = os.path.join(opts.out, "logs")
    for name in (os.listdir(logs) if "micro_batches" in m and os.path.isdir(logs) else []):
        if re.fullmatch(r"step_[0-9]{8,}\.micro_[0-9]{5,}\.vtlog", name) and int(name[5:name.index(".")]) >= step:
            os.remove(os.path.join(logs, name))  # micro-batch logs of the redone steps
    return m, task, step, gone


class _DiscardLog:
    """A rounding log that keeps nothing: batch(step) called again outside its step runs under the same
    engine context as in the step (the trainer's code path, rounding included) without writing into the
    step's log."""

    def op(self, *args):
        pass


def _batch_work(st) -> dict:
    """The engine's work so far in a step (after batch(step): the work batch(step) did)."""
    return {"rounded ops": st.op_index, "random draws": st.random_index}


def _first_steps(steps: int) -> list[int]:
    """The steps the trainer calls before a new run's first one: batch(0), batch(1), batch(0) again."""
    return [0, 1, 0] if steps >= 2 else [0, 0] if steps == 1 else []


def _check_batches(task: Task, engine: EngineConfig, steps, name: str, recorded=None, micro_batches: int = 1) -> dict:
    """data.check_pure_batches with batch(step) called as the training step calls it: in a fresh step context
    (random draws keyed by the step, float ops rounded) and prepared. TaskError when batch(step) is not a
    pure function of the step: a run would pass a full audit but fail a partial one. In a data-parallel run
    batch(k) is micro-batch k % G of step k // G, in that micro-batch's context."""
    from .data import check_pure_batches

    grid, last = Grid(engine.bits), {}

    def call(step):
        at, domain = (step, "op") if micro_batches == 1 else (step // micro_batches,
                                                             parallel.micro_domain(step % micro_batches))
        with step_context(engine, at, writer=_DiscardLog() if engine.mode == "verified" else None,
                          domain=domain) as st:
            batch = _prepare_batch(task.batch(step), engine.mode, grid)
            last["work"] = _batch_work(st)
        return batch

    return check_pure_batches(call, steps, recorded=recorded, name=name, work_fn=lambda: last["work"])


class RunWriter:
    """The trainer's files, step by step: each step's data record, the checkpoint and Merkle leaf at each
    interval's end, the root at the end. ``state`` is (model, optimizer, scheduler). Used by own loops
    (loop.py); ``m`` is the manifest of a run that holds its checkpoint after ``start`` steps."""

    def __init__(self, out: str, m: dict, state, start: int):
        self.out, self.m, self.state = out, m, state
        self.run_sha = store.run_sha256(m)
        self.every, self.steps = m["checkpoint_every"], m["steps"]
        # a resumed run restarts at an interval boundary: its interval's earlier records are on disk
        self.record_hashes = [file_sha256(self.path(record_name(s))) for s in range((start // self.every) * self.every, start)]
        self.unsynced = []  # the interval's logs and records, synced together before its commit (store.sync_files)

    def path(self, name):
        return os.path.join(self.out, name)

    def log_writer(self, step):
        if self.m["mode"] != "verified":
            return None
        return StepLogWriter(self.path(log_name(step)), step, int(self.m["bits"]), pending=self.unsynced)

    def record(self, step, batch, indices, loss, log):
        """Write step's data record; after an interval's last step, its checkpoint, leaf and the manifest."""
        rec = store.record_bytes(step, batch_hash(batch), indices, loss, log["sha256"] if log else None)
        store.write_bytes_atomic(self.path(record_name(step)), rec, pending=self.unsynced)
        self.record_hashes.append(hashlib.sha256(rec).hexdigest())
        done, m = step + 1, self.m
        if done % self.every == 0 or done == self.steps:
            store.sync_files(self.unsynced)
            digest = save_checkpoint(self.path(ckpt_name(done)), *self.state, done)
            m["checkpoints"].append({"step": done, "file": ckpt_name(done), "state_sha256": digest,
                                     "file_sha256": file_sha256(self.path(ckpt_name(done)))})
            index = (done - 1) // self.every
            m["leaves"].append(store.leaf_data(index, index * self.every, done, self.run_sha, digest,
                                               self.record_hashes).hex())
            self.record_hashes = []
            m["steps_completed"] = done
            store.save_manifest(self.out, m)

    def finish(self, seconds: float = 0.0) -> dict:
        m = self.m
        if self.steps == 0:  # one empty interval: the root commits to the initial state
            m["leaves"] = [store.leaf_data(0, 0, 0, self.run_sha, m["initial_state_sha256"], []).hex()]
        m["train_seconds"] = m.get("train_seconds", 0.0) + seconds  # not committed: informational
        m["steps_completed"] = self.steps
        m["root"] = store.tree_of([bytes.fromhex(x) for x in m["leaves"]]).root().hex()
        m["complete"] = True
        store.save_manifest(self.out, m)
        return m


def train(opts: TrainOptions, probe=None) -> dict:
    """Train a task into ``opts.out`` (or continue a killed run with ``opts.resume``) on ``opts.device``;
    returns the manifest."""
    with on_device(opts.device) as device:
        return _train(opts, device, probe)


def _train(opts: TrainOptions, device, probe) -> dict:
    rank, size = parallel.world()
    if opts.resume:
        m, task, start, _ = _resume_state(opts, device, rank)
        mode, bits = m["mode"], int(m["bits"])
        engine = EngineConfig(mode=mode, bits=bits, seed=int(m["seed"]), thresholds=m["thresholds"],
                              slack=float(m.get("slack", 2.0)))
    else:
        if opts.steps < 0 or opts.checkpoint_every <= 0:
            raise RunError("--steps must be >= 0 and --checkpoint-every > 0")
        if not 1 <= opts.micro_batches <= store.MAX_MICRO_BATCHES:
            raise RunError(f"--micro-batches must be in 1..{store.MAX_MICRO_BATCHES}, got {opts.micro_batches}")
        parallel.assignment(opts.micro_batches, size)  # ValueError: more processes than micro-batches
        config = {**default_config(opts.task), **opts.config}
        if opts.config.get("init_seed", 0) != 0 and "init_seed" in default_config(opts.task):
            # the task seeds torch's generator with it, which a run never draws from (randomness.py): the run
            # would start from init_seed 0's weights, whatever the user asked for
            raise TaskError(f"config 'init_seed' ({str(opts.config['init_seed'])[:40]}) draws nothing in a run: the run "
                            f"seed draws the initial weights and every random op (give --seed instead)")
        engine = EngineConfig(mode=opts.mode, bits=opts.bits, seed=opts.seed, thresholds=dict(opts.thresholds or {}))
        mode, bits = opts.mode, opts.bits
        if rank == 0:
            task, m = _start_run(opts, config, engine, device)
        # the other ranks build the initial state with rank 0's initialisation decisions (other hardware
        # could decide otherwise), and take its manifest
        m = json.loads(parallel.broadcast_bytes(json.dumps(m).encode() if rank == 0 else None))
        if rank != 0:
            reader = None
            if mode == "verified":
                reader = StepLogReader(parallel.broadcast_bytes(None), expect_step=0, expect_bits=bits)
            try:
                task = build_initial(opts.task, config, engine, reader=reader)
            finally:
                if reader is not None:
                    reader.close()
            _check_same_data(m, task)
            _prepare_model(task, mode, Grid(bits))
            place_task(task, device)
        elif size > 1 and mode == "verified":
            parallel.broadcast_bytes(store.read_run_file(opts.out, INIT_LOG))
        start = 0
    num_micro = store.micro_batches(m)
    parallel.assignment(num_micro, size)
    grid = Grid(bits)
    path = lambda name: os.path.join(opts.out, name)  # noqa: E731
    run_sha = store.run_sha256(m)
    every, steps = m["checkpoint_every"], m["steps"]
    record_hashes = []
    unsynced = []  # the interval's logs and records, synced together before its commit (store.sync_files)
    first_of_interval = (start // every) * every
    if rank == 0:
        for s in range(first_of_interval, start):  # a resumed run restarts at an interval boundary
            record_hashes.append(file_sha256(path(record_name(s))))
    bar = _progress(steps, "train", opts.progress and rank == 0, initial=start, every=every)
    t_loop, comm = time.perf_counter(), 0.0
    scratch = _Scratch() if num_micro > 1 and mode == "verified" else None
    try:
        for step in range(start, steps):
            if num_micro > 1:
                loss, rec, seconds = _train_parallel_step(task, engine, step, num_micro, mode, grid, scratch, probe,
                                                          path if rank == 0 else None, unsynced)
                comm, first = comm + seconds, None
            else:
                loss, rec, first = _train_step(task, engine, step, mode, grid, probe, path, unsynced)
            if rank == 0:
                store.write_bytes_atomic(path(record_name(step)), rec, pending=unsynced)
                record_hashes.append(hashlib.sha256(rec).hexdigest())
            if step == start or step % every == 0:  # the interval's first step: called again at its checkpoint
                first_call = {step: first}
            done = step + 1
            if done % every == 0 or done == steps:
                if num_micro == 1:
                    _check_batches(task, engine, list(first_call), m["task"], recorded=first_call)  # before commit
                parallel.barrier()  # every rank has finished the interval: its state is the checkpoint's
                if rank == 0:
                    store.sync_files(unsynced)
                    digest = save_checkpoint(path(ckpt_name(done)), task.model, task.optimizer, task.scheduler, done)
                    m["checkpoints"].append({"step": done, "file": ckpt_name(done), "state_sha256": digest,
                                             "file_sha256": file_sha256(path(ckpt_name(done)))})
                    index = (done - 1) // every
                    m["leaves"].append(store.leaf_data(index, index * every, done, run_sha, digest,
                                                       record_hashes).hex())
                    record_hashes = []
                    m["steps_completed"] = done
                    store.save_manifest(opts.out, m)
                # and no rank starts the next interval before the checkpoint is committed: a rank lost there
                # would have the launcher stop rank 0 mid-commit, and the run resume from the one before
                parallel.barrier()
            bar.set_postfix(loss=f"{loss:.4f}", refresh=False)  # before update: a progress line shows this step's loss
            bar.update(1)
    finally:
        if scratch is not None:
            scratch.remove()
    bar.close()
    parallel.barrier()
    if rank != 0:
        return m
    if steps == 0:  # one empty interval: the root commits to the initial state
        m["leaves"] = [store.leaf_data(0, 0, 0, run_sha, m["initial_state_sha256"], []).hex()]
    m["train_seconds"] = m.get("train_seconds", 0.0) + (time.perf_counter() - t_loop)  # not committed: informational
    if num_micro > 1:  # rank 0's time in the step's collectives (informational, like train_seconds)
        m["train_comm_seconds"] = m.get("train_comm_seconds", 0.0) + comm
    m["steps_completed"] = steps
    m["root"] = store.tree_of([bytes.fromhex(x) for x in m["leaves"]]).root().hex()
    m["complete"] = True
    if task.evaluate is not None:
        import copy

        # tasks evaluate with their own (float32) data; a float64 model is evaluated as a float32 copy
        model = copy.deepcopy(task.model).float() if mode == "fp64" else task.model
        m["evaluation"] = task.evaluate(model)
    store.save_manifest(opts.out, m)
    return m


def _start_run(opts: TrainOptions, config: dict, engine: EngineConfig, device):
    """A new run's folder: the initial state built under the engine (its log), checkpoint 0, the manifest."""
    mode, bits = opts.mode, opts.bits
    _check_new_run_dir(opts.out)
    created = not os.path.exists(opts.out)
    os.makedirs(opts.out, exist_ok=True)
    init_writer = StepLogWriter(os.path.join(opts.out, INIT_LOG), 0, bits) if mode == "verified" else None
    try:
        task = build_initial(opts.task, config, engine, writer=init_writer)
        init_log = init_writer.close() if init_writer else None
        _prepare_model(task, mode, Grid(bits))
        place_task(task, device)  # built on the CPU: the same initial state everywhere
        if opts.micro_batches > 1:
            _check_batches(task, engine, _first_steps(opts.steps * opts.micro_batches), opts.task,
                           micro_batches=opts.micro_batches)
            if task.loss is None:
                raise TaskError("a data-parallel run (--micro-batches > 1) needs a task with loss=: veritrain runs "
                                "each micro-batch's backward and the optimizer step itself")
        else:
            _check_batches(task, engine, _first_steps(opts.steps), opts.task)  # before anything is committed
    except BaseException:
        if init_writer:
            init_writer.abort()
        # nothing of the run exists yet: leave the folder as it was, so the same command can be rerun
        import shutil

        shutil.rmtree(os.path.join(opts.out, "logs"), ignore_errors=True)
        if created:
            shutil.rmtree(opts.out, ignore_errors=True)
        raise
    m = _new_manifest(opts, config, engine)
    if task.data_sha256:  # what the task read for its data settings (a path names no content)
        m["data_sha256"] = dict(task.data_sha256)
    m["init_log_sha256"] = init_log["sha256"] if init_log else None
    digest = save_checkpoint(os.path.join(opts.out, ckpt_name(0)), task.model, task.optimizer, task.scheduler, 0)
    m["checkpoints"].append({"step": 0, "file": ckpt_name(0), "state_sha256": digest,
                             "file_sha256": file_sha256(os.path.join(opts.out, ckpt_name(0)))})
    m["initial_state_sha256"] = digest
    store.save_manifest(opts.out, m)
    return task, m


def _train_step(task, engine, step, mode, grid, probe, path, unsynced):
    """One step of a one-process run: (loss, its data record, (batch hash, batch work) for _check_batches);
    its log's path goes to ``unsynced``."""
    writer = StepLogWriter(path(log_name(step)), step, grid.bits, pending=unsynced) if mode == "verified" else None
    with logged_step(engine, step, writer=writer, probe=probe) as st:
        batch = _prepare_batch(task.batch(step), mode, grid)
        work = _batch_work(st)
        loss = task.run_step(batch)
    log = st.closed_log
    indices = task.batch_indices(step) if task.batch_indices else None
    bh = batch_hash(batch)
    return loss, store.record_bytes(step, bh, indices, loss, log["sha256"] if log else None), (bh, work)


class _Scratch(parallel.PartLogs):
    """A trainer process's own folder for the logs of the parts it runs (they go to rank 0, which writes the
    run: the ranks may be on machines that do not share the run folder)."""

    def __init__(self):
        import tempfile

        self.dir = tempfile.mkdtemp(prefix="veritrain-parts-")
        self.step, self.bits = 0, 32

    def writer(self, part):
        name = f"update-{self.step}.vtlog" if part is None else f"micro-{self.step}-{part}.vtlog"
        # read back and removed within the step, never part of a commit: no fsync (a list nobody syncs)
        return StepLogWriter(os.path.join(self.dir, name), self.step, self.bits, pending=[])

    def remove(self):
        import shutil

        shutil.rmtree(self.dir, ignore_errors=True)


def _train_parallel_step(task, engine, step, num_micro, mode, grid, scratch, probe, path, unsynced):
    """One step of a data-parallel run on this process's share; ``path`` (rank 0) writes the step's logs
    (their paths to ``unsynced``). Returns (loss, the step's data record, the seconds spent in its
    collectives)."""
    if scratch is not None:
        scratch.step, scratch.bits = step, grid.bits
    parts = parallel.run_step(task, engine, step, num_micro, mode, grid, scratch or parallel.PartLogs(), probe=probe)
    if path is not None:
        for g, mb in enumerate(parts.micro):
            if mb.get("log") is not None:
                store.write_bytes_atomic(path(store.micro_log_name(step, g)), mb["log"], pending=unsynced)
        if parts.update_log is not None:
            store.write_bytes_atomic(path(log_name(step)), parts.update_log, pending=unsynced)
    update_sha = hashlib.sha256(parts.update_log).hexdigest() if parts.update_log is not None else None
    rec = store.parallel_record_bytes(step, parts.micro, parts.loss, update_sha)
    return parts.loss, rec, parts.comm_seconds


@dataclass
class AuditResult:
    accepted: bool
    reasons: list
    checkpoints: list
    intervals: list
    steps: int
    corrections: dict
    suspicious: int
    suspicious_details: list
    entries: int
    seconds: float
    hardware: dict
    root: str
    leaves: dict
    sample_seed: int | None = None
    freedom: dict = field(default_factory=dict)
    unverified: dict = field(default_factory=dict)

    def as_dict(self):
        return dict(self.__dict__)


def parse_intervals(spec: str, n: int) -> list[int]:
    """'3,5-7' -> [3, 5, 6, 7] (0-based interval indices), checked against the run's n intervals."""
    out = set()
    for part in spec.split(","):
        part = part.strip()
        if not part:
            continue
        try:
            if "-" in part:
                a, b = (int(x) for x in part.split("-", 1))
                out.update(range(a, b + 1))
            else:
                out.add(int(part))
        except ValueError:
            raise RunError(f"--intervals {spec!r}: expected indices and ranges like 3,5-7") from None
    bad = [i for i in out if not 0 <= i < n]
    if bad or not out:
        raise RunError(f"--intervals {spec!r}: the run has intervals 0..{n - 1}")
    return sorted(out)


def sample_intervals(count: int, seed: int, n: int) -> list[int]:
    from . import randomness

    if count <= 0:
        raise RunError("--sample must be positive")
    return sorted(randomness.permutation(seed, 0, n, domain="audit/sample")[:count].tolist())


def _load_audit_progress(out_dir: str, root: str) -> dict | None:
    p = os.path.join(out_dir, "audit.json")
    if not os.path.exists(p):
        _check_new_run_dir(out_dir)
        return None
    try:
        with open(p) as f:
            prev = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise RunError(f"{p} is unreadable ({e}); choose a new --out") from None
    if prev.get("root") != root:
        raise RunError(f"{out_dir} holds an audit of another run (root {str(prev.get('root'))[:16]}…); choose a new --out")
    return prev


def audit(run_dir: str, out_dir: str | None = None, progress: bool = True, probe=None, intervals=None,
          sample: int | None = None, sample_seed: int | None = None, root: str | None = None,
          policy: Policy | None = None, device="cpu") -> AuditResult:
    """Replay intervals of a run, each from its committed checkpoint, and check each against its leaf.

    Every setting comes from the auditor's ``policy`` (policy.py; the default policy without one): the
    manifest is compared with it and refused (PolicyError) where it asks for more. The initial state is
    rebuilt here, never taken from the run. ``intervals`` (indices) or ``sample`` (a count, drawn with
    ``sample_seed``, fresh randomness by default) choose a subset; with ``out_dir`` the result is saved
    after every interval and a later call with the same ``out_dir`` continues where it stopped. The
    replay runs on ``device``, whichever device the trainer used.
    """
    with on_device(device) as device:
        return _audit(run_dir, out_dir, progress, probe, intervals, sample, sample_seed, root, policy, device)


def _audit(run_dir, out_dir, progress, probe, intervals, sample, sample_seed, root, policy, device) -> AuditResult:
    t0 = time.perf_counter()
    policy = policy or Policy.from_options(root=root)
    m = load_manifest(run_dir)
    run = policy.admit(m)
    _refuse_data_inside(run_dir, run)
    rank, size = parallel.world()
    if size > 1:  # an audit on several processes: each replays its share of every step's micro-batches
        if run.micro_batches == 1:
            raise RunError(f"{run_dir} is a run of one micro-batch per step: audit it with one process")
        parallel.assignment(run.micro_batches, size)
        if sample is not None and sample_seed is None:  # one draw, rank 0's, for every rank
            import secrets

            sample_seed = json.loads(parallel.broadcast_bytes(json.dumps(secrets.randbits(63)).encode()))
    plan = AuditPlan(run_dir, m, run, root, out_dir if rank == 0 else None, intervals, sample, sample_seed)
    plan.todo = json.loads(parallel.broadcast_bytes(json.dumps(plan.todo).encode()))  # rank 0 kept the progress
    if source_hash(run.task) != m.get("task_source_sha256"):  # the trainer must have run this code
        raise RunRejected(f"the source of task {run.task} differs from the trainer's (sha256 mismatch); "
                          f"audit with the same task code")
    engine = run.engine()
    grid = Grid(run.bits)
    task, init_reasons = _rebuild_initial_state(run_dir, m, run, engine)
    place_task(task, device)  # after the initial state is hashed: it is built on the CPU
    plan.init_reasons = init_reasons
    bar = _progress(plan.steps_chosen, "audit", progress and rank == 0, initial=plan.steps_done,
                    every=run.checkpoint_every)
    for i in plan.todo:
        a, b = plan.spans[i]
        plan.add(_audit_interval(run_dir, m, task, engine, grid, i, a, b, plan.leaves, plan.tree, plan.root,
                                 plan.run_sha, probe, bar))
    bar.close()
    return plan.result(t0)


class AuditPlan:
    """One audit of a run: its commitments checked against the root, the intervals chosen, the results
    of those already verified (``out_dir`` keeps them: a later audit continues), and the verdict."""

    def __init__(self, run_dir, m, run: AdmittedRun, root, out_dir, intervals, sample, sample_seed):
        policy = run.policy
        if root is not None and policy.root not in (None, root):
            raise RunError(f"--root {root} contradicts the policy's root {policy.root}")
        self.run_dir, self.m, self.run, self.out_dir, self.policy = run_dir, m, run, out_dir, policy
        if not m.get("complete"):
            raise RunRejected(f"{run_dir}: the run is incomplete (the trainer did not finish); resume it first")
        self.leaves = [bytes.fromhex(x) for x in m.get("leaves", [])]
        self.tree = store.tree_of(self.leaves)
        self.root = root or policy.root or m.get("root")
        if self.tree.root().hex() != self.root:
            raise RunRejected(f"{run_dir}: the manifest's leaves hash to {self.tree.root().hex()[:16]}…, not to the "
                              f"committed root {str(self.root)[:16]}…")
        n = store.interval_count(run.steps, run.checkpoint_every)
        if len(self.leaves) != n:  # checked before any per-interval list is built (steps may be up to 2**40)
            raise RunRejected(f"{run_dir}: {len(self.leaves)} leaves for {n} intervals")
        # the weights the run delivers: no interval starts from them, so no replay reads them
        final = store.final_checkpoint_problem(run_dir, run.steps, self.leaves)
        self.final_reasons = [final] if final else []
        self.spans = store.intervals(run.steps, run.checkpoint_every)
        chosen = list(range(n))
        if intervals is not None:
            chosen = parse_intervals(intervals, n) if isinstance(intervals, str) else sorted(intervals)
        elif sample is not None:
            if sample_seed is None:  # unpredictable to the trainer; saved so the audit can be repeated
                import secrets

                sample_seed = secrets.randbits(63)
            chosen = sample_intervals(sample, sample_seed, n)
        self.sample_seed = sample_seed
        prev = _load_audit_progress(out_dir, self.root) if out_dir else None
        self.done = {int(r["interval"]): r for r in (prev or {}).get("intervals", []) if r.get("complete")}
        self.todo = [i for i in chosen if i not in self.done]
        self.steps_chosen = sum(self.spans[i][1] - self.spans[i][0] for i in chosen)
        self.steps_done = sum(self.spans[i][1] - self.spans[i][0] for i in chosen if i in self.done)
        self.run_sha = store.run_sha256(m)
        self.results = [self.done[i] for i in sorted(self.done)]
        self.init_reasons = []

    def add(self, r: dict):
        """One interval's result (IntervalReplay.out); saved at once with ``out_dir``."""
        r["complete"] = True
        self.results.append(r)
        self.save()

    def save(self):
        if self.out_dir:
            results = self.results
            write_json_atomic(os.path.join(self.out_dir, "audit.json"), {
                "run": os.path.abspath(self.run_dir), "root": self.root, "run_sha256": self.run_sha.hex(),
                "intervals": sorted(results, key=lambda r: r["interval"]),
                "leaves": {str(r["interval"]): r["leaf_hash"] for r in results if r.get("leaf_hash")},
                "hardware": hardware.describe(), "sample_seed": self.sample_seed,
                "initial_state_reasons": self.init_reasons, "policy": self.policy.as_dict()})

    def result(self, t0) -> AuditResult:
        results = sorted(self.results, key=lambda r: r["interval"])
        reasons = list(self.init_reasons) + self.final_reasons
        corrections = {"forward": 0, "backward": 0, "optimizer": 0}
        freedom = _add_freedom({}, {})
        suspicious, entries, details = 0, 0, []
        for r in results:
            reasons += r["reasons"]
            suspicious += r.get("suspicious", 0)
            entries += r.get("entries", 0)
            _add_freedom(freedom, r.get("freedom", {}))
            for k in corrections:
                corrections[k] += r.get("corrections", {}).get(k, 0)
            details += r.get("suspicious_details", [])
        if suspicious:
            reasons.append(f"{suspicious} suspicious log entries (rounding decisions far from any midpoint)")
        intervals = [{k: r[k] for k in ("interval", "steps", "match") if k in r} for r in results]
        for r in intervals:
            r["resumed"] = r["interval"] in self.done
        result = AuditResult(accepted=not reasons, reasons=reasons,
                             checkpoints=[c for r in results for c in r["checkpoints"]], intervals=intervals,
                             steps=sum(b - a for a, b in (self.spans[r["interval"]] for r in results)),
                             corrections=corrections, suspicious=suspicious, suspicious_details=details[:50],
                             entries=entries, seconds=time.perf_counter() - t0, hardware=hardware.describe(),
                             root=self.root, leaves={str(r["interval"]): r.get("leaf_hash") for r in results},
                             sample_seed=self.sample_seed, freedom=freedom, unverified=unverified_fields(self.m))
        self.save()
        return result


def _add_freedom(total: dict, more: dict) -> dict:
    """Sum the trainer's accepted choices (engine.StepStats.freedom) into ``total``."""
    for k in ("direction_entries", "value_entries", "value_window_total", "value_window_cells"):
        total[k] = total.get(k, 0) + more.get(k, 0)
    return total


def unverified_fields(m: dict) -> dict:
    """Manifest fields that no commitment covers (the trainer may have written anything there): shown
    as the trainer's claims, never as audited facts. ``veritrain eval`` recomputes the evaluation."""
    committed = set(store.RUN_FIELDS) | {"micro_batches", "data_sha256", "checkpoints", "leaves", "root", "manifest_sha256", "steps_completed",
                                         "complete"}
    return {k: v for k, v in m.items() if k not in committed}


def _refuse_data_inside(run_dir: str, run: AdmittedRun):
    """The auditor reads its own copy of the data: a config naming a file in the run folder (a relative path
    read from inside it, say) would have it train on what the trainer shipped."""
    from .task import data_paths

    inside = store.config_paths_inside(run_dir, run.config, data_paths(run.task))
    if inside:
        raise RunRejected(f"config {inside[0]!r} names {str(run.config[inside[0]])[:200]!r}, inside the run folder: "
                          f"the trainer's own copy, not the auditor's (give the data's path outside the run)")


def _check_data(run: AdmittedRun, task: Task):
    """The auditor's build (audit, eval) read the data the run commits to; else the run is rejected, or, where a
    contract pins the data, the auditor's own copy is not the contract's: its error."""
    problem = store.data_problem(run.data_sha256, task.data_sha256)
    if problem:  # the auditor's copy of the data is not what the run (or the contract) commits to
        if run.policy.data_sha256 is not None:
            raise RunError(f"the auditor's data: {store.data_problem(run.policy.data_sha256, task.data_sha256, 'the contract')}")
        raise RunRejected(f"data: {problem} (the auditor reads its own copy of the data; the run must commit to it)")


def _rebuild_initial_state(run_dir: str, m: dict, run: AdmittedRun, engine: EngineConfig):
    """(task, reasons): the task built by the auditor under the engine, and why its initial state is not
    the run's (empty when it is)."""
    reader = _init_log_reader(run_dir, m) if run.mode == "verified" else None
    try:
        task = build_initial(run.task, run.config, engine, reader=reader)
    except (ReplayMismatchError, LogFormatError) as e:
        raise RunRejected(f"initial state: the task's construction does not replay the run's initialisation "
                          f"log ({e})") from None
    except Exception as e:  # noqa: BLE001 - policy.build_failure: the run's own config is the trainer's
        raise build_failure(run, e) from None
    finally:
        if reader is not None:
            reader.close()
    _check_data(run, task)
    _prepare_model(task, run.mode, Grid(run.bits))
    reasons = []
    if task.init_stats.suspicious_count:
        reasons.append(f"initial state: {task.init_stats.suspicious_count} suspicious entries in {INIT_LOG}")
    h = hash_state(task.model, task.optimizer, task.scheduler, 0)
    for who, want in (("the run", m.get("initial_state_sha256")), ("the policy", run.initial_state_sha256)):
        if want is not None and h != want or (who == "the run" and want is None):
            reasons.append(f"initial state: the auditor's build of task {run.task} hashes to {h[:16]}…, "
                           f"{who} commits to {str(want)[:16]}… (the trainer started from other weights)")
    return task, reasons


class IntervalReplay:
    """The auditor's checks for one interval [a, b), step by step: the committed checkpoint it starts
    from, each step's data record and rounding log, and the state and leaf it ends at. ``audit`` runs
    each step with the task; an own loop (loop.py) runs them with the user's code between
    ``open_step`` and ``close_step``. ``out`` is the interval's result."""

    def __init__(self, run_dir, m, state, engine, i, a, b, leaves, tree, root, run_sha):
        self.run_dir, self.m, self.state, self.engine = run_dir, m, state, engine  # state: (model, optimizer, scheduler)
        self.i, self.a, self.b, self.leaves, self.tree, self.root, self.run_sha = i, a, b, leaves, tree, root, run_sha
        self.mode, self.bits = m["mode"], int(m["bits"])
        self.committed = store.parse_leaf(leaves[i])
        self.record_hashes = []
        self.out = {"interval": i, "steps": [a, b], "reasons": [], "checkpoints": [], "suspicious": 0,
                    "suspicious_details": [], "entries": 0,
                    "corrections": {"forward": 0, "backward": 0, "optimizer": 0}, "freedom": _add_freedom({}, {})}

    def fail(self, reason) -> dict:
        self.out["reasons"].append(reason)
        self.out["match"] = False
        return self.out

    def start(self) -> bool:
        """Load the committed checkpoint after a steps into the state; False (and the reason) if it is not
        the one the commitments name."""
        i, a = self.i, self.a
        start_state = self.m.get("initial_state_sha256") if i == 0 else store.parse_leaf(self.leaves[i - 1])["state_sha256"]
        ck = next((c for c in self.m["checkpoints"] if c["step"] == a), None)
        if ck is None or start_state is None:
            self.fail(f"interval {i}: the run commits to no checkpoint after {a} steps")
            return False
        try:  # by its canonical name, as a regular file inside the run (store.open_run_file)
            with store.open_run_file(self.run_dir, ckpt_name(a)) as f:
                _, h0 = load_checkpoint(f, *self.state)
        except CheckpointError as e:  # the run's own checkpoint does not fit its task: a rejection
            self.fail(f"interval {i}: {e}")
            return False
        if h0 != start_state:
            self.fail(f"interval {i}: {ck['file']} hashes to {h0[:16]}…, the commitment says {start_state[:16]}…")
            return False
        return True

    def open_step(self, step):
        """(ok, reader): the step's committed record and (verified mode) its rounding log, checked; ok is
        False (and the reason recorded) when they are not the committed ones."""
        self.log_sha, self.trainer_rec = None, None
        rp = os.path.join(self.run_dir, record_name(step))
        try:
            raw_rec = store.read_run_file(self.run_dir, record_name(step))
        except store.RunFileError as e:
            self.out["reasons"].append(f"step {step}: the trainer's data record {e}")
            return False, None
        if hashlib.sha256(raw_rec).hexdigest() != self.committed["records"][step - self.a]:
            self.out["reasons"].append(f"step {step}: {rp} is altered or truncated (its hash differs from leaf {self.i})")
            return False, None
        try:  # the committed record, read once: its log hash and batch hash are checked in close_step
            rec = json.loads(raw_rec)
        except ValueError:
            rec = None
        self.trainer_rec = rec if isinstance(rec, dict) else None
        if self.mode != "verified":
            return True, None
        lp = os.path.join(self.run_dir, log_name(step))
        try:
            raw = store.read_run_file(self.run_dir, log_name(step))
        except store.RunFileError as e:
            self.out["reasons"].append(f"step {step}: rounding log {e}")
            return False, None
        self.log_sha = hashlib.sha256(raw).hexdigest()
        if self.trainer_rec is not None and self.trainer_rec.get("log_sha256") != self.log_sha:
            self.out["reasons"].append(f"step {step}: {lp} is not the log the trainer committed to "
                                       f"(altered, truncated or replaced)")
            return False, None
        try:
            reader = StepLogReader(raw, expect_step=step, expect_bits=self.bits)
            reader.source = lp
        except LogFormatError as e:
            self.out["reasons"].append(f"step {step}: {lp}: {e}")
            return False, None
        return True, reader

    def open_parallel_step(self, step, num_micro):
        """``open_step`` for a data-parallel run: (ok, PartLogs) with every part's checked log."""
        ok, reader = self.open_step(step)
        if not ok:
            return False, None
        rec = self.trainer_rec or {}
        micro = rec.get("micro_batches")
        if not isinstance(micro, list) or len(micro) != num_micro or not all(isinstance(x, dict) for x in micro):
            self.out["reasons"].append(f"step {step}: the trainer's data record does not list the run's "
                                       f"{num_micro} micro-batches")
            return False, None
        if self.mode != "verified":
            return True, parallel.PartLogs()
        logs = _ReplayLogs(step, self.bits, reader)
        for g, x in enumerate(micro):
            name = store.micro_log_name(step, g)
            try:
                raw = store.read_run_file(self.run_dir, name)
            except store.RunFileError as e:
                self.out["reasons"].append(f"step {step}: rounding log {e}")
                return False, None
            if hashlib.sha256(raw).hexdigest() != x.get("log_sha256"):
                self.out["reasons"].append(f"step {step}: {os.path.join(self.run_dir, name)} is not the log the "
                                           f"trainer committed to (altered, truncated or replaced)")
                return False, None
            logs.raw[g], logs.names[g] = raw, os.path.join(self.run_dir, name)
        return True, logs

    def close_step(self, step, stats, batch, indices, loss):
        """Count the replayed step's corrections and suspicious entries; compare its data record."""
        out = self.out
        for k in out["corrections"]:
            out["corrections"][k] += stats.corrections[k]
        out["suspicious"] += stats.suspicious_count
        out["suspicious_details"] += [d.__dict__ for d in stats.suspicious][: max(0, 50 - len(out["suspicious_details"]))]
        out["entries"] += stats.entries_total
        _add_freedom(out["freedom"], stats.freedom())
        bh = batch_hash(batch)
        if self.trainer_rec is not None and self.trainer_rec.get("batch_sha256") != bh:
            out["reasons"].append(f"step {step}: the trainer's data record differs from what batch({step}) yields")
        self.record_hashes.append(hashlib.sha256(store.record_bytes(step, bh, indices, loss, self.log_sha)).hexdigest())

    def close_parallel_step(self, step, parts: "parallel.StepParts"):
        """``close_step`` for a data-parallel step: every rank's statistics, each micro-batch's data."""
        out = self.out
        for st in _gather_stats(parts.stats):
            for k in out["corrections"]:
                out["corrections"][k] += st["corrections"][k]
            out["suspicious"] += st["suspicious"]
            out["suspicious_details"] += st["details"][: max(0, 50 - len(out["suspicious_details"]))]
            out["entries"] += st["entries"]
            _add_freedom(out["freedom"], st["freedom"])
        theirs = (self.trainer_rec or {}).get("micro_batches") or []
        for g, (x, y) in enumerate(zip(parts.micro, theirs)):
            if x["batch_sha256"] != y.get("batch_sha256"):
                out["reasons"].append(f"step {step}: the trainer's data record of micro-batch {g} differs from what "
                                      f"batch({step * len(parts.micro) + g}) yields")
        rec = store.parallel_record_bytes(step, parts.micro, parts.loss, self.log_sha)
        self.record_hashes.append(hashlib.sha256(rec).hexdigest())

    def finish(self) -> dict:
        """After the last step: the state against the committed one, and this replay's leaf against the root."""
        out, a, b = self.out, self.a, self.b
        h = hash_state(*self.state, b)
        ok = h == self.committed["state_sha256"]
        out["checkpoints"].append({"step": b, "trainer": self.committed["state_sha256"], "auditor": h, "match": ok})
        if not ok:
            out["reasons"].append(f"checkpoint after step {b}: state hash {h[:16]}… differs from the "
                                  f"trainer's {self.committed['state_sha256'][:16]}…")
        mine = store.leaf_data(self.i, a, b, self.run_sha, h, self.record_hashes)
        out["leaf_hash"] = leaf_hash(mine).hex()
        proof = self.tree.inclusion_proof(self.i)
        out["match"] = verify_inclusion(leaf_hash(mine), self.i, len(self.leaves), proof, bytes.fromhex(self.root))
        if not out["match"] and ok:
            diff = [a + j for j, (x, y) in enumerate(zip(self.record_hashes, self.committed["records"])) if x != y]
            out["reasons"].append(f"interval {self.i}: the replay's data records differ from the committed ones at "
                                  f"steps {diff[:5]} (batch, loss or log)")
        return out


class _ReplayLogs(parallel.PartLogs):
    """The committed logs of one data-parallel step, for its replay: micro-batch g's and the update's."""

    def __init__(self, step, bits, update_reader):
        self.step, self.bits, self.update_reader, self.raw, self.names = step, bits, update_reader, {}, {}

    def reader(self, part):
        if part is None:
            return self.update_reader
        return StepLogReader(self.raw[part], expect_step=self.step, expect_bits=self.bits, source=self.names[part])

    def sha256(self, part):
        return hashlib.sha256(self.raw[part]).hexdigest()


def _gather_stats(stats) -> list[dict]:
    """The engine statistics of a data-parallel step's parts from every rank, as dicts in the step's op
    order (micro-batches 0..G-1, then the update, counted once). A suspicious entry's ``op_index`` becomes
    its position in the whole step, as the verification game numbers ops (``part`` names the part)."""
    import torch.distributed as dist

    rank, size = parallel.world()
    mine = [(g, {"corrections": dict(st.corrections), "suspicious": st.suspicious_count, "entries": st.entries_total,
                 "details": [d.__dict__ for d in st.suspicious][:50], "freedom": st.freedom(), "ops": st.ops})
            for g, st in stats if g is not None or rank == 0]
    if size > 1:
        out = [None] * size
        dist.all_gather_object(out, mine)
        mine = [x for r in out for x in r]
    parts = sorted(mine, key=lambda x: (x[0] is None, x[0] or 0))
    offset = 0
    for g, st in parts:
        for d in st["details"]:
            d["op_index"] += offset
            d["part"] = "update" if g is None else parallel.micro_domain(g)
        offset += st["ops"]
    return [st for _, st in parts]


def _audit_interval(run_dir, m, task, engine, grid, i, a, b, leaves, tree, root, run_sha, probe, bar) -> dict:
    """Replay steps [a, b) with the task from the committed checkpoint after a steps; compare with leaf i."""
    iv = IntervalReplay(run_dir, m, (task.model, task.optimizer, task.scheduler), engine, i, a, b, leaves, tree,
                        root, run_sha)
    if not iv.start():
        return iv.out
    num_micro = store.micro_batches(m)
    for step in range(a, b):
        if num_micro > 1:
            ok, logs = iv.open_parallel_step(step, num_micro)
            if not ok:
                break
            try:
                parts = parallel.run_step(task, engine, step, num_micro, m["mode"], grid, logs, probe=probe)
            except (ReplayMismatchError, LogFormatError) as e:
                iv.out["reasons"].append(str(e))
                break
            except TASK_CODE_FAILURES as e:
                iv.out["reasons"].append(f"step {step}: the step fails from the run's committed state "
                                         f"({type(e).__name__}: {str(e)[:300]})")
                break
            iv.close_parallel_step(step, parts)
            bar.update(1)
            continue
        ok, reader = iv.open_step(step)
        if not ok:
            break
        try:
            with logged_step(engine, step, reader=reader, probe=probe) as st:
                batch = _prepare_batch(task.batch(step), m["mode"], grid)
                loss = task.run_step(batch)
        except (ReplayMismatchError, LogFormatError) as e:
            iv.out["reasons"].append(str(e))
            break
        except TASK_CODE_FAILURES as e:  # the committed state or the run's config makes the task's step fail
            iv.out["reasons"].append(f"step {step}: the step fails from the run's committed state "
                                     f"({type(e).__name__}: {str(e)[:300]})")
            break
        iv.close_step(step, st.stats, batch, task.batch_indices(step) if task.batch_indices else None, loss)
        bar.update(1)
    else:
        return iv.finish()
    iv.out["match"] = False
    return iv.out


def evaluate_run(run_dir: str, step: int | None = None, policy: Policy | None = None, device="cpu") -> dict:
    """The task's held-out metric for a run's committed state (after the last interval by default), computed
    here on ``device`` by the auditor's own build of the task (the manifest's ``evaluation`` is only the
    trainer's claim). Only a state a leaf under the root commits to is evaluated (the policy's root, else the
    manifest's): the manifest's checkpoint list is not covered by the root. The metric is of the committed
    weights, not of audited ones, unless an audit accepted the run."""
    with on_device(device) as device:
        return _evaluate_run(run_dir, step, policy, device)


def committed_states(m: dict, root: str) -> dict:
    """{step: state hash} of the states a run commits to under ``root``: step 0 (the run description's
    initial state) and the end of each interval (its leaf). Raises RunRejected if the leaves do not hash to
    ``root`` or do not describe this run's intervals."""
    try:
        leaves = [bytes.fromhex(x) for x in m.get("leaves", [])]
        parsed = [store.parse_leaf(x) for x in leaves]
    except (ValueError, TypeError, RunError) as e:
        raise RunRejected(f"the manifest's leaves are malformed ({str(e):.200})") from None
    got = store.tree_of(leaves).root().hex()
    if root is not None and got != root:  # no root yet: a run still training, its leaves so far
        raise RunRejected(f"the manifest's leaves hash to {got[:16]}…, not to the committed root {str(root)[:16]}…")
    run_sha = store.run_sha256(m).hex()
    states = {0: m.get("initial_state_sha256")}
    for i, (info, (a, b)) in enumerate(zip(parsed, store.intervals(m["steps"], m["checkpoint_every"]))):
        if (info["interval"], info["first_step"], info["end_step"], info["run_sha256"]) != (i, a, b, run_sha):
            raise RunRejected(f"leaf {i} does not describe interval {i} (steps {a}..{b - 1}) of this run")
        states[b] = info["state_sha256"]
    return states


def _evaluate_run(run_dir, step, policy, device) -> dict:
    import copy

    m = load_manifest(run_dir)
    policy = policy or Policy()
    run = policy.admit(m)
    _refuse_data_inside(run_dir, run)
    states = committed_states(m, policy.root or m.get("root"))
    if step is None:
        step = max(states)
    if step not in states:
        raise RunError(f"{run_dir} commits to no state after step {step}; it commits to the states after steps "
                       f"{sorted(states)} (the starts and ends of its intervals)")
    # built as the audit builds it, replaying the run's initialisation log: a config the trainer did not build
    # (a model of 300000 layers) stops at its first op the log does not have, not after building it all
    reader = _init_log_reader(run_dir, m) if run.mode == "verified" and m.get("init_log_sha256") else None
    try:
        task = run.build_task(init_log=reader)
    except (ReplayMismatchError, LogFormatError) as e:
        raise RunRejected(f"the task's construction does not replay the run's initialisation log ({e})") from None
    finally:
        if reader is not None:
            reader.close()
    _check_data(run, task)  # the held-out data too is the run's (a copy that differs would measure other data)
    if task.evaluate is None:
        raise RunError(f"task {m['task']} defines no evaluation")
    if m["mode"] == "fp64":
        task.model.double()
    place_task(task, device)
    try:  # by its canonical name, as a regular file inside the run (store.open_run_file)
        with store.open_run_file(run_dir, ckpt_name(step)) as f:
            got_step, h = load_checkpoint(f, task.model, task.optimizer, task.scheduler)
    except CheckpointError as e:
        raise RunRejected(f"{ckpt_name(step)}: {e}") from None
    if h != states[step] or got_step != step:
        raise RunRejected(f"{ckpt_name(step)} does not hold the state the run commits to after step {step}")
    model = copy.deepcopy(task.model).float() if m["mode"] == "fp64" else task.model
    return {"task": m["task"], "step": step, "state_sha256": h, **task.evaluate(model)}
