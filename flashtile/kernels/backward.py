"""Attention backward: delta preprocess, a dK/dV kernel (K/V block resident, streams Q) and a dQ kernel
(Q block resident, streams K/V). No atomics, so gradients are bit-for-bit deterministic. On Hopper the calls
kernels/hopper_bwd.py covers go to that one-kernel backward instead, unless deterministic=True.

q, out, dout, dq: [B, Sq, Hq, D(v)]; k, v, dk, dv: [B, Sk, Hk, D(v)]; lse, dlse: [B, Hq, Sq] (varlen: [total, H, D]
and [Hq, total_q], as in forward.py).
The math is docs/derivation.md#6-backward: delta = rowsum(dO * O) - dLSE, P = exp(S - LSE), dV = P^T dO,
dP = dO V^T, dS = P * (dP - delta), dQ = scale * dS K, dK = scale * dS^T Q; the features' terms (softcap's
1 - tanh^2, dropout's regenerated mask, the bias and sink gradients) are docs/derivation.md#8.
"""
import torch
import triton
import triton.language as tl

from . import _common, _launch, configs
from . import hopper_bwd
from ._common import (LOG2E, _dropout_keep, _head_features, _key_range, _load_bias, _load_tile, _mma, _mod_unit,
                      _query_range, _score_mod, _seq_bounds, _slice_base, _store_tile, _tile_view, _visible)
from .features import Features

# Delta and the log2 LSE are stored per (batch, head) padded to a multiple of this many rows (the largest query
# tile the backward uses), with LSE = +inf and delta = 0 in the padding: a streamed query tile that runs past Sq
# then needs no mask, since its P = exp2(s - inf) = 0. Varlen batches pad every sequence to the longest.
ROW_PAD = 128


@triton.jit
def _bwd_preprocess_kernel(Out, dOut, Lse, dLse, Delta, LseLog2, CuSeqQ,
                           stride_ob, stride_os, stride_oh,
                           stride_dob, stride_dos, stride_doh,
                           stride_lb, stride_lh, stride_dlb, stride_dlh,
                           seqlen_q, seqlen_q_pad, num_heads, delta_scale,
                           HEAD_DIM_V: tl.constexpr, HAS_DLSE: tl.constexpr, VARLEN: tl.constexpr,
                           BLOCK_M: tl.constexpr, BLOCK_DV: tl.constexpr):
    """Delta = rowsum(O * dO) (minus dLSE), times delta_scale (1, or the softmax scale for the Gluon kernel, whose
    dS carries it: kernels/hopper_bwd._bwd_step), and the LSE in log2 units, as [B, H, Sq_pad] rows."""
    i_m = tl.program_id(0)
    i_bh = tl.program_id(1)
    i_b = i_bh // num_heads
    i_h = i_bh % num_heads
    q_start, _, seqlen_q, _, _ = _seq_bounds(CuSeqQ, CuSeqQ, i_b, seqlen_q, seqlen_q, 0, VARLEN)
    o_m = i_m * BLOCK_M + tl.arange(0, BLOCK_M)
    o_d = tl.arange(0, BLOCK_DV)
    m_m = o_m < seqlen_q
    m_md = m_m[:, None] & (o_d[None, :] < HEAD_DIM_V)
    rows = (q_start + o_m)[:, None].to(tl.int64)
    p_o = Out + i_b.to(tl.int64) * stride_ob + i_h.to(tl.int64) * stride_oh
    p_do = dOut + i_b.to(tl.int64) * stride_dob + i_h.to(tl.int64) * stride_doh
    b_o = tl.load(p_o + rows * stride_os + o_d[None, :], mask=m_md, other=0.0)
    b_do = tl.load(p_do + rows * stride_dos + o_d[None, :], mask=m_md, other=0.0)
    b_delta = tl.sum(b_o.to(tl.float32) * b_do.to(tl.float32), 1)  # [BLOCK_M]
    if HAS_DLSE:
        # A loss that also uses the LSE adds dLSE_i * P_ij to dS_ij (d lse_i / d s_ij = P_ij): fold it into delta.
        p_dlse = dLse + i_b.to(tl.int64) * stride_dlb + i_h.to(tl.int64) * stride_dlh + q_start
        b_delta -= tl.load(p_dlse + o_m, mask=m_m, other=0.0)
    p_lse = Lse + i_b.to(tl.int64) * stride_lb + i_h.to(tl.int64) * stride_lh + q_start
    b_lse = tl.load(p_lse + o_m, mask=m_m, other=float("-inf"))
    # A row that sees no key has LSE = -inf; +inf makes its P = exp2(s - inf) = 0 instead of exp2(-inf + inf) = NaN.
    b_lse_log2 = tl.where(b_lse == float("-inf"), float("inf"), b_lse * LOG2E)
    tl.store(Delta + i_bh.to(tl.int64) * seqlen_q_pad + o_m, b_delta * delta_scale)
    tl.store(LseLog2 + i_bh.to(tl.int64) * seqlen_q_pad + o_m, b_lse_log2)


