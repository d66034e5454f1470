"""Built-in tasks' data loading: tokenizer files, corpus errors."""

import json
import os

import pytest

from conftest import shared_file
from veritrain.task import TaskError
from veritrain.tasks.gpt2_text import load_bpe_tokenizer, tokenize


def test_gpt2_bpe_from_the_shared_files():
    folder = shared_file("gpt2-tokenizer")
    tok = load_bpe_tokenizer(folder)
    assert len(tok) == 50257
    assert tok("Hello world", add_special_tokens=False)["input_ids"] == [15496, 995]
    ids, vocab = tokenize("Hello world", folder)
    assert ids.tolist() == [15496, 995] and vocab == 50257


@pytest.mark.timeout(60)
def test_a_corpus_that_is_not_a_regular_file_is_refused_unread(tmp_path):
    """A run's config names the corpus: a FIFO hung the auditor at open, /dev/zero with max_chars 0 read until
    memory ran out. A corpus must be a regular file of at most MAX_CORPUS_BYTES."""
    from veritrain.tasks.gpt2_text import read_corpus

    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    for path in (fifo, "/dev/zero"):
        with pytest.raises(TaskError, match="is not a regular file"):
            read_corpus(str(path), 0)


def test_a_small_bpe_in_gpt2_format(tmp_path):
    """vocab.json + merges.txt in GPT-2's format (byte-level symbols), made here."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    symbols = list(bytes_to_unicode().values())
    vocab = {s: i for i, s in enumerate(symbols)}
    vocab["ab"] = len(vocab)
    (tmp_path / "vocab.json").write_text(json.dumps(vocab))
    (tmp_path / "merges.txt").write_text("#version: 0.2\na b\n")
    tok = load_bpe_tokenizer(str(tmp_path))
    assert tok("abc", add_special_tokens=False)["input_ids"] == [vocab["ab"], vocab["c"]]


def test_broken_tokenizer_files_are_named(tmp_path):
    (tmp_path / "vocab.json").write_text("{}")
    (tmp_path / "merges.txt").write_text("#version: 0.2\n")
    with pytest.raises(TaskError, match="empty or broken vocabulary|cannot load"):
        load_bpe_tokenizer(str(tmp_path))
    (tmp_path / "vocab.json").write_text("not json")
    with pytest.raises(TaskError, match=str(tmp_path)):
        load_bpe_tokenizer(str(tmp_path))


# --- CIFAR-10 and the resnet-cifar10 task --------------------------------------------------------

import pickle  # noqa: E402
import tarfile  # noqa: E402

import numpy as np  # noqa: E402
import torch  # noqa: E402

from veritrain.task import build  # noqa: E402
from veritrain.tasks.cifar import load_cifar10  # noqa: E402


def cifar_batch(n, seed):
    rng = np.random.default_rng(seed)
    return {b"batch_label": b"x", b"labels": rng.integers(0, 10, n).tolist(),
            b"data": rng.integers(0, 256, (n, 3072), dtype=np.uint8), b"filenames": [b"f"] * n}


def make_cifar(tmp_path, n=20, as_tar=True):
    """A small archive in cifar-10-python.tar.gz's exact layout (pickled dicts of a uint8 (N, 3072) array)."""
    folder = tmp_path / "cifar-10-batches-py"
    folder.mkdir()
    names = [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]
    for i, name in enumerate(names):
        (folder / name).write_bytes(pickle.dumps(cifar_batch(n, i), protocol=2))
    if not as_tar:
        return tmp_path
    path = tmp_path / "cifar-10-python.tar.gz"
    with tarfile.open(path, "w:gz") as tar:
        tar.add(folder, arcname="cifar-10-batches-py")
    return path


