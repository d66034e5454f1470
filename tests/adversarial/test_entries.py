"""A dishonest trainer that hides its choices in log entries the auditor tolerates (issue 8, rows 1 and 13).

The auditor accepts an entry only where its own classification says one is needed: a direction entry
within slack * tau of a midpoint, a value entry where the error bound is not small against the grid
spacing, with a grid value the honest trainer could have produced; never at a NaN or infinite result.
"""

import numpy as np
import pytest
import torch

from conftest import audit_json
from veritrain.engine import (EngineConfig, TrainerHalf, VerifiedMode, _EagerSlot, _FusedSlot, _PartSlot,
                              step_context)
from veritrain.logformat import StepLogReader, StepLogWriter, read_records, write_records
from veritrain.rounding import UNIT_ROUNDOFF, Grid
from veritrain.runner import TrainOptions, train

GRID = Grid(32)


def largest_grid_point_at_most(t: torch.Tensor) -> torch.Tensor:
    lower, upper, _ = GRID.cell(t)
    return torch.where(t >= 0, lower, -upper).to(torch.float32)


def free_positions(chosen: torch.Tensor, e, limit: int) -> torch.Tensor:
    """The first ``limit`` positions where ``chosen`` holds and the honest log has no entry yet."""
    taken = torch.zeros_like(chosen)
    for p in (e.dir_pos, e.val_pos):
        taken[torch.from_numpy(np.array(p, dtype=np.int64))] = True
    return (chosen & ~taken).nonzero().flatten()[:limit]


def add_value_entries(e, pos: torch.Tensor, values: torch.Tensor):
    """Value entries (float32 ``values``) at ``pos``, merged into ``e`` in position order."""
    allpos = np.concatenate([e.val_pos, pos.numpy()])
    allval = np.concatenate([e.val_bits, values.view(torch.int32).numpy().view(np.uint32)])
    order = np.argsort(allpos)
    e.val_pos, e.val_bits = allpos[order], allval[order]


def add_direction_entries(e, pos: torch.Tensor, away: torch.Tensor):
    """Direction entries at ``pos``, merged into ``e`` in position order."""
    allpos = np.concatenate([e.dir_pos, pos.numpy()])
    order = np.argsort(allpos)
    e.dir_pos, e.dir_bits = allpos[order], np.concatenate([e.dir_bits, away.numpy()])[order]


def flip_beyond_the_bound(slot, e, c, limit: int) -> int:
    """A dishonest trainer's move on one output: the rounding of up to ``limit`` results between 1.1 tau and
    1.9 tau from a midpoint (no honest result within tau of ours rounds that way) flipped to the other
    neighbour, trained on and logged as direction entries in ``e``. Returns how many."""
    y = slot.y64.reshape(-1)
    tau = c * UNIT_ROUNDOFF * slot.scale().reshape(-1)
    dist = GRID.midpoint_distance(y)
    chosen = torch.isfinite(y) & (dist > 1.1 * tau) & (dist < 1.9 * tau) & (tau < GRID.spacing_at(y) / 8)
    pos = free_positions(chosen, e, limit)
    if len(pos):
        away = ~(GRID.round(y[pos]).double().abs() > y[pos].abs())  # the other neighbour
        slot.y32.view(-1)[pos] = GRID.apply_direction(y[pos], away)
        add_direction_entries(e, pos, away)
    return len(pos)


