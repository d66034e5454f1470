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

from .commitments import canonical_json, dtype_name, state_hash, streamed_state_hash, tensor_buffer
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


# safetensors' dtype codes, as commitments.dtype_name names torch's dtypes
_DTYPES = {"F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16", "I64": "int64", "I32": "int32",
           "I16": "int16", "I8": "int8", "U8": "uint8", "U16": "uint16", "U32": "uint32", "U64": "uint64", "BOOL": "bool",
           "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2"}
MAX_STATE_TENSORS = 8  # per parameter; torch's optimizers keep at most 4 (a step, two moments, amsgrad's maximum)
_READ_ERRORS = (SafetensorError, KeyError, json.JSONDecodeError, OSError, ValueError, TypeError, RecursionError)


class _Checkpoint:
    """An open checkpoint file: its veritrain header (step, meta, recorded state hash), its tensors' layout
    (name -> (dtype name, shape)) from the safetensors header, and tensors read one at a time on request."""

    def __init__(self, st, path):
        self.st, self.path = st, path
        header = st.metadata() or {}
        info = json.loads(header["veritrain"])
        if not (isinstance(info, dict) and isinstance(info.get("meta"), dict) and isinstance(info.get("step"), int)
                and not isinstance(info["step"], bool) and info["step"] >= 0
                and isinstance(info.get("state_sha256"), str)):
            raise ValueError("its veritrain metadata is not {step, meta, state_sha256}")
        self.meta, self.step, self.recorded = info["meta"], info["step"], info["state_sha256"]
        self.layout = {}
        for k in st.keys():
            sl = st.get_slice(k)  # the header's entry: nothing of the data is read
            self.layout[k] = (_DTYPES.get(sl.get_dtype(), sl.get_dtype()), tuple(sl.get_shape()))

    def tensor(self, name):
        return self.st.get_tensor(name)


_CHUNK = 8 << 20


def _streamed_entries(ck: _Checkpoint, fd: int) -> dict:
    """{name: (dtype name, shape, nbytes, chunks)} for commitments.streamed_state_hash: each tensor's bytes read
    from the file (safetensors' layout: u64le header size, JSON header, little-endian C-order data) in pieces
    of _CHUNK bytes, which safe_open has checked lie inside the file without overlapping. A tensor of a dtype
    this table does not name is read whole by safetensors."""
    head = os.pread(fd, 8, 0)
    n = int.from_bytes(head, "little")
    header = json.loads(os.pread(fd, n, 8))
    out = {}
    for name, (dtype, shape) in ck.layout.items():
        begin, end = header[name]["data_offsets"]
        if dtype not in _DTYPES.values():
            t = ck.tensor(name)
            raw = tensor_buffer(t)
            out[name] = (dtype_name(t.dtype), tuple(t.shape), raw.nbytes, lambda raw=raw: [raw])
            continue

        def chunks(at=8 + n + begin, stop=8 + n + end):
            while at < stop:
                piece = os.pread(fd, min(_CHUNK, stop - at), at)
                if not piece:
                    raise OSError("the file ended inside a tensor")
                at += len(piece)
                yield piece

        out[name] = (dtype, shape, end - begin, chunks)
    return out


def _with_checkpoint(source, use, with_fd=False):
    """``use(_Checkpoint)`` on a checkpoint given as a path or a file opened by store.open_run_file, read as
    hostile input: a regular file (no symlink, fifo or device) within store.MAX_CHECKPOINT_BYTES, checked
    before safetensors reads it (with pread, not mmap, where safetensors can). A CheckpointError ``use``
    raises passes; any other failure to read is a CheckpointError naming the file."""
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
            return use(_Checkpoint(st, path), f.fileno()) if with_fd else use(_Checkpoint(st, path))
    except CheckpointError:
        raise
    except _READ_ERRORS as e:
        raise CheckpointError(f"checkpoint {path} is unreadable or not a veritrain checkpoint "
                              f"({str(e):.300})") from None
    finally:
        if owned is not None:
            owned.close()


