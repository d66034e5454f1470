"""The README's "Use it in your own code" snippets run as written: the own loop trains, resumes nothing,
and audits (fully and one interval on other hardware); the API snippet prints its checks; the Hugging
Face task trains and audits."""

import json
import os
import re
import subprocess
import sys

import pytest

from conftest import REPO, cli


def snippets():
    text = open(os.path.join(REPO, "README.md")).read()
    section = text.split("### Use it in your own code", 1)[1].split("\n### ", 1)[0]
    return re.findall(r"```python\n(.*?)```", section, re.S)


def test_the_section_has_its_three_snippets():
    s = snippets()
    assert len(s) == 4 and "veritrain.Run(" in s[0] and "veritrain.train(" in s[1] and \
        "veritrain.hf.Trainer(" in s[2] and "veritrain.hf.task(" in s[3]


def test_the_own_loop_snippet_trains_and_audits(tmp_path):
    (tmp_path / "train.py").write_text(snippets()[0])
    env = {k: v for k, v in os.environ.items() if not k.startswith("VERITRAIN_")}
    p = subprocess.run([sys.executable, "train.py", "runs/own"], cwd=tmp_path, env=env, capture_output=True,
                       text=True, timeout=600)
    assert p.returncode == 0, p.stderr
    for flags in ([], ["--intervals", "1", "--variant", "isa-default"]):
        p = cli("audit", "runs/own", "--json", *flags, "--", sys.executable, "train.py", "runs/own",
                cwd=tmp_path)
        r = json.loads(p.stdout)
        assert p.returncode == 0 and r["accepted"] and r["steps"] == (8 if not flags else 4), (p.stderr, r["reasons"])


def test_the_api_snippet_prints_its_checks(tmp_path):
    p = subprocess.run([sys.executable, "-c", snippets()[1]], cwd=tmp_path, capture_output=True, text=True,
                       timeout=600)
    assert p.returncode == 0 and p.stdout.split() == ["True", "True", "True", "4"], (p.stdout, p.stderr)


def test_the_hugging_face_snippet_trains_and_audits(tmp_path):
    pytest.importorskip("accelerate")
    (tmp_path / "hftask.py").write_text(snippets()[3])
    env = {"PYTHONPATH": str(tmp_path)}
    cli("train", "hftask:make_task", "--out", "runs/hf", "--steps", 2, "--checkpoint-every", 1, "--quiet",
        cwd=tmp_path, env=env, check=0)
    cli("audit", "runs/hf", "--task", "hftask:make_task", "--intervals", "1", "--quiet", cwd=tmp_path, env=env,
        check=0)


def test_the_hugging_face_trainer_snippet_is_a_run_its_script_audits(tmp_path):
    """veritrain.hf.Trainer: `trainer.train()` writes a run; the same script audits it on other hardware."""
    pytest.importorskip("accelerate")
    (tmp_path / "hftrain.py").write_text(snippets()[2])
    env = {k: v for k, v in os.environ.items() if not k.startswith("VERITRAIN_")}
    p = subprocess.run([sys.executable, "hftrain.py", "runs/hft"], cwd=tmp_path, env=env, capture_output=True,
                       text=True, timeout=600)
    assert p.returncode == 0 and "{'root': '" in p.stdout, p.stderr
    m = json.loads((tmp_path / "runs" / "hft" / "manifest.json").read_text())
    assert m["complete"] and m["task"] == "loop:hftrain.py" and m["seed"] == 3
    assert m["config"]["training_args"]["learning_rate"] == 1e-3 and m["config"]["training_args"]["max_steps"] == 6
    p = cli("audit", "runs/hft", "--variant", "isa-default", "--json", "--quiet", "--", sys.executable,
            "hftrain.py", "runs/hft", cwd=tmp_path)
    r = json.loads(p.stdout)
    assert p.returncode == 0 and r["accepted"] and [c["match"] for c in r["checkpoints"]] == [True, True], r
