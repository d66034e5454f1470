"""Data-parallel training (issue 11). Plain DistributedDataParallel in float32 is not reproducible across world
sizes: the gradient all-reduce sums per-rank means in another order than one process sums the whole batch,
so N = 1 and N = 2 end with different weights. This is the problem veritrain's data-parallel semantics
(a fixed number of micro-batches, reduced in float64 and rounded with the engine) must remove."""

import subprocess
import sys

DDP_SCRIPT = '''
import os, sys
import torch, torch.distributed as dist, torch.multiprocessing as mp
from torch.nn.parallel import DistributedDataParallel as DDP

def build():
    g = torch.Generator().manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.Tanh(), torch.nn.Linear(64, 4))
    with torch.no_grad():
        for p in m.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    return m

def data(step):
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randn(32, 16, generator=g), torch.randint(0, 4, (32,), generator=g)

def worker(rank, world, store, out):
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    torch.set_num_threads(1)
    model = DDP(build())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for step in range(5):
        x, y = data(step)
        n = 32 // world
        loss = torch.nn.functional.cross_entropy(model(x[rank*n:(rank+1)*n]), y[rank*n:(rank+1)*n])
        loss.backward(); opt.step(); opt.zero_grad()
    if rank == 0:
        torch.save(model.module.state_dict(), out)
    dist.destroy_process_group()
    os._exit(0)  # gloo's threads can abort the interpreter's shutdown (parallel.finish_rank)

if __name__ == "__main__":
    d = sys.argv[1]
    res = {}
    for world in (1, 2):
        mp.spawn(worker, args=(world, f"{d}/store{world}", f"{d}/w{world}.pt"), nprocs=world)
        res[world] = torch.load(f"{d}/w{world}.pt")
    diff = sum((res[1][k] != res[2][k]).sum().item() for k in res[1])
    print("differing", diff, "of", sum(v.numel() for v in res[1].values()))
'''


def test_plain_ddp_in_float32_differs_between_one_and_two_processes(tmp_path):
    (tmp_path / "ddp.py").write_text(DDP_SCRIPT)
    p = subprocess.run([sys.executable, str(tmp_path / "ddp.py"), str(tmp_path)], capture_output=True, text=True,
                       timeout=600)
    assert p.returncode == 0, p.stderr
    differing = int(p.stdout.split()[1])
    assert differing > 0, p.stdout  # the same seed, data and steps; other weights


CHAIN_SCRIPT = '''
import os, sys
import torch, torch.distributed as dist, torch.multiprocessing as mp
from veritrain import parallel
from veritrain.rounding import Grid

G, P = 5, 3000

def vectors():
    gen = torch.Generator().manual_seed(0)
    # a large gradient that a later one cancels: float64 sums are not all exact, and the order matters
    big = torch.randn(P, generator=gen) * 2.0 ** 40
    return [big, torch.randn(P, generator=gen), -big, torch.randn(P, generator=gen), torch.randn(P, generator=gen)]

def worker(rank, world, store, out):
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    v = vectors()
    mine = {g: v[g] for g in parallel.assignment(G, world)[rank]}
    chained = parallel.chained_reduce(mine, G, Grid(32), chunk=1000)
    gathered = parallel.reduce_in_order(parallel.gather(mine, G), Grid(32), G)
    torch.save((chained, gathered), f"{out}.{rank}")
    dist.destroy_process_group()
    os._exit(0)  # gloo's threads can abort the interpreter's shutdown (parallel.finish_rank)

if __name__ == "__main__":
    d = sys.argv[1]
    alone = parallel.reduce_in_order(vectors(), Grid(32), G)
    v = vectors()
    shuffled = parallel.reduce_in_order([v[0], v[2], v[1], v[3], v[4]], Grid(32), G)
    ok = True
    for world in (2, 3):
        mp.spawn(worker, args=(world, f"{d}/store{world}", f"{d}/r{world}"), nprocs=world)
        for r in range(world):
            c, g = torch.load(f"{d}/r{world}.{r}")
            ok &= torch.equal(c.view(torch.int32), alone.view(torch.int32)) and torch.equal(g.view(torch.int32), alone.view(torch.int32))
    print("equal", ok, "order_matters", not torch.equal(alone, shuffled))
'''


