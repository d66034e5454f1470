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



LOOP_SCRIPT = '''
import os, sys, torch
from transformers import GPT2Config, GPT2LMHeadModel, TrainingArguments
import veritrain, veritrain.hf

class Seqs(torch.utils.data.Dataset):
    def __len__(self): return 16
    def __getitem__(self, i):
        ids = (torch.arange(12) * (i + 3)) % 64
        return {"input_ids": ids, "labels": ids}

with veritrain.init(seed=0) as init:
    model = GPT2LMHeadModel(GPT2Config(vocab_size=64, n_positions=16, n_embd=16, n_layer=1, n_head=2))
args = TrainingArguments(output_dir="hf-out", max_steps=2, per_device_train_batch_size=8, report_to=[],
                         learning_rate=1e-3, use_cpu=True, save_strategy="no", seed=3,
                         label_smoothing_factor=float(os.environ.get("SMOOTHING", "0")))
trainer = veritrain.hf.Trainer(model=model, args=args, train_dataset=Seqs(), run_dir=sys.argv[1],
                               checkpoint_every=1, init=init)
print(trainer.train().metrics)
'''


def test_a_contract_pinning_the_training_args_pins_the_loss_too(tmp_path):
    """veritrain.hf.Trainer records the TrainingArguments that decide the training; a client's contract pins
    them (with the script's hash). A trainer that trains with label smoothing (a setting its script takes from
    the command line or the environment, here SMOOTHING) changes the loss of every step: the run's committed
    config must say so, so that an audit under the client's contract refuses it, whatever command it ran."""
    import os
    import subprocess
    import sys

    pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    (tmp_path / "hftrain.py").write_text(LOOP_SCRIPT)
    base = {k: v for k, v in os.environ.items() if not k.startswith("VERITRAIN_")}

    def train(run, smoothing):
        p = subprocess.run([sys.executable, "hftrain.py", run], cwd=tmp_path, capture_output=True, text=True,
                           timeout=600, env={**base, "SMOOTHING": smoothing})
        assert p.returncode == 0, p.stderr
        return json.loads((tmp_path / run / "manifest.json").read_text())

    agreed, smoothed = train("agreed", "0"), train("smoothed", "0.3")
    losses = [json.loads((tmp_path / r / "records" / "step_00000000.json").read_text())["loss"]
              for r in ("agreed", "smoothed")]
    assert losses[0] != losses[1]  # another loss: another training
    contract = tmp_path / "contract.json"
    contract.write_text(json.dumps({"format": "veritrain-contract/1", "task": "loop:hftrain.py",
                                    "task_source_sha256": agreed["task_source_sha256"], "config": agreed["config"],
                                    "seed": 3, "steps": 2}))
    # the agreed run passes its contract; the smoothed one, replayed with the trainer's own setting, must not
    p = cli("audit", "agreed", "--contract", contract, "--json", "--quiet", "--", sys.executable, "hftrain.py",
            "agreed", cwd=tmp_path, env={"SMOOTHING": "0"})
    assert p.returncode == 0 and json.loads(p.stdout)["accepted"], p.stderr
    p = cli("audit", "smoothed", "--contract", contract, "--json", "--quiet", "--", sys.executable, "hftrain.py",
            "smoothed", cwd=tmp_path, env={"SMOOTHING": "0.3"})
    assert p.returncode == 1 and "'config'" in p.stderr, (p.returncode, p.stderr[-2000:])
    assert smoothed["config"]["training_args"]["label_smoothing_factor"] == 0.3
