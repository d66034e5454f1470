"""The dishonest trainer's data and randomness.

A run's config names the data files the auditor reads (resnet-cifar10's ``data``: a CIFAR-10 archive or its
folder), so those files are hostile input like the run folder itself: the loader must end in bounded time and
memory with an error that names the problem. Loads that might misbehave run in a child process under an
address-space limit and a timeout, so that a regression fails the test instead of exhausting the machine.
"""

import io
import os
import pickle
import subprocess
import sys
import tarfile
import textwrap

import numpy as np
import pytest

from conftest import TINY_TEXT as TEXT, cli, small_corpus as corpus

BATCHES = [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]
FOLDER = "cifar-10-batches-py"


def batch_bytes(n=4, seed=0) -> bytes:
    """One batch in the real files' format: a pickled dict with a uint8 (N, 3072) array and a list of labels."""
    rng = np.random.default_rng(seed)
    return pickle.dumps({b"batch_label": b"x", b"labels": rng.integers(0, 10, n).tolist(),
                         b"data": rng.integers(0, 256, (n, 3072), dtype=np.uint8), b"filenames": [b"f"] * n},
                        protocol=2)


class Zeros(io.RawIOBase):
    """``n`` zero bytes, streamed (a compressed bomb's content, never held in memory here)."""

    def __init__(self, n):
        self.n = n

    def readable(self):
        return True

    def readinto(self, b):
        k = min(len(b), self.n)
        b[:k] = bytes(k)
        self.n -= k
        return k


def make_tar(path, members, mode="w:gz"):
    """A tar archive of ``members``: (name, bytes) or (name, size) for ``size`` zero bytes."""
    with tarfile.open(path, mode, compresslevel=1) if mode.endswith("gz") else tarfile.open(path, mode) as tar:
        for name, content in members:
            info = tarfile.TarInfo(name)
            if isinstance(content, int):
                info.size = content
                tar.addfile(info, Zeros(content))
            else:
                info.size = len(content)
                tar.addfile(info, io.BytesIO(content))
    return path


def real_members():
    return [(f"{FOLDER}/{name}", batch_bytes(4, i)) for i, name in enumerate(BATCHES)]


def make_folder(tmp_path, replace=None):
    """An extracted archive; ``replace``: {batch name: bytes} written instead of the real batch."""
    folder = tmp_path / FOLDER
    folder.mkdir()
    for i, name in enumerate(BATCHES):
        (folder / name).write_bytes((replace or {}).get(name, batch_bytes(4, i)))
    return tmp_path