def test_cifar_loader_reads_the_archive_and_the_folder(tmp_path):
    archive = make_cifar(tmp_path)
    x, y, xt, yt = load_cifar10(str(archive))
    assert x.shape == (100, 3, 32, 32) and x.dtype == np.uint8 and y.shape == (100,) and xt.shape == (20, 3, 32, 32)
    want = cifar_batch(20, 0)
    assert np.array_equal(x[:20].reshape(20, -1), want[b"data"]) and y[:20].tolist() == want[b"labels"]
    for folder in (tmp_path, tmp_path / "cifar-10-batches-py"):
        x2, y2, _, _ = load_cifar10(str(folder))
        assert np.array_equal(x2, x) and np.array_equal(y2, y)


def test_cifar_loader_errors_name_the_problem(tmp_path):
    with pytest.raises(TaskError, match="does not exist"):
        load_cifar10(str(tmp_path / "nope.tar.gz"))
    (tmp_path / "junk.tar.gz").write_bytes(b"not a tar")
    with pytest.raises(TaskError, match="not a readable tar"):
        load_cifar10(str(tmp_path / "junk.tar.gz"))
    make_cifar(tmp_path, as_tar=False)
    (tmp_path / "cifar-10-batches-py" / "data_batch_3").unlink()
    with pytest.raises(TaskError, match="no data_batch_3"):
        load_cifar10(str(tmp_path))


def test_cifar_loader_refuses_pickles_that_would_run_code(tmp_path):
    make_cifar(tmp_path, as_tar=False)

    class Evil:
        def __reduce__(self):
            return (os.system, ("echo pwned",))

    (tmp_path / "cifar-10-batches-py" / "test_batch").write_bytes(pickle.dumps({b"data": Evil()}))
    with pytest.raises(TaskError, match="refusing to load"):
        load_cifar10(str(tmp_path))


def test_cifar_augmentation_flips_half_the_images_and_crops_all_nine_offsets():
    from veritrain.tasks.resnet_cifar10 import augment

    n = 8192
    ramp = np.arange(1, 33, dtype=np.float32)  # each image rises left to right and top to bottom
    images = np.broadcast_to(ramp[None, None, None, :] + 100 * ramp[None, None, :, None], (n, 3, 32, 32)).copy()
    out = augment(images, seed=0, step=3)
    row = out[:, 0, 16]  # columns 12 and 20 lie inside the image whatever the crop's offset
    flipped = row[:, 12] > row[:, 20]
    # 1/2: 4096 +- 45 (1 sigma); a flip with probability 4/9 (one draw in [0, 9) for three) gives about 3641
    assert 3870 < flipped.sum() < 4322, flipped.sum()
    # the horizontal offset dx in 0..8 moves column 16 to the image's column 12 + dx (mirrored if flipped)
    col = np.where(flipped, row[:, 15], row[:, 16]) % 100 - 1
    assert sorted(set((col - 12).astype(int).tolist())) == list(range(9))
    assert not np.array_equal(out, augment(images, seed=0, step=4))  # a function of (seed, step)


def test_resnet_cifar10_task_on_cifar_files_and_on_digits(tmp_path):
    archive = make_cifar(tmp_path)
    task = build("resnet-cifar10", {"data": str(archive), "width": 8, "batch_size": 4})
    x, y = task.batch(3)
    assert x.shape == (4, 3, 32, 32) and x.dtype == torch.float32 and y.shape == (4,)
    x2, _ = build("resnet-cifar10", {"data": str(archive), "width": 8, "batch_size": 4}).batch(3)
    assert torch.equal(x, x2)  # augmentation is a function of (seed, step)
    plain, _ = build("resnet-cifar10", {"data": str(archive), "width": 8, "batch_size": 4, "augment": False}).batch(3)
    assert not torch.equal(x, plain)
    d = build("resnet-cifar10", {"data": "digits", "width": 8, "batch_size": 4, "arch": "resnet50"})
    assert d.batch(0)[0].shape == (4, 3, 32, 32)
    assert set(d.evaluate(d.model)) == {"accuracy", "loss", "examples"}
    with pytest.raises(TaskError, match="config 'data' is required"):
        build("resnet-cifar10", {})


# --- gpt2-shakespeare ------------------------------------------------------------------------------