def dishonest_record(pushed: list, natural_only: bool):
    """TrainerHalf.record of a trainer that adds value entries at positions that need none.

    ``natural_only=False``: it pushes each such result up to the far edge of the window the old auditor
    tolerated (|v - y| <= spacing / 2 + slack * tau) wherever that is another grid point than the honest
    rounding, and trains on the pushed value. ``natural_only=True``: the entries hold the honest rounding
    (no effect on the weights; still entries that no honest trainer writes)."""
    orig = TrainerHalf.record

    def record(self, slot, c):
        e = orig(self, slot, c)
        if self.mode.step < 1 or not isinstance(slot, _EagerSlot) or slot.y64.numel() < 16:
            return e
        y = slot.y64.reshape(-1)
        tau = c * UNIT_ROUNDOFF * slot.scale().reshape(-1)
        spacing = GRID.spacing_at(y)
        natural = GRID.round(y)
        if natural_only:
            v = natural
            chosen = torch.isfinite(y) & (tau < spacing / 8)
        else:
            v = largest_grid_point_at_most(y + spacing / 2 + self.mode.config.slack * tau)
            chosen = torch.isfinite(y) & (tau < spacing / 8) & (v.view(torch.int32) != natural.view(torch.int32))
        pos = free_positions(chosen, e, 50)
        if not len(pos):
            return e
        y32 = slot.y32.view(-1)
        y32[pos] = v[pos]
        add_value_entries(e, pos, y32[pos])
        pushed.append(len(pos))
        return e

    return record


@pytest.mark.parametrize("natural_only", [False, True], ids=["far-edge", "unneeded-but-harmless"])
def test_row1_value_entries_where_none_is_needed_are_rejected(tmp_path, monkeypatch, natural_only):
    pushed = []
    monkeypatch.setattr(TrainerHalf, "record", dishonest_record(pushed, natural_only))
    run = tmp_path / "run"
    train(TrainOptions(task="digits-cnn", out=str(run), steps=3, checkpoint_every=3, progress=False))
    monkeypatch.undo()
    assert sum(pushed) > 0, "the dishonest trainer found nothing to push"
    r = audit_json(run, "combo")
    assert not r["accepted"], "value entries at positions that need none were accepted"
    assert r["suspicious"] >= 1 and r["suspicious_details"][0]["kind"] == "value", r["suspicious_details"][:2]
    assert any("suspicious" in x for x in r["reasons"])


def step_log(tmp_path, fn, *inputs, bits: int = 32):
    """Run ``fn`` as a one-op step under the trainer's engine (on the grid of ``bits``); returns (log path, its
    records)."""
    path = str(tmp_path / "step.vtlog")
    w = StepLogWriter(path, 0, bits)
    with step_context(EngineConfig(bits=bits), 0, writer=w):
        fn(*inputs)
    w.close()
    return path, read_records(path)


def replay(path, fn, *inputs, bits: int = 32):
    with StepLogReader(path, expect_step=0, expect_bits=bits) as reader:
        with step_context(EngineConfig(bits=bits), 0, reader=reader) as mode:
            out = fn(*inputs)
    return mode.stats, out


def cancelling_product_log(tmp_path, bits: int):
    """A one-op step whose only result is exactly 0 (1 * 0.75 + 1 * -0.75): its grid cell is not determined by its
    error bound (about 10^-15), so the honest log holds a value entry there, of 0. Returns (the log's path, its
    records, the product's operands)."""
    a, b = torch.tensor([[1.0, 1.0]]), torch.tensor([[0.75], [-0.75]])
    path, records = step_log(tmp_path, torch.mm, a, b, bits=bits)
    out = records[2][-1].outputs[0]
    assert out.val_pos.tolist() == [0] and out.val_bits.view(np.float32).tolist() == [0.0], "no honest value entry"
    return path, records, (a, b)


def replay_with_value(path, records, operands, bits: int, value: np.float32):
    """The log with its value entry replaced by ``value``, replayed: (the statistics, the product)."""
    step, log_bits, ops = records
    ops[-1].outputs[0].val_bits = np.array([value]).view(np.uint32)
    write_records(path, step, log_bits, ops)
    return replay(path, torch.mm, *operands, bits=bits)


def test_row1_a_value_entry_outside_the_honest_window_is_rejected_where_one_is_needed(tmp_path):
    """Where a value entry is needed, the logged value must still be one an honest trainer could have produced: a
    grid point in [round(y - tau), round(y + tau)] (AuditorHalf.replay's window). 1.0 in place of the honest 0 is
    needed, on the grid and finite, so only the window stops it; a value inside it is the trainer's freedom."""
    path, records, operands = cancelling_product_log(tmp_path, 32)
    stats, _ = replay_with_value(path, records, operands, 32, np.float32(1.0))
    assert stats.suspicious_count == 1, [x.detail for x in stats.suspicious]
    assert stats.suspicious[0].kind == "value" and stats.suspicious[0].position == 0
    stats, out = replay_with_value(path, records, operands, 32, np.float32(2.0**-60))  # inside: accepted
    assert stats.suspicious_count == 0 and out.item() == 2.0**-60


