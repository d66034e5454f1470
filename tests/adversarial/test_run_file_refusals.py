"""Every refusal of the run-file reader and the manifest loader (src/veritrain/store.py), one at a time.

A run folder comes from the trainer: its names, file kinds and sizes, and its manifest's fields are hostile
input. The audits in test_hostile_files.py play whole attacks through the command; these tests hold each check
alone (each case fails with its check dropped), including the ones an attack reaches only by a race: a file
replaced, grown or removed between the reader's look at it and its open, which the tests stage by wrapping
``os.open``.
"""

import errno
import os
import struct

import pytest

from veritrain import store
from veritrain.store import RunError, RunFileError, RunRejected

CKPT = store.ckpt_name(0)  # a file in a subfolder: checkpoints/step_00000000.safetensors


def manifest(**fields) -> dict:
    """A manifest load_manifest takes (it checks shape; the policy checks values), with ``fields`` replaced."""
    m = {"format": store.FORMAT, "task": "digits-cnn", "config": {}, "seed": 0, "mode": "verified", "bits": 32,
         "thresholds": {}, "steps": 2, "checkpoint_every": 1,
         "checkpoints": [{"step": 0, "file": CKPT, "state_sha256": "a" * 64}]}
    m.update(fields)
    return m


def write_run(tmp_path, m) -> str:
    run = tmp_path / "run"
    run.mkdir()
    store.save_manifest(str(run), m)
    return str(run)


MALFORMED_MANIFESTS = [  # (id, fields, what the refusal says)
    ("a list, not an object", None, "unknown format"),
    ("another format", {"format": "veritrain-run/1"}, "unknown format 'veritrain-run/1'"),
    ("a task that is a number", {"task": 5}, "field 'task' is missing or not a str"),
    ("a config that is a list", {"config": []}, "field 'config' is missing or not a dict"),
    ("a seed as text", {"seed": "0"}, "field 'seed' is missing or not a int"),
    ("a seed that is true", {"seed": True}, "field 'seed' is missing or not a int"),
    ("a mode that is a number", {"mode": 1}, "field 'mode' is missing or not a str"),
    ("bits that are false", {"bits": False}, "field 'bits' is missing or not a int"),
    ("thresholds that are a list", {"thresholds": []}, "field 'thresholds' is missing or not a dict"),
    ("steps as a float", {"steps": 2.0}, "field 'steps' is missing or not a int"),
    ("no checkpoint interval", {"checkpoint_every": None}, "field 'checkpoint_every' is missing or not a int"),
    ("checkpoints that are an object", {"checkpoints": {}}, "field 'checkpoints' is missing or not a list"),
    ("negative steps", {"steps": -1}, "steps must be >= 0 and checkpoint_every > 0"),
    ("a checkpoint every 0 steps", {"checkpoint_every": 0}, "steps must be >= 0 and checkpoint_every > 0"),
    ("one micro-batch named", {"micro_batches": 1}, "field 'micro_batches' is '1'"),
    ("leaves that are text", {"leaves": "00"}, "field 'leaves' is not a list"),
    ("a leaf that is not a leaf", {"leaves": ["00" * 40]}, "leaf 0 is not a leaf's data in hex"),
    ("a leaf of 3 steps with 2 records",
     {"leaves": [(store.LEAF_TAG + struct.pack("<QQQ", 0, 0, 3) + bytes(128)).hex()]},
     "leaf 0 is not a leaf's data in hex (malformed leaf data: step range and record count disagree)"),
    ("a checkpoint entry that is text", {"checkpoints": ["step 0"]}, "malformed checkpoint entry step 0"),
    ("a negative checkpoint step", {"checkpoints": [{"step": -1, "file": CKPT, "state_sha256": "a" * 64}]},
     "malformed checkpoint entry"),
    ("a checkpoint step that is true", {"checkpoints": [{"step": True, "file": CKPT, "state_sha256": "a" * 64}]},
     "malformed checkpoint entry"),
    ("a checkpoint with no state", {"checkpoints": [{"step": 0, "file": CKPT}]}, "malformed checkpoint entry"),
    ("a checkpoint file outside the run", {"checkpoints": [{"step": 0, "file": "../x", "state_sha256": "a" * 64}]},
     "names '../x', not checkpoints/step_00000000.safetensors"),
]


