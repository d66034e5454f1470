"""Your own training loop, made verifiable: ``veritrain.Run``.

    with veritrain.init(seed=0) as init:                  # the same initial weights on every machine
        model = build_model(); optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4)
    run = veritrain.Run("runs/a", model, optimizer, seed=0, checkpoint_every=100, init=init)
    for step, batch in run.steps(loader, num_steps):      # the batch of step s depends only on (seed, s)
        with run.step(batch):                             # the engine: records or replays this step
            loss = model(batch).loss
            loss.backward(); optimizer.step(); optimizer.zero_grad()

Run normally, the script is the trainer: ``Run`` writes a run folder exactly as ``veritrain train`` does
(docs/FORMAT.md), and a run killed mid-way continues from its last checkpoint when the script is run again.
Run with ``VERITRAIN_AUDIT=<run folder>`` in the environment (``veritrain audit RUN -- python train.py``
sets it), the same script is the auditor: ``steps`` yields only the steps of the audited intervals, each
interval starting from the run's committed checkpoint; ``step`` replays the trainer's rounding log; when
the loop ends the verdict is printed and kept in ``run.result``.

The auditor's checks are the Task path's (runner.AuditPlan, runner.IntervalReplay). What it takes from the
run is decided as in policy.py, with the script the auditor runs as the task: the script's source, its
settings (config, seed, steps, checkpoint interval, grid, mode) and the initial weights it builds are the
auditor's own, and the run's manifest is compared with them; a contract may pin more.
"""

from __future__ import annotations

import contextlib
import hashlib
import inspect
import json
import os
import shutil
import queue
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field

import torch

from . import parallel, hardware, store
from .checkpoint import CheckpointError, hash_state, load_checkpoint, save_checkpoint
from .commitments import batch_hash
from .engine import EngineConfig, ReplayMismatchError, logged_step, step_context
from .logformat import LogFormatError, StepLogReader, StepLogWriter
from .policy import Policy, PolicyError
from .rounding import Grid
from .runner import (AuditPlan, AuditResult, IntervalReplay, RunWriter, _check_new_run_dir, _init_log_reader,
                     _prepare_batch, _progress, versions)
from .store import INIT_LOG, FORMAT, RunError, RunRejected, ckpt_name, file_sha256, log_name, record_name
from .task import Task, TaskError, normalize_optimizer, register_builder

AUDIT_ENV = "VERITRAIN_AUDIT"  # the run folder to audit: the script replays it instead of training
AUDIT_OPTIONS_ENV = "VERITRAIN_AUDIT_OPTIONS"  # JSON: intervals, sample, seed, root, contract, out, result, quiet
GAME_ENV = "VERITRAIN_GAME"  # JSON: the script's role in the verification game (challenger or prover) and its options
LOOP_MODES = ("verified", "nolog", "fp32")


class LoopError(RunError):
    """The loop does not follow Run's protocol (a step outside ``with run.step(batch)``, ...)."""


def auditing() -> str | None:
    """The run folder this process audits (VERITRAIN_AUDIT), or None when it trains."""
    return os.environ.get(AUDIT_ENV) or None


def gaming() -> dict | None:
    """The verification game this process takes part in (VERITRAIN_GAME), or None."""
    raw = os.environ.get(GAME_ENV)
    if not raw:
        return None
    try:
        opts = json.loads(raw)
    except ValueError:
        raise RunError(f"{GAME_ENV} is not JSON: {raw[:80]!r}") from None
    if not isinstance(opts, dict) or opts.get("role") not in ("challenger", "prover") or not opts.get("prover"):
        raise RunError(f"{GAME_ENV} must be a JSON object with a role (challenger or prover) and a prover")
    return opts


def _audit_options() -> dict:
    raw = os.environ.get(AUDIT_OPTIONS_ENV)
    try:
        opts = json.loads(raw) if raw else {}
    except ValueError:
        raise RunError(f"{AUDIT_OPTIONS_ENV} is not JSON: {raw[:80]!r}") from None
    if not isinstance(opts, dict):
        raise RunError(f"{AUDIT_OPTIONS_ENV} must be a JSON object")
    return opts


def _refuse(reason: str):
    """Auditor: the run is refused before any replay; tell ``veritrain audit`` (if it started us) and stop.
    Started by it, the script exits with status 1 and no traceback: the verdict is ``veritrain audit``'s to
    print (the script's traceback, printed above it, read as a crash of the audit)."""
    path = (gaming() or _audit_options()).get("result")
    if path:
        store.write_json_atomic(path, {"refused": True, "accepted": False, "reasons": [reason]})
        raise SystemExit(1)
    raise RunRejected(reason)


@dataclass
class Initialization:
    """What ``init`` recorded: the engine settings it built under, its log (trainer) and its statistics."""

    seed: int
    bits: int
    mode: str
    thresholds: dict = field(default_factory=dict)
    log_path: str | None = None
    log_sha256: str | None = None
    stats: object = None
    reasons: list = field(default_factory=list)


