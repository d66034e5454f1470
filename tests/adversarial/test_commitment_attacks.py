"""The dishonest trainer against what a run commits to and how it is stored: checkpoints that are not the
committed states, a leaf count that is not the run's, tensors the auditor would read before refusing them.

Each test builds a self-consistent forgery (every hash the trainer writes recomputed) from one small honest
run and checks that `verify` / `audit` reject it, naming the problem, or that a checkpoint's header is
checked before its tensors are read."""

import json
import shutil
import subprocess
import sys
import textwrap

import pytest
import torch

from conftest import cli, recommit
from veritrain import store
from veritrain.api import verify
from veritrain.commitments import canonical_json, state_hash
from veritrain.store import ckpt_name

STEPS = 4


@pytest.fixture(scope="module")
def honest(tmp_path_factory):
    """One small committed run (4 steps, a checkpoint after each), trained once for the module."""
    run = tmp_path_factory.mktemp("commitments") / "run"
    cli("train", "digits-cnn", "--out", run, "--steps", STEPS, "--checkpoint-every", 1, "--quiet", check=0)
    return run


@pytest.fixture()
def run(honest, tmp_path):
    copy = tmp_path / "run"
    shutil.copytree(honest, copy)
    return copy


def _root(leaves_hex) -> str:
    return store.tree_of([bytes.fromhex(x) for x in leaves_hex]).root().hex()


def _problems(r, name="manifest.json"):
    return [p["problem"] for p in r.problems if p["file"] == name]


# --- a "complete" run whose leaves commit to fewer steps than its schedule -----------------------


def test_verify_refuses_a_complete_run_that_commits_to_fewer_steps_than_it_has(run):
    """The trainer trains 2 of the agreed 4 steps, marks the run complete with steps_completed = 2 and hands
    the client the root of those 2 leaves. `verify --root` said "consistent" (exit 0): it took the number of
    intervals from steps_completed, not from the committed schedule; the audit refuses it ("2 leaves for 4
    intervals")."""
    m = store.load_manifest(str(run))
    m["leaves"], m["steps_completed"] = m["leaves"][:2], 2
    m["root"] = _root(m["leaves"])
    store.save_manifest(str(run), m)
    r = verify(str(run), root=m["root"])
    assert not r.ok, r.problems
    assert any("2 of its 4 steps" in p for p in _problems(r)), r.problems
    p = cli("verify", run, "--root", m["root"])
    assert p.returncode == 1 and "2 of its 4 steps" in p.stdout, p.stdout


# --- the initial checkpoint is not the committed initial state ------------------------------------


def test_verify_refuses_an_initial_checkpoint_that_is_not_the_committed_initial_state(run):
    """checkpoints/step_00000000 holds another state (the trainer's weights after 2 steps, its header's step
    edited to 0, its manifest entry updated): verify checked the file against its manifest entry only, never
    the entry against the committed initial_state_sha256, and said "consistent" (the audit rejects it)."""
    from safetensors.torch import load_file, save_file

    from veritrain.checkpoint import read_checkpoint

    path = str(run / ckpt_name(0))
    _, meta, _, _ = read_checkpoint(str(run / ckpt_name(2)))
    tensors = dict(load_file(str(run / ckpt_name(2))))
    digest = state_hash(tensors, meta, 0)
    save_file(tensors, path, metadata={"veritrain": canonical_json({"step": 0, "meta": meta,
                                                                   "state_sha256": digest}).decode()})
    m = store.load_manifest(str(run))
    m["checkpoints"][0]["state_sha256"], m["checkpoints"][0]["file_sha256"] = digest, store.file_sha256(path)
    store.save_manifest(str(run), m)
    r = verify(str(run), root=m["root"])
    assert not r.ok, r.problems
    assert any("initial_state_sha256" in p for p in _problems(r, ckpt_name(0))), r.problems


# --- the delivered weights are not the committed final state ----------------------------------------


def _swap_checkpoint(run, step, other):
    """The checkpoint after ``step`` replaced by the one after ``other`` (a state the trainer has), its manifest
    entry updated to it; the leaves and root are untouched (they commit to the trained states)."""
    shutil.copyfile(run / ckpt_name(other), run / ckpt_name(step))
    m = store.load_manifest(str(run))
    src = next(c for c in m["checkpoints"] if c["step"] == other)
    for c in m["checkpoints"]:
        if c["step"] == step:
            c["state_sha256"], c["file_sha256"] = src["state_sha256"], src["file_sha256"]
    store.save_manifest(str(run), m)


