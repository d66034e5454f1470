"""A dishonest trainer that edits what its run *asks for*: thresholds, slack, task, initial state, claims.

Each test plays the attack of one row of issue 8's table (numbers in the names) against an auditor on
another emulated CPU (`--variant combo`), and expects a refusal naming the field or a rejection (exit 1).
Before the auditor had a policy of its own, every one of these was accepted (or ran the trainer's code).
"""

import json
import re
import shutil

import pytest

from conftest import audit_json, cli, recommit
from veritrain import store
from veritrain.runner import TrainOptions, train

AUDITOR = "combo"


@pytest.fixture(scope="module")
def honest(tmp_path_factory):
    run = tmp_path_factory.mktemp("honest") / "run"
    train(TrainOptions(task="digits-cnn", out=str(run), steps=4, checkpoint_every=2, progress=False))
    return run


def copy_run(honest, tmp_path, name="run"):
    dst = tmp_path / name
    shutil.copytree(honest, dst)
    return dst


def edit_manifest(run, **fields):
    """What a dishonest trainer publishes: the manifest edited, then every commitment recomputed."""
    m = store.load_manifest(str(run))
    m.update(fields)
    store.save_manifest(str(run), m)
    return recommit(run)


@pytest.mark.parametrize("edit, reason", [
    ({"width": 16.9}, "not of the type of the task's default 16"),
    ({"batch_size": "64"}, "not of the type of the task's default 64"),
    ({"bogus": 1}, "names keys the task does not have"),
    ({"lr": float("nan")}, "not of the type of the task's default 0.003"),
    ({"width": -3}, "the run's config does not build its task (TaskError: digits-cnn: config 'width' = -3"),
    ({"held_out": 0}, "config 'held_out' = 0 is outside [1, inf)"),
    ({"batch_size": 10**7}, "step 0: the step fails from the run's committed state (ValueError"),
], ids=["width 16.9", "batch size as text", "unknown key", "lr NaN", "negative width", "no held-out data", "a batch of 10**7"])
def test_a_runs_own_config_must_be_one_its_task_builds(honest, tmp_path, edit, reason):
    """Without a contract the auditor takes a built-in task's config from the run. The built-in tasks convert
    with int() and float(): a width of 16.9 built the model of 16, so the audit ACCEPTED a run whose committed
    config names a training that did not happen. Values the task's code rejects stopped the audit with exit 2
    (as if the auditor's own input were unusable) or a traceback; each is now the trainer's: rejected, exit 1."""
    run = copy_run(honest, tmp_path)
    m = store.load_manifest(str(run))
    edit_manifest(run, config={**m["config"], **edit})
    p = cli("audit", run, "--json", "--quiet", "--variant", AUDITOR)
    assert p.returncode == 1 and "Traceback" not in p.stderr, (p.returncode, p.stderr[-2000:])
    r = json.loads(p.stdout)
    assert not r["accepted"] and any(reason in x for x in r["reasons"]), r["reasons"]


def test_row2_slack_of_1e300_is_refused(honest, tmp_path):
    run = copy_run(honest, tmp_path)
    edit_manifest(run, slack=1e300)
    r = audit_json(run, AUDITOR)
    assert not r["accepted"] and r.get("refused"), r
    assert "'slack'" in r["reasons"][0]
    p = cli("verify", run, "--json")
    assert p.returncode == 1 and "'slack'" in p.stdout


def test_row3_a_huge_elementwise_threshold_is_refused(tmp_path):
    thresholds = tmp_path / "t.json"
    thresholds.write_text(json.dumps({"elementwise": 1e18}))
    run = tmp_path / "run"
    cli("train", "digits-cnn", "--out", run, "--steps", 2, "--checkpoint-every", 2, "--thresholds", thresholds,
        "--quiet", check=0)
    assert store.load_manifest(str(run))["thresholds"]["elementwise"] == 1e18
    r = audit_json(run, AUDITOR)
    assert not r["accepted"] and r.get("refused")
    assert "'thresholds'" in r["reasons"][0] and "elementwise" in r["reasons"][0], r["reasons"]
    # a client that agreed to larger thresholds says so in its contract, and only up to what it agreed
    contract = tmp_path / "contract.json"
    cli("contract", "digits-cnn", "--out", contract, "--thresholds", thresholds, check=0)
    r = audit_json(run, AUDITOR, "--contract", contract)
    assert r["accepted"], r["reasons"]


