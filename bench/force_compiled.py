"""The veritrain command line with every compiled path forced on, on any device.

    python bench/force_compiled.py train digits-cnn --device cuda --steps 10 --out runs/d
    python bench/force_compiled.py audit runs/d --device cuda

The library keeps its compiled paths (fused kernels and sums, captured regions, blocked products; docs/SPEED.md,
"The compiled path") to CPUs until they are shown to give the eager engine's bits elsewhere. This runs a
whole train or audit with them on for every op on every device, whatever the compiler check says (the same
switch as bench/compiled_conformance.py's compiled runs), so that bench/gpu_check.sh can train with them on
a GPU and audit on a CPU, and back: end to end, what the op-by-op table says op by op.
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from compiled_conformance import compiled_paths  # noqa: E402

from veritrain import cli  # noqa: E402

if __name__ == "__main__":
    with compiled_paths(True):
        code = cli.main(sys.argv[1:])
    sys.exit(code)
