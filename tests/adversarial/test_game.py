"""The verification game against a dishonest trainer and its prover (issue 8, rows #9-#12 and #14).

Each test plays the trainer: it trains a run that breaks the rules (another step size for one optimizer
op, other data for one step, a rounding steered far from any midpoint), commits to it, and answers the
game with a prover that lies where it can (another non-tensor argument, a claim that a disputed input is
another tensor of batch(step), a prover that trickles bytes or announces 10**10 steps). The auditor replays
under another emulated CPU (``--variant combo``); the game must end with ``trainer_wrong`` or a refusal.
"""

import contextlib
import json
import math
import os
import re
import socket
import subprocess
import sys
import threading
import time

import pytest
import torch

from conftest import TASKS_ENV as ENV, TEST_TASKS as TASKS, cli, flip_far_rounding, recommit, rewrite_checkpoint
from veritrain import store
from veritrain.commitments import batch_hash
from veritrain.engine import OpTrace, VerifiedMode, _tensor_digest, dump_call, load_call
from veritrain.policy import Policy
from veritrain.protocol import Challenger, LocalProver, ProverError, play
from veritrain.rounding import Grid
from veritrain.runner import TrainOptions, _prepare_batch, train
from veritrain.server import HttpProver, make_server

sys.path.insert(0, TASKS)  # in-process provers and challengers rebuild the test task
POISONED = "poisoned_digits:make_task"
POISON_STEP = 4  # interval 2 of 3
LR_STEP = 3  # interval 1 of 3
STEER_STEP = 3
COMMON = dict(steps=6, checkpoint_every=2, progress=False)


def audit(run, out, *extra, task=None):
    """``veritrain audit RUN --out OUT`` under the combo CPU variant; returns (exit code, result, audit.json)."""
    p = cli("audit", run, "--out", out, "--json", "--quiet", "--variant", "combo", *extra,
            *(["--task", task] if task else []), env=ENV)
    assert p.returncode in (0, 1), f"audit failed to run (exit {p.returncode}):\n{p.stderr}"
    with open(os.path.join(out, "audit.json")) as f:
        return p.returncode, json.loads(p.stdout), json.load(f)


@contextlib.contextmanager
def poisoned_data():
    """The dishonest trainer's data pipeline (poisoned_digits reads this when the task is built)."""
    old = os.environ.get("VERITRAIN_TEST_POISON_STEP")
    os.environ["VERITRAIN_TEST_POISON_STEP"] = str(POISON_STEP)
    try:
        yield
    finally:
        if old is None:
            del os.environ["VERITRAIN_TEST_POISON_STEP"]
        else:
            os.environ["VERITRAIN_TEST_POISON_STEP"] = old


class PoisonedProver(LocalProver):
    """The trainer's own prover: it replays with the poisoned pipeline it trained with."""

    def _rep(self):
        if self._replayer is None:
            with poisoned_data():
                return super()._rep()
        return self._replayer


# --- #10 and #12: a step trained on other data, hidden from the data record ----------------------------


@pytest.fixture(scope="module")
def hidden_poison(tmp_path_factory):
    """Step POISON_STEP trains on altered images; its committed data record claims the honest batch, so
    only the state differs (no data finding: the game must reach the referee)."""
    from veritrain.task import build

    d = tmp_path_factory.mktemp("hidden")
    run = d / "run"
    with poisoned_data():
        train(TrainOptions(task=POISONED, out=str(run), **COMMON))
    m = store.load_manifest(str(run))
    honest = build(POISONED, m["config"]).batch(POISON_STEP)
    rp = run / store.record_name(POISON_STEP)
    rec = json.loads(rp.read_bytes())
    claimed = batch_hash(_prepare_batch(honest, m["mode"], Grid(int(m["bits"]))))
    assert rec["batch_sha256"] != claimed
    store.write_bytes_atomic(str(rp), store.record_bytes(POISON_STEP, claimed, rec["batch_indices"], rec["loss"],
                                                         rec["log_sha256"]))
    recommit(run)
    return run, d


def test_10_a_disputed_data_input_must_be_that_tensor_of_batch_step(hidden_poison):
    """#10: in the game the prover claims the disputed input of the first op (conv1's images) is another
    tensor of batch(step) (the labels, which batch(step) does yield): the referee must check the input by
    its name and position, not by membership."""
    run, d = hidden_poison
    rc, result, audit_state = audit(run, d / "audit-full", task=POISONED)
    assert rc == 1 and not result["accepted"]
    assert not any("data record differs" in r for r in result["reasons"]), result["reasons"]

    class ClaimsTheLabels(PoisonedProver):
        def _labels(self, step):
            return self._rep().batch(step)[1]

        def _is_image_input(self, entry, j):
            return (entry.get("sources") or [None] * (j + 1))[j] == "batch:[0]"

        def op(self, step, index):
            e = dict(super().op(step, index))
            if step == POISON_STEP and any(self._is_image_input(e, j) for j in range(len(e["inputs"]))):
                e["inputs"] = [_tensor_digest(self._labels(step)).hex() if self._is_image_input(e, j) else x
                               for j, x in enumerate(e["inputs"])]
                link = getattr(OpTrace, "link", None)  # a consistent liar: the entry hashes to its chain
                if link is not None:
                    prev = super().op(step, index - 1)["chain"] if index > 1 else ""
                    e["chain"] = link(prev, e)
            return e

        def op_inputs(self, step, index):
            payload = super().op_inputs(step, index)
            entry = super().op(step, index)
            if step != POISON_STEP or not any(self._is_image_input(entry, j) for j in range(len(entry["inputs"]))):
                return payload
            func, args, kwargs, random_index, tensors = load_call(payload)
            from torch.utils._pytree import tree_flatten, tree_unflatten

            leaves, spec = tree_flatten((args, kwargs))
            k = 0
            for i, x in enumerate(leaves):
                if isinstance(x, torch.Tensor):
                    if self._is_image_input(entry, k):
                        leaves[i] = self._labels(step).clone()
                    k += 1
            args, kwargs = tree_unflatten(leaves, spec)
            return dump_call(func, args, kwargs, random_index)

    v = Challenger(ClaimsTheLabels(str(run)), audit_state, policy=Policy.from_options(task=POISONED)).play()
    assert v["verdict"] == "trainer_wrong", v
    assert v["step"] == POISON_STEP and v["operator"] == "aten.convolution.default", v
    assert "batch(4)" in v["ruling"] and "[0]" in v["ruling"], v


