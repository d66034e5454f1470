import json
import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHARED_DATA = os.path.normpath(os.path.join(REPO, "..", "shared", "data"))


def shared_file(*parts) -> str:
    path = os.path.join(SHARED_DATA, *parts)
    if not os.path.exists(path):
        pytest.fail(f"{path} is missing: the tests read the shared data beside the checkout (../shared/data)")
    return path


def cli(*args, env=None, check=None, timeout=900):
    """Run ``python -m veritrain.cli ARGS`` in a fresh process; returns CompletedProcess."""
    e = dict(os.environ)
    e.pop("VERITRAIN_VARIANT_APPLIED", None)
    e.update(env or {})
    p = subprocess.run([sys.executable, "-m", "veritrain.cli", *map(str, args)], capture_output=True, text=True,
                       env=e, timeout=timeout)
    if check is not None and p.returncode != check:
        raise AssertionError(f"veritrain {' '.join(map(str, args))} exited {p.returncode}, expected {check}\n"
                             f"stdout:\n{p.stdout}\nstderr:\n{p.stderr}")
    return p


def audit_json(run_dir, variant, *extra):
    p = cli("audit", run_dir, "--json", "--quiet", "--variant", variant, *extra)
    assert p.returncode in (0, 1), f"audit failed to run (exit {p.returncode}):\n{p.stderr}"
    return json.loads(p.stdout)


@pytest.fixture(scope="session")
def shakespeare():
    return shared_file("shakespeare.txt")