def test_row1_a_value_entry_off_a_coarser_grid_is_rejected(tmp_path):
    """On a grid coarser than float32 (b < 32), a value entry must be a grid point. 2^-60 (1 + 2^-20) lies between
    two b = 24 grid points, inside the honest window where a value entry is needed, so only the grid check stops
    it; the auditor writes the nearest grid point in its place, so the result stays on the grid either way."""
    grid = Grid(24)
    off = np.float32(2.0**-60 * (1 + 2.0**-20))
    assert not grid.on_grid(np.array([off]))[0] and grid.on_grid(np.array([np.float32(2.0**-60)]))[0]
    path, records, operands = cancelling_product_log(tmp_path, 24)
    stats, out = replay_with_value(path, records, operands, 24, off)
    assert stats.suspicious_count == 1, [x.detail for x in stats.suspicious]
    assert stats.suspicious[0].kind == "value" and stats.suspicious[0].position == 0
    assert bool(grid.on_grid(out.detach()).all())


def test_row1_an_unneeded_direction_entry_that_agrees_is_rejected_as_another_machine_would(tmp_path):
    """A direction entry names a neighbour of the cell its result lies in, so an entry that agrees with this
    auditor's own rounding, far from any midpoint, can contradict another honest auditor's. Forged at a result one
    float64 ulp below the grid point 1.0 ("away": 1.0, this auditor's own rounding), it reads as 1.0 plus a cell to
    an auditor whose result is one ulp above 1.0, within the error bound. Both must reject it: that one because it
    contradicts far from any midpoint, this one only because no entry is needed there (AuditorHalf.replay). Without
    that check the verdict, and the referee's, would depend on the machine (docs/SPEED-RECORD.md, session 52)."""
    below, above = torch.tensor([[1.0, -2.0**-53]]), torch.tensor([[1.0, 2.0**-52]])  # float32 operands
    ones = torch.ones(2, 1)
    path, (step, bits, ops) = step_log(tmp_path, torch.mm, below, ones)
    out = ops[-1].outputs[0]
    assert not out.n_entries, "an honest trainer logs nothing this far from a midpoint"
    out.dir_pos, out.dir_bits = np.array([0], dtype=np.int64), np.array([True])
    write_records(path, step, bits, ops)
    # the two float64 results, within the error bound of each other, and what the one entry says to each
    y_below = torch.tensor([1 - 2.0**-53], dtype=torch.float64)
    y_above = torch.tensor([1 + 2.0**-52], dtype=torch.float64)
    tau = EngineConfig().thresholds["accumulate"] * UNIT_ROUNDOFF * 2  # sqrt(2) * ||row|| * ||column||, about 2
    assert (y_above - y_below).abs().item() < tau
    away = torch.tensor([True])
    assert GRID.apply_direction(y_below, away).item() == GRID.round(y_below).item() == 1.0
    assert GRID.apply_direction(y_above, away).item() == 1 + 2.0**-23 != GRID.round(y_above).item()
    for operands in (below, above):
        stats, _ = replay(path, torch.mm, operands, ones)
        assert stats.suspicious_count == 1 and stats.suspicious[0].kind == "direction", \
            [x.detail for x in stats.suspicious]


