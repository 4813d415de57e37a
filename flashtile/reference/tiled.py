"""Tiled attention in pure PyTorch: the FA1 and FA2 forward loop orders and the blocked backward.

These run block by block exactly as the kernels do (docs/derivation.md, ch. 4-6), to show that the running
(m_i, l_i, acc) recurrences reproduce naive attention. They are slow (Python loops over tiles) and meant for tests
and teaching, not as a fallback.

# q: [B, Sq, Hq, D]   k: [B, Sk, Hk, D]   v: [B, Sk, Hk, Dv]   out: [B, Sq, Hq, Dv]   lse: [B, Hq, Sq]
# Inside, head-major with kv groups: q -> [B, Hk, G, Sq, D], k/v -> [B, Hk, 1, Sk, D] (see _common.py).
"""

import torch

from ._common import (NEG_INF, accum_dtype, causal_block_mask, check_blocks, check_backward_rows, check_qkv, finite_or_zero,
                      group_kv, group_q, group_rows, resolve_offset, resolve_scale, ungroup_kv, ungroup_q,
                      ungroup_rows)


def _q_block_start(j0, block_m, offset):
    """First row of the first Q block with a query that sees key j0 (query i sees j0 iff i >= j0 - offset)."""
    if offset is None:
        return 0
    first_row = max(0, j0 - offset)
    return first_row - first_row % block_m


def _kv_end(i1, sk, offset):
    """One past the last key seen by any query in rows [.., i1): K/V blocks from here on are skipped entirely."""
    if offset is None:
        return sk
    return min(sk, max(0, i1 + offset))


def _scores(q_i, k_j, scale, i0, i1, j0, j1, offset):
    """s_ij = scale * q_i k_j^T, [B, Hk, G, i1 - i0, j1 - j0], with the causal mask applied if it cuts the block.

    A block whose top-right corner (i0, j1 - 1) is visible is visible everywhere and skips the mask: the kernels'
    first causal stage. Only blocks crossing the diagonal pay for it (ch. 5).
    """
    s_ij = scale * (q_i @ k_j.mT)
    if offset is not None and j1 - 1 > i0 + offset:
        s_ij = s_ij.masked_fill(~causal_block_mask(i0, i1, j0, j1, offset, s_ij.device), NEG_INF)
    return s_ij


def _prepare(q, k, v, block_m, block_n, softmax_scale, causal, diagonal_offset):
    sq, sk, hk = check_qkv(q, k, v)
    check_blocks(block_m, block_n)
    scale = resolve_scale(softmax_scale, q.shape[-1])
    offset = resolve_offset(causal, diagonal_offset, sq, sk)
    acc_dtype = accum_dtype(q.dtype)
    return sq, sk, hk, scale, offset, acc_dtype