@triton.jit
def _recompute_p(b_s, b_lse, r_m, r_n, seqlen_k, diag_offset, sm_scale, qk_scale, window_left, window_right,
                 softcap, slope, bias, MASKED: tl.constexpr, MASK_LEFT: tl.constexpr, MASK_RIGHT: tl.constexpr,
                 SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr, BIAS: tl.constexpr, KEY_BOUND: tl.constexpr):
    """P = exp2(S - LSE) from the raw products b_s, in either orientation (r_m, r_n and the attn_mask tile `bias`
    broadcast to b_s's shape); masked pairs get P = 0. Also returns tanh(s / softcap) for the softcap backward
    (b_s when unused)."""
    if SOFTCAP or HAS_ALIBI or BIAS % 2 == 1:
        b_s, b_t = _score_mod(b_s, r_m, r_n, sm_scale, softcap, slope, bias, diag_offset, SOFTCAP, HAS_ALIBI,
                              BIAS)
        b_p = tl.exp2(b_s * _mod_unit(sm_scale, softcap, SOFTCAP, HAS_ALIBI, BIAS) - b_lse)
    else:
        b_t = b_s
        b_p = tl.exp2(b_s * qk_scale - b_lse)
    if MASKED or (BIAS and BIAS % 2 == 0):
        if MASKED:
            m_visible = _visible(r_m, r_n, seqlen_k, diag_offset, window_left, window_right, MASK_LEFT, MASK_RIGHT,
                                 KEY_BOUND)
            if BIAS and BIAS % 2 == 0:
                m_visible = m_visible & (bias != 0)
        else:
            m_visible = bias != 0
        b_p = tl.where(m_visible, b_p, 0.0)
    return b_p, b_t


@triton.jit
def _bwd_dkdv_inner(b_dk, b_dv, b_k, b_v, q_view, do_view, p_lse, p_delta, start_n, lo, hi,
                    seqlen_q, seqlen_k, stride_qs, stride_dos, diag_offset, sm_scale, qk_scale,
                    window_left, window_right, softcap, slope, p_bias, stride_bias_m, stride_bias_n, p_block_list,
                    seed, i_bh, dropout_threshold, dropout_rescale,
                    MASKED: tl.constexpr, MASK_LEFT: tl.constexpr, MASK_RIGHT: tl.constexpr,
                    SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr, BIAS: tl.constexpr, BLOCK_SKIP: tl.constexpr,
                    DROPOUT: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
                    USE_TMA: tl.constexpr, PRECISION: tl.constexpr, DOT_UPCAST: tl.constexpr):
    """Accumulate dK, dV of one key block over the query blocks [lo, hi), in the transposed orientation
    (keys as rows) so that P^T and dS^T come out of the matmuls without a transpose. MASKED applies the band;
    rows past Sq need no mask (their padded LSE is +inf, so P = 0), nor do keys past Sk (their dK, dV rows are
    never stored and no other row depends on them)."""
    r_n = (start_n + tl.arange(0, BLOCK_N))[:, None]
    # BLOCK_SKIP: [lo, hi) indexes the list of query blocks a bool attn_mask lets this key block be seen by.
    for it in tl.range(lo, hi, 1 if BLOCK_SKIP else BLOCK_M):
        if BLOCK_SKIP:
            start_m = tl.load(p_block_list + it) * BLOCK_M
        else:
            start_m = it
        o_m = start_m + tl.arange(0, BLOCK_M)
        r_m = o_m[None, :]
        b_q = _load_tile(q_view, start_m, seqlen_q, stride_qs, HEAD_DIM, BLOCK_M, BLOCK_D, USE_TMA)
        b_lse = tl.load(p_lse + o_m)  # [BLOCK_M] log2 units, padded rows +inf
        b_st = _mma(b_k, tl.trans(b_q), None, PRECISION, DOT_UPCAST)  # [BLOCK_N, BLOCK_M]
        bias = 0.0
        if BIAS:
            bias = _load_bias(p_bias, start_m, start_n, seqlen_q, seqlen_k, stride_bias_m, stride_bias_n, BIAS,
                              BLOCK_M, BLOCK_N, True)
        b_pt, b_tt = _recompute_p(b_st, b_lse[None, :], r_m, r_n, seqlen_k, diag_offset, sm_scale, qk_scale,
                                  window_left, window_right, softcap, slope, bias, MASKED, MASK_LEFT, MASK_RIGHT,
                                  SOFTCAP, HAS_ALIBI, BIAS, False)
        b_do = _load_tile(do_view, start_m, seqlen_q, stride_dos, HEAD_DIM_V, BLOCK_M, BLOCK_DV, USE_TMA)
        b_dpt = _mma(b_v, tl.trans(b_do), None, PRECISION, DOT_UPCAST)  # [BLOCK_N, BLOCK_M]
        if DROPOUT:
            # The forward's mask, regenerated: dV sums the kept, rescaled P; dP flows back only through them.
            keep = _dropout_keep(seed, i_bh, start_m, start_n, dropout_threshold, BLOCK_M, BLOCK_N, True)
            b_dv = _mma(tl.where(keep, b_pt * dropout_rescale, 0.0).to(b_do.dtype), b_do, b_dv, PRECISION,
                        DOT_UPCAST)
            b_dpt = tl.where(keep, b_dpt * dropout_rescale, 0.0)
        else:
            b_dv = _mma(b_pt.to(b_do.dtype), b_do, b_dv, PRECISION, DOT_UPCAST)  # [BLOCK_N, BLOCK_DV]
        b_delta = tl.load(p_delta + o_m)  # [BLOCK_M]
        b_dst = b_pt * (b_dpt - b_delta[None, :])  # [BLOCK_N, BLOCK_M]
        if SOFTCAP:
            b_dst = b_dst * (1.0 - b_tt * b_tt)
        b_dk = _mma(b_dst.to(b_q.dtype), b_q, b_dk, PRECISION, DOT_UPCAST)  # [BLOCK_N, BLOCK_D]
    return b_dk, b_dv


