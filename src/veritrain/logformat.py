"""The rounding log: one file per training step, written while the step runs (spec: docs/FORMAT.md).

    file    = MAGIC (8 bytes "VTRLOG1\\n") + one zstd frame (with content checksum)
    frame   = HEADER record, then NAME / OP records in execution order, then one END record
    HEADER  = 'H' varint(step) varint(bits)
    NAME    = 'N' varint(id) varint(len) utf8[len]          # ids are 0, 1, 2, ... in order of first use
    OP      = 'O' varint(name_id) varint(n_scalar) n_scalar * (varint(arg_pos) u8(bit))
                  varint(n_out) n_out * OUTPUT
    OUTPUT  = varint(ndim) ndim*varint(dim)
              varint(n_dir) varint(len) gaps[len] bits[ceil(n_dir/8)]
              varint(n_val) varint(len) gaps[len] n_val*u32le(float32 bits)
    END     = 'E' varint(n_ops) varint(rounded_values) varint(n_dir) varint(n_val) varint(n_scalar)

``gaps`` are LEB128 varints of strictly increasing flat (row-major) positions: the first position,
then each difference minus one. ``bits`` are packed least-significant bit first; 1 means the trainer
rounded to the neighbour of larger magnitude.
"""

from __future__ import annotations

import hashlib
import io
import math
import os
import threading
from dataclasses import dataclass, field

import numpy as np
import zstandard

from .store import MAX_LOG_BYTES, RunFileError, fsync_dir, open_regular_file

MAGIC = b"VTRLOG1\n"
_H, _N, _O, _E = b"H", b"N", b"O", b"E"
_NO_ENTRIES = b"\x00" * 4  # an output without entries: 0 directions, 0 gap bytes, 0 values, 0 gap bytes
MAX_NDIM = 64
MAX_NUMEL = 1 << 48
MAX_NAME = 4096
MAX_OP_BYTES = 1 << 27  # the entry blocks of one op record (honest logs: kilobytes); bounds a reader's memory
MAX_OUTPUTS = 1 << 20  # outputs of one op record
MAX_SCALARS = 1024  # scalar entries of one op record
MAX_VARINT_BYTES = 9  # varints carry at most 63 bits
MAX_DECODED = 1 << 32  # decompressed bytes of one log
MAX_INFLATION = 64  # decompressed bytes per compressed byte read, beyond INFLATION_SLACK (zstd bombs)
INFLATION_SLACK = 1 << 20  # honest logs decompress 1.3-7x; a log under 1 MiB decompressed is never refused for it
MAX_WINDOW = 1 << 23  # zstd window a reader allocates (the writer's level 10 uses 4 MiB)
_DECODE_CHUNK = 1 << 14  # gap bytes per numpy pass: bounds temporaries; with gaps < 2^48 a pass's sums stay < 2^63
ZSTD_LEVEL = 10


class LogFormatError(ValueError):
    """A rounding log is malformed, truncated, or not the one expected."""


def _empty(dtype) -> np.ndarray:
    a = np.zeros(0, dtype)
    a.flags.writeable = False  # shared by every output without entries (most of them): never written
    return a


_NONE_I64, _NONE_BOOL, _NONE_U32 = _empty(np.int64), _empty(bool), _empty(np.uint32)


@dataclass(slots=True)
class OutputEntries:
    shape: tuple
    dir_pos: np.ndarray = field(default_factory=lambda: _NONE_I64)
    dir_bits: np.ndarray = field(default_factory=lambda: _NONE_BOOL)
    val_pos: np.ndarray = field(default_factory=lambda: _NONE_I64)
    val_bits: np.ndarray = field(default_factory=lambda: _NONE_U32)

    @property
    def n_entries(self) -> int:
        return len(self.dir_pos) + len(self.val_pos)


@dataclass
class OpRecord:
    name: str
    scalars: list  # [(arg_position, bit)]
    outputs: list  # [OutputEntries]


@dataclass
class StepTotals:
    n_ops: int = 0
    rounded_values: int = 0
    n_dir: int = 0
    n_val: int = 0
    n_scalar: int = 0


# --- varints --------------------------------------------------------------------------------------


