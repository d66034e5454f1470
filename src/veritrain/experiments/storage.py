"""Table 2 of the paper: bytes of log per training step, for the paper's encodings and ours, by rounding
amount b, beside a full weight checkpoint per step (proof-of-learning style).

    naive          1 byte per rounded value (the paper's first encoding)
    packed         5 three-state decisions per byte (1.6 bits per rounded value)
    packed+zip     the packed stream, deflate-compressed (zlib level 6)
    veritrain      our log file (sparse entries, zstd)
    checkpoint     the model's weights, float32, once per step

The packed streams are built from the trainer's own log: a value is "no entry" unless the log has an
entry for it (direction up/down, or a value entry, counted as a decision)."""

from __future__ import annotations

import os
import zlib

import numpy as np

from .. import store
from ..logformat import StepLogReader
from .common import bits_arg, read_table, start, Output, train

POWERS = np.array([1, 3, 9, 27, 81], dtype=np.uint16)


class PackedZip:
    """Streams three-state decisions into base-3 bytes (5 per byte) and deflates them."""

    def __init__(self):
        self.z = zlib.compressobj(6)
        self.carry = np.zeros(0, np.uint8)
        self.packed = 0
        self.zipped = 0

    def add(self, states: np.ndarray):
        states = np.concatenate([self.carry, states])
        n = len(states) - len(states) % 5
        self.carry = states[n:]
        packed = (states[:n].reshape(-1, 5).astype(np.uint16) @ POWERS).astype(np.uint8)
        self.packed += len(packed)
        self.zipped += len(self.z.compress(packed.tobytes()))

    def close(self):
        if len(self.carry):
            self.add(np.zeros(5 - len(self.carry), np.uint8))
        self.zipped += len(self.z.flush())
        return self.packed, self.zipped


def step_sizes(run_dir: str, step: int, bits: int) -> dict:
    r = StepLogReader(os.path.join(run_dir, store.log_name(step)), expect_step=step, expect_bits=bits)
    pz = PackedZip()
    rounded = 0
    chunk = 1 << 24
    while (op := r.next_op()) is not None:
        for o in op.outputs:
            n = int(np.prod(o.shape)) if len(o.shape) else 1
            rounded += n
            for a in range(0, n, chunk):  # states of elements [a, a + chunk)
                b = min(n, a + chunk)
                s = np.zeros(b - a, np.uint8)
                sel = (o.dir_pos >= a) & (o.dir_pos < b)
                s[o.dir_pos[sel] - a] = 1 + o.dir_bits[sel].astype(np.uint8)
                sel = (o.val_pos >= a) & (o.val_pos < b)
                s[o.val_pos[sel] - a] = 2
                pz.add(s)
    r.close()
    packed, zipped = pz.close()
    return {"rounded_values": rounded, "naive_bytes": rounded, "packed_bytes": packed, "packed_zip_bytes": zipped,
            "veritrain_bytes": os.path.getsize(os.path.join(run_dir, store.log_name(step)))}


def weight_bytes(run_dir: str) -> int:
    from ..checkpoint import read_checkpoint

    tensors, _, _, _ = read_checkpoint(os.path.join(run_dir, store.ckpt_name(0)))
    return sum(t.numel() * t.element_size() for k, t in tensors.items() if k.startswith("model/"))


def run(args) -> Output:
    bits_list = bits_arg(args, [32, 30, 28, 26])
    loads, out = start(args, "storage", bits=bits_list)
    rows = []
    for w, (task, config) in loads.items():
        for b in bits_list:
            run_dir = out.run_path(f"{w}-b{b}")
            train(run_dir, task, config, args.steps, every=args.steps, bits=b, device=args.device)
            per = [step_sizes(run_dir, s, b) for s in range(args.steps)]
            row = {"workload": w, "bits": b}
            for k in per[0]:
                row[k] = sum(p[k] for p in per) / len(per)
            row["checkpoint_bytes"] = weight_bytes(run_dir)
            row["packed_over_veritrain"] = row["packed_bytes"] / row["veritrain_bytes"]
            rows.append(row)
    cols = ["workload", "bits", "rounded_values", "naive_bytes", "packed_bytes", "packed_zip_bytes", "veritrain_bytes",
            "checkpoint_bytes", "packed_over_veritrain"]
    out.table(rows, cols)
    plt = out.figure()
    fig, axes = plt.subplots(1, len(loads), figsize=(5.5 * len(loads), 3.8), squeeze=False)
    kinds = [("naive_bytes", "naive"), ("packed_bytes", "packed"), ("packed_zip_bytes", "packed+zip"),
             ("veritrain_bytes", "veritrain"), ("checkpoint_bytes", "checkpoint")]
    for ax, w in zip(axes[0], loads):
        rs = [r for r in rows if r["workload"] == w]
        x = np.arange(len(rs))
        for j, (k, label) in enumerate(kinds):
            ax.bar(x + j * 0.16, [r[k] for r in rs], 0.16, label=label)
        ax.set_xticks(x + 0.32, [f"b={r['bits']}" for r in rs])
        ax.set_yscale("log")
        ax.set_ylabel("bytes per step")
        ax.set_title(w)
        ax.legend(fontsize=7)
    out.save_figure(plt)
    out.markdown("Storage per training step (paper Table 2)",
                 "Bytes per step, averaged over the steps. The paper reports, for GPT-2 on its GPUs, 18 MB of log "
                 "per step and 2.78 GB for a proof-of-learning checkpoint per step.", rows, cols,
                 {"rounded_values": ".3g", "naive_bytes": ".3g", "packed_bytes": ".3g", "packed_zip_bytes": ".3g",
                  "veritrain_bytes": ".0f", "checkpoint_bytes": ".3g", "packed_over_veritrain": ".0f"})
    return out


def check(out_dir: str) -> list[str]:
    rows = read_table(out_dir, "storage")
    return [f"{r['workload']} b={r['bits']}: ours {r['veritrain_bytes']} >= packed {r['packed_bytes']}"
            for r in rows if float(r["veritrain_bytes"]) >= float(r["packed_bytes"])]
