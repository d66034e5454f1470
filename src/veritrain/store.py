"""The run store: file names, atomic writes, the per-interval Merkle leaves, and integrity checks.

Spec: docs/FORMAT.md. A run of N steps with checkpoints every k steps has ceil(N / k) *intervals*;
interval i covers steps [i*k, min((i+1)*k, N)) and ends at a checkpoint. Leaf i of the run's Merkle
tree commits to the interval's index and steps, the run description, the state hash at its end, and
the hash of each of its steps' data records (which hold the hash of the step's rounding log).
"""

from __future__ import annotations

import hashlib
import json
import os
import struct

from .commitments import canonical_json
from .merkle import MerkleTree, leaf_hash

MANIFEST = "manifest.json"
FORMAT = "veritrain-run/1"
LEAF_TAG = b"veritrain-leaf/1\0"
RUN_FIELDS = ("format", "task", "task_source_sha256", "config", "seed", "mode", "bits", "thresholds", "slack",
              "steps", "checkpoint_every", "initial_state_sha256")


class RunError(ValueError):
    """Bad input: a missing or malformed run directory, manifest or option."""


def ckpt_name(step: int) -> str:
    return f"checkpoints/step_{step:08d}.safetensors"


def log_name(step: int) -> str:
    return f"logs/step_{step:08d}.vtlog"


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


def write_bytes_atomic(path: str, data: bytes):
    """Temporary name in the same folder, fsync, rename: readers see the old file or the new one."""
    d = os.path.dirname(os.path.abspath(path))
    os.makedirs(d, exist_ok=True)
    tmp = os.path.join(d, f".tmp-{os.getpid()}-{os.path.basename(path)}")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
    fsync_dir(d)


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


# --- manifest -----------------------------------------------------------------------------------


def manifest_digest(manifest: dict) -> str:
    """SHA-256 of the manifest's canonical JSON without its own ``manifest_sha256`` field."""
    return hashlib.sha256(canonical_json({k: v for k, v in manifest.items() if k != "manifest_sha256"})).hexdigest()


def save_manifest(run_dir: str, manifest: dict):
    manifest["manifest_sha256"] = manifest_digest(manifest)
    write_json_atomic(os.path.join(run_dir, MANIFEST), manifest)


def load_manifest(run_dir: str, check_digest: bool = True) -> dict:
    p = os.path.join(run_dir, MANIFEST)
    if not os.path.isdir(run_dir):
        raise RunError(f"run directory {run_dir} does not exist")
    try:
        with open(p, "rb") as f:
            raw = f.read(64 << 20)
        m = json.loads(raw)
    except FileNotFoundError:
        raise RunError(f"{run_dir} has no {MANIFEST}: not a veritrain run directory") from None
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as e:
        raise RunError(f"{p} is not valid JSON ({type(e).__name__}: {e})") from None
    except OSError as e:
        raise RunError(f"cannot read {p}: {e}") from None
    if not isinstance(m, dict) or m.get("format") != FORMAT:
        raise RunError(f"{p}: unknown format {m.get('format') if isinstance(m, dict) else None!r}, expected {FORMAT}")
    for key, typ in (("task", str), ("config", dict), ("seed", int), ("mode", str), ("bits", int),
                     ("thresholds", dict), ("steps", int), ("checkpoint_every", int), ("checkpoints", list)):
        if not isinstance(m.get(key), typ) or isinstance(m.get(key), bool):
            raise RunError(f"{p}: field {key!r} is missing or not a {typ.__name__}")
    if m["steps"] < 0 or m["checkpoint_every"] <= 0:
        raise RunError(f"{p}: steps must be >= 0 and checkpoint_every > 0")
    for c in m["checkpoints"]:
        if not (isinstance(c, dict) and isinstance(c.get("step"), int) and isinstance(c.get("file"), str)
                and isinstance(c.get("state_sha256"), str)):
            raise RunError(f"{p}: malformed checkpoint entry {c!r:.200}")
    if check_digest and "manifest_sha256" in m and m["manifest_sha256"] != manifest_digest(m):
        raise RunError(f"{p} is altered: its content does not match its manifest_sha256")
    return m


def run_description(manifest: dict) -> dict:
    return {k: manifest.get(k) for k in RUN_FIELDS}


def run_sha256(manifest: dict) -> bytes:
    return hashlib.sha256(canonical_json(run_description(manifest))).digest()


# --- records and leaves -------------------------------------------------------------------------


def record_bytes(step: int, batch_sha256: str, batch_indices, loss: float, log_sha256: str | None) -> bytes:
    """A step's data record, as canonical JSON: trainer and auditor build the same bytes."""
    return canonical_json({"step": step, "batch_sha256": batch_sha256, "batch_indices": batch_indices,
                           "loss": loss, "log_sha256": log_sha256}) + b"\n"


