"""The verification game (after Teutsch & Reitwiessner): a challenger narrows a dispute with the trainer's
run (the prover) to one interval, one step and one operator, and a referee recomputes only that operator.

    phase 1  bisection over the run's Merkle tree      -> the first interval whose leaf differs
    phase 2  bisection over per-step state hashes       -> the first step whose state differs
    phase 3  bisection over per-operator output hashes  -> the first operator whose output differs
    referee  recomputes that operator alone: its own call (op, non-tensor arguments, random-op index,
             captured in its own replay), the prover's tensors checked against agreed hashes (or, for
             the step's data, against that very tensor of batch(step)), the trainer's logged rounding
             decisions for it
    suspicious log entries the audit found are disputed the same way: the referee recomputes the op with
             the trainer's log record and confirms the entry is suspicious

Every answer of the prover is checked against the committed root (or against hashes that were checked
against it) before it is used; a prover that answers inconsistently, times out or refuses loses. How
much work the challenger does (the number of intervals, what it reads) never rests on the prover's word.
The prover is a ``LocalProver`` (a run directory in this process) or an ``HttpProver`` (``veritrain
serve``); both implement ``Prover``.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import tempfile
import time
import typing
from types import SimpleNamespace

import torch

from . import parallel, store
from .checkpoint import CheckpointError, hash_state, load_checkpoint
from .commitments import batch_hash
from .engine import (OpTrace, ReplayMismatchError, VeritrainError, load_call, load_call_tensors,
                     step_context)
from .logformat import LogFormatError, StepLogReader
from .merkle import children, leaf_hash, node_hash, verify_inclusion
from .rounding import Grid
from .policy import AdmittedRun, Policy, trusted
from .task import TaskError, using_device


class ProverError(VeritrainError):
    """The prover failed to answer (timeout, refusal, malformed answer)."""


MAX_INTERVALS = 1 << 40  # more intervals than any run this auditor would replay: an absurd claim
MAX_CLAIMS = 3  # suspicious entries of an audit the referee checks, earliest first


# --- replaying a run's steps -------------------------------------------------------------------


def check_own_data(run: AdmittedRun, task):
    """This side's build of the task read the data the run commits to (its data_sha256, which the audit
    compared before any replay): a copy that changed since, or another copy on this machine, is this side's
    own error, never a finding against the other side (its batches would differ from every record)."""
    problem = store.data_problem(run.data_sha256, task.data_sha256)
    if problem:
        raise TaskError(f"this side's data: {problem}; replay with the data the run commits to")


class Replayer:
    """Replays steps of a run from one of its checkpoints with its logs, on this machine.

    ``checkpoint(step)`` and ``log(step)`` return the bytes of the run's files (local or fetched);
    the task is this side's own build of the manifest's task, so its ``batch(step)`` is this side's data.
    Steps run on this side's ``device``, whichever device the other side used.
    """

    def __init__(self, run: AdmittedRun, checkpoint, log, device="cpu"):
        """``run``: the run's settings as this side admits them (the challenger: through its policy;
        the prover: its own manifest, ``policy.trusted``)."""
        from . import hardware
        from .runner import place_task

        self.run = run
        self._checkpoint, self._log = checkpoint, log
        self.device = hardware.parse_device(device)
        hardware.configure_device(self.device)
        self.task = run.build_task()
        check_own_data(run, self.task)
        self.mode, self.bits = run.mode, run.bits
        self.engine = run.engine()
        self.grid = Grid(self.bits)
        if self.mode == "fp64":
            self.task.model.double()
        place_task(self.task, self.device)
        self.at = None  # the step count of the state currently loaded
        self.ops_replayed = 0
        self.module_names = {id(m): n or "<model>" for n, m in self.task.model.named_modules()}

    def load(self, step: int, expect_state: str | None = None) -> str:
        self.task.hold()
        data = self._checkpoint(step)
        with tempfile.NamedTemporaryFile(suffix=".safetensors") as f:
            f.write(data)
            f.flush()
            try:
                got_step, h = load_checkpoint(f.name, self.task.model, self.task.optimizer, self.task.scheduler)
            except CheckpointError as e:
                raise store.RunError(f"checkpoint after step {step}: {e}") from None
        if got_step != step:
            raise store.RunError(f"the checkpoint for step {step} holds step {got_step}")
        if expect_state is not None and h != expect_state:
            raise store.RunError(f"the checkpoint after step {step} hashes to {h[:16]}…, the commitment says "
                                 f"{expect_state[:16]}…")
        self.at = step
        return h

    def batch(self, step: int):
        from .runner import _prepare_batch

        with using_device(self.device):
            return _prepare_batch(self.task.batch(step), self.mode, self.grid)

    def micro_batch(self, step: int, g: int):
        """Micro-batch ``g`` of ``step`` of a data-parallel run, as this side's task yields it."""
        from .runner import _prepare_batch

        with using_device(self.device):
            return _prepare_batch(self.task.batch(step * self.run.micro_batches + g), self.mode, self.grid)

    def run_step(self, step: int, trace: OpTrace | None = None):
        """One step from the loaded state; returns (loss, batch). The batch of a data-parallel step is the list
        of its micro-batches."""
        if self.at != step:
            raise RuntimeError(f"replayer holds the state after {self.at} steps, not {step}")
        if self.run.micro_batches > 1:
            return self._run_parallel_step(step, trace)
        reader, log_sha = None, None
        if self.mode == "verified":
            raw = self._log(step)
            log_sha = hashlib.sha256(raw).hexdigest()
            try:
                reader = StepLogReader(raw, expect_step=step, expect_bits=self.bits)
            except LogFormatError as e:
                raise store.RunError(f"step {step}: {e}") from None
        self.task.hold()
        batch = self.batch(step)
        hooks = []
        if trace is not None:
            trace.add_sources(batch_leaves(batch), "batch")
            trace.add_sources(state_tensors(self.task), "state")
            hooks = _module_hooks(trace, self.module_names)
        try:
            with using_device(self.device):
                loss, stats = self.task.replay_step(self.engine, step, batch, reader, trace)
        finally:
            for h in hooks:
                h.remove()
            if reader is not None:
                reader.close()
        self.ops_replayed += stats.ops
        self.at = step + 1
        self.last_stats = stats
        indices = self.task.batch_indices(step) if self.task.batch_indices else None
        self.last_record = store.record_bytes(step, batch_hash(batch), indices, loss, log_sha)
        return loss, batch

    def _run_parallel_step(self, step: int, trace: OpTrace | None):
        """A data-parallel step replayed in this one process: its micro-batches in order, then the update."""
        from . import parallel

        logs = _FetchedLogs(self, step) if self.mode == "verified" else parallel.PartLogs()
        hooks = []
        if trace is not None:
            trace.add_sources(state_tensors(self.task), "state")
            hooks = _module_hooks(trace, self.module_names)
        try:
            with using_device(self.device):
                parts = parallel.run_step(self.task, self.engine, step, self.run.micro_batches, self.mode, self.grid,
                                          logs, trace=trace, alone=True)
        except LogFormatError as e:
            raise store.RunError(f"step {step}: {e}") from None
        finally:
            for h in hooks:
                h.remove()
        self.ops_replayed += sum(st.ops for _, st in parts.stats)
        self.at = step + 1
        self.last_record = store.parallel_record_bytes(step, parts.micro, parts.loss,
                                                       logs.sha256(None) if self.mode == "verified" else None)
        return parts.loss, [parts.batches[g] for g in range(self.run.micro_batches)]

    def state_hash(self) -> str:
        self.task.hold()
        return hash_state(self.task.model, self.task.optimizer, self.task.scheduler, self.at)

    def goto(self, interval_start: int, step: int, start_state: str | None = None):
        """Load the checkpoint at ``interval_start`` (unless already at a state in between) and run to ``step``."""
        if self.at is None or self.at > step or self.at < interval_start:
            self.load(interval_start, start_state)
        while self.at < step:
            self.run_step(self.at)


