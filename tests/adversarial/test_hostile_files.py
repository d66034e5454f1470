"""A hostile run folder: the dishonest trainer controls every byte (and every file type) under RUN_DIR.

The auditor must open run files only by their canonical names inside the run, read only regular files
within their size caps, decode logs with every bound checked, and end every command in bounded time and
memory with its documented errors (docs/FORMAT.md, "Reading a run as hostile input"). Commands that
might misbehave run in a child process under a 4 GiB address-space limit and a timeout, so that a
regression fails the test instead of exhausting the machine.
"""

import json
import math
import os
import shutil
import stat
import subprocess
import sys
import tempfile
import textwrap
import threading

import numpy as np
import pytest
import torch
import zstandard
from hypothesis import HealthCheck, assume, given, settings, strategies as st

from conftest import cli, recommit, rewrite_checkpoint
from veritrain import store
from veritrain.commitments import canonical_json
from veritrain.logformat import (MAGIC, LogFormatError, StepLogReader, StepLogWriter, _varint, positions_to_gaps,
                                 read_records)
from veritrain.store import MANIFEST, RunError, ckpt_name, log_name, record_name

STEPS = 2
AS_LIMIT = 4 << 30  # address space of a child command: a reader that slurps /dev/zero fails instead of eating RAM
TIMEOUT = int(os.environ.get("VT_HOSTILE_TIMEOUT", "90"))  # seconds for one child command; honest ones take a few seconds


@pytest.fixture(scope="module")
def honest(tmp_path_factory):
    """One small committed run (2 steps, a checkpoint after each), trained once for the module."""
    run = tmp_path_factory.mktemp("adversarial") / "run"
    cli("train", "digits-cnn", "--out", run, "--steps", STEPS, "--checkpoint-every", 1, "--quiet", check=0)
    return run


@pytest.fixture()
def run(honest, tmp_path):
    copy = tmp_path / "run"
    shutil.copytree(honest, copy, symlinks=True)
    return copy


def _limit():
    import resource

    resource.setrlimit(resource.RLIMIT_AS, (AS_LIMIT, AS_LIMIT))


def hostile(argv, timeout=TIMEOUT):
    """Run argv in a child under the address-space limit; kill it after ``timeout`` seconds.
    Returns (exit code, stdout, stderr, peak RSS in bytes); the exit code is None when it was killed."""
    env = dict(os.environ)
    env.pop("VERITRAIN_VARIANT_APPLIED", None)
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        p = subprocess.Popen(argv, stdout=out, stderr=err, env=env, preexec_fn=_limit)
        killed = threading.Event()

        def kill():
            killed.set()
            p.kill()

        timer = threading.Timer(timeout, kill)
        timer.start()
        try:
            _, status, usage = os.wait4(p.pid, 0)
        finally:
            timer.cancel()
        p.returncode = code = os.waitstatus_to_exitcode(status)
        out.seek(0)
        err.seek(0)
        return (None if killed.is_set() else code), out.read().decode(errors="replace"), \
            err.read().decode(errors="replace"), usage.ru_maxrss * 1024


def hostile_cli(*args, timeout=TIMEOUT):
    return hostile([sys.executable, "-m", "veritrain.cli", *map(str, args)], timeout)


def assert_verify_names(run_dir, name, *words):
    """`veritrain verify --json` ends, exits 1 and names ``name`` (with one of ``words`` in its problem)."""
    code, out, err, _ = hostile_cli("verify", run_dir, "--json")
    assert code is not None, f"verify did not end within {TIMEOUT} s"
    assert "Traceback" not in err, err
    assert code == 1, (code, out, err)
    problems = [p for p in json.loads(out)["problems"] if p["file"] == name]
    assert problems, json.loads(out)["problems"]
    if words:
        assert any(w in p["problem"] for p in problems for w in words), problems
    return problems


def assert_audit_refuses(run_dir, name, exits=(1,)):
    """`veritrain audit --json` ends without a traceback, does not accept, and names ``name``."""
    code, out, err, _ = hostile_cli("audit", run_dir, "--json", "--quiet")
    assert code is not None, f"audit did not end within {TIMEOUT} s"
    assert "Traceback" not in err, err
    assert code in exits, (code, out[-2000:], err[-2000:])
    if code == 1:
        r = json.loads(out)
        assert not r["accepted"]
        assert any(os.path.basename(name) in x for x in r["reasons"]), r["reasons"]
    else:
        assert os.path.basename(name) in err or name in err, err


