"""Canonical hashes of training states and batches (byte layout: docs/FORMAT.md, "State hash").

    state_hash = SHA-256(
        b"veritrain-state/1\\0"
        u64le(step)
        for each tensor, sorted by name (UTF-8 bytes):
            u32le(len(name)) name
            u32le(len(dtype)) dtype          # "float32", "int64", ... (torch dtype name)
            u32le(ndim) ndim * u64le(dim)
            u64le(nbytes) raw little-endian C-order bytes
        u64le(len(meta)) meta                # canonical JSON of everything else: optimizer
    )                                        # hyperparameters, scalar state, scheduler state

Canonical JSON: sorted keys, separators (",", ":"), floats as Python's shortest round-trip repr.
"""

from __future__ import annotations

import hashlib
import json
import struct
import sys

import numpy as np
import torch

STATE_TAG = b"veritrain-state/1\0"
BATCH_TAG = b"veritrain-batch/1\0"
DATA_TAG = b"veritrain-data/1\0"


def canonical_json(obj) -> bytes:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), allow_nan=True, default=_json_default).encode()


def _json_default(o):
    if isinstance(o, torch.Tensor) and o.numel() == 1:
        return o.item()
    if isinstance(o, (np.integer,)):
        return int(o)
    if isinstance(o, (np.floating,)):
        return float(o)
    if isinstance(o, (set, frozenset)):
        return sorted(o)
    if isinstance(o, torch.dtype):
        return str(o)
    raise TypeError(f"cannot commit to a value of type {type(o).__name__}: {o!r}")


def tensor_buffer(t: torch.Tensor):
    """The tensor's raw little-endian C-order bytes as a buffer: a view of its memory where it is already a
    contiguous CPU tensor on a little-endian machine (hashing a checkpoint's tensors then copies nothing)."""
    t = t.detach().to("cpu").contiguous()
    if t.numel() == 0:
        return memoryview(b"")
    raw = t.reshape(-1).view(torch.uint8).numpy() if t.dtype != torch.bool else t.reshape(-1).numpy()
    if sys.byteorder == "big" and t.element_size() > 1:
        raw = np.frombuffer(raw.tobytes(), dtype=np.dtype(f">u{t.element_size()}")).byteswap().tobytes()
    return memoryview(raw).cast("B")


def tensor_bytes(t: torch.Tensor) -> bytes:
    return bytes(tensor_buffer(t))


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def _update_entry(h, name: str, dtype: str, shape, nbytes: int, chunks):
    n, d = name.encode(), dtype.encode()
    h.update(struct.pack("<I", len(n)) + n + struct.pack("<I", len(d)) + d + struct.pack("<I", len(shape)))
    h.update(b"".join(struct.pack("<Q", s) for s in shape))
    h.update(struct.pack("<Q", nbytes))
    for c in chunks:
        h.update(c)


def _update_tensor(h, name: str, t: torch.Tensor):
    raw = tensor_buffer(t)
    _update_entry(h, name, dtype_name(t.dtype), t.shape, raw.nbytes, [raw])


def state_hash(tensors: dict, meta: dict, step: int) -> str:
    h = hashlib.sha256(STATE_TAG + struct.pack("<Q", step))
    for name in sorted(tensors, key=lambda s: s.encode()):
        _update_tensor(h, name, tensors[name])
    m = canonical_json(meta)
    h.update(struct.pack("<Q", len(m)) + m)
    return h.hexdigest()


def streamed_state_hash(entries: dict, meta: dict, step: int) -> str:
    """state_hash from each tensor's (dtype name, shape, nbytes, chunks): ``chunks()`` yields its raw
    little-endian bytes in pieces (a checkpoint's tensor read from its file a few MiB at a time)."""
    h = hashlib.sha256(STATE_TAG + struct.pack("<Q", step))
    for name in sorted(entries, key=lambda s: s.encode()):
        dtype, shape, nbytes, chunks = entries[name]
        _update_entry(h, name, dtype, shape, nbytes, chunks())
    m = canonical_json(meta)
    h.update(struct.pack("<Q", len(m)) + m)
    return h.hexdigest()


def batch_hash(batch) -> str:
    """Hash of the tensors a step consumed, in pytree order (names are their pytree paths)."""
    from torch.utils._pytree import tree_flatten_with_path, keystr

    h = hashlib.sha256(BATCH_TAG)
    leaves, _ = tree_flatten_with_path(batch)
    for path, leaf in leaves:
        if isinstance(leaf, torch.Tensor):
            _update_tensor(h, keystr(path), leaf)
        else:
            m = canonical_json(leaf)
            k = keystr(path).encode()
            h.update(struct.pack("<I", len(k)) + k + b"\xff" + struct.pack("<Q", len(m)) + m)
    return h.hexdigest()


def data_hash(parts) -> str:
    """The data a task read for one config setting, as (name, bytes) parts in the task's order (a corpus: one
    file; a data set: its files by their names, whatever holds them, an archive or a folder)."""
    h = hashlib.sha256(DATA_TAG)
    for name, raw in parts:
        b = name.encode()
        h.update(struct.pack("<I", len(b)) + b + struct.pack("<Q", len(raw)))
        h.update(raw)
    return h.hexdigest()


def is_digest_map(d) -> bool:
    """A task's or a run's data_sha256: config keys to lowercase SHA-256 hex digests."""
    return isinstance(d, dict) and len(d) <= 64 and all(
        isinstance(k, str) and len(k) <= 256 and isinstance(v, str) and len(v) == 64
        and all(c in "0123456789abcdef" for c in v) for k, v in d.items())