class _FetchedLogs:
    """The logs of a data-parallel step's parts, from the replayer's ``log(step, micro)`` (checked there)."""

    def __init__(self, rep: Replayer, step: int):
        self.rep, self.step = rep, step
        self._read: dict = {}  # part -> the bytes its reader was given (hashed without a second fetch)

    def writer(self, part):
        return None

    def reader(self, part):
        data = self._read[part] = self.rep._log(self.step, part)
        return StepLogReader(data, expect_step=self.step, expect_bits=self.rep.bits)

    def sha256(self, part):
        if part not in self._read:
            self._read[part] = self.rep._log(self.step, part)
        return hashlib.sha256(self._read[part]).hexdigest()


def batch_differs(record: dict, batch, micro_batches: int) -> bool:
    """Whether a step's data record names other data than ``batch`` (a data-parallel step: the list of its
    micro-batches, each against its entry)."""
    if micro_batches == 1:
        return record.get("batch_sha256") != batch_hash(batch)
    entries = record.get("micro_batches")
    if not isinstance(entries, list) or len(entries) != len(batch):
        return True
    return any(not isinstance(e, dict) or e.get("batch_sha256") != batch_hash(b) for e, b in zip(entries, batch))


def batch_leaves(batch) -> dict:
    from torch.utils._pytree import keystr, tree_flatten_with_path

    return {keystr(p): x for p, x in tree_flatten_with_path(batch)[0] if isinstance(x, torch.Tensor)}


def state_tensors(task) -> dict:
    out = {f"model/{k}": v for k, v in task.model.state_dict().items()}
    for i, (p, st) in enumerate(task.optimizer.state.items()):
        for k, v in st.items():
            if isinstance(v, torch.Tensor):
                out[f"optimizer/{i}/{k}"] = v
    return out


def _module_hooks(trace: OpTrace, names: dict):
    from torch.nn.modules.module import register_module_forward_hook, register_module_forward_pre_hook

    def pre(module, args):
        trace.modules.append(names.get(id(module), type(module).__name__))

    def post(module, args, out):
        if trace.modules:
            trace.modules.pop()

    return [register_module_forward_pre_hook(pre), register_module_forward_hook(post)]


# --- the prover --------------------------------------------------------------------------------


class Prover(typing.Protocol):
    """What the challenger may ask the trainer's side (implemented by LocalProver and HttpProver).
    Bytes are raw files; hashes are hex; a failure to answer raises ProverError."""

    def manifest(self) -> dict: ...
    def node(self, lo: int, hi: int) -> bytes: ...
    def leaf(self, index: int) -> tuple[bytes, list[bytes]]: ...
    def checkpoint(self, step: int) -> bytes: ...
    def log(self, step: int, micro: int | None = None) -> bytes: ...
    def init_log(self) -> bytes: ...
    def record(self, step: int) -> bytes: ...
    def state_after(self, step: int) -> str: ...
    def op_count(self, step: int) -> int: ...
    def op(self, step: int, index: int) -> dict: ...
    def op_inputs(self, step: int, index: int) -> bytes: ...