# --- (a) the manifest names a file outside the run ----------------------------------------------


def _atime_works(folder) -> bool:
    probe = os.path.join(folder, "probe")
    with open(probe, "wb") as f:
        f.write(b"x")
    os.utime(probe, ns=(10**9, os.stat(probe).st_mtime_ns))
    with open(probe, "rb") as f:
        f.read()
    return os.stat(probe).st_atime_ns != 10**9


def test_manifest_naming_a_file_outside_the_run_is_refused_unread(run, tmp_path):
    """The trainer moves a valid checkpoint out of the run and points the manifest's entry at it
    (`../elsewhere/...`), recommitting the manifest: the auditor must not follow the name."""
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    outside = elsewhere / "x.safetensors"
    shutil.move(run / ckpt_name(1), outside)
    m = store.load_manifest(str(run))
    entry = next(c for c in m["checkpoints"] if c["step"] == 1)
    entry["file"] = "../elsewhere/x.safetensors"
    store.save_manifest(str(run), m)  # a consistent manifest_sha256: only the name is hostile
    watch = _atime_works(str(elsewhere))
    os.utime(outside, ns=(10**9, os.stat(outside).st_mtime_ns))

    code, out, err, _ = hostile_cli("audit", run, "--json", "--quiet")
    assert code in (1, 2) and "Traceback" not in err, (code, out[-2000:], err[-2000:])
    if code == 1:
        assert not json.loads(out)["accepted"]
    assert "elsewhere" in out + err or "step_00000001" in out + err
    code, out, err, _ = hostile_cli("verify", run, "--json")
    assert code == 1 and not json.loads(out)["ok"]
    if watch:
        assert os.stat(outside).st_atime_ns == 10**9, "the auditor read a file outside the run"


def test_a_task_run_committing_to_no_init_log_is_refused_by_the_audit(run):
    """The trainer deletes its initialisation log and recommits with init_log_sha256 null, as an own loop built
    without veritrain.init has: `verify` finds the files consistent with that manifest (it has no such log to
    check), but the audit of a task run reads the log its initial state was built with and refuses the run."""
    os.remove(run / store.INIT_LOG)
    recommit(run)
    assert store.load_manifest(str(run))["init_log_sha256"] is None
    code, out, err, _ = hostile_cli("verify", run, "--json")
    assert code == 0 and json.loads(out)["ok"], (out[-2000:], err[-2000:])
    code, out, err, _ = hostile_cli("audit", run, "--json", "--quiet", "--variant", "combo")
    assert code in (1, 2) and "Traceback" not in err, (code, out[-2000:], err[-2000:])
    if code == 1:
        assert not json.loads(out)["accepted"]
    assert "init.vtlog" in out + err


@pytest.mark.parametrize("leaves", [["zz"], [5], "ab" * 8, {"0": "00"}, "cut short"],
                         ids=["not hex", "numbers", "a string", "an object", "cut short"])
def test_leaves_that_are_not_leaves_are_refused_with_a_verdict(run, leaves):
    """The manifest's leaves as text that is not hex, numbers, a string, an object, or leaves cut short with the
    root recomputed over them: the audit raised a TypeError (a traceback, no verdict) or stopped with exit 2, as
    for input the auditor cannot use; the manifest is the trainer's, so the run is rejected, naming it."""
    m = store.load_manifest(str(run))
    if leaves == "cut short":
        cut = [bytes.fromhex(x)[:40] for x in m["leaves"]]
        m["leaves"], m["root"] = [x.hex() for x in cut], store.tree_of(cut).root().hex()
    else:
        m["leaves"] = leaves
    store.save_manifest(str(run), m)
    assert_audit_refuses(run, store.MANIFEST)
    assert_verify_names(run, store.MANIFEST, "leaf", "leaves")


# --- (b) a log that is a symlink to /dev/zero ---------------------------------------------------


def test_log_symlinked_to_dev_zero_is_refused_promptly(run):
    path = run / log_name(1)
    path.unlink()
    os.symlink("/dev/zero", path)
    assert_verify_names(run, log_name(1), "symbolic link")
    assert_audit_refuses(run, log_name(1))


# --- (c) gap-coded positions that wrap past 2^63 ------------------------------------------------