def test_the_chained_sum_and_the_all_gather_give_one_processs_bits(tmp_path):
    """Both ways of reducing across ranks make the same float64 additions in micro-batch order as one process:
    the same bits for 2 and 3 processes, on every rank, on vectors where the order of additions matters."""
    (tmp_path / "chain.py").write_text(CHAIN_SCRIPT)
    p = subprocess.run([sys.executable, str(tmp_path / "chain.py"), str(tmp_path)], capture_output=True, text=True,
                       timeout=600)
    assert p.returncode == 0, p.stderr
    assert p.stdout.split() == ["equal", "True", "order_matters", "True"], p.stdout


def test_micro_batches_are_shared_out_in_contiguous_blocks():
    import pytest

    from veritrain.parallel import assignment

    assert assignment(4, 1) == [range(0, 4)]
    assert assignment(4, 3) == [range(0, 1), range(1, 2), range(2, 4)]
    assert [g for r in assignment(7, 4) for g in r] == list(range(7))
    with pytest.raises(ValueError, match="at least one"):
        assignment(2, 3)


def test_the_reduction_follows_micro_batch_order_where_float64_is_not_exact():
    """float64 sums of float32 gradients are usually exact (so any order gives the same bits), not always:
    the order is fixed so that it never matters which rank held which micro-batch."""
    import torch

    from veritrain.parallel import reduce_in_order
    from veritrain.rounding import Grid

    a, tiny, b = torch.tensor([1.0]), torch.tensor([2.0 ** -60]), torch.tensor([-1.0])
    assert reduce_in_order([a, tiny, b], Grid(32)).item() == 0.0        # (1 + 2^-60) - 1 in float64
    assert reduce_in_order([a, b, tiny], Grid(32)).item() == 2.0 ** -60


# --- data-parallel runs: veritrain train/audit --nproc, the game, resume ---------------------------

import json  # noqa: E402
import os  # noqa: E402
import shutil  # noqa: E402

import pytest  # noqa: E402

from conftest import TASKS_ENV as ENV, audit_json, cli, flip_far_rounding, recommit  # noqa: E402

G, STEPS, EVERY = 4, 4, 2
DP = ["--micro-batches", G, "--steps", STEPS, "--checkpoint-every", EVERY, "--quiet", "--json"]
GPT2 = ["--set", "n_layer=2", "--set", "n_embd=32", "--set", "n_head=2", "--set", "seq_len=16",
        "--set", "batch_size=2", "--set", "max_chars=20000", "--set", "optimizer=adamw"]


def _train(run, task, *args, nproc=1, env=None):
    p = cli("train", task, "--out", run, *DP, *args, "--nproc", nproc, env={**ENV, **(env or {})})
    assert p.returncode == 0, p.stderr
    return json.loads(p.stdout)


_DP_RUNS = {}


def _dp_run(task, tmp_path_factory, shakespeare):
    """A run trained by 2 processes (G = 4 micro-batches per step, AdamW, dropout), and the same run trained
    by one process (each trained once per test session)."""
    if task not in _DP_RUNS:
        args = ["--set", "optimizer=adamw"] if task == "digits-cnn" else ["--set", f"corpus={shakespeare}", *GPT2]
        d = tmp_path_factory.mktemp(f"dp-{task}")
        two = _train(d / "n2", task, *args, nproc=2)
        one = _train(d / "n1", task, *args, nproc=1)
        _DP_RUNS[task] = d / "n2", two, one
    return _DP_RUNS[task]


@pytest.fixture(scope="module", params=["digits-cnn", "gpt2-text"])
def dp_run(request, tmp_path_factory, shakespeare):
    return _dp_run(request.param, tmp_path_factory, shakespeare)


@pytest.fixture(scope="module")
def digits_run(tmp_path_factory, shakespeare):
    return _dp_run("digits-cnn", tmp_path_factory, shakespeare)


def test_two_processes_and_one_train_to_the_same_root(dp_run):
    _, two, one = dp_run
    assert two["root"] == one["root"] and two["final_state_hash"] == one["final_state_hash"]
    m = json.loads(open(os.path.join(two["run"], "manifest.json")).read())
    assert m["micro_batches"] == G
    logs = sorted(os.listdir(os.path.join(two["run"], "logs")))
    assert "step_00000003.micro_00003.vtlog" in logs and "step_00000003.vtlog" in logs  # keyed by micro-batch


