"""The dishonest trainer against the run's commitment to its data (data_sha256) and the refusal of config paths
inside the run folder: the game, eval and the other readers of a run's config must check the data they read
as the audit does."""

import json

import pytest

from conftest import TINY_TEXT as TEXT, cli, small_corpus as corpus


def test_the_game_does_not_blame_an_honest_trainer_for_the_challengers_own_data(tmp_path):
    """An honest run; an audit that wrongly claims another leaf for interval 1 (so there is a dispute); by the
    time of the dispute the challenger's copy of the corpus has changed (it no longer hashes to the run's
    data_sha256, which the audit had checked). The game's replay built the task from that copy without
    comparing it with the run's commitment, found the trainer's data records 'differ' and ruled
    trainer_wrong: the referee blamed the honest side. The challenger's own data is now checked against
    the run's commitment, and a copy that differs is the challenger's error (exit 2), never a verdict."""
    text = corpus(tmp_path / "data" / "corpus.txt")
    run, aud = tmp_path / "run", tmp_path / "aud"
    cli("train", "gpt2-text", "--out", run, "--set", f"corpus={text}", *TEXT, check=0)
    cli("audit", run, "--out", aud, "--quiet", check=0)
    a = json.loads((aud / "audit.json").read_text())
    a["leaves"]["1"] = "00" * 32  # the auditor's mistake (a fault on its machine)
    (aud / "audit.json").write_text(json.dumps(a))
    text.write_text(text.read_text().replace("king", "queen"))  # the challenger's copy is no longer the run's
    p = cli("dispute", run, aud, "--json")
    assert "trainer_wrong" not in p.stdout, p.stdout[-2000:]
    assert p.returncode == 2 and "config 'corpus'" in p.stderr and "the run commits to" in p.stderr, \
        (p.returncode, p.stdout[-2000:], p.stderr[-2000:])


def test_eval_reads_the_data_the_run_commits_to(tmp_path):
    """`veritrain eval` built the task from the auditor's copy of the data and never compared it with the run's
    data_sha256 (nor a contract's pin): a run trained on other text than the auditor's (which the audit
    rejects) was evaluated on the auditor's held-out text, exit 0, as if the metric were the run's; an
    auditor whose copy is not the contract's data got a metric, exit 0. eval now checks the data as the
    audit does: rejected (exit 1), or the auditor's own error under a pinning contract (exit 2)."""
    text = corpus(tmp_path / "data" / "corpus.txt")
    run = tmp_path / "run"
    cli("train", "gpt2-text", "--out", run, "--set", f"corpus={text}", *TEXT, check=0)
    cli("eval", run, "--json", check=0)
    m = json.loads((run / "manifest.json").read_text())
    pin = tmp_path / "contract.json"
    pin.write_text(json.dumps({"format": "veritrain-contract/1", "data_sha256": m["data_sha256"]}))
    text.write_text(text.read_text().replace("king", "queen"))  # the auditor's copy is not the run's data
    p = cli("eval", run, "--json")
    assert p.returncode == 1 and "data: config 'corpus'" in p.stdout + p.stderr, \
        (p.returncode, p.stdout[-2000:], p.stderr[-2000:])
    p = cli("eval", run, "--json", "--contract", pin)
    assert p.returncode == 2 and "the auditor's data: config 'corpus'" in p.stderr, \
        (p.returncode, p.stdout[-2000:], p.stderr[-2000:])