def encode_log(step, bits, ops, dir_gaps=None) -> bytes:
    """A log written by hand with logformat's varint helper, so that a test can put any gap values in a
    direction block: ``dir_gaps`` maps (op index, output index) to the raw gaps (directions all 0)."""
    names, body = {}, bytearray(b"H" + _varint(step) + _varint(bits))
    n_dir = n_val = n_scalar = rounded = 0
    for i, op in enumerate(ops):
        if op.name not in names:
            names[op.name] = len(names)
            raw = op.name.encode()
            body += b"N" + _varint(names[op.name]) + _varint(len(raw)) + raw
        body += b"O" + _varint(names[op.name]) + _varint(len(op.scalars))
        for pos, bit in op.scalars:
            body += _varint(int(pos)) + bytes([int(bit)])
        body += _varint(len(op.outputs))
        for j, o in enumerate(op.outputs):
            body += _varint(len(o.shape)) + b"".join(_varint(int(d)) for d in o.shape)
            rounded += math.prod(o.shape)
            gaps, dbits = (dir_gaps or {}).get((i, j)), None
            if gaps is None:
                gaps, dbits = positions_to_gaps(o.dir_pos).tolist(), o.dir_bits
            else:
                dbits = np.zeros(len(gaps), bool)
            g = b"".join(_varint(int(x)) for x in gaps)
            body += _varint(len(gaps)) + _varint(len(g)) + g
            body += np.packbits(np.asarray(dbits, bool), bitorder="little").tobytes()
            g = b"".join(_varint(int(x)) for x in positions_to_gaps(o.val_pos).tolist())
            body += _varint(len(o.val_pos)) + _varint(len(g)) + g + np.asarray(o.val_bits, "<u4").tobytes()
            n_dir += len(gaps)
            n_val += len(o.val_pos)
        n_scalar += len(op.scalars)
    body += b"E" + b"".join(_varint(x) for x in (len(ops), rounded, n_dir, n_val, n_scalar))
    return MAGIC + zstandard.ZstdCompressor(write_checksum=True).compress(bytes(body))


def test_positions_wrapping_past_2_63_are_malformed(run):
    """A direction block with gaps 0, 2^63-1, 2^63-1 decodes (in int64) to positions 0, -2^63, 0: the
    first and last look inside the output. The trainer commits to the log; verify must call it
    malformed and audit reject it, without a traceback."""
    step = 1
    path = run / log_name(step)
    s, bits, ops = read_records(str(path))
    where = next((i, j) for i, op in enumerate(ops) for j, o in enumerate(op.outputs)
                 if o.n_entries and math.prod(o.shape) >= 3)
    path.write_bytes(encode_log(s, bits, ops, {where: [0, 2**63 - 1, 2**63 - 1]}))
    recommit(run)
    assert_verify_names(run, log_name(step), "malformed")
    assert_audit_refuses(run, log_name(step))


def test_a_second_scalar_entry_for_one_argument_is_malformed(run):
    """An honest scalar entry with a forged one for the same argument before it: the replay kept the last
    (the honest one) and never looked at the other, so the audit accepted a log that holds an entry nothing
    checked. The format allows one entry per argument, positions strictly increasing."""
    step = 1
    path = run / log_name(step)
    s, bits, ops = read_records(str(path))
    op = next(op for op in ops if op.scalars)  # a Python float near a float32 midpoint (digits-cnn has one)
    pos, bit = op.scalars[0]
    op.scalars.insert(0, (pos, not bit))
    path.write_bytes(encode_log(s, bits, ops))
    recommit(run)
    assert_verify_names(run, log_name(step), "malformed")
    assert_audit_refuses(run, log_name(step))
    with pytest.raises(ValueError, match="strictly increasing"):  # and our writer cannot write one
        StepLogWriter(str(run / "other.vtlog"), step, bits).op(op.name, op.scalars, op.outputs, 0)


def _recommit_checkpoint(run, step, edit):
    """The trainer's checkpoint after ``step`` rewritten by ``edit(tensors, meta)``, its header's hash, the
    manifest's entry and every commitment recomputed: a self-consistent run around a state it chose."""
    path = str(run / ckpt_name(step))
    digest = rewrite_checkpoint(path, edit)
    m = store.load_manifest(str(run))
    for c in m["checkpoints"]:
        if c["step"] == step:
            c["state_sha256"], c["file_sha256"] = digest, store.file_sha256(path)
    store.save_manifest(str(run), m)
    recommit(run)


def _set_group(key, value):
    def edit(tensors, meta):
        meta["optimizer"]["param_groups"][0][key] = value
    return edit


