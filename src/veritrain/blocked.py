"""Matrix products with a large float32 operand, computed block by block in float64.

Why: the engine evaluates a matrix product in float64, so the eager path first copies both float32 operands
to float64. For a language model's vocabulary-wide products that copy is most of the overhead: the logits'
gradient (batch x 50257) is read by two products in the backward pass, and each made a float64 copy twice
its size (bench/bench_blocked.py times the product both ways). Here
the large operand is copied one block at a time into a buffer that stays in cache, and the product, the
operand's norms for the error scale (rules._mm: sqrt(k) ||row_i(a)|| ||col_j(b)||) and the next block
follow while it is there.

Three ways to split, chosen by the large operand's long dimension:

* ``k``: along the inner dimension (``a`` is M x K with K >= M, or ``b`` is K x N with K >= N; the gradient
  with respect to a layer's input): y = sum over blocks of a[:, block] @ b[block], accumulated in float64,
  and the squared norms accumulated the same way (``mm``).
* ``m``: along the rows of a large ``a`` with M > K (the gradient with respect to a weight, a^T of the
  logits' gradient): each block of rows of y is a[rows] @ b. Where ``a`` is a transposed view, as autograd
  passes it, a block of its rows is copied as the stored matrix's columns and multiplied as a transposed view.
* ``n``: along the columns of a large ``b`` with N > K (the logits themselves, h @ W^T): each block of
  columns of y is a @ b[:, cols]. Where ``b`` is a transposed view, as a linear layer passes its weight, a
  block of its columns is a block of the stored matrix's rows, copied as one contiguous run.

In the ``m`` and ``n`` splits each block of y is handed to the caller (``mm_in_blocks``), which rounds it and
scans it for candidates while it is in cache, so the float64 product never exists whole: the logits' is 206 MB
at 512 x 50257, which the product wrote and the rounding read back, each new page faulting on first touch, on
a machine whose two cores move about 7 GB/s.

The trainer scans every value of y, so it takes the norms in the blocks; an auditor reads the error scale at
its entries only, and takes them there unless its entries are many (engine._try_blocked_mm).

Like the compiled kernels (fused.py) this is another correct float64 evaluation of the op: the products of
float32 values are exact in float64, and only the order of the float64 additions may differ from one GEMM
call (the error model's tau bounds any order; docs/ROUNDING.md). The norms are error-model inputs, not
results: their last bits may differ from the eager norm's, which the auditor's tolerance (engine.HONEST_TAU)
absorbs. The engine treats the result like any float64 result: rounded, scanned, logged or replayed.
"""

from __future__ import annotations

import torch

from .hardware import compiled_path

MIN_NUMEL = 1 << 22  # elements of the large float32 operand (16 MB) from which blocking pays (VERITRAIN_BLOCK_MIN_NUMEL)
BLOCK_NUMEL = 1 << 18  # float64 elements of one operand block: 2 MB, in cache between its copy and its product
RESULT_BLOCK_NUMEL = 1 << 20  # float64 elements of an "m" or "n" block's operand copy or result, the larger (8 MB)


def enabled_for(numel: int, device) -> bool:
    """``VERITRAIN_COMPILE`` as for the fused kernels (1: every matrix product that can be split is, 0: none);
    by default, products whose larger operand has at least ``VERITRAIN_BLOCK_MIN_NUMEL`` elements. CPU only."""
    return compiled_path(numel, device, "VERITRAIN_BLOCK_MIN_NUMEL", MIN_NUMEL)


def split(a: torch.Tensor, b: torch.Tensor) -> str | None:
    """How to split ``a @ b`` ("k", "m", "n"), or None where the eager path is used: operands other than float32
    matrices on the CPU (a GPU's copies run at its memory's speed), empty ones."""
    if a.dim() != 2 or b.dim() != 2 or a.dtype != torch.float32 or b.dtype != torch.float32 \
            or a.device.type != "cpu" or b.device.type != "cpu" or a.shape[1] != b.shape[0] or not a.numel() \
            or not b.numel():
        return None
    (m, k), n = a.shape, b.shape[1]
    if not enabled_for(max(a.numel(), b.numel()), a.device):
        return None
    if a.numel() >= b.numel():
        return "k" if k >= m else "m"
    return "k" if k >= n else "n"


