"""The Python API: train, audit, verify, dispute and inspect a run, with typed results.

The command line (cli.py) is a thin layer over these functions; each result's ``as_dict()`` is what the
matching command prints with ``--json``. A task is a built-in name, a ``module:function`` string, a
task function (``config -> Task``) or a built ``Task`` (see ``task.register``).

    import veritrain
    r = veritrain.train("digits-cnn", "runs/a", steps=20)
    a = veritrain.audit("runs/a")
    assert a.accepted and a.root == r.root
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field

from .runner import AuditResult  # noqa: F401  (re-exported: audit's result type)

__all__ = ["train", "audit", "verify", "dispute", "inspect", "TrainResult", "AuditResult", "VerifyResult",
           "DisputeResult", "InspectResult"]


class _Result:
    def as_dict(self) -> dict:
        return asdict(self)


@dataclass
class TrainResult(_Result):
    """A finished (or resumed and finished) run: where it is and what the trainer committed to."""

    run_dir: str
    task: str
    steps: int
    mode: str
    bits: int
    root: str
    final_state_sha256: str
    evaluation: dict | None
    next_command: str
    manifest: dict = field(repr=False, default_factory=dict)


@dataclass
class VerifyResult(_Result):
    """Every file of a run checked against its manifest and root, without replaying."""

    ok: bool
    root: str | None
    steps: int
    intervals: int
    problems: list
    unverified: dict
    complete: bool
    steps_planned: int | None


@dataclass
class DisputeResult(_Result):
    """The verification game's outcome: ``verdict`` is no_dispute, trainer_wrong or auditor_wrong."""

    verdict: str
    interval: int | None
    step: int | None
    operator: str | None
    module: str | None
    queries: int
    referee_ops: int
    referee_bytes: int
    reasons: list
    details: dict = field(default_factory=dict)  # the rest of the game's record (ruling, data_step, ...)

    def as_dict(self) -> dict:
        d = asdict(self)
        return {**d.pop("details"), **d}


@dataclass
class InspectResult(_Result):
    """A summary of a run folder (kind "run") or an audit folder (kind "audit"): docs/FORMAT.md."""

    kind: str
    fields: dict

    def __getitem__(self, key):
        return self.fields[key]

    def as_dict(self) -> dict:
        return dict(self.fields)


def _ref(task) -> str | None:
    from .task import register

    return None if task is None else register(task)


def _policy(task=None, contract=None, root=None):
    from .policy import Policy

    return Policy.from_options(contract=contract, task=_ref(task), root=root)


def train(task, out: str, *, steps: int = 20, checkpoint_every: int = 10, bits: int = 32, seed: int = 0,
          config: dict | None = None, mode: str = "verified", thresholds: dict | None = None, device: str = "cpu",
          resume: bool = False, progress: bool = False, micro_batches: int = 1) -> TrainResult:
    """Train ``task`` into the new folder ``out`` (or continue a killed run there with ``resume``).
    ``micro_batches`` > 1 makes a data-parallel run (docs/DISTRIBUTED.md): in a process group that
    torch.distributed already joined (e.g. under torchrun), every rank calls ``train`` alike."""
    import shlex

    from .runner import TrainOptions, train as run_train

    ref = _ref(task)
    m = run_train(TrainOptions(task=ref, out=out, steps=steps, checkpoint_every=checkpoint_every, bits=bits,
                               seed=seed, config=dict(config or {}), mode=mode, thresholds=thresholds,
                               progress=progress, resume=resume, device=device, micro_batches=micro_batches))
    return TrainResult(run_dir=out, task=m["task"], steps=m["steps_completed"], mode=m["mode"], bits=m["bits"],
                       root=m["root"], final_state_sha256=m["checkpoints"][-1]["state_sha256"],
                       evaluation=m.get("evaluation"), next_command=f"veritrain audit {shlex.quote(out)}", manifest=m)


def check_script_options(task, device):
    """An own loop's replay runs its script, which builds its model and places it: a task or device given
    beside the script would be ignored, so it is refused rather than taken silently."""
    if task is not None:
        raise ValueError("an own loop's script names its task itself: give the script (command) or a task, not both")
    if not str(device).startswith("cpu"):
        raise ValueError(f"device {str(device)!r} does not apply to an own loop's replay: its script places its "
                         "model itself")