@triton.jit
def _bwd_dkdv_kernel(Q, K, V, dOut, dK, dV, LseLog2, Delta, Alibi, Bias, BlockCount, BlockList, Seed, CuSeqQ,
                     CuSeqK,
                     stride_qb, stride_qs, stride_qh,
                     stride_kb, stride_ks, stride_kh,
                     stride_vb, stride_vs, stride_vh,
                     stride_dob, stride_dos, stride_doh,
                     stride_dkb, stride_dks, stride_dkh,
                     stride_dvb, stride_dvs, stride_dvh,
                     stride_alibi_b, stride_bias_b, stride_bias_h, stride_bias_m, stride_bias_n,
                     stride_map_b, stride_map_h, map_cols,
                     seqlen_q, seqlen_k, seqlen_q_pad, diag_offset, sm_scale, qk_scale, num_kv_heads, group_size,
                     window_left, window_right, softcap, dropout_threshold, dropout_rescale,
                     HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr, MASK_LEFT: tl.constexpr,
                     MASK_RIGHT: tl.constexpr, SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr, BIAS: tl.constexpr,
                     BLOCK_SKIP: tl.constexpr, DROPOUT: tl.constexpr, VARLEN: tl.constexpr,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
                     USE_TMA: tl.constexpr, PRECISION: tl.constexpr, DOT_UPCAST: tl.constexpr):
    i_n = tl.program_id(0)
    i_bhk = tl.program_id(1)
    i_b = i_bhk // num_kv_heads
    i_hk = i_bhk % num_kv_heads
    start_n = i_n * BLOCK_N
    q_start, k_start, seqlen_q, seqlen_k, diag_offset = _seq_bounds(CuSeqQ, CuSeqK, i_b, seqlen_q, seqlen_k,
                                                                    diag_offset, VARLEN)
    if start_n < seqlen_k:  # a varlen grid covers the longest sequence
        k_base = _slice_base(K, i_b, k_start, i_hk, stride_kb, stride_ks, stride_kh)
        v_base = _slice_base(V, i_b, k_start, i_hk, stride_vb, stride_vs, stride_vh)
        k_view = _tile_view(k_base, seqlen_k, stride_ks, HEAD_DIM, BLOCK_N, BLOCK_D, USE_TMA)
        v_view = _tile_view(v_base, seqlen_k, stride_vs, HEAD_DIM_V, BLOCK_N, BLOCK_DV, USE_TMA)
        b_k = _load_tile(k_view, start_n, seqlen_k, stride_ks, HEAD_DIM, BLOCK_N, BLOCK_D, USE_TMA)
        b_v = _load_tile(v_view, start_n, seqlen_k, stride_vs, HEAD_DIM_V, BLOCK_N, BLOCK_DV, USE_TMA)
        b_dk = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
        b_dv = tl.zeros([BLOCK_N, BLOCK_DV], tl.float32)
        seed = 0
        if DROPOUT:
            seed = tl.load(Seed)

        lo, hi = _query_range(start_n, seqlen_q, diag_offset, window_left, window_right, MASK_LEFT, MASK_RIGHT,
                              BLOCK_M, BLOCK_N)
        # Grouped-query attention: this program owns the kv head, so it sums the grads of all its query heads in
        # registers -- no atomics, and the order of the sum is fixed.
        for g in range(0, group_size):
            i_h = i_hk * group_size + g
            i_bh = i_b * num_kv_heads * group_size + i_h
            q_base = _slice_base(Q, i_b, q_start, i_h, stride_qb, stride_qs, stride_qh)
            do_base = _slice_base(dOut, i_b, q_start, i_h, stride_dob, stride_dos, stride_doh)
            q_view = _tile_view(q_base, seqlen_q, stride_qs, HEAD_DIM, BLOCK_M, BLOCK_D, USE_TMA)
            do_view = _tile_view(do_base, seqlen_q, stride_dos, HEAD_DIM_V, BLOCK_M, BLOCK_DV, USE_TMA)
            row0 = i_bh.to(tl.int64) * seqlen_q_pad
            slope, p_bias = _head_features(Alibi, Bias, i_b, i_h, stride_alibi_b, stride_bias_b, stride_bias_h,
                                           stride_bias_m, seqlen_q, seqlen_k, HAS_ALIBI, BIAS, BLOCK_M, BLOCK_N)
            if BLOCK_SKIP:
                map_row = i_b * stride_map_b + i_h * stride_map_h + i_n
                p_block_list = BlockList + map_row.to(tl.int64) * map_cols
                lo = 0
                hi = tl.load(BlockCount + map_row)
            else:
                p_block_list = BlockList
            # One loop over the query blocks that see the key block, the band's mask applied to each: measured 5%
            # faster at d128 causal on an H200 than a masked diagonal stage plus an unmasked loop (388 -> 409
            # TFLOP/s, benchmarks/NOTES.md); the likely cause is code size: two copies of this 4-matmul body inside
            # the head loop. The compare-select costs less.
            b_dk, b_dv = _bwd_dkdv_inner(
                b_dk, b_dv, b_k, b_v, q_view, do_view, LseLog2 + row0, Delta + row0, start_n, lo, hi,
                seqlen_q, seqlen_k, stride_qs, stride_dos, diag_offset, sm_scale, qk_scale,
                window_left, window_right, softcap, slope, p_bias, stride_bias_m, stride_bias_n, p_block_list,
                seed, i_bh, dropout_threshold, dropout_rescale,
                MASK_LEFT or MASK_RIGHT, MASK_LEFT, MASK_RIGHT, SOFTCAP, HAS_ALIBI, BIAS, BLOCK_SKIP, DROPOUT,
                HEAD_DIM, HEAD_DIM_V, BLOCK_M, BLOCK_N, BLOCK_D, BLOCK_DV, USE_TMA, PRECISION, DOT_UPCAST)

        dk_base = _slice_base(dK, i_b, k_start, i_hk, stride_dkb, stride_dks, stride_dkh)
        dv_base = _slice_base(dV, i_b, k_start, i_hk, stride_dvb, stride_dvs, stride_dvh)
        dk_view = _tile_view(dk_base, seqlen_k, stride_dks, HEAD_DIM, BLOCK_N, BLOCK_D, USE_TMA)
        dv_view = _tile_view(dv_base, seqlen_k, stride_dvs, HEAD_DIM_V, BLOCK_N, BLOCK_DV, USE_TMA)
        _store_tile(dk_view, (b_dk * sm_scale).to(dK.dtype.element_ty), start_n, seqlen_k, stride_dks, HEAD_DIM,
                    BLOCK_N, BLOCK_D, USE_TMA)
        _store_tile(dv_view, b_dv.to(dV.dtype.element_ty), start_n, seqlen_k, stride_dvs, HEAD_DIM_V,
                    BLOCK_N, BLOCK_DV, USE_TMA)


