"""Your own loop (veritrain.Run): a tiny Hugging Face GPT-2 with an ordinary shuffling DataLoader over two
epochs, trained by a script and audited by running the same script (`veritrain audit RUN -- python train.py`),
fully and in part, on other hardware; and what a lying trainer or a broken loop gets."""

import json
import os
import sys

import pytest

from conftest import cli, recommit

SCRIPT = '''
import os, sys
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset
from transformers import GPT2Config, GPT2LMHeadModel

import veritrain

lr = float(os.environ.get("LR", "1e-3"))
tokens = torch.arange(40 * 17).reshape(40, 17) * 7 % 64          # 40 sequences of 17 tokens
loader = DataLoader(TensorDataset(tokens), batch_size=8, shuffle=True)   # 5 steps per epoch

with veritrain.init(seed=0) as init:
    model = GPT2LMHeadModel(GPT2Config(vocab_size=64, n_positions=32, n_embd=32, n_layer=1, n_head=2))
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)

run = veritrain.Run(sys.argv[1], model, optimizer, seed=0, checkpoint_every=4, init=init, config={"lr": lr})
for step, (batch,) in run.steps(loader, 10):                     # two epochs
    if step == int(os.environ.get("CRASH_AT", "-1")):
        raise SystemExit("crashed on purpose")
    if step == int(os.environ.get("POISON_AT", "-1")):    # a dishonest trainer, outside the engine
        with torch.no_grad():
            model.transformer.h[0].mlp.c_fc.weight.view(-1)[0] += 0.01
    with run.step(batch) as s:
        logits = model(batch[:, :-1]).logits
        loss = F.cross_entropy(logits.reshape(-1, 64).double(), batch[:, 1:].reshape(-1))
        loss.backward(); optimizer.step(); optimizer.zero_grad()
        s.loss = loss
'''


def python(script, *args, env=None, cwd=None):
    import subprocess

    e = {k: v for k, v in os.environ.items() if not k.startswith("VERITRAIN_")}
    e.update(env or {})
    return subprocess.run([sys.executable, str(script), *map(str, args)], capture_output=True, text=True, env=e,
                          cwd=cwd, timeout=600)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    pytest.importorskip("transformers")
    d = tmp_path_factory.mktemp("loop")
    script = d / "train.py"
    script.write_text(SCRIPT)
    p = python(script, d / "run", cwd=d)
    assert p.returncode == 0, p.stderr
    return d, script, d / "run"


def audit(d, run, *flags, script_args=(), env=None):
    p = cli("audit", run, "--json", "--quiet", *flags, "--", sys.executable, d / "train.py", run, *script_args,
            env=env, cwd=d)
    assert p.returncode in (0, 1), p.stderr
    return json.loads(p.stdout), p


def test_the_run_is_an_ordinary_run_folder(trained):
    d, script, run = trained
    m = json.loads((run / "manifest.json").read_text())
    assert m["complete"] and m["task"] == "loop:train.py" and m["steps"] == 10 and m["config"] == {"lr": 0.001}
    assert [c["step"] for c in m["checkpoints"]] == [0, 4, 8, 10] and m["init_log_sha256"]
    records = [json.loads((run / "records" / f"step_{s:08d}.json").read_text()) for s in range(10)]
    # a shuffling DataLoader made step-indexed: each epoch is a permutation of the 40 examples
    for epoch in (0, 1):
        seen = sorted(i for r in records[epoch * 5:(epoch + 1) * 5] for i in r["batch_indices"])
        assert seen == list(range(40))
    assert records[0]["batch_indices"] != records[5]["batch_indices"] and records[0]["loss"] > 0
    assert cli("verify", run, "--task", "loop:train.py", check=0)


@pytest.mark.parametrize("flags", [[], ["--intervals", "1-2"]], ids=["full", "intervals"])
def test_the_same_script_audits_on_other_hardware(trained, flags):
    d, script, run = trained
    r, p = audit(d, run, "--variant", "isa-default", *flags)
    assert r["accepted"], r["reasons"]
    assert [iv["interval"] for iv in r["intervals"]] == ([0, 1, 2] if not flags else [1, 2])
    assert all(c["match"] for c in r["checkpoints"]) and r["steps"] == (10 if not flags else 6)
    assert r["hardware"]["variant"] == "isa-default"


def test_the_log_carries_the_loop_across_the_worst_case_auditor(trained):
    d, script, run = trained
    r, _ = audit(d, run, "--variant", "perturb")
    assert r["accepted"], r["reasons"]
    assert sum(r["corrections"].values()) > 0


