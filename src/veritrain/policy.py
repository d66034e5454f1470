"""The auditor's trust boundary: what it takes from a run, and on whose word.

A run folder is written by the trainer, who may lie. Every setting that decides what "honest training"
means — the task and its source, config, seed, steps, checkpoint interval, grid, mode, thresholds,
slack, initial state — comes from the auditor's own **policy**: a contract the client wrote
(``veritrain contract``), flags the auditor gave, or the defaults below. The run's manifest is only
*compared* against it; a run asking for anything outside it is refused with the field named.

    field                where the auditor's value comes from            a run outside it
    task                 contract / --task; else built-in tasks only     refused: no module the run names
                                                                          is ever imported
    task_source_sha256   contract (else: the trainer's, then the code     refused / rejected
                         the auditor runs is hashed and compared)
    config, seed,        contract (else: the run's, for a task the        refused
    steps, every, bits,  auditor admitted; a config of its task's keys,
    mode                 each of its default's type and, for a built-in
                         task, inside its range (RANGES), that builds)
    thresholds           ceilings: contract, else rules.DEFAULT_THRESHOLDS refused (a larger threshold makes
                                                                          more results free value entries)
    slack                the policy's (default 2.0); the run's may only    refused; the auditor checks with
                         be smaller                                       its own
    initial state        contract's hash, else rebuilt by the auditor     rejected
                         (task built under the engine, runner.py)
    micro_batches        contract (else: the run's, 2..4096; absent       refused
                         means one micro-batch per step); a contract
                         that pins the config and not this pins 1
    (seed: a contract that pins the config and names no seed pins 0)

docs/SECURITY.md has the threat model this implements.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field

from .commitments import is_digest_map
from .store import FORMAT, MAX_MICRO_BATCHES, RunError, RunRejected

CONTRACT_FORMAT = "veritrain-contract/1"
DEFAULT_SLACK = 2.0
MODES = ("verified", "nolog", "fp64", "fp32")
# pinned fields and their types (a contract may pin any of them; absent = the default policy)
PINNABLE = {"task": str, "task_source_sha256": str, "config": dict, "seed": int, "steps": int,
            "checkpoint_every": int, "bits": int, "mode": str, "thresholds": dict, "slack": (int, float),
            "initial_state_sha256": str, "root": str, "micro_batches": int, "data_sha256": dict}
MAX_STEPS = 1 << 40


class PolicyError(RunRejected):
    """The run asks for something the auditor's policy does not allow (the message names the field)."""


def _builtin_tasks() -> dict:
    from .task import BUILTIN_TASKS

    return BUILTIN_TASKS


def _default_thresholds() -> dict:
    from .rules import DEFAULT_THRESHOLDS

    return dict(DEFAULT_THRESHOLDS)


