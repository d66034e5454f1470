"""``veritrain inspect``: what a run or an audit holds, as a stable JSON object (docs/FORMAT.md)."""

from __future__ import annotations

import json
import os

from . import store
from .logformat import LogFormatError, StepLogReader

DENSE_BITS_PER_VALUE = 1.6  # the paper's packed encoding: 5 three-way rounding decisions per byte
INSPECT_FORMAT = "veritrain-inspect/1"


def _log_totals(run_dir: str, name: str, step: int, bits: int) -> tuple[int | None, dict | None]:
    """(file size, totals) of one step's log, read as hostile input (store.open_run_file): the size is
    None when the file is refused, the totals None when it does not decode."""
    try:
        f = store.open_run_file(run_dir, name)
    except store.RunFileError:
        return None, None
    try:
        r = StepLogReader(f, expect_step=step, expect_bits=bits)
        while r.next_op() is not None:
            pass
    except LogFormatError:
        return f.size, None
    finally:
        f.close()
    t = r.end
    return f.size, {"rounded_values": t.rounded_values, "direction": t.n_dir, "value": t.n_val,
                    "scalar": t.n_scalar, "ops": t.n_ops}


def _step_log_totals(run_dir: str, names: list[str], step: int, bits: int) -> tuple[int | None, dict | None]:
    """``_log_totals`` summed over a step's log files (None when any is refused or does not decode)."""
    size, total = 0, None
    for name in names:
        n, t = _log_totals(run_dir, name, step, bits)
        if n is None or t is None:
            return n if n is None else size + n, None
        size += n
        total = t if total is None else {k: total[k] + t[k] for k in total}
    return size, total


def _committed_steps(m: dict) -> int:
    """How many steps the manifest's leaves commit to (bounds the files a hostile manifest makes us read)."""
    try:
        return sum(len(store.parse_leaf(bytes.fromhex(x))["records"]) for x in m.get("leaves", []))
    except (ValueError, TypeError, store.RunError):
        return 0


def _committed_final_state(m: dict) -> str | None:
    """The state hash the last leaf commits to (before any leaf: the committed initial state). Not the
    manifest's ``checkpoints`` list, which no commitment covers: a trainer may list any hash there."""
    try:
        leaves = m.get("leaves", [])
        return store.parse_leaf(bytes.fromhex(leaves[-1]))["state_sha256"] if leaves else m.get("initial_state_sha256")
    except (ValueError, TypeError, store.RunError):
        return None


def inspect_run(run_dir: str) -> dict:
    m = store.load_manifest(run_dir)
    steps = min(int(m.get("steps_completed", 0)), _committed_steps(m))
    per_step, log_total, rounded_total = [], 0, 0
    entries = {"direction": 0, "value": 0, "scalar": 0}
    verified = m["mode"] == "verified"
    micro = store.micro_batches(m)
    for s in range(steps):
        row = {"step": s, "loss": None}
        try:
            rec = json.loads(store.read_run_file(run_dir, store.record_name(s)))
            row["loss"] = rec.get("loss") if isinstance(rec, dict) else None
        except (store.RunError, ValueError, RecursionError):
            pass
        if verified:
            # a data-parallel step's logs: its update's and each micro-batch's
            names = [store.log_name(s)] + [store.micro_log_name(s, g) for g in range(micro)] if micro > 1 \
                else [store.log_name(s)]
            row["log_bytes"], tot = _step_log_totals(run_dir, names, s, int(m["bits"]))
            if tot:
                row.update(tot)
                log_total += row["log_bytes"]
                rounded_total += tot["rounded_values"]
                for k in entries:
                    entries[k] += tot[k]
        per_step.append(row)
    final = _committed_final_state(m)
    return {
        "format": INSPECT_FORMAT, "kind": "run", "run": os.path.abspath(run_dir), "task": m["task"],
        "mode": m["mode"], "bits": m["bits"], "seed": m["seed"], "complete": bool(m.get("complete")),
        "root": m.get("root"), "steps": steps, "steps_planned": m.get("steps"),
        "intervals": len(store.intervals(steps, m["checkpoint_every"])), "checkpoint_every": m["checkpoint_every"],
        "micro_batches": micro,
        "final_state_hash": final,
        "log_bytes_total": log_total if verified else None,
        "rounded_values_total": rounded_total if verified else None,
        "dense_encoding_bytes_total": rounded_total * DENSE_BITS_PER_VALUE / 8 if verified else None,
        "entries": entries if verified else None,
        "per_step": per_step,
        "evaluation": m.get("evaluation"),
    }


def inspect_audit(audit_dir: str) -> dict:
    p = os.path.join(audit_dir, "audit.json")
    try:
        with open(p) as f:
            a = json.load(f)
    except (OSError, ValueError) as e:
        raise store.RunError(f"{p} is unreadable ({e})") from None
    ivs = a.get("intervals", [])
    corr = {"forward": 0, "backward": 0, "optimizer": 0}
    for r in ivs:
        for k in corr:
            corr[k] += r.get("corrections", {}).get(k, 0)
    return {
        "format": INSPECT_FORMAT, "kind": "audit", "run": a.get("run"), "root": a.get("root"),
        "intervals_verified": len(ivs), "intervals_matching": sum(1 for r in ivs if r.get("match")),
        "steps": sum(r["steps"][1] - r["steps"][0] for r in ivs if "steps" in r),
        "corrections": corr, "corrections_total": sum(corr.values()),
        "suspicious": sum(r.get("suspicious", 0) for r in ivs),
        "entries_replayed": sum(r.get("entries", 0) for r in ivs),
        "per_interval": [{k: r.get(k) for k in ("interval", "steps", "match", "corrections", "suspicious")} for r in ivs],
        "hardware": a.get("hardware"),
    }


def inspect_dir(path: str) -> dict:
    if os.path.exists(os.path.join(path, "audit.json")) and not os.path.exists(os.path.join(path, store.MANIFEST)):
        return inspect_audit(path)
    return inspect_run(path)
