"""The run store: file names, atomic writes, the per-interval Merkle leaves, and integrity checks.

Spec: docs/FORMAT.md. A run of N steps with checkpoints every k steps has ceil(N / k) *intervals*;
interval i covers steps [i*k, min((i+1)*k, N)) and ends at a checkpoint. Leaf i of the run's Merkle
tree commits to the interval's index and steps, the run description, the state hash at its end, and
the hash of each of its steps' data records (which hold the hash of the step's rounding log).
"""

from __future__ import annotations

import errno
import hashlib
import io
import json
import os
import re
import stat
import struct

from .commitments import canonical_json
from .merkle import MerkleTree, leaf_hash

MANIFEST = "manifest.json"
FORMAT = "veritrain-run/2"
LEAF_TAG = b"veritrain-leaf/1\0"
MAX_MICRO_BATCHES = 4096  # per step of a data-parallel run: each is a log file and a record entry
RUN_FIELDS = ("format", "task", "task_source_sha256", "config", "seed", "mode", "bits", "thresholds", "slack",
              "steps", "checkpoint_every", "initial_state_sha256", "init_log_sha256")


class RunError(ValueError):
    """Bad input: a missing or malformed run directory, manifest or option."""


class RunRejected(RunError):
    """The run itself is altered, malformed or outside the auditor's policy: the auditor rejects it
    (exit 1), as opposed to input the auditor cannot use at all (exit 2)."""


def ckpt_name(step: int) -> str:
    return f"checkpoints/step_{step:08d}.safetensors"


def log_name(step: int) -> str:
    return f"logs/step_{step:08d}.vtlog"


def micro_log_name(step: int, micro: int) -> str:
    """The rounding log of micro-batch ``micro`` of ``step`` in a data-parallel run (docs/DISTRIBUTED.md)."""
    return f"logs/step_{step:08d}.micro_{micro:05d}.vtlog"


INIT_LOG = "logs/init.vtlog"  # the rounding log of building the task (its random initialisation)


def record_name(step: int) -> str:
    return f"records/step_{step:08d}.json"


# --- atomic files -------------------------------------------------------------------------------


