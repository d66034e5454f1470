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

from conftest import cli, recommit
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
