"""The rounding log: round trips and malformed input (spec: docs/FORMAT.md)."""

import os

import numpy as np
import pytest
import zstandard
from hypothesis import given, settings
from hypothesis import strategies as st

from veritrain import logformat
from veritrain.logformat import (MAGIC, LogFormatError, OpRecord, OutputEntries, QuietRun, StepLogReader,
                                 StepLogWriter, decode_positions, decode_varints, dense_encoding_bytes, encode_varints, gaps_to_positions,
                                 positions_to_gaps, read_records, write_records)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(min_value=0, max_value=2**63 - 1), max_size=200))
def test_varints_round_trip(values):
    a = np.array(values, dtype=np.uint64)
    assert decode_varints(encode_varints(a), len(values)).tolist() == values


@pytest.mark.parametrize("buf, count, words", [
    (b"\x01", 0, "has bytes but no entries"),
    (b"\x01\x02", 1, "holds 2 varints, expected 1"),
    (b"\x81", 1, "holds 0 varints, expected 1"),
    (b"\x01\x81", 1, "holds 1 varints, expected 1"),  # one value, then bytes that do not end one
    (b"\xff" * 9 + b"\x01", 1, "longer than 63 bits"),
], ids=["bytes for no values", "a value too many", "no value ends", "bytes after the last value", "ten bytes"])
def test_varints_that_are_not_count_values_of_63_bits_are_refused(buf, count, words):
    with pytest.raises(LogFormatError, match=words):
        decode_varints(buf, count)


@pytest.mark.parametrize("pos", [[3, 3], [5, 2], list(range(40)) + [39]], ids=["repeated", "decreasing", "many"])
def test_the_writer_refuses_positions_that_are_not_strictly_increasing(pos):
    """A log's gap blocks encode strictly increasing positions (docs/FORMAT.md): the writer never writes another
    list, by its Python path for a few positions or its NumPy one for many."""
    with pytest.raises(ValueError, match="strictly increasing"):
        logformat.encode_positions(np.array(pos, dtype=np.int64))
    with pytest.raises(ValueError, match="strictly increasing"):
        positions_to_gaps(np.array(pos, dtype=np.int64))


@pytest.mark.timeout(30)  # without the check the encoder loops forever: fail, do not hang
def test_the_writer_refuses_a_negative_varint():
    """A varint codes a count, a gap or a length: a negative one has no encoding (shifting it right never reaches
    zero), so the writer refuses it by name."""
    with pytest.raises(ValueError, match="non-negative"):
        logformat._varint(-1)


@settings(max_examples=200, deadline=None)
@given(st.sets(st.integers(min_value=0, max_value=10**12), max_size=100))
def test_gap_coding_round_trip(positions):
    pos = np.array(sorted(positions), dtype=np.int64)
    assert gaps_to_positions(positions_to_gaps(pos)).tolist() == pos.tolist()


@settings(max_examples=300, deadline=None)
@given(st.sets(st.integers(min_value=0, max_value=2**40), max_size=40))
def test_few_positions_encode_as_the_vectorised_path_does(positions):
    pos = np.array(sorted(positions), dtype=np.int64)
    assert logformat.encode_positions(pos) == encode_varints(positions_to_gaps(pos))


def _decoded(buf, count, numel):
    try:
        return decode_positions(buf, count, numel).tolist()
    except LogFormatError:
        return "error"


@settings(max_examples=500, deadline=None)
@given(st.sets(st.integers(min_value=0, max_value=2**20), min_size=1, max_size=40), st.integers(-3, 2**21),
       st.integers(-2, 2), st.lists(st.tuples(st.integers(0, 80), st.integers(0, 255)), max_size=3),
       st.binary(max_size=3))
def test_few_positions_decode_as_the_vectorised_path_does(positions, numel_extra, count_extra, edits, tail):
    """The Python decoder of a few positions accepts and refuses what the NumPy one does: honest blocks, blocks
    with bytes changed or added, counts and output sizes that do not match."""
    pos = sorted(positions)
    buf = bytearray(encode_varints(positions_to_gaps(np.array(pos, dtype=np.int64))) + tail)
    for i, b in edits:
        if i < len(buf):
            buf[i] = b
    count = max(1, len(pos) + count_extra)
    numel = max(1, pos[-1] + 1 + numel_extra)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(logformat, "_FEW", 64)
        few = _decoded(bytes(buf), count, numel)
        mp.setattr(logformat, "_FEW", 0)
        assert few == _decoded(bytes(buf), count, numel)
    if not edits and not tail and not count_extra and numel_extra >= 0:
        assert few == pos