def audit(run_dir: str, *, task=None, contract: str | None = None, root: str | None = None, out: str | None = None,
          intervals=None, sample: int | None = None, sample_seed: int | None = None, device: str = "cpu",
          progress: bool = False, command: list[str] | None = None) -> AuditResult:
    """Replay a run (all intervals, ``intervals`` like "0,3-5" or a list, or ``sample`` drawn at random) and
    check it against its root. A run of a task other than a built-in one is audited only when the auditor
    names the task (``task=`` or a ``contract``). For a run of an own loop (veritrain.Run), ``command`` is
    the script to replay, e.g. ``["python", "train.py"]``. Raises RunRejected when the run is refused."""
    if intervals is not None and sample is not None:
        raise ValueError("use either intervals or sample, not both")
    if command is not None:
        from .loop import audit_script

        check_script_options(task, device)

        if isinstance(intervals, (list, tuple)):
            intervals = ",".join(str(i) for i in intervals)
        return audit_script(run_dir, list(command), out=out, intervals=intervals, sample=sample,
                            sample_seed=sample_seed, root=root, contract=contract, quiet=not progress)
    from .runner import audit as run_audit

    return run_audit(run_dir, out, progress=progress, intervals=intervals, sample=sample, sample_seed=sample_seed,
                     root=root, policy=_policy(task, contract, root), device=device)


def verify(run_dir: str, *, root: str | None = None, task=None, contract: str | None = None) -> VerifyResult:
    """Check every file of a run against its manifest and root, and its settings against the auditor's
    policy, without replaying anything. An incomplete run is not ok: no root commits to it yet."""
    import shlex

    from .policy import PolicyError
    from .runner import unverified_fields
    from .store import RunRejected, load_manifest, verify as verify_files

    policy = _policy(task, contract, root)
    refused, unverified, m = None, {}, None
    try:  # the run's settings against the auditor's policy (nothing is imported or built here)
        m = load_manifest(run_dir)
        unverified = unverified_fields(m)
        policy.admit(m, build=False)
    except PolicyError as e:
        refused = str(e)
    except RunRejected:  # a damaged manifest is reported by verify_files below; a missing one is unusable input
        pass
    r = verify_files(run_dir, root or policy.root)
    complete = bool(m and m.get("complete"))
    if m and not complete:  # consistent files, but no root commits to them: as `inspect` and `audit` say
        r["root"] = None
        if str(m.get("task")).startswith("loop:"):
            resume = f"run its script ({str(m.get('task'))[5:]}) again"
        else:
            resume = "`" + shlex.join(["veritrain", "train", str(m.get("task")), "--out", run_dir, "--resume"]) + "`"
        r["problems"].insert(0, {"file": "manifest.json", "problem": f"the run is incomplete ({r['steps']} of "
                                 f"{m.get('steps')} steps): the trainer did not finish; resume it: {resume}"})
        r["ok"] = False
    if refused:
        r["problems"].insert(0, {"file": "manifest.json", "problem": f"refused by the auditor's policy: {refused}"})
        r["ok"] = False
    return VerifyResult(ok=r["ok"], root=r["root"], steps=r["steps"], intervals=r["intervals"], problems=r["problems"],
                        unverified=unverified, complete=complete, steps_planned=m.get("steps") if m else None)


def dispute(prover: str, audit_dir: str, *, root: str | None = None, task=None, contract: str | None = None,
            device: str = "cpu", timeout: float = 300.0, command: list[str] | None = None) -> DisputeResult:
    """Play the verification game against ``prover`` (the trainer's run folder, or the http:// address of
    ``veritrain serve``) from the audit saved in ``audit_dir`` (``audit(..., out=audit_dir)``). For a run of
    an own loop, ``command`` is its script, as for ``audit``."""
    from .protocol import LocalProver, play
    from .server import HttpProver
    from .store import RunError

    if command is not None:
        from .loop import dispute_script

        check_script_options(task, device)
        return _dispute_result(dispute_script(prover, audit_dir, list(command), root=root, contract=contract,
                                              timeout=timeout))
    p = os.path.join(audit_dir, "audit.json")
    try:
        with open(p) as f:
            audit_state = json.load(f)
    except FileNotFoundError:
        raise RunError(f"{audit_dir} has no audit.json: run `veritrain audit RUN --out {audit_dir}` first") from None
    except (OSError, json.JSONDecodeError) as e:
        raise RunError(f"{p} is unreadable ({e})") from None
    if prover.startswith(("http://", "https://")):
        side = HttpProver(prover, timeout=timeout)
    else:
        side = LocalProver(prover, device=device)
        if str(side.manifest().get("task")).startswith("loop:") and task is None and contract is None:
            raise RunError(f"{prover} is a run of an own loop: give its script, e.g. `veritrain dispute {prover} "
                           f"{audit_dir} -- python {side.manifest()['task'][5:]} ...`")
    return _dispute_result(play(side, audit_state, root, _policy(task, contract, root), device=device))


def _dispute_result(v: dict) -> DisputeResult:
    main = {k: v.pop(k, None) for k in ("verdict", "interval", "step", "operator", "module", "queries",
                                        "referee_ops", "referee_bytes", "reasons")}
    main["reasons"] = main["reasons"] or []
    return DisputeResult(**main, details=v)


def inspect(path: str) -> InspectResult:
    """Summarise a run folder or an audit folder (steps, root, log sizes, entries, corrections)."""
    from .summary import inspect_dir

    r = inspect_dir(path)
    return InspectResult(kind=r["kind"], fields=r)