class LocalProver(Prover):
    """Answers from a run directory, replaying steps with its own task (on ``device``) when asked about them."""

    def __init__(self, run_dir: str, device="cpu"):
        self.run_dir = run_dir
        self.device = device
        self._manifest = store.load_manifest(run_dir)
        self._leaves = [bytes.fromhex(x) for x in self._manifest.get("leaves", [])]  # what the root commits to
        self._tree = store.tree_of(self._leaves)
        self._replayer = None
        self._states: dict[int, str] = {}
        self._traces: dict[int, OpTrace] = {}

    def _read(self, name: str) -> bytes:
        try:  # by its canonical name, a regular file inside the run, within its size cap
            return store.read_run_file(self.run_dir, name)
        except store.RunFileError as e:
            raise ProverError(f"the run has no readable {name} ({e.problem})") from None

    def manifest(self) -> dict:
        return self._manifest

    def node(self, lo, hi):
        return self._tree.node(lo, hi)

    def leaf(self, index):
        return self._leaves[index], self._tree.inclusion_proof(index)

    def checkpoint(self, step):
        return self._read(store.ckpt_name(step))

    def log(self, step, micro=None):
        if micro is not None and not 0 <= micro < store.micro_batches(self._manifest):
            raise ProverError(f"the run has no micro-batch {micro}")
        return self._read(store.log_name(step) if micro is None else store.micro_log_name(step, micro))

    def init_log(self):
        return self._read(store.INIT_LOG)

    def record(self, step):
        return self._read(store.record_name(step))

    def _interval_start(self, step: int) -> int:
        k = self._manifest["checkpoint_every"]
        return (step // k) * k

    def _rep(self) -> Replayer:
        if self._replayer is None:
            self._replayer = Replayer(trusted(self._manifest), self.checkpoint, self.log, device=self.device)
        return self._replayer

    def state_after(self, step):
        if step not in self._states:
            rep = self._rep()
            rep.goto(self._interval_start(step), step)
            rep.run_step(step)
            self._states[step] = rep.state_hash()
        return self._states[step]

    def _trace(self, step, capture=None) -> OpTrace:
        if step in self._traces and capture is None:
            return self._traces[step]
        rep = self._rep()
        rep.goto(self._interval_start(step), step)
        trace = OpTrace(capture=capture)
        rep.run_step(step, trace)
        self._states[step] = rep.state_hash()
        if capture is None:
            self._traces[step] = trace
        return trace

    def op_count(self, step):
        return len(self._trace(step).entries)

    def op(self, step, index):
        entries = self._trace(step).entries
        if not 1 <= index <= len(entries):
            raise ProverError(f"step {step} has no operator #{index}")
        return entries[index - 1]

    def op_inputs(self, step, index):
        trace = self._trace(step, capture=index)
        if trace.captured is None:
            raise ProverError(f"step {step} has no operator #{index}")
        return trace.captured


# --- the challenger ----------------------------------------------------------------------------


class Verdict(dict):
    """verdict, interval, step, operator, module, queries, referee_ops, referee_bytes, reasons, ..."""


class _Lost(Exception):
    def __init__(self, why: str):
        super().__init__(why)
        self.why = why


class Challenger:
    """The auditor's side of the game: its own replay (on ``device``), checked answers, counted queries."""

    def __init__(self, prover: Prover, audit: dict, root: str | None = None, policy: Policy | None = None,
                 device="cpu"):
        self.p = prover
        self.device = device
        self.policy = policy or Policy.from_options(root=root)
        self.audit = audit
        self.queries = 0
        self.bytes = 0
        try:
            self.m = prover.manifest()
        except Exception as e:
            raise _Lost(f"the prover did not send its manifest ({e})") from None
        if not isinstance(self.m, dict):
            raise _Lost(f"the prover's manifest is not a JSON object but {type(self.m).__name__}")
        own_root = root or audit.get("root")  # this side's: a malformed one is its own error
        try:
            self.root = bytes.fromhex(own_root or self.m.get("root", ""))
        except (TypeError, ValueError):
            if own_root:
                raise
            raise _Lost("the prover's manifest names a root that is not a hex hash (and no other root is given)") \
                from None
        if self.m.get("root") and self.m["root"] != self.root.hex():
            raise _Lost(f"the prover's manifest commits to root {self.m['root'][:16]}…, not the audited "
                        f"root {self.root.hex()[:16]}…")
        if not audit.get("run_sha256"):
            raise store.RunError("the audit does not record which run it audited (no run_sha256): audit again")
        if store.run_sha256(self.m).hex() != audit["run_sha256"]:
            raise _Lost("the prover's manifest describes another run than the one audited")
        try:  # every setting of the replay comes from this side's policy, never from the prover
            self.run = self.policy.admit(self.m)
        except store.RunRejected as e:
            raise _Lost(str(e)) from None
        self.n = self._interval_count()
        self._interval = None  # the interval this side replayed last (SimpleNamespace)

    def _interval_count(self) -> int:
        """The number of intervals, from the committed steps and checkpoint interval as this side's policy
        admitted them (the audited run description): never from a claim no commitment covers."""
        steps, every = self.run.steps, self.run.checkpoint_every
        done = self.m.get("steps_completed", steps)
        if done != steps or isinstance(done, bool):
            raise _Lost(f"the prover's manifest announces {str(done)[:40]} completed steps; the run it committed "
                        f"to (and that was audited) has {steps}")
        n = 1 if steps == 0 else -(-steps // every) if every > 0 else 0
        if not 1 <= n <= MAX_INTERVALS:
            raise _Lost(f"the committed run has {n} intervals ({steps} steps, a checkpoint every {every}): "
                        f"refused (at most {MAX_INTERVALS})")
        return n

    def ask(self, what: str, fn, *args, returns: type | None = None):
        """The prover's answer to one query; ``returns``: the type it must have (a Prover of any transport
        answers here, not only HttpProver, which checks its answers itself)."""
        self.queries += 1
        try:
            out = fn(*args)
        except (ProverError, LookupError, ValueError) as e:
            raise _Lost(f"the prover failed to answer {what}: {e}") from None
        if returns is not None and not isinstance(out, returns):
            raise _Lost(f"the prover's answer to {what} is not {returns.__name__} but {type(out).__name__}")
        if isinstance(out, (bytes, bytearray)):
            self.bytes += len(out)
        return out

    # phase 1 ------------------------------------------------------------------------------------

    def first_disputed_interval(self) -> int | None:
        own = self.audit.get("leaves") or {}
        try:
            own = {int(k): bytes.fromhex(v) for k, v in own.items() if v}
        except (TypeError, ValueError, AttributeError):
            raise store.RunError("the audit's leaves are malformed") from None
        if any(not 0 <= i < self.n for i in own):
            raise store.RunError(f"the audit has leaves for intervals outside the committed run's 0..{self.n - 1}")
        # audited intervals whose replay stopped before it built a leaf (a log that does not replay, ...)
        unbuilt = set()
        for r in self.audit.get("intervals") or []:
            i = r.get("interval") if isinstance(r, dict) else None
            if isinstance(i, int) and 0 <= i < self.n and i not in own:
                unbuilt.add(i)
        if len(own) == self.n:
            from .merkle import MerkleTree

            mine = MerkleTree([own[i] for i in range(self.n)])
            if mine.root() == self.root:
                return None
            lo, hi, expect = 0, self.n, self.root
            while hi - lo > 1:
                (a, b), (c, d) = children(lo, hi)
                left = self.ask(f"node [{a},{b})", self.p.node, a, b, returns=bytes)
                right = self.ask(f"node [{c},{d})", self.p.node, c, d, returns=bytes)
                if len(left) != 32 or len(right) != 32:
                    raise _Lost(f"the prover's nodes [{a},{b}) and [{c},{d}) are not 32-byte hashes")
                if node_hash(left, right) != expect:
                    raise _Lost(f"the prover's nodes [{a},{b}) and [{c},{d}) do not hash to their parent "
                                f"[{lo},{hi}) (inconsistent with the committed root)")
                if left != mine.node(a, b):
                    lo, hi, expect = a, b, left
                else:
                    lo, hi, expect = c, d, right
            return lo
        # a partial audit: the first audited interval that differs (checked with an inclusion proof) or
        # that the audit could not replay to a leaf
        for i in sorted(set(own) | unbuilt):
            if i in unbuilt:
                return i
            data = self.leaf(i)
            if leaf_hash(data) != own[i]:
                return i
        return None

    def state_after(self, step: int) -> str:
        """The prover's state hash after ``step``: 64 hex digits, compared with this side's own."""
        h = self.ask(f"state after step {step}", self.p.state_after, step, returns=str)
        if not _is_digest(h):
            raise _Lost(f"the prover's state after step {step} is not a SHA-256 hex digest ({h[:80]!r})")
        return h

    def leaf(self, i: int) -> bytes:
        answer = self.ask(f"leaf {i}", self.p.leaf, i)
        try:
            data, proof = answer
            included = isinstance(data, bytes) and verify_inclusion(leaf_hash(data), i, self.n, list(proof), self.root)
        except (TypeError, ValueError):
            raise _Lost(f"the prover's answer for leaf {i} is not a leaf and its inclusion proof") from None
        if not included:
            raise _Lost(f"the prover's inclusion proof for leaf {i} does not verify against the committed root")
        return data

    # phases 2 and 3 ----------------------------------------------------------------------------

    def play(self) -> Verdict:
        t0 = time.perf_counter()
        v = Verdict(verdict="no_dispute", interval=None, step=None, operator=None, module=None, queries=0,
                    referee_ops=0, referee_bytes=0, interval_replay_ops=0, reasons=[])
        try:
            if self.audit.get("initial_state_reasons"):
                self._dispute_initial_state(v)
            if v["verdict"] != "trainer_wrong":
                i = self.first_disputed_interval()
                if i is not None:
                    v.update(interval=i, verdict="trainer_wrong")
                    self._dispute_interval(i, v)
            if v["verdict"] != "trainer_wrong":
                self._dispute_suspicious(v)
        except _Lost as e:
            v["verdict"] = "trainer_wrong"
            v["reasons"].append(e.why)
        v["queries"] = self.queries
        v["bytes_received"] = self.bytes
        v["seconds"] = time.perf_counter() - t0
        return v

    def _dispute_initial_state(self, v: Verdict):
        """The audit found that its own build of the task does not give the run's initial state (row 4 of
        docs/SECURITY.md). The referee builds the task once more, with the trainer's committed
        initialisation log, and compares: the step-0 state is the trainer's to get right."""
        from .runner import _prepare_model

        reader = None
        if self.run.mode == "verified":
            raw = self.ask("the initialisation log", self.p.init_log, returns=bytes)
            if hashlib.sha256(raw).hexdigest() != self.m.get("init_log_sha256"):
                raise _Lost("the prover's initialisation log is not the one its manifest commits to")
            try:
                reader = StepLogReader(raw, expect_step=0, expect_bits=self.run.bits)
            except LogFormatError as e:
                raise _Lost(f"the trainer's initialisation log is malformed ({e})") from None
            v["referee_bytes"] += len(raw)
        with self._replaying("initial state"):
            try:
                task = self.run.build_task(init_log=reader)
            finally:
                if reader is not None:
                    reader.close()
        check_own_data(self.run, task)
        _prepare_model(task, self.run.mode, Grid(self.run.bits))
        v["referee_ops"] += task.init_stats.ops
        h = hash_state(task.model, task.optimizer, task.scheduler, 0)
        wants = [("the run", self.m.get("initial_state_sha256")), ("the policy", self.run.initial_state_sha256)]
        wrong = [who for who, want in wants if want is not None and want != h] or \
            (["the run"] if self.m.get("initial_state_sha256") is None else [])
        if wrong or task.init_stats.suspicious_count:
            v["verdict"] = "trainer_wrong"
            v["ruling"] = (f"initial state: the task built with the trainer's initialisation log hashes to "
                           f"{h[:16]}…, not to the state {' and '.join(wrong)} commits to" if wrong else
                           f"initial state: {task.init_stats.suspicious_count} suspicious entries in the "
                           f"initialisation log")
        else:
            v["verdict"] = "auditor_wrong"
            v["reasons"].append("initial state: the referee's build of the task gives the committed initial state")

    @contextlib.contextmanager
    def _replaying(self, what: str):
        """This side's replay of the trainer's committed files: files that do not replay (a checkpoint
        that does not hold its committed state, a log that is malformed or names other ops) lose."""
        try:
            yield
        except (store.RunError, ReplayMismatchError, LogFormatError) as e:
            raise _Lost(f"{what}: the trainer's committed files do not replay ({e})") from None

    def _span(self, i: int) -> tuple[int, int]:
        every, steps = self.run.checkpoint_every, self.run.steps
        return (0, 0) if steps == 0 else (i * every, min(i * every + every, steps))

    def _replay_interval(self, i: int) -> SimpleNamespace:
        """Leaf i (with its inclusion proof), the trainer's records and logs for its steps (each checked
        against the leaf), and this side's replay of the interval from its agreed checkpoint."""
        if self._interval is not None and self._interval.i == i:
            return self._interval
        self._interval = None
        try:
            info = store.parse_leaf(self.leaf(i))
        except store.RunError as e:
            raise _Lost(f"the trainer committed a malformed leaf {i} ({e})") from None
        if info["run_sha256"] != store.run_sha256(self.m).hex():
            raise _Lost(f"leaf {i} commits to another run description than the prover's manifest")
        a, b = self._span(i)
        if (info["interval"], info["first_step"], info["end_step"]) != (i, a, b):
            raise _Lost(f"leaf {i} covers steps [{info['first_step']}, {info['end_step']}), the committed run's "
                        f"interval {i} is steps [{a}, {b})")
        if i == 0:
            start_state = self.m.get("initial_state_sha256")
        else:
            try:
                start_state = store.parse_leaf(self.leaf(i - 1))["state_sha256"]
            except store.RunError as e:
                raise _Lost(f"the trainer committed a malformed leaf {i - 1} ({e})") from None
        records, logs = {}, {}
        for s, h in zip(range(a, b), info["records"]):
            raw = self.ask(f"record {s}", self.p.record, s, returns=bytes)
            if hashlib.sha256(raw).hexdigest() != h:
                raise _Lost(f"the prover's data record for step {s} does not match leaf {i}")
            try:
                records[s] = json.loads(raw)
            except (ValueError, RecursionError):
                records[s] = None
            if not isinstance(records[s], dict):
                raise _Lost(f"the trainer committed a malformed data record for step {s}")
        rep = Replayer(self.run, self._checked_checkpoint(start_state, a), self._checked_log(records, logs),
                       device=self.device)
        states, data_finding, record_finding = {}, None, None
        with self._replaying(f"interval {i}"):
            rep.load(a, start_state)
            for s, h in zip(range(a, b), info["records"]):
                loss, batch = rep.run_step(s)
                states[s] = rep.state_hash()
                if data_finding is None and batch_differs(records[s], batch, self.run.micro_batches):
                    data_finding = s
                # the whole record as the audit builds it (loss, example indices, log hash, canonical bytes)
                if record_finding is None and hashlib.sha256(rep.last_record).hexdigest() != h:
                    record_finding = s
        self._interval = SimpleNamespace(i=i, a=a, b=b, info=info, start=start_state, records=records, logs=logs,
                                         rep=rep, states=states, data_finding=data_finding,
                                         record_finding=record_finding, replay_ops=rep.ops_replayed)
        return self._interval

    def _dispute_interval(self, i: int, v: Verdict):
        c = self._replay_interval(i)
        a, b = c.a, c.b
        v["interval_replay_ops"] = c.replay_ops
        if c.data_finding is not None:
            s = c.data_finding
            v["reasons"].append(f"step {s}: the trainer's data record differs from what the task's "
                                f"{self._batches_of(s)} yields (it trained on other data than it claims)")
            v["data_step"] = s
        if a == b:  # a 0-step run: its one leaf must commit to the initial state, which nothing changes
            if c.info["state_sha256"] != c.start:
                raise _Lost(f"interval {i} has no steps, yet its leaf commits to the state "
                            f"{c.info['state_sha256'][:16]}…, not to the run's initial state {str(c.start)[:16]}…")
            v["verdict"] = "auditor_wrong"
            v["reasons"].append(f"interval {i} has no steps: its leaf commits to the agreed initial state")
            return
        # phase 2: the first step whose state differs
        last = self.state_after(b - 1)
        if last != c.info["state_sha256"]:
            raise _Lost(f"the prover's replay of step {b - 1} ends in {str(last)[:16]}…, its leaf commits to "
                        f"{c.info['state_sha256'][:16]}…")
        if c.states[b - 1] == last:
            if c.data_finding is None and c.record_finding is not None:
                # the replay reaches the committed state, yet a committed record is not the one the step gives:
                # the trainer wrote a false record (a loss, example indices or bytes the step did not produce)
                v["reasons"].append(f"step {c.record_finding}: the trainer's committed data record differs from the "
                                    f"one this replay of the step gives, which reaches the committed state")
                v["step"] = c.record_finding
                return
            if c.data_finding is None:
                v["verdict"] = "auditor_wrong"
                v["reasons"].append(f"interval {i}: this replay reaches the committed state; the audit's leaf was wrong")
            v["step"] = c.data_finding
            return
        step = self._first_disputed_step(c, a - 1, b - 1)
        v["step"] = step
        # phase 3 and the referee
        self._dispute_step(c, step, v)
        if c.data_finding is not None and v["verdict"] != "trainer_wrong":
            v["verdict"] = "trainer_wrong"  # its own committed record says it consumed other data
            v["reasons"].append(f"step {c.data_finding}: the trainer's committed data record is not what "
                                f"{self._batches_of(c.data_finding)} yields, whatever the referee found at step {step}")

    def _batches_of(self, s: int) -> str:
        g = self.run.micro_batches
        return f"batch({s})" if g == 1 else f"batch({s * g})..batch({s * g + g - 1}) (the micro-batches of step {s})"

    def _first_disputed_step(self, c: SimpleNamespace, lo: int, hi: int) -> int:
        """Bisection over per-step state hashes: the state after ``lo`` is agreed (``c.a - 1``: the
        interval's checkpoint), the one after ``hi`` disputed. ``log2`` queries."""
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if self.state_after(mid) == c.states[mid]:
                lo = mid
            else:
                hi = mid
        return hi

    def _op(self, step: int, index: int) -> dict:
        return self.ask(f"op {index} of step {step}", self.p.op, step, index, returns=dict)

    def _dispute_step(self, c: SimpleNamespace, step: int, v: Verdict, upto: int | None = None):
        """Phase 3 on ``step``, whose state before is agreed: bisection over the running hash of the two
        sides' op traces (over ops 1..``upto`` when given), then the referee on the first op that differs.
        Returns ("ruled", ...) when the referee ruled (into ``v``), ("agree", trace, answers) when every
        op through ``upto`` agrees, ("none", ...) when there is nothing to rule on."""
        rep = c.rep
        trace = OpTrace(capture=upto)
        with self._replaying(f"step {step}"):
            rep.goto(c.a, step, c.start)
            rep.run_step(step, trace)
        entries = trace.entries
        if upto is None:
            n_prover = self.ask(f"op count of step {step}", self.p.op_count, step)
            # a count below 0 would index this side's trace from its end (HttpProver refuses one; a Prover of
            # another transport may not)
            if type(n_prover) is not int or n_prover < 0:
                raise _Lost(f"the prover's op count of step {step} is not a count of operators "
                            f"({str(n_prover)[:40]})")
            n = min(n_prover, len(entries))
            if n_prover != len(entries):
                v["reasons"].append(f"step {step}: the prover ran {n_prover} operators, this replay {len(entries)}")
        elif not 1 <= upto <= len(entries):
            return "none", trace, {}
        else:
            n = n_prover = upto
        # the first index whose running hash differs (indices 1..n), by bisection; every answer is kept
        answers, first_bad, left, right = {}, None, 1, n
        while left <= right:
            mid = (left + right) // 2
            answers[mid] = self._op(step, mid)
            if answers[mid].get("chain") != entries[mid - 1]["chain"]:
                first_bad, right = mid, mid - 1
            else:
                left = mid + 1
        if first_bad is None:
            if upto is not None:
                return "agree", trace, answers
            if n_prover < len(entries):
                first_bad = n + 1  # the prover claims fewer ops than the replay runs: it must show op n + 1
            else:
                v["reasons"].append(f"step {step}: every operator agrees but the states differ")
                return "none", trace, answers
        mine = entries[first_bad - 1]
        theirs = answers[first_bad] if first_bad in answers else self._op(step, first_bad)
        v.update(operator=mine["op"], operator_index=first_bad, module=mine.get("where"))
        own_call = trace.captured if upto == first_bad else self._own_call(c, step, first_bad, mine)
        prev = entries[first_bad - 2]["chain"] if first_bad > 1 else ""
        if self.run.micro_batches > 1:  # a data-parallel step: the part (micro-batch or update) it lies in
            v["micro_batch"] = parallel.part_of(mine.get("part", ""))
        self._apply(v, referee(self, rep, step, first_bad, mine, theirs, _part_log(c, step, mine), own_call, prev))
        return "ruled", trace, answers

    def _own_call(self, c: SimpleNamespace, step: int, index: int, mine: dict) -> bytes:
        """This side's own call of op ``index`` of ``step`` (its non-tensor arguments, random-op index and
        tensors), captured in a replay of the step."""
        cap = OpTrace(capture=index)
        with self._replaying(f"step {step}"):
            c.rep.goto(c.a, step, c.start)
            c.rep.run_step(step, cap)
        if cap.captured is None or len(cap.entries) < index or cap.entries[index - 1]["chain"] != mine["chain"]:
            raise VeritrainError(f"step {step}: two replays of this side disagree at op {index} (a nondeterministic "
                                 f"replay); the referee cannot rule")
        return cap.captured

    @staticmethod
    def _apply(v: Verdict, ruling: dict):
        notes = ruling.pop("notes", [])
        v.update({k: x for k, x in ruling.items() if k != "verdict" or x is not None})
        v["reasons"].extend(notes)

    # suspicious entries -------------------------------------------------------------------------------

    def _suspicious_claims(self) -> list[dict]:
        """Where the audit found suspicious log entries (step, op index, output slot, position, kind),
        earliest first."""
        out, seen = [], set()
        for r in self.audit.get("intervals") or []:
            for d in (r.get("suspicious_details") or []) if isinstance(r, dict) else []:
                try:
                    claim = {k: int(d[k]) for k in ("step", "op_index", "slot", "position")}
                    claim["kind"], claim["op"] = str(d["kind"]), str(d.get("op") or "")
                except (KeyError, TypeError, ValueError):
                    continue
                key = tuple(claim.values())
                if 0 <= claim["step"] < self.run.steps and claim["op_index"] >= 1 and key not in seen:
                    seen.add(key)
                    out.append(claim)
        return sorted(out, key=lambda c: (c["step"], c["op_index"], c["slot"], c["position"]))

    def _dispute_suspicious(self, v: Verdict):
        """The audit rejected for suspicious log entries: the referee recomputes the op of one of them
        with the trainer's log record and confirms it (the trainer loses) or does not."""
        claims = self._suspicious_claims()
        if not claims:
            return
        for claim in claims[:MAX_CLAIMS]:
            w = Verdict(verdict=None, interval=claim["step"] // self.run.checkpoint_every, step=claim["step"],
                        operator=None, module=None, reasons=[], referee_ops=0, referee_bytes=0)
            self._dispute_claim(claim, w)
            w["interval_replay_ops"] = self._interval.replay_ops if self._interval is not None else 0
            where = f"step {claim['step']}, op #{claim['op_index']}, output {claim['slot']}, position {claim['position']}"
            if w["verdict"] == "trainer_wrong":
                v["reasons"] += [r for r in w.pop("reasons")]
                if v["verdict"] == "auditor_wrong":
                    v["reasons"].append(f"(the interval dispute was ruled for the trainer: {v.get('ruling')})")
                v.update(w, suspicious_entry=claim)
                return
            v["reasons"].append(f"the audit's suspicious entry at {where} is not confirmed: "
                                f"{w.get('ruling') or '; '.join(w['reasons']) or 'no ruling'}")
        if v["verdict"] == "no_dispute":
            v["verdict"] = "auditor_wrong"
            v["reasons"].append("none of the audit's suspicious entries that the referee checked is confirmed")

    def _dispute_claim(self, claim: dict, w: Verdict):
        s, k = claim["step"], claim["op_index"]
        c = self._replay_interval(s // self.run.checkpoint_every)
        if s > c.a:  # the state before the step must be agreed; if not, the dispute is about an earlier step
            theirs = self.state_after(s - 1)
            if theirs != c.states[s - 1]:
                t = self._first_disputed_step(c, c.a - 1, s - 1)
                w.update(step=t, verdict="trainer_wrong")
                self._dispute_step(c, t, w)
                return
        status, trace, answers = self._dispute_step(c, s, w, upto=k)
        if status == "none":
            w["ruling"] = f"this side's replay of step {s} has no op #{k}"
            return
        if status == "ruled":
            return
        mine = trace.entries[k - 1]
        if claim["op"] and claim["op"] != mine["op"]:
            w["ruling"] = f"op #{k} of step {s} is {mine['op']}, not {claim['op']}"
            return
        w.update(operator=mine["op"], operator_index=k, module=mine.get("where"))
        if self.run.micro_batches > 1:  # as for a disputed op: the part of the step the entry lies in
            w["micro_batch"] = parallel.part_of(mine.get("part", ""))
        prev = trace.entries[k - 2]["chain"] if k > 1 else ""
        self._apply(w, referee_suspicious(self, c.rep, s, k, mine, answers[k], _part_log(c, s, mine), trace.captured,
                                          prev, claim))

    def _checked_checkpoint(self, start_state, first_step):
        kept = {}

        def get(step):
            if step != first_step:
                raise RuntimeError("the challenger only loads the interval's agreed checkpoint")
            if step not in kept:  # checked against the agreed state hash each time it is loaded
                kept[step] = self.ask(f"checkpoint {step}", self.p.checkpoint, step, returns=bytes)
            return kept[step]
        return get

    def _checked_log(self, records, logs):
        """The prover's logs, each checked against its committed record: ``logs[step]`` (a data-parallel step's
        update), ``logs[(step, g)]`` (its micro-batch g)."""
        def get(step, micro=None):
            key = step if micro is None else (step, micro)
            if key not in logs:
                if micro is None:
                    raw = self.ask(f"log {step}", self.p.log, step, returns=bytes)
                    want = records[step].get("log_sha256")
                else:
                    raw = self.ask(f"log {step} of micro-batch {micro}", self.p.log, step, micro, returns=bytes)
                    entries = records[step].get("micro_batches")
                    want = entries[micro].get("log_sha256") if isinstance(entries, list) and micro < len(entries) \
                        and isinstance(entries[micro], dict) else None
                if hashlib.sha256(raw).hexdigest() != want:
                    raise _Lost(f"the prover's rounding log for step {step}"
                                f"{'' if micro is None else f', micro-batch {micro},'} does not match its committed record")
                logs[key] = raw
            return logs[key]
        return get


def _part_log(c: SimpleNamespace, step: int, mine: dict) -> bytes | None:
    """The committed log of the op stream an op of this side's trace ran in: the step's, or in a
    data-parallel step its micro-batch's (the update's is the step's)."""
    g = parallel.part_of(mine.get("part") or "")
    return c.logs.get(step) if g is None else c.logs.get((step, g))


def play(prover: Prover, audit: dict, root: str | None, policy: Policy, device="cpu") -> dict:
    """The whole game as the challenger: its verdict as a dict, a prover that fails at the start included."""
    try:
        return dict(Challenger(prover, audit, root, policy=policy, device=device).play())
    except _Lost as e:
        return {"verdict": "trainer_wrong", "interval": None, "step": None, "operator": None, "module": None,
                "queries": 1, "referee_ops": 0, "referee_bytes": 0, "reasons": [e.why]}


# --- the referee -------------------------------------------------------------------------------


def _checked_inputs(ch: Challenger, step: int, index: int, mine: dict, theirs: dict, prev_chain: str, out: dict,
                    own_call: bytes):
    """The prover's tensor inputs for op ``index``: its entry must hash into the running hash it answered
    with (so it binds the op, arguments, random-op index and outputs the bisection compared; not the input
    digests, OpTrace.link), name the same op, and the tensors it sends must have the digests its entry
    claims, as many as this side's own call of the op (``own_call``) takes. Returns (that call: func, args,
    kwargs, random-op index, its tensors; the prover's tensors, each where this side's own is), or a ruling."""
    def lose(why):
        return {**out, "verdict": "trainer_wrong", "ruling": why}

    link = OpTrace.link(prev_chain, theirs)
    if not link or link != theirs.get("chain"):  # an entry that cannot be hashed links to "": it binds nothing
        return lose(f"the prover's entry for op {index} of step {step} does not hash to the running hash it "
                    f"answered with (an inconsistent answer)")
    if theirs.get("op") != mine["op"]:
        return lose(f"the prover's op {index} is {str(theirs.get('op'))[:80]}, the replay runs {mine['op']}")
    payload = ch.ask(f"inputs of op {index} of step {step}", ch.p.op_inputs, step, index, returns=bytes)
    out["referee_bytes"] += len(payload)
    try:
        sent = load_call_tensors(payload)
    except Exception as e:  # noqa: BLE001 - any malformed payload is the prover's fault
        return lose(f"the prover's inputs for op {index} are malformed ({str(e)[:200]})")
    if [_digest(t) for t in sent] != theirs.get("inputs"):
        return lose(f"the prover sent inputs for op {index} that differ from the ones it claimed")
    func, args, kwargs, random_index, own = load_call(own_call)
    if len(sent) != len(own) or len(own) != len(mine["inputs"]):
        return lose(f"the prover sent {len(sent)} tensor inputs for {mine['op']}, which takes {len(own)}")
    return (func, args, kwargs, random_index, own), [t.to(o.device) for t, o in zip(sent, own)]


def referee(ch: Challenger, rep: Replayer, step: int, index: int, mine: dict, theirs: dict, log: bytes | None,
            own_call: bytes, prev_chain: str = "") -> dict:
    """Rule on op ``index`` of ``step``, the first whose running hash differs, by recomputing it alone.

    The call is this side's own (``own_call``, captured in its replay: the op, its non-tensor arguments
    and random-op index); the prover's payload supplies only tensors, each checked against the digest it
    claimed. An input whose digest both sides agree on is trusted (an earlier agreed op's output, or
    agreed state). A disputed input that this side's trace names as the step's data (``batch:NAME``) must
    be exactly the tensor ``batch(step)`` yields under that name; any other disputed input is ruled
    against the trainer. The op is then recomputed with the trainer's logged rounding decisions for it,
    and the party whose output it reproduces is right."""
    out = {"referee_ops": 0, "referee_bytes": len(log) if log else 0}
    checked = _checked_inputs(ch, step, index, mine, theirs, prev_chain, out, own_call)
    if isinstance(checked, dict):
        return checked
    (func, args, kwargs, random_index, own), sent = checked
    notes = []
    if theirs.get("args") != mine.get("args"):
        notes.append(f"op {index} of step {step}: the prover's trace binds other non-tensor arguments of "
                     f"{mine['op']} than this side's replay (the referee uses its own)")
    if theirs.get("random_index") != mine.get("random_index"):
        notes.append(f"op {index} of step {step}: the prover's trace gives random-op index "
                     f"{str(theirs.get('random_index'))[:20]}, this side's replay {mine.get('random_index')}")
    inputs, data_wrong, disputed, batch = [], None, [], None
    sources = mine.get("sources") or [None] * len(own)
    for j, (t, d_p, d_c, src) in enumerate(zip(sent, theirs["inputs"], mine["inputs"], sources)):
        if d_p == d_c:
            inputs.append(t)
            continue
        if isinstance(src, str) and (src.startswith("batch:") or src.startswith("batch/")):
            # batch:NAME, or batch/g:NAME for micro-batch g of a data-parallel step
            kind, _, name = src.partition(":")
            if batch is None or batch[0] != kind:
                g = parallel.part_of("micro/" + kind[len("batch/"):]) if kind != "batch" else None
                batch = (kind, batch_leaves(rep.batch(step) if g is None else rep.micro_batch(step, g)))
            truth = batch[1].get(name)
            if truth is not None and _digest(truth) == d_p:
                inputs.append(t)  # exactly that tensor of batch(step): this side's input was the wrong one
                continue
            if data_wrong is None:
                g = parallel.part_of("micro/" + kind[len("batch/"):]) if kind != "batch" else None
                data_wrong = (j, name, f"batch({step})" if g is None else
                              f"batch({step * rep.run.micro_batches + g}) (micro-batch {g} of step {step})")
            inputs.append(truth if truth is not None else own[j])
            continue
        disputed.append(f"input {j} ({src or 'unknown source'})")
        inputs.append(own[j])
    try:
        digests = recompute(rep, step, mine.get("index", index), func, *_with_tensors(args, kwargs, inputs),
                            random_index, log, domain=mine.get("part", "op"))
    except (ReplayMismatchError, LogFormatError) as e:
        return {**out, "verdict": "trainer_wrong", "notes": notes,
                "ruling": f"the trainer's log has no usable record for op {index} of step {step} ({e})"}
    out["referee_ops"] = 1
    gives = ("the auditor's" if digests == mine["outputs"] else
             "the trainer's" if digests == theirs.get("outputs") else "neither party's")
    if data_wrong is not None:
        j, name, label = data_wrong
        return {**out, "verdict": "trainer_wrong", "input": j, "notes": notes,
                "ruling": f"input {j} of {mine['op']} is not the tensor {label} yields at {name}: the trainer "
                          f"trained step {step} on other data than the task's (recomputed on that tensor, the op "
                          f"gives {gives} output)"}
    if disputed:
        return {**out, "verdict": "trainer_wrong", "notes": notes,
                "ruling": "; ".join(disputed) + " of " + mine["op"] + " differ(s) from this side's although the "
                          "state before the step is agreed"}
    if digests == theirs.get("outputs") and digests != mine["outputs"]:
        return {**out, "verdict": "auditor_wrong", "notes": notes,
                "ruling": f"{mine['op']} recomputed gives the trainer's output"}
    return {**out, "verdict": "trainer_wrong", "notes": notes,
            "ruling": f"{mine['op']} recomputed on the agreed inputs with the referee's own arguments and the logged "
                      f"rounding decisions gives {gives} output"}


def referee_suspicious(ch: Challenger, rep: Replayer, step: int, index: int, mine: dict, theirs: dict,
                       log: bytes | None, own_call: bytes, prev_chain: str, claim: dict) -> dict:
    """Confirm the audit's claim that the trainer's log entry for op ``index`` of ``step`` (output
    ``claim['slot']``, position ``claim['position']``) is suspicious: both sides agree on every op through
    this one, so the referee recomputes it alone (its own call, the prover's checked tensors) with the
    trainer's log record and looks at what the engine flags. ``verdict`` is None when not confirmed."""
    out = {"referee_ops": 0, "referee_bytes": len(log) if log else 0}
    checked = _checked_inputs(ch, step, index, mine, theirs, prev_chain, out, own_call)
    if isinstance(checked, dict):
        return checked
    (func, args, kwargs, random_index, own), sent = checked
    # every op before this one agrees (their outputs and arguments are bound by the running hash): an input
    # whose digest still differs is not one the op reads (uninitialised memory it overwrites): this side's
    sent = [t if d_p == d_c else mine_t for t, d_p, d_c, mine_t in zip(sent, theirs["inputs"], mine["inputs"], own)]
    if log is None:
        return {**out, "verdict": None, "ruling": "the run has no rounding logs"}
    try:
        digests, flagged = recompute_op(rep, step, mine.get("index", index), func, *_with_tensors(args, kwargs, sent),
                                        random_index, log, domain=mine.get("part", "op"))
    except (ReplayMismatchError, LogFormatError) as e:
        return {**out, "verdict": "trainer_wrong",
                "ruling": f"the trainer's log has no usable record for op {index} of step {step} ({e})"}
    out["referee_ops"] = 1
    key = (claim["slot"], claim["position"], claim["kind"])
    hit = next((x for x in flagged if (x.slot, x.position, x.kind) == key), None)
    if hit is None:
        return {**out, "verdict": None,
                "ruling": f"{mine['op']} recomputed with the trainer's log record flags no {claim['kind']} entry at "
                          f"output {claim['slot']}, position {claim['position']}"}
    return {**out, "verdict": "trainer_wrong",
            "ruling": f"{mine['op']} (op {index} of step {step}) recomputed on the agreed inputs with the trainer's "
                      f"log record: its {hit.kind} entry at output {hit.slot}, position {hit.position} is suspicious "
                      f"({hit.detail})"}


def _with_tensors(args, kwargs, tensors):
    """(args, kwargs) of a call with its tensor arguments replaced, in order."""
    from torch.utils._pytree import tree_flatten, tree_unflatten

    leaves, spec = tree_flatten((args, kwargs))
    it = iter(tensors)
    leaves = [next(it) if isinstance(x, torch.Tensor) else x for x in leaves]
    a, k = tree_unflatten(leaves, spec)
    return tuple(a), dict(k)


def recompute_op(rep: Replayer, step: int, index: int, func, args, kwargs, random_index: int, log: bytes | None,
                 domain: str = "op"):
    """Evaluate one operator under the engine, positioned at op ``index`` of ``step``'s op stream ``domain`` (a
    data-parallel step's part) with its log record. Returns (output digests, the suspicious entries flagged)."""
    record = None
    if log is not None:
        reader = StepLogReader(log, expect_step=step, expect_bits=rep.bits)
        try:
            for _ in range(index):
                record = reader.next_op()
                if record is None:
                    break
        finally:
            reader.close()
    trace = OpTrace()
    with step_context(rep.engine, step, reader=_OneRecord(record) if log is not None else None,
                      trace=trace, check_trailing=False, domain=domain) as mode:
        mode.op_index = index - 1
        mode.random_index = random_index
        func(*args, **kwargs)
    return (trace.entries[-1]["outputs"] if trace.entries else None), list(mode.stats.suspicious)


def recompute(rep: Replayer, step: int, index: int, func, args, kwargs, random_index: int, log: bytes | None,
              domain: str = "op"):
    """The output digests of one operator evaluated alone (``recompute_op``)."""
    return recompute_op(rep, step, index, func, args, kwargs, random_index, log, domain)[0]


class _OneRecord:
    def __init__(self, record):
        self.record = record

    def next_op(self):
        r, self.record = self.record, None
        return r

    def close(self):
        pass


def _is_digest(h) -> bool:
    """A SHA-256 digest as hexdigest() writes it (64 lowercase hex digits): what a state or running hash is."""
    return isinstance(h, str) and len(h) == 64 and all(ch in "0123456789abcdef" for ch in h)


def _digest(t: torch.Tensor) -> str:
    from .engine import _tensor_digest

    return _tensor_digest(t).hex()
