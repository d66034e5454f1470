"""The verification game (after Teutsch & Reitwiessner): a challenger narrows a dispute with the trainer's
run (the prover) to one interval, one step and one operator, and a referee recomputes only that operator.

    phase 1  bisection over the run's Merkle tree      -> the first interval whose leaf differs
    phase 2  bisection over per-step state hashes       -> the first step whose state differs
    phase 3  bisection over per-operator output hashes  -> the first operator whose output differs
    referee  recomputes that operator on the prover's inputs, checked against agreed hashes, with the
             trainer's logged rounding decisions for it

Every answer of the prover is checked against the committed root (or against hashes that were checked
against it) before it is used; a prover that answers inconsistently, times out or refuses loses.
The prover is a ``LocalProver`` (a run directory in this process) or an ``HttpProver`` (``veritrain
serve``); both implement ``Prover``.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
import time
import typing

import torch

from . import store
from .checkpoint import CheckpointError, hash_state, load_checkpoint
from .commitments import batch_hash
from .engine import EngineConfig, OpTrace, VeritrainError, load_call, step_context
from .logformat import LogFormatError, StepLogReader
from .merkle import children, leaf_hash, node_hash, verify_inclusion
from .rounding import Grid
from .task import TaskError, build


class ProverError(VeritrainError):
    """The prover failed to answer (timeout, refusal, malformed answer)."""


# --- replaying a run's steps -------------------------------------------------------------------


class Replayer:
    """Replays steps of a run from one of its checkpoints with its logs, on this machine.

    ``checkpoint(step)`` and ``log(step)`` return the bytes of the run's files (local or fetched);
    the task is this side's own build of the manifest's task, so its ``batch(step)`` is this side's data.
    """

    def __init__(self, manifest: dict, checkpoint, log):
        self.manifest = manifest
        self._checkpoint, self._log = checkpoint, log
        try:
            self.task = build(manifest["task"], manifest["config"])
        except TaskError as e:
            raise store.RunError(f"cannot rebuild the run's task: {e}") from None
        self.mode, self.bits = manifest["mode"], int(manifest["bits"])
        self.engine = EngineConfig(mode=self.mode, bits=self.bits, seed=int(manifest["seed"]),
                                   thresholds=manifest["thresholds"], slack=float(manifest.get("slack", 2.0)))
        self.grid = Grid(self.bits)
        if self.mode == "fp64":
            self.task.model.double()
        self.at = None  # the step count of the state currently loaded
        self.ops_replayed = 0
        self.module_names = {id(m): n or "<model>" for n, m in self.task.model.named_modules()}

    def load(self, step: int, expect_state: str | None = None) -> str:
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

        return _prepare_batch(self.task.batch(step), self.mode, self.grid)

    def run_step(self, step: int, trace: OpTrace | None = None):
        """One step from the loaded state; returns (loss, batch)."""
        if self.at != step:
            raise RuntimeError(f"replayer holds the state after {self.at} steps, not {step}")
        reader = None
        if self.mode == "verified":
            try:
                reader = StepLogReader(self._log(step), expect_step=step, expect_bits=self.bits)
            except LogFormatError as e:
                raise store.RunError(f"step {step}: {e}") from None
        batch = self.batch(step)
        hooks = []
        if trace is not None:
            trace.add_sources(batch_leaves(batch), "batch")
            trace.add_sources(state_tensors(self.task), "state")
            hooks = _module_hooks(trace, self.module_names)
        try:
            with step_context(self.engine, step, reader=reader, trace=trace) as st:
                loss = self.task.run_step(batch)
        finally:
            for h in hooks:
                h.remove()
            if reader is not None:
                reader.close()
        self.ops_replayed += st.stats.ops
        self.at = step + 1
        self.last_stats = st.stats
        return loss, batch

    def state_hash(self) -> str:
        return hash_state(self.task.model, self.task.optimizer, self.task.scheduler, self.at)

    def goto(self, interval_start: int, step: int, start_state: str | None = None):
        """Load the checkpoint at ``interval_start`` (unless already at a state in between) and run to ``step``."""
        if self.at is None or self.at > step or self.at < interval_start:
            self.load(interval_start, start_state)
        while self.at < step:
            self.run_step(self.at)


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
    def log(self, step: int) -> bytes: ...
    def record(self, step: int) -> bytes: ...
    def state_after(self, step: int) -> str: ...
    def op_count(self, step: int) -> int: ...
    def op(self, step: int, index: int) -> dict: ...
    def op_inputs(self, step: int, index: int) -> bytes: ...


class LocalProver(Prover):
    """Answers from a run directory, replaying steps with its own task when asked about them."""

    def __init__(self, run_dir: str):
        self.run_dir = run_dir
        self._manifest = store.load_manifest(run_dir)
        self._leaves = [bytes.fromhex(x) for x in self._manifest.get("leaves", [])]  # what the root commits to
        self._tree = store.tree_of(self._leaves)
        self._replayer = None
        self._states: dict[int, str] = {}
        self._traces: dict[int, OpTrace] = {}

    def _read(self, name: str) -> bytes:
        p = os.path.join(self.run_dir, name)
        try:
            with open(p, "rb") as f:
                return f.read()
        except OSError as e:
            raise ProverError(f"the run has no readable {name} ({e.strerror})") from None

    def manifest(self) -> dict:
        return self._manifest

    def node(self, lo, hi):
        return self._tree.node(lo, hi)

    def leaf(self, index):
        return self._leaves[index], self._tree.inclusion_proof(index)

    def checkpoint(self, step):
        return self._read(store.ckpt_name(step))

    def log(self, step):
        return self._read(store.log_name(step))

    def record(self, step):
        return self._read(store.record_name(step))

    def _interval_start(self, step: int) -> int:
        k = self._manifest["checkpoint_every"]
        return (step // k) * k

    def _rep(self) -> Replayer:
        if self._replayer is None:
            self._replayer = Replayer(self._manifest, self.checkpoint, self.log)
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
    """The auditor's side of the game: its own replay, checked answers, counted queries."""

    def __init__(self, prover: Prover, audit: dict, root: str | None = None):
        self.p = prover
        self.audit = audit
        self.queries = 0
        self.bytes = 0
        try:
            self.m = prover.manifest()
        except Exception as e:
            raise _Lost(f"the prover did not send its manifest ({e})") from None
        self.root = bytes.fromhex(root or audit.get("root") or self.m.get("root", ""))
        if self.m.get("root") and self.m["root"] != self.root.hex():
            raise _Lost(f"the prover's manifest commits to root {self.m['root'][:16]}…, not the audited "
                        f"root {self.root.hex()[:16]}…")
        if audit.get("run_sha256") and store.run_sha256(self.m).hex() != audit["run_sha256"]:
            raise _Lost("the prover's manifest describes another run than the one audited")
        self.n = len(store.intervals(int(self.m.get("steps_completed", self.m["steps"])), self.m["checkpoint_every"]))

    def ask(self, what: str, fn, *args):
        self.queries += 1
        try:
            out = fn(*args)
        except (ProverError, LookupError, ValueError) as e:
            raise _Lost(f"the prover failed to answer {what}: {e}") from None
        if isinstance(out, (bytes, bytearray)):
            self.bytes += len(out)
        return out

    # phase 1 ------------------------------------------------------------------------------------

    def first_disputed_interval(self) -> int | None:
        own = self.audit.get("leaves") or {}
        own = {int(k): bytes.fromhex(v) for k, v in own.items()}
        if len(own) == self.n and self.n:
            from .merkle import MerkleTree

            mine = MerkleTree([own[i] for i in range(self.n)])
            if mine.root() == self.root:
                return None
            lo, hi, expect = 0, self.n, self.root
            while hi - lo > 1:
                (a, b), (c, d) = children(lo, hi)
                left = self.ask(f"node [{a},{b})", self.p.node, a, b)
                right = self.ask(f"node [{c},{d})", self.p.node, c, d)
                if node_hash(left, right) != expect:
                    raise _Lost(f"the prover's nodes [{a},{b}) and [{c},{d}) do not hash to their parent "
                                f"[{lo},{hi}) (inconsistent with the committed root)")
                if left != mine.node(a, b):
                    lo, hi, expect = a, b, left
                else:
                    lo, hi, expect = c, d, right
            return lo
        # a partial audit: the first audited interval that differs, checked with an inclusion proof
        for i in sorted(own):
            data, proof = self.leaf(i)
            if leaf_hash(data) != own[i]:
                return i
        return None

    def leaf(self, i: int) -> bytes:
        data, proof = self.ask(f"leaf {i}", self.p.leaf, i)
        if not verify_inclusion(leaf_hash(data), i, self.n, proof, self.root):
            raise _Lost(f"the prover's inclusion proof for leaf {i} does not verify against the committed root")
        return data

    # phases 2 and 3 ----------------------------------------------------------------------------

    def play(self) -> Verdict:
        t0 = time.perf_counter()
        v = Verdict(verdict="no_dispute", interval=None, step=None, operator=None, module=None, queries=0,
                    referee_ops=0, referee_bytes=0, interval_replay_ops=0, reasons=[])
        try:
            i = self.first_disputed_interval()
            if i is not None:
                v.update(interval=i, verdict="trainer_wrong")
                self._dispute_interval(i, v)
        except _Lost as e:
            v["verdict"] = "trainer_wrong"
            v["reasons"].append(e.why)
        v["queries"] = self.queries
        v["bytes_received"] = self.bytes
        v["seconds"] = time.perf_counter() - t0
        return v

    def _dispute_interval(self, i: int, v: Verdict):
        info = store.parse_leaf(self.leaf(i))
        if info["run_sha256"] != store.run_sha256(self.m).hex():
            raise _Lost(f"leaf {i} commits to another run description than the prover's manifest")
        a, b = info["first_step"], info["end_step"]
        start_state = self.m.get("initial_state_sha256") if i == 0 else store.parse_leaf(self.leaf(i - 1))["state_sha256"]
        # the trainer's records and logs for the interval, each checked against the leaf
        records, logs = {}, {}
        for s, h in zip(range(a, b), info["records"]):
            raw = self.ask(f"record {s}", self.p.record, s)
            if hashlib.sha256(raw).hexdigest() != h:
                raise _Lost(f"the prover's data record for step {s} does not match leaf {i}")
            records[s] = json.loads(raw)
        rep = Replayer(self.m, self._checked_checkpoint(start_state, a), self._checked_log(records, logs))
        rep.load(a, start_state)
        mine = {}
        data_finding = None
        for s in range(a, b):
            loss, batch = rep.run_step(s)
            mine[s] = rep.state_hash()
            if data_finding is None and records[s].get("batch_sha256") != batch_hash(batch):
                data_finding = s
        v["interval_replay_ops"] = rep.ops_replayed
        if data_finding is not None:
            v["reasons"].append(f"step {data_finding}: the trainer's data record differs from what the task's "
                                f"batch({data_finding}) yields (it trained on other data than it claims)")
            v["data_step"] = data_finding
        # phase 2: the first step whose state differs
        last = self.ask(f"state after step {b - 1}", self.p.state_after, b - 1)
        if last != info["state_sha256"]:
            raise _Lost(f"the prover's replay of step {b - 1} ends in {last[:16]}…, its leaf commits to "
                        f"{info['state_sha256'][:16]}…")
        if mine[b - 1] == last:
            if data_finding is None:
                v["verdict"] = "auditor_wrong"
                v["reasons"].append(f"interval {i}: this replay reaches the committed state; the audit's leaf was wrong")
            v["step"] = data_finding
            return
        lo, hi = a - 1, b - 1  # state after lo agreed (a - 1: the interval's start), after hi disputed
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if self.ask(f"state after step {mid}", self.p.state_after, mid) == mine[mid]:
                lo = mid
            else:
                hi = mid
        step = hi
        v["step"] = step
        # phase 3: the first operator whose output differs
        rep.goto(a, step, start_state)
        trace = OpTrace()
        rep.run_step(step, trace)
        n_prover = self.ask(f"op count of step {step}", self.p.op_count, step)
        n = min(n_prover, len(trace.entries))
        lo, hi = 0, None
        if n_prover != len(trace.entries):
            v["reasons"].append(f"step {step}: the prover ran {n_prover} operators, this replay {len(trace.entries)}")
        # find the first index whose outputs differ (indices 1..n), by bisection
        first_bad = None
        left, right = 1, n
        while left <= right:
            mid = (left + right) // 2
            theirs = self.ask(f"op {mid} of step {step}", self.p.op, step, mid)
            if theirs.get("chain") != trace.entries[mid - 1]["chain"]:
                first_bad, right = mid, mid - 1
            else:
                left = mid + 1
        if first_bad is None:
            if n_prover != len(trace.entries):
                first_bad = n + 1 if n < len(trace.entries) else None
            if first_bad is None:
                v["reasons"].append(f"step {step}: every operator agrees but the states differ")
                return
        mine_op = trace.entries[first_bad - 1]
        theirs = self.ask(f"op {first_bad} of step {step}", self.p.op, step, first_bad)
        v["operator"] = mine_op["op"]
        v["operator_index"] = first_bad
        v["module"] = mine_op.get("where")
        ruling = referee(self, rep, step, first_bad, mine_op, theirs, logs[step] if step in logs else None)
        v.update(ruling)

    def _checked_checkpoint(self, start_state, first_step):
        def get(step):
            if step != first_step:
                raise RuntimeError("the challenger only loads the interval's agreed checkpoint")
            return self.ask(f"checkpoint {step}", self.p.checkpoint, step)
        return get

    def _checked_log(self, records, logs):
        def get(step):
            if step not in logs:
                raw = self.ask(f"log {step}", self.p.log, step)
                want = records[step].get("log_sha256")
                if hashlib.sha256(raw).hexdigest() != want:
                    raise _Lost(f"the prover's rounding log for step {step} does not match its committed record")
                logs[step] = raw
            return logs[step]
        return get


