"""The run store: commitments in the manifest, integrity checks of every file, crash-safe resume, audits
of chosen intervals that can be split and restarted, and inspect's JSON."""

import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import time

import pytest

from conftest import cli
from veritrain import store
from veritrain.runner import TrainOptions, audit, train
from veritrain.store import RunError, ckpt_name, load_manifest, log_name, record_name, verify

STEPS, EVERY = 6, 2


@pytest.fixture(scope="module")
def pristine(tmp_path_factory):
    run = tmp_path_factory.mktemp("store") / "run"
    train(TrainOptions(task="digits-cnn", out=str(run), steps=STEPS, checkpoint_every=EVERY, progress=False))
    return run


@pytest.fixture()
def run(pristine, tmp_path):
    copy = tmp_path / "run"
    shutil.copytree(pristine, copy)
    return copy


def test_manifest_commits_to_a_root_over_one_leaf_per_interval(pristine):
    m = load_manifest(str(pristine))
    assert m["complete"] and len(m["leaves"]) == STEPS // EVERY and len(m["root"]) == 64
    assert [c["step"] for c in m["checkpoints"]] == [0, 2, 4, 6]
    r = verify(str(pristine))
    assert r["ok"], r["problems"]
    assert r["root"] == m["root"]
    p = cli("verify", pristine, check=0)
    assert "consistent" in p.stdout
    assert cli("verify", pristine, "--root", "ab" * 32).returncode == 1


def flip_byte(path, where=0.5):
    data = bytearray(path.read_bytes())
    i = int(len(data) * where)
    data[i] ^= 0x01
    path.write_bytes(bytes(data))


CORRUPTIONS = {
    "checkpoint": ckpt_name(4), "log": log_name(3), "record": record_name(1), "manifest": "manifest.json",
}


@pytest.mark.parametrize("kind", ["flip", "delete", "truncate"])
@pytest.mark.parametrize("what", sorted(CORRUPTIONS))
def test_verify_names_a_damaged_file_and_audit_refuses_it(run, what, kind):
    name = CORRUPTIONS[what]
    path = run / name
    if kind == "flip":
        flip_byte(path, 0.9 if what == "checkpoint" else 0.5)
    elif kind == "delete":
        path.unlink()
    else:
        path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    if name == "manifest.json" and kind == "delete":  # no manifest: not a run folder at all (unusable input)
        for command in ("verify", "audit"):
            p = cli(command, run)
            assert p.returncode == 2 and "has no manifest.json" in p.stderr
        return
    p = cli("verify", run, "--json")
    assert p.returncode == 1, p.stderr  # a damaged run is a rejected run (2 is for input the auditor cannot use)
    r = json.loads(p.stdout)
    assert not r["ok"] and any(x["file"] == name for x in r["problems"]), r["problems"]
    a = cli("audit", run, "--json", "--quiet")
    assert a.returncode == 1, a.stderr
    r = json.loads(a.stdout)
    assert not r["accepted"]
    assert any(os.path.basename(name) in x or "data record" in x or "differ" in x or "manifest" in x
               for x in r["reasons"]), r["reasons"]


def test_audit_of_chosen_or_sampled_intervals(pristine, tmp_path):
    r = audit(str(pristine), progress=False, intervals="0,2")
    assert r.accepted and [i["interval"] for i in r.intervals] == [0, 2] and r.steps == 4
    r = audit(str(pristine), progress=False, sample=2, sample_seed=5)
    assert r.accepted and len(r.intervals) == 2
    assert [i["interval"] for i in r.intervals] == [i["interval"] for i in
                                                   audit(str(pristine), progress=False, sample=2, sample_seed=5).intervals]
    with pytest.raises(RunError, match="intervals 0..2"):
        audit(str(pristine), progress=False, intervals="7")
    assert cli("audit", pristine, "--intervals", "1-2", "--quiet", check=0)


def _wait_for(path, proc, timeout=300):
    t0 = time.time()
    while not os.path.exists(path):
        assert proc.poll() is None, proc.stderr.read() if proc.stderr else "process ended"
        assert time.time() - t0 < timeout
        time.sleep(0.05)


