"""docs/API.md describes every public name and every parameter of the Python API."""

import inspect
import os
import re

import veritrain
import veritrain.data
import veritrain.hf
from conftest import REPO

DOC = open(os.path.join(REPO, "docs", "API.md")).read()


def documented(name):
    return re.search(rf"`{re.escape(name)}`", DOC) is not None


def test_every_public_name_is_documented():
    missing = [n for n in veritrain.__all__ if n not in ("__version__", "Task") and f"veritrain.{n}" not in DOC
               and f"`{n}`" not in DOC]
    assert not missing, missing


def test_every_parameter_is_documented():
    api = [veritrain.train, veritrain.audit, veritrain.verify, veritrain.dispute, veritrain.inspect, veritrain.init,
           veritrain.Run, veritrain.data.StepLoader, veritrain.data.StepLoader.from_dataloader, veritrain.hf.task]
    missing = [(f.__name__, p) for f in api for p in inspect.signature(f).parameters if not documented(p)]
    # veritrain.hf.Trainer: its own keywords (the rest are transformers.Trainer's)
    missing += [("hf.Trainer", p) for p in inspect.signature(veritrain.hf.Trainer.__init__).parameters
                if p not in ("self", "args", "kwargs") and not documented(p)]
    assert not missing, missing


def test_every_result_field_is_documented():
    import dataclasses

    results = [veritrain.TrainResult, veritrain.AuditResult, veritrain.VerifyResult, veritrain.DisputeResult,
               veritrain.InspectResult]
    missing = [(r.__name__, f.name) for r in results for f in dataclasses.fields(r) if not documented(f.name)]
    assert not missing, missing