@dataclass
class Policy:
    """What the auditor accepts. ``None`` for a field means the default policy for it."""

    task: str | None = None
    task_source_sha256: str | None = None
    config: dict | None = None
    seed: int | None = None
    steps: int | None = None
    checkpoint_every: int | None = None
    bits: int | None = None
    mode: str | None = None
    thresholds: dict = field(default_factory=_default_thresholds)  # ceilings per class
    slack: float = DEFAULT_SLACK
    initial_state_sha256: str | None = None
    root: str | None = None
    micro_batches: int | None = None  # data-parallel runs: micro-batches per step (1: none)
    data_sha256: dict | None = None  # the data files' hashes (Task.data_sha256), by config key
    source: str = "default policy"  # where it came from, for messages

    def __post_init__(self):
        known = _default_thresholds()
        ceilings = dict(known)
        for k, v in (self.thresholds or {}).items():
            if k not in known:
                raise RunError(f"{self.source}: unknown threshold class {k!r}; known: {', '.join(known)}")
            f = _finite(v)
            if f is None or not f > 0:
                raise RunError(f"{self.source}: threshold for {k!r} must be a positive number, got {v!r:.40}")
            ceilings[k] = f
        self.thresholds = ceilings
        slack = _finite(self.slack)
        if slack is None or not 1.0 <= slack <= 16.0:
            raise RunError(f"{self.source}: slack must be a number in [1, 16], got {self.slack!r:.40}")
        self.slack = slack
        g = self.micro_batches  # 1: one micro-batch per step (the run names none)
        if g is not None and (isinstance(g, bool) or not isinstance(g, int) or not 1 <= g <= MAX_MICRO_BATCHES):
            raise RunError(f"{self.source}: micro_batches must be a whole number in 1..{MAX_MICRO_BATCHES}, got {g!r}")
        if self.mode is not None and self.mode not in MODES:
            raise RunError(f"{self.source}: mode must be one of {', '.join(MODES)}, got {self.mode!r}")
        if self.data_sha256 is not None and not is_digest_map(self.data_sha256):
            raise RunError(f"{self.source}: data_sha256 must map config keys to SHA-256 hex digests")

    # --- construction ---------------------------------------------------------------------------

    @classmethod
    def from_file(cls, path: str) -> "Policy":
        """A contract file (``veritrain contract`` writes one)."""
        try:
            with open(path, "rb") as f:
                raw = f.read(1 << 20)
            data = json.loads(raw)
        except OSError as e:
            raise RunError(f"cannot read contract {path}: {e.strerror or e}") from None
        except (ValueError, UnicodeDecodeError, RecursionError) as e:
            raise RunError(f"contract {path} is not valid JSON ({e})") from None
        if not isinstance(data, dict) or data.get("format") != CONTRACT_FORMAT:
            raise RunError(f"contract {path}: expected a JSON object with format {CONTRACT_FORMAT!r}")
        unknown = set(data) - set(PINNABLE) - {"format"}
        if unknown:
            raise RunError(f"contract {path}: unknown fields {sorted(unknown)}")
        kwargs = {}
        for k, typ in PINNABLE.items():
            v = data.get(k)
            if v is None:
                continue
            if isinstance(v, bool) or not isinstance(v, typ):
                raise RunError(f"contract {path}: field {k!r} has the wrong type ({type(v).__name__})")
            kwargs[k] = v
        if "config" in kwargs and "micro_batches" not in kwargs:
            # the config's batch size is a step's: micro-batches would multiply the examples a step takes, a
            # choice a contract that pins the config leaves to no one (a run with G of them is another training)
            kwargs["micro_batches"] = 1
        if "config" in kwargs and "seed" not in kwargs:
            # the run seed keys every draw under the engine (initial weights, dropout); a config's own seeds
            # (init_seed: torch.manual_seed) draw nothing there: left open, the trainer grinds over 2**63 runs
            kwargs["seed"] = 0
        return cls(**kwargs, source=f"contract {path}")

    @classmethod
    def from_options(cls, contract: str | None = None, task: str | None = None, root: str | None = None,
                     slack: float | None = None) -> "Policy":
        """The policy of a command line: a contract file and/or flags (a flag must agree with the contract)."""
        p = cls.from_file(contract) if contract else cls()
        for name, value in (("task", task), ("root", root)):
            if value is None:
                continue
            if getattr(p, name) is not None and getattr(p, name) != value:
                raise RunError(f"--{name} {value!r} contradicts the contract's {name} {getattr(p, name)!r}")
            setattr(p, name, value)
        if slack is not None:
            p.slack = slack
            p.__post_init__()
        return p

    def as_dict(self) -> dict:
        return {"format": CONTRACT_FORMAT, **{k: getattr(self, k) for k in PINNABLE}}

    # --- checking a run -------------------------------------------------------------------------

    def allowed_task(self, ref) -> bool:
        if not isinstance(ref, str):
            return False
        if self.task is not None:
            return ref == self.task
        return ref in _builtin_tasks()

    def admit(self, manifest: dict, build: bool = True) -> "AdmittedRun":
        """Compare a run's manifest with this policy; return the settings the auditor will use.

        Raises PolicyError naming the first field outside the policy. With ``build``, the task's
        defaults are read (this imports the task's module: only after the task itself is admitted).
        """
        where = "the run's manifest"

        def refuse(field_name, why):
            raise PolicyError(f"{where}: field {field_name!r} {why} ({self.source})")

        if manifest.get("format") != FORMAT:
            refuse("format", f"is {manifest.get('format')!r}, this auditor reads {FORMAT}")
        task = manifest.get("task")
        if not self.allowed_task(task):
            if self.task is not None:
                refuse("task", f"is {str(task)[:200]!r}, the policy's task is {self.task!r}")
            refuse("task", f"is {str(task)[:200]!r}, which is not a built-in task ({', '.join(_builtin_tasks())}); "
                           f"an auditor runs other code only when it names it itself (--task or a contract)")
        src = manifest.get("task_source_sha256")
        if self.task_source_sha256 is not None and src != self.task_source_sha256:
            refuse("task_source_sha256", f"is {str(src)[:64]!r}, the policy's is {self.task_source_sha256!r}")
        for name, typ in (("seed", int), ("steps", int), ("checkpoint_every", int), ("bits", int), ("mode", str),
                          ("config", dict), ("thresholds", dict)):
            v = manifest.get(name)
            if isinstance(v, bool) or not isinstance(v, typ):
                refuse(name, f"is missing or not a {typ.__name__}")
        for name in ("seed", "steps", "checkpoint_every", "bits", "mode"):
            pinned = getattr(self, name)
            if pinned is not None and manifest[name] != pinned:
                refuse(name, f"is {manifest[name]!r}, the policy requires {pinned!r}")
        if manifest["mode"] not in MODES:
            refuse("mode", f"is {manifest['mode']!r}, not one of {', '.join(MODES)}")
        if not 23 <= manifest["bits"] <= 32:
            refuse("bits", f"is {manifest['bits']!r}, not in 23..32")
        if not 0 <= manifest["steps"] <= MAX_STEPS:
            refuse("steps", f"is {manifest['steps']!r}, not in 0..{MAX_STEPS}")
        if manifest["checkpoint_every"] <= 0:
            refuse("checkpoint_every", "must be positive")
        if not 0 <= manifest["seed"] < 2**63:
            refuse("seed", "must be in 0..2**63-1")
        thresholds = dict(_default_thresholds())
        for k, v in manifest["thresholds"].items():
            if k not in thresholds:
                refuse("thresholds", f"names an unknown class {str(k)[:64]!r}")
            f = _finite(v)
            if f is None or not f > 0:
                refuse("thresholds", f"gives class {k!r} the value {v!r:.40}, not a positive number")
            thresholds[k] = f
        for k, v in thresholds.items():
            if v > self.thresholds[k]:
                refuse("thresholds", f"gives class {k!r} the threshold {v:g}, above the policy's ceiling "
                                     f"{self.thresholds[k]:g} (a larger threshold lets the trainer choose more "
                                     f"results freely)")
        slack = manifest.get("slack", DEFAULT_SLACK)
        if _finite(slack) is None or not 0 < _finite(slack) <= self.slack:
            refuse("slack", f"is {slack!r:.40}, the policy allows at most {self.slack:g}")
        micro = manifest.get("micro_batches", 1)
        if "micro_batches" in manifest and (isinstance(micro, bool) or not isinstance(micro, int)
                                            or not 2 <= micro <= MAX_MICRO_BATCHES):
            refuse("micro_batches", f"is {str(micro)[:40]!r}, not a whole number in 2..{MAX_MICRO_BATCHES}")
        if self.micro_batches is not None and micro != self.micro_batches:
            refuse("micro_batches", f"is {micro!r}, the policy requires {self.micro_batches!r}")
        init = manifest.get("initial_state_sha256")
        if self.initial_state_sha256 is not None and init != self.initial_state_sha256:
            refuse("initial_state_sha256", f"is {str(init)[:64]!r}, the policy pins {self.initial_state_sha256!r}")
        data = manifest.get("data_sha256")
        if "data_sha256" in manifest and not is_digest_map(data):
            refuse("data_sha256", f"is {str(data)[:80]!r}, not a map of config keys to SHA-256 digests")
        if data and str(task).startswith("loop:"):  # its script reads the data: nothing here would compare them
            refuse("data_sha256", "is given for a run of an own loop, whose data no build here reads or checks")
        if self.data_sha256 is not None and (data or {}) != self.data_sha256:  # none read: no data_sha256
            refuse("data_sha256", f"is {str(data)[:300]!r}, the policy pins {self.data_sha256!r} (other data)")
        config = manifest["config"]
        if self.config is not None and build:
            from .task import default_config

            want = {**default_config(task), **self.config}
            if config != want:
                diff = sorted(k for k in set(want) | set(config) if want.get(k, object()) != config.get(k, object()))
                refuse("config", f"differs from the policy's at keys {diff[:10]}")
        elif build:
            from .task import default_config

            problem = _config_problem(config, default_config(task))
            if problem:
                refuse("config", problem)
        return AdmittedRun(task=task, config=config, seed=manifest["seed"], steps=manifest["steps"],
                           checkpoint_every=manifest["checkpoint_every"], bits=manifest["bits"],
                           mode=manifest["mode"], thresholds=thresholds, slack=self.slack,
                           initial_state_sha256=self.initial_state_sha256, policy=self, micro_batches=micro,
                           data_sha256=data)


