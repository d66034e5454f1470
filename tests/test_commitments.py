"""The canonical state hash follows its written layout; checkpoints round-trip it."""

import hashlib
import json
import re
import struct

import pytest
import torch
import torch.nn as nn

from conftest import rewrite_checkpoint
from veritrain.checkpoint import CheckpointError, collect_state, hash_state, load_checkpoint, save_checkpoint


def layout_hash(tensors: dict, meta: dict, step: int) -> str:
    """docs/FORMAT.md "State hash", implemented from the text, independently of veritrain.commitments."""
    h = hashlib.sha256(b"veritrain-state/1\0" + struct.pack("<Q", step))
    for name in sorted(tensors, key=lambda n: n.encode()):
        t = tensors[name].contiguous()
        dtype = str(t.dtype).split(".")[1].encode()
        raw = t.numpy().tobytes()  # little-endian on this machine
        h.update(struct.pack("<I", len(name.encode())) + name.encode() + struct.pack("<I", len(dtype)) + dtype)
        h.update(struct.pack("<I", t.dim()) + b"".join(struct.pack("<Q", d) for d in t.shape))
        h.update(struct.pack("<Q", len(raw)) + raw)
    m = json.dumps(meta, sort_keys=True, separators=(",", ":")).encode()
    h.update(struct.pack("<Q", len(m)) + m)
    return h.hexdigest()


def make_state():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.Linear(4, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    for _ in range(2):
        opt.zero_grad()
        model(torch.randn(5, 3)).sum().backward()
        opt.step()
        sched.step()
    return model, opt, sched


def test_hash_follows_the_documented_layout():
    model, opt, sched = make_state()
    tensors, meta = collect_state(model, opt, sched, 2)
    assert "model/1.num_batches_tracked" in tensors and "optimizer/state/0.weight/exp_avg" in tensors
    assert hash_state(model, opt, sched, 2) == layout_hash(tensors, meta, 2)


def test_every_part_of_the_state_changes_the_hash():
    model, opt, sched = make_state()
    base = hash_state(model, opt, sched, 2)
    assert hash_state(model, opt, sched, 3) != base
    with torch.no_grad():
        w = model[0].weight
        w.view(-1).view(torch.int32)[0] ^= 1  # one bit of one parameter
    assert hash_state(model, opt, sched, 2) != base
    w.view(-1).view(torch.int32)[0] ^= 1
    assert hash_state(model, opt, sched, 2) == base
    opt.state[model[2].bias]["exp_avg_sq"].view(torch.int32)[0] ^= 1
    assert hash_state(model, opt, sched, 2) != base
    opt.state[model[2].bias]["exp_avg_sq"].view(torch.int32)[0] ^= 1
    model[1].running_var[0] += 1
    assert hash_state(model, opt, sched, 2) != base
    model[1].running_var[0] -= 1
    opt.param_groups[0]["weight_decay"] = 0.02
    assert hash_state(model, opt, sched, 2) != base
    opt.param_groups[0]["weight_decay"] = 0.01
    sched.last_epoch += 1
    assert hash_state(model, opt, sched, 2) != base


def test_checkpoint_round_trip_and_corruption(tmp_path):
    model, opt, sched = make_state()
    path = str(tmp_path / "c.safetensors")
    digest = save_checkpoint(path, model, opt, sched, 2)
    m2, o2, s2 = make_state()
    with torch.no_grad():
        for p in m2.parameters():
            p.zero_()
    step, h = load_checkpoint(path, m2, o2, s2)
    assert (step, h) == (2, digest)
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), m2.state_dict().values()))
    data = bytearray(open(path, "rb").read())
    data[-3] ^= 0xFF
    open(path, "wb").write(bytes(data))
    with pytest.raises(CheckpointError, match="corrupt"):
        load_checkpoint(path, *make_state())
    with pytest.raises(CheckpointError, match="does not exist"):
        load_checkpoint(str(tmp_path / "none.safetensors"), *make_state())
    open(path, "wb").write(b"not a checkpoint")
    with pytest.raises(CheckpointError, match="unreadable"):
        load_checkpoint(path, *make_state())


def test_tied_weights_are_saved_once_each_name(tmp_path):
    emb = nn.Embedding(10, 4)
    head = nn.Linear(4, 10, bias=False)
    head.weight = emb.weight
    model = nn.ModuleDict({"emb": emb, "head": head})
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    path = str(tmp_path / "tied.safetensors")
    digest = save_checkpoint(path, model, opt, None, 0)
    assert load_checkpoint(path, model, opt, None) == (0, digest)