def tiled_attention_fa1(q, k, v, *, block_m=64, block_n=64, softmax_scale=None, causal=False,
                        diagonal_offset=None):
    """Forward in FlashAttention-1 loop order: K/V blocks outer, Q blocks inner.

    The running state lives in full-size arrays, m and l [B, Hq, Sq] and a normalised O [B, Sq, Hq, Dv], each Q
    block's slice read and rewritten once per K/V block (in the paper, a round trip to HBM). Per step, with the
    block's own max and sum m~ = rowmax(s_ij), P~ = exp(s_ij - m~), l~ = rowsum(P~):

        m_new = max(m_i, m~)      l_new = exp(m_i - m_new) l_i + exp(m~ - m_new) l~
        O_i  <- (exp(m_i - m_new) l_i O_i + exp(m~ - m_new) P~ v_j) / l_new

    Args: q [B, Sq, Hq, D], k [B, Sk, Hk, D], v [B, Sk, Hk, Dv]; block_m / block_n (default 64) are the Q / K/V
    tile heights and need not divide Sq / Sk; softmax_scale, causal, diagonal_offset as in naive_attention.
    Returns (out [B, Sq, Hq, Dv] in q.dtype, lse [B, Hq, Sq] float32, float64 for float64 inputs). Accumulates in
    that float32/float64 dtype. Q blocks wholly above the causal diagonal of a K/V block are skipped.
    """
    sq, sk, hk, scale, offset, acc_dtype = _prepare(q, k, v, block_m, block_n, softmax_scale, causal,
                                                    diagonal_offset)
    qg, kg, vg = group_q(q, hk, acc_dtype), group_kv(k, acc_dtype), group_kv(v, acc_dtype)
    m = qg.new_full(qg.shape[:-1], NEG_INF)                                  # [B, Hk, G, Sq]
    l = qg.new_zeros(qg.shape[:-1])                                          # [B, Hk, G, Sq]
    o = qg.new_zeros(qg.shape[:-1] + vg.shape[-1:])                          # [B, Hk, G, Sq, Dv]

    for j0 in range(0, sk, block_n):
        j1 = min(j0 + block_n, sk)
        k_j, v_j = kg[..., j0:j1, :], vg[..., j0:j1, :]                      # [B, Hk, 1, BLOCK_N, D]
        for i0 in range(_q_block_start(j0, block_m, offset), sq, block_m):
            i1 = min(i0 + block_m, sq)
            s_ij = _scores(qg[..., i0:i1, :], k_j, scale, i0, i1, j0, j1, offset)   # [B, Hk, G, BLOCK_M, BLOCK_N]
            m_i, l_i = m[..., i0:i1], l[..., i0:i1]
            m_block = s_ij.amax(dim=-1)
            p_block = torch.exp(s_ij - finite_or_zero(m_block).unsqueeze(-1))
            l_block = p_block.sum(dim=-1)
            m_new = torch.maximum(m_i, m_block)
            m_shift = finite_or_zero(m_new)
            alpha = torch.exp(m_i - m_shift)                                 # rescales the old state
            beta = torch.exp(m_block - m_shift)                              # rescales this block
            l_new = alpha * l_i + beta * l_block
            l_div = torch.where(l_new > 0, l_new, torch.ones_like(l_new))
            o[..., i0:i1, :] = ((alpha * l_i).unsqueeze(-1) * o[..., i0:i1, :]
                                + beta.unsqueeze(-1) * (p_block @ v_j)) / l_div.unsqueeze(-1)
            m[..., i0:i1], l[..., i0:i1] = m_new, l_new

    seen = l > 0
    lse = torch.where(seen, m + torch.log(torch.where(seen, l, torch.ones_like(l))), NEG_INF)
    return ungroup_q(o, q.dtype), ungroup_rows(lse, acc_dtype)


def tiled_attention_fa2(q, k, v, *, block_m=64, block_n=64, softmax_scale=None, causal=False,
                        diagonal_offset=None):
    """Forward in FlashAttention-2 loop order: Q blocks outer (one kernel program each), K/V blocks streamed.

    Per Q block keep m_i, l_i [BLOCK_M] and an unnormalised acc [BLOCK_M, Dv]; for each K/V block

        m_new = max(m_i, rowmax s_ij)     alpha = exp(m_i - m_new)     p = exp(s_ij - m_new)
        l_i <- alpha l_i + rowsum p       acc <- alpha acc + p v_j

    and divide once at the end: out = acc / l_i, lse = m_i + log l_i. With causal=True, K/V blocks entirely above
    the diagonal are never visited, and only blocks that cross it are masked.

    Args and returns as tiled_attention_fa1.
    """
    sq, sk, hk, scale, offset, acc_dtype = _prepare(q, k, v, block_m, block_n, softmax_scale, causal,
                                                    diagonal_offset)
    qg, kg, vg = group_q(q, hk, acc_dtype), group_kv(k, acc_dtype), group_kv(v, acc_dtype)
    out = qg.new_zeros(qg.shape[:-1] + vg.shape[-1:])                        # [B, Hk, G, Sq, Dv]
    lse = qg.new_full(qg.shape[:-1], NEG_INF)                                # [B, Hk, G, Sq]

    for i0 in range(0, sq, block_m):
        i1 = min(i0 + block_m, sq)
        q_i = qg[..., i0:i1, :]                                              # [B, Hk, G, BLOCK_M, D]
        m_i = q_i.new_full(q_i.shape[:-1], NEG_INF)                          # [B, Hk, G, BLOCK_M]
        l_i = q_i.new_zeros(q_i.shape[:-1])                                  # [B, Hk, G, BLOCK_M]
        acc = q_i.new_zeros(q_i.shape[:-1] + vg.shape[-1:])                  # [B, Hk, G, BLOCK_M, Dv]
        for j0 in range(0, _kv_end(i1, sk, offset), block_n):
            j1 = min(j0 + block_n, sk)
            s_ij = _scores(q_i, kg[..., j0:j1, :], scale, i0, i1, j0, j1, offset)  # [B, Hk, G, BLOCK_M, BLOCK_N]
            m_new = torch.maximum(m_i, s_ij.amax(dim=-1))
            m_shift = finite_or_zero(m_new)
            alpha = torch.exp(m_i - m_shift)
            p = torch.exp(s_ij - m_shift.unsqueeze(-1))
            l_i = alpha * l_i + p.sum(dim=-1)
            acc = alpha.unsqueeze(-1) * acc + p @ vg[..., j0:j1, :]
            m_i = m_new
        seen = l_i > 0
        l_div = torch.where(seen, l_i, torch.ones_like(l_i))
        out[..., i0:i1, :] = acc / l_div.unsqueeze(-1)
        lse[..., i0:i1] = torch.where(seen, m_i + torch.log(l_div), NEG_INF)
    return ungroup_q(out, q.dtype), ungroup_rows(lse, acc_dtype)


