"""bench/first_divergence.py, the GPU checks' diagnostic: it replays one step on two devices with per-op
traces and names the first operator whose rounded outputs differ. Here both sides are this CPU: a conforming
second side (the worst case the error model allows, `perturb`) differs nowhere, and a nonconforming one (the
same moves at 100 times their bound) is named at its first operator that rounds differently."""

import os
import sys

import pytest

from conftest import REPO, cli
from veritrain import engine

sys.path.insert(0, os.path.join(REPO, "bench"))

import first_divergence  # noqa: E402


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    d = tmp_path_factory.mktemp("divergence") / "run"
    cli("train", "digits-cnn", "--out", d, "--steps", "1", "--checkpoint-every", "1", "--quiet",
        "--set", "batch_size=16", check=0)
    return str(d)


def second_side(monkeypatch, factor):
    """Replays of the second device (every second call of ``replay``) run as hardware that moves each
    approximate float64 result by up to 0.9 * ``factor`` of its threshold."""
    real, calls = first_divergence.replay, []

    def replay(run_dir, step, device, capture=None):
        calls.append(device)
        if len(calls) % 2:
            return real(run_dir, step, device, capture)
        with monkeypatch.context() as m:
            m.setenv("VERITRAIN_EMULATE", "perturb")
            perturb = engine._EagerSlot.perturb
            m.setattr(engine._EagerSlot, "perturb", lambda self, c, key: perturb(self, c * factor, key))
            return real(run_dir, step, device, capture)

    monkeypatch.setattr(first_divergence, "replay", replay)
    return calls


def test_hardware_within_the_error_model_differs_nowhere(run, monkeypatch, capsys):
    second_side(monkeypatch, 1.0)
    assert first_divergence.main([run, "--step", "0", "--devices", "cpu,cpu"]) == 0
    assert "no operator differs" in capsys.readouterr().out


def test_the_first_operator_beyond_the_error_model_is_named(run, monkeypatch, capsys):
    calls = second_side(monkeypatch, 100.0)
    assert first_divergence.main([run, "--step", "0", "--devices", "cpu,cpu"]) == 1
    out = capsys.readouterr().out
    last = out.strip().splitlines()[-1]
    assert '"what": "outputs"' in last, out  # its inputs agree: this operator is where the sides part
    assert "first difference: traced operator" in out and "input 0:" in out and "float64 output 0:" in out
    assert len(calls) == 4  # each side traced, then each side's call of that operator captured
