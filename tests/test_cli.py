"""The command line: exit codes, clear errors for bad input, the modes and the demo."""

import json
import os

from conftest import audit_json, cli


def test_bad_input_exits_2_with_a_named_error(tmp_path, shakespeare):
    cases = [
        (["train", "no-such-task", "--out", tmp_path / "a"], "neither a built-in task"),
        (["train", "nomodule:fn", "--out", tmp_path / "a"], "cannot import task module 'nomodule'"),
        (["train", "digits-cnn", "--out", tmp_path / "a", "--bits", "40"], "rounding amount must be"),
        (["train", "digits-cnn", "--out", tmp_path / "a", "--set", "nokey"], "--set expects key=value"),
        (["train", "digits-cnn", "--out", tmp_path / "a", "--set", "colour=red"], "unknown config keys ['colour']"),
        (["train", "gpt2-text", "--out", tmp_path / "a"], "config 'corpus' is required"),
        (["train", "gpt2-text", "--out", tmp_path / "a", "--set", "corpus=/no/such/file.txt"],
         "corpus file '/no/such/file.txt' (config 'corpus') does not exist"),
        (["train", "gpt2-text", "--out", tmp_path / "a", "--set", f"corpus={shakespeare}", "--set",
          f"tokenizer={tmp_path}"], "lacks vocab.json/encoder.json"),
        (["audit", tmp_path / "missing"], "does not exist"),
        (["audit", tmp_path], "has no manifest.json"),
        (["train", "digits-cnn", "--out", tmp_path / "a", "--thresholds", tmp_path / "none.json"], "--thresholds"),
    ]
    for args, message in cases:
        p = cli(*args)
        assert p.returncode == 2, (args, p.stdout, p.stderr)
        assert message in p.stderr, (args, p.stderr)
        assert "Traceback" not in p.stderr
    (tmp_path / "manifest.json").write_text("{not json")
    p = cli("audit", tmp_path)  # a run folder whose manifest is damaged: the run is rejected, not unusable input
    assert p.returncode == 1 and "is not valid JSON" in p.stderr and "REJECT" in p.stderr


def test_existing_run_directory_is_never_overwritten(tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    (out / "keep.txt").write_text("precious")
    p = cli("train", "digits-cnn", "--out", out, "--steps", "1")
    assert p.returncode == 2 and "already exists and is not empty" in p.stderr
    assert (out / "keep.txt").read_text() == "precious" and os.listdir(out) == ["keep.txt"]


def test_modes_and_a_coarse_grid(tmp_path):
    for mode in ("nolog", "fp64"):
        run = tmp_path / mode
        cli("train", "digits-cnn", "--out", run, "--steps", "3", "--mode", mode, "--quiet", check=0)
        assert audit_json(run, "native")["accepted"], mode  # same machine: same bits
        assert not os.path.exists(run / "logs")
    run = tmp_path / "b26"
    cli("train", "digits-cnn", "--out", run, "--steps", "6", "--checkpoint-every", "3", "--bits", "26", "--quiet",
        check=0)
    for variant in ("isa-default", "combo"):
        r = audit_json(run, variant)
        assert r["accepted"] and len(r["checkpoints"]) == 2, r["reasons"]
    m = json.loads((run / "manifest.json").read_text())
    assert m["bits"] == 26 and m["complete"] and m["versions"]["torch"]


def test_demo_trains_audits_and_prints_the_verdict(tmp_path):
    p = cli("demo", "--steps", "5", "--out", tmp_path / "demo", check=0)
    assert "plain float32 : REJECT" in p.stdout
    assert "veritrain     : ACCEPT" in p.stdout