@pytest.mark.parametrize("buf,count,want", [
    (b"\x63", 1, [99]), (b"\x00\x62", 2, [0, 99]),
    (b"\x64", 1, "entry position outside its output"),  # a gap past the output
    (b"\x00\x63", 2, "entry position outside its output"),  # a position past the output
    (b"\x85\x00", 1, "entry position outside its output"),  # a varint longer than the largest gap needs
    (b"\x85", 1, "position block ends inside a varint"),
    (b"\x05\x01", 1, "position block holds more than 1 varints"),
    (b"\x05\x01\x02", 1, "position block holds more than 1 varints"),
    (b"\x05", 2, "position block holds 1 varints, expected 2"),
])
def test_few_and_many_positions_decode_alike_at_the_edges(buf, count, want, monkeypatch):
    """Both decoders of an output of 100 elements (gaps of one byte) at the edges of what they accept, and with
    the same refusal."""
    def decoded():
        try:
            return decode_positions(buf, count, 100).tolist()
        except LogFormatError as e:
            return str(e)
    monkeypatch.setattr(logformat, "_FEW", 64)
    assert decoded() == want
    monkeypatch.setattr(logformat, "_FEW", 0)
    assert decoded() == want


def test_a_whole_decoding_pass_without_the_end_of_a_varint_is_refused():
    """The NumPy decoder works a pass of _DECODE_CHUNK bytes at a time: a pass holding no byte that ends a varint
    (a run of continuation bytes before the block's last byte, which does end one) is a varint too long for any
    position, refused by name rather than an IndexError."""
    buf = b"\x80" * logformat._DECODE_CHUNK + b"\x01"
    with pytest.raises(LogFormatError, match="varint longer than 63 bits in position block"):
        decode_positions(buf, logformat._FEW + 1, 1 << 40)
    assert _decoded(b"\x80" * 8 + b"\x01", 1, 1 << 62) == [1 << 56]  # a long varint that ends: a position


@st.composite
def op_records(draw):
    ops = []
    for _ in range(draw(st.integers(0, 6))):
        name = draw(st.sampled_from(["aten.mm.default", "aten.add_.Tensor", "aten._softmax.default", "op/ü"]))
        entries = st.lists(st.tuples(st.integers(0, 20), st.booleans()), max_size=3, unique_by=lambda e: e[0])
        scalars = sorted(draw(entries))  # one entry per argument, in order (docs/FORMAT.md)
        outs = []
        for _ in range(draw(st.integers(0, 3))):
            shape = tuple(draw(st.lists(st.integers(1, 6), max_size=3)))
            numel = int(np.prod(shape)) if shape else 1
            chosen = sorted(draw(st.sets(st.integers(0, numel - 1), max_size=numel)))
            split = draw(st.integers(0, len(chosen)))
            d, v = chosen[:split], chosen[split:]
            o = OutputEntries(shape, np.array(d, np.int64), np.array(draw(st.lists(st.booleans(), min_size=len(d),
                                                                                   max_size=len(d))), bool),
                              np.array(v, np.int64),
                              np.array(draw(st.lists(st.integers(0, 2**32 - 1), min_size=len(v), max_size=len(v))),
                                       np.uint32))
            outs.append(o)
        ops.append(OpRecord(name, scalars, outs))
    return ops


@settings(max_examples=100, deadline=None)
@given(op_records(), st.integers(0, 10**9), st.integers(23, 32))
def test_log_round_trip(tmp_path_factory, ops, step, bits):
    path = str(tmp_path_factory.mktemp("log") / "s.vtlog")
    info = write_records(path, step, bits, ops)
    assert info["bytes"] == os.path.getsize(path)
    s, b, back = read_records(path)
    assert (s, b) == (step, bits)
    assert len(back) == len(ops)
    for x, y in zip(ops, back):
        assert x.name == y.name and [tuple(p) for p in x.scalars] == [tuple(p) for p in y.scalars]
        assert len(x.outputs) == len(y.outputs)
        for o, p in zip(x.outputs, y.outputs):
            assert tuple(o.shape) == p.shape
            assert o.dir_pos.tolist() == p.dir_pos.tolist() and o.dir_bits.tolist() == p.dir_bits.tolist()
            assert o.val_pos.tolist() == p.val_pos.tolist() and o.val_bits.tolist() == p.val_bits.tolist()


