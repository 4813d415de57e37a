"""Folding one block's partial result into the running result, in float32 (docs/derivation.md, ch. 7):

    lse = log(exp(lse_acc) + exp(lse_blk))
    out = exp(lse_acc - lse) * acc + exp(lse_blk - lse) * blk

One pass over the rows (a Triton kernel on the GPU and in the interpreter, torch otherwise): it reads the float32
accumulator, the block output and both LSEs and writes the result and its LSE, either back into the accumulator
(merge_) or, for the last merge of those rows, into the call's output in its own dtype (merge_into: the rounding
then costs no pass of its own). A row the accumulator has not reached yet (lse_acc = -inf) is not read (its
weight is 0, and the buffer may hold anything); a row neither has reached stays -inf with weight 0 on both sides.

# acc, blk, dst: [B, n, H, D] (D contiguous; acc float32, blk and dst any float dtype)
# lse_acc, lse_blk, lse_dst: [B, H, n] float32
"""
import contextlib

import torch
import triton
import triton.language as tl

from . import _local

# 64 rows of (batch, position, head) per program: 32 KB of float32 accumulator at head dim 128, 4 warps.
_BLOCK_ROWS = 64


@triton.jit
def _merge_kernel(Acc, AccLse, Blk, BlkLse, Dst, DstLse, n_rows, seqlen, num_heads, head_dim,
                  stride_ab, stride_as, stride_ah, stride_bb, stride_bs, stride_bh, stride_db, stride_ds, stride_dh,
                  stride_lab, stride_lah, stride_lbb, stride_lbh, stride_ldb, stride_ldh,
                  BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr):
    o_r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)  # flattened (b, s, h) rows
    m_r = o_r < n_rows
    i_h = (o_r % num_heads).to(tl.int64)
    i_s = ((o_r // num_heads) % seqlen).to(tl.int64)
    i_b = (o_r // (num_heads * seqlen)).to(tl.int64)
    lse_a = tl.load(AccLse + i_b * stride_lab + i_h * stride_lah + i_s, mask=m_r, other=float("-inf"))
    lse_b = tl.load(BlkLse + i_b * stride_lbb + i_h * stride_lbh + i_s, mask=m_r, other=float("-inf"))
    m = tl.maximum(lse_a, lse_b)
    m = tl.where(m == float("-inf"), 0.0, m)  # neither side seen: both weights exp(-inf) = 0, never -inf - -inf
    w_a = tl.exp(lse_a - m)
    w_b = tl.exp(lse_b - m)
    l = w_a + w_b
    l_safe = tl.where(l > 0, l, 1.0)
    o_d = tl.arange(0, BLOCK_D)
    m_d = o_d < head_dim
    p_a = Acc + (i_b * stride_ab + i_s * stride_as + i_h * stride_ah)[:, None] + o_d[None, :]
    p_b = Blk + (i_b * stride_bb + i_s * stride_bs + i_h * stride_bh)[:, None] + o_d[None, :]
    p_d = Dst + (i_b * stride_db + i_s * stride_ds + i_h * stride_dh)[:, None] + o_d[None, :]
    m_rd = m_r[:, None] & m_d[None, :]
    b_a = tl.load(p_a, mask=m_rd & (w_a > 0)[:, None], other=0.0)  # [BLOCK_R, BLOCK_D]
    b_b = tl.load(p_b, mask=m_rd & (w_b > 0)[:, None], other=0.0).to(tl.float32)
    out = b_a * (w_a / l_safe)[:, None] + b_b * (w_b / l_safe)[:, None]
    tl.store(p_d, out.to(Dst.dtype.element_ty), mask=m_rd)
    tl.store(DstLse + i_b * stride_ldb + i_h * stride_ldh + i_s, tl.where(l > 0, m + tl.log(l_safe), float("-inf")),
             mask=m_r)


@triton.jit
def _add_rounded_kernel(A, B, Out, n, BLOCK: tl.constexpr):
    o = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = o < n
    a = tl.load(A + o, mask=m, other=0.0)
    b = tl.load(B + o, mask=m, other=0.0)
    tl.store(Out + o, (a + b).to(Out.dtype.element_ty), mask=m)


# Elements per program of the rounded sum: 4 warps, 8 float32 per thread and load.
_ADD_BLOCK = 1024


def add_rounded(a, b, dtype):
    """a + b (float32 tensors of one shape) rounded to dtype, one pass: 8 bytes read and 2 written per element at
    16 bits, where torch's mixed-dtype addition takes its slower unvectorized path and an addition then a cast
    moves 18. The ring's last sums of dQ, dK and dV (_ring.py)."""
    out = torch.empty(a.shape, dtype=dtype, device=a.device)
    if not _local.use_kernels(a) or not (a.is_contiguous() and b.is_contiguous()) or a.shape != b.shape:
        return torch.add(a, b, out=out)
    n = a.numel()
    if n:
        with torch.cuda.device(a.device) if a.is_cuda else contextlib.nullcontext():
            _add_rounded_kernel[(triton.cdiv(n, _ADD_BLOCK),)](a, b, out, n, BLOCK=_ADD_BLOCK, num_warps=4)
    return out


def _merge_torch(acc, lse, blk, lse_blk, dst, lse_dst):
    new = torch.logaddexp(lse, lse_blk)
    ref = torch.where(torch.isneginf(new), 0.0, new)
    w_a = torch.exp(lse - ref).transpose(1, 2).unsqueeze(-1)
    w_b = torch.exp(lse_blk - ref).transpose(1, 2).unsqueeze(-1)
    dst.copy_(torch.where(w_a > 0, acc * w_a, 0.0) + torch.where(w_b > 0, blk.float() * w_b, 0.0))
    lse_dst.copy_(new)


def merge_into(dst, lse_dst, acc, lse, blk, lse_blk):
    """dst, lse_dst <- the merge of (acc, lse) and (blk, lse_blk) (all may be views; dst may be acc, lse_dst lse;
    dst's dtype may be narrower than float32: the merged float32 values are rounded once, as they are stored)."""
    if not _local.use_kernels(acc):
        _merge_torch(acc, lse, blk, lse_blk, dst, lse_dst)
        return
    batch, seqlen, heads, head_dim = acc.shape
    assert dst.shape == acc.shape == blk.shape and lse_dst.shape == lse.shape == lse_blk.shape
    assert all(t.stride(-1) == 1 for t in (acc, blk, dst, lse, lse_blk, lse_dst))
    n_rows = batch * seqlen * heads
    if n_rows == 0:
        return
    with torch.cuda.device(acc.device) if acc.is_cuda else contextlib.nullcontext():
        _merge_kernel[(triton.cdiv(n_rows, _BLOCK_ROWS),)](
            acc, lse, blk, lse_blk, dst, lse_dst, n_rows, seqlen, heads, head_dim, *acc.stride()[:3],
            *blk.stride()[:3], *dst.stride()[:3], *lse.stride()[:2], *lse_blk.stride()[:2], *lse_dst.stride()[:2],
            BLOCK_R=_BLOCK_ROWS, BLOCK_D=max(16, triton.next_power_of_2(head_dim)), num_warps=4)


def merge_(acc, lse, blk, lse_blk):
    """acc, lse <- the merge of (acc, lse) and (blk, lse_blk), in place (acc and lse may be views)."""
    merge_into(acc, lse, acc, lse, blk, lse_blk)

