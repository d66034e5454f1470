"""The referee does not blame an honest auditor for a false data record (SECURITY.md row 19).

The audit recomputes each step's whole record (batch hash, example indices, loss, log hash) and rejects a
run whose leaf commits to other records. In the game, the challenger's replay used to compare a committed
record only by its batch hash and its log hash; where its replay reached the committed state it ruled
`auditor_wrong`. A trainer that trained honestly but committed a made-up loss curve (or other example
indices) thus had a correct rejection overturned. Now the replay builds each step's canonical record as the
audit does, and a record that differs while the replay reaches the committed state rules `trainer_wrong`.
"""

import json
import os

import pytest

from conftest import cli, recommit
from veritrain import store
from veritrain.protocol import Challenger, LocalProver
from veritrain.runner import TrainOptions, train

FAKED_STEP = 1


def _audit(run, out):
    p = cli("audit", run, "--out", out, "--json", "--quiet", "--variant", "combo")
    assert p.returncode in (0, 1), p.stderr
    with open(os.path.join(out, "audit.json")) as f:
        return p.returncode, json.loads(p.stdout), json.load(f)


@pytest.mark.parametrize("field", ["loss", "batch_indices"])
def test_a_record_with_a_false_loss_or_indices_is_not_ruled_against_the_auditor(tmp_path, field):
    run = tmp_path / "run"
    train(TrainOptions(task="digits-cnn", out=str(run), steps=4, checkpoint_every=2, progress=False))
    rp = run / store.record_name(FAKED_STEP)
    rec = json.loads(rp.read_bytes())
    if field == "loss":
        rec["loss"] = rec["loss"] / 10  # the trainer reports a training loss it never reached
    else:
        assert rec["batch_indices"], "digits-cnn reports its batch indices"
        rec["batch_indices"] = list(reversed(rec["batch_indices"]))
    store.write_bytes_atomic(str(rp), store.record_bytes(FAKED_STEP, rec["batch_sha256"], rec["batch_indices"],
                                                         rec["loss"], rec["log_sha256"]))
    recommit(run)
    rc, result, audit_state = _audit(run, tmp_path / "audit")
    assert rc == 1 and any("data records differ" in r for r in result["reasons"]), result["reasons"]
    v = Challenger(LocalProver(str(run)), audit_state).play()
    assert v["verdict"] == "trainer_wrong", (
        f"the referee ruled {v['verdict']!r} against an auditor that correctly rejected a record with a false "
        f"{field}: {v['reasons']}")