def test_other_settings_in_the_auditors_script_are_refused(trained):
    d, script, run = trained
    p = cli("audit", run, "--quiet", "--", sys.executable, d / "train.py", run, env={"LR": "2e-3"}, cwd=d)
    assert p.returncode == 1 and "'config'" in p.stderr and "REJECT" in p.stderr, p.stderr
    assert "Traceback" not in p.stderr, p.stderr


def test_an_edited_script_is_refused(trained, tmp_path):
    d, script, run = trained
    other = tmp_path / "train.py"
    other.write_text(SCRIPT.replace("lr=lr)", "lr=lr, weight_decay=0.0)"))
    p = cli("audit", run, "--quiet", "--", sys.executable, other, run, cwd=tmp_path)
    assert p.returncode == 1 and "task_source_sha256" in p.stderr, p.stderr


def poisoned_copy(run, tmp_path):
    """The trainer nudges one weight in its checkpoint after step 4 and recommits everything (checkpoint
    header, manifest, leaves, root) so that the run is self-consistent."""
    import shutil

    from safetensors.torch import load_file, save_file

    from veritrain import store
    from veritrain.checkpoint import read_checkpoint
    from veritrain.commitments import canonical_json, state_hash

    bad = tmp_path / "run"
    shutil.copytree(run, bad)
    ck = str(bad / "checkpoints" / "step_00000004.safetensors")
    tensors, meta, step, _ = read_checkpoint(ck)
    name = next(k for k in sorted(tensors) if tensors[k].is_floating_point() and tensors[k].numel() > 1)
    tensors = dict(load_file(ck))
    tensors[name] = tensors[name].clone()
    tensors[name].view(-1)[0] += 1e-3
    digest = state_hash(tensors, meta, step)
    save_file(tensors, ck, metadata={"veritrain": canonical_json({"step": step, "meta": meta,
                                                                   "state_sha256": digest}).decode()})
    m = store.load_manifest(str(bad))
    for c in m["checkpoints"]:
        if c["step"] == 4:
            c["state_sha256"], c["file_sha256"] = digest, store.file_sha256(ck)
    store.save_manifest(str(bad), m)
    recommit(bad)
    return bad


def test_poisoned_weights_recommitted_are_rejected(trained, tmp_path):
    """The replay of interval 0 ends elsewhere than the poisoned checkpoint."""
    d, script, run = trained
    r, _ = audit(d, poisoned_copy(run, tmp_path))
    assert not r["accepted"] and r["intervals"][0]["match"] is False, r
    assert any("checkpoint after step 4" in reason for reason in r["reasons"]), r["reasons"]


def test_a_loop_run_claiming_micro_batches_is_refused(trained, tmp_path):
    """The trainer adds micro_batches = 2 to its own loop's manifest and recommits (leaves, root): the loop's
    audit, whose replay reads one batch per step, accepted the run while `verify` found it inconsistent."""
    import shutil

    from veritrain import store

    d, script, run = trained
    bad = tmp_path / "run"
    shutil.copytree(run, bad)
    m = store.load_manifest(str(bad))
    m["micro_batches"] = 2
    store.save_manifest(str(bad), m)
    recommit(bad)
    r, p = audit(d, bad)
    assert p.returncode == 1 and not r["accepted"], r
    assert any("'micro_batches' is 2" in reason for reason in r["reasons"]), r["reasons"]


def test_an_altered_manifest_gets_a_verdict(trained, tmp_path):
    """A manifest edited without its digest: veritrain.init in the auditor's script raised, and the audit
    stopped with exit 2 and no verdict (the task path rejects the same folder)."""
    import shutil

    d, script, run = trained
    bad = tmp_path / "run"
    shutil.copytree(run, bad)
    m = json.loads((bad / "manifest.json").read_text())
    m["created"] = "yesterday"
    (bad / "manifest.json").write_text(json.dumps(m))
    r, p = audit(d, bad)
    assert p.returncode == 1 and r["refused"] and not r["accepted"], r
    assert any("manifest.json is altered" in reason for reason in r["reasons"]), r["reasons"]


def test_a_killed_loop_resumes_to_the_same_root(trained, tmp_path):
    d, script, run = trained
    p = python(script, tmp_path / "run", env={"CRASH_AT": "6"}, cwd=d)
    assert p.returncode != 0 and "crashed on purpose" in p.stderr
    m = json.loads((tmp_path / "run" / "manifest.json").read_text())
    assert not m["complete"] and m["steps_completed"] == 4
    p = python(script, tmp_path / "run", cwd=d)
    assert p.returncode == 0 and "resuming" in p.stderr, p.stderr
    assert json.loads((tmp_path / "run" / "manifest.json").read_text())["root"] == \
        json.loads((run / "manifest.json").read_text())["root"]


