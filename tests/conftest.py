import json
import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHARED_DATA = os.path.normpath(os.path.join(REPO, "..", "shared", "data"))
# the tests' own tasks (module:function), importable by the CLI processes the tests start with TASKS_ENV
TEST_TASKS = os.path.join(REPO, "tests", "tasks")
TASKS_ENV = {"PYTHONPATH": TEST_TASKS + os.pathsep + os.environ.get("PYTHONPATH", "")}
# the modules that warn when a compiled path falls back to the eager engine (fused.FusedKernels.warn_once,
# fused.compiled_code_rounds, rounding._get_compiled)
COMPILED_PATH_WARNINGS_ARE_ERRORS = "error::UserWarning:veritrain.fused,error::UserWarning:veritrain.rounding"


def shared_file(*parts) -> str:
    path = os.path.join(SHARED_DATA, *parts)
    if not os.path.exists(path):
        pytest.fail(f"{path} is missing: the tests read the shared data beside the checkout (../shared/data)")
    return path


def cli(*args, env=None, check=None, timeout=900, cwd=None):
    """Run ``python -m veritrain.cli ARGS`` in a fresh process (in ``cwd``); returns CompletedProcess."""
    e = dict(os.environ)
    e.pop("VERITRAIN_VARIANT_APPLIED", None)
    e.update(env or {})
    # as in this process (pyproject.toml's filterwarnings): a compiled path's fallback warning is an error
    e["PYTHONWARNINGS"] = ",".join(filter(None, [e.get("PYTHONWARNINGS"), COMPILED_PATH_WARNINGS_ARE_ERRORS]))
    p = subprocess.run([sys.executable, "-m", "veritrain.cli", *map(str, args)], capture_output=True, text=True,
                       env=e, timeout=timeout, cwd=cwd)
    if check is not None and p.returncode != check:
        raise AssertionError(f"veritrain {' '.join(map(str, args))} exited {p.returncode}, expected {check}\n"
                             f"stdout:\n{p.stdout}\nstderr:\n{p.stderr}")
    return p


def audit_json(run_dir, variant, *extra):
    p = cli("audit", run_dir, "--json", "--quiet", "--variant", variant, *extra)
    assert p.returncode in (0, 1), f"audit failed to run (exit {p.returncode}):\n{p.stderr}"
    return json.loads(p.stdout)


@pytest.fixture(scope="session")
def shakespeare():
    return shared_file("shakespeare.txt")


def rewrite_checkpoint(path, edit) -> str:
    """The checkpoint file at ``path`` rewritten by ``edit(tensors, meta)``, its header's state hash recomputed:
    what a hostile trainer writes around a state it chose. Returns the new state hash."""
    from safetensors.torch import load_file, save_file

    from veritrain.checkpoint import read_checkpoint
    from veritrain.commitments import canonical_json, state_hash

    _, meta, step, _ = read_checkpoint(str(path))
    tensors = dict(load_file(str(path)))
    edit(tensors, meta)
    digest = state_hash(tensors, meta, step)
    save_file(tensors, str(path), metadata={"veritrain": canonical_json({"step": step, "meta": meta,
                                                                        "state_sha256": digest}).decode()})
    return digest


