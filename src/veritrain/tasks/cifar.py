"""CIFAR-10 from its standard python-pickle archive (``cifar-10-python.tar.gz`` or the extracted folder), and
scikit-learn's digits dressed as CIFAR (3x32x32) for machines without CIFAR-10.

The archive's batches are Python pickles; they are read with an unpickler that only admits the few
NumPy and builtin types the real files use, so a hostile archive cannot run code, and that lets no call
allocate more than the batch's own bytes. A run's config names the path, so every file is hostile input:
opened without blocking, only as a regular file, within size caps (the archive, each batch, the archive's
unpacked bytes and members), decompressed here with the unpacked bytes counted.
"""

from __future__ import annotations

import bz2
import gzip
import io
import lzma
import math
import os
import pickle
import stat
import tarfile
import zlib

import numpy as np

from veritrain.commitments import data_hash
from veritrain.task import TaskError

TRAIN_BATCHES = [f"data_batch_{i}" for i in range(1, 6)]
TEST_BATCH = "test_batch"
FOLDER = "cifar-10-batches-py"
MEAN = np.array([0.4914, 0.4822, 0.4465], dtype=np.float32)
STD = np.array([0.2470, 0.2435, 0.2616], dtype=np.float32)

# caps on what a run's config can make the auditor read: the real archive is 170 MB (186 MB unpacked, 8 members),
# each batch 31 MB
MAX_ARCHIVE_BYTES = 1 << 30
MAX_BATCH_BYTES = 1 << 26
MAX_UNPACKED_BYTES = 1 << 29
MAX_MEMBERS = 1024

_ALLOWED = {("numpy.core.multiarray", "_reconstruct"), ("numpy._core.multiarray", "_reconstruct"),
            ("numpy", "ndarray"), ("numpy", "dtype"), ("numpy.core.multiarray", "scalar"),
            ("numpy._core.multiarray", "scalar"), ("builtins", "bytes"), ("_codecs", "encode")}


def _empty_bytes(*args):
    # the real files (and Python's protocol 2) call bytes() only for b"": bytes(n) would allocate n bytes
    if args:
        raise pickle.UnpicklingError("refusing bytes() with arguments in a CIFAR batch (bytes(n) allocates n bytes)")
    return b""


def _latin1(text, encoding="utf-8"):
    # Python's protocol 2 writes a bytes object as _codecs.encode(text, 'latin1'): as many bytes as characters
    if not isinstance(text, str) or encoding not in ("latin1", "latin-1"):
        raise pickle.UnpicklingError(f"refusing _codecs.encode with encoding {str(encoding)[:20]!r} in a CIFAR batch")
    return text.encode("latin1")


class _SafeUnpickler(pickle.Unpickler):
    def __init__(self, raw: bytes):
        super().__init__(io.BytesIO(raw), encoding="bytes")
        self.budget = len(raw)  # no array may hold more bytes than the batch file has

    def _reconstruct(self, subtype, shape, dtype):
        # NumPy's pickles make an empty array here and fill it from their bytes (ndarray.__setstate__ checks
        # that their length is the shape's); a shape of their own would allocate it unread
        try:
            n = math.prod(shape) * np.dtype(dtype).itemsize
        except Exception:  # noqa: BLE001 - not a shape or a dtype
            n = None
        if subtype is not np.ndarray or not isinstance(shape, tuple) or n is None or not 0 <= n <= self.budget:
            raise pickle.UnpicklingError(f"refusing an array of shape {str(shape)[:60]} in a CIFAR batch "
                                         f"(more than its {self.budget} bytes)")
        return np.ndarray(shape, dtype)

    def find_class(self, module, name):
        if (module, name) not in _ALLOWED:
            raise pickle.UnpicklingError(f"refusing to load {module}.{name} from a CIFAR batch")
        if name == "_reconstruct":
            return self._reconstruct
        if (module, name) == ("builtins", "bytes"):
            return _empty_bytes
        if (module, name) == ("_codecs", "encode"):
            return _latin1
        return super().find_class(module, name)


