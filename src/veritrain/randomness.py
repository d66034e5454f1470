"""Randomness that is the same on every machine.

Every random draw comes from a counter-based generator (Philox-4x64-10, through NumPy's ``Philox``
bit generator, whose raw stream NumPy keeps stable across versions and platforms) keyed by
``(run seed, step, op index, domain)``. Raw 64-bit integers are turned into samples with exact integer
and power-of-two arithmetic, so bits do not depend on the CPU, the GPU or a library's sampling code.
Samples that need a transcendental function (normal, exponential, ...) are computed in float64 and
returned with an error scale; the engine rounds and logs them like any other operator.

Nothing here touches torch's per-device generators.
"""

from __future__ import annotations

import hashlib
import math
import struct

import numpy as np
import torch

_TWO_M53 = 2.0**-53
_TWO_M32 = 2.0**-32


def philox_key(seed: int, step: int, index: int, domain: str) -> np.ndarray:
    # a run's config names seeds (a task's data_seed): out of range, struct.pack raised struct.error, which no
    # caller takes for a bad input; a ValueError names the field (a step that fails rejects the run)
    for name, v in (("seed", seed), ("step", step), ("index", index)):
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or not -2**63 <= v < 2**63:
            raise ValueError(f"random stream {domain!r}: {name} {str(v)[:40]} is not an integer in "
                             f"-2**63..2**63-1 (a 64-bit key)")
    digest = hashlib.sha256(b"veritrain/philox/v1\0" + domain.encode() + b"\0"
                            + struct.pack("<qqq", seed, step, index)).digest()
    return np.frombuffer(digest[:16], dtype="<u8").astype(np.uint64)


class Stream:
    """The raw 64-bit integers for one key, in order."""

    def __init__(self, seed: int, step: int, index: int, domain: str = "op"):
        self.key = (seed, step, index, domain)
        self._bg = np.random.Philox(key=philox_key(seed, step, index, domain))

    def raw(self, n: int) -> np.ndarray:
        if n == 0:
            return np.zeros(0, dtype=np.uint64)
        return self._bg.random_raw(n).astype(np.uint64, copy=False)

    def raw32(self, n: int) -> np.ndarray:
        """n uniform 32-bit integers (two per raw draw, low half first)."""
        r = self.raw((n + 1) // 2)
        return r.view(np.uint32)[:n] if r.dtype.byteorder in ("=", "<") and np.little_endian else \
            np.stack([r & 0xFFFFFFFF, r >> 32], axis=1).reshape(-1)[:n].astype(np.uint32)

    def uniform53(self, n: int) -> np.ndarray:
        """float64 in [0, 1): multiples of 2**-53, exact."""
        return (self.raw(n) >> np.uint64(11)).astype(np.float64) * _TWO_M53

    def uniform_bits(self, n: int, bits: int) -> np.ndarray:
        """float64 in [0, 1): multiples of 2**-bits (bits <= 53), exact."""
        return (self.raw(n) >> np.uint64(64 - bits)).astype(np.float64) * 2.0**-bits

    def integers(self, n: int, low: int, high: int) -> np.ndarray:
        """Integers in [low, high); the modulo bias is at most (high - low) / 2**64."""
        if high <= low:
            raise ValueError(f"random integers: empty range [{low}, {high})")
        span = high - low
        r = self.raw(n)
        if span <= 2**63:
            return (r % np.uint64(span)).astype(np.int64) + low
        return np.array([low + int(v) % span for v in r], dtype=object)


def _to_torch(a: np.ndarray, shape, dtype, device) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(a)).reshape(shape).to(device=device, dtype=dtype)


# --- samples ------------------------------------------------------------------------------------
# Each returns float64 (or integer/bool) torch tensors on ``device``; ``scale`` (when not None) is the
# error scale of a float64 result computed with library functions. Everything is computed on the CPU
# and then moved, so the bits are the same whatever the device (a GPU's log and cos differ from the
# CPU's in the last bits).


def bernoulli_mask(stream: Stream, shape, p, device) -> torch.Tensor:
    """True with probability p: u < p for a 32-bit uniform u (probability ceil(p 2^32) / 2^32)."""
    n = math.prod(shape)
    u = torch.from_numpy(stream.raw32(n).astype(np.float64) * _TWO_M32).reshape(shape).to(device)
    if isinstance(p, torch.Tensor):
        p = p.to(device=device, dtype=torch.float64)
    return u < p


def uniform(stream: Stream, shape, device, bits: int = 53) -> torch.Tensor:
    return _to_torch(stream.uniform_bits(math.prod(shape), bits), shape, torch.float64, device)


