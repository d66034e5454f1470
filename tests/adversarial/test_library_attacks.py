"""A dishonest trainer against the library paths and the run's numeric settings: the manifest's grid, mode,
thresholds, slack, seed, steps and checkpoint interval as the auditor's policy admits them (policy.py).

Every value outside what the policy allows is refused with the field named, as a verdict (exit 1): never a
traceback, never an accepted run, whatever the JSON can hold (integers of any size included).
"""

import json
import math
import shutil

import pytest

from conftest import cli, recommit
from veritrain import store
from veritrain.policy import Policy, PolicyError
from veritrain.runner import TrainOptions, train
from veritrain.store import RunError

HUGE = 10**400  # valid JSON, a Python int, and no float: math.isfinite(HUGE) raises OverflowError


@pytest.fixture(scope="module")
def honest(tmp_path_factory):
    run = tmp_path_factory.mktemp("honest") / "run"
    train(TrainOptions(task="digits-cnn", out=str(run), steps=1, checkpoint_every=1, progress=False))
    return run


@pytest.mark.parametrize("field, value", [
    ("thresholds", {"elementwise": HUGE}), ("thresholds", {"elementwise": -HUGE}),
    ("thresholds", {"elementwise": "1"}), ("thresholds", {"elementwise": math.nan}),
    ("thresholds", {"elementwise": math.inf}), ("thresholds", {"elementwise": -1.0}),
    ("thresholds", {"elementwise": 0}), ("thresholds", {"elementwise": True}), ("thresholds", {"bogus": 1.0}),
    ("slack", HUGE), ("slack", -HUGE), ("slack", 0), ("slack", math.nan), ("slack", math.inf), ("slack", "2"),
    ("slack", True), ("slack", 2.5),
    ("seed", 1.0), ("seed", True), ("seed", -1), ("seed", 2**63), ("seed", HUGE), ("seed", "0"),
    ("steps", -1), ("steps", True), ("steps", 2.0), ("steps", 2**40 + 1), ("steps", HUGE),
    ("checkpoint_every", 0), ("checkpoint_every", -HUGE), ("checkpoint_every", True), ("checkpoint_every", 1.5),
    ("bits", 16), ("bits", 33), ("bits", 64), ("bits", True), ("bits", 32.0), ("bits", HUGE),
    ("mode", "float16"), ("mode", ""), ("mode", None), ("mode", 1),
], ids=lambda v: str(v)[:20])
def test_numeric_settings_outside_the_policy_are_refused_naming_the_field(honest, field, value):
    m = store.load_manifest(str(honest))
    m[field] = {**m["thresholds"], **value} if field == "thresholds" else value
    with pytest.raises(PolicyError, match=repr(field)):
        Policy().admit(m, build=False)


@pytest.mark.parametrize("field, value, says", [
    ("thresholds", {"elementwise": HUGE}, "field 'thresholds' gives class 'elementwise' the value 1000"),
    ("slack", HUGE, "field 'slack' is 1000"),
], ids=["threshold 10**400", "slack 10**400"])
def test_a_setting_too_large_for_a_float_is_refused_not_a_traceback(honest, tmp_path, field, value, says):
    """A threshold or slack of 10**400 (an integer in the manifest's JSON, recommitted): `audit` and `verify`
    raised OverflowError from the policy's own check (a traceback, exit 1 without a verdict, and the same in
    the game's challenger, which admits the run's manifest the same way)."""
    run = tmp_path / "run"
    shutil.copytree(honest, run)
    m = store.load_manifest(str(run))
    m[field] = {**m["thresholds"], **value} if field == "thresholds" else value
    store.save_manifest(str(run), m)
    recommit(run)
    p = cli("audit", run, "--json", "--quiet")
    assert p.returncode == 1 and "Traceback" not in p.stderr, p.stderr[-3000:]
    r = json.loads(p.stdout)
    assert r["refused"] and not r["accepted"] and says in r["reasons"][0], r
    p = cli("verify", run, "--json")
    assert p.returncode == 1 and "Traceback" not in p.stderr, p.stderr[-3000:]
    assert says in json.loads(p.stdout)["problems"][0]["problem"]


@pytest.mark.parametrize("contract, says", [
    ({"thresholds": {"elementwise": HUGE}}, "threshold for 'elementwise' must be a positive number"),
    ({"slack": HUGE}, "slack must be a number in [1, 16]"),
], ids=["threshold 10**400", "slack 10**400"])
def test_a_contract_with_a_number_too_large_for_a_float_is_named(tmp_path, contract, says):
    """The auditor's own contract: unusable input, named (exit 2), not an OverflowError traceback."""
    path = tmp_path / "contract.json"
    path.write_text(json.dumps({"format": "veritrain-contract/1", **contract}))
    with pytest.raises(RunError, match=r"must be"):
        Policy.from_file(str(path))
    p = cli("verify", tmp_path, "--contract", path)
    assert p.returncode == 2 and says in p.stderr and "Traceback" not in p.stderr, p.stderr[-3000:]