def test_row3_thresholds_below_the_ceiling_are_the_trainers_business(tmp_path):
    """Smaller thresholds only make the trainer log less: accepted by the default policy (the honest
    run still replays on this machine and its variants at digits-cnn's scale)."""
    thresholds = tmp_path / "t.json"
    thresholds.write_text(json.dumps({"elementwise": 16.0}))
    run = tmp_path / "run"
    cli("train", "digits-cnn", "--out", run, "--steps", 2, "--checkpoint-every", 2, "--thresholds", thresholds,
        "--quiet", check=0)
    assert audit_json(run, AUDITOR)["accepted"]


def test_row4_initial_weights_of_the_trainers_choosing_are_rejected(tmp_path, monkeypatch):
    """Same task source, but the trainer starts from weights it picked: every commitment is consistent
    with that start, so only an auditor that rebuilds the initial state itself can see it."""
    import torch

    from veritrain import runner

    honest_build = runner.build_initial

    def chosen_start(*args, **kwargs):
        task = honest_build(*args, **kwargs)
        with torch.no_grad():
            task.model.fc.bias.add_(0.5)  # e.g. a bias towards one class, planted before step 0
        return task

    monkeypatch.setattr(runner, "build_initial", chosen_start)
    run = tmp_path / "run"
    train(TrainOptions(task="digits-cnn", out=str(run), steps=2, checkpoint_every=2, progress=False))
    monkeypatch.setattr(runner, "build_initial", honest_build)
    assert store.verify(str(run))["ok"], "the dishonest run is self-consistent"
    r = audit_json(run, AUDITOR)
    assert not r["accepted"]
    assert any(x.startswith("initial state:") for x in r["reasons"]), r["reasons"]
    assert all(c["match"] for c in r["checkpoints"]), "the steps themselves replay: only the start is wrong"
    # and in the game: the referee builds the task once more with the trainer's initialisation log
    audit_dir = tmp_path / "audit"
    cli("audit", run, "--out", audit_dir, "--quiet", "--variant", AUDITOR, check=1)
    p = cli("dispute", run, audit_dir, "--json", check=1)
    v = json.loads(p.stdout)
    assert v["verdict"] == "trainer_wrong" and v["ruling"].startswith("initial state"), v


def test_row4_a_contract_can_pin_the_initial_state(honest, tmp_path):
    m = store.load_manifest(str(honest))
    contract = tmp_path / "c.json"
    cli("contract", "digits-cnn", "--out", contract, "--initial-state", "ab" * 32, check=0)
    r = audit_json(honest, AUDITOR, "--contract", contract)
    assert not r["accepted"] and "initial_state_sha256" in r["reasons"][0]
    contract2 = tmp_path / "c2.json"
    cli("contract", "digits-cnn", "--out", contract2, "--initial-state", m["initial_state_sha256"], "--steps", 4,
        "--checkpoint-every", 2, "--seed", 0, "--mode", "verified", "--bits", 32, check=0)
    assert audit_json(honest, AUDITOR, "--contract", contract2)["accepted"]
    contract3 = tmp_path / "c3.json"
    cli("contract", "digits-cnn", "--out", contract3, "--steps", 8, check=0)
    r = audit_json(honest, AUDITOR, "--contract", contract3)
    assert not r["accepted"] and "'steps'" in r["reasons"][0]