def _finite(v) -> float | None:
    """``v`` as a finite float; None for a bool, text, NaN, an infinity or an integer too large for a float (the
    run's JSON holds integers of any size: a threshold or slack of 10**400 made math.isfinite raise
    OverflowError, and the audit, verify and the game stopped with a traceback instead of a verdict)."""
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return None
    try:
        f = float(v)
    except OverflowError:
        return None
    return f if math.isfinite(f) else None


def _config_problem(config: dict, defaults: dict) -> str | None:
    """Why a run's own config (no policy pins it) is not one of its task's: a key the task does not have, or a
    value of another JSON type than the default's (an int for an int, a number for a float, text or null for
    a path). The built-in tasks convert with int() and float(), so without this a width of 16.9 or "16"
    built the model of 16, and the run's committed config named a training that did not happen."""
    if not defaults:  # a task without defaults (an auditor's own --task) checks its own config
        return None
    unknown = sorted(k for k in config if k not in defaults)
    if unknown:
        return f"names keys the task does not have: {[str(k)[:40] for k in unknown[:10]]}"
    for k, v in config.items():
        d = defaults[k]
        if isinstance(d, bool):
            ok = isinstance(v, bool)
        elif isinstance(d, int):
            ok = isinstance(v, int) and not isinstance(v, bool)
        elif isinstance(d, float):
            ok = isinstance(v, (int, float)) and not isinstance(v, bool) and abs(v) < math.inf
        elif d is None or isinstance(d, str):
            ok = v is None or isinstance(v, str)
        else:
            ok = type(v) is type(d)
        if not ok:
            return f"gives {k!r} the value {str(v)[:40]!r}, not of the type of the task's default {d!r}"
    return None


