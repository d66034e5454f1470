"""The verification game: an honest run has no dispute; a poisoned step is localised to the step and an
operator and ruled against the trainer; a prover that lies about the tree loses."""

import json
import os
import subprocess
import sys
import threading

import pytest

from conftest import TASKS_ENV as ENV, TEST_TASKS as TASKS, cli
from veritrain.policy import Policy
from veritrain.protocol import Challenger, LocalProver, ProverError
from veritrain.server import HttpProver, make_server

sys.path.insert(0, TASKS)  # in-process provers rebuild the test task
POISON_STEP = 4
# the auditor names the (non-built-in) task itself: a run never chooses what code the auditor imports
TASK = ["--task", "poisoned_digits:make_task"]
POLICY = Policy(task="poisoned_digits:make_task")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    d = tmp_path_factory.mktemp("game")
    honest, poisoned = d / "honest", d / "poisoned"
    common = ["--steps", "6", "--checkpoint-every", "2", "--quiet"]
    cli("train", "poisoned_digits:make_task", "--out", honest, *common, env=ENV, check=0)
    cli("train", "poisoned_digits:make_task", "--out", poisoned, *common, check=0,
        env={**ENV, "VERITRAIN_TEST_POISON_STEP": str(POISON_STEP)})
    audits = {}
    for name, run in (("honest", honest), ("poisoned", poisoned)):
        out = d / f"audit-{name}"
        p = cli("audit", run, "--out", out, "--json", "--quiet", "--variant", "isa-avx2", *TASK, env=ENV)
        audits[name] = (p.returncode, json.loads(p.stdout), out)
    return honest, poisoned, audits


def test_honest_run_is_accepted_and_has_no_dispute(runs):
    honest, _, audits = runs
    rc, result, audit_dir = audits["honest"]
    assert rc == 0 and result["accepted"], result["reasons"]
    p = cli("dispute", honest, audit_dir, "--json", *TASK, env=ENV)
    v = json.loads(p.stdout)
    assert p.returncode == 0 and v["verdict"] == "no_dispute", v


def serve(run, env):
    """`veritrain serve RUN --port 0` in its own process (the trainer's machine); returns (process, url)."""
    e = {**os.environ, **env}
    proc = subprocess.Popen([sys.executable, "-m", "veritrain.cli", "serve", str(run), "--port", "0"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=e)
    line = proc.stdout.readline()
    assert "serving" in line, proc.stderr.read()
    return proc, line.strip().rsplit(" ", 1)[-1]


def test_poisoned_step_is_localised_and_the_referee_rules_against_the_trainer(runs):
    _, poisoned, audits = runs
    rc, result, audit_dir = audits["poisoned"]
    assert rc == 1 and not result["accepted"]
    assert any(f"step {POISON_STEP}: the trainer's data record differs" in r for r in result["reasons"]), result["reasons"]
    proc, url = serve(poisoned, {**ENV, "VERITRAIN_TEST_POISON_STEP": str(POISON_STEP)})
    try:
        p = cli("dispute", url, audit_dir, "--json", *TASK, env=ENV)
    finally:
        proc.terminate()
        proc.wait()
    v = json.loads(p.stdout)
    assert p.returncode == 1, p.stderr
    assert v["verdict"] == "trainer_wrong", v
    assert v["interval"] == POISON_STEP // 2 and v["step"] == POISON_STEP and v["data_step"] == POISON_STEP
    assert v["operator"] == "aten.convolution.default" and v["module"] == "conv1", v
    assert "other data" in v["ruling"]
    assert v["queries"] > 0 and v["referee_bytes"] > 0
    assert v["referee_bytes"] < 1_000_000


class LyingProver(LocalProver):
    def __init__(self, run_dir, lie):
        super().__init__(run_dir)
        self.lie = lie

    def node(self, lo, hi):
        h = super().node(lo, hi)
        return bytes(32) if self.lie == "node" and (lo, hi) == (0, 2) else h

    def leaf(self, index):
        data, proof = super().leaf(index)
        if self.lie == "proof":
            proof = [bytes(32)] + proof[1:]
        return data, proof


@pytest.mark.parametrize("lie, why", [("node", "do not hash to their parent"),
                                      ("proof", "inclusion proof for leaf")])
def test_a_prover_that_lies_over_http_loses(runs, tmp_path, lie, why):
    honest, _, audits = runs
    audit_state = json.loads((audits["honest"][2] / "audit.json").read_text())
    # an auditor who disagrees about interval 0, so the game has to walk the tree
    audit_state["leaves"]["0"] = "00" * 32
    server = make_server(LyingProver(str(honest), lie), "127.0.0.1", 0)
    t = threading.Thread(target=server.serve_forever, daemon=True)
    t.start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}"
        v = Challenger(HttpProver(url), audit_state, policy=POLICY).play()
    finally:
        server.shutdown()
        server.server_close()
    assert v["verdict"] == "trainer_wrong" and any(why in r for r in v["reasons"]), v


class SlowProver(LocalProver):
    def manifest(self):
        import time

        time.sleep(3)
        return super().manifest()


def test_an_unreachable_refusing_or_slow_prover_loses(runs):
    honest, _, audits = runs
    with pytest.raises(ProverError, match="cannot reach"):
        HttpProver("http://127.0.0.1:9", timeout=2).manifest()
    server = make_server(LocalProver(str(honest)), "127.0.0.1", 0)
    t = threading.Thread(target=server.serve_forever, daemon=True)
    t.start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}"
        with pytest.raises(ProverError, match="refused /leaf"):
            HttpProver(url).leaf(99)
    finally:
        server.shutdown()
        server.server_close()


def test_the_referee_recomputes_every_operator_of_a_step_alone(runs):
    """Each op, evaluated on its own from its captured inputs with its log record, gives the output the
    whole-step replay gave: what lets a referee settle a dispute about one operator."""
    from veritrain.engine import load_call
    from veritrain.protocol import recompute

    honest, _, _ = runs
    prover = LocalProver(str(honest))
    step = 3
    n = prover.op_count(step)
    assert n > 50
    rep = prover._rep()
    log = prover.log(step)
    kinds = set()
    for k in range(1, n + 1):
        entry = prover.op(step, k)
        func, args, kwargs, random_index, _ = load_call(prover.op_inputs(step, k))
        assert str(func) == entry["op"]
        assert recompute(rep, step, k, func, args, kwargs, random_index, log) == entry["outputs"], (k, entry["op"])
        kinds.add(entry["where"].split(":")[0] if entry["where"] else None)
    assert {"backward", "optimizer", "conv1"} <= kinds


def test_an_auditor_with_a_wrong_leaf_is_ruled_wrong(runs):
    honest, _, audits = runs
    audit_state = json.loads((audits["honest"][2] / "audit.json").read_text())
    audit_state["leaves"]["1"] = "11" * 32
    v = Challenger(LocalProver(str(honest)), audit_state, policy=POLICY).play()
    assert v["verdict"] == "auditor_wrong" and v["interval"] == 1, v

    server = make_server(SlowProver(str(honest)), "127.0.0.1", 0)
    t = threading.Thread(target=server.serve_forever, daemon=True)
    t.start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}"
        p = cli("dispute", url, audits["honest"][2], "--json", "--timeout", "0.5", *TASK)
    finally:
        server.shutdown()
        server.server_close()
    v = json.loads(p.stdout)
    assert p.returncode == 1 and v["verdict"] == "trainer_wrong" and "timed out" in v["reasons"][0], v