def recommit(run_dir):
    """Rewrite a run's commitments (records' log hashes, leaves, root) to match its files as they are now:
    what a dishonest trainer that edited its logs would publish. Returns the new root."""
    import hashlib

    from veritrain import store

    m = store.load_manifest(str(run_dir))
    init_log = os.path.join(run_dir, store.INIT_LOG)
    m["init_log_sha256"] = store.file_sha256(init_log) if os.path.exists(init_log) else None
    run_sha = store.run_sha256(m)
    leaves = []
    for i, (a, b) in enumerate(store.intervals(m["steps"], m["checkpoint_every"])):
        hashes = []
        for s in range(a, b):
            rp = os.path.join(run_dir, store.record_name(s))
            rec = json.loads(open(rp, "rb").read())
            lp = os.path.join(run_dir, store.log_name(s))
            log_sha = store.file_sha256(lp) if os.path.exists(lp) else None
            if "micro_batches" in rec:  # a data-parallel step: each micro-batch's log hash, then the step's
                for g, micro in enumerate(rec["micro_batches"]):
                    mp = os.path.join(run_dir, store.micro_log_name(s, g))
                    micro["log_sha256"] = store.file_sha256(mp) if os.path.exists(mp) else None
                raw = store.parallel_record_bytes(s, rec["micro_batches"], rec["loss"], log_sha)
            else:
                raw = store.record_bytes(s, rec["batch_sha256"], rec["batch_indices"], rec["loss"], log_sha)
            store.write_bytes_atomic(rp, raw)
            hashes.append(hashlib.sha256(raw).hexdigest())
        leaves.append(store.leaf_data(i, a, b, run_sha, store.committed_state(m, b), hashes))
    m["leaves"] = [x.hex() for x in leaves]
    m["root"] = store.tree_of(leaves).root().hex()
    store.save_manifest(str(run_dir), m)
    return m["root"]


def flip_far_rounding(entries, slot, values, grid):
    """The dishonest trainer's steered rounding: one value of an op's output ``slot`` (``values``: its float64
    results, flat) far from any rounding midpoint and without an honest entry, rounded the other way and logged
    as a direction entry in ``entries`` (the trainer's record of it). Returns its position, or None where there
    is no such value."""
    import numpy as np
    import torch

    y32 = slot.y32.view(-1)
    taken = set(entries.dir_pos.tolist()) | set(entries.val_pos.tolist())
    far = [p for p in (grid.midpoint_distance(values) > grid.spacing_at(values) / 4).nonzero().flatten().tolist()
           if p not in taken]
    if not far:
        return None
    p = far[len(far) // 2]
    away = not bool(y32[p].double().abs() > values[p].abs())
    y32[p] = grid.apply_direction(values[p:p + 1], torch.tensor([away]))[0]
    pos = np.append(entries.dir_pos, p)
    order = np.argsort(pos)
    entries.dir_pos, entries.dir_bits = pos[order], np.append(entries.dir_bits, away)[order]
    return p


def forge_wrong_directions(log, forged, targets, y64, tau):
    """A dishonest trainer's one-op log: ``log``'s record with direction entries added at flat positions
    ``targets`` that round the float64 results ``y64`` the wrong way (against their natural rounding given
    ``tau``), written to ``forged``. Returns the positions, checked to hold no honest entry already."""
    import numpy as np

    from veritrain.logformat import StepLogWriter, read_records
    from veritrain.rounding import Grid

    _, _, (record,) = read_records(str(log))
    out = record.outputs[0]
    assert not set(targets.tolist()) & (set(out.dir_pos.tolist()) | set(out.val_pos.tolist()))
    natural_away = Grid(32).classify(y64.reshape(-1)[targets], tau.reshape(-1)[targets])[2]
    pos = np.concatenate([out.dir_pos, targets.numpy()])
    bits = np.concatenate([out.dir_bits, (~natural_away).numpy()])
    order = np.argsort(pos)
    out.dir_pos, out.dir_bits = pos[order].astype(np.int64), bits[order]
    w = StepLogWriter(str(forged), 0, 32)
    w.op(record.name, record.scalars, record.outputs, int(np.prod(out.shape)))
    w.close()
    return targets


# a gpt2-text run of a few seconds: one tiny layer, byte tokens, two steps of one interval each
TINY_TEXT = ["--set", "n_layer=1", "--set", "n_embd=16", "--set", "n_head=2", "--set", "seq_len=16", "--set",
             "batch_size=2", "--steps", 2, "--checkpoint-every", 1, "--quiet"]


def small_corpus(path, seed=0):
    """A text file of 1500 words drawn with ``seed``, for gpt2-text runs that read a corpus (parents created)."""
    import numpy as np

    rng = np.random.default_rng(seed)
    words = ["the", "king", "shall", "not", "speak", "of", "this", "night", "and", "her", "love"]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(" ".join(rng.choice(words, 1500).tolist()) + "\n")
    return path