BROKEN = '''
import sys, torch
import veritrain
from torch.utils.data import DataLoader, Dataset

class Noisy(Dataset):  # augmentation from torch's global RNG: hidden state
    def __len__(self): return 16
    def __getitem__(self, i): return torch.full((3,), float(i)) + torch.rand(3)

model = torch.nn.Linear(3, 1); optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
run = veritrain.Run(sys.argv[1], model, optimizer, checkpoint_every=2)
data = DataLoader(Noisy(), batch_size=4, shuffle=False) if sys.argv[2] == "noisy" else (lambda step: torch.ones(4, 3))
for step, batch in run.steps(data, 4):
    if sys.argv[2] == "outside":
        model(batch).sum().backward(); optimizer.step(); optimizer.zero_grad()
        continue
    with run.step(batch):
        model(batch).sum().backward(); optimizer.step(); optimizer.zero_grad()
'''


@pytest.mark.parametrize("case,message", [("noisy", "hidden state"), ("outside", "with run.step(batch)")])
def test_a_broken_loop_is_refused_at_train_time(tmp_path, case, message):
    script = tmp_path / "broken.py"
    script.write_text(BROKEN)
    p = python(script, tmp_path / "run", case, cwd=tmp_path)
    assert p.returncode != 0 and message in p.stderr, p.stderr
    assert not json.loads((tmp_path / "run" / "manifest.json").read_text())["complete"]


def test_the_game_replays_the_script_and_blames_a_recommitted_checkpoint(trained, tmp_path):
    """The dispute runs the auditor's script too (`veritrain dispute RUN AUDIT -- python train.py`); the run
    folder answers as the prover, whose honest replay of the trainer's files does not end in its leaf."""
    d, script, run = trained
    bad = poisoned_copy(run, tmp_path)
    p = cli("audit", bad, "--out", tmp_path / "audit", "--quiet", "--intervals", "0", "--", sys.executable,
            d / "train.py", bad, cwd=d)
    assert p.returncode == 1, p.stderr
    p = cli("dispute", bad, tmp_path / "audit", "--json", "--", sys.executable, d / "train.py", bad, cwd=d)
    v = json.loads(p.stdout)
    assert p.returncode == 1 and v["verdict"] == "trainer_wrong" and v["interval"] == 0, v
    assert "its leaf commits to" in " ".join(v["reasons"]), v
    # without the script, the run is named as an own loop's: no module named after the script is imported
    for flags in ([], ["--task", "loop:train.py"]):
        p = cli("dispute", bad, tmp_path / "audit", *flags, cwd=d)
        assert p.returncode == 2 and "-- python train.py" in p.stderr, p.stderr


def test_a_wrong_audit_is_the_auditors_fault(trained, tmp_path):
    """An audit whose leaf for interval 1 is wrong (the auditor's machine erred) against the honest run: the
    referee must not be talked into blaming the trainer."""
    d, script, run = trained
    p = cli("audit", run, "--out", tmp_path / "audit", "--quiet", "--", sys.executable, d / "train.py", run, cwd=d)
    assert p.returncode == 0, p.stderr
    state = json.loads((tmp_path / "audit" / "audit.json").read_text())
    state["leaves"]["1"] = "00" * 32
    (tmp_path / "audit" / "audit.json").write_text(json.dumps(state))
    p = cli("dispute", run, tmp_path / "audit", "--json", "--", sys.executable, d / "train.py", run, cwd=d)
    v = json.loads(p.stdout)
    assert v["verdict"] == "auditor_wrong" and v["interval"] == 1, (v["reasons"], v.get("step"))