@pytest.mark.parametrize("kind", ["value", "direction"])
@pytest.mark.parametrize("where", ["nan", "inf"])
def test_row13_entries_at_nan_or_infinite_results_are_suspicious(tmp_path, kind, where):
    x = torch.linspace(-3, 3, 64, dtype=torch.float32)
    fn = torch.log if where == "nan" else (lambda t: torch.exp(t * 40))  # log(<0) = NaN, exp(120) = inf
    path, (step, bits, ops) = step_log(tmp_path, fn, x)
    y = fn(x.double())
    bad = int((torch.isnan(y) if where == "nan" else torch.isinf(y.float())).nonzero()[0])
    out = ops[-1].outputs[0]
    if kind == "value":
        out.val_pos = np.append(out.val_pos, bad).astype(np.int64)
        out.val_bits = np.append(out.val_bits, np.float32(1.0).view(np.uint32))
    else:
        out.dir_pos = np.append(out.dir_pos, bad).astype(np.int64)
        out.dir_bits = np.append(out.dir_bits, True)
    write_records(path, step, bits, ops)
    stats, _ = replay(path, fn, x)
    assert stats.suspicious_count == 1, f"a {kind} entry at a {where} result passed silently"


def test_row13_a_scalar_entry_on_a_non_finite_scalar_is_suspicious(tmp_path):
    x = torch.ones(16)
    fn = lambda t: torch.mul(t, float("inf"))  # noqa: E731
    path, (step, bits, ops) = step_log(tmp_path, fn, x)
    ops[-1].scalars.append((1, True))
    write_records(path, step, bits, ops)
    stats, _ = replay(path, fn, x)
    assert stats.suspicious_count == 1


def test_value_entries_inside_the_window_are_counted_as_the_trainers_freedom(tmp_path):
    """A genuinely undetermined result (a product-sum whose terms cancel to rounding noise) needs a value
    entry; the auditor accepts one inside its window and reports the window it left open."""
    g = torch.Generator().manual_seed(0)
    a = torch.randn(1, 64, generator=g)
    b = torch.randn(64, 32, generator=g)
    b[-1] = (-(a[0, :-1].double() @ b[:-1].double()) / a[0, -1].double()).float()  # a @ b is nearly 0
    path, (step, bits, ops) = step_log(tmp_path, torch.mm, a, b)
    logged = sum(len(o.val_pos) for op in ops for o in op.outputs)
    assert logged > 0
    stats, _ = replay(path, torch.mm, a, b)
    assert stats.suspicious_count == 0
    f = stats.freedom()
    assert f["value_entries"] == logged and f["value_window_total"] > 0 and f["value_window_cells"] > logged


def test_direction_and_value_entries_of_one_output_are_each_checked_against_their_own_position(tmp_path):
    """The auditor fetches an output's direction and value entries' values and error bounds together
    (AuditorHalf.replay); each entry must still be judged by its own position's bound. A forged direction
    entry at a result far from any midpoint beside honest value entries (a result that cancels to rounding
    noise, whose bound is large) in the same output: exactly the forged one is suspicious."""
    g = torch.Generator().manual_seed(0)
    a = torch.randn(1, 64, generator=g)
    b = torch.randn(64, 32, generator=g)
    b[:, :16] *= 1e-6  # columns whose bound is a millionth of the others'
    b[-1, -1] = (-(a[0, :-1].double() @ b[:-1, -1].double()) / a[0, -1].double()).float()  # column 31 ~ 0
    path, (step, bits, ops) = step_log(tmp_path, torch.mm, a, b)
    out = ops[-1].outputs[0]
    assert len(out.val_pos) >= 1 and not len(out.dir_pos), "the honest log should hold value entries only"
    y = (a.double() @ b.double()).reshape(-1)
    spacing = GRID.spacing_at(y)
    dist = GRID.midpoint_distance(y)
    far = int(torch.nonzero(dist[:16] > spacing[:16] / 8)[0])  # a plain result, nowhere near a midpoint
    assert far not in out.val_pos.tolist()
    out.dir_pos = np.array([far], dtype=np.int64)
    out.dir_bits = np.array([bool(GRID.round(y[far:far + 1]).double().abs() <= y[far].abs())])  # the other way
    write_records(path, step, bits, ops)
    stats, _ = replay(path, torch.mm, a, b)
    assert stats.suspicious_count == 1, [s.detail for s in stats.suspicious]
    assert stats.suspicious[0].kind == "direction" and stats.suspicious[0].position == far
    assert stats.freedom()["value_entries"] == len(out.val_pos)


