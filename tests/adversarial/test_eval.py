"""`veritrain eval` evaluates only a state the run commits to under the root (SECURITY.md row 20).

The manifest's `checkpoints` list is not covered by the root. Before, eval loaded the list's last entry and
checked the file only against that entry's `state_sha256`: a trainer added weights of its choosing (here:
another run's, trained longer) as a last entry, and eval reported their metric as the run's, with exit 0.
Now eval takes the states from the leaves under the root (the contract's, `--root`, else the manifest's):
the extra entry is ignored, a step no leaf ends is refused, and a swapped file under a committed step is
rejected.
"""

import json
import shutil

import pytest

from conftest import TASKS_ENV, cli, recommit
from veritrain import store
from veritrain.policy import Policy, write_contract
from veritrain.runner import TrainOptions, train


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    d = tmp_path_factory.mktemp("eval")
    honest, better = d / "honest", d / "better"
    train(TrainOptions(task="digits-cnn", out=str(honest), steps=2, checkpoint_every=2, progress=False))
    train(TrainOptions(task="digits-cnn", out=str(better), steps=12, checkpoint_every=12, progress=False))
    return honest, better


def _swap_last_checkpoint(honest, better, dst):
    shutil.copytree(honest, dst)
    mb = store.load_manifest(str(better))
    donor = mb["checkpoints"][-1]
    # the donor's state, filed as this run's checkpoint after step 2 (the state hash includes the step: use
    # the donor's step in an extra entry, which is what eval picks by default: the list's last entry)
    shutil.copy(better / store.ckpt_name(donor["step"]), dst / store.ckpt_name(donor["step"]))
    m = store.load_manifest(str(dst))
    m["checkpoints"] = m["checkpoints"] + [dict(donor)]
    store.save_manifest(str(dst), m)  # leaves and root untouched: the committed run is the honest one
    return m


def test_eval_builds_the_task_as_the_audit_does(runs, tmp_path):
    """eval built whatever model the run's own config names before it loaded a committed state into it (a GPT-2
    of 300000 layers ran on for minutes and gigabytes). It now replays the run's initialisation log, as the
    audit does: a config the trainer did not build stops at the first op the log does not have."""
    honest, _ = runs
    run = tmp_path / "run"
    shutil.copytree(honest, run)
    m = store.load_manifest(str(run))
    m["config"] = {**m["config"], "width": 17}
    store.save_manifest(str(run), m)
    recommit(run)
    p = cli("eval", run, "--json")
    assert p.returncode == 1 and "does not replay the run's initialisation log" in p.stdout, (p.stdout, p.stderr)


def test_eval_of_an_uncommitted_checkpoint_is_refused(runs, tmp_path):
    honest, better = runs
    root = store.load_manifest(str(honest))["root"]
    contract = tmp_path / "contract.json"
    write_contract(str(contract), Policy(task="digits-cnn", root=root))
    honest_eval = json.loads(cli("eval", honest, "--json", "--contract", contract).stdout)
    better_eval = json.loads(cli("eval", better, "--json").stdout)
    assert honest_eval["accuracy"] != better_eval["accuracy"]

    run = tmp_path / "run"
    _swap_last_checkpoint(honest, better, run)
    assert store.verify(str(run), root)["root"] == root, "the run still hashes to the client's root"
    p = cli("eval", run, "--json", "--contract", contract)
    assert json.loads(p.stdout) == honest_eval, "eval reported the committed state, not the added entry"
    p = cli("eval", run, "--json", "--contract", contract, "--step", "12", check=2)
    assert "commits to no state after step 12" in p.stderr


def test_eval_of_a_swapped_committed_checkpoint_is_rejected(runs, tmp_path):
    honest, better = runs
    run = tmp_path / "run"
    shutil.copytree(honest, run)
    shutil.copy(better / store.ckpt_name(12), run / store.ckpt_name(2))  # another state under step 2's name
    m = store.load_manifest(str(run))
    p = cli("eval", run, "--json", "--root", m["root"], check=1)
    assert "does not hold the state the run commits to after step 2" in p.stderr
    p = cli("eval", run, "--json", "--root", "ab" * 32, check=1)  # not the root the client holds
    assert "not to the committed root" in p.stderr


def test_eval_of_a_config_that_does_not_build_the_task_is_rejected(runs, tmp_path):
    """A config the task's own code refuses (a negative width) is the trainer's: a rejection naming it, not a
    crash of the auditor's build."""
    honest, _ = runs
    run = tmp_path / "run"
    shutil.copytree(honest, run)
    m = store.load_manifest(str(run))
    m["config"] = {**m["config"], "width": -3}
    store.save_manifest(str(run), m)
    recommit(run)  # the commitments rewritten to match, as the trainer that made the change would publish them
    p = cli("eval", run, "--json", check=1)
    assert "the run's config does not build its task (TaskError: digits-cnn: config 'width' = -3" in p.stderr, p.stderr


def test_eval_refuses_leaves_of_another_run(runs, tmp_path):
    """The states eval may evaluate come from the leaves under the root: another run's leaves (a consistent tree
    of them, its root in the manifest) describe its intervals, not this run's, and commit to nothing of it.
    (Leaves that do not parse are refused as the manifest is loaded: test_run_file_refusals.py.)"""
    honest, better = runs
    run = tmp_path / "run"
    shutil.copytree(honest, run)
    m = store.load_manifest(str(run))
    m["leaves"] = store.load_manifest(str(better))["leaves"]
    m["root"] = store.tree_of([bytes.fromhex(x) for x in m["leaves"]]).root().hex()
    store.save_manifest(str(run), m)
    p = cli("eval", run, "--json", check=1)
    assert "leaf 0 does not describe interval 0 (steps 0..1) of this run" in p.stderr, p.stderr


def test_eval_of_a_committed_checkpoint_that_does_not_load_is_rejected(runs, tmp_path):
    """The committed step's file is the trainer's: one that is not a checkpoint rejects the run, naming the file."""
    honest, _ = runs
    run = tmp_path / "run"
    shutil.copytree(honest, run)
    (run / store.ckpt_name(2)).write_bytes(b"\0" * 64)
    p = cli("eval", run, "--json", check=1)
    assert f"{store.ckpt_name(2)}: checkpoint" in p.stderr, p.stderr


def test_eval_with_a_task_that_defines_no_evaluation_says_so(tmp_path):
    """The auditor's own task without an evaluation: an error naming it, before any checkpoint is read."""
    run = tmp_path / "run"
    cli("train", "wide_mlp:make_task", "--set", "width=16", "--set", "batch_size=8", "--steps", "1",
        "--checkpoint-every", "1", "--out", run, "--quiet", env=TASKS_ENV, check=0)
    p = cli("eval", run, "--json", "--task", "wide_mlp:make_task", env=TASKS_ENV, check=2)
    assert "task wide_mlp:make_task defines no evaluation" in p.stderr, p.stderr