def normal(stream: Stream, shape, device):
    """Box-Muller: z = sqrt(-2 ln u1) cos(2 pi u2); returns (z, scale)."""
    n = math.prod(shape)
    r = stream.raw(2 * n)
    u1 = 1.0 - (r[0::2] >> np.uint64(11)).astype(np.float64) * _TWO_M53  # in (0, 1]
    u2 = (r[1::2] >> np.uint64(11)).astype(np.float64) * _TWO_M53
    u1 = torch.from_numpy(u1).reshape(shape)
    u2 = torch.from_numpy(u2).reshape(shape)
    radius = torch.sqrt(-2.0 * torch.log(u1))
    z = radius * torch.cos((2.0 * math.pi) * u2)
    # log, sqrt, the product 2*pi*u2 and cos each add a few u of the radius
    return z.to(device), (8.0 * radius).to(device)


def exponential(stream: Stream, shape, device, lambd: float):
    u = uniform(stream, shape, "cpu")
    y = -torch.log1p(-u) / lambd
    return y.to(device), (4.0 * y.abs()).to(device)


def randperm(stream: Stream, n: int, device) -> torch.Tensor:
    keys = stream.raw(n)
    return torch.from_numpy(np.argsort(keys, kind="stable").astype(np.int64)).to(device)


def multinomial(stream: Stream, probs: torch.Tensor, num_samples: int, replacement: bool) -> torch.Tensor:
    """Categorical draws by exact integer arithmetic.

    Each row's weights (non-negative floats) are scaled by one power of two and truncated to integers
    below 2**52 / n, so the cumulative sums are exact int64 and the search is exact. Weights smaller
    than 2**-52 / n of the row's largest are treated as zero (documented in docs/RANDOMNESS.md).
    """
    p = probs.detach().to("cpu", torch.float64)
    squeeze = p.dim() == 1
    if squeeze:
        p = p.unsqueeze(0)
    if bool((p < 0).any()) or not bool(torch.isfinite(p).all()):
        raise ValueError("multinomial: probabilities must be finite and non-negative")
    rows, n = p.shape
    if not replacement and num_samples > n:
        raise ValueError("multinomial: cannot draw more samples than categories without replacement")
    out = np.zeros((rows, num_samples), dtype=np.int64)
    budget = 52 - max(1, math.ceil(math.log2(max(n, 2))))
    raw = stream.raw(rows * num_samples).reshape(rows, num_samples)
    for i in range(rows):
        w = p[i].numpy()
        top = w.max()
        if top <= 0:
            raise ValueError("multinomial: a row of probabilities sums to zero")
        _, e = math.frexp(top)  # top < 2**e
        ints = np.floor(np.ldexp(w, budget - e)).astype(np.int64)
        for j in range(num_samples):
            total = int(ints.sum())
            if total == 0:
                raise ValueError("multinomial: not enough non-zero probabilities to sample from")
            target = int(raw[i, j]) % total
            k = int(np.searchsorted(np.cumsum(ints), target, side="right"))
            out[i, j] = k
            if not replacement:
                ints[k] = 0
    res = torch.from_numpy(out)
    return (res[0] if squeeze else res).to(probs.device)


# --- data order (outside the engine: batches, shuffles, augmentation) ---------------------------


def permutation(seed: int, epoch: int, n: int, domain: str = "data/permutation") -> np.ndarray:
    """A permutation of range(n) that is the same on every machine."""
    keys = Stream(seed, epoch, 0, domain).raw(n)
    return np.argsort(keys, kind="stable").astype(np.int64)


def integers(seed: int, step: int, n: int, low: int, high: int, domain: str = "data/integers") -> np.ndarray:
    return Stream(seed, step, 0, domain).integers(n, low, high)


MAX_BATCH = 1 << 20  # examples in one batch


def epoch_order(seed: int, step: int, batch_size: int, n_examples: int, domain: str = "data/order") -> np.ndarray:
    """Indices of the examples for ``step``: epochs of a fresh permutation each, batches in order."""
    if batch_size <= 0 or n_examples <= 0:
        raise ValueError("epoch_order: batch size and dataset size must be positive")
    if batch_size > MAX_BATCH:  # a run's config names it: its list of indices would fill memory
        raise ValueError(f"epoch_order: batch size {batch_size} is more than {MAX_BATCH}")
    start = step * batch_size
    out = []
    while len(out) < batch_size:
        epoch, offset = divmod(start + len(out), n_examples)
        perm = permutation(seed, epoch, n_examples, domain)
        take = min(batch_size - len(out), n_examples - offset)
        out.extend(perm[offset:offset + take].tolist())
    return np.asarray(out, dtype=np.int64)
