"""The command line a user expects: --version, fast help, progress in logs, --json, the next command, serve's
URL, unknown --set keys, import hints, Ctrl-C, incomplete runs, dispute under --variant."""

import argparse
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time
import urllib.request

import pytest

from conftest import cli

from veritrain import __version__
from veritrain.cli import PUBLIC_COMMANDS, build_parser

PY = [sys.executable, "-m", "veritrain.cli"]


def _sigint_default():
    """In the child before exec: a shell's background job (`cmd &` without job control, as CI may run us)
    ignores SIGINT, and Python keeps an ignored SIGINT ignored; these tests need it delivered."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _env():
    e = dict(os.environ)
    e.pop("VERITRAIN_VARIANT_APPLIED", None)
    return e


def _command(line: str) -> list[str]:
    """A `veritrain ...` command the CLI printed, as argv for this interpreter."""
    argv = shlex.split(line)
    assert argv[0] == "veritrain", line
    return PY + argv[1:]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A small run trained with stderr piped (not a terminal) and without --quiet: (run dir, process)."""
    run = tmp_path_factory.mktemp("ux") / "run"
    p = cli("train", "digits-cnn", "--out", run, "--steps", "4", "--checkpoint-every", "2", check=0)
    return run, p


def test_version():
    p = cli("--version", check=0)
    assert p.stdout.strip() == f"veritrain {__version__}"


def test_help_is_fast_imports_no_torch_and_hides_internal_commands():
    p = subprocess.run([sys.executable, "-c", "import sys; from veritrain.cli import build_parser; build_parser(); "
                        "print('torch' in sys.modules, 'numpy' in sys.modules)"],
                       capture_output=True, text=True, env=_env(), check=True)
    assert p.stdout.split() == ["False", "False"], "building the parser imported torch or numpy"
    for argv in (["--help"], ["train", "--help"]):
        best = float("inf")
        for _ in range(3):
            t0 = time.perf_counter()
            p = subprocess.run(PY + argv, capture_output=True, text=True, env=_env())
            best = min(best, time.perf_counter() - t0)
            assert p.returncode == 0, p.stderr
        assert best < 1.0, f"veritrain {' '.join(argv)} took {best:.2f} s"
    top = cli("--help", check=0).stdout
    assert "_replay" not in top and "_compare" not in top and "==SUPPRESS==" not in top
    for name in PUBLIC_COMMANDS:
        assert name in top
        assert cli(name, "--help", check=0).stdout.startswith(f"usage: veritrain {name}")
    assert cli("_replay", "--help", check=0).stdout  # hidden, still there for the experiments


def test_every_option_has_help():
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    missing = []
    for name in PUBLIC_COMMANDS:
        for action in sub.choices[name]._actions:
            if not action.help or action.help == argparse.SUPPRESS:
                missing.append(f"{name} {'/'.join(action.option_strings) or action.dest}")
    assert not missing, missing


def test_train_prints_progress_lines_the_run_and_the_next_command(trained):
    run, p = trained
    lines = [x for x in p.stderr.splitlines() if x.startswith("train: ")]
    pattern = r"train: step {}/4 loss \d+\.\d{{4}} elapsed [\dhms.]+ eta [\dhms.]+"
    assert len(lines) == 2 and re.fullmatch(pattern.format(2), lines[0]) and re.fullmatch(pattern.format(4), lines[1]), \
        p.stderr
    m = json.loads((run / "manifest.json").read_text())
    assert f"run folder: {run}" in p.stdout and m["root"] in p.stdout
    assert p.stdout.splitlines()[-1] == f"next: veritrain audit {shlex.quote(str(run))}"


def test_train_json_and_quiet(tmp_path):
    run = tmp_path / "run x"  # a space: the next command must quote it
    p = cli("train", "digits-cnn", "--out", run, "--steps", "2", "--checkpoint-every", "1", "--json", "--quiet",
            check=0)
    r = json.loads(p.stdout)  # one JSON object and nothing else
    m = json.loads((run / "manifest.json").read_text())
    assert r == {"run": str(run), "task": "digits-cnn", "steps": 2, "mode": "verified", "bits": 32, "root": m["root"],
                 "final_state_hash": m["checkpoints"][-1]["state_sha256"], "evaluation": m["evaluation"],
                 "next": f"veritrain audit '{run}'"}
    assert "train: step" not in p.stderr, p.stderr  # --quiet: no progress lines


def test_next_command_audits_with_progress_lines_and_dispute_runs_under_a_variant(trained, tmp_path):
    run, p = trained
    audit_dir = tmp_path / "audit"
    a = subprocess.run(_command(p.stdout.splitlines()[-1][len("next: "):]) + ["--out", str(audit_dir)],
                       capture_output=True, text=True, env=_env())
    assert a.returncode == 0 and "verdict: ACCEPT" in a.stdout, a.stdout + a.stderr
    lines = [x for x in a.stderr.splitlines() if x.startswith("audit: ")]
    assert [x.split(" elapsed")[0] for x in lines] == ["audit: step 2/4", "audit: step 4/4"], a.stderr
    d = cli("dispute", run, audit_dir, "--variant", "isa-default", "--json", check=0)
    v = json.loads(d.stdout)
    assert v["verdict"] == "no_dispute" and v["hardware"]["variant"] == "isa-default", v