@triton.jit
def _bwd_dq_inner(b_dq, b_q, b_do, b_lse, b_delta, k_view, v_view, start_m, lo, hi,
                  seqlen_q, seqlen_k, stride_ks, stride_vs, diag_offset, sm_scale, qk_scale,
                  window_left, window_right, softcap, slope, p_bias, stride_bias_m, stride_bias_n, p_block_list,
                  p_dbias, stride_dbias_m, stride_dbias_n, seed, i_bh, dropout_threshold, dropout_rescale,
                  MASKED: tl.constexpr, MASK_LEFT: tl.constexpr, MASK_RIGHT: tl.constexpr,
                  SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr, BIAS: tl.constexpr, BLOCK_SKIP: tl.constexpr,
                  DBIAS: tl.constexpr, DROPOUT: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
                  USE_TMA: tl.constexpr, PRECISION: tl.constexpr, DOT_UPCAST: tl.constexpr):
    """Accumulate dQ of one query block over the key blocks [lo, hi); with DBIAS also write dS, the gradient of
    an additive bias."""
    o_m = start_m + tl.arange(0, BLOCK_M)
    r_m = o_m[:, None]
    # BLOCK_SKIP: [lo, hi) indexes the list of key blocks a bool attn_mask lets this query block see.
    for it in tl.range(lo, hi, 1 if BLOCK_SKIP else BLOCK_N):
        if BLOCK_SKIP:
            start_n = tl.load(p_block_list + it) * BLOCK_N
        else:
            start_n = it
        r_n = (start_n + tl.arange(0, BLOCK_N))[None, :]
        b_k = _load_tile(k_view, start_n, seqlen_k, stride_ks, HEAD_DIM, BLOCK_N, BLOCK_D, USE_TMA)
        b_v = _load_tile(v_view, start_n, seqlen_k, stride_vs, HEAD_DIM_V, BLOCK_N, BLOCK_DV, USE_TMA)
        b_s = _mma(b_q, tl.trans(b_k), None, PRECISION, DOT_UPCAST)  # [BLOCK_M, BLOCK_N]
        # Keys past Sk read as 0, which would give them P = exp2(-lse) (possibly inf): the masked stage drops
        # them with the band.
        bias = 0.0
        if BIAS:
            bias = _load_bias(p_bias, start_m, start_n, seqlen_q, seqlen_k, stride_bias_m, stride_bias_n, BIAS,
                              BLOCK_M, BLOCK_N, False)
        b_p, b_t = _recompute_p(b_s, b_lse[:, None], r_m, r_n, seqlen_k, diag_offset, sm_scale, qk_scale,
                                window_left, window_right, softcap, slope, bias, MASKED, MASK_LEFT, MASK_RIGHT,
                                SOFTCAP, HAS_ALIBI, BIAS, True)
        b_dp = _mma(b_do, tl.trans(b_v), None, PRECISION, DOT_UPCAST)  # [BLOCK_M, BLOCK_N]
        if DROPOUT:
            keep = _dropout_keep(seed, i_bh, start_m, start_n, dropout_threshold, BLOCK_M, BLOCK_N, False)
            b_dp = tl.where(keep, b_dp * dropout_rescale, 0.0)
        b_ds = b_p * (b_dp - b_delta[:, None])  # [BLOCK_M, BLOCK_N]
        if DBIAS:
            # The bias is added after the softcap, so its gradient is dS itself.
            tl.store(p_dbias + r_m.to(tl.int64) * stride_dbias_m + r_n * stride_dbias_n,
                     b_ds.to(p_dbias.dtype.element_ty), mask=(r_m < seqlen_q) & (r_n < seqlen_k))
        if SOFTCAP:
            b_ds = b_ds * (1.0 - b_t * b_t)
        b_dq = _mma(b_ds.to(b_k.dtype), b_k, b_dq, PRECISION, DOT_UPCAST)  # [BLOCK_M, BLOCK_D]
    return b_dq