def _reshape_state(tensors, meta):
    name = next(k for k in sorted(tensors) if k.startswith("optimizer/state/") and k.endswith("/exp_avg"))
    tensors[name] = torch.zeros(3)


@pytest.mark.parametrize("edit, reason", [
    (_set_group("lr", "abc"), "sets 'lr' to 'abc'"),
    (_set_group("weight_decay", None), "sets 'weight_decay' to 'None'"),
    (_set_group("amsgrad", True), "sets 'amsgrad' to 'True'"),
    (_set_group("betas", [1]), "sets 'betas' to '[1]'"),
    (_reshape_state, "the step fails from the run's committed state (RuntimeError"),
], ids=["lr as text", "no weight decay", "amsgrad", "one beta", "a moment of another shape"])
def test_a_checkpoint_whose_optimizer_state_the_task_cannot_take_is_rejected(run, edit, reason):
    """The trainer's checkpoint, recommitted, restores optimizer settings or state that AdamW's step cannot take:
    the replay of the next interval raised a TypeError, KeyError, AssertionError or RuntimeError (a traceback,
    no verdict), or stopped with exit 2. The settings are checked against the task's own optimizer when the
    checkpoint loads, and a step that fails from a committed state rejects the run."""
    _recommit_checkpoint(run, 1, edit)
    code, out, err, _ = hostile_cli("audit", run, "--json", "--quiet")
    assert code == 1 and "Traceback" not in err, (code, out[-2000:], err[-2000:])
    r = json.loads(out)
    assert not r["accepted"] and any(reason in x for x in r["reasons"]), r["reasons"]


# --- (d) a 1 KB log that declares huge blocks ---------------------------------------------------