@pytest.mark.parametrize("intervals", [None, "1"], ids=["whole audit", "--intervals 1"])
def test_audit_rejects_a_final_checkpoint_that_is_not_the_committed_final_state(run, intervals):
    """The run's last checkpoint, the model the client takes, replaced by the initial weights (its manifest
    entry updated to them; the leaves still commit to the trained state): the audit replayed every interval
    from its start checkpoint, compared the replay with the leaves and never opened the last checkpoint, so
    it said ACCEPT for a run whose delivered weights are untrained. Every audit, whole or partial, now checks
    that the last checkpoint holds the state the last leaf commits to."""
    _swap_checkpoint(run, STEPS, 0)
    extra = ("--intervals", intervals) if intervals else ()
    p = cli("audit", run, "--json", "--quiet", *extra)
    assert p.returncode == 1, (p.returncode, p.stdout[-2000:], p.stderr[-2000:])
    r = json.loads(p.stdout)
    assert not r["accepted"]
    assert any(ckpt_name(STEPS) in x and "last leaf" in x for x in r["reasons"]), r["reasons"]


def test_an_honest_partial_audit_still_accepts(honest):
    p = cli("audit", honest, "--json", "--quiet", "--intervals", "2")
    assert p.returncode == 0, (p.stdout[-2000:], p.stderr[-2000:])


def test_inspect_shows_the_committed_final_state_not_the_manifests_list(run):
    """`veritrain inspect` printed as "final state" the hash of the manifest's last checkpoint entry, which no
    commitment covers: a trainer listed another run's state there (manifest_sha256 recomputed) and inspect
    showed it beside the run's root. It shows the state the last leaf commits to."""
    m = store.load_manifest(str(run))
    want = store.parse_leaf(bytes.fromhex(m["leaves"][-1]))["state_sha256"]
    m["checkpoints"][-1]["state_sha256"] = "ab" * 32
    store.save_manifest(str(run), m)
    r = json.loads(cli("inspect", run, "--json", check=0).stdout)
    assert r["final_state_hash"] == want


# --- a checkpoint's tensors are checked by name, shape and dtype before any is read ---------------------


class _Spy:
    """safetensors.safe_open, recording the name of every tensor whose data is read."""

    def __init__(self, real, read):
        self.real, self.read = real, read

    def __call__(self, *a, **k):
        spy = self

        class Handle:
            def __init__(self, h):
                self.h = h

            def __enter__(self):
                self.st = self.h.__enter__()
                return self

            def __exit__(self, *exc):
                return self.h.__exit__(*exc)

            def get_tensor(self, name):
                spy.read.append(name)
                return self.st.get_tensor(name)

            def __getattr__(self, name):
                return getattr(self.st, name)

        return Handle(self.real(*a, **k))


TASK_STATE = """
from veritrain import store
from veritrain.policy import Policy

def task_state():
    run = Policy().admit({"format": store.FORMAT, "task": "digits-cnn", "config": {}, "seed": 0, "mode": "verified",
                          "bits": 32, "thresholds": {}, "steps": 1, "checkpoint_every": 1, "checkpoints": []},
                         build=False)
    task = run.build_task()
    return task.model, task.optimizer, task.scheduler
"""
exec(TASK_STATE)


def _forge(honest, tmp_path, edit):
    """The honest checkpoint after 1 step with ``edit(tensors)`` applied, self-consistent (its header's hash
    recomputed), written in tmp_path."""
    from safetensors.torch import load_file, save_file

    from veritrain.checkpoint import read_checkpoint

    src = str(honest / ckpt_name(1))
    _, meta, step, _ = read_checkpoint(src)
    tensors = dict(load_file(src))
    edit(tensors)
    path = str(tmp_path / "forged.safetensors")
    save_file(tensors, path, metadata={"veritrain": canonical_json(
        {"step": step, "meta": meta, "state_sha256": state_hash(tensors, meta, step)}).decode()})
    return path


def _a_moment(tensors):
    return next(k for k in sorted(tensors) if k.startswith("optimizer/state/") and k.endswith("/exp_avg"))


def _a_weight(tensors):
    return next(k for k in sorted(tensors) if k.startswith("model/") and tensors[k].dim() > 1)


def _junk(tensors):
    tensors["model/junk"] = torch.zeros(1 << 20)


def _bigger_moment(tensors):
    name = _a_moment(tensors)
    tensors[name] = torch.zeros(tensors[name].numel() + 1024)


def _many_moments(tensors):
    name = _a_moment(tensors)
    for i in range(16):
        tensors[f"{name}{i}"] = tensors[name].clone()


def _double(tensors):
    name = _a_weight(tensors)
    tensors[name] = tensors[name].double()


def _reshaped(tensors):
    name = _a_weight(tensors)
    tensors[name] = tensors[name].reshape(-1)