@dataclass
class AdmittedRun:
    """A run's settings after the policy admitted them: what the auditor builds and checks with.
    ``slack`` is the auditor's own; ``thresholds`` are the run's, each within the policy's ceiling
    (the trainer logged by them, so the auditor classifies with them)."""

    task: str
    config: dict
    seed: int
    steps: int
    checkpoint_every: int
    bits: int
    mode: str
    thresholds: dict
    slack: float
    initial_state_sha256: str | None
    policy: Policy
    micro_batches: int = 1
    data_sha256: dict | None = None  # the run's (admitted: the policy's where it pins them)

    def engine(self):
        from .engine import EngineConfig

        return EngineConfig(mode=self.mode, bits=self.bits, seed=self.seed, thresholds=self.thresholds,
                            slack=self.slack)

    def build_task(self, init_log=None):
        """The task, built by this side's own code under the engine as the trainer built it (so data
        randomness drawn while building is the same); ``init_log`` (a StepLogReader) replays the run's
        initialisation decisions. Replays load their state from checked checkpoints afterwards."""
        from .runner import build_initial

        from .engine import ReplayMismatchError
        from .logformat import LogFormatError

        try:
            return build_initial(self.task, self.config, self.engine(), reader=init_log)
        except (ReplayMismatchError, LogFormatError):
            raise  # the construction does not replay the run's initialisation log: the caller says so
        except Exception as e:  # noqa: BLE001 - see build_failure
            raise build_failure(self, e) from None


# what a task's own code raises on values it cannot take (a config, a committed state the trainer chose); an honest
# run never makes it raise these
TASK_CODE_FAILURES = (RuntimeError, TypeError, ValueError, KeyError, IndexError, AssertionError, OverflowError)


def build_failure(run: "AdmittedRun", e: Exception) -> Exception:
    """The error for a task that does not build with ``run``'s config: the run's own config (no policy pinned
    it) is the trainer's, so whatever its values make the task's code raise (a negative width, a NaN learning
    rate, a corpus that is not a regular file) rejects the run; the policy's own config failing to build is
    the auditor's problem. Other exceptions than these are raised as they are."""
    from .task import TaskError

    if run.policy.config is None and isinstance(e, (TaskError, MemoryError, *TASK_CODE_FAILURES)):
        return RunRejected(f"the run's config does not build its task ({type(e).__name__}: {str(e)[:300]})")
    if isinstance(e, TaskError):
        return RunError(f"cannot rebuild the run's task: {e}")
    return e


def write_contract(path: str, policy: Policy):
    from .store import write_json_atomic

    if os.path.exists(path):
        raise RunError(f"{path} already exists; choose a new path (nothing was overwritten)")
    write_json_atomic(path, policy.as_dict())


def trusted(manifest: dict) -> AdmittedRun:
    """A run's settings taken as its manifest states them: only for a party replaying its *own* run (the
    trainer's prover, resuming, experiments measuring their own runs), never for an auditor."""
    from .rules import DEFAULT_THRESHOLDS

    return AdmittedRun(task=manifest["task"], config=manifest["config"], seed=int(manifest["seed"]),
                       steps=int(manifest["steps"]), checkpoint_every=int(manifest["checkpoint_every"]),
                       bits=int(manifest["bits"]), mode=manifest["mode"],
                       thresholds={**DEFAULT_THRESHOLDS, **manifest["thresholds"]},
                       slack=float(manifest.get("slack", DEFAULT_SLACK)), initial_state_sha256=None,
                       policy=Policy(source="the run's own manifest"),
                       micro_batches=int(manifest.get("micro_batches", 1)), data_sha256=manifest.get("data_sha256"))