def test_serve_prints_its_real_url(trained):
    run, _ = trained
    proc = subprocess.Popen(PY + ["serve", str(run), "--port", "0"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=_env())
    try:
        line = proc.stdout.readline()
        url = re.search(r" on (http://127\.0\.0\.1:(\d+))$", line.strip())
        assert url and int(url.group(2)) != 0, (line, proc.stderr.read() if proc.poll() is not None else "")
        with urllib.request.urlopen(url.group(1) + "/manifest", timeout=60) as f:
            m = json.load(f)
        assert m["root"] == json.loads((run / "manifest.json").read_text())["root"]
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def test_unknown_set_keys_are_refused_before_anything_is_written(tmp_path, monkeypatch):
    for argv, out in ((["train", "digits-cnn"], tmp_path / "run"), (["contract", "digits-cnn"], tmp_path / "c.json"),
                      (["calibrate", "digits-cnn"], tmp_path / "cal")):
        p = cli(*argv, "--out", out, "--set", "lrr=0.1")
        assert p.returncode == 2 and "unknown config keys ['lrr']" in p.stderr and "known: " in p.stderr, p.stderr
        assert " lr," in p.stderr and not out.exists(), (argv, p.stderr)
    # a task that declares no defaults takes any key
    (tmp_path / "free_task.py").write_text("def make_task(config):\n    raise NotImplementedError\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    from veritrain.cli import _config

    assert _config("free_task:make_task", ["anything=1", "name=x"]) == {"anything": 1, "name": "x"}


def test_a_task_module_that_cannot_be_imported_gets_a_pythonpath_hint(tmp_path):
    p = cli("train", "no_such_module_here:make_task", "--out", tmp_path / "a")
    assert p.returncode == 2 and "cannot import task module 'no_such_module_here'" in p.stderr
    assert "(is its folder on PYTHONPATH? e.g. PYTHONPATH=/path/to/dir veritrain train ...)" in p.stderr
    # the module is found but a dependency of it is missing: no hint about the module's folder
    (tmp_path / "needs_dep.py").write_text("import no_such_dependency_xyz\n")
    p = cli("train", "needs_dep:make_task", "--out", tmp_path / "b", env={"PYTHONPATH": str(tmp_path)})
    assert p.returncode == 2 and "no_such_dependency_xyz" in p.stderr and "PYTHONPATH" not in p.stderr, p.stderr


def _train_until_checkpoint(out, *extra):
    """A long `veritrain train` in its own session, once its manifest commits to the checkpoint after 2
    steps (compiling is done by then)."""
    proc = subprocess.Popen(PY + ["train", "digits-cnn", "--out", str(out), "--steps", "100000", "--checkpoint-every",
                                  "1", *extra], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env(),
                            start_new_session=True, preexec_fn=_sigint_default)
    t0 = time.time()
    def committed():  # the manifest (written atomically after the checkpoint) names the checkpoint after 2 steps
        try:
            return json.loads((out / "manifest.json").read_text())["steps_completed"] >= 2
        except (OSError, ValueError, KeyError):
            return False

    while not committed():
        assert proc.poll() is None, proc.communicate()
        assert time.time() - t0 < 600, "no checkpoint after 10 minutes"
        time.sleep(0.1)
    return proc


def _interrupted(proc, group=False):
    (os.killpg if group else os.kill)(proc.pid, signal.SIGINT)
    try:
        out, err = proc.communicate(timeout=120)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # never leave a 100000-step training behind
        proc.communicate()
        raise AssertionError("the interrupted command did not exit within 120 s")
    assert proc.returncode == 130, (proc.returncode, err)
    assert "Traceback" not in err, err
    return err.strip().splitlines()[-1]


def test_ctrl_c_prints_the_resume_command_and_verify_and_inspect_agree_on_the_incomplete_run(tmp_path):
    run = tmp_path / "run"
    last = _interrupted(_train_until_checkpoint(run, "--quiet"))
    assert last == f"interrupted; resume with: veritrain train digits-cnn --out {shlex.quote(str(run))} --resume"
    m = json.loads((run / "manifest.json").read_text())
    assert not m["complete"] and m["steps_completed"] >= 2
    v = cli("verify", run, "--json")
    assert v.returncode == 1, v.stdout + v.stderr
    v = json.loads(v.stdout)
    assert not v["ok"] and not v["complete"] and "incomplete" in v["problems"][0]["problem"], v
    i = json.loads(cli("inspect", run, "--json", check=0).stdout)
    assert not i["complete"] and i["steps"] == v["steps"] == m["steps_completed"] and i["root"] is v["root"] is None
    assert i["steps_planned"] == v["steps_planned"] == 100000
    # the printed command resumes the run (and can itself be interrupted)
    resume = subprocess.Popen(_command(last.split(": ", 1)[1]), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True, env=_env(), start_new_session=True, preexec_fn=_sigint_default)
    t0 = time.time()
    while json.loads((run / "manifest.json").read_text())["steps_completed"] <= m["steps_completed"]:
        assert resume.poll() is None, resume.communicate()
        assert time.time() - t0 < 600
        time.sleep(0.2)
    assert _interrupted(resume) == last


@pytest.mark.parametrize("group", [True, False], ids=["terminal", "parent-only"])
def test_ctrl_c_under_a_variant(tmp_path, group):
    """Ctrl-C in a terminal reaches the --variant parent and its child; a SIGINT to the parent alone is passed
    on. Either way: exit 130, the child's resume line, no traceback from either process."""
    run = tmp_path / "run"
    last = _interrupted(_train_until_checkpoint(run, "--variant", "isa-default"), group=group)
    assert last == (f"interrupted; resume with: veritrain train digits-cnn --out {shlex.quote(str(run))} --resume "
                    f"--variant isa-default")
