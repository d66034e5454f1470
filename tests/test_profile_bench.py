"""bench/profile_engine.py wraps the engine's functions by name: it must keep up with the engine, and its
timer stack must account for the whole step (each category exclusive, together the step's time)."""

import os
import sys

from conftest import REPO

sys.path.insert(0, os.path.join(REPO, "bench"))

import profile_engine  # noqa: E402


def test_the_profile_accounts_for_the_whole_step_once():
    for owner, name, _ in profile_engine._targets():
        assert name in owner.__dict__, f"{owner.__name__}.{name} is gone: update bench/profile_engine.py"
    r = profile_engine.measure("digits-cnn", {}, 1, progress=None)
    for run in ("trainer*", "auditor*"):
        total = sum(r["share"][run].values())
        assert 0.9 <= total <= 1.0 + 1e-9, (run, r["share"][run])  # exclusive: nothing counted twice
        assert r["share"][run]["kernel"] > 0 and r["share"][run]["log"] > 0
    assert r["share"]["trainer*"]["scan"] > 0 and r["share"]["auditor*"]["scan"] == 0  # only the trainer scans
    assert set(r["in_fp64_steps"]) == {"trainer", "auditor"}