def test_a_flipped_rounding_beside_honest_value_entries_is_rejected_by_an_auditor_on_another_variant(tmp_path,
                                                                                                      monkeypatch):
    """A trainer that flips the rounding of one plain result (far from any midpoint) in each output that honestly
    holds value entries, trains on it and logs it as a direction entry beside them. The auditor, on another
    variant, checks both kinds of an output's entries from one fetch of their bounds (AuditorHalf.replay):
    the flipped one must still be judged by its own bound, and the run rejected."""
    orig = TrainerHalf.record
    flipped = []

    def record(self, slot, c):
        e = orig(self, slot, c)
        if self.mode.step < 1 or not isinstance(slot, _EagerSlot) or not len(e.val_pos):
            return e
        y = slot.y64.reshape(-1)
        far = torch.isfinite(y) & (GRID.midpoint_distance(y) > GRID.spacing_at(y) / 4)
        pos = free_positions(far, e, 1)
        if not len(pos):
            return e
        natural_away = GRID.round(y[pos]).double().abs() > y[pos].abs()
        away = ~natural_away
        slot.y32.view(-1)[pos] = GRID.apply_direction(y[pos], away)
        add_direction_entries(e, pos, away)
        flipped.append(int(pos[0]))
        return e

    monkeypatch.setattr(TrainerHalf, "record", record)
    run = tmp_path / "run"
    train(TrainOptions(task="digits-cnn", out=str(run), steps=3, checkpoint_every=3, progress=False))
    monkeypatch.undo()
    assert flipped, "no output with value entries to hide a flip beside"
    r = audit_json(run, "combo")
    assert not r["accepted"], "a flipped rounding beside honest value entries was accepted"
    kinds = {d["kind"] for d in r["suspicious_details"]}
    assert r["suspicious"] == len(flipped) and kinds == {"direction"}, r["suspicious_details"][:3]