# --- the referee -------------------------------------------------------------------------------


def referee(ch: Challenger, rep: Replayer, step: int, index: int, mine: dict, theirs: dict, log: bytes | None) -> dict:
    """Recompute operator ``index`` of ``step`` alone and rule. Its inputs come from the prover; each is
    checked against an input hash both parties agree on, or (for the step's data) against batch(step)."""
    out = {"referee_ops": 0, "referee_bytes": 0}
    payload = ch.ask(f"inputs of op {index} of step {step}", ch.p.op_inputs, step, index)
    out["referee_bytes"] = len(payload) + (len(log) if log else 0)
    try:
        func, args, kwargs, random_index, tensors = load_call(payload)
    except Exception as e:  # noqa: BLE001 - any malformed payload is the prover's fault
        out["verdict"] = "trainer_wrong"
        out.setdefault("reasons", []).append(f"the prover's inputs for op {index} are malformed ({e})")
        return out
    reasons = []
    sent = [_digest(t) for t in tensors]
    if sent != theirs.get("inputs"):
        return {**out, "verdict": "trainer_wrong",
                "reasons_referee": f"the prover sent inputs for op {index} that differ from the ones it claimed"}
    if str(func) != mine["op"] or theirs.get("op") != mine["op"]:
        return {**out, "verdict": "trainer_wrong",
                "reasons_referee": f"the prover's op {index} is {theirs.get('op')}, the replay runs {mine['op']}"}
    for j, (d_p, d_c, src) in enumerate(zip(theirs["inputs"], mine["inputs"], mine.get("sources", []))):
        if d_p == d_c:
            continue
        # a disputed input that is not the output of an earlier (agreed) operator: the step's data or state
        if src and src.startswith("batch"):
            own = {_digest(t) for t in batch_leaves(rep.batch(step)).values()}
            out["referee_ops"] = 0
            if d_p not in own:
                return {**out, "verdict": "trainer_wrong", "input": j,
                        "ruling": f"input {j} of {mine['op']} is not the tensor batch({step}) yields: the trainer "
                                  f"trained step {step} on other data than the task's"}
            return {**out, "verdict": "auditor_wrong", "input": j,
                    "ruling": f"input {j} of {mine['op']} is the tensor batch({step}) yields"}
        reasons.append(f"input {j} ({src or 'unknown source'}) differs")
    if reasons:
        return {**out, "verdict": "trainer_wrong", "ruling": "; ".join(reasons) +
                " although the state before the step is agreed"}
    digests = recompute(rep, step, index, func, args, kwargs, random_index, log)
    out["referee_ops"] = 1
    if digests == theirs.get("outputs") and digests != mine["outputs"]:
        return {**out, "verdict": "auditor_wrong", "ruling": f"{mine['op']} recomputed gives the trainer's output"}
    return {**out, "verdict": "trainer_wrong",
            "ruling": f"{mine['op']} recomputed on the agreed inputs with the logged rounding decisions "
                      f"gives {'the auditor' if digests == mine['outputs'] else 'neither party'}'s output"}


def recompute(rep: Replayer, step: int, index: int, func, args, kwargs, random_index: int, log: bytes | None):
    """Evaluate one operator under the engine, positioned at op ``index`` of ``step`` with its log record."""
    record = None
    if log is not None:
        reader = StepLogReader(log, expect_step=step, expect_bits=rep.bits)
        for _ in range(index):
            record = reader.next_op()
        reader.close()
    trace = OpTrace()
    with step_context(rep.engine, step, reader=_OneRecord(record) if record is not None else None,
                      trace=trace, check_trailing=False) as mode:
        mode.op_index = index - 1
        mode.random_index = random_index
        func(*args, **kwargs)
    return trace.entries[-1]["outputs"] if trace.entries else None


class _OneRecord:
    def __init__(self, record):
        self.record = record

    def next_op(self):
        r, self.record = self.record, None
        return r

    def close(self):
        pass


def _digest(t: torch.Tensor) -> str:
    from .engine import _tensor_digest

    return _tensor_digest(t).hex()
