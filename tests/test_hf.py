"""veritrain.hf: a transformers.Trainer (a tiny GPT-2 from a config, no downloads) trained through its own
training step, optimizer and schedule, and audited on other hardware."""

import json

import pytest

from conftest import cli

TASK = '''
import torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments
import veritrain.hf

class Seqs(torch.utils.data.Dataset):
    def __len__(self): return 24
    def __getitem__(self, i):
        ids = (torch.arange(16) * (i + 3)) % 64
        return {"input_ids": ids, "labels": ids}

DEFAULTS = {"lr": 1e-3, "accumulate": 1}

def make_task(config):
    model = GPT2LMHeadModel(GPT2Config(vocab_size=64, n_positions=32, n_embd=32, n_layer=1, n_head=2))
    args = TrainingArguments(output_dir="hf-out", max_steps=6, per_device_train_batch_size=8, report_to=[],
                             learning_rate=config["lr"], gradient_accumulation_steps=config["accumulate"],
                             use_cpu=True, save_strategy="no")
    return veritrain.hf.task(Trainer(model=model, args=args, train_dataset=Seqs()))
'''


@pytest.fixture(scope="module")
def hf_run(tmp_path_factory):
    pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    d = tmp_path_factory.mktemp("hf")
    (d / "hftask.py").write_text(TASK)
    env = {"PYTHONPATH": str(d)}
    cli("train", "hftask:make_task", "--out", d / "run", "--steps", 6, "--checkpoint-every", 3, "--quiet",
        env=env, cwd=d, check=0)
    return d, env


def test_a_trainer_trains_and_audits_on_other_hardware(hf_run):
    d, env = hf_run
    m = json.loads((d / "run" / "manifest.json").read_text())
    assert m["complete"] and m["task"] == "hftask:make_task"
    records = [json.loads((d / "run" / "records" / f"step_{s:08d}.json").read_text()) for s in range(6)]
    assert sorted(i for r in records[:3] for i in r["batch_indices"]) == list(range(24))  # one shuffled epoch
    p = cli("audit", d / "run", "--task", "hftask:make_task", "--variant", "isa-default", "--json", "--quiet",
            env=env, cwd=d)
    r = json.loads(p.stdout)
    assert p.returncode == 0 and r["accepted"] and [c["match"] for c in r["checkpoints"]] == [True, True], r


def test_gradient_accumulation_is_refused_with_its_reason(hf_run, tmp_path):
    d, env = hf_run
    p = cli("train", "hftask:make_task", "--out", tmp_path / "acc", "--steps", 2, "--set", "accumulate=2",
            "--quiet", env=env, cwd=d)
    assert p.returncode == 2 and "gradient_accumulation_steps" in p.stderr, p.stderr