def test_the_game_finds_the_step_and_operator_a_trainer_tampered_with(trained, tmp_path):
    """The trainer nudged a weight before step 5, outside the engine, and serves its run with the same tampering
    script (`veritrain serve RUN -- python train.py`): its answers are consistent with its root. The game
    narrows to step 5 and the first operator that reads the nudged weight; the referee rules."""
    import subprocess

    d, script, run = trained
    bad = tmp_path / "run"
    p = python(script, bad, env={"POISON_AT": "5"}, cwd=d)
    assert p.returncode == 0, p.stderr
    p = cli("audit", bad, "--out", tmp_path / "audit", "--quiet", "--", sys.executable, d / "train.py", bad, cwd=d)
    assert p.returncode == 1, p.stderr
    env = {k: v for k, v in os.environ.items() if not k.startswith("VERITRAIN_")}
    server = subprocess.Popen([sys.executable, "-m", "veritrain.cli", "serve", str(bad), "--port", "0", "--",
                               sys.executable, str(d / "train.py"), str(bad)], env={**env, "POISON_AT": "5"}, cwd=d,
                              stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                              preexec_fn=_sigint_default)
    try:
        line = server.stdout.readline()
        assert "http://" in line, line
        url = line.strip().split(" on ")[-1]
        p = cli("dispute", url, tmp_path / "audit", "--json", "--variant", "isa-default", "--", sys.executable,
                d / "train.py", bad, cwd=d)
        v = json.loads(p.stdout)
    finally:
        server.kill()
        server.wait(timeout=30)
    assert p.returncode == 1 and v["verdict"] == "trainer_wrong", v
    assert (v["interval"], v["step"], v["operator"], v["module"]) == \
        (1, 5, "aten.addmm.default", "transformer.h.0.mlp.c_fc"), v
    assert "c_fc.weight" in v["ruling"] and "state before the step is agreed" in v["ruling"], v
    assert v["referee_ops"] == 1 and v["hardware"]["variant"] == "isa-default"  # the auditor on other hardware


def _sigint_default():
    import signal

    signal.signal(signal.SIGINT, signal.SIG_DFL)


def test_the_games_views_of_the_one_model_keep_their_own_states():
    """In a dispute against the run folder, the challenger's replays and the local prover's share the script's
    one model: each must find its own state again after the other ran (loop._SharedState)."""
    import torch

    from veritrain.checkpoint import hash_state
    from veritrain.loop import _LoopTask, _SharedState, _StepBridge

    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    shared = _SharedState((model, optimizer, None))
    initial = hash_state(model, optimizer, None, 0)
    a = _LoopTask(shared, _StepBridge(), lambda s: torch.ones(1, 3), None, None)
    model(torch.ones(1, 3)).sum().backward()
    optimizer.step()                                   # a moves on
    moved = hash_state(model, optimizer, None, 0)
    b = _LoopTask(shared, _StepBridge(), lambda s: torch.ones(1, 3), None, None)
    assert hash_state(model, optimizer, None, 0) == initial      # b starts from the script's initial state
    with torch.no_grad():
        model.weight.add_(1.0)                         # b moves elsewhere
    a.hold()
    assert hash_state(model, optimizer, None, 0) == moved
    b.hold()
    assert hash_state(model, optimizer, None, 0) not in (initial, moved)


CANCELLING_INIT = '''
import sys, torch
import veritrain

with veritrain.init(seed=0) as init:
    model = torch.nn.Linear(16, 16)
    a, b, e, f = torch.randn(16, 8), torch.randn(8, 16), 1e-4 * torch.randn(16, 1), 1e-3 * torch.randn(1, 16)
    with torch.no_grad():  # sums that nearly cancel: results near 1e-7 of terms near 1, their last bits open
        model.weight += torch.cat([a, -a, e], 1) @ torch.cat([b, b, f], 0)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
run = veritrain.Run(sys.argv[1], model, optimizer, seed=0, checkpoint_every=1, init=init)
for step, batch in run.steps(lambda s: torch.ones(2, 16), 0):
    with run.step(batch):
        pass
'''


def test_the_initial_state_is_checked_with_the_policys_thresholds(tmp_path):
    """A contract's threshold ceilings bound every rounding choice, the initial weights' included (on the task
    path the auditor builds the task under the admitted thresholds, AdmittedRun.engine). The script's
    construction here holds 256 value entries (exact zeros of a cancelling product), each needed only under
    the default thresholds; the trainer's manifest declares thresholds within the client's ceilings (1e-3),
    recommitted. veritrain.init under audit replayed the initialisation log with the default thresholds and
    accepted it: the initial weights had the default thresholds' freedom, whatever the contract allowed."""
    d = tmp_path
    (d / "train.py").write_text(CANCELLING_INIT)
    p = python(d / "train.py", d / "run", cwd=d)
    assert p.returncode == 0, p.stderr
    from veritrain import store

    m = store.load_manifest(str(d / "run"))
    tiny = {k: 1e-3 for k in m["thresholds"]}
    m["thresholds"] = tiny
    store.save_manifest(str(d / "run"), m)
    recommit(d / "run")
    contract = d / "contract.json"
    contract.write_text(json.dumps({"format": "veritrain-contract/1", "thresholds": tiny}))
    r, p = audit(d, d / "run", "--contract", contract, "--out", d / "audit")
    assert not r["accepted"] and p.returncode == 1, r
    assert any("initial state: 256 suspicious entries" in x for x in r["reasons"]), r["reasons"]
    # and the game's challenger replays the log under the same thresholds: the trainer loses, for those entries
    p = cli("dispute", d / "run", d / "audit", "--contract", contract, "--json", "--", sys.executable,
            d / "train.py", d / "run", cwd=d)
    v = json.loads(p.stdout)
    assert v["verdict"] == "trainer_wrong" and "256 suspicious entries" in v["ruling"], (v, p.stderr[-2000:])
    r, _ = audit(d, d / "run")  # without the contract: the run's own (smaller) thresholds, all the same
    assert not r["accepted"] and any("initial state: 256 suspicious" in x for x in r["reasons"]), r["reasons"]


