"""A dishonest trainer against the auditor's blocked matrix product (blocked.py), the auditor on another CPU
variant.

A product with a large float32 operand is computed block by block in float64, its error scale from norms
accumulated block by block; under another instruction set the float64 GEMM of each block sums in another
order. The trainer logs its product honestly; the attacker adds direction entries that round results the
wrong way where they lie between 1.2 and 1.9 thresholds from a midpoint (inside the auditor's slack window,
so only the scale tells them apart from an honest machine's view). The auditor replays in a child process
under `isa-default`, with the blocked path checked to run there: the honest log gives the trainer's bits with
nothing suspicious, and every forged entry, and nothing else, is caught.
"""

import json
import os
import subprocess
import sys

import pytest
import torch

from conftest import forge_wrong_directions
from veritrain import blocked, rules
from veritrain.engine import EngineConfig, step_context
from veritrain.hardware import KNOBS, variant_env
from veritrain.logformat import StepLogWriter
from veritrain.rounding import UNIT_ROUNDOFF, Grid

aten = torch.ops.aten

CHILD = r"""
import json, sys, torch
from veritrain import blocked
from veritrain.engine import EngineConfig, step_context
from veritrain.logformat import StepLogReader
a, b = torch.load(sys.argv[1])
config = EngineConfig(thresholds={"accumulate": float(sys.argv[2])})
blocked.BLOCK_NUMEL = blocked.RESULT_BLOCK_NUMEL = 1000
calls = []
real, real_in_blocks = blocked.mm, blocked.mm_in_blocks
blocked.mm = lambda *args, **kw: calls.append(["k", kw["norms"]]) or real(*args, **kw)
blocked.mm_in_blocks = lambda *args, **kw: calls.append([args[2], kw["norms"]]) or real_in_blocks(*args, **kw)
result = {}
for name in sys.argv[3:]:
    with StepLogReader(name, expect_step=0, expect_bits=32) as reader:
        with step_context(config, 0, reader=reader) as mode:
            y = torch.mm(a, b)
    result[name] = {"suspicious": mode.stats.suspicious_count,
                    "positions": sorted({s.position for s in mode.stats.suspicious}),
                    "bits": y.view(torch.int32).reshape(-1).tolist()}
result["splits"] = calls
print(json.dumps(result))
"""


def operands(case):
    """Positive operands (every result well away from 0, so tau is a steady share of its grid spacing):
    "k" a layer-input gradient's shape (K long), "m" a weight gradient's (a transposed view), "n" the logits'
    (h @ W^T, W^T a transposed view)."""
    g = torch.Generator().manual_seed(3)
    wide = torch.randn(*{"k": (48, 3001), "m": (256, 3001), "n": (3001, 56)}[case], generator=g).exp()
    other = torch.randn(*{"k": (3001, 40), "m": (256, 24), "n": (24, 56)}[case], generator=g).exp()
    return {"k": (wide, other), "m": (wide.t(), other), "n": (other, wide.t())}[case]


def audit_in_child(tmp_path, a, b, c, *logs):
    torch.save((a, b), tmp_path / "ab.pt")
    env = {k: v for k, v in os.environ.items() if k not in KNOBS and not k.startswith("VERITRAIN_")}
    env.update(variant_env("isa-default"), VERITRAIN_BLOCK_MIN_NUMEL="0")
    p = subprocess.run([sys.executable, "-c", CHILD, str(tmp_path / "ab.pt"), repr(c), *map(str, logs)],
                       capture_output=True, text=True, env=env, timeout=600)
    assert p.returncode == 0, p.stderr
    return json.loads(p.stdout.strip().splitlines()[-1])


# tau about 1/16 of half a spacing at 2**17 and 2**19, where the auditor's entries are many and it takes the norms
# in its blocks; at 2**14 they are few (a few hundred over 3001 rows) and it reads the scale at them from its own
# float32 operands. ``norms``: whether it takes them in its blocks replaying the honest log, and the forged one (in
# "n" at 2**17 the honest log's entries are few, the forged one's many)
@pytest.mark.parametrize("case,c,norms", [("k", 2.0**17, (True, True)), ("m", 2.0**19, (True, True)),
                                          ("m", 2.0**14, (False, False)), ("n", 2.0**17, (False, True)),
                                          ("n", 2.0**14, (False, False))])
def test_forged_decisions_in_a_blocked_product_are_caught_by_an_auditor_on_another_variant(tmp_path, monkeypatch,
                                                                                           case, c, norms):
    a, b = operands(case)
    monkeypatch.setenv("VERITRAIN_COMPILE", "auto")
    monkeypatch.setenv("VERITRAIN_BLOCK_MIN_NUMEL", "0")
    monkeypatch.setattr(blocked, "BLOCK_NUMEL", 1000)
    monkeypatch.setattr(blocked, "RESULT_BLOCK_NUMEL", 1000)
    config = EngineConfig(thresholds={"accumulate": c})
    w = StepLogWriter(str(tmp_path / "honest.vtlog"), 0, 32)
    with step_context(config, 0, writer=w):
        trained = torch.mm(a, b)
    w.close()

    a64, b64 = a.double(), b.double()
    y64 = a64 @ b64
    scale = rules.materialize_scale(rules._mm(rules.Call(aten.mm.default, (a64, b64), {}, [y64]))[0], y64)
    tau = (c * UNIT_ROUNDOFF * scale).reshape(-1)
    dist = Grid(32).midpoint_distance(y64).reshape(-1)
    targets = ((dist > 1.2 * tau) & (dist < 1.9 * tau)).nonzero().flatten()
    assert len(targets) >= 5
    forge_wrong_directions(tmp_path / "honest.vtlog", tmp_path / "forged.vtlog", targets, y64, tau)

    r = audit_in_child(tmp_path, a, b, c, tmp_path / "honest.vtlog", tmp_path / "forged.vtlog")
    assert r["splits"] == [[case, n] for n in norms], "both replays took the blocked path, with the norms where expected"
    honest, forged = r[str(tmp_path / "honest.vtlog")], r[str(tmp_path / "forged.vtlog")]
    assert honest["suspicious"] == 0 and honest["bits"] == trained.view(torch.int32).reshape(-1).tolist()
    assert forged["suspicious"] == len(targets)  # every forged entry, and nothing else
    assert set(forged["positions"]) <= set(targets.tolist())
