"""Whether the compiled paths give the eager engine's results and log on a device, op by op.

    python bench/compiled_conformance.py --device cuda     # on a lent GPU machine (bench/gpu_check.sh runs it)
    python bench/compiled_conformance.py --no-write        # here: every row should say yes

The library keeps its compiled paths (fused elementwise kernels, compiled sums, the round-and-scan epilogues;
captured composites; docs/SPEED.md) on CPUs: on an H200 a run trained with them on CUDA left the CPU's bits within two steps and
failed its CPU audit, and which kernel did it was never isolated (bench/RESULTS.md, "GPU trainer, CPU
auditor"). This script isolates it. Each op of ``OPS`` runs on the device under the trainer twice, with every
compiled path forced on for every op (on any device, and whatever the compiler check says: its answer is
reported apart) and with the eager engine (``VERITRAIN_COMPILE=0``), and the auditor replays the eager
trainer's log with the compiled paths on. A conforming device gives the same result bits and log bytes both
ways, and an auditor that agrees with no suspicious entry. The thresholds are wide (2^25 for every class), so
that about one value in ten gets a log entry: the log then tests that the compiled near-midpoint test finds
what the eager one finds, and the classification of what it finds. For each difference the table shows up to
three positions: the value the compiled run gave, the eager one, and the op's float64 value there (all in hex).

Writes the "Compiled paths, op by op" section of bench/RESULTS.md unless --no-write.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import tempfile
import warnings

import torch

from veritrain import blocked, capture, fused, hardware, rounding
from veritrain.engine import EngineConfig, step_context
from veritrain.logformat import StepLogReader, StepLogWriter

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from bench_engine import machine  # noqa: E402
from profile_engine import write_section  # noqa: E402

WIDE = EngineConfig(thresholds={k: 2.0**25 for k in EngineConfig().thresholds})
N = 1 << 17  # at least the compile threshold (65536), so that the default rule would compile these ops too


def _inputs(g, n):
    x = torch.randn(n, generator=g)
    y = torch.randn(n, generator=g)
    pos = torch.rand(n, generator=g) + 0.25
    return x, y, pos


# name -> the op, on inputs made by _inputs (float32, on the device); each returns a tensor or a list
OPS = {
    "exp": lambda x, y, p: torch.exp(x),
    "log": lambda x, y, p: torch.log(p),
    "sqrt": lambda x, y, p: torch.sqrt(p),
    "rsqrt": lambda x, y, p: torch.rsqrt(p),
    "tanh": lambda x, y, p: torch.tanh(x),
    "sigmoid": lambda x, y, p: torch.sigmoid(x),
    "gelu (tanh)": lambda x, y, p: torch.nn.functional.gelu(x, approximate="tanh"),
    "div": lambda x, y, p: x / p,
    "mul": lambda x, y, p: x * y,
    "add, alpha": lambda x, y, p: torch.add(x, y, alpha=0.3),
    "addcdiv": lambda x, y, p: torch.addcdiv(x, y, p, value=-1e-3),
    "lerp": lambda x, y, p: torch.lerp(x, y, 0.1),
    "pow": lambda x, y, p: p.pow(1.5),
    "sum over rows": lambda x, y, p: x.view(256, -1).sum(1),
    "mean over columns": lambda x, y, p: x.view(256, -1).mean(0),
    "mm": lambda x, y, p: x.view(256, -1)[:, :256] @ y.view(-1, 256)[:256],
    "foreach addcdiv_": lambda x, y, p: _foreach(x, y, p),
    # captured composites (capture.py), at the default thresholds: a region replays only where the trainer's
    # function finds no candidate, which wide thresholds would never allow. Each is called twice in the step:
    # the first call records the region, the second replays it
    "softmax (region)": (lambda x, y, p: _twice(lambda: torch.softmax(x.view(256, -1), -1)), "default"),
    "log-softmax (region)": (lambda x, y, p: _twice(lambda: torch.log_softmax(x.view(256, -1), -1)), "default"),
    "layer norm (region)": (lambda x, y, p: _twice(lambda: torch.nn.functional.layer_norm(x.view(256, -1), (512,))),
                            "default"),
    "batch norm (region)": (lambda x, y, p: _twice(lambda: torch.nn.functional.batch_norm(
        x.view(64, 8, 16, 16), None, None, training=True)), "default"),
}
CONFIGS = {"wide": WIDE, "default": EngineConfig()}


def _op(name):
    """(the op, the name of its engine configuration)."""
    entry = OPS[name]
    return entry if isinstance(entry, tuple) else (entry, "wide")


def _twice(call):
    call()
    return call()


def _replays() -> int:
    """Captured regions replayed so far in this process."""
    return sum(r.replays for r in list(capture._CACHE.values()) if isinstance(r, capture.Region))


def _foreach(x, y, p):
    params = [x[: N // 2].clone(), x[N // 2:].clone()]
    torch._foreach_addcdiv_(params, [y[: N // 2], y[N // 2:]], [p[: N // 2], p[N // 2:]], -1e-3)
    return params


@contextlib.contextmanager
def compiled_paths(on: bool):
    """The compiled paths forced on (``on``) or off for what runs inside. On: the modules' ``compiled_path``
    answers yes for every op on every device, whatever the compiler check (fused.compiled_code_rounds) said,
    which the table reports apart: a check that fails (the H200 machine's CPU under torch 2.11) would
    otherwise leave the eager engine on both sides and every row vacuously the same."""
    saved = os.environ.get("VERITRAIN_COMPILE")
    os.environ["VERITRAIN_COMPILE"] = "1" if on else "0"
    modules = (fused, blocked, rounding, capture)
    originals = [m.compiled_path for m in modules], capture.replays_on
    if on:
        for m in modules:
            m.compiled_path = _always
        capture.replays_on = _always
    try:
        yield
    finally:
        for m, f in zip(modules, originals[0]):
            m.compiled_path = f
        capture.replays_on = originals[1]
        if saved is None:
            del os.environ["VERITRAIN_COMPILE"]
        else:
            os.environ["VERITRAIN_COMPILE"] = saved


def _always(*args) -> bool:
    return True


def _flat(out) -> list:
    return [t.detach().to("cpu") for t in (out if isinstance(out, (list, tuple)) else [out])]


def run(op, config, device: torch.device, compiled: bool, log: str, reader: bool = False):
    """(results on the CPU, entries, suspicious entries, veritrain's warnings) of ``op`` on fresh inputs, as the
    trainer (writing ``log``) or the auditor (reading it)."""
    g = torch.Generator().manual_seed(0)
    inputs = [t.to(device) for t in _inputs(g, N)]
    with compiled_paths(compiled), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if reader:
            with StepLogReader(log, expect_step=0, expect_bits=32) as r, step_context(config, 0, reader=r) as mode:
                out = _flat(op(*inputs))
        else:
            w = StepLogWriter(log, 0, 32)
            with step_context(config, 0, writer=w) as mode:
                out = _flat(op(*inputs))
            w.close()
    s = mode.stats
    # a kernel that failed to compile or run warns and leaves that op to the eager engine: no comparison then
    fell_back = sorted({str(w.message).splitlines()[0][:160] for w in caught if "veritrain" in str(w.message)})
    return out, sum(s.entries_dir.values()) + sum(s.entries_val.values()), s.suspicious_count, fell_back


def _examples(op, got, want, device) -> str:
    """Up to three differing positions: compiled, eager and float64 values, in hex."""
    g = torch.Generator().manual_seed(0)
    exact = _flat(op(*[t.to(device, torch.float64) for t in _inputs(g, N)]))
    out = []
    for a, b, e in zip(got, want, exact):
        if a.shape != b.shape:
            return f"shapes {tuple(a.shape)} and {tuple(b.shape)}"
        for i in (a.view(torch.int32) != b.view(torch.int32)).flatten().nonzero().flatten()[: 3 - len(out)].tolist():
            out.append(f"{float(a.flatten()[i]).hex()} / {float(b.flatten()[i]).hex()} / {float(e.flatten()[i]).hex()}")
    return "; ".join(out)


def check(device: torch.device, names=None) -> list:
    rows = []
    with tempfile.TemporaryDirectory() as d:
        for name in OPS:
            if names and name not in names:
                continue
            op, config = _op(name)
            logs = {c: os.path.join(d, f"{name}-{c}.vtlog") for c in ("compiled", "eager")}
            try:
                replays = _replays()
                got, entries, _, warned = run(op, CONFIGS[config], device, True, logs["compiled"])
                want, eager_entries, _, _ = run(op, CONFIGS[config], device, False, logs["eager"])
                audited, _, suspicious, warned_audit = run(op, CONFIGS[config], device, True, logs["eager"],
                                                           reader=True)
                replays = _replays() - replays
            except Exception as exc:  # a kernel that does not compile or run there: say so, go on
                rows.append({"op": name, "error": f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"})
                continue
            differ = sum(int((a.view(torch.int32) != b.view(torch.int32)).sum()) if a.shape == b.shape else a.numel()
                         for a, b in zip(got, want))
            same_log = open(logs["compiled"], "rb").read() == open(logs["eager"], "rb").read()
            audit_ok = suspicious == 0 and all(torch.equal(a.view(torch.int32), b.view(torch.int32))
                                               for a, b in zip(audited, want))
            rows.append({"op": name, "config": config, "replays": replays,
                         "values": sum(t.numel() for t in want), "differ": differ, "same_log": same_log,
                         "entries": (entries, eager_entries), "audit_ok": audit_ok, "suspicious": suspicious,
                         "warnings": sorted(set(warned + warned_audit)),
                         "examples": _examples(op, got, want, device) if differ else ""})
    return rows


def conforms(rows) -> bool:
    return all("error" not in r and not r["differ"] and r["same_log"] and r["audit_ok"] and not r["warnings"]
               and (r["replays"] or "(region)" not in r["op"]) for r in rows)


def markdown(rows, command: str, device: torch.device) -> str:
    lines = ["## Compiled paths, op by op (issue 12)", "", f"Command: `{command}`", "", f"Machine: {machine(str(device))}", "",
             "Written by `bench/compiled_conformance.py`: each op on 2^17 float32 values (the mm 256 x 256 x 256) "
             "under the trainer with every compiled path forced on and with the eager engine, thresholds 2^25 "
             "(`wide`; captured regions at the `default` ones, each called twice so that the second call replays), and "
             "the eager trainer's log replayed by an auditor with the compiled paths on. `differ`: result values "
             "whose bits differ; `log`: the two logs byte for byte; entries: compiled / eager; examples: compiled / "
             "eager / float64 value; a warning from veritrain (a kernel that did not compile or run, its op left to the "
             "eager engine) counts as not conforming.", "",
             f"The compiler check (`fused.compiled_code_rounds('{device}')`): {fused.compiled_code_rounds(str(device))}.",
             "",
             "| op | thresholds | values | differ | same log | entries | audit of the eager log | regions replayed "
             "| examples |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['op']} | | | | | | | | failed: {r['error'].replace('|', '/')} |")
            continue
        audit = "accepted" if r["audit_ok"] else f"differs ({r['suspicious']} suspicious)"
        notes = [r["examples"]] * bool(r["examples"]) + [f"warned: {w}" for w in r["warnings"]]
        if "(region)" in r["op"] and not r["replays"]:
            notes.append("not exercised: no region replayed")
        lines.append(f"| {r['op']} | {r['config']} | {r['values']} | {r['differ']} | "
                     f"{'yes' if r['same_log'] else 'no'} | {r['entries'][0]} / {r['entries'][1]} | {audit} | "
                     f"{r['replays'] if '(region)' in r['op'] else ''} | {'; '.join(notes).replace('|', '/')} |")
    lines += ["", "Every op conforms." if conforms(rows) else "Some ops do not conform (rows above).", ""]
    return "\n".join(lines)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cpu", metavar="cpu|cuda[:N]")
    ap.add_argument("--ops", default="", help=f"comma-separated, of: {', '.join(OPS)} (default every op)")
    ap.add_argument("--out", default=os.path.join(HERE, "RESULTS.md"))
    ap.add_argument("--no-write", action="store_true")
    args = ap.parse_args(argv)
    try:
        device = hardware.parse_device(args.device)
    except hardware.DeviceError as e:
        ap.error(str(e))
    names = [n for n in args.ops.split(",") if n]
    unknown = [n for n in names if n not in OPS]
    if unknown:
        ap.error(f"unknown ops: {', '.join(unknown)}; known: {', '.join(OPS)}")
    rows = check(device, names)
    command = " ".join(["python bench/compiled_conformance.py", *(argv if argv is not None else sys.argv[1:])])
    text = markdown(rows, command, device)
    print(text)
    if not args.no_write:
        write_section(args.out, text)
    return 0 if conforms(rows) else 1


if __name__ == "__main__":
    sys.exit(main())
