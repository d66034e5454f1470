"""Step-indexed data (veritrain.data) and the trainer's check that batch(step) is a pure function of step."""

import json
import os
import sys
import textwrap

import numpy as np
import pytest
import torch
from torch.utils.data import (BatchSampler, DataLoader, IterableDataset, RandomSampler, SequentialSampler,
                              SubsetRandomSampler, TensorDataset)

from conftest import cli
from veritrain import randomness
from veritrain.data import DOMAIN, StepBatchSampler, StepLoader, check_pure_batches
from veritrain.policy import Policy
from veritrain.runner import TrainOptions, audit, train
from veritrain.task import TaskError


def dataset(n=10):
    x = torch.arange(n * 3, dtype=torch.float32).reshape(n, 3)
    return TensorDataset(x, torch.arange(n) % 3)


def same(a, b):
    return len(a) == len(b) and all(torch.equal(p, q) for p, q in zip(a, b))


# --- the sampler and the loader -------------------------------------------------------------------


def test_epochs_short_and_dropped_batches_and_random_access():
    n, bs, seed = 10, 4, 7
    s = StepBatchSampler(n, bs, seed=seed)
    assert s.steps_per_epoch == 3
    for e in range(3):  # three epochs: each a fresh permutation of the data set, the last batch short
        batches = [s.indices(e * 3 + k) for k in range(3)]
        assert [len(b) for b in batches] == [4, 4, 2]
        assert sum(batches, []) == randomness.permutation(seed, e, n, DOMAIN).tolist()
    assert s.indices(0) + s.indices(1) + s.indices(2) != s.indices(3) + s.indices(4) + s.indices(5)
    d = StepBatchSampler(n, bs, seed=seed, drop_last=True)  # the short batch is dropped
    assert d.steps_per_epoch == 2
    for e in range(3):
        assert d.indices(2 * e) + d.indices(2 * e + 1) == randomness.permutation(seed, e, n, DOMAIN)[:8].tolist()
    q = StepBatchSampler(n, bs, seed=seed, shuffle=False)
    assert [q.indices(k) for k in range(4)] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9], [0, 1, 2, 3]]
    # any range of steps without the ones before it, in a fresh sampler
    assert list(StepBatchSampler(n, bs, seed=seed, start=4, stop=8)) == [s.indices(k) for k in range(4, 8)]
    assert len(StepBatchSampler(n, bs, seed=seed, start=4, stop=8)) == 4
    assert list(StepBatchSampler(n, bs, seed=seed, start=0, stop=8)) == [s.indices(k) for k in range(8)]
    with pytest.raises(TaskError, match="drops every example"):
        StepBatchSampler(3, 4, seed=0, drop_last=True)


def test_the_order_comes_from_the_counter_based_generator_not_torchs():
    n, seed = 12, 3
    got = []
    for torch_seed in (1, 2):
        torch.manual_seed(torch_seed)
        ld = StepLoader(dataset(n), 4, seed=seed)
        got.append([ld.indices(k) for k in range(6)])
        got.append([ld.batch(k)[1].tolist() for k in range(6)])
        got.append([b[1].tolist() for _, b in ld.iter_steps(0, 6)])
    assert got[0] == got[3] and got[1] == got[4] and got[2] == got[5]
    for e in range(2):  # the permutation is Philox's, as a direct call computes it
        keys = randomness.Stream(seed, e, 0, "data/order").raw(n)
        direct = np.argsort(keys, kind="stable").tolist()
        assert sum(got[0][3 * e: 3 * e + 3], []) == direct
    # where the batch size divides the data set, the batches are randomness.epoch_order's
    assert got[0] == [randomness.epoch_order(seed, k, 4, n).tolist() for k in range(6)]
    assert StepLoader(dataset(n), 4, seed=seed + 1).indices(0) != got[0][0]