def intervals(steps: int, every: int) -> list[tuple[int, int]]:
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


def tree_of(leaves: list[bytes]) -> MerkleTree:
    return MerkleTree([leaf_hash(x) for x in leaves])


# --- integrity ----------------------------------------------------------------------------------


def verify(run_dir: str, root: str | None = None) -> dict:
    """Check every file of a run against the manifest and the Merkle root, without replaying.

    Returns {"ok", "root", "intervals", "steps", "problems": [{"file", "problem"}]}; a problem names the
    file (missing, truncated or altered) and what does not match.
    """
    from .checkpoint import CheckpointError, read_checkpoint
    from .commitments import state_hash
    from .logformat import LogFormatError, StepLogReader

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
    steps = int(m.get("steps_completed", m["steps"]))
    for c in m["checkpoints"]:
        p = os.path.join(run_dir, c["file"])
        if c["file"] != ckpt_name(c["step"]):
            bad(MANIFEST, f"checkpoint entry for step {c['step']} names {c['file']!r}")
            continue
        if not os.path.exists(p):
            bad(c["file"], "missing")
            continue
        if c.get("file_sha256") and file_sha256(p) != c["file_sha256"]:
            bad(c["file"], "altered or truncated: its SHA-256 differs from the manifest's")
            continue
        try:
            tensors, meta, step, recorded = read_checkpoint(p)
            actual = state_hash(tensors, meta, step)
        except CheckpointError as e:
            bad(c["file"], f"unreadable ({e})")
            continue
        if actual != c["state_sha256"] or step != c["step"]:
            bad(c["file"], "its state hash differs from the manifest's commitment")
    verified = m["mode"] == "verified"
    for s in range(steps):
        rp = os.path.join(run_dir, record_name(s))
        if not os.path.exists(rp):
            bad(record_name(s), "missing")
            continue
        try:
            with open(rp, "rb") as f:
                rec = json.loads(f.read(1 << 20))
            if not isinstance(rec, dict):
                raise ValueError("not a JSON object")
        except (ValueError, UnicodeDecodeError) as e:
            bad(record_name(s), f"unreadable ({e})")
            continue
        if not verified:
            continue
        lp = os.path.join(run_dir, log_name(s))
        if not os.path.exists(lp):
            bad(log_name(s), "missing")
            continue
        if file_sha256(lp) != rec.get("log_sha256"):
            bad(log_name(s), "altered or truncated: its SHA-256 differs from the one in its data record")
            continue
        try:
            reader = StepLogReader(lp, expect_step=s, expect_bits=m["bits"])
            while reader.next_op() is not None:
                pass
            reader.close()
        except LogFormatError as e:
            bad(log_name(s), f"malformed ({e})")
    # the committed leaves: every record file against its hash in a leaf, the leaves against the root
    got_root = None
    try:
        leaves = [bytes.fromhex(x) for x in m.get("leaves", [])]
        parsed = [parse_leaf(x) for x in leaves]
    except (ValueError, RunError) as e:
        bad(MANIFEST, f"malformed leaves ({e})")
        leaves, parsed = [], []
    run_sha = run_sha256(m).hex()
    for i, (info, (a, b)) in enumerate(zip(parsed, intervals(steps, m["checkpoint_every"]))):
        if (info["interval"], info["first_step"], info["end_step"], info["run_sha256"]) != (i, a, b, run_sha):
            bad(MANIFEST, f"leaf {i} does not describe interval {i} (steps {a}..{b - 1}) of this run")
        if info["state_sha256"] != committed_state(m, b):
            bad(MANIFEST, f"leaf {i} commits to another state than the checkpoint entry for step {b}")
        for s, h in zip(range(a, b), info["records"]):
            rp = os.path.join(run_dir, record_name(s))
            if os.path.exists(rp) and file_sha256(rp) != h:
                bad(record_name(s), f"altered or truncated: its SHA-256 differs from the one in leaf {i}")
    if m.get("complete") and len(leaves) != len(intervals(steps, m["checkpoint_every"])):
        bad(MANIFEST, f"commits to {len(leaves)} leaves for {len(intervals(steps, m['checkpoint_every']))} intervals")
    got_root = tree_of(leaves).root().hex()
    if m.get("complete") and m.get("root") != got_root:
        bad(MANIFEST, f"its leaves hash to root {got_root[:16]}…, it records root {str(m.get('root'))[:16]}…")
    if root is not None and got_root != root:
        bad(MANIFEST, f"the run's root {got_root[:16]}… is not the expected root {root[:16]}…")
    return {"ok": not problems, "root": got_root, "intervals": len(intervals(steps, m["checkpoint_every"])),
            "steps": steps, "problems": problems}
