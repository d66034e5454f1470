"""The RFC 6962 Merkle tree: published test vectors, and inclusion proofs for every leaf of trees 1..70."""

import hashlib
import os

import pytest
from hypothesis import given, strategies as st

from veritrain.merkle import EMPTY_ROOT, MerkleError, MerkleTree, leaf_hash, node_hash, verify_inclusion

# RFC 6962 test vectors (certificate-transparency's merkle tree tests): leaf inputs and MTH of the first n
LEAVES = [bytes.fromhex(h) for h in ["", "00", "10", "2021", "3031", "40414243", "5051525354555657",
                                      "606162636465666768696a6b6c6d6e6f"]]
ROOTS = ["6e340b9cffb37a989ca544e6bb780a2c78901d3fb33738768511a30617afa01d",
         "fac54203e7cc696cf0dfcb42c92a1d9dbaf70ad9e621f4bd8d98662f00e3c125",
         "aeb6bcfe274b70a14fb067a5e5578264db0fa9b51af5e0ba159158f329e06e77",
         "d37ee418976dd95753c1c73862b9398fa2a2cf9b4ff0fdfe8b30cd95209614b7",
         "4e3bbb1f7b478dcfe71fb631631519a3bca12c9aefca1612bfce4c13a86264d4",
         "76e67dadbcdf1e10e1b74ddc608abd2f98dfb16fbce75277b5232a127f2087ef",
         "ddb89be403809e325750d3d263cd78929c2942b7942a34b77e122c9594a74c8c",
         "5dc9da79a70659a9ad559cb701ded9a2ab9d823aad2f4960cfe370eff4604328"]
# PATH(5, D[8]) from the same vectors
PROOF_5_OF_8 = ["bc1a0643b12e4d2d7c77918f44e0f4f79a838b6cf9ec5b5c283e1f4d88599e6b",
                "ca854ea128ed050b41b35ffc1b87b8eb2bde461e9e3b5596ece6b9d5975a0ae0",
                "d37ee418976dd95753c1c73862b9398fa2a2cf9b4ff0fdfe8b30cd95209614b7"]


def test_rfc6962_roots():
    assert MerkleTree([]).root() == EMPTY_ROOT == hashlib.sha256(b"").digest()
    for n, want in enumerate(ROOTS, start=1):
        assert MerkleTree.from_data(LEAVES[:n]).root().hex() == want


def test_rfc6962_inclusion_proof():
    tree = MerkleTree.from_data(LEAVES)
    assert [p.hex() for p in tree.inclusion_proof(5)] == PROOF_5_OF_8
    assert verify_inclusion(leaf_hash(LEAVES[5]), 5, 8, tree.inclusion_proof(5), tree.root())


def test_hash_prefixes_separate_leaves_from_nodes():
    a, b = b"x" * 32, b"y" * 32
    assert leaf_hash(a + b) != node_hash(a, b)
    assert leaf_hash(b"") == hashlib.sha256(b"\x00").digest()


def _recursive_mth(hashes):
    """RFC 6962 section 2.1 written literally, as an oracle."""
    if len(hashes) == 1:
        return hashes[0]
    k = 1
    while k * 2 < len(hashes):
        k *= 2
    return node_hash(_recursive_mth(hashes[:k]), _recursive_mth(hashes[k:]))


def test_every_inclusion_proof_of_trees_1_to_70():
    for n in range(1, 71):
        leaves = [hashlib.sha256(f"{n}/{i}".encode()).digest() for i in range(n)]
        tree = MerkleTree(leaves)
        root = tree.root()
        assert root == _recursive_mth(leaves)
        for i in range(n):
            proof = tree.inclusion_proof(i)
            assert verify_inclusion(leaves[i], i, n, proof, root)
            # the proof fails for another leaf, another index, another size, a changed node or a wrong root
            if n > 1:
                assert not verify_inclusion(leaves[(i + 1) % n], i, n, proof, root)
                assert not verify_inclusion(leaves[i], (i + 1) % n, n, proof, root)
            if proof:
                broken = list(proof)
                broken[len(broken) // 2] = bytes(32)
                assert not verify_inclusion(leaves[i], i, n, broken, root)
                assert not verify_inclusion(leaves[i], i, n, proof[:-1], root)
            assert not verify_inclusion(leaves[i], i, n, proof + [bytes(32)], root)
            assert not verify_inclusion(leaves[i], i, n, proof, bytes(32))


def test_subtree_nodes_are_the_children_of_their_parents():
    tree = MerkleTree([os.urandom(32) for _ in range(13)])
    assert tree.node(0, 13) == node_hash(tree.node(0, 8), tree.node(8, 13))
    assert tree.node(8, 13) == node_hash(tree.node(8, 12), tree.node(12, 13))
    with pytest.raises(MerkleError):
        tree.node(3, 20)
    with pytest.raises(MerkleError):
        tree.inclusion_proof(13)
    with pytest.raises(MerkleError):
        MerkleTree([b"short"])


@given(st.integers(1, 300), st.data())
def test_proofs_of_random_sizes(n, data):
    i = data.draw(st.integers(0, n - 1))
    leaves = [hashlib.sha256(i.to_bytes(4, "little")).digest() for i in range(n)]
    tree = MerkleTree(leaves)
    assert verify_inclusion(leaves[i], i, n, tree.inclusion_proof(i), tree.root())


def test_a_leafs_range_has_no_children():
    """The bisection splits ranges of two leaves or more; asked for a single leaf's children it says so rather
    than split [lo, lo + 1) into an empty half and itself (a loop that never narrows)."""
    from veritrain.merkle import children

    assert children(0, 5) == ((0, 4), (4, 5))
    for lo, hi in [(3, 4), (2, 2)]:
        with pytest.raises(MerkleError, match=rf"range \[{lo}, {hi}\) is a leaf"):
            children(lo, hi)
