"""Train (and log) a task into a run directory; audit a run directory by replaying it.

Run directory (docs/FORMAT.md):

    manifest.json                          task, config, precision, thresholds, versions, checkpoints
    checkpoints/step_XXXXXXXX.safetensors  the state after X steps (X = 0 is the initial state)
    logs/step_XXXXXXXX.vtlog               the rounding log of step X (mode "verified")
    records/step_XXXXXXXX.json             what step X consumed and produced (batch hash, loss, log hash)
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import sys
import time
from dataclasses import dataclass, field

import torch

from . import __version__, hardware
from .checkpoint import CheckpointError, hash_state, load_checkpoint, save_checkpoint
from .commitments import batch_hash
from .engine import EngineConfig, ReplayMismatchError, UnsupportedOpError, step_context
from .logformat import LogFormatError, StepLogReader, StepLogWriter
from .rounding import Grid
from .task import Task, TaskError, build, default_config, source_hash

MANIFEST = "manifest.json"
FORMAT = "veritrain-run/1"


class RunError(ValueError):
    """Bad input: a missing or malformed run directory, manifest or option."""


def ckpt_name(step: int) -> str:
    return f"checkpoints/step_{step:08d}.safetensors"


def log_name(step: int) -> str:
    return f"logs/step_{step:08d}.vtlog"


def record_name(step: int) -> str:
    return f"records/step_{step:08d}.json"


def write_json_atomic(path: str, obj):
    d = os.path.dirname(os.path.abspath(path))
    os.makedirs(d, exist_ok=True)
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=1, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def file_sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def versions() -> dict:
    import numpy

    out = {"veritrain": __version__, "torch": torch.__version__, "numpy": numpy.__version__,
           "python": platform.python_version()}
    try:
        import transformers

        out["transformers"] = transformers.__version__
    except ImportError:
        pass
    return out


def _progress(total, desc, enabled):
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit="step", disable=not (enabled and sys.stderr.isatty()),
                leave=False, dynamic_ncols=True)


def _prepare_model(task: Task, mode: str, grid: Grid):
    if mode == "fp64":
        task.model.double()
    elif mode in ("verified", "nolog") and grid.drop:
        with torch.no_grad():
            for t in list(task.model.parameters()) + list(task.model.buffers()):
                if t.is_floating_point():
                    t.copy_(grid.round(t.double()))


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


def _check_new_run_dir(path: str):
    if os.path.exists(path) and (not os.path.isdir(path) or os.listdir(path)):
        raise RunError(f"{path} already exists and is not empty; choose a new --out (nothing was overwritten)")


def train(opts: TrainOptions, probe=None) -> dict:
    if opts.steps < 0 or opts.checkpoint_every <= 0:
        raise RunError("--steps must be >= 0 and --checkpoint-every > 0")
    _check_new_run_dir(opts.out)
    config = {**default_config(opts.task), **opts.config}
    engine = EngineConfig(mode=opts.mode, bits=opts.bits, seed=opts.seed,
                          thresholds=dict(opts.thresholds or {}))
    task = build(opts.task, config)
    grid = Grid(opts.bits)
    _prepare_model(task, opts.mode, grid)
    os.makedirs(opts.out, exist_ok=True)
    manifest = {
        "format": FORMAT,
        "task": opts.task,
        "task_source_sha256": source_hash(opts.task),
        "config": config,
        "seed": opts.seed,
        "mode": opts.mode,
        "bits": opts.bits,
        "thresholds": engine.thresholds,
        "slack": engine.slack,
        "steps": opts.steps,
        "checkpoint_every": opts.checkpoint_every,
        "versions": versions(),
        "hardware": hardware.describe(),
        "checkpoints": [],
        "steps_completed": 0,
        "complete": False,
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    path = lambda name: os.path.join(opts.out, name)  # noqa: E731
    digest = save_checkpoint(path(ckpt_name(0)), task.model, task.optimizer, task.scheduler, 0)
    manifest["checkpoints"].append({"step": 0, "file": ckpt_name(0), "state_sha256": digest,
                                    "file_sha256": file_sha256(path(ckpt_name(0)))})
    write_json_atomic(path(MANIFEST), manifest)
    bar = _progress(opts.steps, "train", opts.progress)
    for step in range(opts.steps):
        writer = StepLogWriter(path(log_name(step)), step, opts.bits) if opts.mode == "verified" else None
        try:
            with step_context(engine, step, writer=writer, probe=probe) as mode:
                batch = _prepare_batch(task.batch(step), opts.mode, grid)
                loss = task.run_step(batch)
            log = writer.close() if writer else None
        except BaseException:
            if writer:
                writer.abort()
            raise
        stats = mode.stats.as_dict()
        record = {"step": step, "loss": loss, "batch_sha256": batch_hash(batch),
                  "batch_indices": task.batch_indices(step) if task.batch_indices else None,
                  "log": {"file": log_name(step), **log} if log else None, "stats": stats}
        write_json_atomic(path(record_name(step)), record)
        done = step + 1
        if done % opts.checkpoint_every == 0 or done == opts.steps:
            digest = save_checkpoint(path(ckpt_name(done)), task.model, task.optimizer, task.scheduler, done)
            manifest["checkpoints"].append({"step": done, "file": ckpt_name(done), "state_sha256": digest,
                                            "file_sha256": file_sha256(path(ckpt_name(done)))})
        manifest["steps_completed"] = done
        if done % opts.checkpoint_every == 0 or done == opts.steps:
            write_json_atomic(path(MANIFEST), manifest)
        bar.update(1)
        bar.set_postfix(loss=f"{loss:.4f}")
    bar.close()
    manifest["complete"] = True
    if task.evaluate is not None:
        import copy

        # tasks evaluate with their own (float32) data; a float64 model is evaluated as a float32 copy
        model = copy.deepcopy(task.model).float() if opts.mode == "fp64" else task.model
        manifest["evaluation"] = task.evaluate(model)
    write_json_atomic(path(MANIFEST), manifest)
    return manifest


def load_manifest(run_dir: str) -> dict:
    p = os.path.join(run_dir, MANIFEST)
    if not os.path.isdir(run_dir):
        raise RunError(f"run directory {run_dir} does not exist")
    try:
        with open(p) as f:
            m = json.load(f)
    except FileNotFoundError:
        raise RunError(f"{run_dir} has no {MANIFEST}: not a veritrain run directory") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise RunError(f"{p} is not valid JSON ({e})") from None
    if not isinstance(m, dict) or m.get("format") != FORMAT:
        raise RunError(f"{p}: unknown format {m.get('format') if isinstance(m, dict) else None!r}, expected {FORMAT}")
    for key in ("task", "config", "seed", "mode", "bits", "thresholds", "steps", "checkpoints"):
        if key not in m:
            raise RunError(f"{p}: missing field {key!r}")
    return m


@dataclass
class AuditResult:
    accepted: bool
    reasons: list
    checkpoints: list
    steps: int
    corrections: dict
    suspicious: int
    suspicious_details: list
    entries: int
    seconds: float
    hardware: dict

    def as_dict(self):
        return dict(self.__dict__)


def audit(run_dir: str, out_dir: str | None = None, progress: bool = True, probe=None) -> AuditResult:
    t0 = time.perf_counter()
    m = load_manifest(run_dir)
    if out_dir:
        _check_new_run_dir(out_dir)
    try:
        task = build(m["task"], m["config"])
    except TaskError as e:
        raise RunError(f"cannot rebuild the run's task: {e}") from None
    if m.get("task_source_sha256") and source_hash(m["task"]) != m["task_source_sha256"]:
        raise RunError(f"the source of task {m['task']} differs from the trainer's (sha256 mismatch); "
                       f"audit with the same task code")
    mode, bits = m["mode"], int(m["bits"])
    engine = EngineConfig(mode=mode, bits=bits, seed=int(m["seed"]), thresholds=m["thresholds"],
                          slack=float(m.get("slack", 2.0)))
    grid = Grid(bits)
    if mode == "fp64":
        task.model.double()
    committed = {int(c["step"]): c for c in m["checkpoints"]}
    if 0 not in committed:
        raise RunError(f"{run_dir}: the manifest commits to no initial checkpoint")
    try:
        _, h0 = load_checkpoint(os.path.join(run_dir, committed[0]["file"]), task.model, task.optimizer, task.scheduler)
    except CheckpointError as e:
        raise RunError(str(e)) from None
    reasons, results = [], []
    if h0 != committed[0]["state_sha256"]:
        reasons.append(f"the initial checkpoint hashes to {h0[:16]}…, the manifest commits to "
                       f"{committed[0]['state_sha256'][:16]}…")
    steps = int(m.get("steps_completed", m["steps"]))
    totals = {"forward": 0, "backward": 0, "optimizer": 0}
    suspicious, details, entries = 0, [], 0
    bar = _progress(steps, "audit", progress)
    for step in range(steps):
        reader = None
        if mode == "verified":
            try:
                reader = StepLogReader(os.path.join(run_dir, log_name(step)), expect_step=step, expect_bits=bits)
            except LogFormatError as e:
                reasons.append(f"step {step}: {e}")
                break
        try:
            with step_context(engine, step, reader=reader, probe=probe) as st:
                batch = _prepare_batch(task.batch(step), mode, grid)
                task.run_step(batch)
        except (ReplayMismatchError, LogFormatError) as e:
            reasons.append(str(e))
            break
        finally:
            if reader:
                reader.close()
        for k in totals:
            totals[k] += st.stats.corrections[k]
        suspicious += st.stats.suspicious_count
        details += [d.__dict__ for d in st.stats.suspicious][: max(0, 50 - len(details))]
        entries += st.stats.entries_total
        rec_path = os.path.join(run_dir, record_name(step))
        if os.path.exists(rec_path):
            try:
                with open(rec_path) as f:
                    rec = json.load(f)
                if rec.get("batch_sha256") and rec["batch_sha256"] != batch_hash(batch):
                    reasons.append(f"step {step}: the trainer's data record differs from what batch({step}) yields")
            except (json.JSONDecodeError, OSError) as e:
                reasons.append(f"step {step}: unreadable data record ({e})")
        done = step + 1
        if done in committed:
            h = hash_state(task.model, task.optimizer, task.scheduler, done)
            ok = h == committed[done]["state_sha256"]
            results.append({"step": done, "trainer": committed[done]["state_sha256"], "auditor": h, "match": ok})
            if not ok:
                reasons.append(f"checkpoint after step {done}: state hash {h[:16]}… differs from the "
                               f"trainer's {committed[done]['state_sha256'][:16]}…")
            if out_dir:
                save_checkpoint(os.path.join(out_dir, ckpt_name(done)), task.model, task.optimizer, task.scheduler, done)
        bar.update(1)
    bar.close()
    if suspicious:
        reasons.append(f"{suspicious} suspicious log entries (rounding decisions far from any midpoint)")
    if not m.get("complete", True):
        reasons.append("the run is incomplete (the trainer did not finish)")
    result = AuditResult(accepted=not reasons, reasons=reasons, checkpoints=results, steps=steps,
                         corrections=totals, suspicious=suspicious, suspicious_details=details, entries=entries,
                         seconds=time.perf_counter() - t0, hardware=hardware.describe())
    if out_dir:
        write_json_atomic(os.path.join(out_dir, "audit.json"), {"run": os.path.abspath(run_dir), **result.as_dict()})
    return result
