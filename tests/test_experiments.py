"""Each experiment at tiny sizes: its outputs (CSV, Markdown, PNG) and the properties that must hold."""

import csv

import pytest

from conftest import cli, shared_file

TINY_RESNET = ["--set", "resnet.width=4", "--set", "resnet.batch_size=8", "--set", "resnet.train_examples=64"]
TINY_GPT2 = ["--set", "gpt2.n_layer=1", "--set", "gpt2.n_embd=32", "--set", "gpt2.n_head=2", "--set",
             "gpt2.max_chars=20000", "--set", "gpt2.seq_len=16", "--set", "gpt2.batch_size=2"]


def experiment(tmp_path, name, *extra, workloads="resnet"):
    args = ["experiment", name, "--out", tmp_path, "--workloads", workloads, *TINY_RESNET, *extra]
    if "gpt2" in workloads:
        args += ["--corpus", shared_file("shakespeare.txt"), "--tokenizer", shared_file("gpt2-tokenizer"), *TINY_GPT2]
    p = cli(*args, timeout=1200)
    assert p.returncode == 0, p.stdout + p.stderr
    folder = tmp_path / name
    for suffix in (".csv", ".md", ".png"):
        assert (folder / f"{name}{suffix}").stat().st_size > 0
    with open(folder / f"{name}.csv") as f:
        return list(csv.DictReader(f))


def test_divergence_is_zero_for_veritrain_and_not_for_float32(tmp_path):
    rows = experiment(tmp_path, "divergence", "--steps", "3", workloads="resnet,gpt2")
    for w in ("resnet", "gpt2"):
        assert [float(r["l2_distance"]) for r in rows if r["workload"] == w and r["mode"] == "verified"] == [0.0] * 3
        assert any(float(r["l2_distance"]) > 0 for r in rows if r["workload"] == w and r["mode"] == "fp32")


def test_storage_ours_is_smaller_than_the_packed_encoding(tmp_path):
    rows = experiment(tmp_path, "storage", "--steps", "2", "--bits", "32,28")
    assert [int(r["bits"]) for r in rows] == [32, 28]
    for r in rows:
        assert float(r["veritrain_bytes"]) < float(r["packed_bytes"]) < float(r["naive_bytes"])
        assert float(r["packed_bytes"]) == pytest.approx(float(r["rounded_values"]) / 5, abs=1)


def test_corrections_are_counts_that_do_not_grow_as_b_drops(tmp_path):
    rows = experiment(tmp_path, "corrections", "--steps", "2", "--bits", "32,27")
    totals = [int(r["total"]) for r in rows]
    assert all(t >= 0 for t in totals) and totals[-1] <= totals[0]
    assert all(r["accepted"] == "True" for r in rows)


def test_thresholds_table(tmp_path):
    rows = experiment(tmp_path, "thresholds", "--steps", "1", "--variants", "isa-avx2")
    classes = {r["op_class"] for r in rows}
    assert {"accumulate", "elementwise", "normalization", "softmax"} <= classes
    assert all(float(r["max_ratio"]) < float(r["default_c"]) for r in rows)


def test_time_ratios(tmp_path):
    rows = experiment(tmp_path, "time", "--steps", "2")
    assert rows and all(float(r["trainer_over_fp64"]) > 0 and float(r["auditor_over_fp64"]) > 0 for r in rows)


def test_data_order_moves_weights_more_than_hardware(tmp_path):
    rows = experiment(tmp_path, "data-order", "--steps", "4")
    hw, order = rows
    assert 0 <= float(hw["weight_l2"]) < float(order["weight_l2"])


def test_rounding_amount_sweep_and_report(tmp_path):
    rows = experiment(tmp_path, "rounding", "--steps", "2", "--bits", "32,26")
    assert [int(r["bits"]) for r in rows] == [32, 26] and all(float(r["loss"]) > 0 for r in rows)
    cli("report", tmp_path, check=0)
    report = (tmp_path / "report.md").read_text()
    assert "18 MB" in report and "rounding/rounding.png" in report and "Not run:" in report


def test_unknown_experiment_and_missing_corpus_are_bad_input(tmp_path):
    assert cli("experiment", "nope", "--out", tmp_path).returncode == 2
    p = cli("experiment", "storage", "--out", tmp_path, "--workloads", "gpt2")
    assert p.returncode == 2 and "--corpus" in p.stderr
    (tmp_path / "storage").mkdir()
    (tmp_path / "storage" / "keep.txt").write_text("earlier results")
    p = cli("experiment", "storage", "--out", tmp_path, "--workloads", "resnet")
    assert p.returncode == 2 and "already exists" in p.stderr
    assert (tmp_path / "storage" / "keep.txt").read_text() == "earlier results"