@pytest.mark.parametrize("command", ["audit", "eval", "verify", "dispute"])
def test_row5_a_task_named_by_the_run_is_never_imported(honest, tmp_path, command):
    """``subprocess:run`` with a config whose keys are an argv: building that "task" runs a command."""
    marker = tmp_path / "pwned"
    run = copy_run(honest, tmp_path)
    edit_manifest(run, task="subprocess:run", config={"touch": 0, str(marker): 0}, task_source_sha256=None)
    if command == "dispute":
        audit_dir = tmp_path / "audit"
        cli("audit", honest, "--out", audit_dir, "--quiet", check=0)
        p = cli("dispute", run, audit_dir, "--json")
    else:
        p = cli(command, run, *(["--quiet"] if command == "audit" else []))
    assert not marker.exists(), f"`veritrain {command}` ran the trainer's command"
    assert p.returncode == 1, (p.returncode, p.stdout, p.stderr)
    if command == "dispute":
        assert json.loads(p.stdout)["verdict"] == "trainer_wrong"
    else:
        assert "'task'" in p.stdout + p.stderr, p.stdout + p.stderr


def test_row5_a_module_beside_the_run_is_not_imported_from_the_working_directory(honest, tmp_path):
    """`python -m` puts the working directory on sys.path: an auditor that runs in the trainer's folder
    must still not import a module the run names."""
    marker = tmp_path / "pwned"
    run = copy_run(honest, tmp_path)
    (run / "evil_task.py").write_text(f"open({str(marker)!r}, 'w').close()\n"
                                      "from veritrain.tasks.digits_cnn import make_task, DEFAULTS\n")
    edit_manifest(run, task="evil_task:make_task")
    p = cli("audit", ".", "--quiet", "--variant", AUDITOR, cwd=run)
    assert not marker.exists(), "the auditor imported the trainer's module"
    assert p.returncode == 1 and "'task'" in p.stderr
    # named by the auditor itself, the same module is the auditor's choice (and then it is run)
    p = cli("audit", ".", "--quiet", "--task", "evil_task:make_task", cwd=run, env={"PYTHONPATH": str(run)})
    assert marker.exists()


def test_row15_an_edited_evaluation_is_shown_as_the_trainers_unverified_claim(honest, tmp_path):
    run = copy_run(honest, tmp_path)
    m = store.load_manifest(str(run))
    m["evaluation"] = {"accuracy": 0.999, "loss": 0.001, "examples": 297}
    store.save_manifest(str(run), m)
    v = json.loads(cli("verify", run, "--json", check=0).stdout)
    assert v["unverified"]["evaluation"]["accuracy"] == 0.999
    a = audit_json(run, AUDITOR)
    assert a["accepted"] and a["unverified"]["evaluation"]["accuracy"] == 0.999
    p = cli("audit", run, "--quiet")
    assert "unverified" in p.stdout and "evaluation" in p.stdout
    e = json.loads(cli("eval", run, "--json", check=0).stdout)
    assert e["accuracy"] != 0.999, "eval recomputes the metric from the committed state"


