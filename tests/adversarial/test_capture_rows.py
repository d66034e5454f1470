"""A dishonest trainer against the auditor's row-local regions (capture._replay_rows), the auditor on another
CPU variant.

A compiled log-softmax region whose log holds entries in a few rows runs only those rows step by step under the
eager engine, on row-sliced inputs, and keeps its compiled values elsewhere; the entries move to the rows' part
and back (capture._to_rows). The attacker adds direction entries to the region's exp that round results the
wrong way where they lie between 1.2 and 1.9 thresholds from a midpoint (so only the error scale, computed on
the rows' part, tells them apart from an honest machine's view), in rows that held no honest entry. The auditor
replays in a child process under `isa-default`, with the row path checked to run there: the honest log gives
the trainer's bits with nothing suspicious, and every forged entry is named at its position in the whole output.
"""

import json
import os
import subprocess
import sys

import numpy as np
import torch

from veritrain import capture, rules
from veritrain.engine import EngineConfig, step_context
from veritrain.hardware import KNOBS, variant_env
from veritrain.logformat import OutputEntries, StepLogWriter, read_records, write_records
from veritrain.rounding import UNIT_ROUNDOFF, Grid

ROWS, WIDTH = 64, 256
C = 2.0**17  # thresholds at which a few rows of the region hold an honest entry
CONFIG = EngineConfig(thresholds={"accumulate": C, "elementwise": C})

CHILD = r"""
import json, sys, torch
from veritrain import capture
from veritrain.engine import EngineConfig, step_context
from veritrain.logformat import StepLogReader
x = torch.load(sys.argv[1])
config = EngineConfig(thresholds={"accumulate": float(sys.argv[2]), "elementwise": float(sys.argv[2])})
result = {}
for name in sys.argv[3:]:
    capture._CACHE.clear()
    with StepLogReader(name, expect_step=0, expect_bits=32) as reader:
        with step_context(config, 0, reader=reader) as mode:
            ys = [torch.log_softmax(t, -1) for t in x]  # the first call records the region, the second replays it
    region = [v for v in capture._CACHE.values() if isinstance(v, capture.Region)]
    result[name] = {"suspicious": [[s.op, s.op_index, s.position] for s in mode.stats.suspicious],
                    "regions": [[r.replays, r.row_replays, r.fallbacks, r.compiled] for r in region],
                    "bits": [y.view(torch.int32).reshape(-1).tolist() for y in ys]}
print(json.dumps(result))
"""


def inputs():
    """Two calls' inputs, each its own storage (a region's signature holds the storage offset)."""
    g = torch.Generator().manual_seed(5)
    return [torch.randn(ROWS, WIDTH, generator=g) * 3 for _ in range(2)]


def run(x, **io):
    with step_context(CONFIG, 0, **io) as mode:
        ys = [torch.log_softmax(t, -1) for t in x]
    return ys, mode


def window_of_second_exp(x, monkeypatch):
    """The flat positions of the second call's exp results between 1.2 and 1.9 thresholds from a midpoint, its
    float64 results and thresholds, from the eager engine's own analysis (the probe)."""
    monkeypatch.setenv("VERITRAIN_COMPILE", "0")
    seen = []

    def probe(step, index, func, op_class, i, y64, scale):
        if func == "aten.exp.default":
            seen.append((y64.clone(), C * UNIT_ROUNDOFF * rules.materialize_scale(scale(), y64)))

    with step_context(CONFIG, 0, probe=probe):
        [torch.log_softmax(t, -1) for t in x]
    y64, tau = seen[1]
    dist = Grid(32).midpoint_distance(y64)
    return ((dist > 1.2 * tau) & (dist < 1.9 * tau)).reshape(-1).nonzero().flatten(), y64, tau


def audit_in_child(tmp_path, x, *logs):
    torch.save(x, tmp_path / "x.pt")
    env = {k: v for k, v in os.environ.items() if k not in KNOBS and not k.startswith("VERITRAIN_")}
    env.update(variant_env("isa-default"), VERITRAIN_COMPILE="1")
    p = subprocess.run([sys.executable, "-c", CHILD, str(tmp_path / "x.pt"), repr(C), *map(str, logs)],
                       capture_output=True, text=True, env=env, timeout=600)
    assert p.returncode == 0, p.stderr
    return json.loads(p.stdout.strip().splitlines()[-1])


def test_forged_decisions_in_a_row_local_region_are_caught_by_an_auditor_on_another_variant(tmp_path, monkeypatch):
    x = inputs()
    window, y64, tau = window_of_second_exp(x, monkeypatch)

    monkeypatch.setenv("VERITRAIN_COMPILE", "1")
    capture._CACHE.clear()
    honest_log = tmp_path / "honest.vtlog"
    w = StepLogWriter(str(honest_log), 0, 32)
    trained, _ = run(x, writer=w)
    w.close()
    region = next(v for v in capture._CACHE.values() if isinstance(v, capture.Region))
    assert region.replays == 1 and region.fallbacks == 0, "the trainer's second call replayed its region"

    _, bits, records = read_records(str(honest_log))
    exps = [i for i, r in enumerate(records) if r.name == "aten.exp.default"]
    assert len(exps) == 2
    exp = records[exps[1]].outputs[0]
    honest_rows = {int(r) for o in (o for r in records[len(records) // 2:] for o in r.outputs)
                   for r in np.concatenate([o.dir_pos, o.val_pos]) // o.shape[-1]}
    assert 0 < len(honest_rows) <= 12, honest_rows
    # at most four forged rows, none with an honest entry: with the honest ones, at most a quarter of the rows
    targets, rows = [], set()
    for p in window.tolist():
        if p // WIDTH not in honest_rows and p // WIDTH not in rows and len(rows) < 4:
            targets.append(p)
            rows.add(p // WIDTH)
    assert len(targets) >= 3, "too few results in the window to forge"
    natural_away = Grid(32).classify(y64.reshape(-1)[targets], tau.reshape(-1)[targets])[2]
    pos = np.concatenate([exp.dir_pos, np.array(targets, np.int64)])
    away = np.concatenate([exp.dir_bits, (~natural_away).numpy()])
    order = np.argsort(pos)
    records[exps[1]].outputs[0] = OutputEntries(exp.shape, pos[order], away[order], exp.val_pos, exp.val_bits)
    forged_log = tmp_path / "forged.vtlog"
    write_records(str(forged_log), 0, bits, records)

    r = audit_in_child(tmp_path, x, honest_log, forged_log)
    honest, forged = r[str(honest_log)], r[str(forged_log)]
    for replay in (honest, forged):  # one region: recorded once, then replayed compiled, by its rows
        assert replay["regions"] == [[1, 1, 0, True]], replay["regions"]
    assert honest["suspicious"] == []
    assert honest["bits"] == [y.view(torch.int32).reshape(-1).tolist() for y in trained]
    named = sorted(p for op, _, p in forged["suspicious"] if op == "aten.exp.default")
    assert named == sorted(targets), forged["suspicious"]  # every forged entry, in the whole output's positions
    assert len(forged["suspicious"]) == len(targets), forged["suspicious"]  # and nothing else