def load_in_child(path, limit_gib=3, timeout=60):
    """``load_cifar10(path)`` in a child process under an address-space limit: (outcome, text), outcome one of
    "loaded" (text: the shapes), "TaskError" (text: its message), another exception's name, or "timeout"."""
    code = textwrap.dedent(f"""
        import resource, sys
        resource.setrlimit(resource.RLIMIT_AS, ({limit_gib} << 30, {limit_gib} << 30))
        from veritrain.task import TaskError
        from veritrain.tasks.cifar import load_cifar10
        try:
            x, y, xt, yt = load_cifar10(sys.argv[1])
        except TaskError as e:
            print("TaskError", e)
        except BaseException as e:
            print(type(e).__name__, str(e)[:300])
        else:
            print("loaded", x.shape, y.shape, xt.shape, yt.shape)
    """)
    try:
        p = subprocess.run([sys.executable, "-c", code, str(path)], capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return "timeout", f"load_cifar10 did not return within {timeout} s"
    lines = p.stdout.strip().splitlines()
    if not lines:
        return f"exit {p.returncode}", p.stderr[-2000:]
    outcome, _, text = lines[-1].partition(" ")
    return outcome, text


def refused(path, match, **kw):
    outcome, text = load_in_child(path, **kw)
    assert outcome == "TaskError" and all(m in text for m in match), (outcome, text)
    return text


# --- the CIFAR-10 archive: sizes, members, file types ------------------------------------------------


def test_an_honest_archive_and_folder_still_load(tmp_path):
    from veritrain.tasks.cifar import load_cifar10

    archive = make_tar(tmp_path / "c.tar.gz", [(FOLDER, 0)] + real_members())
    x, y, xt, yt = load_cifar10(str(archive))
    assert x.shape == (20, 3, 32, 32) and y.shape == (20,) and xt.shape == (4, 3, 32, 32)
    for mode, suffix in (("w:bz2", "bz2"), ("w:xz", "xz"), ("w", "tar")):
        other = make_tar(tmp_path / f"c.{suffix}", real_members(), mode=mode)
        x2, y2, _, _ = load_cifar10(str(other))
        assert np.array_equal(x2, x) and np.array_equal(y2, y)
    (tmp_path / "f").mkdir()
    x3, y3, _, _ = load_cifar10(str(make_folder(tmp_path / "f")))
    assert np.array_equal(x3, x) and np.array_equal(y3, y)
    # the data hash a run commits to is of the six batches, whatever holds them
    digests = [{}, {}, {}]
    load_cifar10(str(archive), digests[0])
    load_cifar10(str(make_tar(tmp_path / "d.tar", real_members(), mode="w")), digests[1])
    load_cifar10(str(tmp_path / "f"), digests[2])
    assert digests[0] == digests[1] == digests[2] and len(digests[0]["data"]) == 64
    (tmp_path / "g").mkdir()
    other = {}
    load_cifar10(str(make_folder(tmp_path / "g", {"test_batch": batch_bytes(4, 9)})), other)
    assert other != digests[0]


@pytest.mark.timeout(120)
def test_a_compressed_bomb_in_place_of_a_batch_is_refused_unread(tmp_path):
    """A gzip bomb: data_batch_1 is 100 MiB of zeros in 460 KB of archive. The loader read every member it
    wanted whole (``extractfile(m).read()``), however large; a batch is at most MAX_BATCH_BYTES (64 MiB, the real
    ones are 31 MB)."""
    members = real_members()
    members[0] = (members[0][0], 100 << 20)
    archive = make_tar(tmp_path / "bomb.tar.gz", members)
    assert os.path.getsize(archive) < 1 << 20
    refused(archive, ["data_batch_1", "has 104857600 bytes, more than 67108864"])


@pytest.mark.timeout(120)
def test_an_archive_that_unpacks_past_the_cap_is_refused(tmp_path):
    """600 MiB of zeros (a member the loader does not want) before the batches: tarfile decompressed through it
    to reach the next header, and a 1 GiB archive unpacks to about a terabyte (hours); a header claiming 2**40
    bytes sends it the same way. The loader stops after MAX_UNPACKED_BYTES (512 MiB) unpacked."""
    archive = make_tar(tmp_path / "long.tar.gz", [(f"{FOLDER}/readme.html", 600 << 20)] + real_members())
    refused(archive, ["unpacks to more than 536870912 bytes"])


@pytest.mark.timeout(120)
def test_an_archive_of_many_members_is_refused(tmp_path):
    """getmembers() kept every member's header in memory, as many as the archive holds (a million of them from
    a 10 MB archive); the real archive has 8, the loader reads at most MAX_MEMBERS (1024)."""
    archive = make_tar(tmp_path / "many.tar.gz", [(f"junk/{i}", b"") for i in range(1100)] + real_members())
    refused(archive, ["has more than 1024 members"])


@pytest.mark.timeout(120)
@pytest.mark.parametrize("kind", ["fifo", "device", "folder fifo", "folder symlink to a device"])
def test_a_data_path_that_is_not_a_regular_file_is_refused(tmp_path, kind):
    """The config's ``data`` a FIFO (the loader hung in open), /dev/zero, or a folder whose batch is a FIFO or a
    symlink to /dev/zero (read until memory ran out): only regular files are read."""
    if kind == "fifo":
        path = tmp_path / "data.tar.gz"
        os.mkfifo(path)
    elif kind == "device":
        path = "/dev/zero"
    else:
        path = make_folder(tmp_path)
        batch = tmp_path / FOLDER / "data_batch_2"
        batch.unlink()
        if kind == "folder fifo":
            os.mkfifo(batch)
        else:
            os.symlink("/dev/zero", batch)
    refused(path, ["is not a regular file"], timeout=30)


# --- the batches' pickles: no allocation larger than the file -----------------------------------------


class _Call:
    """Pickles as ``func(*args)`` (with ``state`` set by BUILD): the dishonest trainer's hand-made opcodes."""

    def __init__(self, func, args, state=None):
        self.func, self.args, self.state = func, args, state

    def __reduce__(self):
        return (self.func, self.args) if self.state is None else (self.func, self.args, self.state)


def _reconstruct():
    from numpy._core.multiarray import _reconstruct as r

    return r


ROWS = 1 << 15  # 100 MB of images from a pickle of a few hundred bytes


def _hostile_batch(kind) -> bytes:
    labels = [0] * ROWS
    if kind == "array of a shape of its own":  # _reconstruct allocates the shape, unread
        data = _Call(_reconstruct(), (np.ndarray, (ROWS, 3072), b"B"))
    elif kind == "bytes(n) as the array's bytes":  # ndarray.__setstate__ with bytes(n) as its raw data
        data = _Call(_reconstruct(), (np.ndarray, (0,), b"b"),
                     (1, (ROWS, 3072), np.dtype(np.uint8), False, _Call(bytes, (ROWS * 3072,))))
    elif kind == "rows that are one list":  # [row] * ROWS: two bytes of pickle per 3072-byte row
        row = [0] * 3072
        data = [row] * ROWS
    else:  # "labels that are one list": each label a reference to one long list
        data = np.zeros((ROWS // 1024, 3072), np.uint8)
        labels = [[0] * 3072] * (ROWS // 1024)
    raw = pickle.dumps({b"data": data, b"labels": labels}, protocol=4)  # "builtins", as a hand-made pickle names it
    assert len(raw) < 1 << 20
    return raw


@pytest.mark.timeout(120)
@pytest.mark.parametrize("kind", ["array of a shape of its own", "bytes(n) as the array's bytes",
                                  "rows that are one list", "labels that are one list"])
def test_a_batch_pickle_cannot_allocate_more_than_its_bytes(tmp_path, kind):
    """The unpickler admitted only NumPy's and builtin types, but let a small pickle build a large batch:
    ``_reconstruct`` with a shape of its own and ``bytes(n)`` allocate what they are told, and np.asarray
    turned a list of references to one list into a full array. The loader accepted each (100 MB of images
    from a file of under 1 MB; the real batches are 31 MB of their own bytes)."""
    path = make_folder(tmp_path, replace={"test_batch": _hostile_batch(kind)})
    text = refused(path, ["test_batch is not a CIFAR-10 batch"])
    want = {"array of a shape of its own": "refusing an array of shape",
            "bytes(n) as the array's bytes": "refusing bytes() with arguments",
            "rows that are one list": "its data is a list, not a uint8 array",
            "labels that are one list": "labels are not a list of integers"}[kind]
    assert want in text, text


def test_the_audit_of_a_run_whose_data_is_a_bomb_is_rejected_with_the_reason(tmp_path):
    """End to end: a resnet-cifar10 run's config naming a hostile archive. Without a contract the run's config is
    built; the audit must reject it (exit 1) naming the archive, not crash or exhaust memory."""
    import json

    from veritrain import store

    good = make_tar(tmp_path / "good.tar.gz", real_members())
    run = tmp_path / "run"
    cli("train", "resnet-cifar10", "--out", run, "--steps", 1, "--checkpoint-every", 1, "--quiet",
        "--set", f"data={good}", "--set", "width=2", "--set", "batch_size=2", "--set", "arch=resnet18", check=0)
    m = store.load_manifest(str(run))
    assert m["config"]["data"] == str(good)
    members = real_members()
    members[2] = (members[2][0], 100 << 20)
    make_tar(good, members)  # the same path, now a bomb: what the auditor finds there
    p = cli("audit", run, "--json", "--quiet")
    assert p.returncode == 1, (p.returncode, p.stdout[-2000:], p.stderr[-2000:])
    reasons = " ".join(json.loads(p.stdout)["reasons"])
    assert "data_batch_3" in reasons and "more than 67108864" in reasons, reasons


# --- randomness: the run seed under a contract ---------------------------------------------------------


def test_a_contract_that_pins_the_config_pins_the_run_seed(tmp_path):
    """The run seed keys every random draw under the engine: the initial weights (domain "init") and every
    dropout mask. A task's ``init_seed`` (torch.manual_seed in its code) draws nothing under the engine: a
    config with init_seed 5 builds the same initial state as init_seed 0 (so ``veritrain train`` refuses one,
    pointing at --seed). A contract written by ``veritrain
    contract TASK`` pinned the config (init_seed and data_seed included) and every setting but the seed, so
    the trainer could grind over 2**63 initialisations and dropout streams (train many, publish the one it
    likes) and the audit accepted each. A contract that pins the config now pins the seed: 0 unless it names
    one (``--seed``); a run with another seed is refused, naming the field."""
    import json

    from veritrain import store

    from veritrain.checkpoint import hash_state
    from veritrain.engine import EngineConfig
    from veritrain.runner import build_initial

    common = ["--set", "width=4", "--set", "batch_size=8", "--steps", 1, "--checkpoint-every", 1]
    runs = {}
    for label, extra in (("honest", []), ("ground", ["--seed", 12345])):
        runs[label] = tmp_path / label.replace(" ", "_")
        cli("train", "digits-cnn", "--out", runs[label], "--quiet", *common, *extra, check=0)
    init = {k: store.load_manifest(str(r))["initial_state_sha256"] for k, r in runs.items()}
    assert init["honest"] != init["ground"], init  # the run seed draws the weights
    built = [build_initial("digits-cnn", {"width": 4, "batch_size": 8, "init_seed": s}, EngineConfig()) for s in (0, 5)]
    assert len({hash_state(t.model, t.optimizer, t.scheduler, 0) for t in built}) == 1  # init_seed draws nothing
    p = cli("train", "digits-cnn", "--out", tmp_path / "init5", "--quiet", *common, "--set", "init_seed=5")
    assert p.returncode == 2 and "'init_seed' (5) draws nothing in a run" in p.stderr and "--seed" in p.stderr, p.stderr
    assert not (tmp_path / "init5").exists()

    contract = tmp_path / "contract.json"
    cli("contract", "digits-cnn", "--out", contract, "--set", "width=4", "--set", "batch_size=8", "--steps", 1,
        "--checkpoint-every", 1, check=0)
    written = json.loads(contract.read_text())
    assert written["seed"] == 0  # the client did not think of the seed: `veritrain contract` pins 0
    hand = tmp_path / "hand.json"  # a contract written by hand (or by an older veritrain) without the field
    hand.write_text(json.dumps({k: v for k, v in written.items() if k != "seed"}))
    for c in (contract, hand):
        p = cli("audit", runs["honest"], "--contract", c, "--json", "--quiet")
        assert p.returncode == 0, p.stderr[-2000:]
        p = cli("audit", runs["ground"], "--contract", c, "--json", "--quiet")
        assert p.returncode == 1 and "field 'seed'" in p.stdout + p.stderr, (c, p.returncode, p.stdout[-1500:],
                                                                              p.stderr[-1500:])
    pinned = tmp_path / "seed.json"
    cli("contract", "digits-cnn", "--out", pinned, "--set", "width=4", "--set", "batch_size=8", "--steps", 1,
        "--checkpoint-every", 1, "--seed", 12345, check=0)
    p = cli("audit", runs["ground"], "--contract", pinned, "--json", "--quiet")
    assert p.returncode == 0, p.stderr[-2000:]  # a seed the contract names is the agreed one


# --- the GPT-2 tokenizer files --------------------------------------------------------------------------


@pytest.mark.timeout(120)
@pytest.mark.parametrize("kind", ["vocab.json a fifo", "merges.txt a symlink to a device", "vocab.json too large"])
def test_tokenizer_files_that_are_not_small_regular_files_are_refused_unread(tmp_path, kind):
    """gpt2-text's and gpt2-shakespeare's ``tokenizer`` folder is named by a run's config, and the tokenizer
    library read its files whole: a FIFO hung the build (and so the audit), a symlink to /dev/zero read until
    memory ran out. As for the corpus (``read_corpus``), each file must be a regular file within a cap
    (MAX_TOKENIZER_FILE_BYTES, 64 MiB: GPT-2's are 1 MB and 0.5 MB)."""
    folder = tmp_path / "tok"
    folder.mkdir()
    vocab, merges = folder / "vocab.json", folder / "merges.txt"
    if kind == "vocab.json a fifo":
        os.mkfifo(vocab)
        merges.write_text("#version: 0.2\n")
        want = "vocab.json' is not a regular file"
    elif kind == "merges.txt a symlink to a device":
        vocab.write_text("{}")
        os.symlink("/dev/zero", merges)
        want = "merges.txt' is not a regular file"
    else:
        with open(vocab, "wb") as f:  # sparse: 65 MiB that take no disk
            f.truncate((64 << 20) + 1)
        merges.write_text("#version: 0.2\n")
        want = "vocab.json' has 67108865 bytes, more than 67108864"
    code = textwrap.dedent("""
        import resource, sys
        resource.setrlimit(resource.RLIMIT_AS, (3 << 30, 3 << 30))
        from veritrain.task import TaskError
        from veritrain.tasks.gpt2_text import load_bpe_tokenizer
        try:
            load_bpe_tokenizer(sys.argv[1])
        except TaskError as e:
            print("TaskError", e)
        except BaseException as e:
            print(type(e).__name__, str(e)[:300])
        else:
            print("loaded")
    """)
    try:
        p = subprocess.run([sys.executable, "-c", code, str(folder)], capture_output=True, text=True, timeout=40)
        out = p.stdout.strip().splitlines()[-1:] or [f"exit {p.returncode}: {p.stderr[-1500:]}"]
    except subprocess.TimeoutExpired:
        out = ["timeout: load_bpe_tokenizer did not return within 40 s"]
    assert out[0].startswith("TaskError") and want in out[0], out[0]


# --- randomness: keys out of range ----------------------------------------------------------------------


@pytest.mark.parametrize("seed", [2**64, -2**63 - 1])
def test_a_data_seed_out_of_the_generators_range_gets_a_verdict(tmp_path, seed):
    """Without a contract a run's own config is built: ``data_seed`` is an int, so it passed the policy's type
    check, and the task built. Its first batch then keyed the counter-based generator with it: struct.error
    (argument out of range) in ``randomness.philox_key``, and the audit ended in a traceback with no verdict.
    The key's fields are checked (a ValueError naming them), and the step's failure rejects the run."""
    import json

    from conftest import recommit
    from veritrain import store
    from veritrain.runner import TrainOptions, train

    run = tmp_path / "run"
    train(TrainOptions(task="digits-cnn", out=str(run), steps=1, checkpoint_every=1, progress=False,
                       config={"width": 4, "batch_size": 8}))
    m = store.load_manifest(str(run))
    m["config"]["data_seed"] = seed
    store.save_manifest(str(run), m)
    recommit(run)
    p = cli("audit", run, "--json", "--quiet")
    assert p.returncode == 1 and p.stdout.strip(), (p.returncode, p.stderr[-2000:])
    reasons = " ".join(json.loads(p.stdout)["reasons"])
    assert "64-bit" in reasons and "data/order" in reasons, reasons


def test_the_generators_key_names_a_field_out_of_range():
    from veritrain import randomness

    with pytest.raises(ValueError, match=r"seed .* not an integer in -2\*\*63\.\.2\*\*63-1"):
        randomness.Stream(2**63, 0, 0, "op")
    with pytest.raises(ValueError, match="step"):
        randomness.permutation(0, 2**63, 4)
    with pytest.raises(ValueError, match="index"):
        randomness.Stream(0, 0, 1.5, "op")
    assert randomness.Stream(2**63 - 1, -2**63, 0, "op").raw(1).shape == (1,)


def test_a_contract_file_pins_seed_0_where_it_pins_the_config_and_names_no_seed(tmp_path):
    import json

    from veritrain.policy import CONTRACT_FORMAT, Policy

    def contract(**fields):
        path = tmp_path / f"c{len(list(tmp_path.iterdir()))}.json"
        path.write_text(json.dumps({"format": CONTRACT_FORMAT, **fields}))
        return Policy.from_file(str(path))

    assert contract(task="digits-cnn", config={}).seed == 0
    assert contract(task="digits-cnn", config={}, seed=None).seed == 0
    assert contract(task="digits-cnn", config={}, seed=7).seed == 7
    assert contract(task="digits-cnn").seed is None  # the config is the run's: so is its seed


# --- data contents: a path names no bytes -------------------------------------------------------------


def test_a_run_whose_corpus_lies_in_the_run_folder_is_refused(tmp_path):
    """A run's config named its corpus by a relative path, `run/corpus.txt`, and the trainer shipped that file
    in its run folder. An auditor working in the folder that holds the run read the trainer's copy, so the
    audit ACCEPTED a run trained on whatever the trainer chose. A config path inside the run folder is now
    refused: the auditor reads its own data."""
    import json
    import shutil

    elsewhere = tmp_path / "trainer"
    corpus(elsewhere / "run" / "corpus.txt", seed=1)  # the poisoned text, where the trainer's relative path finds it
    run = tmp_path / "run"
    cli("train", "gpt2-text", "--out", run, "--set", "corpus=run/corpus.txt", *TEXT, check=0, cwd=elsewhere)
    shutil.copy(elsewhere / "run" / "corpus.txt", run / "corpus.txt")  # shipped with the run
    p = cli("audit", "run", "--json", "--quiet", "--variant", "combo", cwd=tmp_path)
    assert p.returncode == 1, (p.returncode, p.stdout[-2000:], p.stderr[-2000:])
    r = json.loads(p.stdout)
    assert not r["accepted"] and any("config 'corpus' names 'run/corpus.txt', inside the run folder" in x
                                     for x in r["reasons"]), r["reasons"]
    p = cli("eval", "run", "--json", cwd=tmp_path)
    assert p.returncode == 1 and "inside the run folder" in p.stdout + p.stderr, (p.stdout[-1000:], p.stderr[-1000:])


def test_the_run_commits_to_its_data_and_a_contract_can_pin_it(tmp_path):
    """The manifest's config names a corpus by its path; the run now also commits to the bytes it read there
    (data_sha256, in the run description under the root). An auditor whose copy differs is told so before any
    replay, naming the key; a contract may pin the data hashes, and a run trained on other data is refused
    naming the field; an auditor whose own copy is not the contract's data gets an error of its own (exit 2)."""
    import json
    import shutil

    from veritrain import store
    from veritrain.commitments import data_hash

    text = corpus(tmp_path / "data" / "corpus.txt")
    run = tmp_path / "run"
    cli("train", "gpt2-text", "--out", run, "--set", f"corpus={text}", *TEXT, check=0)
    m = store.load_manifest(str(run))
    assert m["data_sha256"] == {"corpus": data_hash([("corpus", text.read_bytes())])}
    assert "data_sha256" in store.run_description(m)  # committed: leaves and root cover it
    pin = tmp_path / "contract.json"
    pin.write_text(json.dumps({"format": "veritrain-contract/1", "data_sha256": m["data_sha256"]}))
    assert cli("audit", run, "--contract", pin, "--json", "--quiet", "--variant", "combo").returncode == 0
    written = tmp_path / "written.json"  # `veritrain contract --pin-data` reads the client's copy as the task does
    cli("contract", "gpt2-text", "--out", written, "--set", f"corpus={text}", "--pin-data", check=0)
    assert json.loads(written.read_text())["data_sha256"] == m["data_sha256"]
    p = cli("contract", "digits-cnn", "--out", tmp_path / "none.json", "--pin-data")
    assert p.returncode == 2 and "reads no data files to pin" in p.stderr and not (tmp_path / "none.json").exists()

    other = tmp_path / "other"  # the same settings, other text
    cli("train", "gpt2-text", "--out", other, "--set", f"corpus={corpus(tmp_path / 'b' / 'corpus.txt', 2)}",
        *TEXT, check=0)
    p = cli("audit", other, "--contract", pin, "--json", "--quiet")
    assert p.returncode == 1 and "field 'data_sha256'" in p.stdout, p.stdout[-2000:]

    from conftest import recommit

    stripped = tmp_path / "stripped"  # the commitment removed, the run recommitted: nothing left to compare
    shutil.copytree(run, stripped)
    m = store.load_manifest(str(stripped))
    del m["data_sha256"]
    store.save_manifest(str(stripped), m)
    recommit(stripped)
    p = cli("audit", stripped, "--json", "--quiet")
    assert p.returncode == 1 and "commits to no data for it" in p.stdout, (p.returncode, p.stdout[-2000:])

    text.write_text(text.read_text().replace("king", "queen"))  # the auditor's copy is not the run's data
    p = cli("audit", run, "--json", "--quiet", "--variant", "combo")
    assert p.returncode == 1, (p.returncode, p.stderr[-2000:])
    assert any("data: config 'corpus': the data read here hashes to" in x for x in json.loads(p.stdout)["reasons"])
    p = cli("audit", run, "--contract", pin, "--json", "--quiet")  # and not the contract's: the auditor's problem
    assert p.returncode == 2 and "the auditor's data: config 'corpus'" in p.stderr, (p.returncode, p.stderr[-2000:])


def test_a_resumed_run_reads_the_data_it_started_from(tmp_path):
    """A process that resumes a run (or a rank beside rank 0) builds the task from its own copy of the data:
    a copy that changed since the run started would go on training on other data under the same commitment."""
    from veritrain import runner, store
    from veritrain.task import build

    text = corpus(tmp_path / "corpus.txt")
    config = {"corpus": str(text), "n_layer": 1, "n_embd": 16, "n_head": 2, "seq_len": 16, "batch_size": 2}
    task = build("gpt2-text", config)
    m = {"data_sha256": dict(task.data_sha256)}
    runner._check_same_data(m, task)
    text.write_text(text.read_text() + "more\n")
    with pytest.raises(store.RunError, match="config 'corpus': the data read here hashes to .* read other data"):
        runner._check_same_data(m, build("gpt2-text", config))
