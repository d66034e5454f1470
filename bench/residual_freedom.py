"""Residual freedom of a dishonest trainer (issue 8, item 4): how far can a trainer steer training with log
entries that the auditor accepts?

The auditor (engine.AuditorHalf.replay) accepts

* a direction entry where its own float64 result y' lies within slack * tau' of a rounding midpoint, and
  one that *overrides* its own rounding only within tau' of it (what an honest trainer within tau can do);
* a value entry where the window w = slack * tau' is not small against the grid spacing
  (w >= spacing_at(max(|y'| - w, 0)) / 8), and one whose value differs from its own rounding only if it
  lies in [round(y' - tau'), round(y' + tau')],

never at NaN or infinite results (tau' = c * 2**-53 * scale, c the op class's threshold, slack = 2).
This script trains each workload honestly and with an adversarial trainer (a monkeypatched
TrainerHalf.record, as in tests/adversarial/test_entries.py) from the same seed, and takes, at every
approx output, every choice the rules leave open in the adversary's chosen direction, trains on the values
it logs, and compares the two runs. Then it audits the adversarial run under another emulated CPU
(`veritrain audit RUN --json --variant combo`, a subprocess): it must be ACCEPTED, since this is the
freedom the rules allow.

Margins. The adversary does not know the auditor's result y'; it assumes only what an honest trainer
assumes, |y - y'| <= d * tau with d = --hw-diff (1.0: the threshold's own promise; the measured differences
across the CPU variants are <= 1/7 of it, docs/ROUNDING.md), and that the auditor's tau' (its own float64
scale) is at least m * tau, with m = 1 - --margin (default 1e-3: float64 scales computed in another order
differ by ~1e-15 relative, so 0.1 % is ample and costs 0.1 % of the freedom). Then for every y' the
auditor can hold:

* direction entry: |y' - mid| <= |y - mid| + d tau, so the trainer flips positions with
  |y - mid| + d tau <= m * tau (with d = 1 none are left: only a cheater that trusts the auditor's
  hardware to be closer than tau keeps any);
* value entry: the auditor's "needed" test holds for every y' if
  slack * m * tau >= spacing_at(max(|y| + d tau - slack * m * tau, 0)) / 8, and v is inside
  [round(y' - m tau), round(y' + m tau)] for every y' in [y - d tau, y + d tau] if
  round(y + d tau - m tau) <= v <= round(y - d tau + m tau) (rounding is monotone).

(bench/freedom/freedom.md was measured with the rules before the override test was added, when overrides
were accepted within slack * tau and values within spacing / 2 + slack * tau of y'.)

Honest entries outside those sets (direction entries between (slack m - d) tau and tau from a midpoint)
are kept as an honest trainer writes them. Only training steps are manipulated (not the task's
initialisation log), so both runs start from the same committed state; near-midpoint Python scalars (scalar
entries, a handful per run) are left honest.

Strategies (--strategies): ``up`` (every choice towards +infinity), ``down``, ``random`` (a fair coin per
choice: undirected, the chaos baseline), and ``drift`` (the adversary pushes each parameter in the
direction it moved in the previous step: outputs that are a parameter's new value are pushed with that
sign, its momentum / first moment and its gradient against it, its second moment down; outputs it cannot
tie to a parameter go up; the tie is by tensor identity in the optimizer and by the autograd node's
AccumulateGrad inputs in the backward).

    python bench/residual_freedom.py --steps 100                 # both workloads, strategies up,drift
    python bench/residual_freedom.py --steps resnet=50,gpt2=10 --strategies up,drift,random \
        --audit-strategies up,drift --report-steps 1,5,10,25,50    # what bench/freedom/ holds (39 min, 2 cores)
    python bench/residual_freedom.py --steps 3 --workloads resnet --strategies up --no-audit   # smoke

Writes bench/freedom/freedom.md, freedom.csv (one row per workload, strategy and reported step),
freedom_steps.csv (every step, with the counts of the cheap tightenings), freedom_audit.csv, freedom_ops.csv
(choices per op), freedom_tensors.csv (per parameter tensor), freedom_timing.csv; with --results it appends a
section to bench/RESULTS.md. The runs go to --runs (default: a fresh folder under /tmp, removed at the end).
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import csv
import datetime
import json
import math
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
import types

import numpy as np
import torch
from torch.utils._python_dispatch import _disable_current_modes

from veritrain import engine as E
from veritrain.experiments.common import workloads
from veritrain.logformat import OutputEntries
from veritrain.rounding import UNIT_ROUNDOFF, Grid
from veritrain.runner import TrainOptions, train
from veritrain.task import Task

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
SHARED = os.path.join(ROOT, "..", "shared", "data")
SECTION = "## Residual freedom of a dishonest trainer (issue 8)"


# --- the grid's neighbours (float32 grid, b = 32) ---------------------------------------------------


def floor_grid(t: torch.Tensor) -> torch.Tensor:
    """The largest float32 value <= t (float64 in, float64 out)."""
    r = t.to(torch.float32)
    r = torch.where(r.double() > t, torch.nextafter(r, torch.full_like(r, -math.inf)), r)
    return r.double()


def next_up(v: torch.Tensor) -> torch.Tensor:
    v = v.float()
    return torch.nextafter(v, torch.full_like(v, math.inf)).double()


def next_down(v: torch.Tensor) -> torch.Tensor:
    v = v.float()
    return torch.nextafter(v, torch.full_like(v, -math.inf)).double()


# --- the adversary ---------------------------------------------------------------------------------


class Adversary:
    """Replaces TrainerHalf.record; keeps per-step counts of its choices."""

    def __init__(self, strategy: str, slack: float, hw_diff: float, margin: float, seed: int = 0):
        self.strategy, self.slack, self.d, self.m = strategy, slack, hw_diff, 1.0 - margin
        self.grid = Grid(32)
        self.seed = seed
        self.per_step = collections.defaultdict(collections.Counter)
        self.per_op = collections.defaultdict(collections.Counter)  # (phase, op, role) -> counts
        self.task: Task | None = None
        self.params: dict[int, tuple[str, torch.Tensor]] = {}
        self.states: dict[int, tuple[str, str]] = {}
        self.prev: dict[str, torch.Tensor] = {}
        self.drift: dict[str, torch.Tensor] = {}
        self.ctx: list = []  # (func, args, kwargs) of the ops being computed (nested by decompositions)

    # the parameter bookkeeping for ``drift``, refreshed before each step (outside the engine)
    def before_step(self, task: Task):
        self.task = task
        self.params = {}
        names = {}
        for n, p in task.model.named_parameters():
            self.params[p.untyped_storage().data_ptr()] = (n, p)
            names[id(p)] = n
        self.states = {}
        for p, st in task.optimizer.state.items():
            for k, t in st.items():
                if isinstance(t, torch.Tensor) and t.dim() and t.is_floating_point():
                    self.states[t.untyped_storage().data_ptr()] = (names.get(id(p), "?"), k)
        for n, p in task.model.named_parameters():
            cur = p.detach().clone()
            if n in self.prev:
                s = torch.sign(cur - self.prev[n])
                old = self.drift.get(n, torch.ones_like(cur))
                self.drift[n] = torch.where(s == 0, old, s)
            else:
                self.drift[n] = torch.ones_like(cur)
            self.prev[n] = cur

    # which way to push each candidate position (True = towards +infinity), and what it belongs to
    def want(self, mode, slot, idx: torch.Tensor):
        n = len(idx)
        if self.strategy == "up":
            return torch.ones(n, dtype=torch.bool), "any"
        if self.strategy == "down":
            return torch.zeros(n, dtype=torch.bool), "any"
        if self.strategy == "random":
            g = torch.Generator().manual_seed(hash((self.seed, mode.step, mode.op_index)) & 0x7FFFFFFF)
            return torch.rand(n, generator=g) < 0.5, "any"
        # drift
        sign, role = self._drift_sign(mode, slot)
        if sign is None:
            return torch.ones(n, dtype=torch.bool), "other"
        if isinstance(sign, (int, float)):
            return torch.full((n,), sign > 0, dtype=torch.bool), role
        return sign.reshape(-1)[idx] > 0, role

    def _drift_sign(self, mode, slot):
        shape = tuple(slot.shape)
        if self.ctx:
            func, args, kwargs = self.ctx[-1]
            target = None
            if func._overloadpacket.__name__.endswith("_") and args and isinstance(args[0], torch.Tensor):
                target = args[0]
            elif isinstance(kwargs.get("out"), torch.Tensor):
                target = kwargs["out"]
            if target is not None and tuple(target.shape) == shape:
                ptr = target.untyped_storage().data_ptr()
                if ptr in self.params:
                    name = self.params[ptr][0]
                    return self.drift[name], "param"
                if ptr in self.states:
                    name, key = self.states[ptr]
                    if key in ("momentum_buffer", "exp_avg"):
                        return -self.drift[name], "momentum"
                    if key in ("exp_avg_sq", "max_exp_avg_sq", "square_avg"):
                        return -1, "second-moment"
        if mode._phase() == "backward":
            node = torch._C._current_autograd_node()
            if node is not None:
                hits = []
                for fn, _ in node.next_functions:
                    if fn is not None and fn.name().endswith("AccumulateGrad"):
                        p = fn.variable
                        name = next((n for ptr, (n, q) in self.params.items() if q is p), None)
                        if name is None:
                            continue
                        if tuple(p.shape) == shape:
                            hits.append((name, False))
                        elif p.dim() == 2 and tuple(p.shape[::-1]) == shape:
                            hits.append((name, True))
                if len(hits) == 1:
                    name, transposed = hits[0]
                    d = self.drift[name]
                    return -(d.t() if transposed else d), "grad"
        return None, "other"

    # the adversarial record
    def record(self, mode, slot, c):
        grid = self.grid
        if mode.domain != "op" or mode.grid.bits != 32:
            return ORIG_RECORD(mode.trainer, slot, c)
        e = OutputEntries(slot.shape)
        n = math.prod(slot.shape)
        # every position the auditor could accept lies among the candidates of a 4x larger threshold
        # (2 tau >= spacing(|y| - 2 tau) / 8 implies 4 tau >= spacing(y) / 8); 8x for headroom
        cb = c * 4 * max(self.slack, self.d + 1)
        if isinstance(slot, E._FusedSlot):  # its kernel found candidates for c only: evaluate it all
            every = torch.arange(n)
            y_all, s_all = slot._eval(every)
            idx = grid.candidates(y_all, s_all, cb).reshape(-1).nonzero().squeeze(1)
            yc, sc = y_all[idx], s_all[idx]
        else:
            idx = slot.candidate_indices(cb)
            if not idx.numel():
                return e
            yc, sc = slot.values_at(idx), slot.scale_at(idx)
        if not idx.numel():
            return e
        tau = c * UNIT_ROUNDOFF * sc
        h_val, h_dir, h_away = grid.classify(yc, tau)  # what an honest trainer logs
        finite = torch.isfinite(yc) & (yc.abs() < 2.0**127) & torch.isfinite(tau)
        # margins (module docstring): the auditor's y' may be anywhere within d = hw_diff * tau of ours and
        # its tau' may be smaller by the factor m, so every test below holds for the worst such auditor
        w = self.slack * self.m * tau
        d = self.d * tau
        val_ok = finite & (w >= grid.spacing_at((yc.abs() + d - w).clamp(min=0.0)) / 8)
        dist = grid.midpoint_distance(yc)
        # a flip overrides the auditor's own rounding, which it accepts only within tau' of the midpoint
        # (engine.HONEST_TAU): for every admissible y' that needs dist + d <= m tau
        dir_ok = finite & ~val_ok & (dist + d <= torch.minimum(w, self.m * tau))
        want, role = self.want(mode, slot, idx)
        natural = grid.round(yc)
        # value entries: the grid value farthest in the wanted direction that every auditor accepts
        v = torch.where(want, self._farthest(yc, tau), -self._farthest(-yc, tau))
        good = torch.isfinite(v) & self._accepted(v, yc, tau)
        val_ok &= good
        # direction entries
        adv_away = torch.where(want, yc > 0, yc < 0)
        is_val = val_ok | h_val
        is_dir = ~is_val & (dir_ok | h_dir)
        away = torch.where(dir_ok, adv_away, h_away)
        final = natural.clone()
        vv = torch.where(val_ok, v, natural.double()).float()
        final[is_val] = vv[is_val]
        if bool(is_dir.any()):
            final[is_dir] = grid.apply_direction(yc[is_dir], away[is_dir])
        flat = slot.y32.view(-1)
        flat[idx] = final
        e.dir_pos = idx[is_dir].numpy().astype(np.int64)
        e.dir_bits = away[is_dir].numpy()
        e.val_pos = idx[is_val].numpy().astype(np.int64)
        e.val_bits = final[is_val].view(torch.int32).numpy().view(np.uint32)
        changed = final.view(torch.int32) != natural.view(torch.int32)
        # bookkeeping
        st = self.per_step[mode.step]
        k_dir, k_val = int(dir_ok.sum()), int(val_ok.sum())
        c_dir, c_val = int((changed & dir_ok).sum()), int((changed & val_ok).sum())
        st["dir_choices"] += k_dir
        st["val_choices"] += k_val
        st["dir_changed"] += c_dir
        st["val_changed"] += c_val
        ties = int((dir_ok & (dist == 0)).sum())
        st["dir_exact_ties"] += ties
        st["honest_dir"] += int(h_dir.sum())
        st["honest_val"] += int(h_val.sum())
        # what would be left under two cheap tightenings (counted only; the run uses the real rules):
        # value entries checked with slack 1 (an honest value entry needs no more: |round(y) - y'| <=
        # spacing / 2 + tau), and thresholds c four times smaller (direction choices scale with tau)
        w1 = self.m * tau
        v1_ok = finite & (w1 >= grid.spacing_at((yc.abs() + d - w1).clamp(min=0.0)) / 8)
        if bool(v1_ok.any()):
            v1 = torch.where(want, self._farthest(yc, tau, 1.0), -self._farthest(-yc, tau, 1.0))
            v1_ok &= torch.isfinite(v1) & self._accepted(v1, yc, tau, 1.0)
            st["val_choices_vslack1"] += int(v1_ok.sum())
            st["val_changed_vslack1"] += int((v1_ok & (v1.float().view(torch.int32) != natural.view(torch.int32))).sum())
        q = tau / 4
        st["dir_choices_quarter_c"] += int((finite & ~val_ok & (dist + self.d * q <= self.slack * self.m * q)).sum())
        if k_val:  # how far the adversary moved, in grid cells at y
            st["val_cells_moved"] += float(((v - yc).abs() / grid.spacing_at(yc))[val_ok].sum())
        if k_dir or k_val:
            func = self.ctx[-1][0] if self.ctx else "?"
            name = str(func).replace("aten.", "")
            po = self.per_op[(mode._phase(), name, role)]
            po["dir_choices"] += k_dir
            po["val_choices"] += k_val
            po["changed"] += c_dir + c_val
            po["dir_exact_ties"] += ties
        return e

    def _accepted(self, v, y, tau, slack=None):
        """v passes the auditor's check of a value that overrides its rounding (AuditorHalf.replay: v in
        [round(y' - tau'), round(y' + tau')]) for every auditor result y' in [y - d tau, y + d tau] and tau'
        down to m tau. (``slack`` is kept for the bookkeeping columns; the window no longer depends on it.)"""
        grid = self.grid
        d, w = self.d * tau, self.m * tau
        lo = grid.round(y + d - w).double()
        hi = grid.round(y - d + w).double()
        return (v >= lo) & (v <= hi)

    def _farthest(self, y, tau, slack=None):
        """The largest float32 value (as float64) that every admissible auditor accepts (NaN if none)."""
        grid = self.grid
        d, w = self.d * tau, self.m * tau
        v = grid.round((y - d + w).clamp(min=-3e38, max=3e38)).double()
        return torch.where(self._accepted(v, y, tau), v, torch.full_like(v, math.nan))


ORIG_RECORD = E.TrainerHalf.record


@contextlib.contextmanager
def patched(adv: Adversary | None, snap):
    """Install the adversary (or, with None, only counting of the honest run) and the per-step hook."""
    orig_compute, orig_random, orig_run_step = E.VerifiedMode._compute, E.VerifiedMode._random, Task.run_step
    saved = E.TrainerHalf.record

    def compute(self, func, rule, args, kwargs):
        if adv is None:
            return orig_compute(self, func, rule, args, kwargs)
        adv.ctx.append((func, args, kwargs))
        try:
            return orig_compute(self, func, rule, args, kwargs)
        finally:
            adv.ctx.pop()

    def random_op(self, func, args, kwargs):
        if adv is None:
            return orig_random(self, func, args, kwargs)
        adv.ctx.append((func, args, kwargs))
        try:
            return orig_random(self, func, args, kwargs)
        finally:
            adv.ctx.pop()

    def record(self, slot, c):  # self: the trainer's half of the engine
        if adv is not None:
            return adv.record(self.mode, slot, c)
        e = ORIG_RECORD(self, slot, c)
        if self.mode.domain == "op":
            st = snap.honest_counts[self.mode.step]
            st["honest_dir"] += len(e.dir_pos)
            st["honest_val"] += len(e.val_pos)
        return e

    def run_step(task, batch):
        with _disable_current_modes():
            if adv is not None:
                adv.before_step(task)
        loss = orig_run_step(task, batch)
        with _disable_current_modes():
            snap.after_step(task, loss)
        return loss

    E.VerifiedMode._compute, E.VerifiedMode._random, E.TrainerHalf.record = compute, random_op, record
    Task.run_step = run_step
    try:
        yield
    finally:
        E.VerifiedMode._compute, E.VerifiedMode._random, E.TrainerHalf.record = orig_compute, orig_random, saved
        Task.run_step = orig_run_step


class Snapshots:
    """Loss after every step; parameters, BatchNorm statistics and the held-out metric at report steps."""

    def __init__(self, report_steps):
        self.report = set(report_steps)
        self.step = 0
        self.loss = {}
        self.params = {}
        self.buffers = {}
        self.evals = {}
        self.honest_counts = collections.defaultdict(collections.Counter)

    def after_step(self, task, loss):
        self.step += 1
        self.loss[self.step] = float(loss)
        if self.step in self.report:
            self.params[self.step] = {n: p.detach().clone() for n, p in task.model.named_parameters()}
            self.buffers[self.step] = {n: b.detach().clone() for n, b in task.model.named_buffers()
                                       if b.is_floating_point()}
            self.evals[self.step] = task.evaluate(task.model) if task.evaluate is not None else {}


# --- comparison ------------------------------------------------------------------------------------


def compare(h: dict, a: dict) -> dict:
    out = {}
    num = den = 0.0
    best_abs = (0.0, "")
    best_rel = (0.0, "")
    best_t = (0.0, "")
    differ = total = zero_moved = 0
    for n, hp in h.items():
        ap = a[n]
        hd, ad = hp.double(), ap.double()
        diff = (ad - hd)
        num += float((diff * diff).sum())
        den += float((hd * hd).sum())
        differ += int((ap != hp).sum())
        total += hp.numel()
        m = float(diff.abs().max()) if diff.numel() else 0.0
        if m > best_abs[0]:
            best_abs = (m, n)
        nz = hd != 0
        if bool(nz.any()):
            r = float((diff[nz].abs() / hd[nz].abs()).max())
            if r > best_rel[0]:
                best_rel = (r, n)
        zero_moved += int(((hd == 0) & (ad != 0)).sum())
        tn = float(hd.norm())
        rt = float(diff.norm()) / tn if tn > 0 else (math.inf if float(diff.norm()) > 0 else 0.0)
        if rt > best_t[0]:
            best_t = (rt, n)
    out["rel_l2"] = math.sqrt(num / den) if den else 0.0
    out["max_abs"], out["max_abs_tensor"] = best_abs
    out["max_rel"], out["max_rel_tensor"] = best_rel
    out["max_tensor_rel_l2"], out["max_tensor_rel_l2_name"] = best_t
    out["elements_differ"] = differ
    out["elements"] = total
    out["zero_moved"] = zero_moved
    return out


def bn_stats(bufs: dict) -> dict:
    return {n: t for n, t in bufs.items() if n.endswith("running_mean") or n.endswith("running_var")}


def metric_of(ev: dict) -> tuple[str, float | None]:
    for k in ("accuracy", "perplexity", "loss"):
        if k in ev:
            return k, float(ev[k])
    return "", None


# --- running ---------------------------------------------------------------------------------------


def run_training(task, config, steps, out, adv, report_steps, seed):
    snap = Snapshots(report_steps)
    t0 = time.perf_counter()
    with patched(adv, snap):
        m = train(TrainOptions(task=task, out=out, steps=steps, checkpoint_every=steps, config=config, seed=seed,
                               progress=False))
    snap.seconds = time.perf_counter() - t0
    snap.manifest = m
    return snap


def audit(run_dir, variant):
    cmd = [sys.executable, "-m", "veritrain.cli", "audit", run_dir, "--json", "--quiet", "--variant", variant]
    t0 = time.perf_counter()
    p = subprocess.run(cmd, capture_output=True, text=True)
    dt = time.perf_counter() - t0
    if p.returncode not in (0, 1):
        raise RuntimeError(f"audit failed to run (exit {p.returncode}):\n{p.stderr[-3000:]}")
    r = json.loads(p.stdout)
    r["_seconds"] = dt
    r["_rc"] = p.returncode
    return r


def fmt(v, spec=".3g"):
    if v is None:
        return ""
    if isinstance(v, float):
        if math.isinf(v):
            return "inf"
        return format(v, spec)
    return str(v)


def parse_steps(spec: str, names: list[str]) -> dict:
    """--steps 100, or per workload: resnet=30,gpt2=10."""
    if "=" not in spec:
        return {w: int(spec) for w in names}
    out = {}
    for part in spec.split(","):
        w, _, n = part.partition("=")
        out[w.strip()] = int(n)
    missing = [w for w in names if w not in out]
    if missing:
        raise SystemExit(f"--steps {spec!r} gives no step count for {missing}")
    return out


def split_heads(name: str, t: torch.Tensor) -> dict:
    """GPT-2's fused q/k/v projection bias and weight, as their three parts (the key part of the bias has a
    mathematically zero gradient: softmax is invariant to adding a constant to a row of scores)."""
    if name.endswith("attn.c_attn.bias") or name.endswith("attn.c_attn.weight"):
        k = t.shape[-1] // 3
        return {f"{name}[{p}]": t[..., i * k:(i + 1) * k] for i, p in enumerate("qkv")}
    return {name: t}


def tensor_rows(wl, strat, step, h: dict, a: dict) -> list[dict]:
    out = []
    for n in h:
        for part, hp in split_heads(n, h[n]).items():
            ap = split_heads(n, a[n])[part]
            hd, ad = hp.double(), ap.double()
            diff = ad - hd
            nz = hd != 0
            hn = float(hd.norm())
            out.append({"workload": wl, "strategy": strat, "step": step, "tensor": part, "numel": hp.numel(),
                        "honest_rms": hn / math.sqrt(max(hp.numel(), 1)), "rel_l2": float(diff.norm()) / hn if hn else None,
                        "max_abs": float(diff.abs().max()) if diff.numel() else 0.0,
                        "max_rel": float((diff[nz].abs() / hd[nz].abs()).max()) if bool(nz.any()) else None,
                        "elements_changed": int((ap != hp).sum())})
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", default="100", help="steps per run: N, or per workload, e.g. resnet=30,gpt2=10")
    ap.add_argument("--workloads", default="resnet,gpt2")
    ap.add_argument("--strategies", default="up,drift", help="comma-separated: up, down, random, drift")
    ap.add_argument("--audit-strategies", help="audit only these strategies' runs (default: all)")
    ap.add_argument("--report-steps", default="1,10,100",
                    help="steps after which the runs are compared (the last step is always added)")
    ap.add_argument("--data", default="digits", help="resnet data (the experiments' default: digits)")
    ap.add_argument("--corpus", default=os.path.join(SHARED, "shakespeare.txt"))
    ap.add_argument("--tokenizer", default=os.path.join(SHARED, "gpt2-tokenizer"))
    ap.add_argument("--set", action="append", default=[], metavar="WORKLOAD.KEY=VALUE")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--slack", type=float, default=2.0, help="the auditor's slack (its policy's; default 2)")
    ap.add_argument("--hw-diff", type=float, default=1.0,
                    help="the adversary assumes |y - y'| <= HW_DIFF * tau for the auditor's result y'")
    ap.add_argument("--margin", type=float, default=1e-3, help="relative headroom on the auditor's tau'")
    ap.add_argument("--variant", default="combo", help="the auditor's emulated hardware")
    ap.add_argument("--no-audit", action="store_true")
    ap.add_argument("--runs", help="where the runs go (default: a new folder under the system temp dir)")
    ap.add_argument("--keep-runs", action="store_true", help="keep the run folders (default: removed at the end)")
    ap.add_argument("--out", default=os.path.join(HERE, "freedom"))
    ap.add_argument("--results", action="store_true", help="append the section to bench/RESULTS.md")
    args = ap.parse_args(argv)

    names = [w for w in args.workloads.split(",") if w]
    steps = parse_steps(args.steps, names)
    args.steps_by_workload = steps
    loads = {}
    for w in names:  # each workload at its own step count (GPT-2's schedule spans the run, as in the experiments)
        ns = types.SimpleNamespace(workloads=w, data=args.data, corpus=args.corpus, tokenizer=args.tokenizer,
                                   steps=steps[w], set=[x for x in args.set if x.startswith(w + ".")])
        loads.update(workloads(ns))
    strategies = [s for s in args.strategies.split(",") if s]
    for s in strategies:
        if s not in ("up", "down", "random", "drift"):
            raise SystemExit(f"unknown strategy {s!r}")
    audited = set(strategies if not args.audit_strategies else args.audit_strategies.split(","))
    runs = args.runs or tempfile.mkdtemp(prefix="residual_freedom_")
    os.makedirs(runs, exist_ok=True)
    os.makedirs(args.out, exist_ok=True)
    t_start = time.perf_counter()

    res = types.SimpleNamespace(rows=[], steps=[], audits=[], ops=[], tensors=[], timing=[])
    for wl, (task, config) in loads.items():
        n = steps[wl]
        report_steps = sorted({int(s) for s in args.report_steps.split(",") if s.strip() and int(s) <= n} | {n})
        print(f"[{wl}] honest run, {n} steps: {task} {config}", flush=True)
        honest = run_training(task, config, n, os.path.join(runs, f"{wl}-honest"), None, report_steps, args.seed)
        print(f"[{wl}] honest: {honest.seconds:.0f} s, evaluation {honest.manifest.get('evaluation')}", flush=True)
        res.timing.append({"workload": wl, "run": "honest", "steps": n,
                           "train_seconds": round(honest.manifest.get("train_seconds", 0), 1)})
        for strat in strategies:
            adv = Adversary(strat, args.slack, args.hw_diff, args.margin, seed=args.seed)
            out_dir = os.path.join(runs, f"{wl}-{strat}")
            print(f"[{wl}] adversarial run ({strat})", flush=True)
            snap = run_training(task, config, n, out_dir, adv, report_steps, args.seed)
            print(f"[{wl}] {strat}: {snap.seconds:.0f} s, evaluation {snap.manifest.get('evaluation')}", flush=True)
            timing = {"workload": wl, "run": strat, "steps": n,
                      "train_seconds": round(snap.manifest.get("train_seconds", 0), 1)}
            res.timing.append(timing)
            for s in range(1, n + 1):
                c = adv.per_step[s - 1]
                hc = honest.honest_counts[s - 1]
                res.steps.append({"workload": wl, "strategy": strat, "step": s,
                                  "dir_choices": c["dir_choices"], "val_choices": c["val_choices"],
                                  "dir_changed": c["dir_changed"], "val_changed": c["val_changed"],
                                  "dir_exact_ties": c["dir_exact_ties"],
                                  "val_cells_moved": round(c["val_cells_moved"], 3),
                                  "val_choices_vslack1": c["val_choices_vslack1"],
                                  "val_changed_vslack1": c["val_changed_vslack1"],
                                  "dir_choices_quarter_c": c["dir_choices_quarter_c"],
                                  "honest_dir_entries": hc["honest_dir"], "honest_val_entries": hc["honest_val"],
                                  "loss_honest": honest.loss.get(s), "loss_adversarial": snap.loss.get(s)})
            for k in report_steps:
                cp = compare(honest.params[k], snap.params[k])
                hb, ab = bn_stats(honest.buffers[k]), bn_stats(snap.buffers[k])
                bn = compare(hb, ab)["rel_l2"] if hb else None
                mname, mh = metric_of(honest.evals[k])
                _, ma = metric_of(snap.evals[k])
                sofar = [adv.per_step[s] for s in range(k)]
                row = {"workload": wl, "strategy": strat, "step": k,
                       "dir_choices_per_step": sum(c["dir_choices"] for c in sofar) / k,
                       "val_choices_per_step": sum(c["val_choices"] for c in sofar) / k,
                       "changed_per_step": sum(c["dir_changed"] + c["val_changed"] for c in sofar) / k,
                       "choices_at_step": adv.per_step[k - 1]["dir_choices"] + adv.per_step[k - 1]["val_choices"],
                       "honest_entries_per_step": sum(honest.honest_counts[s]["honest_dir"]
                                                      + honest.honest_counts[s]["honest_val"] for s in range(k)) / k,
                       **{f"param_{x}": v for x, v in cp.items()}, "bn_rel_l2": bn,
                       "loss_honest": honest.loss[k], "loss_adversarial": snap.loss[k],
                       "metric": mname, "metric_honest": mh, "metric_adversarial": ma,
                       "eval_loss_honest": honest.evals[k].get("loss"), "eval_loss_adversarial": snap.evals[k].get("loss")}
                res.rows.append(row)
                res.tensors += tensor_rows(wl, strat, k, honest.params[k], snap.params[k])
                print(f"[{wl}] {strat} step {k}: rel L2 {cp['rel_l2']:.3g}, max |dp| {cp['max_abs']:.3g} "
                      f"({cp['max_abs_tensor']}), max rel {cp['max_rel']:.3g} ({cp['max_rel_tensor']}), "
                      f"BN {fmt(bn)}, loss {honest.loss[k]:.5f} -> {snap.loss[k]:.5f}, "
                      f"{mname} {fmt(mh, '.5g')} -> {fmt(ma, '.5g')}", flush=True)
            for (phase, op, role), c in sorted(adv.per_op.items(), key=lambda kv: -(kv[1]["dir_choices"]
                                                                                      + kv[1]["val_choices"])):
                res.ops.append({"workload": wl, "strategy": strat, "phase": phase, "op": op, "role": role,
                                "dir_choices": c["dir_choices"], "val_choices": c["val_choices"],
                                "changed": c["changed"], "dir_exact_ties": c["dir_exact_ties"]})
            if not args.no_audit and strat in audited:
                print(f"[{wl}] auditing {strat} under {args.variant}", flush=True)
                r = audit(out_dir, args.variant)
                f = r.get("freedom", {})
                arow = {"workload": wl, "strategy": strat, "steps": n, "variant": args.variant,
                        "accepted": r["accepted"], "suspicious": r.get("suspicious"),
                        "direction_entries": f.get("direction_entries"), "value_entries": f.get("value_entries"),
                        "value_window_total": f.get("value_window_total"),
                        "value_window_cells": f.get("value_window_cells"),
                        "corrections": sum(r.get("corrections", {}).values()),
                        "corrections_by_phase": json.dumps(r.get("corrections", {}), sort_keys=True),
                        "audit_seconds": round(r["_seconds"], 1),
                        "reasons": "; ".join(r.get("reasons", []))[:300]}
                res.audits.append(arow)
                timing["audit_seconds"] = round(r["_seconds"], 1)
                print(f"[{wl}] audit {strat}: accepted={r['accepted']} suspicious={r.get('suspicious')} "
                      f"freedom={f} corrections={r.get('corrections')}", flush=True)
                if not r["accepted"]:
                    print(json.dumps(r.get("suspicious_details", [])[:5], indent=1), flush=True)
            if not args.keep_runs:
                shutil.rmtree(out_dir, ignore_errors=True)
            write_outputs(args, loads, res, time.perf_counter() - t_start)
        if not args.keep_runs:
            shutil.rmtree(os.path.join(runs, f"{wl}-honest"), ignore_errors=True)
    if not args.keep_runs and not args.runs:
        shutil.rmtree(runs, ignore_errors=True)
    md = write_outputs(args, loads, res, time.perf_counter() - t_start)
    print(md)
    if args.results:
        append_results(args, md, argv)
    bad = [a for a in res.audits if not a["accepted"]]
    return 1 if bad else 0


COLUMNS = ["workload", "strategy", "step", "dir_choices_per_step", "val_choices_per_step", "changed_per_step",
           "choices_at_step", "honest_entries_per_step", "param_rel_l2", "param_max_abs", "param_max_abs_tensor",
           "param_max_rel", "param_max_rel_tensor", "param_max_tensor_rel_l2", "param_max_tensor_rel_l2_name",
           "param_elements_differ", "param_elements", "bn_rel_l2", "loss_honest", "loss_adversarial", "metric",
           "metric_honest", "metric_adversarial", "eval_loss_honest", "eval_loss_adversarial"]


def _write_csv(path, rows):
    if not rows:
        return
    cols = list(dict.fromkeys(k for r in rows for k in r))
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=cols)
        w.writeheader()
        w.writerows(rows)


def machine() -> str:
    model = platform.processor() or "?"
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
        for line in out.splitlines():
            if line.startswith("Model name:"):
                model = line.split(":", 1)[1].strip()
    except OSError:
        pass
    return f"{model}, {os.cpu_count()} cores, torch {torch.__version__} ({torch.get_num_threads()} threads), " \
           f"Python {platform.python_version()}"


def markdown(args, loads, res, seconds) -> str:
    rows, audit_rows, op_rows = res.rows, res.audits, res.ops
    L = [f"Settings: steps {json.dumps(args.steps_by_workload)}, seed {args.seed}, auditor slack {args.slack}, the adversary assumes "
         f"|y - y'| <= {args.hw_diff} tau and tau' >= (1 - {args.margin}) tau; workloads: "
         + "; ".join(f"{w} = `{t}` {json.dumps(c, sort_keys=True)}" for w, (t, c) in loads.items()),
         "", f"Machine: {machine()}. Wall time of the script: {seconds / 60:.1f} min.", "",
         "Choices are positions where the adversary logged an entry of its own choosing (direction: within "
         "~(slack - 1) tau of a midpoint; value: wherever the auditor's window test passes); *changed* counts those "
         "whose value differs from the honest rounding. Parameter changes compare the adversarial run with the "
         "honest run from the same seed after the step; relative changes are per element (elements with an honest "
         "value of 0 left out) and per tensor (L2).", "",
         "| workload | strategy | step | dir. choices / step | value choices / step | changed / step | honest entries / step "
         "| rel. L2 (all params) | max abs change (tensor) | max rel change (tensor) | largest tensor rel. L2 (tensor) "
         "| elements changed | BN stats rel. L2 | train loss honest -> adv. | held-out metric honest -> adv. |",
         "|" + " --- |" * 15]
    for r in rows:
        L.append("| " + " | ".join([
            r["workload"], r["strategy"], str(r["step"]), f"{r['dir_choices_per_step']:.1f}",
            f"{r['val_choices_per_step']:.1f}", f"{r['changed_per_step']:.1f}", f"{r['honest_entries_per_step']:.1f}",
            fmt(r["param_rel_l2"]), f"{fmt(r['param_max_abs'])} (`{r['param_max_abs_tensor']}`)",
            f"{fmt(r['param_max_rel'])} (`{r['param_max_rel_tensor']}`)",
            f"{fmt(r['param_max_tensor_rel_l2'])} (`{r['param_max_tensor_rel_l2_name']}`)",
            f"{r['param_elements_differ']} / {r['param_elements']}",
            fmt(r["bn_rel_l2"]) if r["bn_rel_l2"] is not None else "n/a",
            f"{r['loss_honest']:.5f} -> {r['loss_adversarial']:.5f}",
            f"{r['metric']} {fmt(r['metric_honest'], '.5g')} -> {fmt(r['metric_adversarial'], '.5g')}"]) + " |")
    if audit_rows:
        L += ["", f"Audit of each adversarial run: `veritrain audit RUN --json --variant {args.variant}`.", "",
              "| workload | strategy | steps | verdict | suspicious | freedom: direction entries | value entries "
              "| value window total | value window cells | corrections (auditor) | audit time |",
              "|" + " --- |" * 11]
        for a in audit_rows:
            L.append("| " + " | ".join([a["workload"], a["strategy"], str(a["steps"]),
                                        "ACCEPTED" if a["accepted"] else "REJECTED: " + a["reasons"],
                                        str(a["suspicious"]), str(a["direction_entries"]), str(a["value_entries"]),
                                        fmt(a["value_window_total"]), fmt(a["value_window_cells"], ".4g"),
                                        f"{a['corrections']} {a['corrections_by_phase']}",
                                        f"{a['audit_seconds'] / 60:.1f} min"]) + " |")
    if op_rows:
        L += ["", "Where the choices were (whole run, top 8 per workload and strategy):", "",
              "| workload | strategy | phase | op | tied to | dir. choices | of which exact ties | value choices | changed |",
              "|" + " --- |" * 9]
        seen = collections.Counter()
        for o in op_rows:
            key = (o["workload"], o["strategy"])
            if seen[key] >= 8:
                continue
            seen[key] += 1
            L.append(f"| {o['workload']} | {o['strategy']} | {o['phase']} | `{o['op']}` | {o['role']} | "
                     f"{o['dir_choices']} | {o['dir_exact_ties']} | {o['val_choices']} | {o['changed']} |")
    if res.steps:
        L += ["", "Cheap tightenings, counted in the same adversarial runs (whole run; the runs themselves use the real "
              "rules): *exact ties* are direction choices whose float64 result sits exactly on a midpoint (typically an "
              "exactly computed result, e.g. x**2 or a mean of few values, that every correct machine rounds the same "
              "way); *value slack 1* checks value entries against |v - y'| <= spacing / 2 + tau' instead of "
              "+ 2 tau' (all an honest value entry needs); *c / 4* uses thresholds four times smaller (closer to the "
              "calibrated differences, docs/ROUNDING.md).", "",
              "| workload | strategy | steps | dir. choices | of which exact ties | dir. choices at c / 4 | value choices "
              "| value changed | value choices at value slack 1 | value changed at value slack 1 |",
              "|" + " --- |" * 10]
        keys = list(dict.fromkeys((r["workload"], r["strategy"]) for r in res.steps))
        for key in keys:
            rs = [r for r in res.steps if (r["workload"], r["strategy"]) == key]
            t = lambda f: sum(r.get(f, 0) or 0 for r in rs)  # noqa: E731
            L.append(f"| {key[0]} | {key[1]} | {len(rs)} | {t('dir_choices')} | {t('dir_exact_ties')} | "
                     f"{t('dir_choices_quarter_c')} | {t('val_choices')} | {t('val_changed')} | "
                     f"{t('val_choices_vslack1')} | {t('val_changed_vslack1')} |")
    if res.tensors:
        L += ["", "Most changed parameter tensors after the last step (relative L2 of the change; GPT-2's fused q/k/v "
              "projection split in its parts), top 6 per workload and strategy:", "",
              "| workload | strategy | step | tensor | elements | honest RMS | rel. L2 change | max abs change "
              "| elements changed |", "|" + " --- |" * 9]
        last = {}
        for t in res.tensors:
            last[(t["workload"], t["strategy"])] = max(last.get((t["workload"], t["strategy"]), 0), t["step"])
        for key in sorted(last, key=lambda k: list(last).index(k)):
            ts = [t for t in res.tensors if (t["workload"], t["strategy"]) == key and t["step"] == last[key]]
            ts.sort(key=lambda t: -(t["rel_l2"] if t["rel_l2"] is not None else math.inf))
            for t in ts[:6]:
                L.append(f"| {t['workload']} | {t['strategy']} | {t['step']} | `{t['tensor']}` | {t['numel']} | "
                         f"{fmt(t['honest_rms'])} | {fmt(t['rel_l2'])} | {fmt(t['max_abs'])} | "
                         f"{t['elements_changed']} |")
    if res.timing:
        L += ["", "Time (training loop of each run, and each audit): " + "; ".join(
            f"{t['workload']} {t['run']} {t['steps']} steps {t['train_seconds'] / 60:.1f} min"
            + (f" (audit {t['audit_seconds'] / 60:.1f} min)" if t.get("audit_seconds") else "")
            for t in res.timing) + "."]
    return "\n".join(L) + "\n"


def write_outputs(args, loads, res, seconds) -> str:
    _write_csv(os.path.join(args.out, "freedom.csv"), [{c: r.get(c) for c in COLUMNS} for r in res.rows])
    _write_csv(os.path.join(args.out, "freedom_steps.csv"), res.steps)
    _write_csv(os.path.join(args.out, "freedom_audit.csv"), res.audits)
    _write_csv(os.path.join(args.out, "freedom_ops.csv"), res.ops)
    _write_csv(os.path.join(args.out, "freedom_tensors.csv"), res.tensors)
    _write_csv(os.path.join(args.out, "freedom_timing.csv"), res.timing)
    md = markdown(args, loads, res, seconds)
    with open(os.path.join(args.out, "freedom.md"), "w") as f:
        f.write("# Residual freedom of a dishonest trainer (issue 8)\n\n"
                f"Command: `python bench/residual_freedom.py {' '.join(sys.argv[1:])}`\n\n" + md)
    return md


def compact(md: str) -> str:
    """The summary for bench/RESULTS.md: the settings, the main table, the audits and the tightenings (the
    per-op and per-tensor tables stay in bench/freedom/freedom.md)."""
    blocks, keep, skip = md.split("\n\n"), [], False
    for blk in blocks:
        if blk.startswith("Where the choices were") or blk.startswith("Most changed parameter tensors"):
            skip = True
            continue
        if skip and blk.startswith("|"):
            skip = False
            continue
        skip = False
        keep.append(blk)
    return "\n\n".join(keep)


def append_results(args, md, argv, path=os.path.join(HERE, "RESULTS.md")):
    date = datetime.date.today().isoformat()
    cmd = " ".join(sys.argv[1:] if argv is None else argv)
    text = (f"\n{SECTION}\n\nCommand: `python bench/residual_freedom.py {cmd}` ({date}). Full tables (choices per op, "
            f"most changed tensors) and CSVs: bench/freedom/ (freedom.md, freedom.csv, freedom_steps.csv, "
            f"freedom_audit.csv, freedom_ops.csv, freedom_tensors.csv, freedom_timing.csv).\n\n" + compact(md))
    with open(path, "a") as f:
        f.write(text)


if __name__ == "__main__":
    sys.exit(main())