def _unknown_parameter(tensors):
    tensors["optimizer/state/no.such.parameter/exp_avg"] = torch.zeros(4)


def _missing(tensors):
    del tensors[_a_weight(tensors)]


@pytest.mark.parametrize("edit, words", [
    (_junk, ["model/junk", "not a tensor of the task's model"]),
    (_bigger_moment, ["exp_avg", "more elements than its parameter"]),
    (_many_moments, ["optimizer state tensors for parameter"]),
    (_double, ["float64", "the task's model has float32"]),
    (_reshaped, ["shape", "the task's model has"]),
    (_unknown_parameter, ["no.such.parameter", "not a parameter of the task"]),
    (_missing, ["lacks", "model/"]),
], ids=["junk tensor", "a moment larger than its parameter", "many moments", "another dtype", "another shape",
        "state of no parameter", "a missing tensor"])
def test_a_checkpoints_tensors_are_checked_before_any_is_read(honest, tmp_path, monkeypatch, edit, words):
    """A checkpoint with a junk extra tensor (or one larger than the state it stands for) made the auditor read
    every tensor, then copy each for the hash, before load_state_dict refused it: ~2x the file's size (up to
    the 64 GiB cap, in a sparse file of a few KB) allocated for nothing. The header's names, shapes and dtypes
    are now checked against the task's state first; nothing is read from a file that fails."""
    import safetensors

    from veritrain.checkpoint import CheckpointError, load_checkpoint

    path = _forge(honest, tmp_path, edit)
    read = []
    monkeypatch.setattr(safetensors, "safe_open", _Spy(safetensors.safe_open, read))
    with pytest.raises(CheckpointError) as e:
        load_checkpoint(path, *task_state())  # noqa: F821 - defined by exec(TASK_STATE)
    assert all(w in str(e.value) for w in words), str(e.value)
    assert read == [], f"tensors read before the header was checked: {read[:5]}"


def test_an_honest_checkpoint_still_loads(honest, monkeypatch):
    import safetensors

    from veritrain.checkpoint import load_checkpoint

    read = []
    monkeypatch.setattr(safetensors, "safe_open", _Spy(safetensors.safe_open, read))
    m = store.load_manifest(str(honest))
    step, h = load_checkpoint(str(honest / ckpt_name(1)), *task_state())  # noqa: F821
    assert (step, h) == (1, m["checkpoints"][1]["state_sha256"])
    assert read, "the spy saw no read"


def _sparse_junk_checkpoint(honest, path, size, step=1):
    """The honest checkpoint after ``step`` steps plus a tensor ``model/junk`` of ``size`` bytes whose data is a hole
    of a sparse file: a few KB on disk."""
    from safetensors.torch import save_file

    from veritrain.checkpoint import read_checkpoint

    tensors, meta, step, _ = read_checkpoint(str(honest / ckpt_name(step)))
    save_file(tensors, str(path), metadata={"veritrain": canonical_json(
        {"step": step, "meta": meta, "state_sha256": "00" * 32}).decode()})
    raw = path.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8:8 + n])
    end = max(v["data_offsets"][1] for k, v in header.items() if k != "__metadata__")
    header["model/junk"] = {"dtype": "U8", "shape": [size], "data_offsets": [end, end + size]}
    hb = json.dumps(header).encode()
    hb += b" " * (-len(hb) % 8)
    with open(path, "wb") as f:
        f.write(len(hb).to_bytes(8, "little") + hb + raw[8 + n:])
        f.truncate(8 + len(hb) + end + size)


def test_a_sparse_checkpoint_with_a_huge_junk_tensor_is_refused_in_little_memory(honest, tmp_path):
    """The attack as the auditor meets it: a 1 GiB sparse checkpoint (a few KB on disk) whose junk tensor the
    auditor read, then copied for the hash (its peak memory grew by 2 GiB), before refusing the file as
    corrupt. Refused by the tensor's name, in a child whose peak memory grows by less than 256 MiB."""
    path = tmp_path / "sparse.safetensors"
    _sparse_junk_checkpoint(honest, path, 1 << 30)
    code = TASK_STATE + textwrap.dedent(f"""
        import resource
        from veritrain.checkpoint import CheckpointError, load_checkpoint
        state = task_state()
        before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        try:
            load_checkpoint({str(path)!r}, *state)
        except CheckpointError as e:
            print("refused:", e)
        print("grew KiB:", resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before)
    """)
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert "refused:" in p.stdout and "model/junk" in p.stdout, (p.stdout[-2000:], p.stderr[-3000:])
    grew = int(p.stdout.rsplit("grew KiB:", 1)[1])
    assert grew < 256 << 10, f"peak memory grew by {grew >> 10} MiB"