def mm(a: torch.Tensor, b: torch.Tensor, block: int | None = None, norms: bool = True):
    """The "k" split: (y, ||rows of a|| as M x 1, ||columns of b|| as 1 x N), all float64, for float32 ``a``
    (M x K) and ``b`` (K x N); ``block`` float64 elements per operand block (BLOCK_NUMEL). ``norms=False``: the
    two norms are None (an auditor reads its scales at a few positions only)."""
    (m, k), n = a.shape, b.shape[1]
    block = BLOCK_NUMEL if block is None else block
    y = torch.empty((m, n), dtype=torch.float64, device=a.device)
    width = max(1, min(k, block // max(m, n)))
    a_buf = torch.empty(m * width, dtype=torch.float64, device=a.device)
    b_buf = torch.empty(width * n, dtype=torch.float64, device=a.device)
    rows = torch.zeros(m, dtype=torch.float64, device=a.device) if norms else None
    cols = torch.zeros(n, dtype=torch.float64, device=a.device) if norms else None
    for k0 in range(0, k, width):
        w = min(width, k - k0)
        ab = a_buf[: m * w].view(m, w)
        ab.copy_(a[:, k0:k0 + w])
        bb = b_buf[: w * n].view(w, n)
        bb.copy_(b[k0:k0 + w])
        if k0 == 0:
            torch.mm(ab, bb, out=y)
        else:
            y.addmm_(ab, bb)
        if norms:
            rows += ab.square().sum(1)
            cols += bb.square().sum(0)
    if not norms:
        return y, None, None
    return y, rows.sqrt_().view(m, 1), cols.sqrt_().view(1, n)


def mm_in_blocks(a: torch.Tensor, b: torch.Tensor, how: str, finish, norms: bool = True, block: int | None = None):
    """The "m" and "n" splits: ``a @ b`` for float32 ``a`` (M x K) and ``b`` (K x N), one block of the result's rows
    ("m") or columns ("n") at a time, each handed to ``finish(rows, cols, y, row_norms, col_norms)`` while in
    cache: ``rows`` and ``cols`` the slices of the result the block covers, ``y`` its float64 values, ``row_norms``
    ||its rows of a|| (h x 1) and ``col_norms`` ||its columns of b|| (1 x w), float64, or both None unless
    ``norms``; all three in buffers the next block reuses. ``block``: float64 elements of the larger of a block's
    operand copy and its result (RESULT_BLOCK_NUMEL)."""
    (m, k), n = a.shape, b.shape[1]
    block = RESULT_BLOCK_NUMEL if block is None else block
    if how == "m":
        b64 = b.to(torch.float64)
        col_norms = torch.linalg.vector_norm(b64, dim=0, keepdim=True) if norms else None
        height = max(1, min(m, block // max(k, n)))
        a_buf = torch.empty(height * k, dtype=torch.float64, device=a.device)
        y_buf = torch.empty(height * n, dtype=torch.float64, device=a.device)
        # a transposed operand (autograd's a^T of the logits' gradient): a block of its rows is a block of the
        # stored matrix's columns, copied as K runs of contiguous values and multiplied as a transposed view
        # (BLAS reads it as it lies), not gathered value by value into a's row order; its row norms are then a
        # sum of squares over the block's columns (ATen's norm over a transposed view's rows runs slowly)
        by_columns = a.t().is_contiguous()
        square = torch.empty(height * k, dtype=torch.float64, device=a.device) if norms and by_columns else None
        norm_buf = torch.empty(height, dtype=torch.float64, device=a.device) if norms else None
        for r0 in range(0, m, height):
            h = min(height, m - r0)
            if by_columns:
                cb = a_buf[: k * h].view(k, h)
                cb.copy_(a.t()[:, r0:r0 + h])
                ab = cb.t()
            else:
                ab = a_buf[: h * k].view(h, k)
                ab.copy_(a[r0:r0 + h])
            y = y_buf[: h * n].view(h, n)
            torch.mm(ab, b64, out=y)
            row_norms = None
            if norms and by_columns:
                row_norms = torch.sum(torch.mul(cb, cb, out=square[: k * h].view(k, h)), 0, out=norm_buf[:h]).sqrt_()
            elif norms:
                row_norms = torch.linalg.vector_norm(ab, dim=1, out=norm_buf[:h])
            finish(slice(r0, r0 + h), slice(0, n), y, None if row_norms is None else row_norms.view(h, 1), col_norms)
    elif how == "n":
        a64 = a.to(torch.float64)
        row_norms = torch.linalg.vector_norm(a64, dim=1, keepdim=True) if norms else None
        width = max(1, min(n, block // max(m, k)))
        y_buf = torch.empty(m * width, dtype=torch.float64, device=a.device)
        b_buf = torch.empty(k * width, dtype=torch.float64, device=a.device)
        # a transposed b (a linear layer's weight W^T): its block of columns is a block of W's rows, one contiguous
        # run, multiplied as a transposed view; its columns' norms are then W's rows' norms, reduced in memory order
        by_rows = b.t().is_contiguous()
        for j0 in range(0, n, width):
            w = min(width, n - j0)
            if by_rows:
                stored = b_buf[: w * k].view(w, k)
                stored.copy_(b.t()[j0:j0 + w])
                bb = stored.t()
            else:
                bb = b_buf[: k * w].view(k, w)
                bb.copy_(b[:, j0:j0 + w])
            y = y_buf[: m * w].view(m, w)
            torch.mm(a64, bb, out=y)
            col_norms = None
            if norms:
                col_norms = torch.linalg.vector_norm(stored, dim=1).view(1, w) if by_rows \
                    else torch.linalg.vector_norm(bb, dim=0, keepdim=True)
            finish(slice(0, m), slice(j0, j0 + w), y, row_norms, col_norms)
    else:
        raise ValueError(f"unknown split {how!r} for mm_in_blocks")