@pytest.mark.parametrize("drop_last", [False, True])
def test_batch_and_iter_steps_agree_across_epochs_with_and_without_workers(drop_last):
    ds = dataset(10)
    direct = StepLoader(ds, 4, seed=5, drop_last=drop_last)
    assert len(direct) == direct.steps_per_epoch == (2 if drop_last else 3)
    want = [direct.batch(k) for k in range(7)]  # 2+ epochs, in any order
    for k in range(7):
        idx = direct.indices(k)
        assert same(want[k], (ds.tensors[0][idx], ds.tensors[1][idx]))
        assert len(idx) == (2 if not drop_last and k % 3 == 2 else 4)
    assert same(StepLoader(ds, 4, seed=5, drop_last=drop_last).batch(5), want[5])
    for workers in (0, 2):
        ld = StepLoader(ds, 4, seed=5, drop_last=drop_last, num_workers=workers)
        assert ld.loader(0, 7).num_workers == workers
        got = list(ld.iter_steps(0, 7))
        assert [s for s, _ in got] == list(range(7))
        assert all(same(b, want[s]) for s, b in got), workers
        assert all(same(b, want[s]) for s, b in ld.iter_steps(3, 7)), workers


def test_from_dataloader_takes_the_loaders_settings_and_refuses_what_has_no_step_order():
    ds = dataset(10)

    def collate(items):
        return torch.stack([x for x, _ in items]) * 2

    ld = StepLoader.from_dataloader(DataLoader(ds, batch_size=4, shuffle=True, drop_last=True, collate_fn=collate), 9)
    assert (ld.shuffle, ld.drop_last, ld.batch_size, ld.steps_per_epoch) == (True, True, 4, 2)
    assert ld.indices(0) == StepLoader(ds, 4, seed=9).indices(0)
    assert torch.equal(ld.batch(1), ds.tensors[0][ld.indices(1)] * 2)
    seq = StepLoader.from_dataloader(DataLoader(ds, batch_size=3), 0)
    assert (seq.shuffle, seq.drop_last) == (False, False)
    assert [seq.indices(k) for k in range(5)] == [[0, 1, 2], [3, 4, 5], [6, 7, 8], [9], [0, 1, 2]]
    assert same(seq.batch(1), next(x for i, x in enumerate(DataLoader(ds, batch_size=3)) if i == 1))
    w = StepLoader.from_dataloader(DataLoader(ds, batch_size=4, num_workers=2, prefetch_factor=3), 0)
    assert w.num_workers == 2 and w.dataloader_kwargs["prefetch_factor"] == 3

    class Stream(IterableDataset):
        def __iter__(self):
            return iter(range(10))

    refused = [
        (DataLoader(Stream(), batch_size=2), "IterableDataset: it has no random access"),
        (DataLoader(ds, batch_size=2, sampler=SubsetRandomSampler(range(5))), "sampler is SubsetRandomSampler"),
        (DataLoader(ds, sampler=RandomSampler(ds, replacement=True), batch_size=2), "with replacement"),
        (DataLoader(ds, batch_sampler=BatchSampler(SequentialSampler(ds), 2, False)), "custom batch_sampler"),
        (DataLoader(ds, batch_size=None), "custom batch_sampler"),
    ]
    for loader, message in refused:
        with pytest.raises(TaskError, match=message):
            StepLoader.from_dataloader(loader, 0)
    with pytest.raises(TaskError, match="IterableDataset"):
        StepLoader(Stream(), 2)
    with pytest.raises(TaskError, match="drop batch_sampler, sampler"):
        StepLoader(ds, 2, sampler=None, batch_sampler=None)


