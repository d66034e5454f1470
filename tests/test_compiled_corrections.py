"""Honest corrections through the auditor's compiled paths.

Between this project's CPU variants the log almost never corrects a rounding, and the auditors that really
disagree with the trainer (tests/test_disagreeing_hardware.py) run under the emulated accelerator, where every
compiled path is off: so the paths an auditor on a CPU takes with its kernels on (fused elementwise ops and
sums, blocked matrix products, small foreach tensors laid end to end, captured regions and their rows' runs) had never
been given an honest entry that contradicts their own rounding. That is what a CPU auditor meets when it
audits a GPU trainer.

Here the trainer runs on the worst hardware the error model allows (``perturb``: every approximate result moved
by up to 0.9 of its threshold) and the auditor on this CPU with every compiled path forced on for every size
(VERITRAIN_COMPILE=1). It must accept, with every checkpoint bit for bit and nothing suspicious, after
corrections made by the compiled paths' slots, not only by the eager engine's.
"""

import collections

import pytest
import torch

from conftest import shared_file
from veritrain import blocked, capture, engine
from veritrain.runner import TrainOptions, audit, train

TASKS = {  # task, its settings (small sizes), the slot kinds whose corrections the audit must make
    "digits-cnn": ({}, {"_EagerSlot"}),
    "resnet-cifar10": ({"data": "digits", "width": 8, "batch_size": 16}, {"_FusedSlot", "_EagerSlot"}),
    # the GPT-2 vocabulary (50257): its products by blocks (no log-softmax entry at this size: the rows' corrections
    # are tests/test_capture.py's)
    "gpt2-shakespeare": ({"n_layer": 1, "n_embd": 32, "n_head": 2, "seq_len": 32, "batch_size": 8,
                          "max_chars": 20000}, {"_FusedSlot", "_ProductSlot"}),
}
STEPS = 3


def corrections_by_slot(monkeypatch) -> collections.Counter:
    """A counter, filled as the auditor replays, of the corrections each kind of slot made (by its class name)."""
    fixed = collections.Counter()
    real = engine.AuditorHalf.replay

    def replay(self, func, slot, entries, phase, c, index):
        before = sum(self.mode.stats.corrections.values())
        real(self, func, slot, entries, phase, c, index)
        fixed[type(slot).__name__] += sum(self.mode.stats.corrections.values()) - before

    monkeypatch.setattr(engine.AuditorHalf, "replay", replay)
    return fixed


@pytest.mark.parametrize("task", sorted(TASKS))
def test_the_compiled_auditor_applies_a_worst_case_trainers_corrections(tmp_path, monkeypatch, task, shakespeare):
    config, kinds = TASKS[task]
    config = dict(config)
    if task.startswith("gpt2"):
        config.update(corpus=shakespeare, tokenizer=shared_file("gpt2-tokenizer"))
    run = tmp_path / "run"
    monkeypatch.setenv("VERITRAIN_EMULATE", "perturb")
    train(TrainOptions(task=task, out=str(run), steps=STEPS, checkpoint_every=STEPS, config=config, progress=False))
    monkeypatch.delenv("VERITRAIN_EMULATE")

    monkeypatch.setenv("VERITRAIN_COMPILE", "1")
    capture._CACHE.clear()
    capture._CALLS.clear()
    fixed = corrections_by_slot(monkeypatch)
    r = audit(str(run), progress=False)
    assert r.accepted, r.reasons
    assert r.suspicious == 0 and all(c["match"] for c in r.checkpoints), r.suspicious_details[:3]
    assert sum(r.corrections.values()) > 0, "the worst-case trainer never crossed a midpoint: the check is vacuous"
    assert {k for k, n in fixed.items() if n} >= kinds, dict(fixed)
    print(task, dict(fixed), {k[0].name(): (v.replays, v.row_replays, v.fallbacks)
                              for k, v in capture._CACHE.items() if isinstance(v, capture.Region)})


WIDE = {"elementwise": 2.0**25, "accumulate": 2.0**25}  # many entries, so many of them corrections


def _inputs():
    g = torch.Generator().manual_seed(4)
    x = torch.rand(256, 300, generator=g) + 0.5
    spread = torch.randn(250, 300, generator=g) * torch.logspace(-12, 12, 300)  # a sum no float64 sum holds exactly
    h, w = torch.randn(24, 56, generator=g), torch.randn(3001, 56, generator=g)  # logits' shape: h @ w^T
    small = [torch.rand(5, 7, generator=g) + 0.5 for _ in range(4)]
    logits = torch.randn(250, 300, generator=g)
    return x, spread, h, w, small, logits


def _ops(x, spread, h, w, small, logits):
    """One op for each of the auditor's compiled slots (at the default VERITRAIN_COMPILE, every tensor but the
    optimizer-like update's is large enough); returns the float32 results."""
    out = [x.exp(), spread.sum(1), torch.mm(h, w.t()), torch.log_softmax(logits, -1)]
    return out + list(torch._foreach_add(small, [t.flip(0) for t in small], alpha=0.37))


def test_each_compiled_slot_applies_a_worst_case_trainers_corrections(tmp_path, monkeypatch):
    """The same, op by op, at thresholds wide enough that every kind of compiled slot gets corrections (fused
    elementwise kernels, compiled sums, a product by blocks of its result, small tensors of a foreach update laid
    end to end, a captured log-softmax): the auditor's results are the trainer's, bit for bit, with nothing
    suspicious. (The NLL loss's picked gradient is one value per call, -1/N: it has no room for corrections.)"""
    from veritrain.engine import EngineConfig, step_context
    from veritrain.logformat import StepLogReader, StepLogWriter

    config = EngineConfig(thresholds=WIDE)
    inputs = _inputs()
    monkeypatch.setenv("VERITRAIN_EMULATE", "perturb")
    w = StepLogWriter(str(tmp_path / "0.vtlog"), 0, 32)
    with step_context(config, 0, writer=w):
        trained = _ops(*inputs)
    w.close()
    monkeypatch.delenv("VERITRAIN_EMULATE")
    monkeypatch.setenv("VERITRAIN_BLOCK_MIN_NUMEL", "0")
    monkeypatch.setattr(blocked, "BLOCK_NUMEL", 1000)
    monkeypatch.setattr(blocked, "RESULT_BLOCK_NUMEL", 1000)
    fixed = corrections_by_slot(monkeypatch)
    with StepLogReader(str(tmp_path / "0.vtlog"), expect_step=0, expect_bits=32) as r:
        with step_context(config, 0, reader=r) as mode:
            audited = _ops(*inputs)
    assert mode.stats.suspicious_count == 0, mode.stats.suspicious[:3]
    assert all(torch.equal(t, u) for t, u in zip(trained, audited))
    assert {k for k, n in fixed.items() if n} >= {"_FusedSlot", "_SumSlot", "_ProductSlot", "_PartSlot"}, dict(fixed)
