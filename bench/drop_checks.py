"""Drop each check of a module in turn and see which test fails: the test suite as the spec of its refusals.

A "check" is a `raise` statement, and with --calls a statement calling one of the named functions (the auditor's
`suspicious`, which rejects a run by recording a finding rather than by raising). For each one, a copy of src/ has
that statement replaced by `pass`, and the tests that reach it run against the copy (stopping at the first
failure). A check whose tests all pass without it, or that no test reaches, is held by no test.

Two steps, because finding which tests reach which check takes one whole run of the suite:

    # 1. run the suite (or some test files) once with every raise of the modules recording the test that reached it
    python bench/drop_checks.py probe protocol store --hits /tmp/hits.tsv [-- tests/adversarial]
    # 2. drop each check and run the tests that reached it (or, with --tests, those tests for every check)
    python bench/drop_checks.py drop protocol store --hits /tmp/hits.tsv [--lines 104,106] [--tests NODEID ...]
    # the auditor's findings too: python bench/drop_checks.py probe engine --calls suspicious --hits F -- tests/adversarial

Prints one line per check: KILLED (with the first failing test), SURVIVED, UNREACHED or TIMEOUT. Nothing in the
checkout is changed: the copies live in a temporary folder.
"""

import argparse
import ast
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections import defaultdict

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGE = os.path.join(REPO, "src", "veritrain")
PROBE = "__import__('veritrain._drop_checks_probe', fromlist=['hit']).hit({tag!r})\n"
PROBE_MODULE = """import os
def hit(tag):  # the test that reached this check (subprocesses inherit PYTEST_CURRENT_TEST)
    test = os.environ.get("PYTEST_CURRENT_TEST", "?").rsplit(" ", 1)[0]
    with open(os.environ["DROP_CHECKS_HITS"], "a") as f:
        f.write(test + "\\t" + tag + "\\n")
"""


def check_lines(source: str, calls=()) -> dict[int, int]:
    """{first line: last line} of every raise statement, and of every statement that is a call of a function or
    method named in ``calls`` (a check that records its finding rather than raising: the auditor's
    ``suspicious``). Each must start its line (``if x: raise E`` cannot be dropped by lines)."""
    def called(n):
        f = n.value.func
        return (f.attr if isinstance(f, ast.Attribute) else getattr(f, "id", None)) in calls

    lines = source.splitlines()
    out = {}
    for n in ast.walk(ast.parse(source)):
        if isinstance(n, ast.Raise) or (isinstance(n, ast.Expr) and isinstance(n.value, ast.Call) and called(n)):
            line = lines[n.lineno - 1]
            if n.col_offset != len(line) - len(line.lstrip()):
                sys.exit(f"line {n.lineno}: a check that does not start its line; put it on a line of its own")
            out[n.lineno] = n.end_lineno
    return out


def copy_src(dest: str) -> str:
    shutil.copytree(os.path.join(REPO, "src"), os.path.join(dest, "src"))
    return os.path.join(dest, "src")


def probe(args):
    with tempfile.TemporaryDirectory() as tmp:
        src = copy_src(tmp)
        for mod in args.modules:
            path = os.path.join(src, "veritrain", f"{mod}.py")
            lines = open(path).read().splitlines(keepends=True)
            for first in sorted(check_lines("".join(lines), args.calls), reverse=True):
                indent = lines[first - 1][: len(lines[first - 1]) - len(lines[first - 1].lstrip())]
                lines.insert(first - 1, indent + PROBE.format(tag=f"{mod}:{first}"))
            open(path, "w").write("".join(lines))
        with open(os.path.join(src, "veritrain", "_drop_checks_probe.py"), "w") as f:
            f.write(PROBE_MODULE)
        open(args.hits, "w").close()
        env = {**os.environ, "PYTHONPATH": src, "DROP_CHECKS_HITS": os.path.abspath(args.hits)}
        rc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *args.pytest_args],
                            cwd=REPO, env=env).returncode
    print(f"pytest exited {rc}; {sum(1 for _ in open(args.hits))} hits in {args.hits}")