@st.composite
def quiet_records(draw):
    """(name, scalars, shapes, rounded values) per op: records without tensor entries, as a captured region's."""
    out = []
    for _ in range(draw(st.integers(1, 6))):
        name = draw(st.sampled_from(["aten.mean.dim", "aten.rsqrt.default", "aten.add.Tensor", "op/ü"]))
        entries = st.lists(st.tuples(st.integers(0, 200), st.booleans()), max_size=3, unique_by=lambda e: e[0])
        scalars = sorted(draw(entries))  # one entry per argument, in order (docs/FORMAT.md)
        shapes = [tuple(draw(st.lists(st.integers(1, 300), max_size=3))) for _ in range(draw(st.integers(0, 3)))]
        out.append((name, scalars, shapes, sum(int(np.prod(s)) for s in shapes)))
    return out


@settings(max_examples=60, deadline=None)
@given(quiet_records(), st.integers(0, 2))
def test_a_quiet_run_is_written_and_read_as_its_records_one_by_one(tmp_path_factory, records, known):
    """``StepLogWriter.quiet_ops`` writes the bytes ``op`` writes for each record (its names new or already
    in the file), and ``StepLogReader.skip_quiet`` consumes exactly those bytes, with the END totals right."""
    d = tmp_path_factory.mktemp("quiet")
    run = QuietRun(records)

    def write(path, quiet):
        w = StepLogWriter(str(path), 5, 32)
        for r in range(1 + known):  # the names are new in the first pass, known in later ones
            if quiet and r == known:
                w.quiet_ops(run)
            else:
                for name, scalars, shapes, rounded in records:
                    w.op(name, scalars, [OutputEntries(s) for s in shapes], rounded)
        w.op("aten.mm.default", [], [OutputEntries((2, 3), np.array([4]), np.array([True]))], 6)
        w.close()
        return path.read_bytes()

    assert write(d / "quiet.vtlog", True) == write(d / "ops.vtlog", False)
    r = StepLogReader(str(d / "quiet.vtlog"), expect_step=5)
    for _ in range(known * len(records)):
        r.next_op()
    assert r.skip_quiet(run) == (known > 0)  # a name not yet in the file: read record by record
    if not known:
        assert [r.next_op().name for _ in records] == run.names
    assert r.next_op().outputs[0].dir_pos.tolist() == [4]
    assert r.next_op() is None  # END read, its totals checked against what was consumed
    r.close()


def test_skip_quiet_reads_nothing_unless_the_bytes_are_the_honest_ones(tmp_path):
    """Another scalar bit, an entry, another shape or name, records given back, or a log that ends: False,
    and the next record is the one that was next before."""
    honest = [("aten.mean.dim", [(2, False)], [(4, 3)], 12), ("aten.rsqrt.default", [], [(3,)], 3)]
    run = QuietRun(honest)
    variants = {
        "honest": honest,
        "scalar bit": [("aten.mean.dim", [(2, True)], [(4, 3)], 12), honest[1]],
        "shape": [honest[0], ("aten.rsqrt.default", [], [(4,)], 4)],
        "name": [honest[0], ("aten.sqrt.default", [], [(3,)], 3)],
        "entry": [honest[0], ("aten.rsqrt.default", [], [(3,)], 3, [1])],
        "ends early": [honest[0]],
    }
    for label, recs in variants.items():
        path = str(tmp_path / f"{label}.vtlog")
        w = StepLogWriter(path, 0, 32)
        for pass_ in range(2):  # the first pass gives every name its id
            for name, scalars, shapes, rounded, *entry in (honest if pass_ == 0 else recs):
                pos = np.array(entry[0] if entry else [], np.int64)
                w.op(name, scalars, [OutputEntries(s, pos, np.ones(len(pos), bool)) for s in shapes], rounded)
        w.close()
        r = StepLogReader(path)
        first = [r.next_op() for _ in honest]
        assert r.skip_quiet(run) == (label == "honest"), label
        if label != "honest":
            assert r.next_op().name == recs[0][0], label
        r.unread(first)
        assert not r.skip_quiet(run)  # records given back come first
        assert r.next_op().name == honest[0][0]
        r.close()


