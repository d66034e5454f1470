"""Command line: ``veritrain train | audit | demo | variants``.

Exit codes: 0 accepted / done, 1 rejected, 2 bad input or usage.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile

from . import hardware


def _variant_arg(p):
    p.add_argument("--variant", choices=sorted(hardware.VARIANTS),
                   help="run this command as if on other hardware (re-runs it in a child process)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="veritrain", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)

    t = sub.add_parser("train", help="train a task, writing checkpoints, rounding logs and a manifest")
    t.add_argument("task", help="built-in task (digits-cnn, gpt2-text) or module:function")
    t.add_argument("--out", required=True, help="new run directory")
    t.add_argument("--steps", type=int, default=20)
    t.add_argument("--checkpoint-every", type=int, default=10)
    t.add_argument("--bits", type=int, default=32, help="rounding amount b in 23..32 (32 = float32)")
    t.add_argument("--seed", type=int, default=0, help="run seed for in-step randomness (dropout, ...)")
    t.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="task config override")
    t.add_argument("--mode", default="verified", choices=["verified", "nolog", "fp64", "fp32"])
    t.add_argument("--thresholds", help="JSON file of per-class threshold constants")
    t.add_argument("--quiet", action="store_true")
    _variant_arg(t)

    a = sub.add_parser("audit", help="replay a run and compare every checkpoint hash")
    a.add_argument("run_dir")
    a.add_argument("--out", help="write the auditor's checkpoints and audit.json here")
    a.add_argument("--json", action="store_true", help="print the result as JSON")
    a.add_argument("--quiet", action="store_true")
    _variant_arg(a)

    d = sub.add_parser("demo", help="train the digits CNN, audit it on emulated other hardware, print the verdict")
    d.add_argument("--out", help="folder for the demo's runs (default: a new temporary folder)")
    d.add_argument("--steps", type=int, default=20)
    d.add_argument("--variant", default="combo", choices=sorted(hardware.VARIANTS),
                   help="the auditor's hardware variant")

    sub.add_parser("variants", help="list the emulated hardware variants")

    c = sub.add_parser("calibrate", help="measure float64 differences across hardware variants; write thresholds")
    c.add_argument("task")
    c.add_argument("--variants", default="isa-default,isa-avx2,onednn-sse41,mkl-compatible,threads-1,no-mkldnn,combo",
                   help="comma-separated hardware variants to compare against this machine")
    c.add_argument("--steps", type=int, default=3)
    c.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    c.add_argument("--seed", type=int, default=0)
    c.add_argument("--bits", type=int, default=32)
    c.add_argument("--out", required=True, help="new folder for the calibration run and its report")
    c.add_argument("--quiet", action="store_true")

    cmp_ = sub.add_parser("_compare")  # internal: one variant's replay for calibrate
    cmp_.add_argument("run_dir")
    cmp_.add_argument("probe_dir")
    cmp_.add_argument("--out", required=True)
    _variant_arg(cmp_)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    variant = getattr(args, "variant", None)
    if args.command in ("train", "audit", "_compare") and variant and os.environ.get(hardware.APPLIED) != variant:
        return hardware.run_in_variant(variant, argv)
    try:
        import torch  # noqa: F401

        hardware.apply_process_settings()
        return _dispatch(args)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except Exception as e:  # bad input of any kind: name it, exit 2
        from .checkpoint import CheckpointError
        from .engine import VeritrainError
        from .logformat import LogFormatError
        from .runner import RunError
        from .task import TaskError

        if isinstance(e, (RunError, TaskError, CheckpointError, LogFormatError, VeritrainError, ValueError,
                          FileNotFoundError, PermissionError)):
            print(f"veritrain: error: {e}", file=sys.stderr)
            return 2
        raise


def _dispatch(args) -> int:
    if args.command == "variants":
        for name, env in hardware.VARIANTS.items():
            print(f"{name:16s} {' '.join(f'{k}={v}' for k, v in env.items()) or '(this machine as it is)'}")
        return 0
    if args.command == "train":
        return _train(args)
    if args.command == "audit":
        return _audit(args)
    if args.command == "demo":
        return _demo(args)
    if args.command == "calibrate":
        return _calibrate(args)
    if args.command == "_compare":
        return _compare(args)
    return 2


def _calibrate(args) -> int:
    from .calibrate import calibrate
    from .runner import _check_new_run_dir
    from .task import parse_overrides

    variants = [v for v in args.variants.split(",") if v]
    for v in variants:
        if v not in hardware.VARIANTS:
            raise ValueError(f"unknown variant {v!r}; known: {', '.join(hardware.VARIANTS)}")
    _check_new_run_dir(args.out)
    r = calibrate(args.task, parse_overrides(args.set, {}), args.steps, variants, args.out, seed=args.seed,
                  bits=args.bits, progress=not args.quiet)
    print(f"{'class':14s} {'max ratio':>10s} {'default c':>10s} {'margin':>8s} {'recommended':>12s}")
    for cls, v in r["per_class"].items():
        margin = "inf" if math.isinf(v["margin_of_default"]) else f"{v['margin_of_default']:.0f}x"
        print(f"{cls:14s} {v['max_ratio']:10.3g} {v['default']:10g} {margin:>8s} {v['recommended']:12g}"
              + (f"  EXACT VIOLATIONS: {v['exact_violations']}" if v["exact_violations"] else ""))
    for v, rep in r["reports"].items():
        if not rep["accepted"]:
            print(f"variant {v}: replay rejected, left out of the figures above: " + "; ".join(rep["reasons"][:3]))
    print(f"report and thresholds: {os.path.join(args.out, 'calibration.json')}")
    return 0 if all(rep["accepted"] for rep in r["reports"].values()) else 1


def _compare(args) -> int:
    from .calibrate import CompareProbe
    from .runner import audit

    probe = CompareProbe(args.probe_dir)
    r = audit(args.run_dir, None, progress=False, probe=probe)
    out = {"variant": os.environ.get(hardware.APPLIED, "native"), "accepted": r.accepted, "reasons": r.reasons,
           "hardware": r.hardware, **probe.report()}
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1, sort_keys=True)
    return 0 if r.accepted else 1


def _train(args) -> int:
    from .runner import TrainOptions, train
    from .task import parse_overrides

    thresholds = None
    if args.thresholds:
        try:
            with open(args.thresholds) as f:
                thresholds = json.load(f)
        except (OSError, json.JSONDecodeError) as e:
            raise ValueError(f"--thresholds {args.thresholds}: {e}") from None
        thresholds = thresholds.get("thresholds", thresholds)
    m = train(TrainOptions(task=args.task, out=args.out, steps=args.steps, checkpoint_every=args.checkpoint_every,
                           bits=args.bits, seed=args.seed, config=parse_overrides(args.set, {}), mode=args.mode,
                           thresholds=thresholds, progress=not args.quiet))
    last = m["checkpoints"][-1]
    print(f"trained {m['task']} for {m['steps_completed']} steps (mode {m['mode']}, b={m['bits']}) -> {args.out}")
    print(f"final state hash (step {last['step']}): {last['state_sha256']}")
    if m.get("evaluation"):
        print("held-out: " + ", ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}"
                                       for k, v in m["evaluation"].items()))
    return 0


def _audit(args) -> int:
    from .runner import audit

    r = audit(args.run_dir, args.out, progress=not args.quiet)
    if args.json:
        print(json.dumps(r.as_dict(), indent=1, sort_keys=True))
    else:
        print(f"audit of {args.run_dir} on {r.hardware['variant']} ({r.hardware['cpu_capability']}, "
              f"{r.hardware['threads']} threads)")
        for c in r.checkpoints:
            print(f"  step {c['step']:6d}  {'match   ' if c['match'] else 'MISMATCH'}  {c['auditor'][:16]}")
        print(f"  steps replayed {r.steps}, log entries {r.entries}, corrections applied "
              f"{sum(r.corrections.values())} ({', '.join(f'{k} {v}' for k, v in r.corrections.items())}), "
              f"suspicious entries {r.suspicious}")
        print(f"verdict: {'ACCEPT' if r.accepted else 'REJECT'}")
        for reason in r.reasons:
            print(f"  - {reason}")
    return 0 if r.accepted else 1


def _demo(args) -> int:
    import subprocess

    base = args.out or tempfile.mkdtemp(prefix="veritrain-demo-")
    os.makedirs(base, exist_ok=True)
    py = [sys.executable, "-m", "veritrain.cli"]
    print(f"veritrain demo: digits CNN, {args.steps} steps; trainer on this machine as it is, auditor on "
          f"emulated hardware '{args.variant}' ({' '.join(f'{k}={v}' for k, v in hardware.VARIANTS[args.variant].items())})")
    verdicts = {}
    for mode in ("fp32", "verified"):
        run = os.path.join(base, f"run-{mode}")
        rc = subprocess.call(py + ["train", "digits-cnn", "--out", run, "--steps", str(args.steps),
                                   "--mode", mode, "--quiet", "--variant", "native"])
        if rc != 0:
            return rc
        rc = subprocess.call(py + ["audit", run, "--quiet", "--variant", args.variant])
        verdicts[mode] = rc
        print()
    print("summary:")
    print(f"  plain float32 : {'ACCEPT' if verdicts['fp32'] == 0 else 'REJECT'} "
          f"(the auditor's hardware rounds differently, so its weights differ)")
    print(f"  veritrain     : {'ACCEPT' if verdicts['verified'] == 0 else 'REJECT'} "
          f"(bit-identical weights at every checkpoint)")
    print(f"runs kept in {base}")
    return verdicts["verified"]


if __name__ == "__main__":
    sys.exit(main())