def _labels(labels):
    """The labels of a batch as int64, without building anything larger than the pickle: a flat list of ints
    (the real files) or a 1-d integer array (a list of lists, each a reference to one long list, would make
    np.asarray allocate their product)."""
    if isinstance(labels, np.ndarray) and labels.ndim == 1 and labels.dtype.kind in "iu":
        return labels.astype(np.int64)
    if isinstance(labels, list) and all(type(v) is int for v in labels):
        return np.asarray(labels, dtype=np.int64)
    raise ValueError("labels are not a list of integers")


def _read_batch(raw: bytes, name: str, source: str):
    try:
        d = _SafeUnpickler(raw).load()
        if not isinstance(d, dict):
            raise ValueError(f"a {type(d).__name__}, not a dict")
        data = d[b"data"]
        # the real files hold a uint8 array; a list (of references to one row) would be built at 3072 bytes a row
        if not isinstance(data, np.ndarray) or data.dtype != np.uint8:
            raise ValueError(f"its data is a {type(data).__name__}"
                             f"{' of ' + str(data.dtype) if isinstance(data, np.ndarray) else ''}, not a uint8 array")
        labels = _labels(d[b"labels"])
    except Exception as e:  # noqa: BLE001 - any malformed batch: name it
        raise TaskError(f"config 'data': {source}: {name} is not a CIFAR-10 batch ({type(e).__name__}: "
                        f"{str(e)[:300]})") from None
    if data.ndim != 2 or data.shape[1] != 3072 or len(labels) != len(data):
        raise TaskError(f"config 'data': {source}: {name} holds data of shape {data.shape}, expected (N, 3072)")
    if len(labels) and (labels.min() < 0 or labels.max() > 9):
        raise TaskError(f"config 'data': {source}: {name} has labels outside 0..9")
    return data.reshape(-1, 3, 32, 32), labels


def _open_regular(path: str, cap: int, what: str):
    """``path`` opened for reading as hostile input: without blocking (a FIFO), a regular file (not a device
    such as /dev/zero), of at most ``cap`` bytes."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    f = open(fd, "rb")
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise TaskError(f"config 'data': {what} {path!r} is not a regular file")
        if st.st_size > cap:
            raise TaskError(f"config 'data': {what} {path!r} has {st.st_size} bytes, more than {cap}")
        os.set_blocking(fd, True)
    except BaseException:
        f.close()
        raise
    return f


class _Unpacked(io.RawIOBase):
    """A decompressed stream that stops with a TaskError past ``cap`` bytes (a compressed bomb, or a header
    claiming more data than any CIFAR archive has, which tarfile would read or skip through)."""

    def __init__(self, f, cap: int, path: str):
        self.f, self.cap, self.path, self.total = f, cap, path, 0

    def readable(self):
        return True

    def readinto(self, b):
        n = self.f.readinto(b)
        self.total += n or 0
        if self.total > self.cap:
            raise TaskError(f"config 'data': {self.path!r} unpacks to more than {self.cap} bytes (not "
                            f"cifar-10-python.tar.gz)")
        return n


def _decompressed(f):
    head = f.read(6)
    f.seek(0)
    if head[:2] == b"\x1f\x8b":
        return gzip.GzipFile(fileobj=f, mode="rb")
    if head[:3] == b"BZh":
        return bz2.BZ2File(f, "rb")
    if head == b"\xfd7zXZ\x00":
        return lzma.LZMAFile(f, "rb")
    return f


def _read_archive(path: str) -> dict:
    """The batches' bytes from a (compressed) tar archive, read as a stream within the caps."""
    blobs, wanted = {}, set(TRAIN_BATCHES + [TEST_BATCH])
    try:
        with _open_regular(path, MAX_ARCHIVE_BYTES, "archive") as f, \
                tarfile.open(fileobj=_Unpacked(_decompressed(f), MAX_UNPACKED_BYTES, path), mode="r|") as tar:
            for count, m in enumerate(tar, 1):
                if count > MAX_MEMBERS:
                    raise TaskError(f"config 'data': {path!r} has more than {MAX_MEMBERS} members (not "
                                    f"cifar-10-python.tar.gz)")
                name = os.path.basename(m.name)
                if not m.isfile() or name not in wanted:
                    continue
                if name in blobs:
                    raise TaskError(f"config 'data': {path!r} holds {name} twice")
                if m.size > MAX_BATCH_BYTES:
                    raise TaskError(f"config 'data': {path!r}: its {name} has {m.size} bytes, more than "
                                    f"{MAX_BATCH_BYTES} (a CIFAR-10 batch has 31 MB)")
                blobs[name] = tar.extractfile(m).read()
    except FileNotFoundError:
        raise TaskError(f"config 'data': {path!r} does not exist") from None
    except (tarfile.TarError, OSError, EOFError, zlib.error, lzma.LZMAError) as e:
        raise TaskError(f"config 'data': {path!r} is not a readable tar archive ({e})") from None
    for name in TRAIN_BATCHES + [TEST_BATCH]:
        if name not in blobs:
            raise TaskError(f"config 'data': {path!r} has no {name} (not cifar-10-python.tar.gz)")
    return blobs