@contextlib.contextmanager
def init(seed: int = 0, bits: int = 32, mode: str = "verified", thresholds: dict | None = None):
    """Build the model (and optimizer) inside this block so that every machine builds the same initial
    weights: random initialisation draws from the counter-based generator (domain "init"), float ops are
    computed in float64 and rounded to the grid, and near-midpoint decisions go to an initialisation log
    (the trainer's) or come from the audited run's. Pass what it yields to ``Run(..., init=...)``, with the
    same ``thresholds`` (smaller than the defaults where an auditor's contract sets smaller ceilings)."""
    if mode not in LOOP_MODES:
        raise RunError(f"mode must be one of {', '.join(LOOP_MODES)}, got {mode!r}")
    hardware.apply_process_settings()
    engine = EngineConfig(mode=mode, bits=int(bits), seed=int(seed), thresholds=_thresholds_arg(thresholds, "init"))
    rec = Initialization(seed=engine.seed, bits=engine.bits, mode=mode, thresholds=engine.thresholds)
    writer = reader = None
    run_dir, game = auditing(), gaming()
    if game and mode == "verified":
        reader, engine = _game_init_log(game, engine)
    elif run_dir and mode == "verified":
        try:
            m = store.load_manifest(run_dir)
            engine = _admitted_engine(m, _audit_options(), engine)
            reader = _init_log_reader(run_dir, m) if m.get("init_log_sha256") else None
        except RunRejected as e:  # an altered manifest or log: a verdict, as on the task path
            _refuse(str(e))
    elif mode == "verified":
        fd, rec.log_path = tempfile.mkstemp(prefix="veritrain-init-", suffix=".vtlog")
        os.close(fd)
        writer = StepLogWriter(rec.log_path, 0, rec.bits)
    try:
        with logged_step(engine, 0, writer=writer, reader=reader, domain="init") as st:
            yield rec
    except (ReplayMismatchError, LogFormatError) as e:
        _refuse(f"initial state: the script's construction does not replay the run's initialisation log ({e})")
    if st.closed_log is not None:
        rec.log_sha256 = st.closed_log["sha256"]
    rec.stats = st.stats


def _thresholds_arg(thresholds, where: str) -> dict:
    """The per-class thresholds a script gives (None: the defaults), checked as the engine checks them."""
    try:
        return EngineConfig(thresholds=dict(thresholds or {})).thresholds
    except (TypeError, ValueError) as e:
        raise RunError(f"{where}: thresholds: {e}") from None


def _admitted_engine(m: dict, opts: dict, engine: EngineConfig) -> EngineConfig:
    """The engine the auditor's side replays the initialisation log under: the run's thresholds as the auditor's
    policy admits them (each within the contract's ceilings) and the policy's slack, as the task path builds its
    task (AdmittedRun.engine) and as the steps replay. With the defaults instead, a contract's smaller ceilings
    bounded every step's rounding choices but not the initial weights'. PolicyError (a RunRejected) where the
    run is outside the policy; Run.steps checks the task against this script's own."""
    policy = Policy.from_options(contract=opts.get("contract"), root=opts.get("root"))
    if policy.task is None:
        policy.task = m.get("task")
    run = policy.admit(m, build=False)
    return EngineConfig(mode=engine.mode, bits=engine.bits, seed=engine.seed, thresholds=run.thresholds,
                        slack=run.slack)


def _script_of(frame) -> tuple[str, str]:
    """(label, source sha256) of the file that constructs the Run (through veritrain.hf.Trainer, say): the
    code an auditor must run too."""
    package = os.path.dirname(os.path.abspath(__file__)) + os.sep
    while frame.f_back is not None and os.path.abspath(frame.f_code.co_filename).startswith(package):
        frame = frame.f_back
    path = frame.f_code.co_filename
    if not os.path.isfile(path):
        raise RunError(f"veritrain.Run must be created in a script or module file (not {path}): the auditor "
                       f"runs the same file")
    with open(path, "rb") as f:
        return f"loop:{os.path.basename(path)}", hashlib.sha256(f.read()).hexdigest()


def _as_step_data(data, seed: int):
    """(batch(step), indices(step) or None, iter_steps(start, stop) or None) for a StepLoader, a torch
    DataLoader (made step-indexed with the run's seed) or a function of the step."""
    from .data import StepLoader

    if isinstance(data, torch.utils.data.DataLoader):
        data = StepLoader.from_dataloader(data, seed=seed)
    if isinstance(data, StepLoader):
        return data.batch, data.indices, data.iter_steps
    if callable(data):
        return data, None, None
    raise TaskError(f"Run.steps expects a torch DataLoader, a veritrain.data.StepLoader or a function "
                    f"batch(step), got {type(data).__name__}")