def test_a_checkpoints_streamed_hash_is_its_state_hash(tmp_path):
    """checkpoint.checkpoint_state hashes a checkpoint's tensors from the file's bytes, a few MiB at a time
    (verify and the audit's check of the final weights): the same hash as state_hash of the tensors read,
    for every dtype and shape a state can hold (bool, integers, bfloat16, 0-dim, empty, larger than a chunk)."""
    from safetensors.torch import save_file

    from veritrain import checkpoint
    from veritrain.checkpoint import checkpoint_state, read_checkpoint
    from veritrain.commitments import canonical_json, state_hash

    tensors = {"model/a": torch.arange(6, dtype=torch.float32).reshape(2, 3), "model/b": torch.tensor(True),
               "model/c": torch.tensor([1, -2], dtype=torch.int64), "model/d": torch.zeros(0, 4),
               "model/e": torch.tensor([1.5, -0.0], dtype=torch.bfloat16), "model/f": torch.tensor([True, False]),
               "optimizer/state/a/exp_avg": torch.randn(3 * checkpoint._CHUNK // 4 + 5, dtype=torch.float64)}
    meta = {"optimizer": {"class": "AdamW"}, "x": -0.0}
    path = str(tmp_path / "c.safetensors")
    save_file(tensors, path, metadata={"veritrain": canonical_json(
        {"step": 3, "meta": meta, "state_sha256": state_hash(tensors, meta, 3)}).decode()})
    got, meta2, step, recorded = read_checkpoint(path)
    assert checkpoint_state(path) == (3, state_hash(got, meta2, step)) == (3, state_hash(tensors, meta, 3))


def test_a_checkpoint_that_ends_inside_a_tensor_while_it_is_hashed_is_refused(tmp_path, monkeypatch):
    """safetensors checks at open that every tensor lies inside the file; a file cut short after that (a trainer's
    file shrinking while the auditor streams it) ends a read early: a CheckpointError naming the file, not a
    hash of fewer bytes than the tensor holds. Staged by making every read past the header return nothing."""
    from safetensors.torch import save_file

    from veritrain import checkpoint
    from veritrain.checkpoint import checkpoint_state
    from veritrain.commitments import canonical_json, state_hash

    tensors = {"model/a": torch.arange(6, dtype=torch.float32)}
    path = str(tmp_path / "c.safetensors")
    save_file(tensors, path, metadata={"veritrain": canonical_json(
        {"step": 1, "meta": {}, "state_sha256": state_hash(tensors, {}, 1)}).decode()})
    header_end = 8 + int.from_bytes(open(path, "rb").read(8), "little")
    pread, empty = checkpoint.os.pread, []

    def cut_short(fd, n, at):
        if at < header_end:
            return pread(fd, n, at)
        empty.append(at)
        if len(empty) > 100:  # a reader that takes an empty read for progress would spin here for ever
            pytest.fail("the reader kept reading past the end of the file")
        return b""
    monkeypatch.setattr(checkpoint.os, "pread", cut_short)
    with pytest.raises(CheckpointError, match=r"c\.safetensors.*the file ended inside a tensor"):
        checkpoint_state(path)


def test_a_scheduler_whose_state_is_not_plain_values_is_refused_by_name():
    """A checkpoint commits to the scheduler's state_dict() as JSON: a scheduler that keeps an object there
    cannot be committed, and saying so names the fix, rather than failing inside the hash."""
    model = nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    class Holding(torch.optim.lr_scheduler.StepLR):
        def state_dict(self):
            return {**super().state_dict(), "helper": object()}

    with pytest.raises(CheckpointError, match=r"scheduler state is not serialisable .*plain values"):
        collect_state(model, opt, Holding(opt, step_size=1), 0)
    assert collect_state(model, opt, torch.optim.lr_scheduler.StepLR(opt, step_size=1), 0)[1]["scheduler"]


def _rewrite(path, edit=None, header=None):
    """The checkpoint at ``path`` rewritten as a hostile trainer would: ``edit(meta)`` applied and its header's
    hash recomputed (a self-consistent file around the edit), or ``header`` as its veritrain metadata."""
    if edit is not None:
        rewrite_checkpoint(path, lambda tensors, meta: edit(meta))
        return
    from safetensors.torch import load_file, save_file

    save_file(dict(load_file(path)), path, metadata={"veritrain": header})


NOT_A_HEADER = "its veritrain metadata is not {step, meta, state_sha256}"


def _groups(edit):
    def on(meta):
        edit(meta["optimizer"]["param_groups"])
    return on


@pytest.mark.parametrize("edit, header, words", [
    (lambda meta: meta["optimizer"].update({"class": "SGD"}), None, "holds SGD state, the task builds AdamW"),
    (_groups(lambda gs: gs.append(dict(gs[0]))), None, "holds 2 optimizer groups, the task has 1"),
    (_groups(lambda gs: gs[0].update({"params": ["no.such.weight"]})), None,
     "optimizer group names unknown parameter 'no.such.weight'"),
    (None, '{"step": -1, "meta": {}, "state_sha256": ""}', NOT_A_HEADER),
    (None, '{"step": true, "meta": {}, "state_sha256": ""}', NOT_A_HEADER),
    (None, '{"step": 2, "meta": [], "state_sha256": ""}', NOT_A_HEADER),
], ids=["another optimizer", "two groups", "a group of another parameter", "a negative step", "a step that is true",
        "meta that is a list"])
def test_a_checkpoint_whose_header_describes_another_optimizer_or_no_state_is_refused(tmp_path, edit, header, words):
    """A checkpoint's header (its JSON metadata) is the trainer's: one that names another optimizer, another
    number of parameter groups or a parameter the task does not have, or that is not {step, meta, state_sha256},
    is refused by name when it loads, even with its hash recomputed to match. Each case fails with its check
    dropped."""
    path = str(tmp_path / "c.safetensors")
    save_checkpoint(path, *make_state(), 2)
    _rewrite(path, edit, header)
    with pytest.raises(CheckpointError, match=re.escape(words)):
        load_checkpoint(path, *make_state())