@triton.jit
def _bwd_dq_kernel(Q, K, V, dOut, dQ, LseLog2, Delta, Alibi, Bias, BlockCount, BlockList, DBias, Seed, CuSeqQ,
                   CuSeqK,
                   stride_qb, stride_qs, stride_qh,
                   stride_kb, stride_ks, stride_kh,
                   stride_vb, stride_vs, stride_vh,
                   stride_dob, stride_dos, stride_doh,
                   stride_dqb, stride_dqs, stride_dqh,
                   stride_alibi_b, stride_bias_b, stride_bias_h, stride_bias_m, stride_bias_n,
                   stride_map_b, stride_map_h, map_cols,
                   stride_dbias_b, stride_dbias_h, stride_dbias_m, stride_dbias_n,
                   seqlen_q, seqlen_k, seqlen_q_pad, diag_offset, sm_scale, qk_scale, num_heads, group_size,
                   window_left, window_right, softcap, dropout_threshold, dropout_rescale,
                   HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr, MASK_LEFT: tl.constexpr,
                   MASK_RIGHT: tl.constexpr, EVEN_N: tl.constexpr, SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr,
                   BIAS: tl.constexpr, BLOCK_SKIP: tl.constexpr, DBIAS: tl.constexpr, DROPOUT: tl.constexpr,
                   VARLEN: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
                   USE_TMA: tl.constexpr, PRECISION: tl.constexpr, DOT_UPCAST: tl.constexpr):
    i_m = tl.program_id(0)
    if MASK_RIGHT:
        i_m = tl.num_programs(0) - 1 - i_m  # heaviest query blocks first, as in the forward
    i_bh = tl.program_id(1)
    i_b = i_bh // num_heads
    i_h = i_bh % num_heads
    i_hk = i_h // group_size
    start_m = i_m * BLOCK_M
    q_start, k_start, seqlen_q, seqlen_k, diag_offset = _seq_bounds(CuSeqQ, CuSeqK, i_b, seqlen_q, seqlen_k,
                                                                    diag_offset, VARLEN)
    if start_m < seqlen_q:
        q_base = _slice_base(Q, i_b, q_start, i_h, stride_qb, stride_qs, stride_qh)
        do_base = _slice_base(dOut, i_b, q_start, i_h, stride_dob, stride_dos, stride_doh)
        k_base = _slice_base(K, i_b, k_start, i_hk, stride_kb, stride_ks, stride_kh)
        v_base = _slice_base(V, i_b, k_start, i_hk, stride_vb, stride_vs, stride_vh)
        q_view = _tile_view(q_base, seqlen_q, stride_qs, HEAD_DIM, BLOCK_M, BLOCK_D, USE_TMA)
        do_view = _tile_view(do_base, seqlen_q, stride_dos, HEAD_DIM_V, BLOCK_M, BLOCK_DV, USE_TMA)
        k_view = _tile_view(k_base, seqlen_k, stride_ks, HEAD_DIM, BLOCK_N, BLOCK_D, USE_TMA)
        v_view = _tile_view(v_base, seqlen_k, stride_vs, HEAD_DIM_V, BLOCK_N, BLOCK_DV, USE_TMA)
        b_q = _load_tile(q_view, start_m, seqlen_q, stride_qs, HEAD_DIM, BLOCK_M, BLOCK_D, USE_TMA)
        b_do = _load_tile(do_view, start_m, seqlen_q, stride_dos, HEAD_DIM_V, BLOCK_M, BLOCK_DV, USE_TMA)
        o_m = start_m + tl.arange(0, BLOCK_M)
        b_lse = tl.load(LseLog2 + i_bh.to(tl.int64) * seqlen_q_pad + o_m)  # [BLOCK_M]
        b_delta = tl.load(Delta + i_bh.to(tl.int64) * seqlen_q_pad + o_m)  # [BLOCK_M]
        b_dq = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
        slope, p_bias = _head_features(Alibi, Bias, i_b, i_h, stride_alibi_b, stride_bias_b, stride_bias_h,
                                       stride_bias_m, seqlen_q, seqlen_k, HAS_ALIBI, BIAS, BLOCK_M, BLOCK_N)
        p_dbias = DBias + i_b.to(tl.int64) * stride_dbias_b + i_h.to(tl.int64) * stride_dbias_h
        seed = 0
        if DROPOUT:
            seed = tl.load(Seed)

        if BLOCK_SKIP:
            # One masked loop over the listed key blocks (a bool attn_mask comes without a band).
            map_row = i_b * stride_map_b + i_h * stride_map_h + i_m
            p_block_list = BlockList + map_row.to(tl.int64) * map_cols
            b_dq = _bwd_dq_inner(
                b_dq, b_q, b_do, b_lse, b_delta, k_view, v_view, start_m, 0, tl.load(BlockCount + map_row),
                seqlen_q, seqlen_k, stride_ks, stride_vs, diag_offset, sm_scale, qk_scale,
                window_left, window_right, softcap, slope, p_bias, stride_bias_m, stride_bias_n, p_block_list,
                p_dbias, stride_dbias_m, stride_dbias_n, seed, i_bh, dropout_threshold, dropout_rescale,
                True, MASK_LEFT, MASK_RIGHT, SOFTCAP, HAS_ALIBI, BIAS, BLOCK_SKIP, DBIAS, DROPOUT,
                HEAD_DIM, HEAD_DIM_V, BLOCK_M, BLOCK_N, BLOCK_D, BLOCK_DV, USE_TMA, PRECISION, DOT_UPCAST)
        else:
            p_block_list = BlockList
            lo, full_lo, full_hi, hi = _key_range(start_m, seqlen_q, seqlen_k, diag_offset, window_left, window_right,
                                                  MASK_LEFT, MASK_RIGHT, BLOCK_M, BLOCK_N)
            if MASK_LEFT:
                b_dq = _bwd_dq_inner(
                    b_dq, b_q, b_do, b_lse, b_delta, k_view, v_view, start_m, lo, tl.minimum(full_lo, hi),
                    seqlen_q, seqlen_k, stride_ks, stride_vs, diag_offset, sm_scale, qk_scale,
                    window_left, window_right, softcap, slope, p_bias, stride_bias_m, stride_bias_n, p_block_list,
                    p_dbias, stride_dbias_m, stride_dbias_n, seed, i_bh, dropout_threshold, dropout_rescale,
                    True, MASK_LEFT, MASK_RIGHT, SOFTCAP, HAS_ALIBI, BIAS, BLOCK_SKIP, DBIAS, DROPOUT,
                    HEAD_DIM, HEAD_DIM_V, BLOCK_M, BLOCK_N, BLOCK_D, BLOCK_DV, USE_TMA, PRECISION, DOT_UPCAST)
            b_dq = _bwd_dq_inner(
                b_dq, b_q, b_do, b_lse, b_delta, k_view, v_view, start_m, full_lo, full_hi,
                seqlen_q, seqlen_k, stride_ks, stride_vs, diag_offset, sm_scale, qk_scale,
                window_left, window_right, softcap, slope, p_bias, stride_bias_m, stride_bias_n, p_block_list,
                p_dbias, stride_dbias_m, stride_dbias_n, seed, i_bh, dropout_threshold, dropout_rescale,
                False, MASK_LEFT, MASK_RIGHT, SOFTCAP, HAS_ALIBI, BIAS, BLOCK_SKIP, DBIAS, DROPOUT,
                HEAD_DIM, HEAD_DIM_V, BLOCK_M, BLOCK_N, BLOCK_D, BLOCK_DV, USE_TMA, PRECISION, DOT_UPCAST)
            if not EVEN_N:  # as in the forward: no masked stage when nothing needs a mask
                b_dq = _bwd_dq_inner(
                    b_dq, b_q, b_do, b_lse, b_delta, k_view, v_view, start_m, tl.maximum(full_lo, full_hi), hi,
                    seqlen_q, seqlen_k, stride_ks, stride_vs, diag_offset, sm_scale, qk_scale,
                    window_left, window_right, softcap, slope, p_bias, stride_bias_m, stride_bias_n, p_block_list,
                    p_dbias, stride_dbias_m, stride_dbias_n, seed, i_bh, dropout_threshold, dropout_rescale,
                    True, MASK_LEFT, MASK_RIGHT, SOFTCAP, HAS_ALIBI, BIAS, BLOCK_SKIP, DBIAS, DROPOUT,
                    HEAD_DIM, HEAD_DIM_V, BLOCK_M, BLOCK_N, BLOCK_D, BLOCK_DV, USE_TMA, PRECISION, DOT_UPCAST)

        dq_base = _slice_base(dQ, i_b, q_start, i_h, stride_dqb, stride_dqs, stride_dqh)
        dq_view = _tile_view(dq_base, seqlen_q, stride_dqs, HEAD_DIM, BLOCK_M, BLOCK_D, USE_TMA)
        _store_tile(dq_view, (b_dq * sm_scale).to(dQ.dtype.element_ty), start_m, seqlen_q, stride_dqs, HEAD_DIM,
                    BLOCK_M, BLOCK_D, USE_TMA)


