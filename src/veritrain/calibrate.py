"""Threshold calibration: how far do float64 results really differ between machines?

A reference run (this machine) records every approx op's float64 result y and error scale s before
rounding. Each hardware variant then replays the same run with its log, so every op sees exactly the
trainer's inputs, and measures per element

    ratio = |y_variant - y_reference| / (u * s)        (u = 2**-53)

The engine's threshold for an op class is c * u * s, so the largest ratio seen in a class is the
smallest c that would have covered it; the recommended c is that times a safety factor. Elements
certified exact (s = 0) must not differ at all; any that do are reported as violations.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from collections import defaultdict

import numpy as np
import torch

from .rounding import UNIT_ROUNDOFF

SAFETY = 8.0


class ReferenceProbe:
    """Writes (y, s) of every approx output, one pair of files per step."""

    def __init__(self, folder: str):
        self.folder = folder
        os.makedirs(folder, exist_ok=True)
        self.step = None
        self.index = []
        self._fy = self._fs = None
        self.offset = 0

    def _open(self, step):
        self.close()
        self.step, self.index, self.offset = step, [], 0
        self._fy = open(os.path.join(self.folder, f"y_{step:08d}.f64"), "wb")
        self._fs = open(os.path.join(self.folder, f"s_{step:08d}.f32"), "wb")

    def __call__(self, step, op_index, name, op_class, slot, y, scale_fn):
        if step != self.step:
            self._open(step)
        y = y.detach().contiguous().to("cpu", torch.float64)
        s = scale_fn().contiguous().to("cpu", torch.float32)
        self._fy.write(y.numpy().tobytes())
        self._fs.write(s.numpy().tobytes())
        self.index.append([op_index, name, op_class, slot, self.offset, y.numel()])
        self.offset += y.numel()

    def close(self):
        if self._fy is not None:
            self._fy.close()
            self._fs.close()
            with open(os.path.join(self.folder, f"index_{self.step:08d}.json"), "w") as f:
                json.dump(self.index, f)
            self._fy = self._fs = None


class CompareProbe:
    """Compares this machine's (y) with the reference's, op by op."""

    def __init__(self, folder: str):
        self.folder = folder
        self.step = None
        self.classes = defaultdict(lambda: {"elements": 0, "differing": 0, "max_ratio": 0.0, "exact_violations": 0,
                                            "log2_ratio_histogram": defaultdict(int), "rounding_disagreements": 0,
                                            "needed": []})
        self.ops = defaultdict(lambda: {"elements": 0, "differing": 0, "max_ratio": 0.0, "rounding_disagreements": 0,
                                        "needed": []})
        self.grid = None

    def _load(self, step):
        self.step = step
        with open(os.path.join(self.folder, f"index_{step:08d}.json")) as f:
            self.index = {(e[0], e[3]): e for e in json.load(f)}
        self.y = np.memmap(os.path.join(self.folder, f"y_{step:08d}.f64"), dtype=np.float64, mode="r")
        self.s = np.memmap(os.path.join(self.folder, f"s_{step:08d}.f32"), dtype=np.float32, mode="r")

    def __call__(self, step, op_index, name, op_class, slot, y, scale_fn):
        if step != self.step:
            self._load(step)
        e = self.index.get((op_index, slot))
        if e is None or e[1] != name:
            raise RuntimeError(f"calibration: op #{op_index} {name} is not in the reference at step {step}")
        off, n = e[4], e[5]
        ref = torch.from_numpy(np.array(self.y[off:off + n])).view(y.shape)
        s = torch.from_numpy(np.array(self.s[off:off + n]).astype(np.float64)).view(y.shape)
        y = y.detach().to("cpu", torch.float64)
        diff = (y - ref).abs()
        same_nan = torch.isnan(y) & torch.isnan(ref)
        diff = torch.where(same_nan | (y == ref), torch.zeros_like(diff), diff)
        differing = diff > 0
        ratio = torch.where(differing, diff / (UNIT_ROUNDOFF * s), torch.zeros_like(diff))
        violations = int((differing & (s == 0)).sum())
        finite = ratio[torch.isfinite(ratio) & differing]
        c = self.classes[op_class]
        o = self.ops[name]
        # elements this machine rounds to another grid point than the reference: the threshold each
        # would have needed, |y_ref - midpoint| / (u s) (the data of the paper's Algorithm 3)
        from .rounding import Grid

        self.grid = self.grid or Grid(int(os.environ.get("VERITRAIN_CALIBRATE_BITS", "32")))
        r_ref, r_var = self.grid.round(ref), self.grid.round(y)
        flip = (r_ref.view(torch.int32) != r_var.view(torch.int32)) & differing
        if bool(flip.any()):
            mid = (r_ref[flip].double() + r_var[flip].double()) / 2
            needed = ((ref[flip] - mid).abs() / (UNIT_ROUNDOFF * s[flip])).tolist()
            for d in (c, o):
                d["rounding_disagreements"] += len(needed)
                d["needed"] = sorted(d["needed"] + needed)[-1000:]
        nd = int(differing.sum())
        mx = float(finite.max()) if finite.numel() else 0.0
        for d in (c, o):
            d["elements"] += y.numel()
            d["differing"] += nd
            d["max_ratio"] = max(d["max_ratio"], mx)
        c["exact_violations"] += violations
        if finite.numel():
            bins = torch.floor(torch.log2(finite.clamp(min=2.0**-30))).to(torch.int64)
            vals, counts = torch.unique(bins, return_counts=True)
            for v, k in zip(vals.tolist(), counts.tolist()):
                c["log2_ratio_histogram"][int(v)] += int(k)

    def report(self) -> dict:
        classes = {}
        for k, v in self.classes.items():
            classes[k] = {**v, "log2_ratio_histogram": dict(sorted(v["log2_ratio_histogram"].items()))}
        return {"classes": classes, "ops": {k: dict(v) for k, v in sorted(self.ops.items())}}


def algorithm3(needed: list, lo: int = -40, hi: int = 40) -> float | None:
    """The paper's Algorithm 3: binary search over the threshold's exponent k for the smallest 2**k that
    still covers every observed rounding disagreement (each needs |y_ref - midpoint| < 2**k u s).
    Here the disagreements are the ones calibration observed; None when there were none."""
    if not needed:
        return None
    covers = lambda k: all(v < 2.0**k for v in needed)  # noqa: E731 - monotone in k
    if not covers(hi):
        return math.inf
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if covers(mid):
            hi = mid
        else:
            lo = mid
    return 2.0**hi


def recommend(reports: dict, defaults: dict, safety: float = SAFETY) -> dict:
    """Per class: the largest ratio any variant showed, and the threshold c = safety * that. Variants
    whose replay was rejected are left out: once a replay diverges (different data, a missed
    decision), its later differences say nothing about rounding."""
    reports = {v: r for v, r in reports.items() if r.get("accepted")}
    out = {}
    for cls, default in defaults.items():
        worst = max((r["classes"].get(cls, {}).get("max_ratio", 0.0) for r in reports.values()), default=0.0)
        violations = sum(r["classes"].get(cls, {}).get("exact_violations", 0) for r in reports.values())
        needed = [v for r in reports.values() for v in r["classes"].get(cls, {}).get("needed", [])]
        out[cls] = {"max_ratio": worst, "recommended": max(1.0, math.ceil(safety * worst)),
                    "default": default, "margin_of_default": (default / worst) if worst else math.inf,
                    "exact_violations": violations, "rounding_disagreements": len(needed),
                    "algorithm3": algorithm3(needed)}
    return out


def calibrate(task: str, config: dict, steps: int, variants: list, out_dir: str, seed: int = 0, bits: int = 32,
              progress: bool = True, device="cpu") -> dict:
    from .rules import DEFAULT_THRESHOLDS
    from .runner import TrainOptions, train

    run_dir, probe_dir = os.path.join(out_dir, "run"), os.path.join(out_dir, "probe")
    ref = ReferenceProbe(probe_dir)
    train(TrainOptions(task=task, out=run_dir, steps=steps, checkpoint_every=max(steps, 1), bits=bits, seed=seed,
                       config=config, progress=progress, device=str(device)), probe=ref)
    ref.close()
    reports = {}
    for v in variants:
        path = os.path.join(out_dir, f"variant-{v}.json")
        rc = subprocess.call([sys.executable, "-m", "veritrain.cli", "_compare", run_dir, probe_dir, "--out", path,
                              "--variant", v, "--device", str(device)],
                             env={**os.environ, "VERITRAIN_CALIBRATE_BITS": str(bits)})
        if rc not in (0, 1):
            raise RuntimeError(f"calibration replay under variant {v} failed (exit {rc})")
        with open(path) as f:
            reports[v] = json.load(f)
    result = {"task": task, "config": config, "steps": steps, "bits": bits, "variants": variants,
              "safety": SAFETY, "per_class": recommend(reports, DEFAULT_THRESHOLDS), "reports": reports}
    result["thresholds"] = {k: v["recommended"] for k, v in result["per_class"].items()}
    per_op = defaultdict(list)
    for r in reports.values():
        if r.get("accepted"):
            for op, d in r.get("ops", {}).items():
                per_op[op] += d.get("needed", [])
    result["algorithm3_per_op"] = {op: algorithm3(v) for op, v in sorted(per_op.items()) if v}
    with open(os.path.join(out_dir, "calibration.json"), "w") as f:
        json.dump(result, f, indent=1, sort_keys=True)
    return result