def test_12_disputes_work_after_partial_and_sampled_audits(hidden_poison):
    """#12: an audit of some intervals (--intervals, --sample) can still blame the trainer in a dispute."""
    from veritrain.runner import sample_intervals

    run, d = hidden_poison
    seed = next(s for s in range(100) if sample_intervals(1, s, 3) == [POISON_STEP // 2])
    dirs = []
    for name, extra in (("intervals", ["--intervals", str(POISON_STEP // 2)]),
                        ("sample", ["--sample", "1", "--seed", str(seed)])):
        rc, result, audit_state = audit(run, d / f"audit-{name}", *extra, task=POISONED)
        assert rc == 1 and list(audit_state["leaves"]) == [str(POISON_STEP // 2)], (name, result)
        dirs.append(d / f"audit-{name}")
    # the trainer's prover over HTTP, in its own process with its poisoned pipeline
    proc = subprocess.Popen([sys.executable, "-m", "veritrain.cli", "serve", str(run), "--port", "0"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, **ENV, "VERITRAIN_TEST_POISON_STEP": str(POISON_STEP)})
    try:
        line = proc.stdout.readline()
        assert "serving" in line, proc.stderr.read()
        url = line.strip().rsplit(" ", 1)[-1]
        for audit_dir in dirs[1:]:  # the sampled audit's state (the --intervals one has the same leaves: above)
            p = cli("dispute", url, audit_dir, "--json", "--task", POISONED, env=ENV)
            assert p.returncode == 1, (audit_dir, p.stdout, p.stderr)
            v = json.loads(p.stdout)
            assert v["verdict"] == "trainer_wrong", v
            assert v["interval"] == POISON_STEP // 2 and v["step"] == POISON_STEP, v
            assert v["operator"] == "aten.convolution.default" and "batch(4)" in v["ruling"], v
    finally:
        proc.terminate()
        proc.wait()


# --- #9: another non-tensor argument for one op ----------------------------------------------------------


_LIE = {"on": False}


@contextlib.contextmanager
def doubled_step_size():
    """While on, step LR_STEP's AdamW update (aten._foreach_addcdiv_, one op for every parameter) runs with
    twice the first parameter's step size: the trainer's own code, so its log, checkpoints and prover's
    replays are consistent with it."""
    orig = VerifiedMode.__torch_dispatch__

    def dispatch(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.step == LR_STEP and func is torch.ops.aten._foreach_addcdiv_.ScalarList \
                and not getattr(self, "_lied", False):
            self._lied = True
            args = list(args)
            args[3] = [2 * args[3][0], *args[3][1:]]  # the step sizes, one per parameter
        return orig(self, func, types, args, kwargs)

    VerifiedMode.__torch_dispatch__ = dispatch
    try:
        yield
    finally:
        VerifiedMode.__torch_dispatch__ = orig


class StepSizeProver(LocalProver):
    def state_after(self, step):
        with doubled_step_size():
            return super().state_after(step)

    def _trace(self, step, capture=None):
        with doubled_step_size():
            return super()._trace(step, capture)


@pytest.fixture(scope="module")
def doubled_run(tmp_path_factory):
    """A digits-cnn run whose step LR_STEP took a doubled step size, and its rejecting audit's state."""
    d = tmp_path_factory.mktemp("doubled")
    run = d / "run"
    with doubled_step_size():
        train(TrainOptions(task="digits-cnn", out=str(run), **COMMON))
    rc, result, audit_state = audit(run, d / "audit")
    assert rc == 1 and not result["accepted"]
    return run, audit_state


def test_9_the_referee_uses_its_own_non_tensor_arguments(doubled_run):
    """#9: the trainer changed one of AdamW's step sizes in its update (a `scalars` entry of
    _foreach_addcdiv_); the prover's payload carries
    that value. The referee must recompute with the argument of its own replay, not the prover's."""
    run, audit_state = doubled_run
    v = Challenger(StepSizeProver(str(run)), audit_state).play()
    assert v["verdict"] == "trainer_wrong", v
    assert v["interval"] == LR_STEP // 2 and v["step"] == LR_STEP, v
    assert v["operator"] == "aten._foreach_addcdiv_.ScalarList" and v["module"] == "optimizer", v
    assert v["referee_ops"] == 1, v
    assert any("non-tensor arguments" in r for r in v["reasons"]), v


class ShortInputsProver(StepSizeProver):
    """The same trainer's prover, answering the disputed op with one tensor input fewer than the op takes: its
    trace entry's input digests and its payload alike, so that every tensor it sends has the digest it
    claimed (the running hash does not bind input digests, OpTrace.link)."""

    def _disputed(self, step, index):
        return step == LR_STEP and StepSizeProver.op(self, step, index)["op"] == "aten._foreach_addcdiv_.ScalarList"

    def op(self, step, index):
        entry = super().op(step, index)
        return {**entry, "inputs": entry["inputs"][:-1]} if self._disputed(step, index) else entry

    def op_inputs(self, step, index):
        payload = super().op_inputs(step, index)
        if not self._disputed(step, index):
            return payload
        func, args, kwargs, random_index, _ = load_call(payload)
        args = list(args)
        args[2] = args[2][:-1]  # the last tensor of the call (tensor2's last), as the entry's digests
        return dump_call(func, tuple(args), kwargs, random_index)


def test_9_a_prover_sending_fewer_tensor_inputs_than_the_op_takes_loses(doubled_run):
    """The referee recomputes the op with this side's own call: a prover whose inputs are fewer than that
    call's tensors (each with the digest it claimed) must lose, not crash the referee or be recomputed on a
    shortened list."""
    run, audit_state = doubled_run
    v = Challenger(ShortInputsProver(str(run)), audit_state).play()
    assert v["verdict"] == "trainer_wrong", v
    assert v["step"] == LR_STEP and v["operator"] == "aten._foreach_addcdiv_.ScalarList", v
    assert v["referee_ops"] == 0, v  # ruled before anything is recomputed
    assert "tensor inputs for aten._foreach_addcdiv_.ScalarList, which takes" in v["ruling"], v


class HostileAnswers(StepSizeProver):
    """The same trainer's prover, answering one kind of query out of its type or range: a negative op count
    (with the ops it then names answered from the end of its trace, as Python's negative indices read), a
    boolean count, Merkle nodes as hex strings, no leaf, no inputs (None), a manifest that is a list. HttpProver
    refuses such answers itself; the challenger must too, for a Prover of any other transport."""

    def __init__(self, run_dir, lie):
        super().__init__(run_dir)
        self.lie = lie

    def op_count(self, step):
        if step == LR_STEP and self.lie == "negative count":
            return -3
        if step == LR_STEP and self.lie == "boolean count":
            return True
        return super().op_count(step)

    def op(self, step, index):
        if step == LR_STEP and index < 1:
            return self._trace(step).entries[index - 1]
        return super().op(step, index)

    def node(self, lo, hi):
        h = super().node(lo, hi)
        return h.hex() if self.lie == "hex nodes" else h

    def leaf(self, index):
        return None if self.lie == "no leaf" else super().leaf(index)

    def op_inputs(self, step, index):
        return None if self.lie == "no inputs" else super().op_inputs(step, index)

    def manifest(self):
        m = super().manifest()
        return list(m) if self.lie == "manifest as a list" else {**m, "root": "zz"} if self.lie == "root" else m

    def state_after(self, step):
        h = super().state_after(step)
        return h.encode() if self.lie == "state as bytes" else "zz" * 32 if self.lie == "state not a digest" else h


class UnhashableEntry(ShortInputsProver):
    """The same trainer's prover, answering the disputed op with an entry that cannot be hashed (a random-op index
    that is NaN) and the running hash "" that OpTrace.link gives such an entry: an answer that binds nothing."""

    def op(self, step, index):
        entry = StepSizeProver.op(self, step, index)
        return {**entry, "random_index": math.nan, "chain": ""} if self._disputed(step, index) else entry


@pytest.mark.parametrize("lie, reason", [("negative count", "is not a count of operators"),
                                         ("boolean count", "is not a count of operators"),
                                         ("hex nodes", "is not bytes but str"),
                                         ("no inputs", "is not bytes but NoneType"),
                                         ("manifest as a list", "manifest is not a JSON object but list"),
                                         ("state as bytes", "is not str but bytes"),
                                         ("state not a digest", "is not a SHA-256 hex digest")])
def test_answers_out_of_their_type_or_range_lose(doubled_run, lie, reason):
    """A negative op count had the challenger read its own trace from the end and stop with "the referee
    cannot rule" (no verdict); hex nodes, no inputs for the disputed op and a manifest that is not an object
    stopped it with a TypeError or AttributeError. Each must be the prover's loss."""
    run, audit_state = doubled_run
    v = play(HostileAnswers(str(run), lie), audit_state, None, Policy())
    assert v["verdict"] == "trainer_wrong", v
    assert any(reason in r for r in v["reasons"]) or reason in v.get("ruling", ""), v


def test_an_entry_that_binds_nothing_loses_before_the_referee_recomputes(doubled_run):
    """OpTrace.link gives "" for an entry it cannot hash; a prover answering that as its running hash passed the
    check that the entry hashes into it, and only the referee's own recompute caught the lie."""
    run, audit_state = doubled_run
    v = Challenger(UnhashableEntry(str(run)), audit_state).play()
    assert v["verdict"] == "trainer_wrong" and v["referee_ops"] == 0, v
    assert "does not hash to the running hash it answered with" in v["ruling"], v


def test_a_zero_step_run_whose_leaf_commits_to_another_state_loses(tmp_path):
    """A 0-step run whose one leaf commits to a state other than its initial state (the trainer's checkpoint
    entry, recommitted): the audit rejected it, but the game ruled `auditor_wrong`, "interval 0 has no steps:
    its leaf commits to the agreed initial state", without comparing the two. An auditor whose own leaf is
    wrong, for the honest run, still loses."""
    import hashlib

    run = tmp_path / "run"
    train(TrainOptions(task="digits-cnn", out=str(run), steps=0, checkpoint_every=1, progress=False))
    _, honest_state = audit(run, tmp_path / "honest")[1:]
    wrong_leaf = {**honest_state, "leaves": {"0": "00" * 32}}
    v = Challenger(LocalProver(str(run)), wrong_leaf).play()
    assert v["verdict"] == "auditor_wrong", v
    m = store.load_manifest(str(run))
    m["checkpoints"][0]["state_sha256"] = hashlib.sha256(b"a model the trainer wants certified").hexdigest()
    store.save_manifest(str(run), m)
    recommit(run)
    rc, result, audit_state = audit(run, tmp_path / "audit")
    assert rc == 1 and any("checkpoint after step 0" in r for r in result["reasons"]), result["reasons"]
    v = Challenger(LocalProver(str(run)), audit_state).play()
    assert v["verdict"] == "trainer_wrong", v
    assert any("has no steps, yet its leaf commits to the state" in r for r in v["reasons"]), v


def test_a_manifest_root_that_is_not_hex_loses_where_the_auditor_gives_none(doubled_run):
    """The root comes from the auditor (--root, its audit's) where it has one; from the prover's manifest only
    where it has none, and then a root that is not hex is the prover's loss, not a ValueError."""
    run, audit_state = doubled_run
    v = play(HostileAnswers(str(run), "root"), {k: x for k, x in audit_state.items() if k != "root"}, None, Policy())
    assert v["verdict"] == "trainer_wrong", v
    assert any("names a root that is not a hex hash" in r for r in v["reasons"]), v


def test_an_answer_that_is_not_a_leaf_loses(doubled_run, tmp_path):
    """An audit of some intervals asks the prover for their leaves with inclusion proofs: an answer that is not
    a pair (here None) stopped the challenger with a TypeError."""
    run, _ = doubled_run
    rc, _, audit_state = audit(run, tmp_path / "audit", "--intervals", str(LR_STEP // 2))
    assert rc == 1
    v = Challenger(HostileAnswers(str(run), "no leaf"), audit_state).play()
    assert v["verdict"] == "trainer_wrong", v
    assert any("is not a leaf and its inclusion proof" in r for r in v["reasons"]), v


# --- every refusal of the challenger, one lie each ----------------------------------------------------------


def _sha(data: bytes) -> str:
    import hashlib

    return hashlib.sha256(data).hexdigest()


def _another_state(data: bytes) -> bytes:
    """A checkpoint of the same step and task, one weight moved, its header's state hash recomputed: a file that
    loads and names the right step, but holds another state than the one the run commits to."""
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "ckpt.safetensors")
        with open(path, "wb") as f:
            f.write(data)

        def edit(tensors, meta):
            name = next(k for k in sorted(tensors) if k.startswith("model/") and tensors[k].is_floating_point())
            tensors[name] = tensors[name].clone()
            tensors[name].view(-1)[0] += 1.0
        rewrite_checkpoint(path, edit)
        with open(path, "rb") as f:
            return f.read()


class CommittedLies(StepSizeProver):
    """The doubled run's prover, with one lie: an answer that is not what the trainer committed to (a data
    record, a checkpoint, the initialisation log, the manifest), an answer out of its shape, or a run whose
    commitments themselves are malformed (a leaf, a record a leaf commits to). For the last, the prover serves
    the tree of the edited leaves and `root` is its root: the root an audit of such a run holds."""

    def __init__(self, run_dir, lie):
        super().__init__(run_dir)
        self.lie = lie
        leaf = store.parse_leaf(self._leaves[1])
        run_sha, state, records = bytes.fromhex(leaf["run_sha256"]), leaf["state_sha256"], leaf["records"]
        edited = {"a malformed leaf": (1, b"not a leaf"),
                  "a malformed leaf before the disputed one": (0, b"not a leaf"),
                  "a leaf of another run": (1, store.leaf_data(1, 2, 4, bytes(32), state, records)),
                  "a leaf of other steps": (1, store.leaf_data(1, 4, 6, run_sha, state, records)),
                  "a committed record that is not an object": (
                      1, store.leaf_data(1, 2, 4, run_sha, state, [_sha(b"[]"), records[1]]))}.get(lie)
        if lie == "a committed rounding log that is malformed":  # its record, and the leaf, name the bad log
            rec = json.loads(self._read(store.record_name(2)))
            self.bad_record = store.record_bytes(2, rec["batch_sha256"], rec["batch_indices"], rec["loss"],
                                                 _sha(b"not a log"))
            edited = (1, store.leaf_data(1, 2, 4, run_sha, state, [_sha(self.bad_record), records[1]]))
        if edited is not None:
            self._leaves[edited[0]] = edited[1]
            self._tree = store.tree_of(self._leaves)
        self.root = self._tree.root().hex()
        if lie == "a malformed initialisation log":
            self._manifest = {**self._manifest, "init_log_sha256": _sha(b"not a log")}
        self._manifest = {**self._manifest, "root": self.root}

    def manifest(self):
        m = super().manifest()
        if self.lie == "a manifest of another root":
            return {**m, "root": "00" * 32}
        return {**m, "seed": m["seed"] + 1} if self.lie == "a manifest of another run" else m

    def node(self, lo, hi):
        return super().node(lo, hi)[:31] if self.lie == "short nodes" else super().node(lo, hi)

    def record(self, step):
        if self.lie == "a refused query":
            raise ProverError("no such record")
        if self.lie == "a record that is not the committed one" and step == 2:
            return super().record(step) + b" "
        if self.lie == "a committed record that is not an object" and step == 2:
            return b"[]"
        if self.lie == "a committed rounding log that is malformed" and step == 2:
            return self.bad_record
        return super().record(step)

    def log(self, step, micro=None):
        if self.lie == "a committed rounding log that is malformed" and step == 2:
            return b"not a log"
        return super().log(step, micro)

    def checkpoint(self, step):
        if self.lie == "a checkpoint that does not load":
            return b"not a checkpoint"
        if self.lie == "another step's checkpoint":
            return super().checkpoint(step + 2)
        if self.lie == "another state at the checkpoint's step":
            return _another_state(super().checkpoint(step))
        return super().checkpoint(step)

    def init_log(self):
        if self.lie == "a malformed initialisation log":
            return b"not a log"
        return super().init_log() + (b"\0" if self.lie == "another initialisation log" else b"")


CHALLENGER_REFUSALS = [  # (the lie, the reason the prover loses with)
    ("a manifest of another root", "the prover's manifest commits to root 0000000000000000…, not the audited root"),
    ("a manifest of another run", "the prover's manifest describes another run than the one audited"),
    ("a refused query", "the prover failed to answer record 2: no such record"),
    ("short nodes", "are not 32-byte hashes"),
    ("a malformed leaf", "the trainer committed a malformed leaf 1 (malformed leaf data)"),
    ("a malformed leaf before the disputed one", "the trainer committed a malformed leaf 0 (malformed leaf data)"),
    ("a leaf of another run", "leaf 1 commits to another run description than the prover's manifest"),
    ("a leaf of other steps", "leaf 1 covers steps [4, 6), the committed run's interval 1 is steps [2, 4)"),
    ("a record that is not the committed one", "the prover's data record for step 2 does not match leaf 1"),
    ("a committed record that is not an object", "the trainer committed a malformed data record for step 2"),
    ("a checkpoint that does not load", "interval 1: the trainer's committed files do not replay (checkpoint after "
                                        "step 2:"),
    ("another step's checkpoint", "interval 1: the trainer's committed files do not replay (the checkpoint for "
                                  "step 2 holds step 4)"),
    ("another state at the checkpoint's step", "interval 1: the trainer's committed files do not replay (the "
                                               "checkpoint after step 2 hashes to "),
    ("a committed rounding log that is malformed", "interval 1: the trainer's committed files do not replay (step 2: "
                                                   "<bytes>: not a veritrain rounding log"),
    ("another initialisation log", "the prover's initialisation log is not the one its manifest commits to"),
    ("a malformed initialisation log", "the trainer's initialisation log is malformed"),
]


@pytest.mark.parametrize("lie, reason", CHALLENGER_REFUSALS, ids=[r[0] for r in CHALLENGER_REFUSALS])
def test_each_refusal_of_the_challenger_rules_against_the_trainer(doubled_run, lie, reason):
    """Every check the challenger makes of what the prover sends or the trainer committed, one lie at a time
    (each case fails with its check dropped). Where the lie is in the commitments, the audit holds their root,
    as an audit of such a run would; a dispute of the initial state is the audit's finding where the lie is in
    the initialisation log. A partial audit of interval 1 alone reaches leaf 0 only as the disputed interval's
    start."""
    run, audit_state = doubled_run
    prover = CommittedLies(str(run), lie)
    own = {**audit_state, "root": prover.root, "run_sha256": store.run_sha256(prover._manifest).hex()}
    if "initialisation log" in lie:
        own["initial_state_reasons"] = ["the audit's build of the task does not give the run's initial state"]
    if lie == "a malformed leaf before the disputed one":
        own["leaves"] = {"1": audit_state["leaves"]["1"]}
        own["intervals"] = [r for r in audit_state["intervals"] if r.get("interval") == 1]
    v = play(prover, own, None, Policy())
    assert v["verdict"] == "trainer_wrong", v
    assert any(reason in r for r in v["reasons"]), v


def test_a_run_whose_only_lie_is_a_malformed_initialisation_log_loses_at_its_initial_state(tmp_path):
    """An honest run but for its committed initialisation log: bytes that are not a log, recommitted (manifest,
    leaves, root). The audit refuses such a run before replaying anything; an auditor that disputes its initial
    state must win. The referee's check of the log is then the whole defence: built without the log, the task
    gives the committed initial state and every interval replays, and the referee would rule against the
    auditor."""
    from veritrain.merkle import leaf_hash

    run = tmp_path / "run"
    train(TrainOptions(task="digits-cnn", out=str(run), steps=2, checkpoint_every=2, progress=False))
    rc, _, audit_state = audit(run, tmp_path / "audit")
    assert rc == 0
    (run / store.INIT_LOG).write_bytes(b"not a log")
    root = recommit(run)
    p = cli("audit", run, "--root", root, "--quiet", check=1)
    assert "not a veritrain rounding log" in p.stderr, p.stderr
    m = store.load_manifest(str(run))
    own = {**audit_state, "root": root, "run_sha256": store.run_sha256(m).hex(),
           "leaves": {str(i): leaf_hash(bytes.fromhex(x)).hex() for i, x in enumerate(m["leaves"])},
           "initial_state_reasons": ["the audit's build of the task does not give the run's initial state"]}
    v = play(LocalProver(str(run)), own, None, Policy())
    assert v["verdict"] == "trainer_wrong", v
    assert any("the trainer's initialisation log is malformed" in r for r in v["reasons"]), v


class MalformedInputs(StepSizeProver):
    """The doubled run's prover, answering the disputed op's tensor inputs with a payload that is not one: bytes
    that are not safetensors, call metadata that is not a list, or a tensor the metadata does not name."""

    def __init__(self, run_dir, lie):
        super().__init__(run_dir)
        self.lie = lie

    def op_inputs(self, step, index):
        from safetensors.torch import load, save

        data = super().op_inputs(step, index)
        if self.lie == "not a payload":
            return b"not a payload"
        tensors = load(data)
        meta = json.loads(data[8:8 + int.from_bytes(data[:8], "little")])["__metadata__"]
        if self.lie == "metadata that is not a list":
            meta["leaves"] = json.dumps({"tensor": "t0"})
        else:
            tensors["unnamed"] = torch.zeros(1)
        return save(tensors, metadata=meta)


@pytest.mark.parametrize("lie, reason", [
    ("not a payload", "the prover's inputs for op "),
    ("metadata that is not a list", "malformed call metadata"),
    ("a tensor the metadata does not name", "the call's tensors and its metadata disagree"),
])
def test_a_payload_of_inputs_out_of_its_shape_loses(doubled_run, lie, reason):
    """The disputed op's inputs are the prover's: a payload the referee cannot read as that op's call is the
    prover's loss, with a reason naming what is wrong with it."""
    run, audit_state = doubled_run
    v = Challenger(MalformedInputs(str(run), lie), audit_state).play()
    assert v["verdict"] == "trainer_wrong", v
    assert "the prover's inputs for op " in v["ruling"] and "are malformed" in v["ruling"], v
    assert reason in v["ruling"], v


def test_a_run_outside_this_sides_policy_or_its_interval_cap_loses(doubled_run, monkeypatch):
    """The game replays with this side's policy: a run it does not admit (another seed than the policy pins), or
    with more intervals than the challenger bisects over, is the prover's loss before anything is replayed."""
    from veritrain import protocol

    run, audit_state = doubled_run
    v = play(LocalProver(str(run)), audit_state, None, Policy(seed=1))
    assert v["verdict"] == "trainer_wrong" and "field 'seed' is 0, the policy requires 1" in v["reasons"][0], v
    monkeypatch.setattr(protocol, "MAX_INTERVALS", 2)
    v = play(LocalProver(str(run)), audit_state, None, Policy())
    assert v["verdict"] == "trainer_wrong", v
    assert "the committed run has 3 intervals (6 steps, a checkpoint every 2): refused (at most 2)" in v["reasons"][0]


@pytest.mark.parametrize("edit, error", [
    ({"run_sha256": None}, "the audit does not record which run it audited"),
    ({"leaves": {"0": "zz"}}, "the audit's leaves are malformed"),
    ({"leaves": {"3": "00" * 32}}, "the audit has leaves for intervals outside the committed run's 0..2"),
    ({"root": "zz"}, "non-hexadecimal"),
], ids=["no run hash", "leaves not hex", "a leaf outside the run", "a root not hex"])
def test_a_malformed_audit_is_the_auditors_own_error_not_a_verdict(doubled_run, edit, error):
    """What the challenger takes from its own side (the audit's run hash, leaves, root) is not the prover's to
    lose on: a malformed audit stops the game with an error naming it, and no verdict either way."""
    run, audit_state = doubled_run
    with pytest.raises(ValueError, match=error):
        play(StepSizeProver(str(run)), {**audit_state, **edit}, None, Policy())


def test_a_replay_runs_only_from_the_state_it_holds(doubled_run):
    """Internal invariants of the replays both sides run: a replayer runs the step after the state it holds, and
    the challenger loads no checkpoint but the disputed interval's first (the one its commitments check)."""
    from veritrain.policy import trusted
    from veritrain.protocol import Replayer

    run, audit_state = doubled_run
    p = LocalProver(str(run))
    rep = Replayer(trusted(p.manifest()), p.checkpoint, p.log)
    rep.load(2)
    with pytest.raises(RuntimeError, match="replayer holds the state after 2 steps, not 3"):
        rep.run_step(3)
    rep.run_step(2)
    assert rep.at == 3
    get = Challenger(p, audit_state)._checked_checkpoint(None, 2)
    with pytest.raises(RuntimeError, match="the challenger only loads the interval's agreed checkpoint"):
        get(4)
    assert get(2) == p.checkpoint(2)


def test_the_provers_own_refusals_name_what_it_does_not_have(doubled_run):
    """An honest prover asked for what the run does not have (a file, a micro-batch of a run without any, an
    operator outside a step) says so with a ProverError, which the challenger rules as a failure to answer."""
    run, _ = doubled_run
    p = StepSizeProver(str(run))
    for ask, words in [(lambda: p.checkpoint(5), "the run has no readable checkpoints/step_00000005.safetensors"),
                       (lambda: p.log(2, 1), "the run has no micro-batch 1"),
                       (lambda: p.op(2, 0), "step 2 has no operator #0"),
                       (lambda: p.op(2, p.op_count(2) + 1), "has no operator #"),
                       (lambda: p.op_inputs(2, 10**6), "step 2 has no operator #1000000")]:
        with pytest.raises(ProverError, match=words):
            ask()


# --- #11: a rounding steered far from any midpoint ----------------------------------------------------------


def test_11_a_suspicious_entry_is_disputed_and_ruled_against_the_trainer(tmp_path):
    """#11: every hash matches, the audit rejects only for one suspicious log entry; the game must not end
    in no_dispute: the referee recomputes that op with the trainer's log record and confirms it."""
    from veritrain.engine import TrainerHalf, _EagerSlot, _PartSlot

    grid = Grid(32)
    orig = TrainerHalf.record
    steered = {}

    def record(self, slot, c):
        e = orig(self, slot, c)
        # AdamW's update of a parameter: a part of the foreach op's small tensors laid end to end (or, computed
        # tensor by tensor, its own output)
        whole = slot.whole if isinstance(slot, _PartSlot) else slot
        if self.mode.step == STEER_STEP and not steered and isinstance(whole, _EagerSlot) \
                and math.prod(slot.shape) >= 64 \
                and str(whole.analysis.call.func) in ("aten.addcdiv.default", "aten._foreach_addcdiv.ScalarList"):
            p = flip_far_rounding(e, slot, slot.values_at(torch.arange(math.prod(slot.shape))), grid)
            if p is not None:
                steered.update(op=str(whole.analysis.call.func), position=p, op_index=self.mode.op_index)
        return e

    run = tmp_path / "steered"
    TrainerHalf.record = record
    try:
        train(TrainOptions(task="digits-cnn", out=str(run), **COMMON))
    finally:
        TrainerHalf.record = orig
    assert steered, "found nothing to steer"
    rc, result, _ = audit(run, tmp_path / "audit")
    assert rc == 1 and result["suspicious"] == 1, result
    assert all(c["match"] for c in result["checkpoints"]), "the dishonest trainer's commitments are self-consistent"
    p = cli("dispute", run, tmp_path / "audit", "--json")
    v = json.loads(p.stdout)
    assert p.returncode == 1 and v["verdict"] == "trainer_wrong", (v, p.stderr)
    assert v["step"] == STEER_STEP and v["operator"] == "aten._foreach_addcdiv_.ScalarList", v
    assert v["operator_index"] == steered["op_index"] and v["referee_ops"] == 1, v
    assert "suspicious" in v["ruling"] and str(steered["position"]) in v["ruling"], v


# --- #14: provers that never finish ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def digits_run(tmp_path_factory):
    d = tmp_path_factory.mktemp("digits")
    run = d / "run"
    train(TrainOptions(task="digits-cnn", out=str(run), **COMMON))
    rc, result, _ = audit(run, d / "audit")
    assert rc == 0, result
    return run, d / "audit"


def dispute_process(url, audit_dir, *extra, timeout=60):
    """``veritrain dispute`` in a child limited to 3 GiB of address space (an attack must not exhaust the
    machine running the tests); returns (CompletedProcess, seconds)."""
    import shlex

    e = {k: v for k, v in os.environ.items() if k != "VERITRAIN_VARIANT_APPLIED"}
    cmd = [sys.executable, "-m", "veritrain.cli", "dispute", url, str(audit_dir), "--json", *extra]
    t0 = time.monotonic()
    p = subprocess.run(["/bin/sh", "-c", f"ulimit -v {3 << 20}; exec {shlex.join(cmd)}"], capture_output=True,
                       text=True, env=e, timeout=timeout)
    return p, time.monotonic() - t0


def test_14_a_prover_announcing_1e10_steps_is_refused(digits_run):
    """#14: the manifest's steps_completed (no commitment covers it) announces 10**10 steps: the challenger
    takes the number of intervals from the committed steps its policy admitted, and the prover loses."""
    run, audit_dir = digits_run

    class Announces(LocalProver):
        def manifest(self):
            return {**super().manifest(), "steps_completed": 10**10}

    server = make_server(Announces(str(run)), "127.0.0.1", 0)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        p, _ = dispute_process(f"http://127.0.0.1:{server.server_address[1]}", audit_dir)
    finally:
        server.shutdown()
        server.server_close()
    assert p.returncode == 1 and p.stdout.strip(), p.stderr[-2000:]
    v = json.loads(p.stdout)
    assert v["verdict"] == "trainer_wrong" and "10000000000" in " ".join(v["reasons"]), v


class Trickler:
    """An HTTP server that answers every request by trickling one byte every ``every`` seconds (the body,
    or the status line and headers themselves)."""

    def __init__(self, where="body", every=2.0):
        self.where, self.every = where, every
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.sock.settimeout(0.5)
        self.stop = threading.Event()
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self):
        while not self.stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except OSError:
                continue
            threading.Thread(target=self._answer, args=(conn,), daemon=True).start()

    def _answer(self, conn):
        head = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 100000\r\n\r\n"
        try:
            conn.recv(65536)
            if self.where == "body":
                conn.sendall(head)
            for b in (head if self.where == "headers" else b" " * 100000):
                if self.stop.wait(self.every):
                    break
                conn.sendall(bytes([b]) if isinstance(b, int) else b)
        except OSError:
            pass
        finally:
            conn.close()

    def close(self):
        self.stop.set()
        self.sock.close()


@pytest.mark.parametrize("where", ["body", "headers"])
def test_14_a_trickling_prover_loses_on_the_whole_answer_deadline(digits_run, where):
    """#14: one byte every 2 s never trips a per-read socket timeout; --timeout 5 is the whole answer's."""
    _, audit_dir = digits_run
    server = Trickler(where)
    try:
        p, seconds = dispute_process(server.url, audit_dir, "--timeout", "5", timeout=45)
    finally:
        server.close()
    assert p.returncode == 1 and p.stdout.strip(), p.stderr[-2000:]
    v = json.loads(p.stdout)
    assert v["verdict"] == "trainer_wrong" and "timed out" in v["reasons"][0], v
    assert seconds < 30, seconds


class RawAnswer(Trickler):
    """An HTTP server that answers every request with the same bytes, then streams ``tail`` until stopped."""

    def __init__(self, head: bytes, tail: bytes = b""):
        self.head, self.tail = head, tail
        super().__init__()

    def _answer(self, conn):
        try:
            conn.recv(65536)
            conn.sendall(self.head)
            while self.tail and not self.stop.is_set():
                conn.sendall(self.tail)
        except OSError:
            pass
        finally:
            conn.close()


@pytest.mark.parametrize("status", ["200 OK", "500 Internal Server Error"])
def test_a_chunk_of_negative_size_is_refused_unread(digits_run, status):
    """http.client reads a chunk whose size line is -1 to the end of the stream, past the route's cap (and, on an
    error status, past the 64 KiB read of its message): a prover streaming after it filled the challenger's
    memory until the deadline (about 1.5 GB/s here), which ended in a MemoryError and no verdict."""
    _, audit_dir = digits_run
    server = RawAnswer(f"HTTP/1.1 {status}\r\nTransfer-Encoding: chunked\r\n\r\n-1\r\n".encode(), b"x" * (1 << 20))
    try:
        p, seconds = dispute_process(server.url, audit_dir, "--timeout", "20", timeout=60)
    finally:
        server.close()
    assert p.returncode == 1 and p.stdout.strip(), p.stderr[-2000:]
    v = json.loads(p.stdout)
    assert v["verdict"] == "trainer_wrong" and "Transfer-Encoding" in v["reasons"][0], v
    assert seconds < 15, seconds


@pytest.mark.parametrize("timeout", ["nan", "inf", "0", "-1"])
def test_a_bad_timeout_is_the_auditors_own_error(digits_run, timeout):
    """--timeout is the auditor's setting: a value that is no deadline was played as a game that the prover lost
    ("the prover did not send its manifest"), against an honest trainer too."""
    _, audit_dir = digits_run
    p = cli("dispute", "http://127.0.0.1:9", audit_dir, "--timeout", timeout)
    assert p.returncode == 2 and "timeout must be a positive number of seconds" in p.stderr, (p.stdout, p.stderr)


def test_a_provers_text_cannot_forge_lines_of_the_verdict(digits_run):
    """The prover's refusal message reaches the reasons the command line prints: newlines and ANSI escapes in it
    erased the real verdict on a terminal and printed "verdict: auditor_wrong" in its place."""
    _, audit_dir = digits_run
    forged = "no\n\x1b[2K\x1b[1Averdict: auditor_wrong"
    body = json.dumps({"error": forged}).encode()
    server = RawAnswer(b"HTTP/1.1 404 Not Found\r\nContent-Length: %d\r\n\r\n" % len(body) + body)
    try:
        p = cli("dispute", server.url, audit_dir, "--timeout", "10")
    finally:
        server.close()
    assert p.returncode == 1 and p.stdout.startswith("verdict: trainer_wrong"), (p.stdout, p.stderr)
    assert "\x1b" not in p.stdout and not any(line.startswith("verdict: auditor") for line in p.stdout.splitlines())
    assert "\\x1b[2K" in p.stdout, p.stdout  # shown, escaped


def test_every_http_answer_has_a_size_cap():
    """Beside #14: an answer announcing or streaming more than its route's cap is refused, unread."""
    class Huge(Trickler):
        def _answer(self, conn):
            try:
                conn.recv(65536)
                if self.where == "announce":
                    conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 1000000000000\r\n\r\n{")
                else:  # no length: streams until the reader stops
                    conn.sendall(b"HTTP/1.1 200 OK\r\nConnection: close\r\n\r\n")
                    chunk = b" " * (1 << 20)
                    while not self.stop.is_set():
                        conn.sendall(chunk)
            except OSError:
                pass
            finally:
                conn.close()

    for where in ("announce", "stream"):
        server = Huge(where)
        try:
            t0 = time.monotonic()
            with pytest.raises(ProverError, match="larger than"):
                HttpProver(server.url, timeout=20).op_count(0)
            assert time.monotonic() - t0 < 10
        finally:
            server.close()

    class Objects(Trickler):  # a leaf's answer of 2 MiB of small JSON objects, at once
        def _answer(self, conn):
            body = b'{"data": "00", "proof": [' + b"{}," * ((2 << 20) // 3) + b"{}]}"
            try:
                conn.recv(65536)
                conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % len(body) + body)
            except OSError:
                pass
            finally:
                conn.close()

    # a leaf's answer is one object with two strings and a list of at most MAX_PROOF hashes: 64 MiB of small JSON
    # objects in it parsed into ~1.5 GiB of Python objects before the proof's length was checked
    server = Objects()
    try:
        with pytest.raises(ProverError, match="more JSON items than an answer of its kind"):
            HttpProver(server.url, timeout=20).leaf(0)
    finally:
        server.close()


class Canned(Trickler):
    """An HTTP server that answers every request with ``body`` (status 200, its Content-Length)."""

    def __init__(self, body: bytes):
        self.body = body
        super().__init__()

    def _answer(self, conn):
        try:
            conn.recv(65536)
            conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % len(self.body) + self.body)
        except OSError:
            pass
        finally:
            conn.close()


def _answers():
    from veritrain.server import MAX_PROOF

    h = '"' + "00" * 32 + '"'
    return [  # (id, the query, the prover's answer, what the refusal says)
        ("a manifest that is a list", ("manifest",), b"[1]", "the manifest is not a JSON object"),
        ("a node that is not JSON", ("node", 0, 1), b"{not json", "/node: the answer is not JSON"),
        ("a node that is a list", ("node", 0, 1), b"[]", "/node: the answer is not a JSON object"),
        ("a node that is not hex", ("node", 0, 1), b'{"hash": "zz"}', "an answer holds a malformed hash"),
        ("a node of 1 byte", ("node", 0, 1), b'{"hash": "00"}', "an answer holds a hash that is not 32 bytes"),
        ("a state of 1 byte", ("state_after", 0), b'{"state_sha256": "00"}', "a hash that is not 32 bytes"),
        ("a leaf that is not hex", ("leaf", 0), b'{"data": "zz", "proof": []}', "/leaf: malformed answer"),
        ("a leaf with no proof", ("leaf", 0), b'{"data": "00"}', "/leaf: malformed answer"),
        ("a proof one hash too long", ("leaf", 0), ('{"data": "00", "proof": [%s]}' % ",".join(
            [h] * (MAX_PROOF + 1))).encode(), "/leaf: malformed answer"),
        ("a negative op count", ("op_count", 0), b'{"count": -1}', "/op_count: malformed answer"),
        ("an op count that is true", ("op_count", 0), b'{"count": true}', "/op_count: malformed answer"),
        ("an op count that is a list", ("op_count", 0), b"[3]", "/op_count: malformed answer"),
        ("an op with a number for an input", ("op", 0, 1), b'{"chain": "x", "inputs": [1], "outputs": []}',
         "/op: malformed answer"),
        ("an op with no chain", ("op", 0, 1), b'{"inputs": [], "outputs": []}', "/op: malformed answer"),
    ]


@pytest.mark.parametrize("query, body, words", [a[1:] for a in _answers()], ids=[a[0] for a in _answers()])
def test_http_answers_out_of_their_shape_are_refused(query, body, words):
    """HttpProver checks each answer's shape as it parses it (the challenger checks types again, for provers of
    any transport): an answer out of shape is a ProverError naming it, which the challenger rules the prover's
    failure to answer. Each case fails with its check dropped."""
    server = Canned(body)
    try:
        with pytest.raises(ProverError, match=re.escape(words)):
            getattr(HttpProver(server.url, timeout=20), query[0])(*query[1:])
    finally:
        server.close()


def test_a_prover_url_that_is_not_http_is_refused():
    for url in ("ftp://127.0.0.1:80", "http://", "127.0.0.1:80"):
        with pytest.raises(ProverError, match="expected http://HOST:PORT"):
            HttpProver(url)
