"""Installation: every module the package imports is a declared dependency, and `pip install .` gives a
working `veritrain` command outside the repository."""

import ast
import os
import re
import shutil
import subprocess
import sys

import pytest

from conftest import REPO

SRC = os.path.join(REPO, "src", "veritrain")
# import name -> distribution name, where they differ
DISTRIBUTIONS = {"sklearn": "scikit-learn", "yaml": "PyYAML", "PIL": "Pillow", "cv2": "opencv-python"}


def _toml(path):
    try:
        import tomllib
    except ImportError:  # Python 3.10
        tomllib = pytest.importorskip("tomli")
    with open(path, "rb") as f:
        return tomllib.load(f)


def _name(requirement: str) -> str:
    return re.match(r"[A-Za-z0-9._-]+", requirement.strip()).group(0).lower().replace("_", "-")


def _third_party_imports() -> dict[str, str]:
    """Top-level module -> first file importing it, for every import under src/veritrain (function-level
    imports included: a command imports matplotlib only when it plots)."""
    found = {}
    for folder, _, files in os.walk(SRC):
        for name in sorted(files):
            if not name.endswith(".py"):
                continue
            path = os.path.join(folder, name)
            with open(path) as f:
                tree = ast.parse(f.read(), path)
            for node in ast.walk(tree):
                if isinstance(node, ast.Import):
                    names = [a.name for a in node.names]
                elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                    names = [node.module]
                else:
                    continue
                for top in (n.split(".")[0] for n in names):
                    if top not in sys.stdlib_module_names and top != "veritrain":
                        found.setdefault(top, os.path.relpath(path, REPO))
    return found


def test_every_imported_module_is_a_declared_dependency():
    project = _toml(os.path.join(REPO, "pyproject.toml"))["project"]
    declared = {_name(r): r for r in project["dependencies"]}
    imports = _third_party_imports()
    assert {"torch", "numpy", "matplotlib"} <= set(imports), imports  # the scan finds what it must
    missing = {m: where for m, where in imports.items() if _name(DISTRIBUTIONS.get(m, m)) not in declared}
    assert not missing, f"imported but not in pyproject.toml [project].dependencies: {missing}"
    unpinned = [r for r in declared.values() if not re.search(r"[<>=~!]", r)]
    assert not unpinned, f"dependencies without a version range: {unpinned}"
    # our pinned set-up pins every one of them
    with open(os.path.join(REPO, "requirements.txt")) as f:
        pinned = {_name(x) for x in f if x.strip() and not x.startswith(("#", "-"))}
    assert set(declared) <= pinned, set(declared) - pinned


@pytest.mark.slow
def test_pip_install_gives_a_working_command_outside_the_repository(tmp_path):
    """A fresh venv over the system site-packages (the heavy wheels come from there: nothing is downloaded),
    veritrain installed into it from a copy of the repository (not editable, no index), then used from
    another folder with PYTHONPATH unset."""
    import importlib.util

    from pip import __version__ as pip_version

    if tuple(int(x) for x in pip_version.split(".")[:2]) < (22, 3):
        pytest.skip(f"pip {pip_version} has no --python")
    if importlib.util.find_spec("setuptools") is None:
        pytest.skip("setuptools (the build backend) is not installed: --no-build-isolation cannot build offline")
    src = tmp_path / "src-copy"
    shutil.copytree(os.path.join(REPO, "src"), src / "src",
                    ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(os.path.join(REPO, name), src / name)
    venv = tmp_path / "venv"
    # no pip inside: ensurepip's old setuptools would shadow the system's; the system pip installs into it
    subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", "--without-pip", str(venv)], check=True)
    python, script = venv / "bin" / "python", venv / "bin" / "veritrain"
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VERITRAIN_VARIANT_APPLIED")}
    env["PIP_NO_INDEX"] = "1"
    p = subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps",
                        "--no-build-isolation", "--no-index", "--disable-pip-version-check", "-q", str(src)],
                       capture_output=True, text=True, env=env, timeout=300)
    assert p.returncode == 0, p.stdout + p.stderr
    work = tmp_path / "elsewhere"
    work.mkdir()

    def run(*argv, timeout=300):
        p = subprocess.run(list(map(str, argv)), capture_output=True, text=True, env=env, cwd=work, timeout=timeout)
        assert p.returncode == 0, (argv, p.stdout, p.stderr)
        return p.stdout

    where = run(python, "-c", "import veritrain; print(veritrain.__file__)").strip()
    assert where.startswith(str(venv)), f"the venv imports veritrain from {where}, not its own installation"
    from veritrain.cli import PUBLIC_COMMANDS

    assert run(script, "--version").strip().startswith("veritrain ")
    for command in PUBLIC_COMMANDS:
        assert run(script, command, "--help").startswith(f"usage: veritrain {command}")
    run(script, "train", "digits-cnn", "--steps", "2", "--checkpoint-every", "1", "--out", "run", "--quiet")
    assert "verdict: ACCEPT" in run(script, "audit", "run", "--quiet")