@pytest.mark.parametrize("fields, words", [r[1:] for r in MALFORMED_MANIFESTS], ids=[r[0] for r in MALFORMED_MANIFESTS])
def test_load_manifest_refuses_each_malformed_field_and_names_it(tmp_path, fields, words):
    """The manifest's shape is checked before any of it is used (a string where a step count goes would be a
    TypeError deep in an audit): each field of the wrong type or range rejects the run, naming the field."""
    run = tmp_path / "run"
    run.mkdir()
    m = [] if fields is None else manifest(**fields)
    store.write_json_atomic(str(run / store.MANIFEST), m)  # as the trainer wrote it, with no digest to match
    with pytest.raises(RunRejected) as refused:
        store.load_manifest(str(run))
    assert words in str(refused.value), str(refused.value)


def test_load_manifest_takes_a_well_formed_manifest_and_refuses_it_altered(tmp_path):
    """The control for the refusals above (their manifests differ from this one in one field), and the digest:
    a manifest edited after it was saved no longer matches its manifest_sha256."""
    run = write_run(tmp_path, manifest(micro_batches=2))
    assert store.load_manifest(run)["micro_batches"] == 2
    path = os.path.join(run, store.MANIFEST)
    with open(path) as f:
        text = f.read()
    with open(path, "w") as f:
        f.write(text.replace('"seed": 0', '"seed": 1'))
    with pytest.raises(RunRejected, match="is altered"):
        store.load_manifest(run)
    with open(path, "w") as f:
        f.write('{"format": ')
    with pytest.raises(RunRejected, match="is not valid JSON"):
        store.load_manifest(run)


def test_a_manifest_that_is_there_but_unreadable_is_that_error_not_a_missing_run(tmp_path):
    """A manifest.json that is a folder (or a fifo, a symlink, too large) is refused as what it is; only a
    missing one says the folder is not a run."""
    run = tmp_path / "run"
    (run / store.MANIFEST).mkdir(parents=True)
    with pytest.raises(RunFileError, match="manifest.json is a folder, not a regular file"):
        store.load_manifest(str(run))
    os.rmdir(run / store.MANIFEST)
    with pytest.raises(RunError, match="has no manifest.json: not a veritrain run directory"):
        store.load_manifest(str(run))


@pytest.fixture()
def run(tmp_path):
    """A run folder with a manifest and one checkpoint file (its contents do not matter to the reader)."""
    d = write_run(tmp_path, manifest())
    os.mkdir(os.path.join(d, "checkpoints"))
    with open(os.path.join(d, CKPT), "wb") as f:
        f.write(b"x" * 100)
    return d


@pytest.mark.parametrize("name", ["../manifest.json", "checkpoints/../manifest.json", "/etc/passwd",
                                  "logs/step_1.vtlog", 5, None])
def test_only_canonical_run_file_names_are_opened(run, name):
    """Names come from the trainer (a manifest's entries, a prover's query): only the canonical ones are files."""
    with pytest.raises(RunError, match="is not the name of a run file"):
        store.read_run_file(run, name)


def test_a_run_folder_that_is_not_a_folder_or_lacks_a_subfolder_is_named(run, tmp_path):
    not_a_folder = tmp_path / "file"
    not_a_folder.write_bytes(b"")
    with pytest.raises(RunError, match="cannot be opened"):
        store.read_run_file(str(not_a_folder), store.MANIFEST)
    with pytest.raises(RunFileError, match=r"is missing \(the run has no logs/ folder\)") as e:
        store.read_run_file(run, store.INIT_LOG)
    assert e.value.missing
    with open(os.path.join(run, "logs"), "wb"):
        pass
    with pytest.raises(RunFileError, match=r"is missing \(logs is not a folder\)") as e:
        store.read_run_file(run, store.INIT_LOG)
    assert e.value.missing


@pytest.fixture()
def between_look_and_open(monkeypatch):
    """Run ``act`` when the reader opens the file named ``base`` (after it looked at the file with stat): the
    window in which a hostile trainer can swap the file. Returns a function that installs it."""
    real_open = os.open

    def install(base, act):
        def opening(path, flags, *args, **kwargs):
            if os.path.basename(str(path)) == base:
                act(path, kwargs.get("dir_fd"))
            return real_open(path, flags, *args, **kwargs)
        monkeypatch.setattr(os, "open", opening)
    return install