def tiled_attention_backward(q, k, v, out, lse, dout, *, block_m=64, block_n=64, softmax_scale=None, causal=False,
                             diagonal_offset=None, dlse=None):
    """Blocked backward in the kernels' three passes (docs/derivation.md, ch. 6).

    1. Preprocess: delta = rowsum(dout * out) - dlse, [B, Hq, Sq].
    2. For each K/V block (resident), stream the Q blocks: recompute p = exp(s_ij - lse_i), then
       dV_j += p^T dO_i, dp = dO_i v_j^T, ds = p * (dp - delta_i), dK_j += scale ds^T q_i.
    3. For each Q block (resident), stream the K/V blocks: recompute p and ds, dQ_i += scale ds k_j.
    Each output block is written by exactly one loop iteration (no atomics, deterministic). Pass 2 sums dK, dV over
    the query heads that share a kv head. Causal blocks entirely above the diagonal are skipped in both passes.

    Args and returns as attention_backward, plus block_m / block_n (default 64), which need not divide Sq / Sk.
    Accumulates in float32 (float64 for float64 inputs).
    """
    sq, sk, hk, scale, offset, acc_dtype = _prepare(q, k, v, block_m, block_n, softmax_scale, causal,
                                                    diagonal_offset)
    check_backward_rows(q, v, out, dout, lse, dlse)
    qg, kg, vg = group_q(q, hk, acc_dtype), group_kv(k, acc_dtype), group_kv(v, acc_dtype)
    dog = group_q(dout, hk, acc_dtype)                                       # [B, Hk, G, Sq, Dv]

    delta = (dog * group_q(out, hk, acc_dtype)).sum(dim=-1)                  # [B, Hk, G, Sq]
    if dlse is not None:
        delta = delta - group_rows(dlse, hk, acc_dtype)
    lse_g = group_rows(lse, hk, acc_dtype)
    lse_g = lse_g.masked_fill(lse_g == NEG_INF, float("inf"))                # no visible key: p = exp(-inf) = 0

    def p_and_ds(i0, i1, j0, j1):
        s_ij = _scores(qg[..., i0:i1, :], kg[..., j0:j1, :], scale, i0, i1, j0, j1, offset)
        p = torch.exp(s_ij - lse_g[..., i0:i1].unsqueeze(-1))                # [B, Hk, G, BLOCK_M, BLOCK_N]
        dp = dog[..., i0:i1, :] @ vg[..., j0:j1, :].mT
        return p, p * (dp - delta[..., i0:i1].unsqueeze(-1))

    dk = kg.new_zeros(kg.shape)                                              # [B, Hk, 1, Sk, D]
    dv = vg.new_zeros(vg.shape)                                              # [B, Hk, 1, Sk, Dv]
    for j0 in range(0, sk, block_n):
        j1 = min(j0 + block_n, sk)
        dk_j = kg.new_zeros(kg[..., j0:j1, :].shape)
        dv_j = vg.new_zeros(vg[..., j0:j1, :].shape)
        for i0 in range(_q_block_start(j0, block_m, offset), sq, block_m):
            i1 = min(i0 + block_m, sq)
            p, ds = p_and_ds(i0, i1, j0, j1)
            dv_j += (p.mT @ dog[..., i0:i1, :]).sum(dim=2, keepdim=True)
            dk_j += scale * (ds.mT @ qg[..., i0:i1, :]).sum(dim=2, keepdim=True)
        dk[..., j0:j1, :], dv[..., j0:j1, :] = dk_j, dv_j

    dq = qg.new_zeros(qg.shape)                                              # [B, Hk, G, Sq, D]
    for i0 in range(0, sq, block_m):
        i1 = min(i0 + block_m, sq)
        dq_i = qg.new_zeros(qg[..., i0:i1, :].shape)
        for j0 in range(0, _kv_end(i1, sk, offset), block_n):
            j1 = min(j0 + block_n, sk)
            _, ds = p_and_ds(i0, i1, j0, j1)
            dq_i += scale * (ds @ kg[..., j0:j1, :])
        dq[..., i0:i1, :] = dq_i
    return ungroup_q(dq, q.dtype), ungroup_kv(dk, k.dtype), ungroup_kv(dv, v.dtype)