@pytest.mark.parametrize("how", ["two processes", "one process, other hardware"])
def test_an_auditor_with_any_number_of_processes_reaches_the_trainers_root(dp_run, how):
    run, two, _ = dp_run
    if how == "two processes":
        p = cli("audit", run, "--json", "--quiet", "--nproc", 2)
        assert p.returncode == 0, p.stderr
        r = json.loads(p.stdout)
    else:
        r = audit_json(run, "isa-default")
        assert r["hardware"]["variant"] == "isa-default"
    assert r["accepted"], r["reasons"]
    assert r["root"] == two["root"] and len(r["checkpoints"]) == STEPS // EVERY
    assert all(c["match"] for c in r["checkpoints"])
    assert r["entries"] > 0  # the micro-batches' and the updates' logs were read


@pytest.fixture(scope="module")
def poisoned(tmp_path_factory):
    """A 2-process run whose rank 1 trains micro-batch 3 of step 3 (the task's batch(15)) on altered data."""
    from veritrain.parallel import assignment

    assert 3 in assignment(G, 2)[1]
    d = tmp_path_factory.mktemp("dp-poison")
    poison = {"VERITRAIN_TEST_POISON_STEP": str(3 * G + 3)}
    _train(d / "run", "poisoned_digits:make_task", nproc=2, env=poison)
    p = cli("audit", d / "run", "--out", d / "audit", "--json", "--quiet", "--task", "poisoned_digits:make_task",
            "--variant", "isa-default", env=ENV)
    return d / "run", d / "audit", poison, json.loads(p.stdout), p.returncode


def test_a_poisoned_micro_batch_on_rank_1_is_rejected_by_the_audit(poisoned):
    _, _, _, r, rc = poisoned
    assert rc == 1 and not r["accepted"]
    assert any("micro-batch 3 differs from what batch(15) yields" in x for x in r["reasons"]), r["reasons"]


def test_the_game_names_the_step_the_micro_batch_and_the_operator(poisoned):
    from test_protocol import serve

    run, audit_dir, poison, _, _ = poisoned
    proc, url = serve(run, {**ENV, **poison})  # the trainer's machine answers with its poisoned pipeline
    try:
        p = cli("dispute", url, audit_dir, "--json", "--task", "poisoned_digits:make_task", env=ENV)
    finally:
        proc.terminate()
        proc.wait()
    v = json.loads(p.stdout)
    assert p.returncode == 1, p.stderr
    assert v["verdict"] == "trainer_wrong", v
    assert (v["interval"], v["step"], v["micro_batch"]) == (1, 3, 3), v
    assert v["operator"] == "aten.convolution.default" and v["module"] == "conv1", v
    assert "micro-batch 3 of step 3" in v["ruling"] and v["referee_ops"] == 1


def test_a_prover_that_serves_another_micro_batch_log_loses(poisoned):
    from veritrain.policy import Policy
    from veritrain.protocol import LocalProver, play

    run, audit_dir, _, _, _ = poisoned

    class SwappedLogs(LocalProver):  # answers micro-batch 2's log when asked for micro-batch 3's
        def log(self, step, micro=None):
            return super().log(step, 2 if micro == 3 else micro)

    audit = json.loads((audit_dir / "audit.json").read_text())
    v = play(SwappedLogs(str(run)), audit, None, Policy(task="poisoned_digits:make_task"))
    assert v["verdict"] == "trainer_wrong"
    assert any("micro-batch 3, does not match its committed record" in r for r in v["reasons"]), v


def test_a_suspicious_entry_in_a_micro_batch_is_ruled_with_its_micro_batch(tmp_path):
    """The trainer steers one rounding of micro-batch 1's forward at step 1 far from any midpoint and logs it
    as a direction entry: every hash matches and the audit rejects only for that entry; the game confirms it
    and names the micro-batch, as it does for a disputed op (the verdict left `micro_batch` out)."""
    import math

    import torch

    from veritrain.engine import TrainerHalf, _EagerSlot
    from veritrain.protocol import Challenger, LocalProver
    from veritrain.rounding import Grid
    from veritrain.runner import TrainOptions, train

    grid, orig, steered = Grid(32), TrainerHalf.record, {}

    def record(self, slot, c):
        e = orig(self, slot, c)
        if self.mode.step == 1 and self.mode.domain == "micro/1" and self.mode.op_index >= 5 and not steered \
                and isinstance(slot, _EagerSlot) and math.prod(slot.shape) >= 64:
            p = flip_far_rounding(e, slot, slot.values_at(torch.arange(math.prod(slot.shape))), grid)
            if p is not None:
                steered.update(position=p)
        return e

    run = tmp_path / "run"
    TrainerHalf.record = record
    try:
        train(TrainOptions(task="digits-cnn", out=str(run), steps=2, checkpoint_every=2, progress=False,
                           micro_batches=2))
    finally:
        TrainerHalf.record = orig
    assert steered, "found nothing to steer"
    p = cli("audit", run, "--out", tmp_path / "audit", "--json", "--quiet")
    r = json.loads(p.stdout)
    assert p.returncode == 1 and r["suspicious"] == 1 and all(c["match"] for c in r["checkpoints"]), r
    v = Challenger(LocalProver(str(run)), json.loads((tmp_path / "audit" / "audit.json").read_text())).play()
    assert v["verdict"] == "trainer_wrong" and "suspicious" in v["ruling"], v
    assert (v["step"], v["micro_batch"]) == (1, 1), v


