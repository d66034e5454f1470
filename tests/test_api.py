"""The Python API: train, audit, verify, inspect and dispute as functions with typed results, and a task
given as a name, a function (importable or not) or a built Task."""

import pytest
import torch

import veritrain
from veritrain.store import RunRejected
from veritrain.tasks.digits_cnn import make_task as digits



def make_task(config):  # an importable task function: its reference is test_api:make_task
    return digits(config)


def test_every_public_name_is_there_and_lazy():
    import subprocess
    import sys

    code = "import sys, veritrain; print('torch' in sys.modules, sorted(veritrain.__all__))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.startswith("False")
    for name in veritrain.__all__:
        assert getattr(veritrain, name) is not None


def test_train_audit_verify_inspect_with_a_task_function(tmp_path):
    out = str(tmp_path / "run")
    r = veritrain.train(make_task, out, steps=4, checkpoint_every=2)
    assert isinstance(r, veritrain.TrainResult) and r.task == "test_api:make_task" and r.steps == 4
    assert r.as_dict()["root"] == r.root and "veritrain audit" in r.next_command
    a = veritrain.audit(out, task=make_task, intervals=[1])
    assert isinstance(a, veritrain.AuditResult) and a.accepted and a.root == r.root and a.steps == 2
    v = veritrain.verify(out, task=make_task)
    assert v.ok and v.complete and v.root == r.root and v.as_dict()["steps"] == 4
    i = veritrain.inspect(out)
    assert i.kind == "run" and i["steps"] == 4 and i.as_dict()["root"] == r.root
    # the default policy audits only built-in tasks: a run naming other code is refused, not imported
    with pytest.raises(RunRejected, match="task"):
        veritrain.audit(out)
    assert not veritrain.verify(out).ok


def test_a_function_that_cannot_be_imported_and_a_built_task(tmp_path):
    closure = lambda config: digits(config)  # noqa: E731
    r = veritrain.train(closure, str(tmp_path / "a"), steps=2, checkpoint_every=1)
    assert r.task.startswith("python:") and veritrain.audit(str(tmp_path / "a"), task=closure).accepted

    def built():
        torch.manual_seed(0)  # built outside veritrain: its own seed makes the two builds the same
        return digits({})

    r = veritrain.train(built(), str(tmp_path / "b"), steps=2, checkpoint_every=1)
    assert veritrain.audit(str(tmp_path / "b"), task=built()).accepted
    other = built()
    with torch.no_grad():
        next(other.model.parameters()).add_(1e-3)  # an auditor given other weights rejects
    assert not veritrain.audit(str(tmp_path / "b"), task=other).accepted


def test_dispute_of_an_honest_run_and_the_cli_prints_the_api_result(tmp_path):
    import json

    from conftest import cli

    out, audit_dir = str(tmp_path / "run"), str(tmp_path / "audit")
    veritrain.train("digits-cnn", out, steps=2, checkpoint_every=1)
    assert veritrain.audit(out, out=audit_dir).accepted
    d = veritrain.dispute(out, audit_dir)
    assert isinstance(d, veritrain.DisputeResult) and d.verdict == "no_dispute" and d.as_dict()["verdict"] == "no_dispute"
    p = cli("verify", out, "--json", check=0)
    assert json.loads(p.stdout) == veritrain.verify(out).as_dict()


def test_a_task_or_device_beside_an_own_loops_script_is_refused_not_ignored(tmp_path):
    """An own loop's replay runs its script, which builds and places its model: ``task=`` and ``device=`` beside
    ``command=`` were dropped without a word (the audit replayed the script's model on the CPU)."""
    from conftest import cli

    script = ["python", str(tmp_path / "train.py")]  # never run: refused before anything is read
    for kwargs, message in (({"task": "digits-cnn"}, "names its task itself"), ({"device": "cuda"}, "does not apply")):
        with pytest.raises(ValueError, match=message):
            veritrain.audit(str(tmp_path / "run"), command=script, **kwargs)
        with pytest.raises(ValueError, match=message):
            veritrain.dispute(str(tmp_path / "run"), str(tmp_path / "audit"), command=script, **kwargs)
    p = cli("audit", tmp_path / "run", "--task", "digits-cnn", "--", *script)  # (a CUDA device is checked before)
    assert p.returncode == 2 and "names its task itself" in p.stderr and "Traceback" not in p.stderr, p.stderr