def _varint(n: int) -> bytes:
    if 0 <= n < 128:  # one byte: most counts, ids and dimensions
        return _ONE_BYTE[n]
    if n < 0:
        raise ValueError("varint must be non-negative")
    out = bytearray()
    while True:
        b = n & 0x7F
        n >>= 7
        if n:
            out.append(b | 0x80)
        else:
            out.append(b)
            return bytes(out)


_ONE_BYTE = [bytes([i]) for i in range(128)]


def _shape_bytes(shape) -> bytes:
    """An output's rank and dimensions as varints (cached: a step's shapes repeat every step)."""
    b = _SHAPES.get(shape)
    if b is None:
        b = _varint(len(shape)) + b"".join(_varint(int(d)) for d in shape)
        if len(_SHAPES) < 1 << 16:
            _SHAPES[shape] = b
    return b


_SHAPES: dict = {}


def encode_varints(values: np.ndarray) -> bytes:
    a = np.asarray(values, dtype=np.uint64)
    if a.size == 0:
        return b""
    nbytes = np.ones(a.shape, dtype=np.int64)
    v = a >> np.uint64(7)
    while v.any():
        nbytes += v > 0
        v >>= np.uint64(7)
    ends = np.cumsum(nbytes)
    starts = ends - nbytes
    out = np.empty(int(ends[-1]), dtype=np.uint8)
    v = a.copy()
    for k in range(int(nbytes.max())):
        m = nbytes > k
        byte = (v[m] & np.uint64(0x7F)).astype(np.uint8)
        cont = (nbytes[m] > k + 1).astype(np.uint8) << np.uint8(7)
        out[starts[m] + k] = byte | cont
        v[m] >>= np.uint64(7)
    return out.tobytes()


def decode_varints(buf: bytes, count: int) -> np.ndarray:
    a = np.frombuffer(buf, dtype=np.uint8)
    if count == 0:
        if a.size:
            raise LogFormatError("position block has bytes but no entries")
        return np.zeros(0, np.int64)
    ends = np.flatnonzero(a < 0x80)
    if ends.size != count or (a.size and ends[-1] != a.size - 1):
        raise LogFormatError(f"position block holds {ends.size} varints, expected {count}")
    starts = np.concatenate([[0], ends[:-1] + 1])
    lengths = ends - starts + 1
    if lengths.max() > 9:
        raise LogFormatError("varint longer than 63 bits in position block")
    vals = np.zeros(count, dtype=np.uint64)
    for k in range(int(lengths.max())):
        m = lengths > k
        vals[m] |= (a[starts[m] + k].astype(np.uint64) & np.uint64(0x7F)) << np.uint64(7 * k)
    return vals.astype(np.int64)


def positions_to_gaps(pos: np.ndarray) -> np.ndarray:
    pos = np.asarray(pos, dtype=np.int64)
    if pos.size == 0:
        return pos
    gaps = np.empty_like(pos)
    gaps[0] = pos[0]
    gaps[1:] = np.diff(pos) - 1
    if (gaps < 0).any():
        raise ValueError("positions must be strictly increasing")
    return gaps


# Below this many positions a block is encoded and decoded by a Python loop: most outputs with entries have one
# to three, where NumPy's per-call cost is many times the work (the log category fell: docs/SPEED.md).
_FEW = 32


def encode_positions(pos: np.ndarray) -> bytes:
    """The gap block of strictly increasing positions: ``encode_varints(positions_to_gaps(pos))``."""
    if len(pos) > _FEW:
        return encode_varints(positions_to_gaps(pos))
    parts, last = [], -1
    for p in np.asarray(pos, dtype=np.int64).tolist():
        if p <= last:
            raise ValueError("positions must be strictly increasing")
        parts.append(_varint(p - last - 1))
        last = p
    return b"".join(parts)


def gaps_to_positions(gaps: np.ndarray) -> np.ndarray:
    if gaps.size == 0:
        return gaps
    return np.cumsum(gaps + 1) - 1


def _op_head(nid: int, scalars) -> bytes:
    """An OP record up to its outputs: tag, name id, scalar entries."""
    parts = [_O, _varint(nid), _varint(len(scalars))]
    last = -1
    for pos, bit in scalars:
        if pos <= last:  # the format's rule, which a reader enforces
            raise ValueError(f"scalar entries must name strictly increasing argument positions ({pos} after {last})")
        last = pos
        parts.append(_varint(pos) + (b"\x01" if bit else b"\x00"))
    return b"".join(parts)