class Run:
    """One verifiable run of your own loop (see the module's docstring). The trainer's half writes the
    run (``_Recording``); with VERITRAIN_AUDIT set the auditor's half replays it (``_Replaying``)."""

    def __new__(cls, *args, **kwargs):
        if cls is Run:
            cls = _Playing if gaming() else _Replaying if auditing() else _Recording
        return super().__new__(cls)

    def __init__(self, path: str, model: torch.nn.Module, optimizer: torch.optim.Optimizer, *, scheduler=None,
                 seed: int = 0, checkpoint_every: int = 100, bits: int = 32, mode: str = "verified",
                 config: dict | None = None, init: Initialization | None = None, thresholds: dict | None = None,
                 quiet: bool = False):
        if not isinstance(model, torch.nn.Module):
            raise TaskError(f"Run: model must be a torch.nn.Module, got {type(model).__name__}")
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TaskError(f"Run: optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
        if mode not in LOOP_MODES:
            raise RunError(f"Run: mode must be one of {', '.join(LOOP_MODES)}, got {mode!r}")
        if parallel.world()[1] > 1 or parallel.launched():  # every rank would write the one run folder
            raise RunError("Run: a run of an own loop is one process; this one is a rank of several (torchrun, "
                           "torch.distributed). For data-parallel training give veritrain a Task (loss=) and "
                           "--micro-batches (docs/DISTRIBUTED.md)")
        if not 23 <= int(bits) <= 32 or int(checkpoint_every) <= 0:
            raise RunError("Run: bits must be in 23..32 and checkpoint_every positive")
        if init is not None and (init.bits, init.mode) != (int(bits), mode):
            raise RunError(f"Run: veritrain.init used bits={init.bits}, mode={init.mode}; the run bits={bits}, mode={mode}")
        self.thresholds = _thresholds_arg(thresholds, "Run")
        if init is not None and init.thresholds != self.thresholds:  # the auditor replays both under the run's
            raise RunError(f"Run: veritrain.init used other thresholds than the run's ({init.thresholds} against "
                           f"{self.thresholds}): give both the same")
        try:
            self.config = json.loads(json.dumps(config or {}))  # as the manifest will hold it
        except (TypeError, ValueError) as e:
            raise RunError(f"Run: config must be JSON data ({e})") from None
        hardware.apply_process_settings()
        normalize_optimizer(optimizer)
        self.path, self.model, self.optimizer, self.scheduler = path, model, optimizer, scheduler
        self.state = (model, optimizer, scheduler)
        self.seed, self.checkpoint_every, self.bits, self.mode = int(seed), int(checkpoint_every), int(bits), mode
        self.init, self.quiet = init, quiet
        self.grid = Grid(self.bits)
        self.task, self.source_sha256 = _script_of(sys._getframe(1))
        if self.mode in ("verified", "nolog") and self.grid.drop:  # the model lives on the coarser grid
            with torch.no_grad():
                for t in list(model.parameters()) + list(model.buffers()):
                    if t.is_floating_point():
                        t.copy_(self.grid.round(t.double()))
        self.result = None  # the auditor's AuditResult, after the loop
        self.manifest = None
        self._pending = None  # the step the loop body is running, with its batch
        self._done = None

    def engine(self, thresholds=None) -> EngineConfig:
        return EngineConfig(mode=self.mode, bits=self.bits, seed=self.seed, thresholds=dict(thresholds or {}))

    def _compare_settings(self, m: dict, steps: int):
        """The run's manifest against this script's own settings (the auditor's side runs the trainer's script)."""
        mine = {"task": self.task, "task_source_sha256": self.source_sha256, "config": self.config, "seed": self.seed,
                "steps": steps, "checkpoint_every": self.checkpoint_every, "bits": self.bits, "mode": self.mode}
        for name, want in mine.items():
            if m.get(name) != want:
                raise PolicyError(f"the run's manifest: field {name!r} is {str(m.get(name))[:200]!r}, this script's "
                                  f"is {str(want)[:200]!r} (run the trainer's script with its settings)")
        if "micro_batches" in m:  # an own loop trains one batch per step in one process; its replay reads no more
            raise PolicyError(f"the run's manifest: field 'micro_batches' is {m['micro_batches']!r:.40}, but "
                              f"an own loop's run has one batch per step (no micro-batches)")

    def _yielded(self, step, batch):
        self._pending, self._done = (step, batch), None

    def _taken(self, step):
        if self._done is None:
            raise LoopError(f"step {step}: the loop body did not run its step inside `with run.step(batch):`")
        done, self._pending, self._done = self._done, None, None
        return done

    @contextlib.contextmanager
    def step(self, batch):
        """Run the body (forward, backward, optimizer step) of the step ``steps`` just yielded under the
        engine. Yields a handle: set ``.loss`` to the loss tensor to have it recorded in the run."""
        if self._pending is None or self._done is not None:
            raise LoopError("run.step(batch) is used once per step, inside `for step, batch in run.steps(...)`")
        step, expected = self._pending
        if not _part_of(batch, expected):
            raise LoopError(f"step {step}: run.step() must be given the batch run.steps() yielded (or a part of it)")
        handle = StepHandle(step)
        with self._engine_step(step) as stats:
            yield handle
        loss = handle.loss
        self._done = {"loss": None if loss is None else float(loss.detach() if torch.is_tensor(loss) else loss),
                      "stats": stats.get("stats"), "log": stats.get("log"), "error": stats.get("error")}


def _part_of(x, tree) -> bool:
    """Whether ``x`` is ``tree`` or one of the containers or tensors inside it."""
    if x is tree:
        return True
    if isinstance(tree, dict):
        return any(_part_of(x, v) for v in tree.values())
    if isinstance(tree, (list, tuple)):
        return any(_part_of(x, v) for v in tree)
    return False


# Run(...) dispatches in __new__: show __init__'s parameters to help() and inspect.signature
_init_signature = inspect.signature(Run.__init__)
Run.__signature__ = _init_signature.replace(parameters=list(_init_signature.parameters.values())[1:])


@dataclass
class StepHandle:
    step: int
    loss: object = None


class _Recording(Run):
    """The trainer's half: writes the run folder step by step, resumable."""

    def steps(self, data, num_steps: int):
        """Yield (step, batch) for the steps still to train; after the last, the run is complete."""
        batch_of, indices_of, iter_steps = _as_step_data(data, self.seed)
        if int(num_steps) < 0:
            raise RunError("num_steps must be >= 0")
        m, start = self._resume(int(num_steps)) if os.path.exists(os.path.join(self.path, store.MANIFEST)) \
            else self._begin(int(num_steps))
        writer = RunWriter(self.path, m, self.state, start)
        self._writer = writer
        source = iter_steps(start, m["steps"]) if iter_steps else ((s, batch_of(s)) for s in range(start, m["steps"]))
        bar = _progress(m["steps"], "train", not self.quiet, initial=start)
        t0 = time.perf_counter()
        first_hash = {}
        for step, raw in source:
            batch = _prepare_batch(raw, self.mode, self.grid)
            self._yielded(step, batch)
            yield step, batch
            done = self._taken(step)
            a = (step // self.checkpoint_every) * self.checkpoint_every
            if step == a:
                first_hash[a] = batch_hash(batch)
            if (step + 1) % self.checkpoint_every == 0 or step + 1 == m["steps"]:
                _check_pure(batch_of, a, first_hash.pop(a, None), self.mode, self.grid)
            writer.record(step, batch, indices_of(step) if indices_of else None, done["loss"], done["log"])
            bar.update(1)
        bar.close()
        self.manifest = writer.finish(time.perf_counter() - t0)
        self.root = self.manifest["root"]

    @contextlib.contextmanager
    def _engine_step(self, step):
        out = {}
        with logged_step(self.engine(self._thresholds), step, writer=self._writer.log_writer(step)) as st:
            yield out
        out["log"] = st.closed_log
        out["stats"] = st.stats

    def _manifest(self, steps: int, thresholds: dict) -> dict:
        return {"format": FORMAT, "task": self.task, "task_source_sha256": self.source_sha256, "config": self.config,
                "seed": self.seed, "mode": self.mode, "bits": self.bits, "thresholds": thresholds, "slack": 2.0,
                "steps": steps, "checkpoint_every": self.checkpoint_every, "versions": versions(),
                "hardware": hardware.describe(), "checkpoints": [], "leaves": [], "steps_completed": 0,
                "complete": False, "root": None, "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}

    def _begin(self, steps: int):
        _check_new_run_dir(self.path)
        self._thresholds = self.thresholds
        m = self._manifest(steps, self.thresholds)
        os.makedirs(self.path, exist_ok=True)
        m["init_log_sha256"] = None
        if self.init is not None and self.init.log_path:
            os.makedirs(os.path.dirname(os.path.join(self.path, INIT_LOG)), exist_ok=True)
            shutil.move(self.init.log_path, os.path.join(self.path, INIT_LOG))
            m["init_log_sha256"] = self.init.log_sha256
        p0 = os.path.join(self.path, ckpt_name(0))
        digest = save_checkpoint(p0, *self.state, 0)
        m["checkpoints"].append({"step": 0, "file": ckpt_name(0), "state_sha256": digest, "file_sha256": file_sha256(p0)})
        m["initial_state_sha256"] = digest
        store.save_manifest(self.path, m)
        return m, 0

    def _resume(self, steps: int):
        """A run of this script killed mid-way: restore the last checkpoint into the model and optimizer."""
        m = store.load_manifest(self.path)
        if m.get("complete"):
            raise RunError(f"{self.path} is a complete run; choose a new path (nothing was overwritten)")
        mine = {"task": self.task, "task_source_sha256": self.source_sha256, "config": self.config, "seed": self.seed,
                "mode": self.mode, "bits": self.bits, "steps": steps, "checkpoint_every": self.checkpoint_every,
                "thresholds": self.thresholds}
        diff = [k for k, v in mine.items() if m.get(k) != v]
        if diff:
            raise RunError(f"{self.path} holds an unfinished run with other {', '.join(diff)}; resume it with the "
                           f"same script and settings, or choose a new path")
        self._thresholds = m["thresholds"]
        store.remove_stray_temporaries(self.path)
        last = m["checkpoints"][-1]
        try:
            if store.run_file_sha256(self.path, ckpt_name(last["step"])) != last.get("file_sha256"):
                raise RunError(f"{last['file']}, the run's last committed checkpoint, is altered; cannot resume")
            with store.open_run_file(self.path, ckpt_name(last["step"])) as f:
                step, h = load_checkpoint(f, *self.state)
        except store.RunFileError as e:
            raise RunError(f"{last['file']}, the run's last committed checkpoint, {e.problem}; cannot resume") from None
        except CheckpointError as e:
            raise RunError(str(e)) from None
        if h != last["state_sha256"]:
            raise RunError(f"{last['file']} does not hold the committed state; cannot resume")
        m["leaves"] = m.get("leaves", [])[: len(m["checkpoints"]) - 1]
        m["steps_completed"] = step
        for s in range(step, m["steps"]):  # written by the killed process after its last checkpoint: redone
            for name in (log_name(s), record_name(s), ckpt_name(s + 1)):
                with contextlib.suppress(FileNotFoundError):
                    os.remove(os.path.join(self.path, name))
        if not self.quiet:
            print(f"veritrain: resuming {self.path} after step {step}", file=sys.stderr)
        return m, step


def _check_pure(batch_of, step, recorded, mode, grid):
    """The data of ``step``, produced again later, must be the same bytes (partial audits start anywhere)."""
    if recorded is None:
        return
    if batch_hash(_prepare_batch(batch_of(step), mode, grid)) != recorded:
        raise TaskError(f"the data of step {step}, produced again, differs from what step {step} trained on: the "
                        f"dataset has hidden state (e.g. augmentation from torch's global RNG). Draw data randomness "
                        f"with veritrain.randomness, keyed by the example index and epoch")


class _Replaying(Run):
    """The auditor's half: replays the audited intervals of the run named by VERITRAIN_AUDIT."""

    def steps(self, data, num_steps: int):
        """Yield (step, batch) for the steps of the audited intervals, each interval from its committed
        checkpoint; after the last, ``self.result`` holds the verdict."""
        t0 = time.perf_counter()
        batch_of, indices_of, _ = _as_step_data(data, self.seed)
        run_dir = auditing()
        opts = _audit_options()
        try:
            m, run = self._admit(run_dir, int(num_steps), opts)
            plan = AuditPlan(run_dir, m, run, opts.get("root"), opts.get("out"), opts.get("intervals"),
                             opts.get("sample"), opts.get("seed"))
        except RunRejected as e:
            _refuse(str(e))
        plan.init_reasons = self._initial_state_reasons(m, run)
        engine = run.engine()
        bar = _progress(plan.steps_chosen, "audit", not (self.quiet or opts.get("quiet")), initial=plan.steps_done)
        for i in plan.todo:
            a, b = plan.spans[i]
            iv = IntervalReplay(run_dir, m, self.state, engine, i, a, b, plan.leaves, plan.tree, plan.root,
                                plan.run_sha)
            self._iv, self._engine_config = iv, engine
            if not iv.start():
                plan.add(iv.out)
                continue
            for step in range(a, b):
                ok, reader = iv.open_step(step)
                if not ok:
                    break
                self._reader = reader
                batch = _prepare_batch(batch_of(step), self.mode, self.grid)
                self._yielded(step, batch)
                try:
                    yield step, batch
                    done = self._taken(step)
                finally:
                    if reader:
                        reader.close()
                if done["error"]:
                    iv.out["reasons"].append(done["error"])
                    break
                iv.close_step(step, done["stats"], batch, indices_of(step) if indices_of else None, done["loss"])
                bar.update(1)
            else:
                plan.add(iv.finish())
                continue
            iv.out["match"] = False
            plan.add(iv.out)
        bar.close()
        self.result = plan.result(t0)
        self._report(opts)

    @contextlib.contextmanager
    def _engine_step(self, step):
        out = {}
        try:
            with step_context(self._engine_config, step, reader=self._reader) as st:
                yield out
        except (ReplayMismatchError, LogFormatError) as e:  # the step does not replay: this interval fails
            out["error"] = str(e)
            return
        out["stats"] = st.stats

    def _admit(self, run_dir: str, steps: int, opts: dict):
        """The run's manifest against the auditor's policy and against this script's own settings."""
        policy = Policy.from_options(contract=opts.get("contract"), root=opts.get("root"))
        if policy.task is None:  # the auditor runs this script: it names the task itself
            policy.task = self.task
        m = store.load_manifest(run_dir)
        run = policy.admit(m, build=False)
        self._compare_settings(m, steps)
        if policy.config is not None and m["config"] != policy.config:
            raise PolicyError(f"the run's manifest: field 'config' differs from the policy's ({policy.source})")
        return m, run

    def _initial_state_reasons(self, m: dict, run) -> list:
        """The initial weights this script built (under veritrain.init, replaying the run's log) against the
        run's commitment and the policy's pin."""
        reasons = []
        if self.init is not None and self.init.stats is not None and self.init.stats.suspicious_count:
            reasons.append(f"initial state: {self.init.stats.suspicious_count} suspicious entries in {INIT_LOG}")
        h = hash_state(*self.state, 0)
        for who, want in (("the run", m.get("initial_state_sha256")), ("the policy", run.initial_state_sha256)):
            if want is not None and h != want or (who == "the run" and want is None):
                hint = "" if self.init is not None else " (build the model inside `with veritrain.init(seed):`)"
                reasons.append(f"initial state: this script's model hashes to {h[:16]}…, {who} commits to "
                               f"{str(want)[:16]}… (the trainer started from other weights){hint}")
        return reasons

    def _report(self, opts: dict):
        from .cli import shown

        r = self.result
        if opts.get("result"):
            store.write_json_atomic(opts["result"], r.as_dict())
        if not (self.quiet or opts.get("quiet")):
            print(f"veritrain audit of {auditing()}: {'ACCEPT' if r.accepted else 'REJECT'} ({r.steps} steps "
                  f"replayed, {sum(r.corrections.values())} corrections)", file=sys.stderr)
            for reason in r.reasons[:10]:
                print(f"  - {shown(reason)}", file=sys.stderr)


_provers: dict = {}  # the game's prover, by address: veritrain.init and Run.steps ask the same one


def _audited_run(opts: dict) -> str | None:
    """The run_sha256 the challenger's saved audit records."""
    try:
        with open(os.path.join(opts["audit_dir"], "audit.json")) as f:
            return json.load(f).get("run_sha256")
    except (OSError, ValueError, AttributeError):
        return None


def _game_prover(opts: dict):
    """The trainer's side of the game: its run folder (LocalProver) or the address of its ``veritrain serve``."""
    from .protocol import LocalProver
    from .server import HttpProver

    where = str(opts["prover"])
    if where not in _provers:
        _provers[where] = HttpProver(where, timeout=float(opts.get("timeout") or 300)) \
            if where.startswith(("http://", "https://")) else LocalProver(where)
    return _provers[where]


def _game_init_log(opts: dict, engine: EngineConfig):
    """(The trainer's initialisation log, the engine to replay it under), for the script's construction under
    veritrain.init in the game, the log checked against the hash the prover's manifest commits to (the
    challenger checks that manifest against the audited run before anything else). The challenger replays
    it under its policy's admitted thresholds and slack, as the audit did (_admitted_engine); a manifest
    outside the policy is the game's to rule on."""
    try:
        prover = _game_prover(opts)
        manifest = prover.manifest()
        want = manifest.get("init_log_sha256")
        raw = prover.init_log() if want else None
    except Exception as e:  # noqa: BLE001 - a prover that cannot answer: no dispute to play
        _refuse(f"the prover did not send the run's initialisation log ({str(e)[:200]})")
    if opts.get("role") == "challenger" and isinstance(manifest, dict):
        with contextlib.suppress(RunRejected):
            engine = _admitted_engine(manifest, opts, engine)
    if raw is None:
        return None, engine
    if hashlib.sha256(raw).hexdigest() != want:
        _refuse("the prover's initialisation log is not the one its manifest commits to")
    try:
        return StepLogReader(raw, expect_step=0, expect_bits=int(engine.bits)), engine
    except LogFormatError as e:
        _refuse(f"the prover's initialisation log is malformed ({e})")


class _StepBridge:
    """Hands the steps a replay of the game asks for (on the game's thread) to the script's loop (on the main
    thread, where the user's code runs) and the outcome back. One side runs at a time."""

    def __init__(self):
        self.requests, self.replies = queue.Queue(), queue.Queue()

    def run_step(self, engine, step, batch, reader, trace):  # the game's thread
        self.requests.put(("step", (engine, step, batch, reader, trace)))
        kind, value = self.replies.get()
        if kind == "error":
            raise value
        return value

    def finish(self, outcome):  # the game's thread, at its end
        self.requests.put(("done", outcome))


class _SharedState:
    """The script has one model and optimizer; the game's replays (the challenger's, one per interval, and a
    local prover's) each see it as a task of their own. The replay that runs swaps its state in."""

    def __init__(self, state):
        self.state = state
        self._dir = tempfile.TemporaryDirectory(prefix="veritrain-game-")
        self._count = 0
        self.holder = None
        self.initial = self.snapshot()  # the script's initial state (built under veritrain.init)

    def snapshot(self) -> str:
        self._count += 1
        path = os.path.join(self._dir.name, f"state_{self._count}.safetensors")
        save_checkpoint(path, *self.state, 0)
        return path

    def hold(self, view):
        if self.holder is view:
            return
        if self.holder is not None:
            self.holder.saved = self.snapshot()
        load_checkpoint(view.saved, *self.state)
        self.holder = view


def _in_the_loop(model, optimizer, batch):
    raise LoopError("an own loop's step runs in its script's loop, not as a task's train_step")


class _LoopTask(Task):
    """A replay's view of the script's model and optimizer: its steps are run by the script's own loop."""

    def __init__(self, shared: _SharedState, bridge: _StepBridge, batch_of, indices_of, init_stats):
        model, optimizer, scheduler = shared.state
        # the example indices too: the replay rebuilds each step's data record as the script wrote it
        super().__init__(model=model, optimizer=optimizer, scheduler=scheduler, batch=batch_of,
                         batch_indices=indices_of, train_step=_in_the_loop)
        self.shared, self.bridge, self.saved = shared, bridge, shared.initial
        self.script_init_stats = init_stats
        self.hold()

    def hold(self):
        self.shared.hold(self)

    def replay_step(self, engine, step, batch, reader=None, trace=None):
        return self.bridge.run_step(engine, step, batch, reader, trace)


class _Playing(Run):
    """The script's part in the verification game (protocol.py): as the auditor's challenger (``veritrain
    dispute RUN AUDIT -- python train.py``) or as the trainer's prover (``veritrain serve RUN -- python
    train.py``). The game runs unchanged on a thread of its own, its replays seeing the script's model as
    tasks (_LoopTask); each step a replay runs is yielded by ``steps`` to the script's loop, whose body runs
    it under the engine the replay set up (its log, its op trace)."""

    def steps(self, data, num_steps: int):
        """Yield (step, batch) for each step the game replays; after the game, ``self.result`` holds its
        outcome (the verdict, for the challenger)."""
        batch_of, indices_of, _ = _as_step_data(data, self.seed)
        opts = gaming()
        try:
            prover = _game_prover(opts)
            m = prover.manifest()
            if opts["role"] == "prover" or _audited_run(opts) == store.run_sha256(m).hex():
                # the audited run (a prover that sends another manifest loses the game instead)
                self._compare_settings(m, int(num_steps))
        except RunRejected as e:
            _refuse(str(e))
        except Exception as e:  # noqa: BLE001 - no manifest: there is no run to play about
            _refuse(f"the prover did not send its manifest ({str(e)[:200]})")
        shared, bridge = _SharedState(self.state), _StepBridge()
        init_stats = self.init.stats if self.init is not None else None
        register_builder(self.task, lambda config: _LoopTask(shared, bridge, batch_of, indices_of, init_stats))
        play = self._challenge if opts["role"] == "challenger" else self._serve
        threading.Thread(target=play, args=(opts, prover, bridge), daemon=True, name="veritrain-game").start()
        while True:
            try:
                kind, request = bridge.requests.get()
            except KeyboardInterrupt:  # how a prover is stopped
                if opts["role"] != "prover":
                    raise
                print("veritrain: the prover stopped (interrupted)", file=sys.stderr)
                return
            if kind == "done":
                break
            self._request = request
            engine, step, batch, reader, trace = request
            self._yielded(step, batch)
            try:
                yield step, batch
                done = self._taken(step)
            except BaseException as e:
                bridge.replies.put(("error", LoopError(f"the script stopped in step {step} ({type(e).__name__})")))
                raise
            bridge.replies.put(("error", done["error"]) if done["error"] is not None else
                               ("ok", (done["loss"], done["stats"])))
        self.result = request
        if isinstance(request, BaseException):
            raise request
        if opts.get("result"):
            store.write_json_atomic(opts["result"], request)

    @contextlib.contextmanager
    def _engine_step(self, step):
        engine, _, _, reader, trace = self._request
        out = {"error": None}
        try:
            with step_context(engine, step, reader=reader, trace=trace) as st:
                yield out
        except (ReplayMismatchError, LogFormatError) as e:  # the replay's to judge (the trainer's log)
            out["error"] = e
            return
        out["stats"] = st.stats

    def _challenge(self, opts: dict, prover, bridge: _StepBridge):
        """The game's thread, as the auditor: the Challenger with this side's policy and the saved audit."""
        from .protocol import play

        outcome = None
        try:
            with open(os.path.join(opts["audit_dir"], "audit.json")) as f:
                audit = json.load(f)
            policy = Policy.from_options(contract=opts.get("contract"), root=opts.get("root"))
            if policy.task is None:  # the auditor runs this script: it names the task itself
                policy.task = self.task
            outcome = play(prover, audit, opts.get("root"), policy)
        except BaseException as e:  # noqa: BLE001 - handed to the main thread, which raises it
            outcome = e if isinstance(e, (RunError, TaskError)) else RunError(f"the game stopped: {type(e).__name__}: {e}")
        finally:
            bridge.finish(outcome)

    def _serve(self, opts: dict, prover, bridge: _StepBridge):
        """The game's thread, as the trainer: answer the challenger's queries over HTTP until interrupted."""
        from .server import make_server

        try:
            server = make_server(prover, opts.get("host") or "127.0.0.1", int(opts.get("port") or 0))
            host, port = server.server_address[:2]
            print(f"serving {opts['prover']} (root {prover.manifest().get('root')}) on http://{host}:{port}", flush=True)
            server.serve_forever()
        except BaseException as e:  # noqa: BLE001
            bridge.finish(RunError(f"the prover stopped: {type(e).__name__}: {e}"))


def audit_script(run_dir: str, command: list[str], *, out: str | None = None, intervals=None, sample: int | None = None,
                 sample_seed: int | None = None, root: str | None = None, contract: str | None = None,
                 quiet: bool = False) -> AuditResult:
    """Audit a run of an own loop by running ``command`` (the trainer's script, e.g. ``python train.py``)
    with VERITRAIN_AUDIT set; returns its AuditResult. RunRejected when the run was refused."""
    if not command:
        raise RunError("audit: give the command that runs the training script after `--`")
    if not os.path.isfile(os.path.join(run_dir, store.MANIFEST)):
        raise RunError(f"{run_dir} is not a run folder (no {store.MANIFEST})")
    with tempfile.TemporaryDirectory(prefix="veritrain-audit-") as tmp:
        result = os.path.join(tmp, "result.json")
        opts = {"out": os.path.abspath(out) if out else None, "intervals": intervals, "sample": sample,
                "seed": sample_seed, "root": root, "contract": os.path.abspath(contract) if contract else None,
                "result": result, "quiet": quiet}
        env = {AUDIT_ENV: os.path.abspath(run_dir), AUDIT_OPTIONS_ENV: json.dumps(opts)}
        # our stdout is the verdict (--json)
        data = _run_script(command, env, result, "audit", stdout=sys.stderr)
    if data.get("refused"):
        raise RunRejected("; ".join(data["reasons"]))
    return AuditResult(**data)


def dispute_script(prover: str, audit_dir: str, command: list[str], *, root: str | None = None,
                   contract: str | None = None, timeout: float = 300.0) -> dict:
    """Play the verification game about a run of an own loop, as the auditor, by running ``command`` (the
    trainer's script) with VERITRAIN_GAME set; returns the verdict as a dict. ``prover``: the run folder or
    the http:// address of ``veritrain serve RUN -- python train.py``. RunRejected when refused."""
    if not command:
        raise RunError("dispute: give the command that runs the training script after `--`")
    if not os.path.isfile(os.path.join(audit_dir, "audit.json")):
        raise RunError(f"{audit_dir} has no audit.json: run `veritrain audit RUN --out {audit_dir} -- ...` first")
    if not prover.startswith(("http://", "https://")):
        if not os.path.isfile(os.path.join(prover, store.MANIFEST)):
            raise RunError(f"{prover} is not a run folder (no {store.MANIFEST})")
        prover = os.path.abspath(prover)
    with tempfile.TemporaryDirectory(prefix="veritrain-dispute-") as tmp:
        result = os.path.join(tmp, "result.json")
        opts = {"role": "challenger", "prover": prover, "audit_dir": os.path.abspath(audit_dir), "root": root,
                "contract": os.path.abspath(contract) if contract else None, "timeout": timeout, "result": result}
        data = _run_script(command, {GAME_ENV: json.dumps(opts)}, result, "dispute", stdout=sys.stderr)
    if data.get("refused"):
        raise RunRejected("; ".join(data["reasons"]))
    return data


def serve_script(run_dir: str, command: list[str], *, host: str = "127.0.0.1", port: int = 0) -> int:
    """Answer the game's queries about a run of an own loop (the trainer's side) by running ``command`` (its
    script) with VERITRAIN_GAME set, until interrupted; the script prints the address it serves on."""
    if not command:
        raise RunError("serve: give the command that runs the training script after `--`")
    if not os.path.isfile(os.path.join(run_dir, store.MANIFEST)):
        raise RunError(f"{run_dir} is not a run folder (no {store.MANIFEST})")
    opts = {"role": "prover", "prover": os.path.abspath(run_dir), "host": host, "port": port}
    env = dict(os.environ, **{GAME_ENV: json.dumps(opts)})
    env.pop(AUDIT_ENV, None)  # one role per script
    try:
        return subprocess.call(command, env=env, preexec_fn=_stop_with_parent)
    except OSError as e:
        raise RunError(f"cannot run {command[0]!r}: {e.strerror or e}") from None


def _run_script(command: list[str], env: dict, result: str, what: str, stdout=None) -> dict:
    """Run the script with ``env`` added; returns the JSON it left at ``result``."""
    full = dict(os.environ, **env)
    full.pop(AUDIT_ENV if GAME_ENV in env else GAME_ENV, None)  # one role per script
    try:
        rc = subprocess.call(command, env=full, stdout=stdout, preexec_fn=_stop_with_parent)
    except OSError as e:
        raise RunError(f"cannot run {command[0]!r}: {e.strerror or e}") from None
    if not os.path.exists(result):
        raise RunError(f"the script ({' '.join(command)}) exited with code {rc} before it finished the {what} "
                       f"(its output above says why)")
    with open(result) as f:
        return json.load(f)


def _stop_with_parent():
    """In the script's process, before it starts: stop when the veritrain command that runs it ends, even if
    that one is killed (Linux; subprocess.call already stops the script when the command is interrupted)."""
    import ctypes
    import signal

    with contextlib.suppress(Exception):
        ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGTERM))  # PR_SET_PDEATHSIG