def load_cifar10(path: str, digests: dict | None = None):
    """(train images uint8 Nx3x32x32, train labels, test images, test labels); ``digests["data"]``, where
    given, the data hash of the six batch files (the same for the archive and its extracted folder)."""
    path = os.path.expanduser(str(path))
    if not os.path.exists(path):
        raise TaskError(f"config 'data': {path!r} does not exist (give cifar-10-python.tar.gz, its extracted "
                        f"folder, or 'digits')")
    blobs = {}
    if os.path.isdir(path):
        folder = os.path.join(path, FOLDER) if os.path.isdir(os.path.join(path, FOLDER)) else path
        for name in TRAIN_BATCHES + [TEST_BATCH]:
            p = os.path.join(folder, name)
            if not os.path.exists(p):
                raise TaskError(f"config 'data': {folder!r} has no {name} (not an extracted CIFAR-10 archive)")
            try:
                with _open_regular(p, MAX_BATCH_BYTES, "batch") as f:
                    blobs[name] = f.read(MAX_BATCH_BYTES + 1)
            except OSError as e:
                raise TaskError(f"config 'data': cannot read {p!r}: {e}") from None
            if len(blobs[name]) > MAX_BATCH_BYTES:  # it grew after it was opened
                raise TaskError(f"config 'data': batch {p!r} has more than {MAX_BATCH_BYTES} bytes")
    else:
        blobs = _read_archive(path)
    if digests is not None:
        digests["data"] = data_hash([(n, blobs[n]) for n in TRAIN_BATCHES + [TEST_BATCH]])
    train = [_read_batch(blobs[n], n, path) for n in TRAIN_BATCHES]
    x_test, y_test = _read_batch(blobs[TEST_BATCH], TEST_BATCH, path)
    return (np.concatenate([x for x, _ in train]), np.concatenate([y for _, y in train]), x_test, y_test)


def digits_as_cifar(held_out: int = 297):
    """scikit-learn's digits (8x8, 0..16) as uint8 3x32x32 images: each pixel a 4x4 block, grey in RGB."""
    from sklearn.datasets import load_digits

    d = load_digits()
    img = np.clip(d.images * 16, 0, 255).astype(np.uint8)
    img = np.kron(img, np.ones((4, 4), dtype=np.uint8))[:, None].repeat(3, axis=1)
    y = d.target.astype(np.int64)
    n = len(img) - held_out
    return img[:n], y[:n], img[n:], y[n:]


def normalize(images_uint8: np.ndarray) -> np.ndarray:
    """float32 NCHW, per-channel standardised with CIFAR-10's mean and std (exact NumPy float32 ops)."""
    x = images_uint8.astype(np.float32) / np.float32(255)
    return (x - MEAN[None, :, None, None]) / STD[None, :, None, None]
