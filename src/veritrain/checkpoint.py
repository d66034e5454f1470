"""Training state: collect it, hash it, save it as safetensors, load it back.

A state is (model parameters and buffers, optimizer state and hyperparameters, scheduler state, step).
Tensor names in files and hashes:

    model/<state_dict key>
    optimizer/state/<parameter name>/<key>     (parameter names from model.named_parameters())

Everything that is not a tensor (optimizer param_groups, non-tensor optimizer state, scheduler state) is
kept as canonical JSON in the file's metadata and in the hash.
"""

from __future__ import annotations

import json
import math
import os
import tempfile

import torch
from safetensors import SafetensorError
from safetensors.torch import save_file

from .commitments import canonical_json, state_hash
from .store import fsync_dir


class CheckpointError(ValueError):
    pass


def _param_names(model, optimizer):
    by_id = {id(p): n for n, p in model.named_parameters(remove_duplicate=False)}
    names = []
    for group in optimizer.param_groups:
        for p in group["params"]:
            names.append(by_id.get(id(p), f"__param{len(names)}"))
    return names


def collect_state(model, optimizer, scheduler, step: int):
    tensors, meta = {}, {}
    for k, v in model.state_dict().items():
        tensors[f"model/{k}"] = v.detach()
    names = _param_names(model, optimizer)
    sd = optimizer.state_dict()
    opt_scalars = {}
    for idx, st in sd["state"].items():
        pname = names[idx]
        for key, val in st.items():
            if isinstance(val, torch.Tensor):
                tensors[f"optimizer/state/{pname}/{key}"] = val.detach()
            else:
                opt_scalars.setdefault(pname, {})[key] = val
    groups = []
    for g in sd["param_groups"]:
        g = dict(g)
        g["params"] = [names[i] for i in g["params"]]
        groups.append(g)
    meta["optimizer"] = {"class": type(optimizer).__name__, "param_groups": groups, "scalar_state": opt_scalars}
    meta["scheduler"] = _scheduler_state(scheduler)
    return tensors, meta


def _scheduler_state(scheduler):
    if scheduler is None:
        return None
    sd = scheduler.state_dict()
    try:
        canonical_json(sd)
    except TypeError as e:
        raise CheckpointError(f"scheduler state is not serialisable ({e}); use a scheduler whose "
                              f"state_dict() holds plain values") from None
    return {"class": type(scheduler).__name__, "state": sd}


def hash_state(model, optimizer, scheduler, step: int) -> str:
    tensors, meta = collect_state(model, optimizer, scheduler, step)
    return state_hash(tensors, meta, step)


def save_checkpoint(path: str, model, optimizer, scheduler, step: int) -> str:
    """Write atomically; returns the state hash."""
    tensors, meta = collect_state(model, optimizer, scheduler, step)
    digest = state_hash(tensors, meta, step)
    header = {"veritrain": canonical_json({"step": step, "meta": meta, "state_sha256": digest}).decode()}
    d = os.path.dirname(os.path.abspath(path))
    os.makedirs(d, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".tmp-", dir=d)
    os.close(fd)
    try:
        save_file(_unshared(tensors), tmp, metadata=header)
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
        fsync_dir(d)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
    return digest


def _unshared(tensors: dict) -> dict:
    """Contiguous CPU tensors, copying any that share storage with one already taken (tied weights)."""
    seen, out = set(), {}
    for k in sorted(tensors):
        v = tensors[k].detach().contiguous().cpu()
        key = (v.untyped_storage().data_ptr(), v.storage_offset()) if v.numel() else None
        if key is not None and key in seen:
            v = v.clone()
        seen.add(key)
        out[k] = v
    return out


def _safetensors_path(f) -> str:
    """A path that opens the very file ``f`` holds open (Linux: /proc/self/fd), else its checked path."""
    proc = f"/proc/self/fd/{f.fileno()}"
    return proc if os.path.exists(proc) else f.path


def read_checkpoint(source):
    """(tensors, meta, step, recorded state hash) of a checkpoint: a path, or a file opened by
    store.open_run_file. Either way it is read as hostile input: a regular file (no symlink, fifo or
    device) within store.MAX_CHECKPOINT_BYTES, checked before safetensors reads it (with pread, not
    mmap, where safetensors can). Raises CheckpointError naming the problem."""
    from safetensors import safe_open

    from .store import MAX_CHECKPOINT_BYTES, RunFileError, open_regular_file

    owned = None
    if isinstance(source, (str, os.PathLike)):
        try:
            owned = f = open_regular_file(os.fspath(source), MAX_CHECKPOINT_BYTES, "checkpoint")
        except RunFileError as e:
            raise CheckpointError(f"checkpoint {e}") from None
    else:
        f = source
    path = f.path
    try:
        target = _safetensors_path(f)
        try:
            handle = safe_open(target, framework="pt", backend="pread")
        except TypeError:  # safetensors < 0.8: no backend choice (mmap)
            handle = safe_open(target, framework="pt")
        with handle as st:
            header = st.metadata() or {}
            tensors = {k: st.get_tensor(k) for k in st.keys()}
        info = json.loads(header["veritrain"])
        if not (isinstance(info, dict) and isinstance(info.get("meta"), dict) and isinstance(info.get("step"), int)
                and not isinstance(info["step"], bool) and info["step"] >= 0
                and isinstance(info.get("state_sha256"), str)):
            raise ValueError("its veritrain metadata is not {step, meta, state_sha256}")
    except (SafetensorError, KeyError, json.JSONDecodeError, OSError, ValueError, TypeError, RecursionError) as e:
        raise CheckpointError(f"checkpoint {path} is unreadable or not a veritrain checkpoint "
                              f"({str(e):.300})") from None
    finally:
        if owned is not None:
            owned.close()
    return tensors, info["meta"], info["step"], info["state_sha256"]


