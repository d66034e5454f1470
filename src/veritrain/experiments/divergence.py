"""Fig. 4a/b of the paper: L2 distance between the trainer's and an auditor's weights, step by step, for
plain float32, float64 + rounding without a log, and veritrain (float64 + rounding + log).

The trainer runs on this machine; the auditor, in another process under a hardware variant, trains the
same task continuously from the initial checkpoint (with the trainer's logs in veritrain's mode) and
compares its weights with the trainer's checkpoint after every step."""

from __future__ import annotations

import json
import math
import os



from .common import read_table, start, Output, train, veritrain

MODES = [("fp32", "plain float32"), ("nolog", "float64 + rounding, no log"), ("verified", "veritrain")]


def replay_distances(run_dir: str, device="cpu") -> list[float]:
    """Continuous replay of a run on this machine (on ``device``); per step, the L2 distance of the model's
    parameters and buffers to the trainer's checkpoint after that step."""
    from .. import store
    from ..checkpoint import read_checkpoint
    from ..policy import trusted
    from ..protocol import Replayer

    m = store.load_manifest(run_dir)

    def read(name):
        with open(os.path.join(run_dir, name), "rb") as f:
            return f.read()

    rep = Replayer(trusted(m), lambda s: read(store.ckpt_name(s)), lambda s: read(store.log_name(s)), device=device)
    rep.load(0, m["initial_state_sha256"])
    out = []
    for step in range(m["steps"]):
        rep.run_step(step)
        tensors, _, _, _ = read_checkpoint(os.path.join(run_dir, store.ckpt_name(step + 1)))
        sq = 0.0
        for k, v in rep.task.model.state_dict().items():
            if v.is_floating_point():
                sq += float(((v.detach().cpu().double() - tensors[f"model/{k}"].double()) ** 2).sum())
        out.append(math.sqrt(sq))
    return out


def run(args) -> Output:
    loads, out = start(args, "divergence", auditor_variant=args.variant)
    rows = []
    for w, (task, config) in loads.items():
        for mode, label in MODES:
            run_dir = out.run_path(f"{w}-{mode}")
            train(run_dir, task, config, args.steps, every=1, mode=mode, device=args.device)
            result = out.run_path(f"{w}-{mode}-auditor.json")
            veritrain("_replay", run_dir, "--out", result, variant=args.variant, device=args.device)
            with open(result) as f:
                dist = json.load(f)
            for step, d in enumerate(dist, start=1):
                rows.append({"workload": w, "mode": mode, "step": step, "l2_distance": d})
    cols = ["workload", "mode", "step", "l2_distance"]
    out.table(rows, cols)
    plt = out.figure()
    fig, axes = plt.subplots(1, len(loads), figsize=(5 * len(loads), 3.6), squeeze=False)
    for ax, w in zip(axes[0], loads):
        for mode, label in MODES:
            pts = [(r["step"], r["l2_distance"]) for r in rows if r["workload"] == w and r["mode"] == mode]
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", ms=3, label=label)
        ax.set_yscale("symlog", linthresh=1e-9)
        ax.set_title(f"{w}: trainer vs auditor ({args.variant})")
        ax.set_xlabel("step")
        ax.set_ylabel("L2 distance of weights")
        ax.legend(fontsize=8)
    out.save_figure(plt)
    summary = []
    for w in loads:
        for mode, label in MODES:
            d = [r["l2_distance"] for r in rows if r["workload"] == w and r["mode"] == mode]
            summary.append({"workload": w, "mode": label, "final_l2": d[-1] if d else None,
                            "max_l2": max(d) if d else None,
                            "steps_with_zero_distance": sum(1 for x in d if x == 0.0), "steps": len(d)})
    out.markdown("Divergence between trainer and auditor (paper Fig. 4a/b)",
                 f"Trainer on this machine, auditor under hardware variant `{args.variant}` in a separate process, "
                 f"training continuously from the same initial checkpoint. veritrain must stay at exactly 0.",
                 summary, ["workload", "mode", "final_l2", "max_l2", "steps_with_zero_distance", "steps"])
    return out


def check(out_dir: str) -> list[str]:
    """Properties that must hold: veritrain's distance is exactly 0 everywhere; plain float32's is not."""
    rows = read_table(out_dir, "divergence")
    problems = []
    for w in {r["workload"] for r in rows}:
        v = [float(r["l2_distance"]) for r in rows if r["workload"] == w and r["mode"] == "verified"]
        f32 = [float(r["l2_distance"]) for r in rows if r["workload"] == w and r["mode"] == "fp32"]
        if any(x != 0.0 for x in v):
            problems.append(f"{w}: veritrain's distance is not 0: {v}")
        if not any(x > 0 for x in f32):
            problems.append(f"{w}: plain float32 did not diverge under this variant")
    return problems


