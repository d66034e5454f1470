"""Honest corrections through the auditor's compiled paths.

Between this project's CPU variants the log almost never corrects a rounding, and the auditors that really
disagree with the trainer (tests/test_disagreeing_hardware.py) run under the emulated accelerator, where every
compiled path is off: so the paths an auditor on a CPU takes with its kernels on (fused elementwise ops and
sums, the round-and-scan epilogues, blocked matrix products, captured regions and their rows' runs) had never
been given an honest entry that contradicts their own rounding. That is what a CPU auditor meets when it
audits a GPU trainer.

Here the trainer runs on the worst hardware the error model allows (``perturb``: every approximate result moved
by up to 0.9 of its threshold) and the auditor on this CPU with every compiled path forced on for every size
(VERITRAIN_COMPILE=1). It must accept, with every checkpoint bit for bit and nothing suspicious, after
corrections made by the compiled paths' slots, not only by the eager engine's.
"""

import collections

import pytest

from conftest import shared_file
from veritrain import capture, engine
from veritrain.runner import TrainOptions, audit, train

TASKS = {  # task, its settings (small sizes), the slot kinds whose corrections the audit must make
    "digits-cnn": ({}, {"_EagerSlot"}),
    "resnet-cifar10": ({"data": "digits", "width": 8, "batch_size": 16}, {"_FusedSlot", "_EagerSlot"}),
    # the GPT-2 vocabulary (50257): blocked products, the vocabulary-wide sums, the log-softmax's rows
    "gpt2-shakespeare": ({"n_layer": 1, "n_embd": 32, "n_head": 2, "seq_len": 32, "batch_size": 8,
                          "max_chars": 20000}, {"_FusedSlot", "_ProductSlot"}),
}
STEPS = 3


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
    fixed = collections.Counter()
    real = engine.VerifiedMode._replay

    def replay(self, func, slot, entries, phase, c, index):
        before = sum(self.stats.corrections.values())
        real(self, func, slot, entries, phase, c, index)
        fixed[type(slot).__name__] += sum(self.stats.corrections.values()) - before

    monkeypatch.setattr(engine.VerifiedMode, "_replay", replay)
    r = audit(str(run), progress=False)
    assert r.accepted, r.reasons
    assert r.suspicious == 0 and all(c["match"] for c in r.checkpoints), r.suspicious_details[:3]
    assert sum(r.corrections.values()) > 0, "the worst-case trainer never crossed a midpoint: the check is vacuous"
    assert {k for k, n in fixed.items() if n} >= kinds, dict(fixed)
    print(task, dict(fixed), {k[0].name(): (v.replays, v.row_replays, v.fallbacks)
                              for k, v in capture._CACHE.items() if isinstance(v, capture.Region)})