class QuietRun:
    """A fixed sequence of OP records without tensor entries (a captured region's: capture.py), encoded once
    per assignment of name ids, so that a writer emits it and a reader matches it as one byte string. The
    bytes are exactly what ``StepLogWriter.op`` writes for each record in turn."""

    def __init__(self, records):
        """``records``: (name, scalars [(arg_position, bit)], output shapes, rounded values) per op."""
        self.records = [(name, list(scalars), [tuple(s) for s in shapes], int(rounded))
                        for name, scalars, shapes, rounded in records]
        self.names = [r[0] for r in self.records]
        self.n_scalar = sum(len(r[1]) for r in self.records)
        self.rounded = sum(r[3] for r in self.records)
        self.numel = sum(math.prod(s) for r in self.records for s in r[2])
        self._bytes: dict = {}  # name ids -> encoded records

    def encoded(self, nids: tuple) -> bytes:
        raw = self._bytes.get(nids)
        if raw is None:
            raw = b"".join(_op_head(nid, scalars) + _varint(len(shapes))
                           + b"".join(_shape_bytes(shape) + _NO_ENTRIES for shape in shapes)
                           for nid, (_, scalars, shapes, _) in zip(nids, self.records))
            if len(self._bytes) < 16:
                self._bytes[nids] = raw
        return raw


# --- writer ---------------------------------------------------------------------------------------

_THREAD = threading.local()


def _compressors() -> list:
    """This thread's compressors between logs: a new level-10 compressor allocates its tables each time, a
    cost that shows on small models' short steps; one whose frame has ended starts the next
    frame from scratch, so a log's bytes do not depend on what was written before (tests/test_logformat.py)."""
    free = getattr(_THREAD, "free", None)
    if free is None:
        free = _THREAD.free = []
    return free