@pytest.mark.parametrize("n, logged", [(16, 0), (12, 1)])
def test_a_mean_over_a_power_of_two_of_an_exact_sum_leaves_no_choice(tmp_path, n, logged):
    """Shrinking the freedom where the result is determined: the mean of float32 values over 2**k
    elements is exact on every machine when their sum is (summing, then scaling by 2**-k, in any order),
    so even a mean that lands exactly on a float32 tie needs no entry: ties-to-even decides. Over 12
    elements the division rounds, so the same tie is still the trainer's to log."""
    x = torch.tensor([1.0, 1.0 + 2.0**-23] * (n // 2)).reshape(1, n)  # mean = 1 + 2**-24: a float32 tie
    fn = lambda t: torch.mean(t, 1)  # noqa: E731
    path, (step, bits, ops) = step_log(tmp_path, fn, x)
    assert sum(len(o.dir_pos) + len(o.val_pos) for op in ops for o in op.outputs) == logged
    stats, out = replay(path, fn, x)
    assert stats.suspicious_count == 0 and float(out[0]) == 1.0


def test_a_flipped_tie_of_a_certified_exact_result_is_rejected(tmp_path):
    """An exact mean landing on a float32 tie has tau 0: every machine computes the tie itself and
    rounds it to even, so a direction entry that rounds it away is a choice no honest trainer has (it was
    accepted while the auditor's check was dist <= tau, true at 0 <= 0)."""
    x = torch.tensor([1.0, 1.0 + 2.0**-23] * 8).reshape(1, 16)
    fn = lambda t: torch.mean(t, 1)  # noqa: E731
    path, (step, bits, ops) = step_log(tmp_path, fn, x)
    out = ops[-1].outputs[0]
    assert len(out.dir_pos) == 0
    out.dir_pos, out.dir_bits = np.array([0], dtype=np.int64), np.array([True])
    write_records(path, step, bits, ops)
    stats, y = replay(path, fn, x)
    assert stats.suspicious_count == 1 and stats.suspicious[0].kind == "direction"


def test_a_rounding_flipped_beyond_the_error_bound_is_rejected(tmp_path, monkeypatch):
    """Slack tolerates entries the trainer logged; it does not widen what an honest trainer could have
    *chosen*. A trainer that overrides the rounding of results between tau and slack * tau from a
    midpoint (no honest result within tau of ours rounds that way) is rejected."""
    orig = TrainerHalf.record
    flipped = []

    def record(self, slot, c):
        e = orig(self, slot, c)
        if self.mode.step < 1 or not isinstance(slot, _EagerSlot) or slot.y64.numel() < 16:
            return e
        n = flip_beyond_the_bound(slot, e, c, 20)
        if n:
            flipped.append(n)
        return e

    monkeypatch.setattr(TrainerHalf, "record", record)
    run = tmp_path / "run"
    train(TrainOptions(task="digits-cnn", out=str(run), steps=3, checkpoint_every=3, progress=False))
    monkeypatch.undo()
    assert sum(flipped) > 0, "nothing between tau and 2 tau to flip"
    r = audit_json(run, "combo")
    assert not r["accepted"] and r["suspicious"] >= 1
    assert r["suspicious_details"][0]["kind"] == "direction"


@pytest.mark.parametrize("where", ["fused", "packed"])
@pytest.mark.parametrize("forgery", ["value", "direction"])
def test_forged_entries_in_a_fused_foreach_output_are_rejected(tmp_path, monkeypatch, forgery, where):
    """The optimizer's foreach update of a large parameter comes from the single op's fused kernel
    (engine._try_fused_foreach), whose candidates the kernel found; the small parameters' from one op on them
    laid end to end (``packed``: engine._packed_groups), each parameter's entries a part of its result. A trainer
    that adds entries there (a value entry at the other grid neighbour where none is needed, or a rounding
    flipped more than 1.1 tau from a midpoint: elementwise taus are small, so few results lie within 2 tau) and
    trains on them is rejected by an auditor on another variant."""
    if where == "fused":
        monkeypatch.setenv("VERITRAIN_COMPILE_MIN_NUMEL", "256")  # digits-cnn's larger parameters take the path
    forged_type = _FusedSlot if where == "fused" else _PartSlot
    orig_record, orig_foreach = TrainerHalf.record, VerifiedMode._try_fused_foreach
    forged = []

    def foreach(self, *a, **kw):
        self._forging = True
        try:
            return orig_foreach(self, *a, **kw)
        finally:
            self._forging = False

    def record(self, slot, c):
        e = orig_record(self, slot, c)
        if self.mode.step < 1 or not getattr(self.mode, "_forging", False) or type(slot) is not forged_type:
            return e
        n = int(np.prod(slot.shape))
        every = torch.arange(n)
        y, tau = slot.values_at(every), c * UNIT_ROUNDOFF * slot.scale_at(every)
        ok = torch.isfinite(y) & (y != 0) & (tau < GRID.spacing_at(y) / 8)
        if forgery == "direction":
            dist = GRID.midpoint_distance(y)
            ok &= (dist > 1.1 * tau) & (dist < 1000 * tau)
        pos = free_positions(ok, e, 20)
        if not len(pos):
            return e
        y32 = slot.y32.view(-1)
        if forgery == "value":  # the grid point one step away from the honest rounding, in magnitude
            y32[pos] = (GRID.round(y[pos]).view(torch.int32) + 1).view(torch.float32)
            add_value_entries(e, pos, y32[pos])
        else:
            away = ~(GRID.round(y[pos]).double().abs() > y[pos].abs())  # the other neighbour
            y32[pos] = GRID.apply_direction(y[pos], away)
            add_direction_entries(e, pos, away)
        forged.append(len(pos))
        return e

    run = tmp_path / "run"
    with monkeypatch.context() as m:
        m.setattr(TrainerHalf, "record", record)
        m.setattr(VerifiedMode, "_try_fused_foreach", foreach)
        train(TrainOptions(task="digits-cnn", out=str(run), steps=3, checkpoint_every=3, progress=False))
    assert sum(forged) > 0, f"no {where} foreach output to forge in"
    r = audit_json(run, "combo")
    assert not r["accepted"], f"forged {forgery} entries in fused foreach outputs were accepted"
    assert r["suspicious"] >= 1 and r["suspicious_details"][0]["kind"] == forgery, r["suspicious_details"][:2]


def moving_finish_op(moved: list, chosen):
    """VerifiedMode._finish_op of a trainer that moves some float32 results of the ops ``chosen(func, slots)``
    picks to the next grid value up (``chosen`` returns their positions, or None for an op left alone), trains
    on them and logs them as value entries; ``moved`` gets each op's count."""
    orig = VerifiedMode._finish_op

    def finish(self, func, record, scalars, slots):
        pos = chosen(func, slots) if self.writer is not None and self.step >= 1 else None
        if pos is None:
            return orig(self, func, record, scalars, slots)
        y = slots[0].y32.view(-1)
        y[pos] = torch.nextafter(y[pos], torch.full_like(y[pos], float("inf")))
        write = self.writer.op

        def op(name, sc, outputs, rounded):
            add_value_entries(outputs[0], pos, y[pos])
            return write(name, sc, outputs, rounded)

        self.writer.op = op
        try:
            return orig(self, func, record, scalars, slots)
        finally:
            del self.writer.op
            moved.append(len(pos))

    return finish


def test_entries_on_an_exact_max_pool_gradient_are_rejected(tmp_path, monkeypatch):
    """digits-cnn's pooling gradient (2 x 2 windows, stride 2: no input in two windows) is an exact op, which no
    honest trainer logs an entry for. A trainer that moves some of its results to the next grid value, trains on
    them and logs them as value entries is rejected by an auditor on another variant."""
    moved = []

    def chosen(func, slots):
        if func is not torch.ops.aten.max_pool2d_with_indices_backward.default:
            return None
        return slots[0].y32.view(-1).nonzero().flatten()[:5]

    monkeypatch.setattr(VerifiedMode, "_finish_op", moving_finish_op(moved, chosen))
    run = tmp_path / "run"
    train(TrainOptions(task="digits-cnn", out=str(run), steps=3, checkpoint_every=3, progress=False))
    monkeypatch.undo()
    assert sum(moved) > 0
    r = audit_json(run, "combo")
    assert not r["accepted"] and r["suspicious"] >= 1, r["reasons"]
    first = r["suspicious_details"][0]
    assert "max_pool2d_with_indices_backward" in first["op"] and first["kind"] == "exact", r["suspicious_details"][:2]


@pytest.mark.parametrize("regions", ["python", "compiled"])
def test_a_moved_batchnorm_mean_inside_a_captured_region_is_rejected(tmp_path, monkeypatch, regions):
    """Inside a BatchNorm call, which an auditor replays as one captured region (digits-cnn's are small, so as
    Python, or compiled once their signature is hot: VERITRAIN_CAPTURE_HOT_CALLS=1 here; capture.py): a trainer
    that moves some channel means to the next grid value, trains on them and logs them as value entries. The
    auditor on another variant must not replay the region past those entries: its records differ from the
    honest template, so it runs the call op by op and names the entries."""
    moved = []

    def chosen(func, slots):
        if func is not torch.ops.aten.mean.dim or slots[0].y32.numel() > 64:
            return None
        return torch.arange(min(2, slots[0].y32.numel()))

    monkeypatch.setattr(VerifiedMode, "_finish_op", moving_finish_op(moved, chosen))
    monkeypatch.setenv("VERITRAIN_COMPILE", "0")  # the trainer runs every BatchNorm op by op, through the hook
    run = tmp_path / "run"
    train(TrainOptions(task="digits-cnn", out=str(run), steps=3, checkpoint_every=3, progress=False))
    monkeypatch.undo()  # the auditor at default settings: small regions replay as Python, large ones compiled
    if regions == "compiled":
        monkeypatch.setenv("VERITRAIN_CAPTURE_HOT_CALLS", "1")  # the auditor's child process inherits it
    assert sum(moved) > 0
    r = audit_json(run, "combo")
    assert not r["accepted"] and r["suspicious"] >= 1, r["reasons"]
    first = r["suspicious_details"][0]
    assert "mean.dim" in first["op"] and first["kind"] == "value", r["suspicious_details"][:2]


@pytest.mark.parametrize("gather", ["numpy", "torch"])
def test_roundings_flipped_in_a_convolutions_gradients_are_rejected(tmp_path, monkeypatch, gather):
    """A trainer that flips the rounding of results between 1.1 tau and 1.9 tau from a midpoint in a backward
    convolution's gradients, trains on them and logs them as direction entries. The auditor's tau there comes
    from lazy factors at the entries' positions (rules._convolution_backward): for the weight gradient the
    channel norms of the output gradient and of the input (rules.ChannelNorm), for the input gradient the
    output gradient's patch norms times each input channel's weight norm; a tau twice too large would let
    every flip through. Results that close to a midpoint are rare where tau is small against the grid, so the
    flips land in the weight gradients (long sums), and in the input gradients only where one is found.
    Rejected by an auditor on another variant, and by one whose channel norms are gathered in torch (more
    values than rules.GATHER_NUMPY_NUMEL; digits-cnn's are below it)."""
    from veritrain import rules
    from veritrain.runner import audit

    orig = TrainerHalf.record
    flipped = []

    def record(self, slot, c):
        e = orig(self, slot, c)
        if self.mode.step < 1 or not isinstance(slot, _EagerSlot) or slot.index > 1 \
                or slot.analysis.call.func is not torch.ops.aten.convolution_backward.default:
            return e
        n = flip_beyond_the_bound(slot, e, c, 5)
        if n:
            flipped.append((slot.index, n))
        return e

    monkeypatch.setattr(TrainerHalf, "record", record)
    run = tmp_path / "run"
    train(TrainOptions(task="digits-cnn", out=str(run), steps=3, checkpoint_every=3, progress=False))
    monkeypatch.undo()
    assert 1 in {i for i, _ in flipped}, f"no flip in a weight gradient: {flipped}"
    if gather == "numpy":
        r = audit_json(run, "combo")
        assert not r["accepted"] and r["suspicious"] == sum(n for _, n in flipped), r["suspicious_details"][:3]
        assert {d["kind"] for d in r["suspicious_details"]} == {"direction"}
    else:
        monkeypatch.setattr(rules, "GATHER_NUMPY_NUMEL", 0)
        r = audit(str(run), progress=False)
        assert not r.accepted and r.suspicious == sum(n for _, n in flipped), r.suspicious_details[:3]


def test_roundings_flipped_in_a_forward_convolution_by_the_input_gradient_kernel_are_rejected(tmp_path, monkeypatch):
    """The forward convolutions computed by ATen's input-gradient kernel (convolution.py; forced on for digits-cnn's
    small ones) on both sides: a trainer that flips roundings between 1.1 and 1.9 tau from a midpoint in their
    results, trains on them and logs them as direction entries, is rejected by an auditor on another variant that
    computes them the same way, every flip counted. The kernel changes how the float64 result is computed, not
    the auditor's checks of entries."""
    orig = TrainerHalf.record
    flipped = []

    def record(self, slot, c):
        e = orig(self, slot, c)
        if self.mode.step < 1 or not isinstance(slot, _EagerSlot) \
                or slot.analysis.call.func is not torch.ops.aten.convolution.default:
            return e
        flipped.append(flip_beyond_the_bound(slot, e, c, 5))
        return e

    monkeypatch.setattr(TrainerHalf, "record", record)
    monkeypatch.setenv("VERITRAIN_CONV_MIN_NUMEL", "0")
    run = tmp_path / "run"
    train(TrainOptions(task="digits-cnn", out=str(run), steps=3, checkpoint_every=3, progress=False))
    monkeypatch.undo()
    assert sum(flipped) > 0, flipped
    monkeypatch.setenv("VERITRAIN_CONV_MIN_NUMEL", "0")  # the auditor's process computes them the same way
    r = audit_json(run, "combo")
    assert not r["accepted"] and r["suspicious"] == sum(flipped), r["suspicious_details"][:3]
    assert {d["kind"] for d in r["suspicious_details"]} == {"direction"}
    assert all("convolution.default" in d["op"] for d in r["suspicious_details"]), r["suspicious_details"][:3]
