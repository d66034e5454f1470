"""Hostile inputs: the log decoder and the manifest loader fail only with their documented errors, and
a log that declares huge blocks is refused before memory is spent on it."""

import json
import os
import tracemalloc

import numpy as np
import zstandard
from hypothesis import HealthCheck, given, settings, strategies as st

from veritrain.logformat import MAGIC, LogFormatError, OutputEntries, StepLogReader, StepLogWriter, _varint
from veritrain.store import MANIFEST, RunError, load_manifest

FUZZ = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def decode(data: bytes):
    r = StepLogReader(data)
    try:
        n = 0
        while r.next_op() is not None:
            n += 1
            assert n < 100_000
    finally:
        r.close()


def a_log(tmp_path_factory=None) -> bytes:
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        p = os.path.join(d, "x.vtlog")
        w = StepLogWriter(p, 3, 32)
        e = OutputEntries((4, 5), dir_pos=np.array([1, 7, 19]), dir_bits=np.array([True, False, True]),
                          val_pos=np.array([2]), val_bits=np.array([0x3F800000], np.uint32))
        w.op("aten.mm.default", [(1, True)], [e], 20)
        w.op("aten.add.Tensor", [], [OutputEntries((3,))], 3)
        w.close()
        return open(p, "rb").read()


VALID = a_log()


def frame(payload: bytes) -> bytes:
    return MAGIC + zstandard.ZstdCompressor(write_checksum=True).compress(payload)


@FUZZ
@given(st.binary(max_size=400))
def test_random_bytes(data):
    for blob in (data, MAGIC + data, frame(data), frame(b"H\x03\x20" + data)):
        try:
            decode(blob)
        except LogFormatError:
            pass


@FUZZ
@given(st.data())
def test_mutated_valid_logs(data):
    raw = bytearray(zstandard.ZstdDecompressor().decompressobj().decompress(VALID[len(MAGIC):]))
    n = data.draw(st.integers(1, 8))
    for _ in range(n):
        i = data.draw(st.integers(0, len(raw) - 1))
        raw[i] = data.draw(st.integers(0, 255))
    cut = data.draw(st.integers(0, len(raw)))
    for blob in (frame(bytes(raw)), frame(bytes(raw[:cut])), VALID[:cut + len(MAGIC)]):
        try:
            decode(blob)
        except LogFormatError:
            pass


def test_the_valid_log_decodes():
    decode(VALID)


def test_huge_declared_blocks_are_refused_before_allocation():
    # an op that declares 2^40 direction entries in a 2^48-element output, followed by 50 MB of zeros
    body = (b"H" + _varint(0) + _varint(32) + b"N" + _varint(0) + _varint(3) + b"abc" + b"O" + _varint(0)
            + _varint(0) + _varint(1) + _varint(2) + _varint(1 << 24) + _varint(1 << 24)
            + _varint(1 << 40) + _varint(1 << 41))
    blob = frame(body + bytes(50 << 20))
    assert len(blob) < 1 << 20
    tracemalloc.start()
    try:
        decode(blob)
        raise AssertionError("accepted")
    except LogFormatError as e:
        assert "larger than" in str(e)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert peak < 16 << 20, peak


JSON = st.recursive(st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20),
                    lambda c: st.lists(c, max_size=4) | st.dictionaries(st.text(max_size=12), c, max_size=6),
                    max_leaves=30)


@FUZZ
@given(st.one_of(JSON, st.fixed_dictionaries({"format": st.just("veritrain-run/1")}, optional={
    "task": JSON, "config": JSON, "seed": JSON, "mode": JSON, "bits": JSON, "thresholds": JSON, "steps": JSON,
    "checkpoint_every": JSON, "checkpoints": st.lists(JSON, max_size=3), "manifest_sha256": JSON})))
def test_manifest_loader_on_hostile_json(tmp_path_factory, obj):
    d = tmp_path_factory.mktemp("m")
    (d / MANIFEST).write_text(json.dumps(obj))
    try:
        load_manifest(str(d))
    except RunError:
        pass


@FUZZ
@given(st.binary(max_size=300))
def test_manifest_loader_on_hostile_bytes(tmp_path_factory, data):
    d = tmp_path_factory.mktemp("m")
    (d / MANIFEST).write_bytes(data)
    try:
        load_manifest(str(d))
    except RunError:
        pass