def read_checkpoint(source, check=None):
    """(tensors, meta, step, recorded state hash) of a checkpoint: a path, or a file opened by
    store.open_run_file (read as hostile input: _with_checkpoint). ``check(path, layout)``, given, sees
    the tensors' names, dtypes and shapes from the file's header before any tensor is read, and raises
    CheckpointError to refuse them. Raises CheckpointError naming the problem."""
    def use(ck):
        if check is not None:
            check(ck.path, ck.layout)
        return {k: ck.tensor(k) for k in ck.layout}, ck.meta, ck.step, ck.recorded

    return _with_checkpoint(source, use)


def checkpoint_state(source) -> tuple[int, str]:
    """(step, state hash of its contents) of a checkpoint (read as read_checkpoint does), its tensors' bytes
    streamed from the file a few MiB at a time: a checkpoint whose header declares a 60 GiB tensor (a sparse
    file of a few KB) costs reading time, not memory. Raises CheckpointError naming the problem."""
    def use(ck, fd):
        entries = _streamed_entries(ck, fd)
        try:
            return ck.step, streamed_state_hash(entries, ck.meta, ck.step)
        except (ValueError, TypeError, OverflowError, RecursionError) as e:  # OSError: _with_checkpoint's
            raise CheckpointError(f"checkpoint {ck.path} holds no hashable state ({str(e):.200})") from None

    return _with_checkpoint(source, use, with_fd=True)


def _expect_state_of(model, optimizer):
    """check(path, layout) for read_checkpoint: the tensors of a state of ``model`` and ``optimizer``. The
    model's are exactly its state_dict's (names, dtypes, shapes); an optimizer's are named after a parameter,
    at most MAX_STATE_TENSORS of them per parameter, none with more elements than its parameter. So a file
    with a junk extra tensor (or a larger one) is refused before its data is read (a sparse file of a few KB
    can declare 64 GiB of tensors)."""
    want = {f"model/{k}": (dtype_name(v.dtype), tuple(v.shape)) for k, v in model.state_dict().items()}
    params = [p for g in optimizer.param_groups for p in g["params"]]
    sizes = {n: max(p.numel(), 1) for n, p in zip(_param_names(model, optimizer), params)}

    def check(path, layout):
        per_param = {}
        for name, (dtype, shape) in layout.items():
            if name in want:
                wd, ws = want[name]
                if dtype != wd:
                    raise CheckpointError(f"checkpoint {path}: tensor {name} is {dtype}, the task's model has {wd}")
                if shape != ws:
                    raise CheckpointError(f"checkpoint {path}: tensor {name} has shape {list(shape)}, the task's "
                                          f"model has {list(ws)}")
            elif name.startswith("optimizer/state/"):
                pname = name[len("optimizer/state/"):].rpartition("/")[0]
                if pname not in sizes:
                    raise CheckpointError(f"checkpoint {path}: tensor {name:.200} is optimizer state of {pname!r:.200}, "
                                          f"not a parameter of the task")
                per_param[pname] = per_param.get(pname, 0) + 1
                if per_param[pname] > MAX_STATE_TENSORS:
                    raise CheckpointError(f"checkpoint {path} holds more than {MAX_STATE_TENSORS} optimizer state "
                                          f"tensors for parameter {pname}")
                n = math.prod(shape)
                if n > sizes[pname]:
                    raise CheckpointError(f"checkpoint {path}: tensor {name} ({n} elements) has more elements than "
                                          f"its parameter ({sizes[pname]})")
            else:
                what = "model" if name.startswith("model/") else "model or optimizer"
                raise CheckpointError(f"checkpoint {path}: tensor {name!r:.200} is not a tensor of the task's {what}")
        missing = sorted(set(want) - set(layout))
        if missing:
            more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
            raise CheckpointError(f"checkpoint {path} lacks {missing[0]}{more} of the task's model")

    return check


def load_checkpoint(source, model, optimizer, scheduler):
    """Restore the state in place; returns (step, recomputed state hash). ``source`` is a path or a file
    opened by store.open_run_file (read_checkpoint). A file that does not hold a state of the task is a
    CheckpointError, whatever its header says; its tensors' names, dtypes and shapes are checked against the
    task's before any is read (_expect_state_of)."""
    tensors, meta, step, recorded = read_checkpoint(source, check=_expect_state_of(model, optimizer))
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