def test_gpt2_shakespeare_from_local_pretrained_weights(tmp_path, shakespeare):
    from transformers import GPT2Config, GPT2LMHeadModel

    tok = shared_file("gpt2-tokenizer")
    small = {"corpus": shakespeare, "tokenizer": tok, "n_layer": 1, "n_embd": 32, "n_head": 2, "max_chars": 20000,
             "batch_size": 2, "seq_len": 16}
    torch.manual_seed(5)
    saved = GPT2LMHeadModel(GPT2Config(vocab_size=50257, n_layer=1, n_embd=32, n_head=2, n_positions=64))
    saved.save_pretrained(tmp_path / "pre")
    task = build("gpt2-shakespeare", {**small, "pretrained": str(tmp_path / "pre")})
    assert torch.equal(task.model.transformer.wte.weight, saved.transformer.wte.weight)
    assert task.model.config.resid_pdrop == 0.1 and task.scheduler is not None
    ids = task.batch(0)
    assert ids.shape == (2, 17)
    fresh = build("gpt2-shakespeare", small)
    assert not torch.equal(fresh.model.transformer.wte.weight, saved.transformer.wte.weight)
    lr0 = task.optimizer.param_groups[0]["lr"]
    task.run_step(ids)
    assert task.optimizer.param_groups[0]["lr"] < lr0  # the linear schedule steps per optimizer step
    assert "perplexity" in task.evaluate(task.model)


@pytest.mark.parametrize("override, message", [
    ({"corpus": None}, "config 'corpus' is required"),
    ({"corpus": "/no/such.txt"}, "'/no/such.txt'"),
    ({"tokenizer": None}, "config 'tokenizer' is required"),
    ({"tokenizer": "/no/such/folder"}, "config 'tokenizer': '/no/such/folder'"),
    ({"pretrained": "/no/such/model"}, "config 'pretrained': '/no/such/model'"),
])
def test_gpt2_shakespeare_errors_name_key_and_path(shakespeare, override, message):
    cfg = {"corpus": shakespeare, "tokenizer": shared_file("gpt2-tokenizer"), "n_layer": 1, "n_embd": 32,
           "n_head": 2, "max_chars": 5000, **override}
    with pytest.raises(TaskError, match=message):
        build("gpt2-shakespeare", cfg)


RANGED_TASKS = {"digits-cnn": "digits_cnn", "gpt2-text": "gpt2_text", "gpt2-shakespeare": "gpt2_shakespeare",
                "resnet-cifar10": "resnet_cifar10"}


def _outside(interval: str, default):
    """Values just outside an interval as ``check_ranges`` reads it, of the default's type, and non-finite ones."""
    low, high = (float(b) for b in interval[1:-1].split(","))
    cast = type(default)
    out = [cast(low) if interval[0] == "(" else cast(low) - (1 if cast is int else 1e-9)]
    if high != float("inf"):
        out.append(cast(high) if interval[-1] == ")" else cast(high) + (1 if cast is int else 1e-9))
    if cast is float:
        out += [float("nan"), float("inf")]
    return out


@pytest.mark.parametrize("task", sorted(RANGED_TASKS))
def test_a_config_that_builds_but_means_nothing_is_refused_naming_the_key(task):
    """seq_len 0, dropout 1 or NaN, a learning rate of inf, no held-out data: each built a task (some trained
    to NaN or to nothing) with no error. Each is refused before any data is read, naming the key."""
    import importlib

    from veritrain.task import build

    mod = importlib.import_module(f"veritrain.tasks.{RANGED_TASKS[task]}")
    assert mod.RANGES and set(mod.RANGES) <= set(mod.DEFAULTS)
    for key, interval in mod.RANGES.items():
        default = mod.DEFAULTS[key]
        for bad in _outside(interval, default):
            with pytest.raises(TaskError, match=f"{task}: config '{key}' = .* is outside "):
                build(task, {key: bad})
    if task.startswith("gpt2"):
        with pytest.raises(TaskError, match="'n_embd' .* not a multiple of 'n_head'"):
            build(task, {"n_embd": 30, "n_head": 4})