def test_row15_a_zero_step_run_commits_to_its_initial_state(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    cli("train", "digits-cnn", "--out", a, "--steps", 0, "--quiet", check=0)
    cli("train", "digits-cnn", "--out", b, "--steps", 0, "--set", "width=8", "--quiet", check=0)
    ra, rb = store.load_manifest(str(a))["root"], store.load_manifest(str(b))["root"]
    empty = "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855"  # SHA-256 of nothing
    assert ra != rb and empty not in (ra, rb)
    assert audit_json(a, AUDITOR)["accepted"]
    # a 0-step run whose initial state was swapped for another model's is rejected
    shutil.copy(b / store.ckpt_name(0), a / store.ckpt_name(0))
    m = store.load_manifest(str(a))
    mb = store.load_manifest(str(b))
    m["checkpoints"] = mb["checkpoints"]
    m["initial_state_sha256"] = mb["initial_state_sha256"]
    store.save_manifest(str(a), m)
    run_sha = store.run_sha256(m)
    m["leaves"] = [store.leaf_data(0, 0, 0, run_sha, m["initial_state_sha256"], []).hex()]
    m["root"] = store.tree_of([bytes.fromhex(m["leaves"][0])]).root().hex()
    store.save_manifest(str(a), m)
    r = audit_json(a, AUDITOR)
    assert not r["accepted"] and any("initial state" in x for x in r["reasons"]), r["reasons"]


def test_sampled_audits_draw_unpredictable_intervals_and_can_be_repeated(tmp_path):
    run = tmp_path / "run"
    train(TrainOptions(task="digits-cnn", out=str(run), steps=8, checkpoint_every=1, progress=False))
    seen, seeds = set(), set()
    for _ in range(3):
        r = audit_json(run, "native", "--sample", 2)
        assert r["accepted"] and r["sample_seed"] is not None
        seeds.add(r["sample_seed"])
        seen.add(tuple(i["interval"] for i in r["intervals"]))
    assert len(seeds) == 3, "each sampled audit draws a fresh seed"
    again = audit_json(run, "native", "--sample", 2, "--seed", r["sample_seed"])
    assert [i["interval"] for i in again["intervals"]] == [i["interval"] for i in r["intervals"]]


# --- every refusal of Policy.admit, field by field ----------------------------------------------------------------

def admissible_manifest(**fields) -> dict:
    """A manifest the default policy admits (digits-cnn's own config), with ``fields`` replaced."""
    from veritrain.task import default_config

    m = {"format": store.FORMAT, "task": "digits-cnn", "seed": 0, "steps": 4, "checkpoint_every": 2, "bits": 32,
         "mode": "verified", "config": default_config("digits-cnn"), "thresholds": {}}
    m.update(fields)
    return m


def admit(policy, manifest: dict):
    """``policy.admit`` as the auditor calls it: an own loop's task is its script, so there is nothing to build."""
    return policy.admit(manifest, build=not str(manifest["task"]).startswith("loop:"))


D1, D2 = "a" * 64, "b" * 64
REFUSALS = [  # (id, the policy's pinned fields, the manifest's edits, what the refusal must say)
    ("an older format", {}, {"format": "veritrain-run/1"}, "field 'format'"),
    ("another task than the contract's", {"task": "digits-cnn"}, {"task": "resnet-cifar10"}, "the policy's task is"),
    ("a task that is not built in", {}, {"task": "subprocess:run"}, "not a built-in task"),
    ("another task source", {"task_source_sha256": D1}, {"task_source_sha256": D2}, "field 'task_source_sha256'"),
    ("seed true", {}, {"seed": True}, "field 'seed' is missing or not a int"),
    ("steps as text", {}, {"steps": "4"}, "field 'steps' is missing or not a int"),
    ("no config", {}, {"config": None}, "field 'config' is missing or not a dict"),
    ("a seed the contract does not name", {"seed": 1}, {}, "field 'seed' is 0, the policy requires 1"),
    ("a grid the contract does not name", {"bits": 32}, {"bits": 31}, "field 'bits' is 31, the policy requires 32"),
    ("an unknown mode", {}, {"mode": "sloppy"}, "field 'mode' is 'sloppy', not one of"),
    ("a grid finer than float32", {}, {"bits": 40}, "field 'bits' is 40, not in 23..32"),
    ("a grid coarser than bfloat16's", {}, {"bits": 22}, "field 'bits' is 22, not in 23..32"),
    ("negative steps", {}, {"steps": -1}, "field 'steps' is -1"),
    ("2**41 steps", {}, {"steps": 2**41}, "field 'steps' is 2199023255552"),
    ("checkpoints every 0 steps", {}, {"checkpoint_every": 0}, "field 'checkpoint_every' must be positive"),
    ("a negative seed", {}, {"seed": -1}, "field 'seed' must be in 0..2**63-1"),
    ("a seed of 2**63", {}, {"seed": 2**63}, "field 'seed' must be in 0..2**63-1"),
    ("an unknown threshold class", {}, {"thresholds": {"bogus": 1.0}}, "names an unknown class 'bogus'"),
    ("a zero threshold", {}, {"thresholds": {"elementwise": 0}}, "not a positive number"),
    ("a NaN threshold", {}, {"thresholds": {"elementwise": float("nan")}}, "not a positive number"),
    ("a threshold of 10**400", {}, {"thresholds": {"elementwise": 10**400}}, "not a positive number"),
    ("a threshold as text", {}, {"thresholds": {"elementwise": "1"}}, "not a positive number"),
    ("a threshold above the ceiling", {}, {"thresholds": {"elementwise": 1e18}}, "above the policy's ceiling"),
    ("a threshold above the contract's ceiling", {"thresholds": {"accumulate": 4.0}},
     {"thresholds": {"accumulate": 8.0}}, "above the policy's ceiling 4"),
    ("a slack of 1e300", {}, {"slack": 1e300}, "field 'slack'"),
    ("a slack of 0", {}, {"slack": 0}, "field 'slack'"),
    ("a NaN slack", {}, {"slack": float("nan")}, "field 'slack'"),
    ("a slack as text", {}, {"slack": "2"}, "field 'slack'"),
    ("one micro-batch named", {}, {"micro_batches": 1}, "field 'micro_batches' is '1', not a whole number"),
    ("4097 micro-batches", {}, {"micro_batches": 4097}, "field 'micro_batches' is '4097'"),
    ("micro-batches true", {}, {"micro_batches": True}, "field 'micro_batches' is 'True'"),
    ("micro-batches 2.0", {}, {"micro_batches": 2.0}, "field 'micro_batches' is '2.0'"),
    ("no micro-batches where the contract names 2", {"micro_batches": 2}, {},
     "field 'micro_batches' is 1, the policy requires 2"),
    ("another initial state", {"initial_state_sha256": D1}, {"initial_state_sha256": D2},
     "field 'initial_state_sha256'"),
    ("no initial state where the contract pins one", {"initial_state_sha256": D1}, {},
     "field 'initial_state_sha256' is 'None'"),
    ("data hashes that are not digests", {}, {"data_sha256": {"corpus": "not hex"}}, "not a map of config keys"),
    ("data hashes for an own loop", {"task": "loop:" + D1}, {"task": "loop:" + D1, "data_sha256": {"x": D1}},
     "is given for a run of an own loop"),
    ("other data than the contract's", {"data_sha256": {"corpus": D1}}, {"data_sha256": {"corpus": D2}},
     "the policy pins"),
    ("no data hashes where the contract pins some", {"data_sha256": {"corpus": D1}}, {}, "the policy pins"),
    ("another config than the contract's", {"config": {"width": 8}}, {}, "differs from the policy's at keys ['width']"),
    ("a config key the task does not have", {}, {"config": {"bogus": 1}}, "names keys the task does not have"),
]


@pytest.mark.parametrize("pinned, edits, words", [r[1:] for r in REFUSALS], ids=[r[0] for r in REFUSALS])
def test_admit_refuses_each_field_outside_the_policy_and_names_it(pinned, edits, words):
    """Each refusal of `Policy.admit` (the auditor's trust boundary, docs/SECURITY.md "What the auditor takes from
    whom"), played against the policy directly: a manifest that differs from an admissible one in that field
    alone is refused, and the refusal names the field. The audits above reach a few of these through the whole
    command; this holds every one (each case fails with its check dropped), and the control below holds that the
    manifest is otherwise admissible."""
    from veritrain.policy import Policy, PolicyError

    with pytest.raises(PolicyError) as refused:
        admit(Policy(**pinned), admissible_manifest(**edits))
    assert words in str(refused.value), str(refused.value)


@pytest.mark.parametrize("pinned, edits", [
    ({}, {}), ({"task": "digits-cnn", "seed": 0, "bits": 32, "micro_batches": 1}, {}),
    ({"micro_batches": 2}, {"micro_batches": 2}), ({"initial_state_sha256": D1}, {"initial_state_sha256": D1}),
    ({"data_sha256": {"corpus": D1}}, {"data_sha256": {"corpus": D1}}), ({}, {"slack": 1.5}),
    ({}, {"thresholds": {"elementwise": 1.0, "accumulate": 8}}), ({"task": "loop:" + D1}, {"task": "loop:" + D1}),
], ids=["default", "pinned as the run", "2 micro-batches", "an initial state", "data", "a smaller slack",
        "thresholds at or below the ceilings", "an own loop"])
def test_admit_takes_a_manifest_inside_the_policy(pinned, edits):
    """The control for the refusals above: the same manifests without the one field outside the policy are
    admitted, with the auditor's slack and the run's thresholds over the built-in ones."""
    from veritrain.policy import Policy

    run = admit(Policy(**pinned), admissible_manifest(**edits))
    assert run.slack == 2.0 and run.micro_batches == edits.get("micro_batches", 1)
    assert run.thresholds["elementwise"] == edits.get("thresholds", {}).get("elementwise", 32.0)


# --- the auditor's own contract: read strictly, refused as the auditor's error ----------------------------------


@pytest.mark.parametrize("text, words", [
    (None, "cannot read contract"),
    (b"{", "is not valid JSON"),
    (b"\xff\xfe", "is not valid JSON"),
    (b"[]", "expected a JSON object with format"),
    (b'{"format": "veritrain-contract/0"}', "expected a JSON object with format"),
    (b'{"format": "%s", "roots": "ab"}', "unknown fields ['roots']"),
    (b'{"format": "%s", "seed": "0"}', "field 'seed' has the wrong type (str)"),
    (b'{"format": "%s", "seed": true}', "field 'seed' has the wrong type (bool)"),
    (b'{"format": "%s", "thresholds": {"bogus": 1}}', "unknown threshold class 'bogus'"),
    (b'{"format": "%s", "mode": "sloppy"}', "mode must be one of"),
    (b'{"format": "%s", "data_sha256": {"corpus": "not hex"}}', "data_sha256 must map config keys"),
], ids=["missing", "truncated", "not text", "a list", "another format", "an unknown field", "a seed as text",
        "a seed that is true", "an unknown threshold class", "an unknown mode", "data hashes that are not digests"])
def test_a_contract_the_auditor_cannot_take_is_its_own_error_naming_the_problem(tmp_path, text, words):
    """The contract is the auditor's own input (its client's terms): one it cannot read or that says something no
    run could meet is a RunError naming the problem, never a default policy in its place. Each case fails with
    its check dropped."""
    from veritrain.policy import CONTRACT_FORMAT, Policy

    path = tmp_path / "contract.json"
    if text is not None:
        path.write_bytes(text.replace(b"%s", CONTRACT_FORMAT.encode()))
    with pytest.raises(store.RunError, match=re.escape(words)) as e:
        Policy.from_file(str(path))
    assert not isinstance(e.value, store.RunRejected)


def test_a_flag_that_contradicts_the_contract_and_an_existing_contract_path_are_refused(tmp_path):
    from veritrain.policy import Policy, write_contract

    path = tmp_path / "contract.json"
    write_contract(str(path), Policy(task="digits-cnn", root="cd" * 32))
    assert Policy.from_options(contract=str(path), root="cd" * 32).root == "cd" * 32  # the same root: agreed
    with pytest.raises(store.RunError, match="--root 'abab.*' contradicts the contract's root 'cdcd"):
        Policy.from_options(contract=str(path), root="ab" * 32)
    with pytest.raises(store.RunError, match="--task 'resnet-cifar10' contradicts the contract's task 'digits-cnn'"):
        Policy.from_options(contract=str(path), task="resnet-cifar10")
    before = path.read_bytes()
    with pytest.raises(store.RunError, match="already exists; choose a new path"):
        write_contract(str(path), Policy())
    assert path.read_bytes() == before  # nothing overwritten