def test_verify_and_audit_hash_a_sparse_final_checkpoint_in_little_memory(run):
    """The final checkpoint with a 1 GiB junk tensor in a sparse file (a few KB on disk), its manifest entry
    updated to it: verify read every tensor of a checkpoint whole before hashing it, and so would the audit's
    check of the final weights. Each is now hashed from the file a few MiB at a time: both name the file, and
    peak memory grows by less than 256 MiB."""
    path = run / ckpt_name(STEPS)
    _sparse_junk_checkpoint(run, path, 1 << 30, step=STEPS)
    m = store.load_manifest(str(run))
    m["checkpoints"][-1]["file_sha256"] = store.file_sha256(str(path))
    store.save_manifest(str(run), m)
    code = textwrap.dedent(f"""
        import resource
        from veritrain import store
        from veritrain.api import verify
        before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        r = verify({str(run)!r})
        print("verify:", r.problems)
        leaves = [bytes.fromhex(x) for x in store.load_manifest({str(run)!r})["leaves"]]
        print("audit:", store.final_checkpoint_problem({str(run)!r}, {STEPS}, leaves))
        print("grew KiB:", resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before)
    """)
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    out = p.stdout.split("grew KiB:")[0]
    assert "verify:" in out and ckpt_name(STEPS) in out.split("audit:")[0], (p.stdout[-2000:], p.stderr[-3000:])
    assert "last leaf" in out.split("audit:")[1], p.stdout[-2000:]
    grew = int(p.stdout.rsplit("grew KiB:", 1)[1])
    assert grew < 256 << 10, f"peak memory grew by {grew >> 10} MiB"


# --- what the audit checks before it replays anything ----------------------------------------------------


def _leaves_of_half_the_run(run, tmp_path):
    m = store.load_manifest(str(run))
    m["leaves"] = m["leaves"][:2]
    m["root"] = _root(m["leaves"])
    store.save_manifest(str(run), m)
    return []


def _another_task_source(run, tmp_path):
    m = store.load_manifest(str(run))
    m["task_source_sha256"] = "0" * 64
    store.save_manifest(str(run), m)
    recommit(run)
    return []


def _init_log(data):
    def edit(run, tmp_path):
        (run / store.INIT_LOG).write_bytes(data(run))
        return []
    return edit


def _recommitted(edit):
    def both(run, tmp_path):
        out = edit(run, tmp_path)
        recommit(run)
        return out
    return both


@pytest.mark.parametrize("edit, code, words", [
    (lambda run, tmp_path: ["--root", "ab" * 32], 1, "not to the committed root abababababababab"),
    (_leaves_of_half_the_run, 1, "2 leaves for 4 intervals"),
    (_another_task_source, 1, "the source of task digits-cnn differs from the trainer's (sha256 mismatch)"),
    (_init_log(lambda run: (run / store.INIT_LOG).read_bytes() + b"\0"), 1,
     "is not the initialisation log the run commits to (altered, truncated or replaced)"),
    (_recommitted(_init_log(lambda run: b"not a log")), 1, "not a veritrain rounding log"),
    (_recommitted(_init_log(lambda run: (run / store.log_name(0)).read_bytes())), 1,
     "initial state: the task's construction does not replay the run's initialisation log"),
], ids=["the client's root is another", "leaves for half the run", "another task source", "an altered init log",
        "a malformed init log, recommitted", "a step's log as the init log, recommitted"])
def test_the_audit_refuses_before_replaying_what_does_not_match_its_commitments(run, tmp_path, edit, code, words):
    """The checks `audit` makes before it replays a step: the manifest's leaves against the root the client
    holds (--root) and against the run's schedule, the task's source against the one the trainer ran, the
    initialisation log against its hash and against the task's construction. The recommitted forgeries are
    self-consistent (every hash the trainer writes recomputed). Each case fails with its check dropped."""
    extra = edit(run, tmp_path)
    p = cli("audit", run, "--json", "--quiet", *extra)
    assert p.returncode == code and words in p.stdout + p.stderr, (p.returncode, p.stdout[-2000:], p.stderr[-2000:])


def test_a_root_that_contradicts_the_auditors_policy_is_its_own_error(run):
    """The command line refuses --root against a contract's root as it reads them; a library caller passing
    both to the audit gets the same refusal from the audit itself, before anything of the run is trusted."""
    from veritrain.policy import Policy
    from veritrain.runner import audit

    with pytest.raises(store.RunError, match="contradicts the policy's root cdcdcdcdcdcd") as e:
        audit(str(run), progress=False, root="ab" * 32, policy=Policy(root="cd" * 32))
    assert not isinstance(e.value, store.RunRejected)