def test_a_logs_bytes_do_not_depend_on_the_logs_written_before_it(tmp_path):
    """Writers reuse their thread's compressors (logformat._compressors): a log written after others, or while
    another is open, has the bytes of the same log written by a fresh thread, and reads back."""
    import threading

    from veritrain import logformat

    ops = [OpRecord("aten.mm.default", [], [OutputEntries((40, 50), np.arange(0, 2000, 7), np.arange(286) % 3 == 0)]),
           OpRecord("aten.exp.default", [(1, True)], [OutputEntries((3,))])]
    # more than the writer buffers (64 KiB), so its compressor is mid-frame while the other writer runs
    other = [OpRecord("aten.add.Tensor", [], [OutputEntries((10**6,), np.arange(0, 10**6, 3), np.arange(333334) % 5 == 0)])]

    def fresh():
        write_records(str(tmp_path / "fresh.vtlog"), 7, 32, ops)

    t = threading.Thread(target=fresh)
    t.start()
    t.join()
    want = (tmp_path / "fresh.vtlog").read_bytes()
    write_records(str(tmp_path / "other.vtlog"), 7, 32, other)
    reused = logformat._compressors()[-1]
    write_records(str(tmp_path / "after.vtlog"), 7, 32, ops)
    assert logformat._compressors()[-1] is reused  # the same compressor wrote it
    a = StepLogWriter(str(tmp_path / "a.vtlog"), 7, 32)  # two open at once: each its own compressor
    b = StepLogWriter(str(tmp_path / "b.vtlog"), 7, 32)
    for w, records in ((a, other), (b, ops), (a, ops)):
        for r in records:
            w.op(r.name, r.scalars, r.outputs, sum(int(np.prod(o.shape)) for o in r.outputs))
    b.close()
    a.close()
    assert (tmp_path / "after.vtlog").read_bytes() == want
    assert (tmp_path / "b.vtlog").read_bytes() == want
    assert [r.name for r in read_records(str(tmp_path / "a.vtlog"))[2]] == ["aten.add.Tensor"] + [r.name for r in ops]


def sample_log(tmp_path, step=3):
    ops = [OpRecord("aten.mm.default", [], [OutputEntries((4, 5), np.array([1, 7]), np.array([True, False]),
                                                            np.array([19]), np.array([0x3F800000], np.uint32))]),
           OpRecord("aten.exp.default", [(1, True)], [OutputEntries((3,))])]
    path = str(tmp_path / "s.vtlog")
    write_records(path, step, 32, ops)
    return path


def test_reader_checks_step_bits_and_magic(tmp_path):
    path = sample_log(tmp_path)
    with pytest.raises(LogFormatError, match="for step 3, expected step 4"):
        StepLogReader(path, expect_step=4)
    with pytest.raises(LogFormatError, match="b=32, expected 30"):
        StepLogReader(path, expect_bits=30)
    data = open(path, "rb").read()
    with pytest.raises(LogFormatError, match="bad magic"):
        StepLogReader(b"XXXXXXXX" + data[8:])
    with pytest.raises(LogFormatError, match="cannot open"):
        StepLogReader(str(tmp_path / "missing.vtlog"))


def test_a_log_file_that_fails_while_read_is_a_log_error_naming_it(tmp_path):
    """A run file that grows past its cap while it is read raises RunFileError from its read; the reader names the
    log and the problem as a LogFormatError (the audit's reason to reject), not a crash inside its decoder."""
    from veritrain.store import RunFileError

    data = open(sample_log(tmp_path), "rb").read()

    class Failing:  # the bytes of an honest log up to its last 8, then the read that finds the file grown
        path = "logs/step_00000003.vtlog"

        def __init__(self):
            self.left = memoryview(data[:-8])

        def read(self, n=-1):
            if not self.left:
                raise RunFileError("step_00000003.vtlog", self.path, "grew past the 10-byte limit while it was read")
            out, self.left = bytes(self.left[:n]), self.left[n:]
            return out

    with pytest.raises(LogFormatError, match="step_00000003.vtlog: grew past the 10-byte limit"):
        StepLogReader(Failing()).read_all()


@pytest.mark.parametrize("limit, words", [("MAX_LOG_BYTES", "larger than 64 bytes"),
                                           ("MAX_DECODED", "decompresses to more than 64 bytes")])