def load_checkpoint(source, model, optimizer, scheduler):
    """Restore the state in place; returns (step, recomputed state hash). ``source`` is a path or a file
    opened by store.open_run_file (read_checkpoint). A file that does not hold a state of the task is a
    CheckpointError, whatever its header says."""
    tensors, meta, step, recorded = read_checkpoint(source)
    path = os.fspath(source) if isinstance(source, (str, os.PathLike)) else source.path
    try:
        actual = state_hash(tensors, meta, step)
    except (ValueError, TypeError, OverflowError, RecursionError) as e:
        raise CheckpointError(f"checkpoint {path} holds no hashable state ({str(e):.200})") from None
    if actual != recorded:
        raise CheckpointError(f"checkpoint {path} is corrupt: its contents hash to {actual[:16]}…, "
                              f"its header says {recorded[:16]}…")
    try:
        _restore(path, tensors, meta, model, optimizer, scheduler)
    except CheckpointError:
        raise
    except (KeyError, TypeError, ValueError, AttributeError, IndexError, RuntimeError) as e:
        raise CheckpointError(f"checkpoint {path} does not hold a state of the task "
                              f"({type(e).__name__}: {str(e):.200})") from None
    return step, hash_state(model, optimizer, scheduler, step)


def _restore(path, tensors, meta, model, optimizer, scheduler):
    model_sd = {k[len("model/"):]: v for k, v in tensors.items() if k.startswith("model/")}
    try:
        model.load_state_dict(model_sd, strict=True)
    except RuntimeError as e:
        raise CheckpointError(f"checkpoint {path} does not fit the task's model: {e}") from None
    names = _param_names(model, optimizer)
    index = {n: i for i, n in enumerate(names)}
    state: dict = {}
    for k, v in tensors.items():
        if k.startswith("optimizer/state/"):
            pname, key = k[len("optimizer/state/"):].rsplit("/", 1)
            if pname not in index:
                raise CheckpointError(f"checkpoint {path}: optimizer state for unknown parameter {pname}")
            state.setdefault(index[pname], {})[key] = v
    for pname, vals in meta["optimizer"].get("scalar_state", {}).items():
        state.setdefault(index[pname], {}).update(vals)
    groups = []
    for g in meta["optimizer"]["param_groups"]:
        g = dict(g)
        try:
            g["params"] = [index[n] for n in g["params"]]
        except KeyError as e:
            raise CheckpointError(f"checkpoint {path}: optimizer group names unknown parameter {e}") from None
        groups.append(g)
    if meta["optimizer"]["class"] != type(optimizer).__name__:
        raise CheckpointError(f"checkpoint {path} holds {meta['optimizer']['class']} state, "
                              f"the task builds {type(optimizer).__name__}")
    _check_settings(path, groups, optimizer.param_groups)
    optimizer.load_state_dict({"state": state, "param_groups": groups})
    _restore_exact_dtypes(optimizer, state)
    if scheduler is not None and meta.get("scheduler"):
        scheduler.load_state_dict(meta["scheduler"]["state"])


def _check_settings(path, groups, own):
    """The optimizer settings a checkpoint restores against the task's own optimizer's: flags and text equal
    (amsgrad, foreach, capturable, ...: they choose other code), numbers finite numbers (a learning rate is
    state that changes), sequences of the same length. A setting the task's code cannot take (a learning rate
    of "abc" or 10**400, amsgrad without its state) failed inside the replayed step. Settings one side's torch
    does not have are left to torch's load_state_dict, which gives them their defaults (another torch version
    wrote the checkpoint)."""
    if len(groups) != len(own):
        raise CheckpointError(f"checkpoint {path} holds {len(groups)} optimizer groups, the task has {len(own)}")
    for i, (g, mine) in enumerate(zip(groups, own)):
        for key, want in mine.items():
            if key != "params" and key in g and not _same_kind(g[key], want):
                raise CheckpointError(f"checkpoint {path}: optimizer group {i} sets {key!r} to {str(g[key])[:40]!r}, "
                                      f"which the task's {want!r} does not allow")


def _same_kind(got, want) -> bool:
    if isinstance(want, bool) or want is None or isinstance(want, str):
        return type(got) is type(want) and got == want
    if isinstance(want, (int, float)):
        return isinstance(got, (int, float)) and not isinstance(got, bool) and abs(got) < math.inf
    if isinstance(want, (list, tuple)):
        return isinstance(got, (list, tuple)) and len(got) == len(want) and all(map(_same_kind, got, want))
    return type(got) is type(want)


def _restore_exact_dtypes(optimizer, state):
    # load_state_dict casts floating state to the parameter's dtype; keep what was saved (e.g. 'step')
    for idx, vals in state.items():
        p = [p for g in optimizer.param_groups for p in g["params"]][idx]
        for key, v in vals.items():
            if isinstance(v, torch.Tensor):
                cur = optimizer.state[p].get(key)
                if isinstance(cur, torch.Tensor) and cur.dtype != v.dtype:
                    optimizer.state[p][key] = v.to(cur.device)