def test_a_killed_rank_then_resume_gives_the_uninterrupted_root(tmp_path):
    """Rank 1 dies computing micro-batch 2 of step 2, while rank 0 is slow to commit step 2's checkpoint:
    no rank starts an interval before the last one's checkpoint is committed, so the run resumes from step 2.
    (Without that barrier rank 0 was stopped mid-commit and the manifest said 0 steps: seen in the CI.)"""
    task = "killed_digits:make_task"
    p = cli("train", task, "--out", tmp_path / "run", *DP, "--nproc", 2,
            env={**ENV, "VERITRAIN_TEST_KILL_AT": str(2 * G + 2), "VERITRAIN_TEST_SLOW_COMMIT": "2"})
    assert p.returncode == 128 + 9, p.stderr
    assert "rank 1 was killed by SIGKILL" in p.stderr and "--resume --nproc 2" in p.stderr
    m = json.loads((tmp_path / "run" / "manifest.json").read_text())
    assert not m["complete"] and m["steps_completed"] == 2
    p = cli("train", task, "--out", tmp_path / "run", "--resume", "--nproc", 2, "--quiet", "--json", env=ENV)
    assert p.returncode == 0, p.stderr
    resumed = json.loads(p.stdout)
    whole = _train(tmp_path / "whole", task)
    assert resumed["root"] == whole["root"]


def _dp_copy(run, tmp_path):
    dst = tmp_path / "copy"
    shutil.copytree(run, dst)
    return dst


def test_a_malformed_micro_batch_log_is_named(digits_run, tmp_path):
    """A micro-batch log cut short and recommitted (its hash in the step's record): the audit's reason named
    neither the file nor the micro-batch ("<bytes>: truncated ...")."""
    run, _, _ = digits_run
    bad = _dp_copy(run, tmp_path)
    name = bad / "logs" / "step_00000001.micro_00002.vtlog"
    name.write_bytes(name.read_bytes()[:-9])
    recommit(bad)
    assert cli("verify", bad).returncode == 1  # verify reads the log too: malformed
    r = audit_json(bad, "isa-default")
    assert not r["accepted"]
    assert any("step_00000001.micro_00002.vtlog" in x and "<bytes>" not in x for x in r["reasons"]), r["reasons"]


@pytest.mark.parametrize("log, where", [("step_00000001.micro_00002.vtlog", "step 1, micro-batch 2: "),
                                       ("step_00000001.vtlog", "step 1: ")], ids=["micro-batch", "update"])
def test_the_game_rules_against_a_committed_log_of_a_data_parallel_step_that_is_malformed(digits_run, tmp_path, log,
                                                                                          where):
    """A step's logs cut short and recommitted, in the game: their hashes match the committed record, so the
    referee's replay of the step reads them, and a log that does not parse is the trainer's loss, naming the step
    (and the micro-batch, for a micro-batch's log)."""
    from veritrain.policy import Policy
    from veritrain.protocol import LocalProver, play

    run, _, _ = digits_run
    bad = _dp_copy(run, tmp_path)
    name = bad / "logs" / log
    name.write_bytes(name.read_bytes()[:-9])
    recommit(bad)
    p = cli("audit", bad, "--out", tmp_path / "audit", "--json", "--quiet", env=ENV)
    assert p.returncode == 1, p.stderr
    v = play(LocalProver(str(bad)), json.loads((tmp_path / "audit" / "audit.json").read_text()), None, Policy())
    assert v["verdict"] == "trainer_wrong", v
    assert any(f"the trainer's committed files do not replay ({where}" in r for r in v["reasons"]), v


