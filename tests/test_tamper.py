"""Logs that lie: steering a rounding far from any midpoint, and logs that belong to other code."""

import os
import shutil

import numpy as np
import pytest

from conftest import audit_json, cli, flip_far_rounding, recommit
from veritrain.logformat import read_records, write_records
from veritrain.rounding import Grid
from veritrain.runner import TrainOptions, log_name, train

STEP = 3


class Capture:
    """Probe that keeps the float64 results of one step's approx ops (by op index)."""

    def __init__(self, step):
        self.step, self.values = step, {}

    def __call__(self, step, op_index, name, op_class, slot, y, scale_fn):
        if step == self.step and y.numel() >= 64:
            self.values[(op_index, slot)] = (name, y.detach().clone())


@pytest.fixture()
def honest_run(tmp_path):
    cap = Capture(STEP)
    run = tmp_path / "run"
    train(TrainOptions(task="digits-cnn", out=str(run), steps=6, checkpoint_every=2, progress=False), probe=cap)
    return run, cap


def steer_one_rounding(run, cap):
    """Add a direction entry that rounds one value the wrong way, far from any midpoint."""
    grid = Grid(32)
    path = os.path.join(run, log_name(STEP))
    step, bits, ops = read_records(path)
    # the last ops of the step first: the optimizer writes them straight into the state, so one changed
    # rounding there must show in the state hash (an early activation may be masked by ReLU or pooling)
    for (op_index, slot), (name, y) in sorted(cap.values.items(), reverse=True):
        rec = ops[op_index - 1]
        assert rec.name == name
        out_slot = [i for i, o in enumerate(rec.outputs) if tuple(o.shape) == tuple(y.shape)][0]
        flat = y.reshape(-1)
        dist = grid.midpoint_distance(flat)
        far = (dist > grid.spacing_at(flat) / 4).nonzero().flatten().tolist()
        taken = set(rec.outputs[out_slot].dir_pos.tolist()) | set(rec.outputs[out_slot].val_pos.tolist())
        far = [p for p in far if p not in taken]
        if not far:
            continue
        p = far[len(far) // 2]
        natural_away = bool(grid.round(flat[p:p + 1]).double().abs() > flat[p:p + 1].abs())
        o = rec.outputs[out_slot]
        pos = np.append(o.dir_pos, p)
        order = np.argsort(pos)
        o.dir_pos = pos[order]
        o.dir_bits = np.append(o.dir_bits, not natural_away)[order]
        write_records(path, step, bits, ops)
        return name, p
    raise AssertionError("no approx output with a value far from a midpoint")


@pytest.fixture()
def steered_run(tmp_path, monkeypatch):
    """A dishonest trainer: at step STEP it rounds one value the wrong way, far from any midpoint, and
    logs that decision; everything else (later ops, later steps, commitments) is honest."""
    from veritrain.engine import TrainerHalf, _EagerSlot

    grid = Grid(32)
    orig = TrainerHalf.record
    steered = {}

    def record(self, slot, c):
        e = orig(self, slot, c)
        if self.mode.step == STEP and not steered and isinstance(slot, _EagerSlot) and slot.y64.numel() >= 64:
            p = flip_far_rounding(e, slot, slot.y64.reshape(-1), grid)
            if p is not None:
                steered.update(op=str(slot.analysis.call.func), position=p)
        return e

    monkeypatch.setattr(TrainerHalf, "record", record)
    run = tmp_path / "steered"
    train(TrainOptions(task="digits-cnn", out=str(run), steps=6, checkpoint_every=2, progress=False))
    assert steered, "found nothing to steer"
    return run, steered


def test_steered_rounding_is_suspicious_even_when_hashes_match(steered_run):
    run, steered = steered_run
    r = audit_json(run, "isa-avx2")
    assert not r["accepted"]
    assert all(c["match"] for c in r["checkpoints"]), "the dishonest trainer's commitments are self-consistent"
    assert r["suspicious"] == 1
    d = r["suspicious_details"][0]
    assert (d["step"], d["op"], d["position"], d["kind"]) == (STEP, steered["op"], steered["position"], "direction")
    assert any("suspicious" in reason for reason in r["reasons"])
    p = cli("audit", run, "--quiet", "--variant", "isa-avx2")
    assert p.returncode == 1 and "REJECT" in p.stdout and "suspicious" in p.stdout


def test_log_steered_after_training_is_rejected(honest_run):
    run, cap = honest_run
    name, position = steer_one_rounding(run, cap)
    recommit(run)  # the dishonest trainer commits to the steered log
    r = audit_json(run, "onednn-sse41")
    assert not r["accepted"] and r["suspicious"] >= 1
    first = r["suspicious_details"][0]
    assert (first["step"], first["op"], first["position"]) == (STEP, name, position)
    after = {c["step"]: c["match"] for c in r["checkpoints"]}
    assert after[STEP + 1] is False, "the steered value changes the state at the end of its interval"


def test_flipping_genuine_entries_changes_the_result(honest_run):
    """Entries the trainer really needed sit near midpoints, so flipping them is not itself suspicious;
    the auditor then follows another trajectory and the hashes reject the run. (Later entries, logged
    on the trainer's trajectory, may look suspicious on the new one: that is expected.)"""
    run, _ = honest_run
    first_flipped = None
    for s in range(6):
        path = os.path.join(run, log_name(s))
        step, bits, ops = read_records(path)
        for i, op in enumerate(ops):
            for o in op.outputs:
                if len(o.dir_bits) and first_flipped is None:
                    first_flipped = (step, i + 1)
                o.dir_bits = ~o.dir_bits
        write_records(path, step, bits, ops)
    assert first_flipped is not None
    recommit(run)
    r = audit_json(run, "native")
    assert not r["accepted"]
    assert any("differs from the trainer" in reason for reason in r["reasons"])
    if r["suspicious_details"]:
        d = r["suspicious_details"][0]
        assert (d["step"], d["op_index"]) > first_flipped


def test_log_of_another_task_fails_with_fingerprint_error(tmp_path, shakespeare):
    digits, gpt = tmp_path / "digits", tmp_path / "gpt"
    train(TrainOptions(task="digits-cnn", out=str(digits), steps=2, checkpoint_every=2, progress=False))
    train(TrainOptions(task="gpt2-text", out=str(gpt), steps=2, checkpoint_every=2, progress=False,
                       config={"corpus": shakespeare, "n_layer": 1, "n_embd": 32, "n_head": 2, "seq_len": 16,
                               "batch_size": 2, "max_chars": 5000}))
    for f in (gpt / "logs").glob("step_*.vtlog"):  # the steps' logs; the initialisation log stays digits'
        shutil.copy(f, digits / "logs" / f.name)
    recommit(digits)
    r = audit_json(digits, "native")
    assert not r["accepted"]
    assert r["reasons"][0].startswith("step 0, op #1: replay runs aten.convolution.default but the log has "
                                      "aten.add.Tensor here"), r["reasons"]


def test_log_of_another_configuration_fails_with_shape_error(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    train(TrainOptions(task="digits-cnn", out=str(a), steps=1, checkpoint_every=1, progress=False))
    train(TrainOptions(task="digits-cnn", out=str(b), steps=1, checkpoint_every=1, progress=False,
                       config={"width": 8}))
    shutil.copy(b / log_name(0), a / log_name(0))
    recommit(a)
    r = audit_json(a, "native")
    assert not r["accepted"]
    assert "step 0, op #1 aten.convolution.default: output shapes [(64, 16, 8, 8)] differ from the log's " \
           "[(64, 8, 8, 8)]" in r["reasons"][0]


def test_truncated_or_missing_log_is_rejected_with_its_name(honest_run):
    run, _ = honest_run
    path = os.path.join(run, log_name(2))
    data = open(path, "rb").read()
    open(path, "wb").write(data[: len(data) // 2])
    r = audit_json(run, "native")
    assert not r["accepted"] and "step_00000002.vtlog" in r["reasons"][0]
    recommit(run)  # even when the trainer commits to the truncated log, the log format rejects it
    r = audit_json(run, "native")
    assert not r["accepted"] and "step_00000002.vtlog" in r["reasons"][0] and "truncated" in r["reasons"][0]
    os.remove(path)
    r = audit_json(run, "native")
    assert not r["accepted"] and "step_00000002.vtlog" in r["reasons"][0]