def test_step_loader_arguments_that_define_no_step_order_are_refused_by_name():
    """A size, batch size, seed, step range or step that is not one, a loader that is not a DataLoader, a data set
    without random access: each refused with an error naming the argument, not a wrong order later."""
    ds = dataset(10)
    refused = [
        (lambda: StepBatchSampler(0, 2, seed=0), TaskError, "the data set's size must be a positive integer, got 0"),
        (lambda: StepBatchSampler(10, True, seed=0), TaskError, "batch_size must be a positive integer, got True"),
        (lambda: StepBatchSampler(10, 2.0, seed=0), TaskError, "batch_size must be a positive integer, got 2.0"),
        (lambda: StepBatchSampler(10, 2, seed=2**63), TaskError, "seed must be an integer"),
        (lambda: StepBatchSampler(10, 2, seed="0"), TaskError, "seed must be an integer"),
        (lambda: StepBatchSampler(4, 8, seed=0, drop_last=True), TaskError, "drops every example"),
        (lambda: StepBatchSampler(10, 2, seed=0, start=-1), ValueError, "need 0 <= start <= stop"),
        (lambda: StepBatchSampler(10, 2, seed=0, start=3, stop=2), ValueError, "need 0 <= start <= stop"),
        (lambda: StepBatchSampler(10, 2, seed=0).indices(-1), ValueError, "step must be a non-negative integer"),
        (lambda: StepBatchSampler(10, 2, seed=0).indices(1.0), ValueError, "step must be a non-negative integer"),
        (lambda: len(StepBatchSampler(10, 2, seed=0)), TypeError, "has no length"),
        (lambda: StepLoader.from_dataloader([ds], 0), TaskError, "expects a torch.utils.data.DataLoader, got list"),
        (lambda: StepLoader(object(), 2), TaskError, "object is not a map-style data set"),
    ]
    for make, error, message in refused:
        with pytest.raises(error, match=message):
            make()
    assert len(StepBatchSampler(10, 2, seed=0, start=3, stop=7)) == 4


# --- the trainer refuses batch(step) with hidden state --------------------------------------------

USER_TASKS = '''
import numpy as np
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

from veritrain import Task
from veritrain.data import StepLoader


def data(n=20):
    g = np.random.default_rng(0)
    x = torch.from_numpy(g.standard_normal((n, 3)).astype(np.float32))
    return TensorDataset(x, torch.from_numpy(g.integers(0, 2, n)))


def task(batch, batch_indices=None):
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    return Task(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), batch=batch,
                batch_indices=batch_indices, loss=lambda m, b: F.cross_entropy(m(b[0]), b[1]))


def step_loader(config):  # honest: batches indexed by step
    loader = StepLoader(data(), 8, seed=1)
    return task(loader.batch, loader.indices)


def augmented(config):  # honest: noise drawn by the engine inside the step, keyed by the step
    loader = StepLoader(data(), 8, seed=1)

    def batch(step):
        x, y = loader.batch(step)
        return x + 0.1 * torch.randn_like(x), y

    return task(batch, loader.indices)


def iterator(config):  # the next batch of an ordinary DataLoader
    it = iter(DataLoader(data(), batch_size=4, shuffle=True))
    return task(lambda step: next(it))


def epoch_cache(config):  # reshuffles with NumPy's global generator when a new epoch begins
    ds, state = data(16), {}
    np.random.seed(0)

    def batch(step):
        epoch, k = divmod(step, 2)
        if state.get("epoch") != epoch:
            state["epoch"], state["perm"] = epoch, np.random.permutation(16)
        idx = torch.from_numpy(state["perm"][8 * k: 8 * k + 8])
        return ds.tensors[0][idx], ds.tensors[1][idx]

    return task(batch)


def lazy(config):  # the same data every time, but built with a float op on first use
    ds, cache = data(), {}

    def batch(step):
        if "x" not in cache:
            cache["x"] = ds.tensors[0] * 4.0
        return cache["x"][:8], ds.tensors[1][:8]

    return task(batch)
'''


@pytest.fixture
def user_tasks(tmp_path, monkeypatch, request):
    """A module of task functions in tmp_path, on sys.path (and PYTHONPATH for the command line)."""
    name = "vt_user_tasks_" + request.node.name.replace("[", "_").replace("]", "").replace("-", "_")
    (tmp_path / "code").mkdir()
    (tmp_path / "code" / f"{name}.py").write_text(textwrap.dedent(USER_TASKS))
    monkeypatch.syspath_prepend(str(tmp_path / "code"))
    yield name
    sys.modules.pop(name, None)