def fsync_dir(d: str):
    try:
        fd = os.open(d, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def write_bytes_atomic(path: str, data: bytes, pending: list | None = None):
    """Temporary name in the same folder, fsync, rename: readers see the old file or the new one. With
    ``pending`` (a list), no fsync: the path is appended to it, for ``sync_files`` before a commit."""
    d = os.path.dirname(os.path.abspath(path))
    os.makedirs(d, exist_ok=True)
    tmp = os.path.join(d, f".tmp-{os.getpid()}-{os.path.basename(path)}")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            if pending is None:
                f.flush()
                os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
    if pending is None:
        fsync_dir(d)
    else:
        pending.append(path)


def sync_files(paths: list):
    """Make files written without fsync (``pending``) durable, then their folders' entries, and empty the list.

    A run commits to its per-step files (logs, data records) only at each interval's end, when the manifest
    names the interval's leaf; a crash before that loses the interval and a resumed run writes its files
    again. So they are synced together before that commit rather than each when written (an fsync of each
    file and its folder as it is written; a run writes two or more such files a step): docs/SPEED.md."""
    dirs = []
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        d = os.path.dirname(os.path.abspath(p))
        if d not in dirs:
            dirs.append(d)
    for d in dirs:
        fsync_dir(d)
    paths.clear()


def write_json_atomic(path: str, obj):
    write_bytes_atomic(path, (json.dumps(obj, indent=1, sort_keys=True) + "\n").encode())


def file_sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def remove_stray_temporaries(run_dir: str) -> list[str]:
    """Delete temporaries a killed writer left behind (they are never read as valid files)."""
    gone = []
    for sub in ("", "checkpoints", "logs", "records"):
        d = os.path.join(run_dir, sub)
        if not os.path.isdir(d):
            continue
        for name in os.listdir(d):
            if name.startswith(".tmp-") or ".tmp-" in name:
                os.remove(os.path.join(d, name))
                gone.append(os.path.join(sub, name))
    return gone


# --- reading a run as hostile input -------------------------------------------------------------
#
# Everything under a run folder is written by the trainer, who may lie. Readers of a run open its files
# only through open_run_file: by their canonical names (never a name read from the manifest), as
# regular files inside the run folder (no symlink, fifo, device or folder, no symlinked subfolder), and
# within a size cap checked on the open file before anything is read (docs/FORMAT.md, "Reading a run
# as hostile input").

MAX_MANIFEST_BYTES = 64 << 20
MAX_RECORD_BYTES = 1 << 20
MAX_LOG_BYTES = 1 << 30
MAX_CHECKPOINT_BYTES = 64 << 30
RUN_SUBDIRS = ("checkpoints", "logs", "records")
_CANONICAL = re.compile(r"manifest\.json|checkpoints/step_[0-9]{8,}\.safetensors|logs/step_[0-9]{8,}(\.micro_[0-9]{5,})?\.vtlog"
                        r"|logs/init\.vtlog|records/step_[0-9]{8,}\.json")
_KINDS = {"manifest.json": ("manifest", MAX_MANIFEST_BYTES), "records": ("data record", MAX_RECORD_BYTES),
          "logs": ("rounding log", MAX_LOG_BYTES), "checkpoints": ("checkpoint", MAX_CHECKPOINT_BYTES)}
_OPEN_FLAGS = (os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0)
               | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_BINARY", 0))
_DIR_FLAGS = os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | getattr(os, "O_CLOEXEC", 0)
_AT = os.open in os.supports_dir_fd and os.stat in os.supports_dir_fd and os.stat in os.supports_follow_symlinks


class RunFileError(RunRejected):
    """A run file the reader refuses: missing, not a regular file (a symlink, fifo, device, folder),
    inside a symlinked subfolder, or over its size cap. ``problem`` says which, without the path."""

    def __init__(self, name: str, path: str, problem: str, missing: bool = False):
        super().__init__(f"{path} {problem}")
        self.name, self.path, self.problem, self.missing = name, path, problem, missing


def run_file_cap(name: str) -> tuple[str, int]:
    """(what the file is, its size cap in bytes) for a canonical run file name."""
    return _KINDS[name.split("/", 1)[0]]


def _not_regular(mode: int) -> str:
    if stat.S_ISLNK(mode):
        return "is a symbolic link: a run's files must be regular files inside the run folder"
    for test, what in ((stat.S_ISFIFO, "a fifo"), (stat.S_ISCHR, "a character device"),
                       (stat.S_ISBLK, "a block device"), (stat.S_ISDIR, "a folder"), (stat.S_ISSOCK, "a socket")):
        if test(mode):
            return f"is {what}, not a regular file"
    return "is not a regular file"


def _open_regular(path: str, display: str, name: str, what: str, cap: int, dir_fd=None) -> tuple[int, int]:
    """(fd, size) of the regular file ``path`` (relative to ``dir_fd`` if given), opened without following
    a symlink or blocking on a fifo, refused before reading if it is larger than ``cap``."""
    at = {} if dir_fd is None else {"dir_fd": dir_fd}
    try:
        before = os.stat(path, follow_symlinks=False, **at)
    except FileNotFoundError:
        raise RunFileError(name, display, "does not exist", missing=True) from None
    except OSError as e:
        raise RunFileError(name, display, f"cannot be read ({e.strerror})") from None
    if not stat.S_ISREG(before.st_mode):  # refused before opening: opening a device can have effects
        raise RunFileError(name, display, _not_regular(before.st_mode))
    if before.st_size > cap:
        raise RunFileError(name, display, f"is {before.st_size} bytes, over the {cap}-byte limit for a {what} "
                                          f"(refused unread)")
    try:
        fd = os.open(path, _OPEN_FLAGS, **at)
    except OSError as e:
        if e.errno == errno.ENOENT:
            raise RunFileError(name, display, "does not exist", missing=True) from None
        if e.errno in (errno.ELOOP, errno.EMLINK):
            raise RunFileError(name, display, _not_regular(stat.S_IFLNK)) from None
        raise RunFileError(name, display, f"cannot be opened ({e.strerror})") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or (st.st_dev, st.st_ino) != (before.st_dev, before.st_ino):
            raise RunFileError(name, display, "was replaced while it was opened")
        if st.st_size > cap:
            raise RunFileError(name, display, f"is {st.st_size} bytes, over the {cap}-byte limit for a {what} "
                                              f"(refused unread)")
    except BaseException:
        os.close(fd)
        raise
    return fd, st.st_size


class RunFile:
    """A run file opened for reading by ``open_run_file``: reads are capped at the file's size limit
    (even if it grows while read) and hashed. ``path`` names it in messages; ``size`` is its size when
    opened; ``sha256()`` is the hash of the bytes read so far (``drain()`` first for the whole file)."""

    def __init__(self, fd: int, path: str, name: str, size: int, cap: int):
        self._f = io.open(fd, "rb", buffering=1 << 16, closefd=True)
        self.path, self.name, self.size, self.cap = path, name, size, cap
        self.bytes_read = 0
        self._hash = hashlib.sha256()

    def read(self, n: int = -1) -> bytes:
        if n is None or n < 0:
            parts = []
            while chunk := self.read(1 << 20):
                parts.append(chunk)
            return b"".join(parts)
        data = self._f.read(min(n, self.cap + 1 - self.bytes_read))
        self.bytes_read += len(data)
        if self.bytes_read > self.cap:
            raise RunFileError(self.name, self.path, f"grew past the {self.cap}-byte limit while it was read")
        self._hash.update(data)
        return data

    def drain(self) -> "RunFile":
        while self.read(1 << 20):
            pass
        return self

    def sha256(self) -> str:
        return self._hash.hexdigest()

    def fileno(self) -> int:
        return self._f.fileno()

    def close(self):
        self._f.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def open_run_file(run_dir: str, name: str, max_bytes: int | None = None) -> RunFile:
    """Open the run file ``name`` (a canonical name: MANIFEST, ckpt_name(s), log_name(s), INIT_LOG,
    record_name(s)) of ``run_dir`` for reading, as hostile input: only a regular file, not through a
    symlink (the file's or its subfolder's), at most ``max_bytes`` (default: the cap of its kind).
    Raises RunFileError naming the file and the problem (``missing`` set when it does not exist)."""
    if not isinstance(name, str) or not _CANONICAL.fullmatch(name):
        raise RunError(f"{name!r:.200} is not the name of a run file")
    what, cap = run_file_cap(name)
    cap = cap if max_bytes is None else min(cap, max_bytes)
    path = os.path.join(run_dir, name)
    sub, _, base = name.rpartition("/")
    if not _AT:  # no openat here: check the subfolder by name, then open by path (a small race remains)
        if sub and os.path.islink(os.path.join(run_dir, sub)):
            raise RunFileError(name, path, f"is in {sub}/, a symbolic link: a run's files must be inside the run folder")
        fd, size = _open_regular(path, path, name, what, cap)
        return RunFile(fd, path, name, size, cap)
    try:
        dfd = os.open(run_dir, _DIR_FLAGS)
    except OSError as e:
        raise RunError(f"run directory {run_dir} cannot be opened ({e.strerror})") from None
    try:
        if not sub:
            fd, size = _open_regular(base, path, name, what, cap, dir_fd=dfd)
        else:
            try:
                st = os.stat(sub, dir_fd=dfd, follow_symlinks=False)
            except FileNotFoundError:
                raise RunFileError(name, path, f"is missing (the run has no {sub}/ folder)", missing=True) from None
            if stat.S_ISLNK(st.st_mode):
                raise RunFileError(name, path, f"is in {sub}/, which is a symbolic link: a run's files must be "
                                               f"regular files inside the run folder")
            if not stat.S_ISDIR(st.st_mode):
                raise RunFileError(name, path, f"is missing ({sub} is not a folder)", missing=True)
            try:
                sfd = os.open(sub, _DIR_FLAGS | getattr(os, "O_NOFOLLOW", 0), dir_fd=dfd)
            except OSError as e:
                raise RunFileError(name, path, f"cannot be opened ({sub}/: {e.strerror})") from None
            try:
                fd, size = _open_regular(base, path, name, what, cap, dir_fd=sfd)
            finally:
                os.close(sfd)
    finally:
        os.close(dfd)
    return RunFile(fd, path, name, size, cap)


def open_regular_file(path: str, max_bytes: int, what: str = "file") -> RunFile:
    """Open a file given by path (not by run-file name) as hostile input: a regular file, not a symlink,
    at most ``max_bytes``. Raises RunFileError."""
    fd, size = _open_regular(path, path, os.path.basename(path), what, max_bytes)
    return RunFile(fd, path, os.path.basename(path), size, max_bytes)


def read_run_file(run_dir: str, name: str, max_bytes: int | None = None) -> bytes:
    """The bytes of a run file, read with open_run_file's checks."""
    with open_run_file(run_dir, name, max_bytes) as f:
        return f.read()


def run_file_sha256(run_dir: str, name: str, max_bytes: int | None = None) -> str:
    """SHA-256 of a run file, streamed (checkpoints are large) with open_run_file's checks."""
    with open_run_file(run_dir, name, max_bytes) as f:
        return f.drain().sha256()


# --- manifest -----------------------------------------------------------------------------------


def manifest_digest(manifest: dict) -> str:
    """SHA-256 of the manifest's canonical JSON without its own ``manifest_sha256`` field."""
    return hashlib.sha256(canonical_json({k: v for k, v in manifest.items() if k != "manifest_sha256"})).hexdigest()


def save_manifest(run_dir: str, manifest: dict):
    manifest["manifest_sha256"] = manifest_digest(manifest)
    write_json_atomic(os.path.join(run_dir, MANIFEST), manifest)


def load_manifest(run_dir: str, check_digest: bool = True) -> dict:
    """The run's manifest, parsed and checked for shape. A missing folder or manifest is unusable input
    (RunError); a manifest that is there but malformed or altered rejects the run (RunRejected)."""
    p = os.path.join(run_dir, MANIFEST)
    if not os.path.isdir(run_dir):
        raise RunError(f"run directory {run_dir} does not exist")
    try:
        raw = read_run_file(run_dir, MANIFEST)
    except RunFileError as e:
        if e.missing:
            raise RunError(f"{run_dir} has no {MANIFEST}: not a veritrain run directory") from None
        raise
    try:
        m = json.loads(raw)
    except (ValueError, RecursionError) as e:  # JSONDecodeError, UnicodeDecodeError, too many digits
        raise RunRejected(f"{p} is not valid JSON ({type(e).__name__}: {str(e):.200})") from None
    if not isinstance(m, dict) or m.get("format") != FORMAT:
        raise RunRejected(f"{p}: unknown format {m.get('format') if isinstance(m, dict) else None!r:.100}, "
                       f"expected {FORMAT}")
    for key, typ in (("task", str), ("config", dict), ("seed", int), ("mode", str), ("bits", int),
                     ("thresholds", dict), ("steps", int), ("checkpoint_every", int), ("checkpoints", list)):
        if not isinstance(m.get(key), typ) or isinstance(m.get(key), bool):
            raise RunRejected(f"{p}: field {key!r} is missing or not a {typ.__name__}")
    if m["steps"] < 0 or m["checkpoint_every"] <= 0:
        raise RunRejected(f"{p}: steps must be >= 0 and checkpoint_every > 0")
    if "micro_batches" in m:
        g = m["micro_batches"]
        if isinstance(g, bool) or not isinstance(g, int) or not 2 <= g <= MAX_MICRO_BATCHES:
            raise RunRejected(f"{p}: field 'micro_batches' is {str(g)[:40]!r}, not a whole number in "
                              f"2..{MAX_MICRO_BATCHES} (a run of one micro-batch per step has no such field)")
    leaves = m.get("leaves", [])
    if not isinstance(leaves, list):
        raise RunRejected(f"{p}: field 'leaves' is not a list")
    for i, x in enumerate(leaves):  # each the hex of a leaf's data (parse_leaf), as the trainer wrote them
        try:
            parse_leaf(bytes.fromhex(x))
        except (TypeError, ValueError) as e:  # RunError is a ValueError
            raise RunRejected(f"{p}: leaf {i} is not a leaf's data in hex ({str(e):.100})") from None
    for c in m["checkpoints"]:
        if not (isinstance(c, dict) and isinstance(c.get("step"), int) and not isinstance(c.get("step"), bool)
                and c["step"] >= 0 and isinstance(c.get("file"), str) and isinstance(c.get("state_sha256"), str)):
            raise RunRejected(f"{p}: malformed checkpoint entry {str(c):.200}")
        if c["file"] != ckpt_name(c["step"]):  # files are read by their canonical names only
            raise RunRejected(f"{p}: the checkpoint entry for step {c['step']} names {c['file']!r:.200}, not "
                           f"{ckpt_name(c['step'])}")
    if check_digest and "manifest_sha256" in m and m["manifest_sha256"] != manifest_digest(m):
        raise RunRejected(f"{p} is altered: its content does not match its manifest_sha256")
    return m


def run_description(manifest: dict) -> dict:
    d = {k: manifest.get(k) for k in RUN_FIELDS}
    if "micro_batches" in manifest:  # data-parallel runs only, so that other runs keep their run hash
        d["micro_batches"] = manifest["micro_batches"]
    if "data_sha256" in manifest:  # runs of tasks that read data files (Task.data_sha256)
        d["data_sha256"] = manifest["data_sha256"]
    return d


def config_paths_inside(run_dir: str, config: dict, paths: dict | None = None) -> list[str]:
    """The config keys whose value names a file or folder inside the run folder (as this process resolves
    it: a relative path against its working directory), or a folder whose subfolder the task reads there.
    ``paths``: the keys the task reads data from (its ``make_task.data_paths``, task.data_paths), each with the
    words it takes as no path ("bytes") and the subfolders it reads under a folder; None: any string may be a
    path."""
    base, inside = os.path.realpath(run_dir), []
    for key, v in sorted(config.items()):
        if paths is not None and (key not in paths or v in paths[key]["words"]):  # a setting, or a word
            continue
        if not (isinstance(v, str) and v):
            continue
        v = os.path.expanduser(v)
        within = paths[key]["within"] if paths is not None else ()
        for p in [v] + [os.path.join(v, sub) for sub in within]:
            p = os.path.realpath(p) if os.path.exists(p) else None
            if p is not None and (p == base or p.startswith(base + os.sep)):
                inside.append(key)
                break
    return inside


def data_problem(committed, mine, whose: str = "the run") -> str | None:
    """Why a task built here (its Task.data_sha256, ``mine``) did not read the data ``whose`` commits to
    (``committed``, by config key); None where it did. A run without data hashes (an own loop, a task that
    reads no files) commits to none, and a build without them is checked by the run's batch hashes alone."""
    committed, mine = committed or {}, mine or {}
    for key in sorted(set(committed) | set(mine)):
        if committed.get(key) != mine.get(key):
            if key not in mine:
                return f"config {key!r}: {whose} commits to data {committed[key][:16]}…, but none was read for it here"
            if key not in committed:
                return (f"config {key!r}: the data read here hashes to {mine[key][:16]}…, but {whose} commits to no "
                        f"data for it (written by an older veritrain, or its data hashes removed)")
            return f"config {key!r}: the data read here hashes to {mine[key][:16]}…, {whose} commits to {committed[key][:16]}…"
    return None


def micro_batches(manifest: dict) -> int:
    """G, the number of micro-batches per step of a data-parallel run; 1 for other runs."""
    return int(manifest.get("micro_batches", 1))


def run_sha256(manifest: dict) -> bytes:
    return hashlib.sha256(canonical_json(run_description(manifest))).digest()


# --- records and leaves -------------------------------------------------------------------------


def record_bytes(step: int, batch_sha256: str, batch_indices, loss: float, log_sha256: str | None) -> bytes:
    """A step's data record, as canonical JSON: trainer and auditor build the same bytes."""
    return canonical_json({"step": step, "batch_sha256": batch_sha256, "batch_indices": batch_indices,
                           "loss": loss, "log_sha256": log_sha256}) + b"\n"


def parallel_record_bytes(step: int, micro: list[dict], loss: float, log_sha256: str | None) -> bytes:
    """A data-parallel step's data record: per micro-batch (in micro-batch order) its batch hash, indices, loss
    and log hash; the step's loss (the micro-batch losses' mean) and the hash of the update's log."""
    keys = ("batch_sha256", "batch_indices", "loss", "log_sha256")
    return canonical_json({"step": step, "micro_batches": [{k: m[k] for k in keys} for m in micro], "loss": loss,
                           "log_sha256": log_sha256}) + b"\n"


def interval_count(steps: int, every: int) -> int:
    """len(intervals(steps, every)), without building the list."""
    return 1 if steps == 0 else -(-steps // every)


def intervals(steps: int, every: int) -> list[tuple[int, int]]:
    """The run's checkpoint intervals; a run of 0 steps has one empty interval, so that its root
    commits to its initial state like any other run's."""
    if steps == 0:
        return [(0, 0)]
    return [(a, min(a + every, steps)) for a in range(0, steps, every)]


def leaf_data(index: int, first: int, end: int, run_sha: bytes, state_sha256: str, record_sha256s: list[str]) -> bytes:
    if len(record_sha256s) != end - first:
        raise ValueError("one record hash per step of the interval")
    out = [LEAF_TAG, struct.pack("<QQQ", index, first, end), run_sha, bytes.fromhex(state_sha256)]
    out += [bytes.fromhex(h) for h in record_sha256s]
    return b"".join(out)


def parse_leaf(data: bytes) -> dict:
    """The fields of a leaf's data (raises RunError if malformed)."""
    n = len(LEAF_TAG)
    if len(data) < n + 24 + 64 or not data.startswith(LEAF_TAG) or (len(data) - n - 24 - 64) % 32:
        raise RunError("malformed leaf data")
    index, first, end = struct.unpack("<QQQ", data[n:n + 24])
    body = data[n + 24:]
    records = [body[64 + 32 * i: 96 + 32 * i].hex() for i in range((len(body) - 64) // 32)]
    if end - first != len(records):
        raise RunError("malformed leaf data: step range and record count disagree")
    return {"interval": index, "first_step": first, "end_step": end, "run_sha256": body[:32].hex(),
            "state_sha256": body[32:64].hex(), "records": records}


def committed_state(manifest: dict, step: int) -> str | None:
    for c in manifest["checkpoints"]:
        if c["step"] == step:
            return c["state_sha256"]
    return None


def final_checkpoint_problem(run_dir: str, steps: int, leaves: list[bytes]) -> str | None:
    """Why checkpoints/step_<steps> (the weights the run delivers) does not hold the state the last leaf
    commits to, or None where it does. The audit replays intervals from their start checkpoints and compares
    the replay with the leaves; the file of the last state is never a start, so it is checked here, by its
    contents' state hash, streamed from the file a few MiB at a time (checkpoint.checkpoint_state)."""
    from .checkpoint import CheckpointError, checkpoint_state

    name = ckpt_name(steps)
    try:
        want = parse_leaf(leaves[-1])["state_sha256"]
        with open_run_file(run_dir, name) as f:
            step, got = checkpoint_state(f)
    except (RunFileError, CheckpointError) as e:
        return f"{name}, the run's final weights: {e.problem if isinstance(e, RunFileError) else e}"
    except (IndexError, RunError) as e:
        return f"the run's last leaf is malformed ({e})"
    if (step, got) != (steps, want):
        return (f"{name}, the run's final weights, holds the state {got[:16]}… after {step} steps, not the state "
                f"{want[:16]}… after {steps} steps that the last leaf commits to")
    return None


def tree_of(leaves: list[bytes]) -> MerkleTree:
    return MerkleTree([leaf_hash(x) for x in leaves])


# --- integrity ----------------------------------------------------------------------------------


def verify(run_dir: str, root: str | None = None) -> dict:
    """Check every file of a run against the manifest and the Merkle root, without replaying.

    Returns {"ok", "root", "intervals", "steps", "problems": [{"file", "problem"}]}; a problem names the
    file (missing, truncated, altered, malformed, or refused as hostile input) and what does not match.
    Files are read as hostile input (open_run_file); the work is bounded by the manifest's size and the
    files' size caps.
    """
    from .checkpoint import CheckpointError, checkpoint_state

    problems = []

    def bad(name, why):
        problems.append({"file": name, "problem": why})

    try:
        m = load_manifest(run_dir)
    except RunError as e:
        return {"ok": False, "root": None, "intervals": 0, "steps": 0,
                "problems": [{"file": MANIFEST, "problem": str(e)}]}
    if "manifest_sha256" not in m:
        bad(MANIFEST, "has no manifest_sha256 (written by an older veritrain or altered)")
    # the committed leaves first: the steps they commit to bound the files looked at below
    try:
        leaves = [bytes.fromhex(x) for x in m.get("leaves", [])]
        parsed = [parse_leaf(x) for x in leaves]
    except (ValueError, TypeError, RunError) as e:
        bad(MANIFEST, f"malformed leaves ({str(e):.200})")
        leaves, parsed = [], []
    committed = sum(len(info["records"]) for info in parsed)
    steps = m.get("steps_completed", m["steps"])
    if not isinstance(steps, int) or isinstance(steps, bool) or not 0 <= steps <= m["steps"]:
        bad(MANIFEST, f"steps_completed {steps!r:.40} is not a step count of this run")
        steps = committed
    if steps != committed:
        bad(MANIFEST, f"its leaves commit to {committed} steps, it says {steps} steps are complete")
        steps = min(steps, committed)
    if m.get("complete") and steps != m["steps"]:  # the schedule is what the root covers: all of it
        bad(MANIFEST, f"says the run is complete, but its leaves commit to {steps} of its {m['steps']} steps")
    for c in m["checkpoints"]:
        name = ckpt_name(c["step"])  # load_manifest checked that the entry names this file
        try:
            if c.get("file_sha256") and run_file_sha256(run_dir, name) != c["file_sha256"]:
                bad(name, "altered or truncated: its SHA-256 differs from the manifest's")
                continue
            with open_run_file(run_dir, name) as f:
                step, actual = checkpoint_state(f)  # streamed: memory of a few MiB, whatever the header declares
        except RunFileError as e:
            bad(name, e.problem)
            continue
        except (CheckpointError, ValueError, TypeError, OverflowError) as e:
            bad(name, f"unreadable ({str(e):.300})")
            continue
        if actual != c["state_sha256"] or step != c["step"]:
            bad(name, "its state hash differs from the manifest's commitment")
        elif c["step"] == 0 and m.get("initial_state_sha256") is not None and actual != m["initial_state_sha256"]:
            bad(name, f"holds the state {actual[:16]}…, not the run's initial_state_sha256 "
                      f"{str(m['initial_state_sha256'])[:16]}… (which the root commits to)")
    verified = m["mode"] == "verified"
    if verified and m.get("init_log_sha256") is not None:  # None: an own loop built without veritrain.init
        _verify_log(run_dir, INIT_LOG, m.get("init_log_sha256"), 0, m["bits"], bad,
                    "its SHA-256 differs from the manifest's init_log_sha256")
    record_sha = {}
    for s in range(steps):
        name = record_name(s)
        try:
            raw = read_run_file(run_dir, name)
        except RunFileError as e:
            bad(name, e.problem)
            continue
        record_sha[s] = hashlib.sha256(raw).hexdigest()
        try:
            rec = json.loads(raw)
            if not isinstance(rec, dict):
                raise ValueError("not a JSON object")
        except (ValueError, RecursionError) as e:
            bad(name, f"unreadable ({str(e):.200})")
            continue
        if verified:
            _verify_log(run_dir, log_name(s), rec.get("log_sha256"), s, m["bits"], bad,
                        "its SHA-256 differs from the one in its data record")
        if "micro_batches" in m:
            micro = rec.get("micro_batches")
            if not isinstance(micro, list) or len(micro) != micro_batches(m) or not all(isinstance(x, dict) for x in micro):
                bad(name, f"does not list the run's {micro_batches(m)} micro-batches")
            elif verified:
                for g, x in enumerate(micro):
                    _verify_log(run_dir, micro_log_name(s, g), x.get("log_sha256"), s, m["bits"], bad,
                                "its SHA-256 differs from the one in its step's data record")
    # every record file against its hash in a leaf, the leaves against the root
    run_sha = run_sha256(m).hex()
    spans = intervals(steps, m["checkpoint_every"])
    for i, (info, (a, b)) in enumerate(zip(parsed, spans)):
        if (info["interval"], info["first_step"], info["end_step"], info["run_sha256"]) != (i, a, b, run_sha):
            bad(MANIFEST, f"leaf {i} does not describe interval {i} (steps {a}..{b - 1}) of this run")
        if info["state_sha256"] != committed_state(m, b):
            bad(MANIFEST, f"leaf {i} commits to another state than the checkpoint entry for step {b}")
        for s, h in zip(range(a, b), info["records"]):
            if s in record_sha and record_sha[s] != h:
                bad(record_name(s), f"altered or truncated: its SHA-256 differs from the one in leaf {i}")
    if m.get("complete") and len(leaves) != len(spans):
        bad(MANIFEST, f"commits to {len(leaves)} leaves for {len(spans)} intervals")
    got_root = tree_of(leaves).root().hex()
    if m.get("complete") and m.get("root") != got_root:
        bad(MANIFEST, f"its leaves hash to root {got_root[:16]}…, it records root {str(m.get('root'))[:16]}…")
    if root is not None and got_root != root:
        bad(MANIFEST, f"the run's root {got_root[:16]}… is not the expected root {root[:16]}…")
    return {"ok": not problems, "root": got_root, "intervals": len(spans), "steps": steps, "problems": problems}


def _verify_log(run_dir: str, name: str, want_sha256, step: int, bits: int, bad, differs: str):
    """Hash and decode one rounding log in a single pass (what is decoded is what is hashed)."""
    from .logformat import LogFormatError, StepLogReader

    try:
        with open_run_file(run_dir, name) as f:
            error = None
            try:
                reader = StepLogReader(f, expect_step=step, expect_bits=bits)
                while reader.next_op() is not None:
                    pass
            except LogFormatError as e:
                error = e
            f.drain()
            if f.sha256() != want_sha256:
                bad(name, f"altered or truncated: {differs}")
            elif error is not None:
                bad(name, f"malformed ({error})")
    except RunFileError as e:
        bad(name, e.problem)