def _bomb(n_out=1, n_dir=0) -> bytes:
    """One op record with ``n_out`` outputs, the first with ``n_dir`` direction entries at positions
    0, 1, 2, ... (all gaps 0): a few MB of zeros that zstd squeezes into a kilobyte or two."""
    body = bytearray(b"H" + _varint(0) + _varint(32) + b"N" + _varint(0) + _varint(3) + b"abc")
    body += b"O" + _varint(0) + _varint(0) + _varint(n_out)
    body += _varint(1) + _varint(1 << 40)  # shape (2^40,)
    body += _varint(n_dir) + _varint(n_dir) + bytes(n_dir) + bytes((n_dir + 7) // 8) + _varint(0) + _varint(0)
    body += (_varint(0) + _varint(0) * 4) * (n_out - 1)  # shape () and no entries
    body += b"E" + b"".join(_varint(x) for x in (1, (1 << 40) + n_out - 1, n_dir, 0, 0))
    return MAGIC + zstandard.ZstdCompressor(level=19, write_checksum=True).compress(bytes(body))


DECODE = textwrap.dedent("""
    import json, resource, sys
    from veritrain.logformat import LogFormatError, StepLogReader
    data = open(sys.argv[1], "rb").read()
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    try:
        r = StepLogReader(data)
        while r.next_op() is not None:
            pass
        result = "decoded"
    except LogFormatError as e:
        result = "LogFormatError: " + str(e)
    grew = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) * 1024
    print(json.dumps({"result": result, "grew": grew}))
""")


@pytest.mark.timeout(300)
@pytest.mark.parametrize("n_out,n_dir", [(1, (1 << 27) // 5 - 16), (1 << 20, 0)], ids=["entries", "outputs"])
def test_a_small_log_declaring_huge_blocks_is_refused_in_little_memory(tmp_path, n_out, n_dir):
    """Within the per-op limits (2^27 bytes of entry blocks, 2^20 outputs), a kilobyte-sized file
    decompresses to tens of MB that decode to gigabytes of positions or Python objects; the reader must
    refuse it (inflation limit) before decoding, with peak memory a few MB above the baseline."""
    blob = _bomb(n_out, n_dir)
    assert len(blob) < 4096, len(blob)
    p = tmp_path / "bomb.vtlog"
    p.write_bytes(blob)
    code, out, err, _ = hostile([sys.executable, "-c", DECODE, str(p)], timeout=240)
    assert code == 0, (code, out, err[-3000:])
    r = json.loads(out)
    assert r["result"].startswith("LogFormatError"), r
    assert r["grew"] < 64 << 20, f"decoding a {len(blob)}-byte log raised the peak RSS by {r['grew'] >> 20} MB"


# --- (e) a fifo or a device in place of a run file ----------------------------------------------


@pytest.mark.timeout(600)
@pytest.mark.parametrize("kind", ["fifo", "device"])
@pytest.mark.parametrize("name", [record_name(1), ckpt_name(1), log_name(1)], ids=["record", "checkpoint", "log"])
def test_a_fifo_or_device_in_place_of_a_run_file_is_refused_not_hung(run, name, kind):
    path = run / name
    path.unlink()
    if kind == "fifo":
        os.mkfifo(path)
    else:
        try:
            os.mknod(path, 0o600 | stat.S_IFCHR, os.makedev(1, 5))  # /dev/zero's numbers
        except PermissionError:
            pytest.skip("cannot create a device node here")
    assert_verify_names(run, name, "not a regular file")
    assert_audit_refuses(run, name, exits=(1,) if "checkpoint" not in name else (1, 2))


# --- (f) symlinks: a run subfolder, or one file, pointing elsewhere -------------------------------


@pytest.mark.parametrize("what", ["subfolder", "file"])
def test_symlinked_subfolder_or_file_is_refused_even_with_valid_content(run, tmp_path, what):
    """The content is the honest one, but it lives outside the run: refused all the same."""
    from veritrain.runner import audit

    outside = tmp_path / "outside"
    if what == "subfolder":
        shutil.move(run / "records", outside)
        os.symlink(outside, run / "records")
    else:
        shutil.move(run / record_name(1), outside)
        os.symlink(outside, run / record_name(1))
    r = store.verify(str(run))
    assert not r["ok"] and any(p["file"].startswith("records") and "symbolic link" in p["problem"]
                               for p in r["problems"]), r["problems"]
    try:
        a = audit(str(run), progress=False)
    except RunError as e:
        assert "records" in str(e) and "symbolic link" in str(e)
    else:
        assert not a.accepted and any("symbolic link" in x for x in a.reasons), a.reasons


# --- (g) a sparse multi-gigabyte log ------------------------------------------------------------


def test_an_oversized_log_is_refused_by_its_size_before_reading(run):
    """A 3 GiB (sparse) log is over the 1 GiB cap: refused from its size, in little memory."""
    path = run / log_name(1)
    with open(path, "r+b") as f:
        f.truncate(3 << 30)
    code, out, err, rss = hostile_cli("audit", run, "--json", "--quiet")
    assert code == 1 and "Traceback" not in err, (code, err[-2000:])
    assert any("step_00000001.vtlog" in x and "limit" in x for x in json.loads(out)["reasons"])
    assert rss < 2 << 30, rss
    assert_verify_names(run, log_name(1), "limit")


# --- (h) a self-consistent checkpoint that does not hold a state ----------------------------------


@pytest.mark.parametrize("header", ["meta-missing", "not-an-object"])
def test_a_checkpoint_with_hostile_metadata_is_an_error_not_a_crash(run, header):
    """The checkpoint's header agrees with its tensors (its recorded state hash is right) but its meta
    is not an optimizer/scheduler state, or the header is not a JSON object."""
    from safetensors.torch import load_file, save_file

    from veritrain.commitments import state_hash
    from veritrain.runner import audit

    path = str(run / ckpt_name(1))
    tensors = load_file(path)
    if header == "meta-missing":
        info = {"step": 1, "meta": {}, "state_sha256": state_hash(tensors, {}, 1)}
    else:
        info = ["step", 1]
    save_file(tensors, path, metadata={"veritrain": canonical_json(info).decode()})
    try:
        a = audit(str(run), progress=False)
    except RunError as e:
        assert "step_00000001" in str(e)
    else:
        assert not a.accepted


# --- byte-level fuzzing of a whole run ----------------------------------------------------------


def _files(run_dir) -> list[str]:
    out = []
    for root, _, names in os.walk(run_dir):
        for n in names:
            out.append(os.path.relpath(os.path.join(root, n), run_dir))
    return sorted(out)


def _same_content(name: str, old: bytes, new: bytes) -> bool:
    """Whether ``new`` commits to the same content as ``old`` (then accepting it is no error).

    manifest.json: its manifest_sha256 is over the canonical JSON of the parsed object, so JSON that
    parses to the same object (other whitespace) is the same manifest. Checkpoints, for `audit`: the
    replay uses the tensors and metadata, so a file that safetensors loads to the same tensors (bit for
    bit) and metadata holds the same state (verify still rejects it: it checks the file's SHA-256).
    Everything else (records, logs) is committed byte for byte."""
    if name == MANIFEST:
        try:
            return canonical_json(json.loads(new)) == canonical_json(json.loads(old))
        except (ValueError, TypeError, RecursionError):
            return False
    if name.startswith("checkpoints/"):
        import torch
        from safetensors.torch import load

        try:
            a, b = load(old), load(new)
            ma = json.loads(old[8:8 + int.from_bytes(old[:8], "little")]).get("__metadata__")
            mb = json.loads(new[8:8 + int.from_bytes(new[:8], "little")]).get("__metadata__")
        except Exception:  # noqa: BLE001 - anything safetensors refuses is different content
            return False
        return ma == mb and a.keys() == b.keys() and all(
            a[k].dtype == b[k].dtype and a[k].shape == b[k].shape
            and a[k].reshape(-1).view(torch.uint8).equal(b[k].reshape(-1).view(torch.uint8))
            for k in a)
    return False


@st.composite
def mutations(draw, names):
    name = draw(st.sampled_from(names))
    kind = draw(st.sampled_from(["flip", "set", "insert", "delete", "truncate", "append"]))
    where = draw(st.floats(0, 1))
    value = draw(st.binary(min_size=1, max_size=8))
    return name, kind, where, value


def mutate(data: bytes, kind: str, where: float, value: bytes) -> bytes:
    i = min(int(where * len(data)), max(len(data) - 1, 0))
    if kind == "flip":
        return data[:i] + bytes([data[i] ^ (value[0] or 1)]) + data[i + 1:]
    if kind == "set":
        return data[:i] + value + data[i + len(value):]
    if kind == "insert":
        return data[:i] + value + data[i:]
    if kind == "delete":
        return data[:i] + data[i + len(value):]
    if kind == "truncate":
        return data[:i]
    return data + value


class Fuzz:
    """One honest run, copied and mutated per example (module-scoped so hypothesis may reuse it)."""

    def __init__(self, honest):
        self.honest = str(honest)
        self.names = _files(self.honest)
        self.original = {n: open(os.path.join(self.honest, n), "rb").read() for n in self.names}
        self.every = store.load_manifest(self.honest)["checkpoint_every"]

    def copy_with(self, name, data):
        d = tempfile.mkdtemp(prefix="vt-fuzz-")
        run_dir = os.path.join(d, "run")
        shutil.copytree(self.honest, run_dir)
        with open(os.path.join(run_dir, name), "wb") as f:
            f.write(data)
        return d, run_dir


@pytest.fixture(scope="module")
def fuzz(honest):
    return Fuzz(honest)


FUZZ_VERIFY = settings(max_examples=150, deadline=20_000, suppress_health_check=list(HealthCheck),
                       database=None)
FUZZ_AUDIT = settings(max_examples=50, deadline=60_000, suppress_health_check=list(HealthCheck), database=None)


@pytest.mark.timeout(300)
@FUZZ_VERIFY
@given(data=st.data())
def test_verify_rejects_every_byte_mutation(fuzz, data):
    """`store.verify` on a run with one file mutated (a byte flipped or set, bytes inserted, deleted or
    appended, the file truncated): it returns (never raises) and is not ok, naming the mutated file,
    unless the mutation leaves the committed content identical (_same_content: only a manifest that
    parses to the same JSON; verify checks checkpoints' file hashes, so any checkpoint change counts)."""
    name, kind, where, value = data.draw(mutations(fuzz.names))
    old = fuzz.original[name]
    new = mutate(old, kind, where, value)
    assume(new != old)
    d, run_dir = fuzz.copy_with(name, new)
    try:
        r = store.verify(run_dir)
        if name == MANIFEST and _same_content(name, old, new):
            return
        assert not r["ok"], (name, kind)
        assert name in {p["file"] for p in r["problems"]}, (name, r["problems"])
    finally:
        shutil.rmtree(d)


@pytest.mark.timeout(600)
@FUZZ_AUDIT
@given(data=st.data())
def test_audit_rejects_every_byte_mutation_of_what_it_replays(fuzz, data):
    """`runner.audit` on a run with one file mutated: it returns or raises a RunError (the RunError
    family: refused/rejected run), never another exception, and does not accept the run, unless the
    committed content is identical (_same_content) or the file is one the replay does not read: the
    last checkpoint (its state is recomputed by the replay and compared with the commitment; verify
    checks the file itself)."""
    from veritrain.runner import audit

    name, kind, where, value = data.draw(mutations(fuzz.names))
    old = fuzz.original[name]
    new = mutate(old, kind, where, value)
    assume(new != old)
    d, run_dir = fuzz.copy_with(name, new)
    try:
        try:
            r = audit(run_dir, progress=False)
        except RunError:
            return
        if r.accepted:
            assert _same_content(name, old, new) or name == ckpt_name(STEPS), (name, kind, where, value)
    finally:
        shutil.rmtree(d)


@pytest.mark.timeout(600)
@FUZZ_AUDIT
@given(data=st.data())
def test_recommitted_hostile_logs_never_crash_verify_or_audit(fuzz, data):
    """The dishonest trainer mutates the decompressed records of one step's log and commits to the result
    (recommit). verify and audit must end with their documented results: verify ok or the log named
    as malformed; audit accepting, rejecting, or raising a RunError. A log verify calls malformed must
    not be accepted by audit (both decode with the same checks). (A mutated log may be accepted: a
    change can be harmless, e.g. dropping an entry that asks for the natural rounding.)"""
    from veritrain.runner import audit

    step = data.draw(st.integers(0, STEPS - 1))
    name = log_name(step)
    raw = bytearray(zstandard.ZstdDecompressor().decompressobj().decompress(fuzz.original[name][len(MAGIC):]))
    for _ in range(data.draw(st.integers(1, 4))):
        kind = data.draw(st.sampled_from(["set", "insert", "delete"]))
        i = data.draw(st.integers(0, len(raw) - 1))
        value = data.draw(st.binary(min_size=1, max_size=4) | st.sampled_from(
            [b"\xff" * 9 + b"\x7f", b"\x80" * 8 + b"\x01", _varint(2**62), b"\x00" * 3]))
        if kind == "set":
            raw[i:i + len(value)] = value
        elif kind == "insert":
            raw[i:i] = value
        else:
            del raw[i:i + len(value)]
    new = MAGIC + zstandard.ZstdCompressor(write_checksum=True).compress(bytes(raw))
    d, run_dir = fuzz.copy_with(name, new)
    try:
        recommit(run_dir)
        v = store.verify(run_dir)
        problems = [p for p in v["problems"] if p["file"] == name]
        assert v["ok"] or problems, v["problems"]
        assert all("malformed" in p["problem"] for p in problems), problems
        try:
            r = audit(run_dir, progress=False)
        except RunError:
            return
        assert not (problems and r.accepted), (problems, r.reasons)
    finally:
        shutil.rmtree(d)


def test_reader_refuses_what_verify_would_miss():
    """Direct decoder checks: positions that pass the output's end only by wrapping past 2^63, a
    position with both a direction and a value entry, set padding bits, END totals that disagree."""
    from veritrain.logformat import OpRecord, OutputEntries

    def log(outputs):
        return encode_log(0, 32, [OpRecord("aten.mm.default", [], outputs)])

    def decode(blob):
        r = StepLogReader(blob)
        try:
            while r.next_op() is not None:
                pass
        finally:
            r.close()

    e = OutputEntries((4, 5), dir_pos=np.array([1, 7]), dir_bits=np.array([True, False]),
                      val_pos=np.array([7]), val_bits=np.array([0x3F800000], np.uint32))
    with pytest.raises(LogFormatError, match="both"):
        decode(log([e]))
    ops = [OpRecord("aten.mm.default", [], [OutputEntries((4, 5))])]
    with pytest.raises(LogFormatError, match="outside"):
        decode(encode_log(0, 32, ops, {(0, 0): [3, 2**62, 2**62, 2**62, 2**62]}))
    blob = encode_log(0, 32, ops, {(0, 0): [1]})
    body = bytearray(zstandard.ZstdDecompressor().decompressobj().decompress(blob[len(MAGIC):]))
    k = body.index(bytes([1, 1, 1, 0]))  # count 1, length 1, gap 1, bits 0
    body[k + 3] = 0x02  # a padding bit
    with pytest.raises(LogFormatError, match="padding"):
        decode(MAGIC + zstandard.ZstdCompressor().compress(bytes(body)))
    body[k + 3] = 0x00
    body[-4] += 1  # END's rounded_values
    with pytest.raises(LogFormatError, match="END"):
        decode(MAGIC + zstandard.ZstdCompressor().compress(bytes(body)))