def test_the_game_on_a_loops_initial_state_blames_the_side_that_is_wrong(tmp_path):
    """A dispute about an own loop's initial state: the challenger's script has built it under veritrain.init
    with the prover's initialisation log; the referee's build of the task (a view of that state) replayed
    the log once more against nothing, found it unread and ruled `trainer_wrong` for every such dispute,
    the honest trainer's included (an audit that wrongly claimed other initial weights)."""
    d = tmp_path
    (d / "train.py").write_text(CANCELLING_INIT)
    p = python(d / "train.py", d / "run", cwd=d)
    assert p.returncode == 0, p.stderr
    r, _ = audit(d, d / "run", "--out", d / "audit")
    assert r["accepted"], r["reasons"]
    saved = json.loads((d / "audit" / "audit.json").read_text())
    saved["initial_state_reasons"] = ["initial state: this script's model hashes to 0000…, the run commits to "
                                      "1111… (a wrong audit)"]
    (d / "audit" / "audit.json").write_text(json.dumps(saved))
    p = cli("dispute", d / "run", d / "audit", "--json", "--", sys.executable, d / "train.py", d / "run", cwd=d)
    v = json.loads(p.stdout)
    assert v["verdict"] == "auditor_wrong", (v, p.stderr[-2000:])


def test_an_own_loop_declares_smaller_thresholds_and_passes_a_contract_with_smaller_ceilings(tmp_path):
    """A client's contract may set smaller threshold ceilings than the defaults. An own loop had no way to
    train under them (Run and init took no thresholds and recorded the defaults), so the auditor refused every
    honest own-loop run under such a contract. Now the script gives them to both, and init and Run must agree."""
    d = tmp_path
    script = CANCELLING_INIT.replace("import veritrain\n", "import json, os, veritrain\n"
                                     "T = json.loads(os.environ.get('T', 'null'))\nI = json.loads(os.environ.get('I', 'null'))\n")
    script = script.replace("veritrain.init(seed=0)", "veritrain.init(seed=0, thresholds=I or T)")
    script = script.replace("checkpoint_every=1, init=init)", "checkpoint_every=1, init=init, thresholds=T)")
    (d / "train.py").write_text(script)
    from veritrain import rules

    small = {k: v / 4 for k, v in rules.DEFAULT_THRESHOLDS.items()}
    contract = d / "contract.json"
    contract.write_text(json.dumps({"format": "veritrain-contract/1", "thresholds": small}))
    p = python(d / "train.py", d / "default", cwd=d)
    assert p.returncode == 0, p.stderr
    r, _ = audit(d, d / "default", "--contract", contract)  # the defaults: beyond the contract's ceilings
    assert not r["accepted"] and r["refused"] and any("thresholds" in x for x in r["reasons"]), r
    p = python(d / "train.py", d / "small", env={"T": json.dumps(small)}, cwd=d)
    assert p.returncode == 0, p.stderr
    assert json.loads((d / "small" / "manifest.json").read_text())["thresholds"] == small
    r, _ = audit(d, d / "small", "--contract", contract, env={"T": json.dumps(small)})
    assert r["accepted"], r["reasons"]
    p = python(d / "train.py", d / "mixed", env={"T": json.dumps(small), "I": json.dumps(rules.DEFAULT_THRESHOLDS)},
               cwd=d)
    assert p.returncode != 0 and "veritrain.init used other thresholds than the run's" in p.stderr, p.stderr
    p = python(d / "train.py", d / "bad", env={"T": json.dumps({"elementwise": -1.0})}, cwd=d)
    assert p.returncode != 0 and "thresholds: threshold for class 'elementwise' must be a positive" in p.stderr