def opts(task, out, steps=6, every=3):
    return TrainOptions(task=task, out=str(out), steps=steps, checkpoint_every=every, progress=False)


def test_a_task_pulling_batches_from_a_dataloader_iterator_is_refused_and_nothing_is_written(tmp_path, user_tasks):
    out = tmp_path / "run"
    env = {"PYTHONPATH": str(tmp_path / "code") + os.pathsep + os.environ.get("PYTHONPATH", "")}
    p = cli("train", f"{user_tasks}:iterator", "--out", out, "--steps", "4", "--quiet", env=env)
    assert p.returncode == 2, p.stderr
    assert f"task {user_tasks}:iterator: batch(step) is not a pure function of step: batch(0) called again " \
           "returned different data than the first call" in p.stderr
    assert "DataLoader iterator" in p.stderr and "veritrain.data.StepLoader" in p.stderr
    assert "Traceback" not in p.stderr and not out.exists()  # the folder is as it was: absent
    out.mkdir()  # ... or empty
    for steps in (1, 4):  # a run of one step calls batch(0) twice
        with pytest.raises(TaskError, match=r"batch\(0\) called again returned different data"):
            train(opts(f"{user_tasks}:iterator", out, steps=steps))
        assert os.listdir(out) == []


def test_hidden_state_that_shows_mid_run_is_refused_at_the_checkpoint(tmp_path, user_tasks):
    out = tmp_path / "run"
    with pytest.raises(TaskError, match=r"batch\(0\) called again returned different data than what step 0 "
                                        r"trained on"):
        train(opts(f"{user_tasks}:epoch_cache", out))  # epoch 1 begins at step 2, inside interval 0
    m = json.loads((out / "manifest.json").read_text())
    assert [c["step"] for c in m["checkpoints"]] == [0] and not m["complete"]  # the interval is not committed


def test_a_batch_that_does_engine_work_on_first_use_is_refused(tmp_path, user_tasks):
    with pytest.raises(TaskError, match=r"batch\(0\) called again did other work than the first call "
                                        r"\(0 rounded ops, 0 random draws, not 1 rounded ops"):
        train(opts(f"{user_tasks}:lazy", tmp_path / "run"))
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("fn", ["step_loader", "augmented"])
def test_a_step_loader_task_trains_and_passes_full_and_partial_audits(tmp_path, user_tasks, fn):
    run = tmp_path / "run"
    m = train(opts(f"{user_tasks}:{fn}", run, steps=7))  # 3 steps an epoch (the last one short)
    assert m["complete"] and [c["step"] for c in m["checkpoints"]] == [0, 3, 6, 7]
    assert json.loads((run / "records" / "step_00000002.json").read_text())["batch_indices"] == \
        StepLoader(dataset(20), 8, seed=1).indices(2)
    policy = Policy.from_options(task=f"{user_tasks}:{fn}")  # the auditor names the code it runs
    for intervals in (None, "1", "2"):
        r = audit(str(run), progress=False, intervals=intervals, policy=policy)
        assert r.accepted, (intervals, r.reasons)
        assert [i["interval"] for i in r.intervals] == ([0, 1, 2] if intervals is None else [int(intervals)])


def test_check_pure_batches():
    calls = iter(range(100))
    assert set(check_pure_batches(lambda s: torch.tensor([s]), [0, 1, 0])) == {0, 1}
    with pytest.raises(TaskError, match=r"task t: batch\(0\) is|batch\(0\) called again returned different data"):
        check_pure_batches(lambda s: torch.tensor([next(calls)]), [0, 1, 0], name="t")
    h = check_pure_batches(lambda s: torch.tensor([s]), [3])[3]
    check_pure_batches(lambda s: torch.tensor([s]), [3], recorded={3: h})
    with pytest.raises(TaskError, match="than what step 3 trained on"):
        check_pure_batches(lambda s: torch.tensor([s + 1]), [3], recorded={3: h})