class StepLogWriter:
    """Streams one step's records into ``path`` (atomically: temporary name, fsync, rename). With ``pending``
    (a list), no fsync: the path is appended to it at ``close``, for store.sync_files before the run commits."""

    def __init__(self, path: str, step: int, bits: int, pending: list | None = None):
        self.path, self.pending = path, pending
        self.tmp = f"{path}.tmp-{os.getpid()}"
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        self._file = open(self.tmp, "wb")
        self._file.write(MAGIC)
        free = _compressors()
        self._compressor = free.pop() if free else zstandard.ZstdCompressor(level=ZSTD_LEVEL, write_checksum=True)
        self._z = self._compressor.stream_writer(self._file, closefd=False)
        self._names: dict[str, int] = {}
        self.totals = StepTotals()
        self._buf = bytearray()
        self._emit(_H + _varint(step) + _varint(bits))

    def _emit(self, b: bytes):
        self._buf += b
        if len(self._buf) > 1 << 16:
            self._z.write(bytes(self._buf))
            self._buf.clear()

    def op(self, name: str, scalars, outputs, rounded_values: int):
        nid = self._names.get(name)
        if nid is None:
            nid = self._names[name] = len(self._names)
            raw = name.encode()
            self._emit(_N + _varint(nid) + _varint(len(raw)) + raw)
        parts = [_op_head(nid, scalars), _varint(len(outputs))]
        for o in outputs:
            parts.append(_shape_bytes(o.shape))
            if not len(o.dir_pos) and not len(o.val_pos):  # most outputs: what the general case encodes
                parts.append(_NO_ENTRIES)
                continue
            g = encode_positions(o.dir_pos)
            parts += [_varint(len(o.dir_pos)), _varint(len(g)), g,
                      np.packbits(np.asarray(o.dir_bits, bool), bitorder="little").tobytes()]
            g = encode_positions(o.val_pos)
            parts += [_varint(len(o.val_pos)), _varint(len(g)), g,
                      np.asarray(o.val_bits, dtype="<u4").tobytes()]
            self.totals.n_dir += len(o.dir_pos)
            self.totals.n_val += len(o.val_pos)
        self.totals.n_scalar += len(scalars)
        self.totals.n_ops += 1
        self.totals.rounded_values += rounded_values
        self._emit(b"".join(parts))

    def quiet_ops(self, run: QuietRun):
        """``op`` for each of ``run``'s records, as one byte string where every name already has its id (a
        NAME record goes right before its name's first OP record, so a new name takes the general path)."""
        ids = self._names
        nids = tuple(ids.get(name, -1) for name in run.names)
        if -1 in nids:
            for name, scalars, shapes, rounded in run.records:
                self.op(name, scalars, [OutputEntries(shape) for shape in shapes], rounded)
            return
        self._emit(run.encoded(nids))
        self.totals.n_scalar += run.n_scalar
        self.totals.n_ops += len(run.records)
        self.totals.rounded_values += run.rounded

    def close(self) -> dict:
        t = self.totals
        self._emit(_E + _varint(t.n_ops) + _varint(t.rounded_values) + _varint(t.n_dir) + _varint(t.n_val)
                   + _varint(t.n_scalar))
        self._z.write(bytes(self._buf))
        self._buf.clear()
        self._z.close()  # ends the frame (a flush before it would append a second, empty frame)
        free = _compressors()
        if len(free) < 4:  # its frame ended: the next log of this thread starts a new one (a few kept, not all)
            free.append(self._compressor)
        if self.pending is None:
            self._file.flush()
            os.fsync(self._file.fileno())
        self._file.close()
        os.replace(self.tmp, self.path)
        if self.pending is None:
            fsync_dir(os.path.dirname(os.path.abspath(self.path)))
        else:
            self.pending.append(self.path)
        with open(self.path, "rb") as f:
            data = f.read()
        return {"sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data)}

    def abort(self):
        try:
            self._file.close()
        finally:
            if os.path.exists(self.tmp):
                os.remove(self.tmp)


# --- reader ---------------------------------------------------------------------------------------


class StepLogReader:
    """Reads one step's records in order, without loading the whole file.

    ``path_or_bytes`` is a path (opened as hostile input: a regular file, no symlink, at most
    MAX_LOG_BYTES), the log's bytes, or a binary file object (e.g. store.open_run_file's), which
    ``close()`` closes. Compressed input is fed to zstd a small chunk at a time, and refused once it inflates
    more than MAX_INFLATION times beyond INFLATION_SLACK, so memory stays a bounded multiple of the bytes
    read; every declared size is checked before anything is read or allocated, and every position
    against its output. Every malformed input is a LogFormatError naming the problem.
    """

    CHUNK = 128  # compressed bytes per feed: bounds what one zstd call can inflate (a few MB)

    def __init__(self, path_or_bytes, expect_step: int | None = None, expect_bits: int | None = None,
                 source: str | None = None):
        """``source``: the name errors give the log (default: its path, else "<bytes>" or the stream's path)."""
        if isinstance(path_or_bytes, str):
            self.source = path_or_bytes
            try:
                self._file = open_regular_file(path_or_bytes, MAX_LOG_BYTES, "rounding log")
            except RunFileError as e:
                raise LogFormatError(f"cannot open rounding log {e}") from None
        elif isinstance(path_or_bytes, (bytes, bytearray, memoryview)):
            self.source = "<bytes>"
            self._file = io.BytesIO(path_or_bytes)
        else:
            self.source = getattr(path_or_bytes, "path", "<stream>")
            self._file = path_or_bytes
        self.source = source or self.source
        self._in = self._out = 0
        magic = self._file.read(len(MAGIC))
        self._in += len(magic)
        if magic != MAGIC:
            if isinstance(path_or_bytes, (str, bytes, bytearray, memoryview)):  # what the reader opened
                self._file.close()
            raise LogFormatError(f"{self.source}: not a veritrain rounding log (bad magic)")
        self._z = zstandard.ZstdDecompressor(max_window_size=MAX_WINDOW).decompressobj()
        self._buf = bytearray()
        self._pos = 0
        self._names: list[str] = []
        self._ids: dict[str, int] = {}  # name -> its first id (a hostile log may repeat a name)
        self.totals = StepTotals()
        self.end: StepTotals | None = None
        self._unread: list[OpRecord] = []  # records given back (unread), returned again first
        self.index = 0
        self._numel_total = 0
        tag = self._read(1)
        if tag != _H:
            raise LogFormatError(f"{self.source}: missing header record")
        self.step, self.bits = self._varint(), self._varint()
        if expect_step is not None and self.step != expect_step:
            raise LogFormatError(f"{self.source}: log is for step {self.step}, expected step {expect_step}")
        if expect_bits is not None and self.bits != expect_bits:
            raise LogFormatError(f"{self.source}: log is for rounding amount b={self.bits}, expected {expect_bits}")

    def _feed(self) -> bool:
        """Decompress one more chunk; False at the end of the input."""
        if self._z.eof:
            return False
        if self._out > INFLATION_SLACK + MAX_INFLATION * self._in:  # checked when more is needed
            raise LogFormatError(f"{self.source}: decompresses to {self._out} bytes from {self._in}: more than "
                                 f"{MAX_INFLATION} times its size (a compression bomb, not a rounding log)")
        try:
            chunk = self._file.read(self.CHUNK)
        except RunFileError as e:
            raise LogFormatError(f"{self.source}: {e.problem}") from None
        if not chunk:
            raise LogFormatError(f"{self.source}: truncated (the compressed frame is incomplete)")
        self._in += len(chunk)
        if self._in > MAX_LOG_BYTES:
            raise LogFormatError(f"{self.source}: larger than {MAX_LOG_BYTES} bytes")
        try:
            out = self._z.decompress(chunk)
        except zstandard.ZstdError as e:
            raise LogFormatError(f"{self.source}: corrupt compressed data ({e})") from None
        self._out += len(out)
        if self._out > MAX_DECODED:
            raise LogFormatError(f"{self.source}: decompresses to more than {MAX_DECODED} bytes")
        if self._pos > 1 << 16:
            del self._buf[: self._pos]
            self._pos = 0
        self._buf += out
        return True

    def _read(self, n: int) -> bytes:
        while len(self._buf) - self._pos < n:
            if not self._feed():
                raise LogFormatError(f"{self.source}: truncated (ended inside a record)")
        out = bytes(memoryview(self._buf)[self._pos: self._pos + n])  # one copy, not two
        self._pos += n
        return out

    def _varint(self) -> int:
        buf, pos = self._buf, self._pos
        if pos < len(buf) and buf[pos] < 0x80:  # most varints are one byte, already decompressed
            self._pos = pos + 1
            return buf[pos]
        shift, value = 0, 0
        for _ in range(MAX_VARINT_BYTES):
            b = self._read(1)[0]
            value |= (b & 0x7F) << shift
            if not b & 0x80:
                return value
            shift += 7
        raise LogFormatError(f"{self.source}: varint longer than 63 bits")

    def next_op(self) -> OpRecord | None:
        """The next OP record, or None once END has been read."""
        if self._unread:
            return self._unread.pop()
        if self.end is not None:
            return None
        while True:
            tag = self._read(1)
            if tag == _N:
                nid, length = self._varint(), self._varint()
                if nid != len(self._names) or length > MAX_NAME:
                    raise LogFormatError(f"{self.source}: bad name table entry")
                try:
                    name = self._read(length).decode()
                except UnicodeDecodeError:
                    raise LogFormatError(f"{self.source}: op name is not UTF-8") from None
                self._ids.setdefault(name, nid)
                self._names.append(name)
            elif tag == _O:
                return self._op()
            elif tag == _E:
                self._end()
                return None
            else:
                raise LogFormatError(f"{self.source}: unknown record tag {tag!r}")

    def skip_quiet(self, run: QuietRun) -> bool:
        """Consume ``run``'s records if the log's next bytes are exactly their encoding (what an honest trainer
        writes for them; they then parse to those records), and say so; otherwise read nothing and return False
        (the caller reads record by record, which takes every other encoding and names every problem)."""
        if self._unread or self.end is not None:
            return False
        nids = tuple(self._ids.get(name, -1) for name in run.names)
        if -1 in nids:
            return False
        raw = run.encoded(nids)
        while len(self._buf) - self._pos < len(raw):
            if not self._feed():
                return False
        pos = self._pos
        if self._buf[pos: pos + len(raw)] != raw:
            return False
        self._pos = pos + len(raw)
        self.totals.n_scalar += run.n_scalar
        self.totals.n_ops += len(run.records)
        self._numel_total += run.numel
        self.index += len(run.records)
        return True

    def unread(self, records: list):
        """Give back ``records`` (the last ones ``next_op`` returned, in order): ``next_op`` returns them again."""
        self._unread.extend(reversed(records))

    def _op(self) -> OpRecord:
        nid = self._varint()
        if nid >= len(self._names):
            raise LogFormatError(f"{self.source}: op refers to unknown name id {nid}")
        n_scalar = self._varint()
        if n_scalar > MAX_SCALARS:
            raise LogFormatError(f"{self.source}: too many scalar entries")
        scalars = []
        for _ in range(n_scalar):
            pos = self._varint()
            bit = self._read(1)[0]
            if bit > 1:
                raise LogFormatError(f"{self.source}: scalar direction must be 0 or 1")
            if scalars and pos <= scalars[-1][0]:  # one entry per argument: a second one would go unchecked
                raise LogFormatError(f"{self.source}: scalar entries must name strictly increasing argument "
                                     f"positions ({pos} after {scalars[-1][0]})")
            scalars.append((pos, bool(bit)))
        n_out = self._varint()
        if n_out > MAX_OUTPUTS:
            raise LogFormatError(f"{self.source}: too many outputs in one op")
        outputs = []
        self._op_budget = MAX_OP_BYTES
        for _ in range(n_out):
            ndim = self._varint()
            if ndim > MAX_NDIM:
                raise LogFormatError(f"{self.source}: output has {ndim} dimensions")
            shape = tuple(self._varint() for _ in range(ndim))
            numel = 1
            for d in shape:
                numel *= d
                if d > MAX_NUMEL or numel > MAX_NUMEL:
                    raise LogFormatError(f"{self.source}: output shape {shape} is too large")
            dir_pos, dir_bits = self._positions(numel), _EMPTY_BITS
            if len(dir_pos):
                raw = self._read((len(dir_pos) + 7) // 8)
                if len(dir_pos) % 8 and raw[-1] >> (len(dir_pos) % 8):
                    raise LogFormatError(f"{self.source}: direction bits have padding bits set")
                dir_bits = np.unpackbits(np.frombuffer(raw, np.uint8), count=len(dir_pos), bitorder="little").view(bool)
            val_pos, val_bits = self._positions(numel), _EMPTY_VALUES
            if len(val_pos):
                val_bits = np.frombuffer(self._read(4 * len(val_pos)), dtype="<u4").astype(np.uint32)
            if len(dir_pos) and len(val_pos):
                k = np.minimum(np.searchsorted(val_pos, dir_pos), len(val_pos) - 1)
                if (val_pos[k] == dir_pos).any():
                    raise LogFormatError(f"{self.source}: a position has both a direction and a value entry")
            self.totals.n_dir += len(dir_pos)
            self.totals.n_val += len(val_pos)
            self._numel_total += numel
            outputs.append(OutputEntries(shape, dir_pos, dir_bits, val_pos, val_bits))
        self.totals.n_scalar += n_scalar
        self.totals.n_ops += 1
        self.index += 1
        return OpRecord(self._names[nid], scalars, outputs)

    def _positions(self, numel: int) -> np.ndarray:
        count, length = self._varint(), self._varint()
        if count > numel or length > MAX_VARINT_BYTES * count or length < count:
            raise LogFormatError(f"{self.source}: entry block does not fit its output")
        self._op_budget -= length + 4 * count  # checked before anything is read or allocated
        if self._op_budget < 0:
            raise LogFormatError(f"{self.source}: op record larger than {MAX_OP_BYTES} bytes")
        if not count:
            return _EMPTY_POSITIONS
        buf = self._read(length)
        try:
            return decode_positions(buf, count, numel)
        except LogFormatError as e:
            raise LogFormatError(f"{self.source}: {e}") from None

    def _end(self):
        t = StepTotals(*(self._varint() for _ in range(5)))
        if (t.n_ops, t.rounded_values, t.n_dir, t.n_val, t.n_scalar) != (
                self.totals.n_ops, self._numel_total, self.totals.n_dir, self.totals.n_val, self.totals.n_scalar):
            raise LogFormatError(f"{self.source}: END totals do not match the records")
        while self._feed():
            pass
        if len(self._buf) > self._pos:
            raise LogFormatError(f"{self.source}: data after the END record")
        if self._z.unused_data or self._file.read(1):
            raise LogFormatError(f"{self.source}: trailing bytes after the compressed frame")
        self.totals.rounded_values = t.rounded_values
        self.end = t

    def read_all(self) -> list[OpRecord]:
        ops = []
        while (op := self.next_op()) is not None:
            ops.append(op)
        return ops

    def close(self):
        self._file.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


_EMPTY_POSITIONS, _EMPTY_BITS, _EMPTY_VALUES = np.zeros(0, np.int64), np.zeros(0, bool), np.zeros(0, np.uint32)
for _a in (_EMPTY_POSITIONS, _EMPTY_BITS, _EMPTY_VALUES):  # shared by every output without entries
    _a.flags.writeable = False


def decode_positions(buf: bytes, count: int, numel: int) -> np.ndarray:
    """The ``count`` strictly increasing positions in [0, numel) that the gap block ``buf`` encodes
    (docs/FORMAT.md). Raises LogFormatError for anything else: a varint that does not end, a gap that
    leaves the output (checked per value, so sums never wrap), too many or too few values. Works a
    _DECODE_CHUNK of bytes at a time: besides the result it allocates a bounded amount."""
    if count <= _FEW:
        return _decode_few(buf, count, numel)
    a = np.frombuffer(buf, dtype=np.uint8)
    out = np.empty(count, np.int64)
    if a.size and a[-1] & 0x80:
        raise LogFormatError("position block ends inside a varint")
    done, i, last = 0, 0, -1
    longest = max(1, ((int(numel) - 1).bit_length() + 6) // 7)  # varint bytes of the largest gap that fits
    while i < a.size:
        block = a[i: i + _DECODE_CHUNK]
        ends = np.flatnonzero(block < 0x80)
        if not ends.size:
            raise LogFormatError("varint longer than 63 bits in position block")
        block = block[: ends[-1] + 1]
        starts = np.empty_like(ends)
        starts[0] = 0
        starts[1:] = ends[:-1] + 1
        lengths = ends - starts + 1
        if int(lengths.max()) > longest:
            raise LogFormatError("entry position outside its output")
        n = ends.size
        if done + n > count:
            raise LogFormatError(f"position block holds more than {count} varints")
        gaps = np.zeros(n, np.int64)
        for k in range(int(lengths.max())):
            m = lengths > k
            gaps[m] |= (block[starts[m] + k].astype(np.int64) & 0x7F) << (7 * k)
        if int(gaps.max()) >= numel:
            raise LogFormatError("entry position outside its output")
        pos = np.cumsum(gaps + 1) + last  # < numel + n * numel < 2^63: no wrap
        if int(pos[-1]) >= numel:
            raise LogFormatError("entry position outside its output")
        out[done: done + n] = pos
        done += n
        last = int(pos[-1])
        i += block.size
    if done != count:
        raise LogFormatError(f"position block holds {done} varints, expected {count}")
    return out


def _decode_few(buf: bytes, count: int, numel: int) -> np.ndarray:
    """decode_positions for a few positions, byte by byte in Python, with the same checks."""
    if buf and buf[-1] & 0x80:
        raise LogFormatError("position block ends inside a varint")
    longest = max(1, ((int(numel) - 1).bit_length() + 6) // 7)
    out, last, gap, shift, length = [], -1, 0, 0, 0
    for b in buf:
        length += 1
        if length > longest:
            raise LogFormatError("entry position outside its output")
        gap |= (b & 0x7F) << shift
        shift += 7
        if b < 0x80:
            if len(out) == count:
                raise LogFormatError(f"position block holds more than {count} varints")
            last += gap + 1
            if gap >= numel or last >= numel:
                raise LogFormatError("entry position outside its output")
            out.append(last)
            gap, shift, length = 0, 0, 0
    if len(out) != count:
        raise LogFormatError(f"position block holds {len(out)} varints, expected {count}")
    return np.array(out, dtype=np.int64)


def dense_encoding_bytes(rounded_values: int) -> float:
    """The paper's dense log: one of three states per rounded value, 5 values per byte (1.6 bits)."""
    return rounded_values * 1.6 / 8


def write_records(path: str, step: int, bits: int, ops: list[OpRecord]) -> dict:
    """Write a step log from records (tools and tests: e.g. to build a tampered log)."""
    w = StepLogWriter(path, step, bits)
    try:
        for op in ops:
            rounded = sum(int(np.prod(o.shape)) for o in op.outputs)
            w.op(op.name, op.scalars, op.outputs, rounded)
        return w.close()
    except BaseException:
        w.abort()
        raise


def read_records(path: str) -> tuple[int, int, list[OpRecord]]:
    with StepLogReader(path) as r:
        return r.step, r.bits, r.read_all()
