"""What the engine's per-output work costs a whole step, as a bound on trimming it: the trainer's near-midpoint
scan and exact classification of the results computed by eager float64 kernels (convolutions, matrix products,
unfused ops), and the auditor's checks of the log's entries, each taken out in its own run.

    python bench/per_output_bound.py                                  # resnet (default size), digits-cnn
    python bench/per_output_bound.py --workloads resnet --steps 8 --no-write

Runs, rotated per step in one process, each on its own copy of the task: plain float64 (the denominator), the
trainer, the trainer without the classification of its eager results' candidates (the scan still runs: its
log then has no entries there), the trainer without their scan either, the auditor of the trainer's log, and
that auditor without any entry check (``AuditorHalf.replay`` skipped: entries are neither checked nor
applied). The runs without are not verified steps and their weights drift apart from the trainer's; they time
what the step would cost if that work were free. The fused kernels (elementwise ops, sums, epilogues of large
eager results, captured regions) keep their scan in every run: it is inside their compiled code. Writes the
"Per-output work" section of bench/RESULTS.md unless --no-write.
"""

from __future__ import annotations

import os
import statistics
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import torch  # noqa: E402

from profile_engine import _step, workload_bench  # noqa: E402
from veritrain import engine  # noqa: E402
from veritrain.engine import EngineConfig  # noqa: E402
from veritrain.logformat import OutputEntries  # noqa: E402
from veritrain.rounding import Grid  # noqa: E402
from veritrain.runner import _prepare_batch, _prepare_model  # noqa: E402
from veritrain.task import build  # noqa: E402

RUNS = {  # name: (role, what is taken out)
    "trainer": ("trainer", None),
    "trainer, no classification": ("trainer", "classify"),
    "trainer, no scan or classification": ("trainer", "scan"),
    "auditor": ("auditor", None),
    "auditor, no entry checks": ("auditor", "checks"),
}
_EMPTY = torch.zeros(0, dtype=torch.int64)


def _without(what):
    """Patches taking ``what`` out of the engine; returns a function that puts it back."""
    record, replay, find = engine.TrainerHalf.record, engine.AuditorHalf.replay, engine._EagerSlot.candidate_indices
    if what == "classify":  # the scan runs, its candidates are dropped
        engine.TrainerHalf.record = lambda self, slot, c: (
            slot.candidate_indices(c) if isinstance(slot, engine._EagerSlot) else None,
            OutputEntries(slot.shape) if isinstance(slot, engine._EagerSlot) else record(self, slot, c))[1]
    elif what == "scan":
        engine._EagerSlot.candidate_indices = lambda self, c: _EMPTY
    elif what == "checks":
        engine.AuditorHalf.replay = lambda *args: None

    def restore():
        engine.TrainerHalf.record, engine.AuditorHalf.replay = record, replay
        engine._EagerSlot.candidate_indices = find

    return restore


def measure(task_ref: str, config: dict, steps: int, progress=print) -> dict:
    grid, cfg = Grid(32), EngineConfig()
    tasks = {}
    for run in ("fp64", *RUNS):
        t = build(task_ref, config)
        _prepare_model(t, "fp64" if run == "fp64" else "fp32", grid)
        tasks[run] = t
    names = ["fp64", *RUNS]
    times = {r: [] for r in names}
    with tempfile.TemporaryDirectory() as d:
        for step in range(steps + 1):
            k = step % len(names)
            order = names[k:] + names[:k]
            order = sorted(order, key=lambda r: r != "trainer")  # the auditors replay the trainer's log
            for run in order:
                role, what = ("fp64", None) if run == "fp64" else RUNS[run]
                batch = _prepare_batch(tasks[run].batch(step), "fp64" if run == "fp64" else "fp32", grid)
                path = os.path.join(d, f"{step}.vtlog" if run in ("trainer", "auditor", "auditor, no entry checks")
                                    else f"{step}-{what}.vtlog")
                restore = _without(what)
                try:
                    elapsed = _step(tasks[run], role, step, batch, path, cfg)
                finally:
                    restore()
                if step:
                    times[run].append(elapsed)
            if step:
                progress("  step %d: %s" % (step, ", ".join(f"{r} {times[r][-1] * 1e3:.0f} ms" for r in names)))
    fp64 = times["fp64"]
    return {"fp64_ms": statistics.median(fp64) * 1e3,
            "over_fp64": {r: statistics.median(t / f for t, f in zip(times[r], fp64)) for r in RUNS}}


def markdown(results: dict, descriptions: dict, command: str, machine: str) -> str:
    lines = ["## Per-output work", "", f"Command: `{command}`", "", f"Machine: {machine}", "",
             "Written by `bench/per_output_bound.py`: medians of same-step ratios to plain float64, each run on its "
             "own copy of the task, rotated per step in one process. The runs without are not verified steps: they "
             "time the step as if that work were free (the trainer's scan and classification of the results of "
             "eager float64 kernels; the auditor's checks of the log's entries). The compiled kernels keep their "
             "scan in every run.", "",
             "| workload | plain fp64 step | " + " | ".join(RUNS) + " |",
             "| --- | --- | " + " | ".join("---" for _ in RUNS) + " |"]
    for name, r in results.items():
        lines.append(f"| {name} | {r['fp64_ms']:.1f} ms | " + " | ".join(f"{r['over_fp64'][k]:.2f}x" for k in RUNS)
                     + " |")
    lines += ["", "Workloads: " + "; ".join(f"{k}: {v}" for k, v in descriptions.items()) + ".", ""]
    return "\n".join(lines)


if __name__ == "__main__":
    workload_bench("per_output_bound.py", __doc__.splitlines()[0], "resnet,digits", 8, measure, markdown)