def test_train_killed_mid_run_resumes_to_the_same_root(pristine, tmp_path):
    steps = 9
    ref = tmp_path / "ref"
    train(TrainOptions(task="digits-cnn", out=str(ref), steps=steps, checkpoint_every=3, progress=False))
    run = tmp_path / "killed"
    kill_after = random.Random().randint(1, steps - 2)
    proc = subprocess.Popen([sys.executable, "-m", "veritrain.cli", "train", "digits-cnn", "--out", str(run),
                             "--steps", str(steps), "--checkpoint-every", "3", "--quiet"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    _wait_for(run / record_name(kill_after), proc)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    m = load_manifest(str(run))
    assert not m["complete"], "killed too late"
    p = cli("audit", run, "--quiet")
    assert p.returncode == 1 and "incomplete" in p.stderr  # an unfinished run is rejected, not unusable input
    cli("train", "digits-cnn", "--out", run, "--resume", "--quiet", check=0)
    assert load_manifest(str(run))["root"] == load_manifest(str(ref))["root"], f"killed after step {kill_after}"
    assert verify(str(run))["ok"]
    p = cli("train", "digits-cnn", "--out", run, "--resume")
    assert p.returncode == 2 and "complete run" in p.stderr


def test_an_auditor_killed_and_restarted_keeps_what_it_verified(pristine, tmp_path):
    out = tmp_path / "audit"
    proc = subprocess.Popen([sys.executable, "-m", "veritrain.cli", "audit", str(pristine), "--out", str(out),
                             "--quiet"], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    _wait_for(out / "audit.json", proc)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    before = json.loads((out / "audit.json").read_text())
    verified = {r["interval"] for r in before["intervals"]}
    assert verified
    p = cli("audit", pristine, "--out", out, "--json", "--quiet", check=0)
    r = json.loads(p.stdout)
    assert r["accepted"] and [i["interval"] for i in r["intervals"]] == [0, 1, 2]
    assert {i["interval"] for i in r["intervals"] if i["resumed"]} == verified
    other = tmp_path / "other"
    train(TrainOptions(task="digits-cnn", out=str(other), steps=2, checkpoint_every=1, progress=False))
    p = cli("audit", other, "--out", out, "--quiet")
    assert p.returncode == 2 and "another run" in p.stderr


def test_inspect_json(pristine, tmp_path):
    r = json.loads(cli("inspect", pristine, "--json", check=0).stdout)
    m = load_manifest(str(pristine))
    assert r["root"] == m["root"] and r["steps"] == STEPS and r["final_state_hash"] == m["checkpoints"][-1]["state_sha256"]
    assert r["log_bytes_total"] == sum((pristine / log_name(s)).stat().st_size for s in range(STEPS))
    assert r["rounded_values_total"] > 0 and r["dense_encoding_bytes_total"] == r["rounded_values_total"] * 1.6 / 8
    assert r["log_bytes_total"] < r["dense_encoding_bytes_total"]
    assert set(r["entries"]) == {"direction", "value", "scalar"}
    out = tmp_path / "audit"
    cli("audit", pristine, "--out", out, "--quiet", "--variant", "threads-1", check=0)
    a = json.loads(cli("inspect", out, "--json", check=0).stdout)
    assert a["kind"] == "audit" and a["intervals_matching"] == 3 and a["suspicious"] == 0
    assert a["corrections_total"] >= 0


@pytest.mark.parametrize("how", ["task", "micro-batches", "own loop"])
def test_an_intervals_files_are_synced_together_before_its_commit(tmp_path, monkeypatch, how):
    """A step's log and data record are written without an fsync each (a temporary name and a rename) and
    made durable together (store.sync_files) before the manifest commits to their interval: when the manifest
    names an interval, every log and record of its steps has been synced, and no fsync touched them before."""
    import torch

    from veritrain import store

    out = str(tmp_path / "run")
    synced, problems, commits = set(), [], []
    real_fsync, real_sync_files, real_save = os.fsync, store.sync_files, store.save_manifest
    inside = []

    def per_step(p):  # the initial state's log is committed with checkpoint 0, when written
        return any(f"{os.sep}{d}{os.sep}" in p for d in ("logs", "records")) and "init.vtlog" not in p

    def fsync(fd):
        p = os.readlink(f"/proc/self/fd/{fd}")
        if per_step(p):
            if not inside:
                problems.append(f"an fsync of {p} as it was written")
            synced.add(p)
        real_fsync(fd)

    def sync_files(paths):
        inside.append(1)
        try:
            real_sync_files(paths)
        finally:
            inside.pop()

    def save_manifest(run_dir, m):
        done = m.get("steps_completed", 0)
        names = [log_name(s) for s in range(done)] + [record_name(s) for s in range(done)]
        names += [store.micro_log_name(s, g) for s in range(done) for g in range(2)] if how == "micro-batches" else []
        for name in names:
            p = os.path.realpath(os.path.join(run_dir, name))
            if p not in synced:
                problems.append(f"{name} not synced when the manifest committed step {done}")
        commits.append(done)
        real_save(run_dir, m)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(store, "sync_files", sync_files)
    monkeypatch.setattr(store, "save_manifest", save_manifest)
    if how == "own loop":
        from veritrain.loop import Run, init

        with init(seed=0) as built:
            model = torch.nn.Linear(4, 2)
            opt = torch.optim.SGD(model.parameters(), lr=0.1)
        run = Run(out, model, opt, checkpoint_every=EVERY, quiet=True, init=built)
        for step, x in run.steps(lambda step: torch.randn(3, 4, generator=torch.Generator().manual_seed(step)), STEPS):
            with run.step(x) as s:
                loss = model(x).square().mean()
                loss.backward(); opt.step(); opt.zero_grad()
                s.loss = loss
    else:
        train(TrainOptions(task="digits-cnn", out=out, steps=STEPS, checkpoint_every=EVERY, progress=False,
                           micro_batches=2 if how == "micro-batches" else 1))
    assert not problems, problems[:5]
    assert [c for c in commits if c] and max(commits) == STEPS
    r = verify(out)
    assert r["ok"], r["problems"]


def test_an_own_loop_built_without_veritrain_init_verifies(tmp_path):
    """Its manifest commits to no initialisation log (init_log_sha256 null) and the run has none: verify
    checks the files the manifest commits to, not one it says does not exist."""
    import torch

    from veritrain.loop import Run

    out = str(tmp_path / "run")
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    run = Run(out, model, opt, checkpoint_every=EVERY, quiet=True)
    for step, x in run.steps(lambda step: torch.randn(3, 4, generator=torch.Generator().manual_seed(step)), STEPS):
        with run.step(x) as s:
            loss = model(x).square().mean()
            loss.backward(); opt.step(); opt.zero_grad()
            s.loss = loss
    assert load_manifest(out)["init_log_sha256"] is None
    r = verify(out)
    assert r["ok"], r["problems"]


def test_the_recorded_versions_do_not_import_transformers():
    """A run records transformers' version from its installed metadata: importing it cost 0.8 s of every run of
    a task that does not use it (a fresh process: the suite's own may have imported it)."""
    transformers = pytest.importorskip("transformers")
    code = ("import sys, json; from veritrain.runner import versions; v = versions(); "
            "print(json.dumps([v.get('transformers'), 'transformers' in sys.modules]))")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    assert json.loads(p.stdout) == [transformers.__version__, False]


def _flip_last_checkpoint(run, m):
    path = run / m["checkpoints"][-1]["file"]
    data = bytearray(path.read_bytes())
    data[-3] ^= 0xFF
    path.write_bytes(bytes(data))


def _last_checkpoint_is(content):
    def edit(run, m):
        path = run / m["checkpoints"][-1]["file"]
        path.write_bytes(content(run))
        m["checkpoints"][-1]["file_sha256"] = store.file_sha256(str(path))
    return edit


@pytest.mark.parametrize("edit, task, words", [
    (lambda run, m: m.update(task_source_sha256="0" * 64), "digits-cnn",
     "the source of task digits-cnn changed since the run started; resume with the same code"),
    (_flip_last_checkpoint, "digits-cnn", "the run's last committed checkpoint, is altered; cannot resume"),
    (lambda run, m: os.remove(run / m["checkpoints"][-1]["file"]), "digits-cnn",
     "the run's last committed checkpoint, does not exist; cannot resume"),
    (_last_checkpoint_is(lambda run: b"not a checkpoint"), "digits-cnn", "is unreadable or not a veritrain checkpoint"),
    (_last_checkpoint_is(lambda run: (run / ckpt_name(0)).read_bytes()), "digits-cnn",
     "does not hold the committed state; cannot resume"),
    (lambda run, m: None, "resnet-cifar10", "is a run of task 'digits-cnn', not 'resnet-cifar10'"),
], ids=["another task source", "an altered checkpoint", "no checkpoint", "a checkpoint that is not one",
        "another step's checkpoint", "another task"])
def test_resume_refuses_a_run_it_cannot_continue_from_its_commitments(pristine, tmp_path, edit, task, words):
    """A run is resumed from its last committed checkpoint, with the code and task it started with: a file that
    is not that checkpoint (altered, missing, not one, another state with its file hash updated), another task
    source or another task is refused by name before anything is trained or overwritten. Each case fails with
    its check dropped."""
    run = tmp_path / "run"
    shutil.copytree(pristine, run)
    m = load_manifest(str(run))
    m["complete"] = False  # as a killed trainer leaves it
    edit(run, m)
    store.save_manifest(str(run), m)
    before = {p: p.read_bytes() for p in run.rglob("*") if p.is_file()}
    with pytest.raises(RunError, match=re.escape(words)):
        train(TrainOptions(task=task, out=str(run), resume=True, progress=False))
    assert {p: p.read_bytes() for p in run.rglob("*") if p.is_file()} == before


@pytest.mark.parametrize("opts, words", [
    (dict(steps=-1), "--steps must be >= 0 and --checkpoint-every > 0"),
    (dict(checkpoint_every=0), "--steps must be >= 0 and --checkpoint-every > 0"),
    (dict(micro_batches=0), "--micro-batches must be in 1..4096, got 0"),
    (dict(micro_batches=4097), "--micro-batches must be in 1..4096, got 4097"),
])
def test_train_refuses_a_schedule_no_run_can_have(tmp_path, opts, words):
    with pytest.raises(RunError, match=re.escape(words)):
        train(TrainOptions(task="digits-cnn", out=str(tmp_path / "run"), progress=False, **opts))
    assert not (tmp_path / "run").exists()


def test_audit_options_and_progress_that_cannot_be_used_are_named(pristine, tmp_path):
    from veritrain.runner import parse_intervals, sample_intervals

    for spec in ("x", "1-", "3,a"):
        with pytest.raises(RunError, match=re.escape(f"--intervals {spec!r}: expected indices and ranges like 3,5-7")):
            parse_intervals(spec, 4)
    with pytest.raises(RunError, match="--sample must be positive"):
        sample_intervals(0, 1, 4)
    out = tmp_path / "audit"
    out.mkdir()
    (out / "audit.json").write_text("{not json")
    with pytest.raises(RunError, match="audit.json is unreadable .*; choose a new --out"):
        audit(str(pristine), str(out), progress=False)
    assert (out / "audit.json").read_text() == "{not json"  # nothing the auditor wrote is lost


def test_verify_names_a_data_record_that_is_not_a_json_object(run):
    (run / record_name(1)).write_bytes(b"[]")
    r = verify(str(run))
    assert not r["ok"] and any(p["file"] == record_name(1) and "unreadable (not a JSON object)" in p["problem"]
                               for p in r["problems"]), r["problems"]


def test_a_leaf_takes_one_record_hash_per_step_of_its_interval():
    """A leaf commits to each step's record: a count that differs from the interval's steps would commit to a
    step range its records do not cover (parse_leaf refuses such data; leaf_data does not write it)."""
    h = "ab" * 32
    data = store.leaf_data(1, 2, 4, bytes(32), h, [h, h])
    assert store.parse_leaf(data)["records"] == [h, h]
    for records in ([h], [h, h, h]):
        with pytest.raises(ValueError, match="one record hash per step of the interval"):
            store.leaf_data(1, 2, 4, bytes(32), h, records)