@pytest.mark.parametrize("value", [2, 1, "4", 10**9, None])
def test_a_manifest_that_changes_the_number_of_micro_batches_is_rejected(digits_run, tmp_path, value):
    """The trainer claims another G (or drops it: one micro-batch per step) than the run was trained with."""
    run, _, _ = digits_run
    bad = _dp_copy(run, tmp_path)
    m = json.loads((bad / "manifest.json").read_text())
    if value is None:
        del m["micro_batches"]
    else:
        m["micro_batches"] = value
    m.pop("manifest_sha256", None)
    (bad / "manifest.json").write_text(json.dumps(m))
    r = audit_json(bad, "isa-default")  # the auditor on other hardware
    assert not r["accepted"], r


def test_an_altered_micro_batch_log_is_named(digits_run, tmp_path):
    run, _, _ = digits_run
    bad = _dp_copy(run, tmp_path)
    name = bad / "logs" / "step_00000001.micro_00002.vtlog"
    name.write_bytes(name.read_bytes()[:-1] + b"\0")
    r = audit_json(bad, "isa-default")  # the auditor on other hardware
    assert not r["accepted"]
    assert any("step_00000001.micro_00002.vtlog is not the log the trainer committed to" in x for x in r["reasons"])
    p = cli("verify", bad)
    assert p.returncode == 1 and "step_00000001.micro_00002.vtlog" in p.stdout + p.stderr


def test_the_policy_bounds_and_pins_the_micro_batches():
    from veritrain.policy import Policy, PolicyError

    m = {"format": "veritrain-run/2", "task": "digits-cnn", "seed": 0, "steps": 4, "checkpoint_every": 2, "bits": 32,
         "mode": "verified", "config": {}, "thresholds": {}, "micro_batches": 4}
    assert Policy().admit(m, build=False).micro_batches == 4
    with pytest.raises(PolicyError, match="micro_batches"):
        Policy(micro_batches=8).admit(m, build=False)
    for bad in (1, 0, True, "4", 10**6):
        with pytest.raises(PolicyError, match="micro_batches"):
            Policy().admit({**m, "micro_batches": bad}, build=False)
    one = {k: v for k, v in m.items() if k != "micro_batches"}  # a run of one batch per step names none
    assert Policy(micro_batches=1).admit(one, build=False).micro_batches == 1
    with pytest.raises(PolicyError, match="'micro_batches' is 4, the policy requires 1"):
        Policy(micro_batches=1).admit(m, build=False)


def test_a_contract_file_pins_one_micro_batch_where_it_pins_the_config(tmp_path):
    from veritrain.policy import CONTRACT_FORMAT, Policy

    def contract(**fields):
        path = tmp_path / f"c{len(list(tmp_path.iterdir()))}.json"
        path.write_text(json.dumps({"format": CONTRACT_FORMAT, **fields}))
        return Policy.from_file(str(path))

    assert contract(task="digits-cnn", config={"optimizer": "adamw"}).micro_batches == 1
    assert contract(task="digits-cnn", config={}, micro_batches=None).micro_batches == 1
    assert contract(task="digits-cnn", config={}, micro_batches=8).micro_batches == 8
    assert contract(task="digits-cnn").micro_batches is None  # the config is the run's: so is its batch per step


def test_more_processes_than_micro_batches_is_refused_before_anything_is_written(tmp_path):
    p = cli("train", "digits-cnn", "--out", tmp_path / "run", "--micro-batches", 2, "--steps", 2, "--nproc", 3,
            "--quiet")
    assert p.returncode == 2 and "3 processes for 2 micro-batches" in p.stderr
    assert not (tmp_path / "run").exists()


def test_a_data_parallel_run_of_a_task_with_its_own_step_is_refused_before_anything_is_written(tmp_path):
    """veritrain runs each micro-batch's backward and the optimizer step itself: a task that brings its own
    train_step= cannot be split, and is refused by name."""
    p = cli("train", "own_step_digits:make_task", "--out", tmp_path / "run", "--micro-batches", 2, "--steps", 2,
            "--quiet", env=ENV)
    assert p.returncode == 2 and "a data-parallel run (--micro-batches > 1) needs a task with loss=" in p.stderr, \
        p.stderr
    assert not (tmp_path / "run").exists()


