"""``veritrain experiment NAME --out DIR``: the paper's results, reproduced side by side with ours.

Each experiment writes DIR/NAME/ (a CSV table, a Markdown table with its settings, a PNG plot) and
checks the properties that must hold; ``veritrain report DIR`` assembles them into DIR/report.md.
"""

from __future__ import annotations

import importlib

EXPERIMENTS = {
    "divergence": "divergence",
    "storage": "storage",
    "corrections": "corrections",
    "thresholds": "thresholds",
    "time": "timecost",
    "data-order": "data_order",
    "rounding": "bits_sweep",
}


DEFAULT_STEPS = {"divergence": 10, "storage": 4, "corrections": 8, "thresholds": 2, "time": 4, "data-order": 30,
                 "rounding": 60}


def module(name: str):
    if name not in EXPERIMENTS:
        raise ValueError(f"unknown experiment {name!r}; known: {', '.join(EXPERIMENTS)}")
    return importlib.import_module(f"{__name__}.{EXPERIMENTS[name]}")


def add_arguments(p):
    p.add_argument("name", help=", ".join(EXPERIMENTS) + ", or all")
    p.add_argument("--out", required=True, help="folder for the experiment's outputs (DIR/NAME/)")
    p.add_argument("--workloads", default="resnet,gpt2", help="resnet (resnet-cifar10), gpt2 (gpt2-shakespeare)")
    p.add_argument("--steps", type=int, help="training steps per run (default: each experiment's own, see DEFAULT_STEPS)")
    p.add_argument("--data", default="digits", help="CIFAR-10 archive or folder for the resnet workload, or digits")
    p.add_argument("--corpus", help="text file for the gpt2 workload (e.g. ../shared/data/shakespeare.txt)")
    p.add_argument("--tokenizer", help="GPT-2 tokenizer folder for the gpt2 workload (../shared/data/gpt2-tokenizer)")
    p.add_argument("--variant", default="reorder", help="the auditor's hardware variant (default: the emulated accelerator)")
    p.add_argument("--device", default="cpu", metavar="cpu|cuda[:N]",
                   help="where the experiment's trainers and auditors run (passed to each veritrain command)")
    p.add_argument("--variants", help="thresholds: variants to calibrate against")
    p.add_argument("--bits", help="comma-separated rounding amounts (storage, corrections, rounding)")
    p.add_argument("--set", action="append", default=[], metavar="WORKLOAD.KEY=VALUE",
                   help="scale a workload, e.g. gpt2.n_layer=12 (repeatable)")


def run_experiment(args) -> int:
    names = list(EXPERIMENTS) if args.name == "all" else [args.name]
    problems = []
    given = args.steps
    for name in names:
        mod = module(name)
        args.steps = given if given is not None else DEFAULT_STEPS[name]
        if args.steps <= 0:
            raise ValueError("--steps must be positive")
        out = mod.run(args)
        found = mod.check(args.out)
        problems += [f"{name}: {p}" for p in found]
        print(f"{name}: wrote {out.dir}" + ("" if not found else f" ({len(found)} check(s) failed)"))
    for p in problems:
        print(f"  - {p}")
    return 0 if not problems else 1