def drop(args):
    reached = defaultdict(set)
    if args.hits:
        for line in open(args.hits):
            test, tag = line.rstrip("\n").split("\t")
            if test != "?":
                reached[tag].add(test)
    only = {int(x) for x in args.lines.split(",")} if args.lines else None
    counts = defaultdict(int)
    with tempfile.TemporaryDirectory() as tmp:
        src = copy_src(tmp)
        for mod in args.modules:
            path = os.path.join(src, "veritrain", f"{mod}.py")
            original = open(path).read()
            for first, last in sorted(check_lines(original, args.calls).items()):
                if only is not None and first not in only:
                    continue
                tag = f"{mod}:{first}"
                tests = args.tests or sorted(reached.get(tag, ()))
                if not tests:
                    print(f"UNREACHED {tag}", flush=True)
                    counts["UNREACHED"] += 1
                    continue
                lines = original.splitlines(keepends=True)
                indent = lines[first - 1][: len(lines[first - 1]) - len(lines[first - 1].lstrip())]
                lines[first - 1: last] = [indent + "pass  # dropped\n"] + ["\n"] * (last - first)
                open(path, "w").write("".join(lines))
                t0 = time.monotonic()
                try:
                    p = subprocess.run([sys.executable, "-m", "pytest", "-x", "-q", "-n", "0", "-p", "no:cacheprovider",
                                        "-o", "addopts=", *tests], cwd=REPO, capture_output=True, text=True,
                                       timeout=args.timeout, env={**os.environ, "PYTHONPATH": src})
                    verdict = {0: "SURVIVED", 1: "KILLED"}.get(p.returncode, f"ERROR(pytest exit {p.returncode})")
                    failed = next((x for x in p.stdout.splitlines() if x.startswith("FAILED")), "")
                except subprocess.TimeoutExpired:
                    verdict, failed = "TIMEOUT", ""
                finally:
                    open(path, "w").write(original)
                counts[verdict] += 1
                print(f"{verdict} {tag} ({len(tests)} tests, {time.monotonic() - t0:.0f} s) {failed[:160]}", flush=True)
    print("; ".join(f"{k}: {v}" for k, v in sorted(counts.items())))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("step", choices=["probe", "drop"])
    ap.add_argument("modules", nargs="+", help="modules of src/veritrain, e.g. protocol store")
    ap.add_argument("--hits", help="the file of (test, check) pairs the probe writes and drop reads")
    ap.add_argument("--calls", default="", help="also count as checks the statements that call these functions or "
                    "methods, e.g. suspicious,suspicious_block (the auditor's findings that reject without raising)")
    ap.add_argument("--lines", help="drop: only the raise statements starting on these lines, e.g. 104,106")
    ap.add_argument("--tests", nargs="+", help="drop: run these tests for every check (instead of --hits)")
    ap.add_argument("--timeout", type=float, default=600, help="drop: seconds for one check's tests")
    argv = sys.argv[1:]
    split = argv.index("--") if "--" in argv else len(argv)  # after "--": the probe's pytest arguments
    args = ap.parse_args(argv[:split])
    args.pytest_args = argv[split + 1:]
    args.calls = tuple(filter(None, args.calls.split(",")))
    if args.step == "probe" and not args.hits:
        ap.error("probe needs --hits FILE")
    if args.step == "drop" and not (args.hits or args.tests):
        ap.error("drop needs --hits FILE (from probe) or --tests")
    for mod in args.modules:
        if not os.path.exists(os.path.join(PACKAGE, f"{mod}.py")):
            ap.error(f"no module src/veritrain/{mod}.py")
    (probe if args.step == "probe" else drop)(args)


if __name__ == "__main__":
    main()