def test_a_config_word_that_names_the_run_folder_is_not_a_path_into_it(tmp_path):
    """The refusal of config paths inside the run folder took every string value of the config that named an
    existing file as a path: an honest gpt2-text run kept in a folder named `adamw` (its optimizer) or `bytes`
    (its tokenizer, a word the task reads no file for) and audited from the folder that holds it was refused,
    'config ... names ..., inside the run folder'. Only the settings a task reads data from are checked now
    (a built-in task's ``make_task.data_paths``, less the words it takes as no path: tokenizer `bytes`, data
    `digits`); a corpus named by a path into the run folder is still refused."""
    import shutil

    text = corpus(tmp_path / "data" / "corpus.txt")
    runs = tmp_path / "runs"
    runs.mkdir()
    cli("train", "gpt2-text", "--out", runs / "adamw", "--set", f"corpus={text}", *TEXT, check=0)
    for name in ("adamw", "bytes"):
        if name == "bytes":
            shutil.move(runs / "adamw", runs / "bytes")
        p = cli("audit", name, "--json", "--quiet", cwd=runs)
        assert p.returncode == 0, (name, p.returncode, p.stdout[-2000:], p.stderr[-2000:])
        p = cli("eval", name, "--json", cwd=runs)
        assert p.returncode == 0, (name, p.returncode, p.stdout[-2000:], p.stderr[-2000:])

    from veritrain import store  # a path into the run folder, relative or not, is still one
    assert store.config_paths_inside(str(runs / "bytes"), {"corpus": str(runs / "bytes" / "manifest.json")},
                                     {"corpus": {"words": (), "within": ()}}) == ["corpus"]
    assert store.config_paths_inside(str(runs / "bytes"), {"corpus": str(runs / "bytes")}, None) == ["corpus"]


def test_a_setting_too_large_for_a_float_is_named_by_the_range_check(tmp_path):
    """A built-in task's config with n_layer = 10**400 (JSON integers have any size; a trainer's manifest, a
    client's `--set`): the range check (task.check_ranges) raised OverflowError from math.isfinite, a
    traceback for `veritrain train` and a rejection that named no key for the audit. It is outside the range,
    named as such."""
    import pytest

    from veritrain.task import TaskError, check_ranges

    with pytest.raises(TaskError, match=r"config 'n_layer' = 1000.* is outside \[1, inf\)"):
        check_ranges("gpt2-text", {"n_layer": 10 ** 400}, {"n_layer": "[1, inf)"})
    text = corpus(tmp_path / "corpus.txt")
    p = cli("train", "gpt2-text", "--out", tmp_path / "run", "--set", f"corpus={text}", "--set",
            f"n_layer={10 ** 400}", "--steps", 1, "--quiet")
    assert p.returncode == 2 and "Traceback" not in p.stderr and "config 'n_layer'" in p.stderr, \
        (p.returncode, p.stderr[-2000:])


def test_a_cifar_folder_whose_batches_folder_is_the_run_folder_is_refused(tmp_path):
    """resnet-cifar10 reads a data folder's `cifar-10-batches-py` subfolder where it has one. The trainer
    trains with data=`.` on batches of its own, names its run folder `cifar-10-batches-py` and ships its
    batches in it: an auditor working in the folder that holds the run passed the inside-the-run-folder check
    (`.` is not inside the run), read the trainer's batches, whose hashes are the run's, and ACCEPTED. The
    folders a task reads under a data path (``make_task.data_paths``) are checked too."""
    import shutil
    import sys

    sys.path.insert(0, str(__import__("pathlib").Path(__file__).parent))
    from test_data_attacks import BATCHES, FOLDER, batch_bytes

    trainer, ship = tmp_path / "trainer", tmp_path / "ship"
    (trainer / FOLDER).mkdir(parents=True)
    for i, name in enumerate(BATCHES):  # the trainer's own data, not CIFAR-10
        (trainer / FOLDER / name).write_bytes(batch_bytes(8, 100 + i))
    cli("train", "resnet-cifar10", "--out", "run", "--set", "data=.", "--set", "width=2", "--set", "batch_size=2",
        "--set", "eval_examples=4", "--steps", 1, "--quiet", cwd=trainer, check=0)
    ship.mkdir()
    shutil.copytree(trainer / "run", ship / FOLDER)
    for name in BATCHES:
        shutil.copy(trainer / FOLDER / name, ship / FOLDER / name)
    p = cli("audit", FOLDER, "--json", "--quiet", cwd=ship)
    assert p.returncode == 1 and "inside the run folder" in p.stdout, (p.returncode, p.stdout[-2000:], p.stderr[-2000:])
    p = cli("audit", ship / FOLDER, "--json", "--quiet", cwd=trainer)  # its own batches beside the run: the data
    assert p.returncode == 0, (p.returncode, p.stdout[-2000:], p.stderr[-2000:])