def test_a_log_read_from_a_stream_is_bounded_by_its_size_and_what_it_decodes_to(tmp_path, monkeypatch, limit, words):
    """A log given as bytes or a stream has no file size to refuse it by at open: the reader counts what it reads
    and what that decompresses to, and stops at either limit (here lowered to 64 bytes, below the sample's)."""
    data = open(sample_log(tmp_path), "rb").read()
    StepLogReader(data).read_all()  # the honest log, within the real limits
    monkeypatch.setattr(logformat, limit, 64)
    with pytest.raises(LogFormatError, match=words):
        StepLogReader(data).read_all()


def test_bytes_after_the_frame_and_an_op_record_over_its_budget_are_refused(tmp_path, monkeypatch):
    """Nothing may follow the compressed frame (a log has one byte string per meaning); an op record's entry
    blocks are charged to its budget as declared, before they are read (here the budget lowered to 12 bytes, below
    the sample's first record's 15)."""
    data = open(sample_log(tmp_path), "rb").read()
    with pytest.raises(LogFormatError, match="trailing bytes after the compressed frame"):
        StepLogReader(data + b"\x00").read_all()
    monkeypatch.setattr(logformat, "MAX_OP_BYTES", 12)
    with pytest.raises(LogFormatError, match="op record larger than 12 bytes"):
        StepLogReader(data).read_all()
    monkeypatch.setattr(logformat, "MAX_OP_BYTES", 15)
    assert len(StepLogReader(data).read_all()) == 2


@pytest.mark.timeout(60)  # without the truncation check the reader waits forever for more bytes: fail, do not hang
def test_truncated_and_corrupt_logs_are_errors(tmp_path):
    data = open(sample_log(tmp_path), "rb").read()
    for cut in range(len(MAGIC), len(data)):
        with pytest.raises(LogFormatError):
            StepLogReader(data[:cut]).read_all()
    for i in range(len(MAGIC), len(data)):
        bad = bytearray(data)
        bad[i] ^= 0x40
        try:
            StepLogReader(bytes(bad)).read_all()
        except LogFormatError:
            pass  # most flips are caught by zstd's checksum or the record checks; none may crash


@pytest.mark.timeout(60)  # a payload ending inside a record: without its check the reader loops; fail, do not hang
def test_records_are_validated(tmp_path):
    def frame(payload: bytes) -> bytes:
        return MAGIC + zstandard.ZstdCompressor().compress(payload)

    header, v = b"H\x00\x20", logformat._varint
    cases = {
        b"": "truncated",
        b"Q": "missing header",
        header + b"O\x00": "unknown name id",
        header + b"N\x05\x01a": "bad name table",
        header + b"N\x00\x01aO\x00\x00\x01\x01\x04\x05\x05": "entry block does not fit",
        header + b"N\x00\x01aO\x00\x00\x01\x01\x04\x03\x03\x01\x02\x03": "outside its output",
        header + b"N\x00\x01aO\x00\x00\x01\x01\x04\x01\x01\x09\x00\x00\x00E": "outside its output",
        header + b"Z": "unknown record tag",
        header + b"E\x01\x00\x00\x00\x00": "END totals",
        header + b"E\x00\x00\x00\x00\x00junk": "data after the END",
        header + b"N\x00\x01aO\x00\x00\x01\x41": "dimensions",
        header + b"N\x00\x01aO\x00" + v(1025): "too many scalar entries",
        header + b"N\x00\x01aO\x00\x01\x00\x02": "scalar direction must be 0 or 1",
        header + b"N\x00\x01aO\x00\x00" + v((1 << 20) + 1): "too many outputs",
        header + b"N\x00\x01aO\x00\x00\x01\x02" + v(1 << 25) + v(1 << 24): "is too large",
        header + b"N\x00\x01aO\x00\x00\x01\x01\x04\x01\x01\x00\x02": "padding bits set",
        header + b"N\x00\x01aO\x00\x00\x01\x01\x04\x01\x01\x00\x00\x01\x01\x00\x00\x00\x80\x3f":
            "both a direction and a value entry",
    }
    for payload, message in cases.items():
        with pytest.raises(LogFormatError, match=message):
            StepLogReader(frame(payload)).read_all()


def test_writer_is_atomic(tmp_path):
    path = str(tmp_path / "s.vtlog")
    w = StepLogWriter(path, 0, 32)
    w.op("aten.mm.default", [], [OutputEntries((2, 2))], 4)
    assert not os.path.exists(path)  # only the temporary file exists while the step runs
    w.abort()
    assert not os.listdir(tmp_path)


def test_dense_encoding_is_1_6_bits_per_value():
    assert dense_encoding_bytes(5) == 1.0