def _raise(err):
    def act(path, dir_fd):
        raise OSError(err, os.strerror(err))
    return act


def test_a_file_swapped_between_look_and_open_is_refused(run, between_look_and_open):
    """The reader stats a file, refuses a non-regular or oversized one unopened, then opens it: a file swapped in
    between (another inode, one grown past its cap, one removed, a symlink) is refused by what it is then."""
    path = os.path.join(run, CKPT)
    with store.open_run_file(run, CKPT) as f:  # the control: nothing swapped
        assert f.read() == b"x" * 100

    def replace(p, dir_fd):
        os.replace(os.path.join(run, "swap"), path)
    with open(os.path.join(run, "swap"), "wb") as f:
        f.write(b"y" * 100)
    between_look_and_open(os.path.basename(CKPT), replace)
    with pytest.raises(RunFileError, match="was replaced while it was opened"):
        store.read_run_file(run, CKPT)

    def grow(p, dir_fd):
        with open(path, "ab") as f:
            f.write(b"x" * 100)
    between_look_and_open(os.path.basename(CKPT), grow)
    with pytest.raises(RunFileError, match="is 200 bytes, over the 150-byte limit"):
        store.read_run_file(run, CKPT, max_bytes=150)

    for err, words in [(errno.ENOENT, "does not exist"), (errno.ELOOP, "is a symbolic link"),
                       (errno.EACCES, r"cannot be opened \(Permission denied\)")]:
        between_look_and_open(os.path.basename(CKPT), _raise(err))
        with pytest.raises(RunFileError, match=words) as e:
            store.read_run_file(run, CKPT)
        assert e.value.missing == (err == errno.ENOENT)

    between_look_and_open("checkpoints", _raise(errno.EACCES))
    with pytest.raises(RunFileError, match=r"cannot be opened \(checkpoints/: Permission denied\)"):
        store.read_run_file(run, CKPT)


def test_a_file_that_cannot_be_looked_at_or_grows_while_read_is_refused(run, monkeypatch):
    real_stat = os.stat

    def stat(path, *args, **kwargs):
        if os.path.basename(str(path)) == os.path.basename(CKPT):
            raise OSError(errno.EACCES, os.strerror(errno.EACCES))
        return real_stat(path, *args, **kwargs)
    monkeypatch.setattr(os, "stat", stat)
    with pytest.raises(RunFileError, match=r"cannot be read \(Permission denied\)"):
        store.read_run_file(run, CKPT)
    monkeypatch.setattr(os, "stat", real_stat)

    with store.open_run_file(run, CKPT, max_bytes=150) as f:
        assert f.read(60) == b"x" * 60
        with open(os.path.join(run, CKPT), "ab") as g:  # grown after it was opened
            g.write(b"x" * 100)
        with pytest.raises(RunFileError, match="grew past the 150-byte limit while it was read"):
            f.read()


def test_without_openat_a_symlinked_subfolder_is_still_refused(run, tmp_path, monkeypatch):
    """Where the platform has no openat, the reader checks the subfolder by name before opening by path."""
    monkeypatch.setattr(store, "_AT", False)
    assert store.read_run_file(run, CKPT) == b"x" * 100
    elsewhere = tmp_path / "elsewhere"
    os.rename(os.path.join(run, "checkpoints"), elsewhere)
    os.symlink(elsewhere, os.path.join(run, "checkpoints"))
    with pytest.raises(RunFileError, match="is in checkpoints/, a symbolic link"):
        store.read_run_file(run, CKPT)


def test_a_file_over_its_cap_is_refused_before_it_is_opened(run, between_look_and_open):
    """Its size from stat is enough to refuse it: the reader does not open it (the check after the open is for a
    file that grew in between, above)."""
    def opened(path, dir_fd):
        raise AssertionError(f"{path} was opened")
    between_look_and_open(os.path.basename(CKPT), opened)
    with pytest.raises(RunFileError, match=r"is 100 bytes, over the 99-byte limit for a checkpoint \(refused unread\)"):
        store.read_run_file(run, CKPT, max_bytes=99)
