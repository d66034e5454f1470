"""Command line: ``veritrain train | audit | eval | verify | inspect | serve | dispute | demo | calibrate |
experiment | report | variants``.

Exit codes: 0 accepted / done, 1 rejected, 2 bad input or usage.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shlex
import signal
import sys
import tempfile

from . import __version__, hardware


def _variant_arg(p):
    p.add_argument("--variant", choices=sorted(hardware.VARIANTS), metavar="NAME",
                   help="run this command as if on other hardware (re-runs it in a child process; "
                        "`veritrain variants` lists them)")


def _device_arg(p):
    p.add_argument("--device", default="cpu", metavar="cpu|cuda[:N]",
                   help="where the float64 evaluation runs (default cpu); the run's files do not depend on it, so a "
                        "run trained on a GPU can be audited on a CPU and the other way round")


def _policy_args(p):
    p.add_argument("--contract", help="the client's contract (veritrain contract writes one): the settings this "
                                      "auditor accepts; without it, the default policy (built-in tasks, default "
                                      "thresholds and slack as ceilings)")
    p.add_argument("--task", dest="policy_task", metavar="TASK",
                   help="accept a run of this task (module:function you name yourself; a run never names code "
                        "for the auditor to import)")


def _policy(args):
    from .policy import Policy

    return Policy.from_options(contract=getattr(args, "contract", None), task=getattr(args, "policy_task", None),
                               root=getattr(args, "root", None))


# the commands `veritrain --help` lists; the internal ones (_replay, _compare) are left out of it
PUBLIC_COMMANDS = ("train", "audit", "contract", "demo", "variants", "eval", "experiment", "report", "verify",
                   "inspect", "serve", "dispute", "calibrate")
MODES = ["verified", "nolog", "fp64", "fp32"]


def build_parser() -> argparse.ArgumentParser:
    # nothing heavy is imported here: `veritrain --help` must not wait for torch
    parser = argparse.ArgumentParser(
        prog="veritrain", description="Verifiable training across hardware: train a run, audit it bit for bit on "
                                      "other hardware, settle a dispute.",
        epilog="exit codes: 0 accepted / done, 1 rejected, 2 bad input or usage, 130 interrupted. "
               "`veritrain COMMAND --help` describes a command.")
    parser.add_argument("--version", action="version", version=f"veritrain {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="{" + ",".join(PUBLIC_COMMANDS) + "}")

    t = sub.add_parser("train", help="train a task, writing checkpoints, rounding logs and a manifest")
    t.add_argument("task", help="built-in task (digits-cnn, gpt2-text, resnet-cifar10, gpt2-shakespeare) or module:function")
    t.add_argument("--out", required=True, help="new run directory")
    t.add_argument("--steps", type=int, default=20, help="training steps (default 20)")
    t.add_argument("--checkpoint-every", type=int, default=10,
                   help="steps per checkpoint interval, the unit an audit replays (default 10)")
    t.add_argument("--bits", type=int, default=32, help="rounding amount b in 23..32 (32 = float32)")
    t.add_argument("--seed", type=int, default=0, help="run seed for in-step randomness (dropout, ...)")
    t.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="task config override (repeatable)")
    t.add_argument("--mode", default="verified", choices=MODES,
                   help="verified (default: float64 per op, rounded, logged), nolog, fp64 or fp32")
    t.add_argument("--thresholds", help="JSON file of per-class threshold constants")
    t.add_argument("--resume", action="store_true",
                   help="continue the killed run in --out from its last complete checkpoint")
    t.add_argument("--micro-batches", type=int, default=1, metavar="G",
                   help="data-parallel run: each step is G micro-batches (the task's batch(step*G) .. "
                        "batch(step*G+G-1)), whatever the number of processes (docs/DISTRIBUTED.md)")
    t.add_argument("--json", action="store_true", help="print the result as one JSON object")
    t.add_argument("--quiet", action="store_true", help="no progress bar or progress lines")
    _nproc_arg(t)
    _device_arg(t)
    _variant_arg(t)

    a = sub.add_parser("audit", help="replay a run's intervals and check each against the committed root",
                       usage="veritrain audit RUN_DIR [options] [-- COMMAND ...]",
                       epilog="A run of your own loop (veritrain.Run) is audited by running its script: give the "
                              "command after `--`, e.g. `veritrain audit runs/a -- python train.py`. It runs with "
                              "VERITRAIN_AUDIT set and replays the run with the script's own code and settings.")
    a.add_argument("run_dir", help="the trainer's run directory")
    a.add_argument("--out", help="save the audit here (audit.json, kept after each interval); an existing "
                                 "audit of the same run continues where it stopped")
    a.add_argument("--intervals", help="replay only these intervals (0-based), e.g. 3,5-7")
    a.add_argument("--sample", type=int, help="replay N intervals drawn at random (with --seed)")
    a.add_argument("--seed", type=int, default=None,
                   help="seed for --sample (default: fresh randomness, printed and saved, so the trainer cannot "
                        "know which intervals go unchecked)")
    a.add_argument("--root", help="the root the trainer gave you (default: the one in the run's manifest)")
    a.add_argument("--json", action="store_true", help="print the result as JSON")
    a.add_argument("--quiet", action="store_true", help="no progress bar or progress lines")
    _policy_args(a)
    _nproc_arg(a)
    _device_arg(a)
    _variant_arg(a)

    k = sub.add_parser("contract", help="write the client's contract: the settings an auditor will accept")
    k.add_argument("task", help="built-in task or module:function (its source is hashed into the contract)")
    k.add_argument("--out", required=True, help="new contract file (JSON)")
    k.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="task config override (repeatable)")
    k.add_argument("--steps", type=int, help="pin the number of training steps")
    k.add_argument("--checkpoint-every", type=int, help="pin the steps per checkpoint interval")
    k.add_argument("--seed", type=int, help="pin the run seed (default 0: the seed keys every draw of a run, its "
                                            "initial weights and dropout masks)")
    k.add_argument("--bits", type=int, help="pin the rounding amount")
    k.add_argument("--mode", choices=MODES, help="pin the training mode")
    k.add_argument("--thresholds", help="JSON file of per-class threshold ceilings (default: the built-in ones)")
    k.add_argument("--slack", type=float, help="the auditor's slack (default 2)")
    k.add_argument("--initial-state", help="pin the initial state's hash (fine-tuning from given weights)")
    k.add_argument("--root", help="the root the trainer committed to")
    k.add_argument("--micro-batches", type=int, help="pin the micro-batches per step of a data-parallel run "
                                                     "(default 1: one batch per step, no data-parallel run)")
    k.add_argument("--pin-data", action="store_true", help="pin the data: build the task here and write the hashes "
                                                          "of the data files it reads (data_sha256)")

    d = sub.add_parser("demo", help="train the digits CNN, audit it on emulated other hardware, print the verdict")
    d.add_argument("--out", help="folder for the demo's runs (default: a new temporary folder)")
    d.add_argument("--steps", type=int, default=20, help="training steps (default 20)")
    d.add_argument("--variant", default="combo", choices=sorted(hardware.VARIANTS), metavar="NAME",
                   help="the auditor's hardware variant (default combo; `veritrain variants` lists them)")

    sub.add_parser("variants", help="list the emulated hardware variants")

    e = sub.add_parser("eval", help="the task's held-out metric (accuracy / perplexity) for a run's checkpoint")
    e.add_argument("run_dir", help="the run directory")
    e.add_argument("--step", type=int, help="the committed state after this many steps (an interval's end, or 0; "
                                            "default: the last)")
    e.add_argument("--root", help="the root the trainer gave you (default: the one in the run's manifest)")
    e.add_argument("--json", action="store_true", help="print the result as JSON")
    _policy_args(e)
    _device_arg(e)

    x = sub.add_parser("experiment", help="run one of the paper's experiments (table CSV + Markdown, plot PNG)")
    from .experiments import add_arguments  # experiments/__init__ imports nothing heavy (tests/test_cli_ux.py)

    add_arguments(x)
    rp = sub.add_parser("report", help="assemble the experiments in DIR into DIR/report.md")
    rp.add_argument("dir", help="the folder given to `veritrain experiment --out`")

    rpl = sub.add_parser("_replay")  # internal (no help: hidden): continuous replay for the divergence experiment
    rpl.add_argument("run_dir")
    rpl.add_argument("--out", required=True)
    _device_arg(rpl)
    _variant_arg(rpl)

    v = sub.add_parser("verify", help="check every file of a run against its manifest and root (no replay)")
    v.add_argument("run_dir", help="the run directory")
    v.add_argument("--root", help="also require this root")
    v.add_argument("--json", action="store_true", help="print the result as JSON")
    _policy_args(v)

    i = sub.add_parser("inspect", help="summarise a run or an audit: steps, root, log sizes, entries")
    i.add_argument("run_dir", help="a run directory or an audit directory")
    i.add_argument("--json", action="store_true", help="print the stable JSON object of docs/FORMAT.md")

    sv = sub.add_parser("serve", help="answer the verification game's queries about a run over HTTP",
                        usage="veritrain serve RUN_DIR [options] [-- COMMAND ...]",
                        epilog="For a run of your own loop, give its script after `--`, e.g. `veritrain serve runs/a "
                               "-- python train.py`: the script replays the steps the game asks about.")
    sv.add_argument("run_dir", help="the run directory to answer for")
    sv.add_argument("--host", default="127.0.0.1", help="address to bind (default: loopback only)")
    sv.add_argument("--port", type=int, default=8337, help="port (0: any free port)")
    _device_arg(sv)

    g = sub.add_parser("dispute", help="play the verification game against a run (directory or http://HOST:PORT)",
                       usage="veritrain dispute PROVER AUDIT_DIR [options] [-- COMMAND ...]",
                       epilog="For a run of your own loop, give its script after `--`, as for `audit`: e.g. "
                              "`veritrain dispute runs/a audits/a -- python train.py`.")
    g.add_argument("prover", help="the trainer's run directory or http://HOST:PORT of `veritrain serve`")
    g.add_argument("audit_dir", help="an audit directory written by `veritrain audit --out`")
    g.add_argument("--root", help="the root the trainer gave you (default: the audited root)")
    g.add_argument("--timeout", type=float, default=300.0, help="seconds the prover may take for one whole answer "
                                                                 "(connecting, headers and body together)")
    g.add_argument("--json", action="store_true", help="print the verdict as JSON")
    _policy_args(g)
    _device_arg(g)
    _variant_arg(g)

    c = sub.add_parser("calibrate", help="measure float64 differences across hardware variants; write thresholds")
    c.add_argument("task", help="built-in task or module:function")
    c.add_argument("--variants", default=hardware.CALIBRATION_VARIANTS,
                   help="comma-separated hardware variants to compare against this machine")
    c.add_argument("--steps", type=int, default=3, help="training steps of the calibration run (default 3)")
    c.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="task config override (repeatable)")
    c.add_argument("--seed", type=int, default=0, help="run seed (default 0)")
    c.add_argument("--bits", type=int, default=32, help="rounding amount b in 23..32 (default 32)")
    c.add_argument("--out", required=True, help="new folder for the calibration run and its report")
    c.add_argument("--quiet", action="store_true", help="no progress bar or progress lines")
    _device_arg(c)

    cmp_ = sub.add_parser("_compare")  # internal (no help: hidden): one variant's replay for calibrate
    cmp_.add_argument("run_dir")
    cmp_.add_argument("probe_dir")
    cmp_.add_argument("--out", required=True)
    _device_arg(cmp_)
    _variant_arg(cmp_)
    return parser


def _nproc_arg(p):
    p.add_argument("--nproc", type=int, default=1, metavar="N",
                   help="run as N processes on this machine (gloo on CPUs, NCCL on GPUs); a data-parallel run only. "
                        "Under torchrun, leave it out: the processes torchrun starts join its process group")


def main(argv: list[str] | None = None) -> int:
    code = _main(argv)
    if "torch.distributed" in sys.modules and sys.modules["torch.distributed"].is_initialized():
        from . import parallel

        if parallel.launched():
            parallel.finish_rank(code)  # a rank of several: leave without the interpreter's shutdown
    return code


def _main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    # `veritrain audit RUN [options] -- python train.py ...`: the command after `--` replays an own loop
    own, command = (argv[:argv.index("--")], argv[argv.index("--") + 1:]) if "--" in argv else (argv, [])
    parser = build_parser()
    args = parser.parse_args(own)
    args.command_line = command
    if command and args.command not in ("audit", "dispute", "serve"):
        parser.error(f"only audit, dispute and serve take a command after `--` (got {args.command})")
    variant = getattr(args, "variant", None)
    if (args.command in ("train", "audit", "dispute", "_compare", "_replay") and variant
            and os.environ.get(hardware.APPLIED) != variant):
        return hardware.run_in_variant(variant, argv)
    try:
        import torch  # noqa: F401

        hardware.apply_process_settings()
        if getattr(args, "device", None) is not None:  # checked before anything is written
            args.device = str(hardware.parse_device(args.device))
        if args.command in ("train", "audit"):
            from . import parallel

            nproc = args.nproc
            if nproc < 1:
                raise ValueError(f"--nproc must be at least 1, got {nproc}")
            if nproc > 1 and parallel.launched():
                raise ValueError("--nproc starts its own processes; under torchrun, leave it out")
            if nproc > 1:
                if args.command == "train" and not args.resume:
                    parallel.assignment(args.micro_batches, nproc)  # ValueError before any process starts
                if command:
                    raise ValueError("--nproc does not apply to the run of an own loop (the command after `--`)")
                rest = [a for i, a in enumerate(own) if a != "--nproc" and not a.startswith("--nproc=")
                        and not (i > 0 and own[i - 1] == "--nproc")]
                rc = parallel.launch(rest, nproc)
                if rc != 0 and args.command == "train":
                    hint = _interrupted(args)
                    if "resume with" in hint:
                        print(f"veritrain: {hint.split('; ', 1)[1]} --nproc {nproc} (any number of processes "
                              f"up to the run's micro-batches per step)", file=sys.stderr)
                return rc
            if parallel.launched():
                args.device = parallel.init_from_env(args.device)
        return _dispatch(args)
    except KeyboardInterrupt:
        # a second Ctrl-C (or the --variant parent passing one on) must not turn this into a traceback
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        print(_interrupted(args), file=sys.stderr)
        return 130
    except Exception as e:  # bad input of any kind: name it, exit 2
        from .checkpoint import CheckpointError
        from .engine import VeritrainError
        from .logformat import LogFormatError
        from .store import RunError, RunRejected
        from .task import TaskError

        if isinstance(e, RunRejected) and args.command in ("audit", "verify", "eval", "dispute", "inspect"):
            # the run is altered, malformed or outside the auditor's policy: a rejection, exit 1
            if getattr(args, "json", False):
                print(json.dumps({"accepted": False, "refused": True, "reasons": [str(e)]}, indent=1, sort_keys=True))
            print(f"veritrain: REJECT: {shown(e)}", file=sys.stderr)
            return 1

        if isinstance(e, (RunError, TaskError, CheckpointError, LogFormatError, VeritrainError, ValueError, OSError,
                          FileNotFoundError, PermissionError)):
            print(f"veritrain: error: {shown(e)}", file=sys.stderr)
            return 2
        from . import parallel

        if parallel.launched() and isinstance(e, RuntimeError):  # a collective failed: another rank is gone
            print(f"veritrain: error: rank {os.environ.get('RANK')}: the process group broke off "
                  f"({str(e).splitlines()[0][:300]})", file=sys.stderr)
            return 2
        raise


def _interrupted(args) -> str:
    """The line for Ctrl-C: for a run with a manifest that is not complete, the command that resumes it."""
    if args.command != "train":
        return "interrupted"
    try:
        with open(os.path.join(args.out, "manifest.json")) as f:
            complete = json.load(f).get("complete")
    except (OSError, ValueError, AttributeError):  # stopped before the run existed: nothing to resume
        return "interrupted; nothing to resume (run the same command again)"
    if complete:
        return "interrupted"
    cmd = ["veritrain", "train", args.task, "--out", args.out, "--resume"]
    if args.device not in (None, "cpu"):
        cmd += ["--device", args.device]
    if args.variant:
        cmd += ["--variant", args.variant]
    return f"interrupted; resume with: {shlex.join(cmd)}"


def _config(task: str, pairs: list[str]) -> dict:
    """--set overrides, checked against the task's declared defaults before anything is written: a
    misspelt key must not train a run with the default silently in its place."""
    from .task import TaskError, default_config, parse_overrides

    overrides = parse_overrides(pairs, {})
    known = default_config(task)
    unknown = sorted(set(overrides) - set(known))
    if known and unknown:  # a task that declares no defaults takes any key
        raise TaskError(f"{task}: unknown config keys {unknown}; known: {', '.join(sorted(known))}")
    return overrides


def _dispatch(args) -> int:
    if args.command == "variants":
        for name, env in hardware.VARIANTS.items():
            note = {"reorder": "  (float64 as a GPU library computes it: split-K, tree sums, other FMAs and libm)",
                    "perturb": "  (every approximate result moved by up to 0.9 of its threshold)"}.get(name, "")
            print(f"{name:16s} {' '.join(f'{k}={v}' for k, v in env.items()) or '(this machine as it is)'}{note}")
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
    if args.command == "verify":
        return _verify(args)
    if args.command == "contract":
        return _contract(args)
    if args.command == "eval":
        from .runner import evaluate_run

        r = evaluate_run(args.run_dir, args.step, policy=_policy(args), device=args.device)
        print(json.dumps(r, indent=1, sort_keys=True) if args.json else
              f"{r['task']} after {r['step']} steps: " + ", ".join(
                  f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in r.items()
                  if k not in ("task", "step", "state_sha256")))
        return 0
    if args.command == "_replay":
        from .experiments.divergence import replay_distances

        with open(args.out, "w") as f:
            json.dump(replay_distances(args.run_dir, device=args.device), f)
        return 0
    if args.command == "experiment":
        from .experiments import run_experiment

        return run_experiment(args)
    if args.command == "report":
        from .experiments.report import write_report

        print(write_report(args.dir))
        return 0
    if args.command == "inspect":
        return _inspect(args)
    if args.command == "serve":
        return _serve(args)
    if args.command == "dispute":
        return _dispute(args)
    return 2


def _contract(args) -> int:
    from .policy import Policy, write_contract
    from .task import default_config, source_hash

    thresholds = _read_thresholds(args.thresholds) if args.thresholds else {}
    overrides = _config(args.task, args.set)
    defaults = default_config(args.task)
    data = None
    if args.pin_data:  # the client's copy of the data, read as the task reads it
        from .task import TaskError, build

        data = build(args.task, {**defaults, **overrides}).data_sha256
        if not data:
            raise TaskError(f"--pin-data: task {args.task} with this config reads no data files to pin")
    policy = Policy(task=args.task, task_source_sha256=source_hash(args.task), config={**defaults, **overrides},
                    seed=0 if args.seed is None else args.seed, steps=args.steps, checkpoint_every=args.checkpoint_every, bits=args.bits,
                    mode=args.mode, thresholds=thresholds, slack=args.slack if args.slack is not None else 2.0,
                    initial_state_sha256=args.initial_state, root=args.root,
                    micro_batches=1 if args.micro_batches is None else args.micro_batches, data_sha256=data,
                    source="veritrain contract")
    write_contract(args.out, policy)
    print(f"contract for task {args.task} (source sha256 {policy.task_source_sha256[:16]}…) -> {args.out}")
    return 0


def _read_thresholds(path):
    try:
        with open(path) as f:
            thresholds = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"--thresholds {path}: {e}") from None
    if not isinstance(thresholds, dict):
        raise ValueError(f"--thresholds {path}: expected a JSON object of class -> constant")
    return thresholds.get("thresholds", thresholds)


def _verify(args) -> int:
    from .api import verify

    r = verify(args.run_dir, root=args.root, task=getattr(args, "policy_task", None), contract=args.contract)
    if args.json:
        print(json.dumps(r.as_dict(), indent=1, sort_keys=True))
    else:
        print(f"{args.run_dir}: {r.steps} steps{'' if r.complete else ' (INCOMPLETE)'}, {r.intervals} "
              f"intervals, root {r.root}")
        for p in r.problems:
            print(f"  {shown(p['file'])}: {shown(p['problem'])}")
        if r.unverified:
            print(f"  not covered by the root (the trainer's unverified claims): {shown(', '.join(sorted(r.unverified)))}")
        print("consistent" if r.ok else f"NOT consistent: {len(r.problems)} problem(s)")
    return 0 if r.ok else 1


def _inspect(args) -> int:
    from .summary import inspect_dir

    r = inspect_dir(args.run_dir)
    if args.json:
        print(json.dumps(r, indent=1, sort_keys=True))
        return 0
    if r["kind"] == "audit":
        print(f"audit of {r['run']}: root {r['root']}")
        print(f"  intervals verified {r['intervals_verified']} ({r['intervals_matching']} matching), steps "
              f"{r['steps']}, corrections {r['corrections_total']} ({', '.join(f'{k} {v}' for k, v in r['corrections'].items())}), "
              f"suspicious entries {r['suspicious']}")
        return 0
    print(f"run {args.run_dir}: task {shown(r['task'])}, mode {shown(r['mode'])}, b={r['bits']}, {r['steps']} steps, "
          f"{r['intervals']} intervals, "
          f"{'complete' if r['complete'] else 'INCOMPLETE (%s of %s steps)' % (r['steps'], r['steps_planned'])}")
    print(f"  root {r['root']}")
    print(f"  final state {r['final_state_hash']}")
    if r["log_bytes_total"] is not None:
        n = max(r["steps"], 1)
        print(f"  log {r['log_bytes_total']} bytes ({r['log_bytes_total'] / n:.0f} per step) for "
              f"{r['rounded_values_total']} rounded values; entries: {r['entries']['direction']} direction, "
              f"{r['entries']['value']} value, {r['entries']['scalar']} scalar")
        print(f"  the paper's dense encoding (1.6 bits per rounded value): {r['dense_encoding_bytes_total']:.0f} bytes "
              f"({r['dense_encoding_bytes_total'] / max(r['log_bytes_total'], 1):.0f}x ours)")
    return 0


def _serve(args) -> int:
    from .protocol import LocalProver
    from .server import make_server

    if args.command_line:  # an own loop's run: its script answers
        from .loop import serve_script

        if args.device != "cpu":
            raise ValueError("serve: an own loop's script runs on its own devices (no --device)")
        return serve_script(args.run_dir, args.command_line, host=args.host, port=args.port)
    prover = LocalProver(args.run_dir, device=args.device)
    if str(prover.manifest().get("task")).startswith("loop:"):
        raise ValueError(f"{args.run_dir} is a run of an own loop: give its script after `--`, e.g. `veritrain serve "
                         f"{args.run_dir} -- python {prover.manifest()['task'][5:]} ...`")
    server = make_server(prover, args.host, args.port)
    host, port = server.server_address[:2]
    print(f"serving {args.run_dir} (root {prover.manifest().get('root')}) on http://{host}:{port}", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
    return 0


def shown(text) -> str:
    """``text`` as one printable line: a trainer's or prover's strings reach the terminal in reasons, rulings and
    problems, and a newline or an ANSI escape in them could forge or erase lines of the verdict. Control and
    other unprintable characters are shown escaped (``\\n``, ``\\x1b``); --json output is escaped by JSON itself."""
    s = str(text)
    return s if s.isprintable() else "".join(c if c.isprintable() else repr(c)[1:-1] for c in s)


def _dispute(args) -> int:
    from .api import dispute

    verdict = dispute(args.prover, args.audit_dir, root=args.root, task=getattr(args, "policy_task", None),
                      contract=args.contract, device=args.device, timeout=args.timeout,
                      command=args.command_line or None).as_dict()
    if args.json:
        verdict["hardware"] = hardware.describe()  # the challenger's machine (--variant), as audit reports it
        print(json.dumps(verdict, indent=1, sort_keys=True))
    else:
        print(f"verdict: {verdict['verdict']}")
        for k in ("interval", "step", "micro_batch", "operator", "module", "data_step", "ruling"):
            if verdict.get(k) is not None:
                print(f"  {k}: {shown(verdict[k])}")
        print(f"  queries {verdict['queries']}, referee recomputed {verdict['referee_ops']} op(s) from "
              f"{verdict['referee_bytes']} bytes" + (f"; replaying the interval ran {verdict['interval_replay_ops']} ops"
                                                     if verdict.get("interval_replay_ops") else ""))
        for r in verdict.get("reasons", []):
            print(f"  - {shown(r)}")
    return 0 if verdict["verdict"] == "no_dispute" else 1


def _calibrate(args) -> int:
    from .calibrate import calibrate
    from .runner import _check_new_run_dir

    variants = [v for v in args.variants.split(",") if v]
    for v in variants:
        if v not in hardware.VARIANTS:
            raise ValueError(f"unknown variant {v!r}; known: {', '.join(hardware.VARIANTS)}")
    config = _config(args.task, args.set)
    _check_new_run_dir(args.out)
    r = calibrate(args.task, config, args.steps, variants, args.out, seed=args.seed,
                  bits=args.bits, progress=not args.quiet, device=args.device)
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

    from .policy import Policy
    from .store import load_manifest

    probe = CompareProbe(args.probe_dir)
    # calibrate's own run, trained by this same command a moment ago: its task is the caller's choice
    policy = Policy(task=load_manifest(args.run_dir)["task"], source="calibrate's own run")
    r = audit(args.run_dir, None, progress=False, probe=probe, policy=policy, device=args.device)
    out = {"variant": os.environ.get(hardware.APPLIED, "native"), "accepted": r.accepted, "reasons": r.reasons,
           "hardware": r.hardware, **probe.report()}
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1, sort_keys=True)
    return 0 if r.accepted else 1


def _train(args) -> int:
    from .runner import TrainOptions, train
    from .task import BUILTIN_TASKS

    thresholds = _read_thresholds(args.thresholds) if args.thresholds else None
    config = _config(args.task, args.set)
    m = train(TrainOptions(task=args.task, out=args.out, steps=args.steps, checkpoint_every=args.checkpoint_every,
                           bits=args.bits, seed=args.seed, config=config, mode=args.mode,
                           thresholds=thresholds, progress=not args.quiet, resume=args.resume, device=args.device,
                           micro_batches=args.micro_batches))
    from .parallel import world

    if world()[0] != 0:  # rank 0 reports
        return 0
    last = m["checkpoints"][-1]
    # the default policy audits built-in tasks only: the auditor names a task of one's own itself
    audit_cmd = ["veritrain", "audit", args.out] + (["--task", m["task"]] if m["task"] not in BUILTIN_TASKS else [])
    if args.json:
        print(json.dumps({"run": os.path.abspath(args.out), "task": m["task"], "steps": m["steps_completed"],
                          "mode": m["mode"], "bits": m["bits"], "root": m["root"],
                          "final_state_hash": last["state_sha256"], "evaluation": m.get("evaluation"),
                          "next": shlex.join(audit_cmd)}, indent=1, sort_keys=True))
        return 0
    print(f"trained {m['task']} for {m['steps_completed']} steps (mode {m['mode']}, b={m['bits']})")
    print(f"run folder: {args.out}")
    print(f"final state hash (step {last['step']}): {last['state_sha256']}")
    print(f"root (the trainer's commitment to the run): {m['root']}")
    if m.get("evaluation"):
        print("held-out: " + ", ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}"
                                       for k, v in m["evaluation"].items()))
    print(f"next: {shlex.join(audit_cmd)}")
    return 0


def _audit(args) -> int:
    from .runner import audit

    if args.intervals and args.sample:
        raise ValueError("use either --intervals or --sample, not both")
    command = args.command_line
    if command:
        from .api import check_script_options
        from .loop import audit_script

        check_script_options(getattr(args, "policy_task", None), args.device)

        r = audit_script(args.run_dir, command, out=args.out, intervals=args.intervals, sample=args.sample,
                         sample_seed=args.seed, root=args.root, contract=args.contract, quiet=args.quiet)
    else:
        r = audit(args.run_dir, args.out, progress=not args.quiet, intervals=args.intervals, sample=args.sample,
                  sample_seed=args.seed, root=args.root, policy=_policy(args), device=args.device)
        from .parallel import world

        if world()[0] != 0:  # rank 0 reports
            return 0 if r.accepted else 1
    if args.json:
        print(json.dumps(r.as_dict(), indent=1, sort_keys=True))
    else:
        print(f"audit of {args.run_dir} on {r.hardware['variant']} ({r.hardware['cpu_capability']}, "
              f"{r.hardware['threads']} threads, device {r.hardware['device']})")
        for iv in r.intervals:
            a, b = iv["steps"]
            print(f"  interval {iv['interval']:4d} (steps {a}..{b - 1})  "
                  f"{'match   ' if iv['match'] else 'MISMATCH'}{'  (verified before)' if iv.get('resumed') else ''}")
        print(f"  steps replayed {r.steps}, log entries {r.entries}, corrections applied "
              f"{sum(r.corrections.values())} ({', '.join(f'{k} {v}' for k, v in r.corrections.items())}), "
              f"suspicious entries {r.suspicious}")
        if r.sample_seed is not None:
            print(f"  sampled intervals with seed {r.sample_seed} (repeat with --seed {r.sample_seed})")
        if r.unverified:
            print(f"  not covered by the root, the trainer's unverified claims: {shown(', '.join(sorted(r.unverified)))}")
        print(f"verdict: {'ACCEPT' if r.accepted else 'REJECT'}")
        for reason in r.reasons:
            print(f"  - {shown(reason)}")
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
