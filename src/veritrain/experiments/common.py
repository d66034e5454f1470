"""What every experiment shares: the two workloads at default (small) sizes, running veritrain commands as
separate processes under hardware variants, and writing a table (CSV + Markdown) and a plot (PNG)."""

from __future__ import annotations

import csv
import json
import os
import subprocess
import sys
import time

from ..task import TaskError

PAPER = "Srivastava, Arora, Boneh, Optimistic Verifiable Training by Controlling Hardware Nondeterminism (NeurIPS 2024)"


def workloads(args) -> dict:
    """name -> (task, config) at the sizes this 2-core machine finishes in minutes; --set NAME.KEY=VALUE scales."""
    out = {}
    names = [w for w in args.workloads.split(",") if w]
    for w in names:
        if w == "resnet":
            out[w] = ("resnet-cifar10", {"data": args.data, "arch": "resnet18", "width": 8, "batch_size": 16,
                                         "train_examples": 512, "eval_examples": 297})
        elif w == "gpt2":
            if not args.corpus or not args.tokenizer:
                raise TaskError("the gpt2 workload needs --corpus and --tokenizer (e.g. ../shared/data/shakespeare.txt "
                                "and ../shared/data/gpt2-tokenizer), or --workloads resnet")
            out[w] = ("gpt2-shakespeare", {"corpus": os.path.abspath(args.corpus),
                                           "tokenizer": os.path.abspath(args.tokenizer), "n_layer": 2, "n_embd": 128,
                                           "n_head": 4, "batch_size": 8, "seq_len": 64, "max_chars": 200000,
                                           "lr": 1e-3, "schedule_steps": max(args.steps, 1)})
        else:
            raise TaskError(f"unknown workload {w!r}; known: resnet, gpt2")
    for item in args.set:
        key, _, value = item.partition("=")
        w, _, k = key.partition(".")
        if w not in out or not k or not _:
            raise TaskError(f"--set {item!r}: expected WORKLOAD.KEY=VALUE with WORKLOAD in {sorted(out)}")
        out[w][1][k] = _parse(value)
    return out


def start(args, name: str, **settings) -> tuple[dict, "Output"]:
    """The workloads and the output folder of one experiment, with its settings written down."""
    loads = workloads(args)
    out = Output(args.out, name, {"steps": args.steps, **settings,
                                  "workloads": {k: v[0] for k, v in loads.items()}, "configs": loads})
    return loads, out


def bits_arg(args, default: list[int]) -> list[int]:
    """--bits 32,28,... (rounding amounts), or the experiment's default."""
    if not args.bits:
        return default
    try:
        return [int(b) for b in args.bits.split(",") if b.strip()]
    except ValueError:
        raise ValueError(f"--bits {args.bits!r}: expected comma-separated integers like 32,28,26") from None


def read_table(out_dir: str, name: str) -> list[dict]:
    with open(os.path.join(out_dir, name, f"{name}.csv")) as f:
        return list(csv.DictReader(f))


def _parse(v: str):
    for cast in (int, float):
        try:
            return cast(v)
        except ValueError:
            pass
    return {"true": True, "false": False}.get(v.lower(), v)


def sets(config: dict) -> list[str]:
    return [a for k, v in config.items() for a in ("--set", f"{k}={v}")]


def veritrain(*args, variant: str | None = None, device: str | None = None, ok=(0,), capture_json: bool = False,
              env=None):
    """Run a veritrain command in its own process (under a hardware variant, on a device); returns
    (rc, stdout, seconds)."""
    cmd = [sys.executable, "-m", "veritrain.cli", *map(str, args)]
    if variant:
        cmd += ["--variant", variant]
    if device:
        cmd += ["--device", str(device)]
    t0 = time.perf_counter()
    p = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, **(env or {})})
    dt = time.perf_counter() - t0
    if p.returncode not in ok:
        raise RuntimeError(f"`veritrain {' '.join(map(str, args))}` exited {p.returncode}:\n{p.stderr[-2000:]}")
    return p.returncode, (json.loads(p.stdout) if capture_json else p.stdout), dt


def train(out: str, task: str, config: dict, steps: int, every: int = 1, mode: str = "verified", bits: int = 32,
          seed: int = 0, variant: str | None = None, device: str | None = None) -> float:
    _, _, dt = veritrain("train", task, "--out", out, "--steps", steps, "--checkpoint-every", every, "--mode", mode,
                         "--bits", bits, "--seed", seed, "--quiet", *sets(config), variant=variant, device=device)
    return dt


class Output:
    """DIR/NAME/: NAME.csv, NAME.md, NAME.png and settings.json."""

    def __init__(self, root: str, name: str, settings: dict):
        self.dir = os.path.join(root, name)
        self.name = name
        if os.path.exists(self.dir) and os.listdir(self.dir):
            raise ValueError(f"{self.dir} already exists; choose another --out or move it away (nothing was "
                             f"overwritten)")
        os.makedirs(self.dir, exist_ok=True)
        self.settings = settings
        with open(os.path.join(self.dir, "settings.json"), "w") as f:
            json.dump(settings, f, indent=1, sort_keys=True, default=str)

    def run_path(self, name: str) -> str:
        """Where the experiment's own runs go (DIR/NAME/runs/: large, not part of the report)."""
        return os.path.join(self.dir, "runs", name)

    def path(self, suffix: str) -> str:
        return os.path.join(self.dir, f"{self.name}{suffix}")

    def table(self, rows: list[dict], columns: list[str]):
        with open(self.path(".csv"), "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=columns, extrasaction="ignore")
            w.writeheader()
            w.writerows(rows)

    def markdown(self, title: str, text: str, rows: list[dict], columns: list[str], fmt=None):
        fmt = fmt or {}
        lines = [f"## {title}", "", text.strip(), "",
                 "Settings: " + ", ".join(f"`{k}={v}`" for k, v in sorted(self.settings.items())
                                         if k not in ("configs",)), "",
                 "| " + " | ".join(columns) + " |", "|" + " --- |" * len(columns)]
        for r in rows:
            lines.append("| " + " | ".join(_cell(r.get(c), fmt.get(c)) for c in columns) + " |")
        lines += ["", f"![{self.name}]({self.name}.png)", ""]
        with open(self.path(".md"), "w") as f:
            f.write("\n".join(lines))

    def figure(self):
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        return plt

    def save_figure(self, plt):
        plt.tight_layout()
        plt.savefig(self.path(".png"), dpi=110)
        plt.close("all")


def _cell(v, fmt):
    if v is None:
        return ""
    if fmt and isinstance(v, (int, float)):
        return format(v, fmt)
    if isinstance(v, float):
        return f"{v:.4g}"
    return str(v)