def test_an_audit_on_several_processes_of_a_run_of_one_micro_batch_is_refused(tmp_path):
    """Processes share out a step's micro-batches: a run of one micro-batch per step has nothing to share."""
    run = tmp_path / "run"
    cli("train", "digits-cnn", "--out", run, "--steps", 2, "--checkpoint-every", 2, "--quiet", check=0)
    p = cli("audit", run, "--quiet", "--nproc", 2)
    assert p.returncode == 2 and "is a run of one micro-batch per step: audit it with one process" in p.stderr, \
        p.stderr


def test_torchrun_launches_the_same_run(digits_run, tmp_path):
    """`torchrun --nproc_per_node 2 -m veritrain.cli train ...` (as the README launches on several machines):
    its processes join torchrun's process group; the run is the one `--nproc 2` trains."""
    _, two, _ = digits_run
    p = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                        "-m", "veritrain.cli", "train", "digits-cnn", "--out", str(tmp_path / "run"),
                        *map(str, DP), "--set", "optimizer=adamw"],
                       capture_output=True, text=True, timeout=900, env={**os.environ, **ENV})
    assert p.returncode == 0, p.stderr
    assert json.loads(p.stdout)["root"] == two["root"]


def test_inspect_counts_every_micro_batch_log(digits_run):
    run, _, _ = digits_run
    p = cli("inspect", run, "--json")
    r = json.loads(p.stdout)
    logs = run / "logs"
    sizes = sum(f.stat().st_size for f in logs.iterdir() if f.name != "init.vtlog")
    assert r["micro_batches"] == G and r["log_bytes_total"] == sizes


def test_an_own_loop_refuses_to_run_as_one_rank_of_several(monkeypatch, tmp_path):
    """veritrain.Run is one process per run: under torchrun every rank would write the same run folder."""
    import torch

    import veritrain
    from veritrain.store import RunError

    for k, v in {"RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1"}.items():
        monkeypatch.setenv(k, v)
    model = torch.nn.Linear(2, 2)
    with pytest.raises(RunError, match="one process"):
        veritrain.Run(str(tmp_path / "run"), model, torch.optim.SGD(model.parameters(), lr=0.1))


def test_a_contract_pins_the_micro_batches(digits_run, tmp_path):
    run, _, _ = digits_run
    cli("contract", "digits-cnn", "--out", tmp_path / "c8.json", "--set", "optimizer=adamw", "--micro-batches", 8,
        check=0)
    p = cli("audit", run, "--contract", tmp_path / "c8.json", "--json", "--quiet")
    assert p.returncode == 1 and "'micro_batches' is 4, the policy requires 8" in p.stdout, p.stdout
    p = cli("contract", "digits-cnn", "--out", tmp_path / "c0.json", "--micro-batches", 0)
    assert p.returncode == 2 and "micro_batches must be a whole number in 1..4096" in p.stderr


def test_a_contract_that_pins_the_config_gives_no_micro_batches_unless_it_names_them(digits_run, tmp_path):
    """The attack: the client pins the config (its batch size) and everything else `veritrain contract`
    offers, not --micro-batches (which could not pin 1); the trainer trains each step on G = 4 micro-batches,
    four times the examples the config gives a step, and the audit accepted it."""
    run, _, _ = digits_run
    pins = ["--set", "optimizer=adamw", "--steps", STEPS, "--checkpoint-every", EVERY, "--seed", 0]
    cli("contract", "digits-cnn", "--out", tmp_path / "c.json", *pins, check=0)
    contract = json.loads((tmp_path / "c.json").read_text())
    contract.pop("micro_batches")  # a contract written by hand, or by an older veritrain: the config still pins it
    (tmp_path / "hand.json").write_text(json.dumps(contract))
    cli("contract", "digits-cnn", "--out", tmp_path / "c1.json", *pins, "--micro-batches", 1)
    for name in ("c.json", "hand.json", "c1.json"):
        p = cli("audit", run, "--contract", tmp_path / name, "--json", "--quiet")
        assert p.returncode == 1 and "'micro_batches' is 4, the policy requires 1" in p.stdout, (name, p.stdout)
    assert json.loads((tmp_path / "c.json").read_text())["micro_batches"] == 1
    cli("contract", "digits-cnn", "--out", tmp_path / "c4.json", *pins, "--micro-batches", G, check=0)
    r = json.loads(cli("audit", run, "--contract", tmp_path / "c4.json", "--json", "--quiet", check=0).stdout)
    assert r["accepted"] and r["root"] == digits_run[1]["root"]
