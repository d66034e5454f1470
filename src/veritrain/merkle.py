"""RFC 6962 / RFC 9162 Merkle tree hash, subtree nodes and inclusion proofs.

    leaf hash   = SHA-256(0x00 || data)
    node hash   = SHA-256(0x01 || left || right)
    MTH([])     = SHA-256("")
    MTH(D[n])   = node(MTH(D[0:k]), MTH(D[k:n])), k the largest power of two < n (no duplicated leaf)

A subtree is named by its leaf range [lo, hi); the children of [lo, hi) are [lo, lo+k) and [lo+k, hi).
The verification game walks these ranges, so a node query is answered by the range alone.
"""

from __future__ import annotations

import hashlib

EMPTY_ROOT = hashlib.sha256(b"").digest()


class MerkleError(ValueError):
    """A malformed query or proof (not a failed verification, which returns False)."""


def leaf_hash(data: bytes) -> bytes:
    return hashlib.sha256(b"\x00" + data).digest()


def node_hash(left: bytes, right: bytes) -> bytes:
    return hashlib.sha256(b"\x01" + left + right).digest()


def split_point(n: int) -> int:
    """The largest power of two strictly smaller than n (n >= 2)."""
    return 1 << ((n - 1).bit_length() - 1)


def children(lo: int, hi: int) -> tuple[tuple[int, int], tuple[int, int]]:
    if hi - lo < 2:
        raise MerkleError(f"range [{lo}, {hi}) is a leaf, it has no children")
    mid = lo + split_point(hi - lo)
    return (lo, mid), (mid, hi)


class MerkleTree:
    """A tree over leaf hashes, with every subtree hash memoized."""

    def __init__(self, leaf_hashes: list[bytes]):
        for h in leaf_hashes:
            if not isinstance(h, (bytes, bytearray)) or len(h) != 32:
                raise MerkleError("leaf hashes must be 32-byte digests")
        self.leaves = [bytes(h) for h in leaf_hashes]
        self._memo: dict[tuple[int, int], bytes] = {}

    @classmethod
    def from_data(cls, items: list[bytes]) -> "MerkleTree":
        return cls([leaf_hash(d) for d in items])

    @property
    def size(self) -> int:
        return len(self.leaves)

    def node(self, lo: int, hi: int) -> bytes:
        """MTH of leaves [lo, hi)."""
        if not (0 <= lo < hi <= self.size):
            if lo == hi == 0 and self.size == 0:
                return EMPTY_ROOT
            raise MerkleError(f"range [{lo}, {hi}) is not a subtree of a tree of {self.size} leaves")
        if hi - lo == 1:
            return self.leaves[lo]
        key = (lo, hi)
        if key not in self._memo:
            (a, b), (c, d) = children(lo, hi)
            self._memo[key] = node_hash(self.node(a, b), self.node(c, d))
        return self._memo[key]

    def root(self) -> bytes:
        return self.node(0, self.size) if self.size else EMPTY_ROOT

    def inclusion_proof(self, index: int) -> list[bytes]:
        """PATH(index, D[n]) of RFC 6962 section 2.1.1: sibling hashes, leaf level first."""
        if not 0 <= index < self.size:
            raise MerkleError(f"leaf {index} is outside a tree of {self.size} leaves")
        path, lo, hi = [], 0, self.size
        while hi - lo > 1:
            (a, b), (c, d) = children(lo, hi)
            if index < b:
                path.append(self.node(c, d))
                lo, hi = a, b
            else:
                path.append(self.node(a, b))
                lo, hi = c, d
        return path[::-1]


def verify_inclusion(leaf: bytes, index: int, size: int, proof: list[bytes], root: bytes) -> bool:
    """RFC 9162 section 2.1.3.2: does ``proof`` show leaf hash ``leaf`` at ``index`` in a tree of ``size``
    leaves with root ``root``?"""
    if not 0 <= index < size:
        return False
    if any(not isinstance(p, (bytes, bytearray)) or len(p) != 32 for p in proof):
        return False
    fn, sn, r = index, size - 1, leaf
    for p in proof:
        if sn == 0:
            return False
        if fn & 1 or fn == sn:
            r = node_hash(p, r)
            if not fn & 1:
                while fn and not fn & 1:
                    fn >>= 1
                    sn >>= 1
        else:
            r = node_hash(r, p)
        fn >>= 1
        sn >>= 1
    return sn == 0 and r == root