# Rows per preprocess program: a light, memory-bound pass; 128 divides ROW_PAD.
_PREPROCESS_BLOCK_M = 128


def _batch_strides(t, varlen):
    """(batch, seqlen, head) strides of a [B, S, H, D] tensor, or of a packed [total, H, D] one (batch stride 0)."""
    return (0,) + tuple(t.stride()[:2]) if varlen else tuple(t.stride()[:3])


def attention_backward(dout, q, k, v, out, lse, dlse, softmax_scale, diagonal_offset, feats: Features,
                       dq=None, dk=None, dv=None, bias_grad=False, deterministic=False):
    """Launch the three backward kernels. Returns (dq, dk, dv, dbias, dsinks).

    dlse (optional, lse's shape) is the gradient reaching the returned LSE. dq, dk, dv may be given: buffers (views
    of one packed gradient, for the packed APIs) that the kernels write in full. bias_grad: also return the
    gradient of feats.attn_bias (a float bias), summed over its broadcast dimensions; dsinks is returned when
    feats.sinks is set. deterministic: bit-identical gradients from run to run (the portable kernels; the Hopper
    kernel adds dQ with atomics). Inputs are assumed validated.
    """
    varlen = feats.varlen
    # The preprocess reads lse and dlse as rows of unit stride; they are small, so copy any other layout (autograd
    # hands an expanded, stride-0 dlse for lse.sum()).
    lse = lse.contiguous()
    dlse = None if dlse is None else dlse.contiguous()
    seqlen_q, num_heads, head_dim = q.shape[-3], q.shape[-2], q.shape[-1]
    seqlen_k, num_kv_heads, head_dim_v = k.shape[-3], k.shape[-2], v.shape[-1]
    if varlen:
        batch = feats.cu_seqlens_q.numel() - 1
        seqlen_q, seqlen_k = feats.max_seqlen_q, feats.max_seqlen_k
        lse_strides = (0, lse.stride(0))
        dlse_strides = (0, dlse.stride(0)) if dlse is not None else (0, 0)
    else:
        batch = q.shape[0]
        lse_strides = (lse.stride(0), lse.stride(1))
        dlse_strides = (dlse.stride(0), dlse.stride(1)) if dlse is not None else (0, 0)
    seqlen_q_pad = triton.cdiv(max(seqlen_q, 1), ROW_PAD) * ROW_PAD
    delta = _common.empty((batch, num_heads, seqlen_q_pad), torch.float32, q.device)
    lse_log2 = _common.empty((batch, num_heads, seqlen_q_pad), torch.float32, q.device)
    dq = _common.empty(q.shape, q.dtype, q.device) if dq is None else dq
    dk = _common.empty(k.shape, k.dtype, k.device) if dk is None else dk
    dv = _common.empty(v.shape, v.dtype, v.device) if dv is None else dv
    spec = configs.launch_spec(q, (q, k, v, dout, dq, dk, dv))
    block_d, block_dv = spec.block_d(head_dim), spec.block_d(head_dim_v)
    qk_scale = softmax_scale * LOG2E.value
    group_size = num_heads // num_kv_heads
    fargs = feats.kernel_args(q, spec.use_tma, seqlen_q, seqlen_k)
    dropout_rescale = 1.0 / (1.0 - feats.dropout_p)

    has_dlse = dlse is not None
    dlse_arg = dlse if has_dlse else lse  # never read when HAS_DLSE is False
    gluon = hopper_bwd.supports(q, k, v, out, dout, feats, softmax_scale, deterministic)
    delta_scale = softmax_scale if gluon else 1.0  # the Gluon kernel wants delta in the units of its scaled dS
    _launch.launch(_bwd_preprocess_kernel, (seqlen_q_pad // _PREPROCESS_BLOCK_M, batch * num_heads), (
        out, dout, lse, dlse_arg, delta, lse_log2, fargs.cu_q,
        *_batch_strides(out, varlen), *_batch_strides(dout, varlen), *lse_strides, *dlse_strides,
        seqlen_q, seqlen_q_pad, num_heads, delta_scale), dict(
        HEAD_DIM_V=head_dim_v, HAS_DLSE=has_dlse, VARLEN=varlen, BLOCK_M=_PREPROCESS_BLOCK_M, BLOCK_DV=block_dv),
        q.device.index)

    full_shape = (batch, num_heads, seqlen_q, seqlen_k)
    if gluon:
        # Hopper, 16-bit, d 64/128 (an attn_mask is read by TMA, not with dropout; varlen batches come without one): the
        # warp-specialized Gluon kernel (kernels/hopper_bwd.py), which reads delta and lse_log2 as the portable
        # kernels do ([B, H, Sq_pad], varlen rows by position in the sequence). Its bias gradient is dS in the
        # bias's dtype, whatever the bias's shape (hopper_bwd.attention_backward's DBIAS note), with rows padded to
        # TMA's 16 bytes; only a band leaves tiles unwritten.
        dbias_full = None
        if bias_grad:
            dtype = feats.attn_bias.dtype
            row = triton.cdiv(seqlen_k, 16 // dtype.itemsize) * (16 // dtype.itemsize)
            shape = full_shape[:3] + (row,)
            if feats.banded:
                dbias_full = torch.zeros(shape, dtype=dtype, device=q.device)
            else:
                dbias_full = _common.empty(shape, dtype, q.device)
            dbias_full = dbias_full[..., :seqlen_k]
        hopper_bwd.attention_backward(q, k, v, dout, dq, dk, dv, lse_log2, delta, softmax_scale, diagonal_offset,
                                      feats, dbias=dbias_full)
        return dq, dk, dv, _reduce_dbias(dbias_full, feats), _sinks_grad(feats, lse_log2, delta, delta_scale)

    # The bias gradient is dS, written whole by the dQ kernel ([B, H, Sq, Sk]) and summed over the bias's
    # broadcast dimensions here; tiles the kernel skips (outside the band, fully masked) stay 0.
    dbias_full = None
    dbias_strides = (0, 0, 0, 0)
    if bias_grad:
        bias = feats.attn_bias
        dtype = bias.dtype if tuple(bias.shape) == full_shape else torch.float32
        dbias_full = torch.zeros(full_shape, dtype=dtype, device=q.device)
        dbias_strides = dbias_full.stride()

    dkdv_candidates, dq_candidates = configs.backward_candidates(max(head_dim, head_dim_v), feats.mask_right,
                                                                 q.dtype, spec)
    common = dict(
        HEAD_DIM=head_dim, HEAD_DIM_V=head_dim_v, MASK_LEFT=feats.mask_left, MASK_RIGHT=feats.mask_right,
        SOFTCAP=feats.softcap_mode(q.dtype), HAS_ALIBI=fargs.has_alibi, BIAS=fargs.bias_kind,
        DROPOUT=feats.dropout_p > 0, VARLEN=varlen, BLOCK_D=block_d, BLOCK_DV=block_dv, USE_TMA=spec.use_tma,
        PRECISION=spec.precision, DOT_UPCAST=spec.dot_upcast,
    )
    scalars = (seqlen_q, seqlen_k, seqlen_q_pad, diagonal_offset, softmax_scale, qk_scale)
    feature_scalars = (feats.window_left, feats.window_right, feats.softcap, fargs.dropout_threshold,
                       dropout_rescale)

    def launch_dkdv(cfg):
        lists = feats.block_lists(cfg.block_m, cfg.block_n, True, seqlen_q, seqlen_k)
        counts, indices, map_strides, map_cols = lists if lists is not None else (fargs.cu_q, fargs.cu_q, (0, 0), 0)
        return _launch.launch(_bwd_dkdv_kernel, (triton.cdiv(seqlen_k, cfg.block_n), batch * num_kv_heads), (
            q, k, v, dout, dk, dv, lse_log2, delta, fargs.alibi, fargs.bias, counts, indices, fargs.seed, fargs.cu_q,
            fargs.cu_k,
            *_batch_strides(q, varlen), *_batch_strides(k, varlen), *_batch_strides(v, varlen),
            *_batch_strides(dout, varlen), *_batch_strides(dk, varlen), *_batch_strides(dv, varlen),
            fargs.stride_alibi_b, *fargs.bias_strides, *map_strides, map_cols,
            *scalars, num_kv_heads, group_size, *feature_scalars),
            dict(common, BLOCK_SKIP=lists is not None, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n),
            q.device.index, num_warps=cfg.num_warps, num_stages=cfg.num_stages)

    def launch_dq(cfg):
        lists = feats.block_lists(cfg.block_m, cfg.block_n, False, seqlen_q, seqlen_k)
        counts, indices, map_strides, map_cols = lists if lists is not None else (fargs.cu_q, fargs.cu_q, (0, 0), 0)
        even_n = not feats.banded and not varlen and seqlen_k % cfg.block_n == 0
        return _launch.launch(_bwd_dq_kernel, (triton.cdiv(seqlen_q, cfg.block_m), batch * num_heads), (
            q, k, v, dout, dq, lse_log2, delta, fargs.alibi, fargs.bias, counts, indices,
            fargs.alibi if dbias_full is None else dbias_full, fargs.seed, fargs.cu_q, fargs.cu_k,
            *_batch_strides(q, varlen), *_batch_strides(k, varlen), *_batch_strides(v, varlen),
            *_batch_strides(dout, varlen), *_batch_strides(dq, varlen),
            fargs.stride_alibi_b, *fargs.bias_strides, *map_strides, map_cols, *dbias_strides,
            *scalars, num_heads, group_size, *feature_scalars),
            dict(common, EVEN_N=even_n, BLOCK_SKIP=lists is not None, DBIAS=dbias_full is not None,
                 BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n),
            q.device.index, num_warps=cfg.num_warps, num_stages=cfg.num_stages)

    key = (max(head_dim, head_dim_v), feats.mask_right, q.dtype, spec, feats.variant() + (bias_grad, fargs.bias_kind))
    configs.launch_first_that_compiles(("bwd_dkdv",) + key, dkdv_candidates, launch_dkdv)
    configs.launch_first_that_compiles(("bwd_dq",) + key, dq_candidates, launch_dq)

    return dq, dk, dv, _reduce_dbias(dbias_full, feats), _sinks_grad(feats, lse_log2, delta)


@triton.jit
def _dbias_sum_kernel(X, Out, seqlen_q, seqlen_k, n_out_h, n_sum_b, n_sum_h, stride_xb, stride_xh, stride_xm,
                      stride_ob, stride_oh, stride_om, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Out[b', h', i, j] = sum over the summed batch and head entries of X[b, h, i, j], in fp32, stored once in Out's
    dtype. Program (tile, b' * n_out_h + h'); a summed dim has n_out 1 and n_sum its size, a kept one n_sum 1.
    Keys are contiguous in both (stride 1). One pass over X at the memory's rate, in a fixed order: deterministic."""
    pid_t = tl.program_id(0)
    pid_o = tl.program_id(1)
    n_tn = tl.cdiv(seqlen_k, BLOCK_N)
    r_m = (pid_t // n_tn) * BLOCK_M + tl.arange(0, BLOCK_M)
    r_n = (pid_t % n_tn) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (r_m < seqlen_q)[:, None] & (r_n < seqlen_k)[None, :]
    b0 = pid_o // n_out_h
    h0 = pid_o % n_out_h
    tile = r_m[:, None].to(tl.int64) * stride_xm + r_n[None, :]
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for rb in range(n_sum_b):
        for rh in range(n_sum_h):
            base = (b0 + rb).to(tl.int64) * stride_xb + (h0 + rh).to(tl.int64) * stride_xh
            acc += tl.load(X + base + tile, mask=mask, other=0.0).to(tl.float32)
    out = Out + b0.to(tl.int64) * stride_ob + h0.to(tl.int64) * stride_oh
    tl.store(out + r_m[:, None].to(tl.int64) * stride_om + r_n[None, :], acc.to(Out.dtype.element_ty), mask=mask)


# (BLOCK_M, BLOCK_N) of _dbias_sum_kernel: 128 keys are 256-byte rows of a 16-bit buffer per load, and 32 rows
# keep the fp32 sum at 32 registers a thread with 4 warps.
_DBIAS_SUM_BLOCK = (32, 128)


def _reduce_dbias(dbias_full, feats):
    """The bias's gradient from dS over [B, H, Sq, Sk] (None without one): summed over the bias's broadcast
    dimensions in fp32, in the bias's dtype. A sum over batch and/or heads is one pass of _dbias_sum_kernel (torch's
    16-bit sum over a strided dim of 16, returning fp32 for the cast, took 5.0 ms for the Gluon backward's [1, 16,
    16k, 16k] bf16 on an H200: benchmarks/bwd_dbias.py); a bias broadcast along Sq or Sk is summed by torch."""
    if dbias_full is None:
        return None
    bias = feats.attn_bias
    dims = tuple(i for i in range(4) if bias.shape[i] == 1 and dbias_full.shape[i] != 1)
    if not dims:
        return dbias_full.to(bias.dtype).contiguous()  # (the Gluon kernel's rows may be padded: a view)
    if 2 in dims or 3 in dims or dbias_full.stride(3) != 1:
        return dbias_full.sum(dim=dims, keepdim=True, dtype=torch.float32).to(bias.dtype).contiguous()
    batch, heads, seqlen_q, seqlen_k = dbias_full.shape
    out_b = 1 if 0 in dims else batch
    out_h = 1 if 1 in dims else heads
    out = torch.empty((out_b, out_h, seqlen_q, seqlen_k), dtype=bias.dtype, device=dbias_full.device)
    block_m, block_n = _DBIAS_SUM_BLOCK
    grid = (triton.cdiv(seqlen_q, block_m) * triton.cdiv(seqlen_k, block_n), out_b * out_h)
    _launch.launch(_dbias_sum_kernel, grid, (
        dbias_full, out, seqlen_q, seqlen_k, out_h, batch // out_b, heads // out_h, dbias_full.stride(0),
        dbias_full.stride(1), dbias_full.stride(2), out.stride(0), out.stride(1), out.stride(2)),
        dict(BLOCK_M=block_m, BLOCK_N=block_n), dbias_full.device.index, num_warps=4)
    return out


def _sinks_grad(feats, lse_log2, delta, delta_scale=1.0):
    """The sinks' gradient (None without sinks): d loss / d sink_h = -sum_{b, i} P_sink(b, h, i) * delta(b, h, i),
    P_sink = exp(sink - lse) (docs/derivation.md#8); padded rows have lse = +inf, so they add 0. delta: as the
    preprocess stored it, times delta_scale."""
    if feats.sinks is None:
        return None
    p_sink = torch.exp2(feats.sinks.float()[None, :, None] * LOG2E.value - lse_log2)
    return -(p_sink * delta).sum(dim=(0, 2)) / delta_scale
