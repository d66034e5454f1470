"""CIFAR-10 from its standard python-pickle archive (``cifar-10-python.tar.gz`` or the extracted folder), and
scikit-learn's digits dressed as CIFAR (3x32x32) for machines without CIFAR-10.

The archive's batches are Python pickles; they are read with an unpickler that only admits the few
NumPy and builtin types the real files use, so a hostile archive cannot run code.
"""

from __future__ import annotations

import io
import os
import pickle
import tarfile

import numpy as np

from veritrain.task import TaskError

TRAIN_BATCHES = [f"data_batch_{i}" for i in range(1, 6)]
TEST_BATCH = "test_batch"
FOLDER = "cifar-10-batches-py"
MEAN = np.array([0.4914, 0.4822, 0.4465], dtype=np.float32)
STD = np.array([0.2470, 0.2435, 0.2616], dtype=np.float32)

_ALLOWED = {("numpy.core.multiarray", "_reconstruct"), ("numpy._core.multiarray", "_reconstruct"),
            ("numpy", "ndarray"), ("numpy", "dtype"), ("numpy.core.multiarray", "scalar"),
            ("numpy._core.multiarray", "scalar"), ("builtins", "bytes"), ("_codecs", "encode")}


class _SafeUnpickler(pickle.Unpickler):
    def find_class(self, module, name):
        if (module, name) not in _ALLOWED:
            raise pickle.UnpicklingError(f"refusing to load {module}.{name} from a CIFAR batch")
        return super().find_class(module, name)


def _read_batch(raw: bytes, name: str, source: str):
    try:
        d = _SafeUnpickler(io.BytesIO(raw), encoding="bytes").load()
        data = np.asarray(d[b"data"], dtype=np.uint8)
        labels = np.asarray(d[b"labels"], dtype=np.int64)
    except Exception as e:  # noqa: BLE001 - any malformed batch: name it
        raise TaskError(f"config 'data': {source}: {name} is not a CIFAR-10 batch ({type(e).__name__}: {e})") from None
    if data.ndim != 2 or data.shape[1] != 3072 or len(labels) != len(data):
        raise TaskError(f"config 'data': {source}: {name} holds data of shape {data.shape}, expected (N, 3072)")
    if len(labels) and (labels.min() < 0 or labels.max() > 9):
        raise TaskError(f"config 'data': {source}: {name} has labels outside 0..9")
    return data.reshape(-1, 3, 32, 32), labels


def load_cifar10(path: str):
    """(train images uint8 Nx3x32x32, train labels, test images, test labels)."""
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
            with open(p, "rb") as f:
                blobs[name] = f.read()
    else:
        try:
            with tarfile.open(path, "r:*") as tar:
                members = {os.path.basename(m.name): m for m in tar.getmembers() if m.isfile()}
                for name in TRAIN_BATCHES + [TEST_BATCH]:
                    if name not in members:
                        raise TaskError(f"config 'data': {path!r} has no {name} (not cifar-10-python.tar.gz)")
                    blobs[name] = tar.extractfile(members[name]).read()
        except (tarfile.TarError, OSError, EOFError) as e:
            raise TaskError(f"config 'data': {path!r} is not a readable tar archive ({e})") from None
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
