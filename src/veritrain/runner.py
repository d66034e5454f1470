"""Train (and log) a task into a run directory; audit a run directory by replaying it.

Run directory (docs/FORMAT.md):

    manifest.json                          task, config, precision, thresholds, versions, checkpoints,
                                           the Merkle leaves and root
    checkpoints/step_XXXXXXXX.safetensors  the state after X steps (X = 0 is the initial state)
    logs/step_XXXXXXXX.vtlog               the rounding log of step X (mode "verified")
    records/step_XXXXXXXX.json             what step X consumed (batch hash and indices), its loss and log hash
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

from . import __version__, hardware, store
from .checkpoint import CheckpointError, hash_state, load_checkpoint, save_checkpoint
from .commitments import batch_hash
from .engine import EngineConfig, ReplayMismatchError, UnsupportedOpError, step_context
from .logformat import LogFormatError, StepLogReader, StepLogWriter
from .merkle import leaf_hash, verify_inclusion
from .rounding import Grid
from .store import (MANIFEST, FORMAT, RunError, ckpt_name, file_sha256, load_manifest, log_name, record_name,
                    write_json_atomic)
from .task import Task, TaskError, build, default_config, source_hash

__all__ = ["MANIFEST", "FORMAT", "RunError", "ckpt_name", "log_name", "record_name", "write_json_atomic",
           "file_sha256", "load_manifest", "train", "audit", "TrainOptions", "AuditResult", "UnsupportedOpError"]


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


def _progress(total, desc, enabled, initial=0):
    """Steps, rate and ETA on a terminal; nothing when stderr is piped or --quiet."""
    from tqdm import tqdm

    return tqdm(total=total, initial=initial, desc=desc, unit="step",
                disable=not (enabled and sys.stderr.isatty()), leave=False, dynamic_ncols=True)


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
    resume: bool = False


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
    }


def _resume_state(opts: TrainOptions):
    """(manifest, task, first step) of a run killed mid-way, restored from its last complete checkpoint."""
    m = load_manifest(opts.out)
    if m.get("complete"):
        raise RunError(f"{opts.out} is a complete run; nothing to resume")
    if source_hash(m["task"]) != m.get("task_source_sha256"):
        raise RunError(f"the source of task {m['task']} changed since the run started; resume with the same code")
    gone = store.remove_stray_temporaries(opts.out)
    task = build(m["task"], m["config"])
    grid = Grid(int(m["bits"]))
    _prepare_model(task, m["mode"], grid)
    last = m["checkpoints"][-1]
    path = os.path.join(opts.out, last["file"])
    if not os.path.exists(path) or file_sha256(path) != last.get("file_sha256"):
        raise RunError(f"{last['file']}, the run's last committed checkpoint, is missing or altered; cannot resume")
    try:
        step, h = load_checkpoint(path, task.model, task.optimizer, task.scheduler)
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
    return m, task, step, gone


def train(opts: TrainOptions, probe=None) -> dict:
    """Train a task into ``opts.out`` (or continue a killed run with ``opts.resume``); returns the manifest."""
    if opts.resume:
        m, task, start, _ = _resume_state(opts)
        mode, bits = m["mode"], int(m["bits"])
        engine = EngineConfig(mode=mode, bits=bits, seed=int(m["seed"]), thresholds=m["thresholds"],
                              slack=float(m.get("slack", 2.0)))
    else:
        if opts.steps < 0 or opts.checkpoint_every <= 0:
            raise RunError("--steps must be >= 0 and --checkpoint-every > 0")
        _check_new_run_dir(opts.out)
        config = {**default_config(opts.task), **opts.config}
        engine = EngineConfig(mode=opts.mode, bits=opts.bits, seed=opts.seed, thresholds=dict(opts.thresholds or {}))
        task = build(opts.task, config)
        mode, bits = opts.mode, opts.bits
        _prepare_model(task, mode, Grid(bits))
        os.makedirs(opts.out, exist_ok=True)
        m = _new_manifest(opts, config, engine)
        digest = save_checkpoint(os.path.join(opts.out, ckpt_name(0)), task.model, task.optimizer, task.scheduler, 0)
        m["checkpoints"].append({"step": 0, "file": ckpt_name(0), "state_sha256": digest,
                                 "file_sha256": file_sha256(os.path.join(opts.out, ckpt_name(0)))})
        m["initial_state_sha256"] = digest
        store.save_manifest(opts.out, m)
        start = 0
    grid = Grid(bits)
    path = lambda name: os.path.join(opts.out, name)  # noqa: E731
    run_sha = store.run_sha256(m)
    every, steps = m["checkpoint_every"], m["steps"]
    record_hashes = []
    first_of_interval = (start // every) * every
    for s in range(first_of_interval, start):  # a resumed run restarts at an interval boundary
        record_hashes.append(file_sha256(path(record_name(s))))
    bar = _progress(steps, "train", opts.progress, initial=start)
    t_loop = time.perf_counter()
    for step in range(start, steps):
        writer = StepLogWriter(path(log_name(step)), step, bits) if mode == "verified" else None
        try:
            with step_context(engine, step, writer=writer, probe=probe):
                batch = _prepare_batch(task.batch(step), mode, grid)
                loss = task.run_step(batch)
            log = writer.close() if writer else None
        except BaseException:
            if writer:
                writer.abort()
            raise
        indices = task.batch_indices(step) if task.batch_indices else None
        rec = store.record_bytes(step, batch_hash(batch), indices, loss, log["sha256"] if log else None)
        store.write_bytes_atomic(path(record_name(step)), rec)
        record_hashes.append(hashlib.sha256(rec).hexdigest())
        done = step + 1
        if done % every == 0 or done == steps:
            digest = save_checkpoint(path(ckpt_name(done)), task.model, task.optimizer, task.scheduler, done)
            m["checkpoints"].append({"step": done, "file": ckpt_name(done), "state_sha256": digest,
                                     "file_sha256": file_sha256(path(ckpt_name(done)))})
            index = (done - 1) // every
            m["leaves"].append(store.leaf_data(index, index * every, done, run_sha, digest, record_hashes).hex())
            record_hashes = []
            m["steps_completed"] = done
            store.save_manifest(opts.out, m)
        bar.update(1)
        bar.set_postfix(loss=f"{loss:.4f}")
    bar.close()
    m["train_seconds"] = m.get("train_seconds", 0.0) + (time.perf_counter() - t_loop)  # not committed: informational
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
          sample: int | None = None, sample_seed: int = 0, root: str | None = None) -> AuditResult:
    """Replay intervals of a run, each from its committed checkpoint, and check each against its leaf.

    ``intervals`` (indices) or ``sample`` (a count) choose a subset; with ``out_dir`` the result is
    saved after every interval and a later call with the same ``out_dir`` continues where it stopped.
    """
    t0 = time.perf_counter()
    m = load_manifest(run_dir)
    reasons = []
    if not m.get("complete"):
        raise RunError(f"{run_dir}: the run is incomplete (the trainer did not finish); resume it first")
    leaves = [bytes.fromhex(x) for x in m.get("leaves", [])]
    tree = store.tree_of(leaves)
    committed_root = root or m.get("root")
    if tree.root().hex() != committed_root:
        raise RunError(f"{run_dir}: the manifest's leaves hash to {tree.root().hex()[:16]}…, not to the committed "
                       f"root {str(committed_root)[:16]}…")
    spans = store.intervals(int(m["steps"]), m["checkpoint_every"])
    n = len(spans)
    if len(leaves) != n:
        raise RunError(f"{run_dir}: {len(leaves)} leaves for {n} intervals")
    chosen = list(range(n))
    if intervals is not None:
        chosen = parse_intervals(intervals, n) if isinstance(intervals, str) else sorted(intervals)
    elif sample is not None:
        chosen = sample_intervals(sample, sample_seed, n)
    prev = _load_audit_progress(out_dir, committed_root) if out_dir else None
    done = {int(r["interval"]): r for r in (prev or {}).get("intervals", []) if r.get("complete")}
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
    run_sha = store.run_sha256(m)
    results = [done[i] for i in sorted(done)]
    state = {"suspicious": 0, "details": [], "entries": 0, "corrections": {"forward": 0, "backward": 0, "optimizer": 0}}
    for r in results:
        state["suspicious"] += r.get("suspicious", 0)
        state["entries"] += r.get("entries", 0)
        for k in state["corrections"]:
            state["corrections"][k] += r.get("corrections", {}).get(k, 0)
        state["details"] += r.get("suspicious_details", [])
    todo = [i for i in chosen if i not in done]
    bar = _progress(sum(spans[i][1] - spans[i][0] for i in chosen), "audit", progress,
                    initial=sum(spans[i][1] - spans[i][0] for i in chosen if i in done))

    def save():
        if out_dir:
            write_json_atomic(os.path.join(out_dir, "audit.json"), {
                "run": os.path.abspath(run_dir), "root": committed_root, "run_sha256": run_sha.hex(),
                "intervals": sorted(results, key=lambda r: r["interval"]),
                "leaves": {str(r["interval"]): r["leaf_hash"] for r in results if r.get("leaf_hash")},
                "hardware": hardware.describe()})

    for i in todo:
        a, b = spans[i]
        r = _audit_interval(run_dir, m, task, engine, grid, i, a, b, leaves, tree, committed_root, run_sha, probe, bar)
        r["complete"] = True
        results.append(r)
        state["suspicious"] += r["suspicious"]
        state["entries"] += r["entries"]
        for k in state["corrections"]:
            state["corrections"][k] += r["corrections"][k]
        state["details"] += r["suspicious_details"]
        save()
    bar.close()
    results.sort(key=lambda r: r["interval"])
    for r in results:
        reasons += r["reasons"]
    if state["suspicious"]:
        reasons.append(f"{state['suspicious']} suspicious log entries (rounding decisions far from any midpoint)")
    checkpoints = [c for r in results for c in r["checkpoints"]]
    result = AuditResult(accepted=not reasons, reasons=reasons, checkpoints=checkpoints,
                         intervals=[{k: r[k] for k in ("interval", "steps", "match", "resumed") if k in r} for r in results],
                         steps=sum(b - a for a, b in (spans[r["interval"]] for r in results)),
                         corrections=state["corrections"], suspicious=state["suspicious"],
                         suspicious_details=state["details"][:50], entries=state["entries"],
                         seconds=time.perf_counter() - t0, hardware=hardware.describe(), root=committed_root,
                         leaves={str(r["interval"]): r.get("leaf_hash") for r in results})
    for r in result.intervals:
        r["resumed"] = r["interval"] in done
    save()
    return result


def _audit_interval(run_dir, m, task, engine, grid, i, a, b, leaves, tree, root, run_sha, probe, bar) -> dict:
    """Replay steps [a, b) from the committed checkpoint after a steps; compare with leaf i."""
    mode, bits = m["mode"], int(m["bits"])
    out = {"interval": i, "steps": [a, b], "reasons": [], "checkpoints": [], "suspicious": 0,
           "suspicious_details": [], "entries": 0, "corrections": {"forward": 0, "backward": 0, "optimizer": 0}}
    committed = store.parse_leaf(leaves[i])
    start_state = m.get("initial_state_sha256") if i == 0 else store.parse_leaf(leaves[i - 1])["state_sha256"]
    ck = next((c for c in m["checkpoints"] if c["step"] == a), None)
    if ck is None or start_state is None:
        out["reasons"].append(f"interval {i}: the run commits to no checkpoint after {a} steps")
        out["match"] = False
        return out
    try:
        _, h0 = load_checkpoint(os.path.join(run_dir, ck["file"]), task.model, task.optimizer, task.scheduler)
    except CheckpointError as e:
        raise RunError(str(e)) from None
    if h0 != start_state:
        out["reasons"].append(f"interval {i}: {ck['file']} hashes to {h0[:16]}…, the commitment says {start_state[:16]}…")
        out["match"] = False
        return out
    record_hashes = []
    for step in range(a, b):
        reader, log_sha = None, None
        rp = os.path.join(run_dir, record_name(step))
        try:
            with open(rp, "rb") as f:
                raw_rec = f.read(1 << 20)
        except OSError as e:
            out["reasons"].append(f"step {step}: cannot read the trainer's data record {rp} ({e.strerror})")
            break
        if hashlib.sha256(raw_rec).hexdigest() != committed["records"][step - a]:
            out["reasons"].append(f"step {step}: {rp} is altered or truncated (its hash differs from leaf {i})")
            break
        try:  # the committed record, read once: its log hash and batch hash are checked below
            trainer_rec = json.loads(raw_rec)
        except ValueError:
            trainer_rec = None
        if not isinstance(trainer_rec, dict):
            trainer_rec = None
        if mode == "verified":
            lp = os.path.join(run_dir, log_name(step))
            try:
                with open(lp, "rb") as f:
                    raw = f.read()
            except OSError as e:
                out["reasons"].append(f"step {step}: cannot read rounding log {lp} ({e.strerror})")
                break
            log_sha = hashlib.sha256(raw).hexdigest()
            if trainer_rec is not None and trainer_rec.get("log_sha256") != log_sha:
                out["reasons"].append(f"step {step}: {lp} is not the log the trainer committed to "
                                      f"(altered, truncated or replaced)")
                break
            try:
                reader = StepLogReader(raw, expect_step=step, expect_bits=bits)
                reader.source = lp
            except LogFormatError as e:
                out["reasons"].append(f"step {step}: {lp}: {e}")
                break
        try:
            with step_context(engine, step, reader=reader, probe=probe) as st:
                batch = _prepare_batch(task.batch(step), mode, grid)
                loss = task.run_step(batch)
        except (ReplayMismatchError, LogFormatError) as e:
            out["reasons"].append(str(e))
            break
        finally:
            if reader:
                reader.close()
        for k in out["corrections"]:
            out["corrections"][k] += st.stats.corrections[k]
        out["suspicious"] += st.stats.suspicious_count
        out["suspicious_details"] += [d.__dict__ for d in st.stats.suspicious][: max(0, 50 - len(out["suspicious_details"]))]
        out["entries"] += st.stats.entries_total
        bh = batch_hash(batch)
        if trainer_rec is not None and trainer_rec.get("batch_sha256") != bh:
            out["reasons"].append(f"step {step}: the trainer's data record differs from what batch({step}) yields")
        indices = task.batch_indices(step) if task.batch_indices else None
        record_hashes.append(hashlib.sha256(store.record_bytes(step, bh, indices, loss, log_sha)).hexdigest())
        bar.update(1)
    else:
        h = hash_state(task.model, task.optimizer, task.scheduler, b)
        ok = h == committed["state_sha256"]
        out["checkpoints"].append({"step": b, "trainer": committed["state_sha256"], "auditor": h, "match": ok})
        if not ok:
            out["reasons"].append(f"checkpoint after step {b}: state hash {h[:16]}… differs from the "
                                  f"trainer's {committed['state_sha256'][:16]}…")
        mine = store.leaf_data(i, a, b, run_sha, h, record_hashes)
        out["leaf_hash"] = leaf_hash(mine).hex()
        proof = tree.inclusion_proof(i)
        out["match"] = verify_inclusion(leaf_hash(mine), i, len(leaves), proof, bytes.fromhex(root))
        if not out["match"] and ok:
            diff = [a + j for j, (x, y) in enumerate(zip(record_hashes, committed["records"])) if x != y]
            out["reasons"].append(f"interval {i}: the replay's data records differ from the committed ones at steps "
                                  f"{diff[:5]} (batch, loss or log)")
        return out
    out["match"] = False
    return out


def evaluate_run(run_dir: str, step: int | None = None) -> dict:
    """The task's held-out metric for a run's checkpoint (the last one by default)."""
    import copy

    m = load_manifest(run_dir)
    ck = m["checkpoints"][-1] if step is None else next((c for c in m["checkpoints"] if c["step"] == step), None)
    if ck is None:
        raise RunError(f"{run_dir} has no checkpoint after step {step}; it has "
                       f"{[c['step'] for c in m['checkpoints']]}")
    try:
        task = build(m["task"], m["config"])
    except TaskError as e:
        raise RunError(f"cannot rebuild the run's task: {e}") from None
    if task.evaluate is None:
        raise RunError(f"task {m['task']} defines no evaluation")
    if m["mode"] == "fp64":
        task.model.double()
    try:
        _, h = load_checkpoint(os.path.join(run_dir, ck["file"]), task.model, task.optimizer, task.scheduler)
    except CheckpointError as e:
        raise RunError(str(e)) from None
    if h != ck["state_sha256"]:
        raise RunError(f"{ck['file']} does not hold the committed state")
    model = copy.deepcopy(task.model).float() if m["mode"] == "fp64" else task.model
    return {"task": m["task"], "step": ck["step"], "state_sha256": h, **task.evaluate(model)}