def test_an_own_loops_threshold_too_large_for_a_float_is_named():
    """`veritrain.init(thresholds={"elementwise": 10**400})` (or Run's): the engine's check raised OverflowError
    from math.isfinite, which the loop's own check (loop._thresholds_arg) does not take for a bad threshold: a
    traceback that named nothing. It is a RunError naming the threshold, as for NaN or a negative one."""
    import pytest

    import veritrain
    from veritrain.store import RunError

    with pytest.raises(RunError, match="init: thresholds: threshold for class 'elementwise' must be a positive"):
        with veritrain.init(thresholds={"elementwise": 10 ** 400}):
            pass


def test_a_contract_pinning_no_data_admits_a_run_that_reads_none(tmp_path):
    """A contract pinning `data_sha256: {}` (the task reads no data files: digits-cnn's data are part of the
    installed library) refused every honest run of such a task: its manifest has no data_sha256 (a run commits
    to data only where its task read some), and None is not {}. Absent and empty are the same commitment."""
    run = tmp_path / "run"
    cli("train", "digits-cnn", "--out", run, "--steps", 1, "--quiet", check=0)
    pin = tmp_path / "contract.json"
    pin.write_text(json.dumps({"format": "veritrain-contract/1", "data_sha256": {}}))
    p = cli("audit", run, "--contract", pin, "--json", "--quiet")
    assert p.returncode == 0, (p.returncode, p.stdout[-2000:], p.stderr[-2000:])
    other = tmp_path / "other.json"  # a pin of some data still refuses it
    other.write_text(json.dumps({"format": "veritrain-contract/1", "data_sha256": {"data": "ab" * 32}}))
    p = cli("audit", run, "--contract", other, "--json", "--quiet")
    assert p.returncode == 1 and "field 'data_sha256'" in p.stdout, (p.returncode, p.stdout[-2000:])


def test_every_data_setting_of_the_built_in_tasks_is_checked_for_the_run_folder(tmp_path):
    """Declaring the data settings (make_task.data_paths) narrowed the run-folder check from every string to
    those settings: gpt2-shakespeare's `pretrained` (a folder of weights) was left out, so weights shipped in the
    run folder would have been the trainer's choice of initial state, which the auditor rebuilds from that folder."""
    from veritrain import store
    from veritrain.task import data_paths

    run = tmp_path / "run"
    (run / "weights").mkdir(parents=True)
    (run / "corpus.txt").write_text("x")
    cases = {"gpt2-shakespeare": {"pretrained": "weights", "corpus": "corpus.txt", "tokenizer": "weights"},
             "gpt2-text": {"corpus": "corpus.txt", "tokenizer": "weights"},
             "resnet-cifar10": {"data": "weights"}}
    for task, config in cases.items():
        got = store.config_paths_inside(str(run), {k: str(run / v) for k, v in config.items()}, data_paths(task))
        assert got == sorted(config), (task, got)


def test_an_own_loops_run_cannot_claim_data_hashes_a_contract_pins(tmp_path):
    """An own loop's script reads its data itself: no build on the auditor's side computes data hashes for it,
    so a loop run's manifest claiming the hashes a contract pins passed the policy and nothing compared them."""
    from veritrain.policy import Policy, PolicyError
    from veritrain.rules import DEFAULT_THRESHOLDS

    digest = {"corpus": "ab" * 32}
    m = {"format": "veritrain-run/2", "task": "loop:train.py", "task_source_sha256": "00" * 32, "config": {},
         "seed": 0, "steps": 1, "checkpoint_every": 1, "bits": 32, "mode": "verified",
         "thresholds": dict(DEFAULT_THRESHOLDS), "slack": 2.0, "data_sha256": digest}
    for policy in (Policy(task="loop:train.py"), Policy(task="loop:train.py", data_sha256=digest)):
        with pytest.raises(PolicyError, match="data_sha256.*own loop"):
            policy.admit(m, build=False)
    del m["data_sha256"]
    Policy(task="loop:train.py").admit(m, build=False)
    with pytest.raises(PolicyError, match="field 'data_sha256'"):  # a contract pinning data a loop cannot show
        Policy(task="loop:train.py", data_sha256=digest).admit(m, build=False)
