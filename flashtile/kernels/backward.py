"""Attention backward: delta preprocess, a dK/dV kernel (K/V block resident, streams Q) and a dQ kernel
(Q block resident, streams K/V). No atomics, so gradients are bit-for-bit deterministic. On Hopper the calls
kernels/hopper_bwd.py covers go to that one-kernel backward instead, unless deterministic=True.

q, out, dout, dq: [B, Sq, Hq, D(v)]; k, v, dk, dv: [B, Sk, Hk, D(v)]; lse, dlse: [B, Hq, Sq] (varlen: [total, H, D]
and [Hq, total_q], as in forward.py).
The math is docs/derivation.md#6-backward: delta = rowsum(dO * O) - dLSE, P = exp(S - LSE), dV = P^T dO,
dP = dO V^T, dS = P * (dP - delta), dQ = scale * dS K, dK = scale * dS^T Q; the features' terms (softcap's
1 - tanh^2, dropout's regenerated mask, the bias and sink gradients) are docs/derivation.md#8.
"""
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from . import _common, _launch, configs
from . import hopper_bwd
from ._common import (BIAS_BOOL, BIAS_FLOAT, LOG2E, BiasView, Config, CuSeqlens, Dropout, Heads, Scale, Seq,
                      _attention_mask, _block_list, _dropout_keep, _head_features, _key_range, _load_bias, _load_tile,
                      _mma, _query_block, _query_range, _score_mod, _score_unit, _seq_bounds, _head_views, _slice_view,
                      _store_tile, _streamed_block)
from ..request import AttentionRequest
from . import features
from .features import Features

# Delta and the log2 LSE are stored per (batch, head) padded to a multiple of this many rows (the largest query
# tile the backward uses), with LSE = +inf and delta = 0 in the padding: a streamed query tile that runs past Sq
# then needs no mask, since its P = exp2(s - inf) = 0. Varlen batches pad every sequence to the longest.
ROW_PAD = 128


class Strides(NamedTuple):
    """(batch, seqlen, head) strides of each [B, S, H, D] tensor (batch 0 for packed varlen tensors)."""
    q: tuple
    k: tuple
    v: tuple
    dout: tuple
    dq: tuple
    dk: tuple
    dv: tuple


class Rows(NamedTuple):
    """What the preprocess writes per query row: [B, H, pad] fp32, rows past Sq padded (ROW_PAD)."""
    lse_log2: object  # LSE in log2 units, +inf for a row that sees no key and in the padding
    delta: object  # rowsum(dO * O) - dLSE, 0 in the padding
    pad: int  # rows per (batch, head)


@triton.jit
def _zero_share(ptr, n, BLOCK: tl.constexpr = 1024):
    """Zero this program's share of ptr[0:n] (float32): the grid's programs, in launch order, take equal contiguous
    shares, so that together they zero all of it whatever rows they own. BLOCK elements per store: 8 a thread at
    the preprocess's 4 warps, one 32-byte store each."""
    programs = tl.num_programs(0) * tl.num_programs(1)
    p = tl.program_id(1) * tl.num_programs(0) + tl.program_id(0)
    share = tl.cdiv(tl.cdiv(n, programs), BLOCK) * BLOCK
    i = p * share
    stop = tl.minimum(i + share, n)
    while i < stop:  # (not `range`: Triton 3.6's interpreter cannot take these bounds)
        offs = i + tl.arange(0, BLOCK)
        tl.store(ptr + offs, tl.zeros([BLOCK], tl.float32), mask=offs < stop)
        i += BLOCK


@triton.jit
def _bwd_preprocess_kernel(Out, dOut, Lse, dLse, rows, CuSeqQ, DqAcc, total_q, strides, seqlen_q, num_heads,
                           delta_scale, HEAD_DIM_V: tl.constexpr, HAS_DLSE: tl.constexpr, VARLEN: tl.constexpr,
                           BLOCK_M: tl.constexpr, BLOCK_DV: tl.constexpr, ZERO_WIDTH: tl.constexpr):
    """Delta = rowsum(O * dO) (minus dLSE), times delta_scale (1, or the softmax scale for the Gluon kernel, whose
    dS carries it: kernels/hopper_bwd._bwd_step), and the LSE in log2 units, as Rows. strides: (out, dout) of
    (batch, seqlen, head) and (lse, dlse) of (batch, head). ZERO_WIDTH > 0: also zero the Gluon backward's dQ buffer
    DqAcc (float32, ZERO_WIDTH columns per row), which the kernel then adds into: one launch and one call fewer than
    a separate memset, the same bytes. Fixed-length: the program's rows (laid out as Rows'). Varlen ([total_q, heads,
    ZERO_WIDTH]): an equal share of the whole buffer per program (_zero_share), since rows outside every sequence
    (offsets that do not end at total_q, or lengths past max_seqlen_q) belong to no program and dQ copies them."""
    i_m = tl.program_id(0)
    i_bh = tl.program_id(1)
    i_b = i_bh // num_heads
    i_h = i_bh % num_heads
    starts, seq = _seq_bounds(CuSeqlens(CuSeqQ, CuSeqQ, total_q, total_q), i_b, Seq(seqlen_q, seqlen_q, 0), VARLEN)
    q_start = starts[0]
    o_m = i_m * BLOCK_M + tl.arange(0, BLOCK_M)
    o_d = tl.arange(0, BLOCK_DV)
    m_m = o_m < seq.seqlen_q
    m_md = m_m[:, None] & (o_d[None, :] < HEAD_DIM_V)
    p_rows = (q_start + o_m)[:, None].to(tl.int64)
    s_o, s_do, s_lse, s_dlse = strides
    p_o = Out + i_b.to(tl.int64) * s_o[0] + i_h.to(tl.int64) * s_o[2]
    p_do = dOut + i_b.to(tl.int64) * s_do[0] + i_h.to(tl.int64) * s_do[2]
    b_o = tl.load(p_o + p_rows * s_o[1] + o_d[None, :], mask=m_md, other=0.0)
    b_do = tl.load(p_do + p_rows * s_do[1] + o_d[None, :], mask=m_md, other=0.0)
    b_delta = tl.sum(b_o.to(tl.float32) * b_do.to(tl.float32), 1)  # [BLOCK_M]
    if HAS_DLSE:
        # A loss that also uses the LSE adds dLSE_i * P_ij to dS_ij (d lse_i / d s_ij = P_ij): fold it into delta.
        p_dlse = dLse + i_b.to(tl.int64) * s_dlse[0] + i_h.to(tl.int64) * s_dlse[1] + q_start
        b_delta -= tl.load(p_dlse + o_m, mask=m_m, other=0.0)
    p_lse = Lse + i_b.to(tl.int64) * s_lse[0] + i_h.to(tl.int64) * s_lse[1] + q_start
    b_lse = tl.load(p_lse + o_m, mask=m_m, other=float("-inf"))
    # A row that sees no key has LSE = -inf; +inf makes its P = exp2(s - inf) = 0 instead of exp2(-inf + inf) = NaN.
    b_lse_log2 = tl.where(b_lse == float("-inf"), float("inf"), b_lse * LOG2E)
    tl.store(rows.delta + i_bh.to(tl.int64) * rows.pad + o_m, b_delta * delta_scale)
    tl.store(rows.lse_log2 + i_bh.to(tl.int64) * rows.pad + o_m, b_lse_log2)
    if ZERO_WIDTH > 0 and VARLEN:
        _zero_share(DqAcc, (tl.zeros([], tl.int64) + total_q) * num_heads * ZERO_WIDTH)  # (total_q may be 1: constexpr)
    elif ZERO_WIDTH > 0:
        p_acc = DqAcc + (i_bh.to(tl.int64) * rows.pad + o_m)[:, None] * ZERO_WIDTH
        if ZERO_WIDTH == 192:  # (d192 and MLA: hopper_bwd.dq_width; 128 + 64 columns)
            tl.store(p_acc + tl.arange(0, 128)[None, :], tl.zeros([BLOCK_M, 128], tl.float32))
            tl.store(p_acc + 128 + tl.arange(0, 64)[None, :], tl.zeros([BLOCK_M, 64], tl.float32))
        else:
            tl.store(p_acc + tl.arange(0, ZERO_WIDTH)[None, :], tl.zeros([BLOCK_M, ZERO_WIDTH], tl.float32))


class Program(NamedTuple):
    """What the inner loop of one program reads, fixed for the program (or for one query head of a dK/dV program):
    the resident block's rows and tiles, and the streamed side's views."""
    start: int  # first row of the resident block (keys for dK/dV, queries for dQ)
    b_a: object  # resident tiles: k, v (dK/dV) or q, dO (dQ)
    b_b: object
    view_a: object  # streamed views: q, dO (dK/dV) or k, v (dQ)
    view_b: object
    row_stats: object  # (lse_log2, delta): dK/dV, pointers to the head's rows; dQ, the block's [BLOCK_M] values
    seq: object  # _common.Seq
    band: object  # _common.Band
    scale: object  # _common.Scale
    slope: float  # ALiBi slope of the query head (0 without)
    bias_view: object  # _common.BiasView of the head's attn_mask
    dbias_view: object  # DBIAS (dQ kernel): a BiasView of the head's dS output
    block_list: object  # BLOCK_SKIP: the list of streamed blocks to visit
    seed: object  # dropout's Philox key (0 without dropout)
    i_bh: int  # batch * heads + query head: dropout's counter
    dropout: object  # _common.Dropout, scale = 1 / (1 - p)


@triton.jit
def _recompute_p(b_s, b_lse, r_m, r_n, bias, prog, MASKED: tl.constexpr, FEAT: tl.constexpr,
                 KEY_BOUND: tl.constexpr):
    """P = exp2(S - LSE) from the raw products b_s, in either orientation (r_m, r_n and the attn_mask tile `bias`
    broadcast to b_s's shape); masked pairs get P = 0. Also returns tanh(s / softcap) for the softcap backward
    (b_s when unused)."""
    if FEAT.SOFTCAP or FEAT.HAS_ALIBI or FEAT.BIAS == BIAS_FLOAT:
        b_s, b_t = _score_mod(b_s, r_m, r_n, prog.scale, prog.slope, bias, prog.seq.diag, FEAT)
    else:
        b_t = b_s
    b_p = tl.exp2(b_s * _score_unit(prog.scale, FEAT) - b_lse)
    if MASKED or FEAT.BIAS == BIAS_BOOL:
        b_p = tl.where(_attention_mask(r_m, r_n, prog.seq, prog.band, bias, MASKED, FEAT.MASK_LEFT, FEAT.MASK_RIGHT,
                                       FEAT.BIAS, KEY_BOUND), b_p, 0.0)
    return b_p, b_t


@triton.jit
def _bwd_dkdv_inner(b_dk, b_dv, prog, lo, hi, MASKED: tl.constexpr, FEAT: tl.constexpr, CFG: tl.constexpr):
    """Accumulate dK, dV of prog's key block over the query blocks [lo, hi), in the transposed orientation
    (keys as rows) so that P^T and dS^T come out of the matmuls without a transpose. MASKED applies the band;
    rows past Sq need no mask (their padded LSE is +inf, so P = 0), nor do keys past Sk (their dK, dV rows are
    never stored and no other row depends on them)."""
    b_k, b_v, p_lse, p_delta = prog.b_a, prog.b_b, prog.row_stats[0], prog.row_stats[1]
    start_n = prog.start
    r_n = (start_n + tl.arange(0, CFG.BLOCK_N))[:, None]
    # BLOCK_SKIP: [lo, hi) indexes the list of query blocks a bool attn_mask lets this key block be seen by.
    for it in tl.range(lo, hi, 1 if FEAT.BLOCK_SKIP else CFG.BLOCK_M):
        start_m = _streamed_block(prog.block_list, it, CFG.BLOCK_M, FEAT.BLOCK_SKIP)
        o_m = start_m + tl.arange(0, CFG.BLOCK_M)
        r_m = o_m[None, :]
        b_q = _load_tile(prog.view_a, start_m, CFG.HEAD_DIM, CFG.BLOCK_M, CFG.BLOCK_D, CFG.USE_TMA)
        b_lse = tl.load(p_lse + o_m)  # [BLOCK_M] log2 units, padded rows +inf
        b_st = _mma(b_k, tl.trans(b_q), None, CFG.PRECISION, CFG.DOT_UPCAST)  # [BLOCK_N, BLOCK_M]
        bias = 0.0
        if FEAT.BIAS:
            bias = _load_bias(prog.bias_view, start_m, start_n, FEAT.BIAS_TMA, CFG.BLOCK_M, CFG.BLOCK_N, True)
        b_pt, b_tt = _recompute_p(b_st, b_lse[None, :], r_m, r_n, bias, prog, MASKED, FEAT, False)
        b_do = _load_tile(prog.view_b, start_m, CFG.HEAD_DIM_V, CFG.BLOCK_M, CFG.BLOCK_DV, CFG.USE_TMA)
        b_dpt = _mma(b_v, tl.trans(b_do), None, CFG.PRECISION, CFG.DOT_UPCAST)  # [BLOCK_N, BLOCK_M]
        if FEAT.DROPOUT:
            # The forward's mask, regenerated: dV sums the kept, rescaled P; dP flows back only through them.
            keep = _dropout_keep(prog.seed, prog.i_bh, start_m, start_n, prog.dropout.threshold, CFG.BLOCK_M,
                                 CFG.BLOCK_N, True)
            b_dv = _mma(tl.where(keep, b_pt * prog.dropout.scale, 0.0).to(b_do.dtype), b_do, b_dv, CFG.PRECISION,
                        CFG.DOT_UPCAST)
            b_dpt = tl.where(keep, b_dpt * prog.dropout.scale, 0.0)
        else:
            b_dv = _mma(b_pt.to(b_do.dtype), b_do, b_dv, CFG.PRECISION, CFG.DOT_UPCAST)  # [BLOCK_N, BLOCK_DV]
        b_delta = tl.load(p_delta + o_m)  # [BLOCK_M]
        b_dst = b_pt * (b_dpt - b_delta[None, :])  # [BLOCK_N, BLOCK_M]
        if FEAT.SOFTCAP:
            b_dst = b_dst * (1.0 - b_tt * b_tt)
        b_dk = _mma(b_dst.to(b_q.dtype), b_q, b_dk, CFG.PRECISION, CFG.DOT_UPCAST)  # [BLOCK_N, BLOCK_D]
    return b_dk, b_dv


@triton.jit
def _bwd_dkdv_kernel(Q, K, V, dOut, dK, dV, rows, strides, seq, cu_seqlens, heads, band, scale, alibi, bias, blocks,
                     dropout, FEAT: tl.constexpr, CFG: tl.constexpr):
    """One program per (key block, batch * kv head). Argument groups: Rows and Strides above, the others
    _common's (heads: kv heads and the group size)."""
    i_n = tl.program_id(0)
    i_bhk = tl.program_id(1)
    i_b = i_bhk // heads.num_heads
    i_hk = i_bhk % heads.num_heads
    start_n = i_n * CFG.BLOCK_N
    starts, seq = _seq_bounds(cu_seqlens, i_b, seq, FEAT.VARLEN)
    if start_n < seq.seqlen_k:  # a varlen grid covers the longest sequence
        k_view, v_view = _head_views(K, V, strides.k, strides.v, i_b, starts[1], i_hk, seq.seqlen_k, CFG.BLOCK_N,
                                     CFG)
        b_k = _load_tile(k_view, start_n, CFG.HEAD_DIM, CFG.BLOCK_N, CFG.BLOCK_D, CFG.USE_TMA)
        b_v = _load_tile(v_view, start_n, CFG.HEAD_DIM_V, CFG.BLOCK_N, CFG.BLOCK_DV, CFG.USE_TMA)
        b_dk = tl.zeros([CFG.BLOCK_N, CFG.BLOCK_D], tl.float32)
        b_dv = tl.zeros([CFG.BLOCK_N, CFG.BLOCK_DV], tl.float32)
        seed = 0
        if FEAT.DROPOUT:
            seed = tl.load(dropout.seed)

        lo, hi = _query_range(start_n, seq, band, FEAT.MASK_LEFT, FEAT.MASK_RIGHT, CFG.BLOCK_M, CFG.BLOCK_N)
        # Grouped-query attention: this program owns the kv head, so it sums the grads of all its query heads in
        # registers -- no atomics, and the order of the sum is fixed.
        for g in range(0, heads.group_size):
            i_h = i_hk * heads.group_size + g
            i_bh = i_b * heads.num_heads * heads.group_size + i_h
            q_view, do_view = _head_views(Q, dOut, strides.q, strides.dout, i_b, starts[0], i_h, seq.seqlen_q,
                                          CFG.BLOCK_M, CFG)
            row0 = i_bh.to(tl.int64) * rows.pad
            slope, bias_view = _head_features(alibi, bias, i_b, i_h, seq, FEAT, CFG.BLOCK_M, CFG.BLOCK_N)
            if FEAT.BLOCK_SKIP:
                block_list, n_listed = _block_list(blocks, i_b, i_h, i_n)
                lo_h, hi_h = 0, n_listed
            else:
                block_list, lo_h, hi_h = blocks.indices, lo, hi
            prog = Program(start_n, b_k, b_v, q_view, do_view, (rows.lse_log2 + row0, rows.delta + row0), seq, band,
                           scale, slope, bias_view, bias_view, block_list, seed, i_bh, dropout)
            # One loop over the query blocks that see the key block, the band's mask applied to each: measured 5%
            # faster at d128 causal on an H200 than a masked diagonal stage plus an unmasked loop (388 -> 409
            # TFLOP/s, docs/design-record.md, "Backward: dK/dV as one masked loop"); the likely cause is code size: two
            # copies of this 4-matmul body inside the head loop. The compare-select costs less.
            b_dk, b_dv = _bwd_dkdv_inner(b_dk, b_dv, prog, lo_h, hi_h, FEAT.MASK_LEFT or FEAT.MASK_RIGHT, FEAT,
                                         CFG)

        dk_view, dv_view = _head_views(dK, dV, strides.dk, strides.dv, i_b, starts[1], i_hk, seq.seqlen_k,
                                       CFG.BLOCK_N, CFG)
        _store_tile(dk_view, (b_dk * scale.sm_scale).to(dK.dtype.element_ty), start_n, CFG.HEAD_DIM, CFG.BLOCK_N,
                    CFG.BLOCK_D, CFG.USE_TMA)
        _store_tile(dv_view, b_dv.to(dV.dtype.element_ty), start_n, CFG.HEAD_DIM_V, CFG.BLOCK_N, CFG.BLOCK_DV,
                    CFG.USE_TMA)


@triton.jit
def _bwd_dq_inner(b_dq, prog, lo, hi, MASKED: tl.constexpr, FEAT: tl.constexpr, CFG: tl.constexpr):
    """Accumulate dQ of prog's query block over the key blocks [lo, hi); with DBIAS also write dS, the gradient of
    an additive bias."""
    b_q, b_do, b_lse, b_delta = prog.b_a, prog.b_b, prog.row_stats[0], prog.row_stats[1]
    start_m = prog.start
    o_m = start_m + tl.arange(0, CFG.BLOCK_M)
    r_m = o_m[:, None]
    # BLOCK_SKIP: [lo, hi) indexes the list of key blocks a bool attn_mask lets this query block see.
    for it in tl.range(lo, hi, 1 if FEAT.BLOCK_SKIP else CFG.BLOCK_N):
        start_n = _streamed_block(prog.block_list, it, CFG.BLOCK_N, FEAT.BLOCK_SKIP)
        r_n = (start_n + tl.arange(0, CFG.BLOCK_N))[None, :]
        b_k = _load_tile(prog.view_a, start_n, CFG.HEAD_DIM, CFG.BLOCK_N, CFG.BLOCK_D, CFG.USE_TMA)
        b_v = _load_tile(prog.view_b, start_n, CFG.HEAD_DIM_V, CFG.BLOCK_N, CFG.BLOCK_DV, CFG.USE_TMA)
        b_s = _mma(b_q, tl.trans(b_k), None, CFG.PRECISION, CFG.DOT_UPCAST)  # [BLOCK_M, BLOCK_N]
        # Keys past Sk read as 0, which would give them P = exp2(-lse) (possibly inf): the masked stage drops
        # them with the band.
        bias = 0.0
        if FEAT.BIAS:
            bias = _load_bias(prog.bias_view, start_m, start_n, FEAT.BIAS_TMA, CFG.BLOCK_M, CFG.BLOCK_N, False)
        b_p, b_t = _recompute_p(b_s, b_lse[:, None], r_m, r_n, bias, prog, MASKED, FEAT, True)
        b_dp = _mma(b_do, tl.trans(b_v), None, CFG.PRECISION, CFG.DOT_UPCAST)  # [BLOCK_M, BLOCK_N]
        if FEAT.DROPOUT:
            keep = _dropout_keep(prog.seed, prog.i_bh, start_m, start_n, prog.dropout.threshold, CFG.BLOCK_M,
                                 CFG.BLOCK_N, False)
            b_dp = tl.where(keep, b_dp * prog.dropout.scale, 0.0)
        b_ds = b_p * (b_dp - b_delta[:, None])  # [BLOCK_M, BLOCK_N]
        if FEAT.DBIAS:
            # The bias is added after the softcap, so its gradient is dS itself.
            dbias = prog.dbias_view
            tl.store(dbias.handle + r_m.to(tl.int64) * dbias.stride_m + r_n * dbias.stride_n,
                     b_ds.to(dbias.handle.dtype.element_ty),
                     mask=(r_m < dbias.seq.seqlen_q) & (r_n < dbias.seq.seqlen_k))
        if FEAT.SOFTCAP:
            b_ds = b_ds * (1.0 - b_t * b_t)
        b_dq = _mma(b_ds.to(b_k.dtype), b_k, b_dq, CFG.PRECISION, CFG.DOT_UPCAST)  # [BLOCK_M, BLOCK_D]
    return b_dq


@triton.jit
def _bwd_dq_kernel(Q, K, V, dOut, dQ, rows, strides, seq, cu_seqlens, heads, band, scale, alibi, bias, blocks,
                   dbias, dropout, FEAT: tl.constexpr, CFG: tl.constexpr):
    """One program per (query block, batch * head). Argument groups: Rows and Strides above, the others _common's
    (dbias: a Bias, the [B, H, Sq, Sk] output of dS under DBIAS)."""
    i_m, i_bh, i_b, i_h, i_hk, starts, seq = _query_block(heads, cu_seqlens, seq, FEAT, CFG.BLOCK_M)
    start_m = i_m * CFG.BLOCK_M
    if start_m < seq.seqlen_q:
        q_view, do_view = _head_views(Q, dOut, strides.q, strides.dout, i_b, starts[0], i_h, seq.seqlen_q,
                                      CFG.BLOCK_M, CFG)
        k_view, v_view = _head_views(K, V, strides.k, strides.v, i_b, starts[1], i_hk, seq.seqlen_k, CFG.BLOCK_N,
                                     CFG)
        b_q = _load_tile(q_view, start_m, CFG.HEAD_DIM, CFG.BLOCK_M, CFG.BLOCK_D, CFG.USE_TMA)
        b_do = _load_tile(do_view, start_m, CFG.HEAD_DIM_V, CFG.BLOCK_M, CFG.BLOCK_DV, CFG.USE_TMA)
        o_m = start_m + tl.arange(0, CFG.BLOCK_M)
        b_lse = tl.load(rows.lse_log2 + i_bh.to(tl.int64) * rows.pad + o_m)  # [BLOCK_M]
        b_delta = tl.load(rows.delta + i_bh.to(tl.int64) * rows.pad + o_m)  # [BLOCK_M]
        b_dq = tl.zeros([CFG.BLOCK_M, CFG.BLOCK_D], tl.float32)
        slope, bias_view = _head_features(alibi, bias, i_b, i_h, seq, FEAT, CFG.BLOCK_M, CFG.BLOCK_N)
        p_dbias = dbias.ptr + i_b.to(tl.int64) * dbias.strides[0] + i_h.to(tl.int64) * dbias.strides[1]
        seed = 0
        if FEAT.DROPOUT:
            seed = tl.load(dropout.seed)

        if FEAT.BLOCK_SKIP:
            block_list, n_listed = _block_list(blocks, i_b, i_h, i_m)
        else:
            block_list = blocks.indices
        prog = Program(start_m, b_q, b_do, k_view, v_view, (b_lse, b_delta), seq, band, scale, slope, bias_view,
                       BiasView(p_dbias, seq, dbias.strides[2], dbias.strides[3]), block_list, seed, i_bh, dropout)
        if FEAT.BLOCK_SKIP:
            # One masked loop over the listed key blocks (a bool attn_mask comes without a band).
            b_dq = _bwd_dq_inner(b_dq, prog, 0, n_listed, True, FEAT, CFG)
        else:
            lo, full_lo, full_hi, hi = _key_range(start_m, seq, band, FEAT.MASK_LEFT, FEAT.MASK_RIGHT, CFG.BLOCK_M,
                                                  CFG.BLOCK_N)
            if FEAT.MASK_LEFT:  # the stages of the forward
                b_dq = _bwd_dq_inner(b_dq, prog, lo, tl.minimum(full_lo, hi), True, FEAT, CFG)
            b_dq = _bwd_dq_inner(b_dq, prog, full_lo, full_hi, False, FEAT, CFG)
            if not CFG.EVEN_N:  # as in the forward: no masked stage when nothing needs a mask
                b_dq = _bwd_dq_inner(b_dq, prog, tl.maximum(full_lo, full_hi), hi, True, FEAT, CFG)

        dq_view = _slice_view(dQ, strides.dq, i_b, starts[0], i_h, seq.seqlen_q, CFG.HEAD_DIM, CFG.BLOCK_M,
                              CFG.BLOCK_D, CFG.USE_TMA)
        _store_tile(dq_view, (b_dq * scale.sm_scale).to(dQ.dtype.element_ty), start_m, CFG.HEAD_DIM, CFG.BLOCK_M,
                    CFG.BLOCK_D, CFG.USE_TMA)


# The request fields a varlen plan swaps in per call (BwdPlan.varlen_fargs).
_OFFSETS = frozenset(("cu_seqlens_q", "cu_seqlens_k"))
# Rows per preprocess program: a light, memory-bound pass; 128 divides ROW_PAD.
_PREPROCESS_BLOCK_M = 128


def attention_backward(dout, q, k, v, out, lse, dlse, req: AttentionRequest, gluon=False, dq=None, dk=None,
                       dv=None, bias_grad=False):
    """Launch the backward of one request: the preprocess, then the Hopper Gluon kernel (gluon=True: the dispatch
    chose it, flashtile/dispatch.py) or the portable dK/dV and dQ kernels. Returns (dq, dk, dv, dbias, dsinks).

    dlse (optional, lse's shape) is the gradient reaching the returned LSE. dq, dk, dv may be given: buffers (views
    of one packed gradient, for the packed APIs; float32 ones for context parallelism) that the kernels write in
    full. bias_grad: also return the gradient of req.attn_bias (a float bias), summed over its broadcast
    dimensions; dsinks is returned when req.sinks is set. The portable kernels use no atomics: their gradients are
    bit-identical run to run. Inputs are assumed validated.
    """
    return plan_backward(dout, q, k, v, out, lse, dlse, req, gluon, (dq, dk, dv), bias_grad)[1:]


class BwdPlan:
    """The backward launches of one plan key (flashtile/dispatch.py), everything but the call's tensors fixed, as
    forward.FwdPlan: the preprocess, then the Gluon kernel's plan (hopper_bwd.GluonBwdPlan) or the portable dK/dV
    and dQ launches with the tiles that compiled (_launch.Bound each). run allocates the rows and the gradients
    not given, takes the feature tensors from the request, launches, and returns (dq, dk, dv, dbias, dsinks)."""
    __slots__ = ("device", "pad", "rows_shape", "preprocess", "gluon", "dkdv", "dq", "groups", "fargs", "lengths",
                 "use_tma", "tiles", "dropout_scalars", "full_shape", "bias_grad", "dbias_dtype", "delta_scale",
                 "varlen_fargs")

    def run(self, dout, q, k, v, out, lse, dlse, req, grads, dq_addend=None):
        """(dq, dk, dv, dbias, dsinks) of a call with this plan's key (dq_addend: the Gluon kernel's only, see
        plan_backward)."""
        stream = _launch.stream_for(q.get_device())
        call = self.prepare(stream, dout, q, k, v, out, lse, dlse, req, grads, dq_addend)
        if self.gluon is None:
            self.launch_dkdv(stream, call)
            self.launch_dq(stream, call)
        return self.finish(call)

    def prepare(self, stream, dout, q, k, v, out, lse, dlse, req, grads, dq_addend=None):
        """Allocate the call's buffers and launch the preprocess (and the Gluon kernel) -> the call's _BwdCall."""
        device = self.device
        call = _BwdCall()
        call.req, call.tensors = req, (q, k, v, dout)
        call.rows = Rows(_common.empty(self.rows_shape, torch.float32, device),
                         _common.empty(self.rows_shape, torch.float32, device), self.pad)
        dq, dk, dv = grads
        call.grads = (_common.empty(q.shape, q.dtype, device) if dq is None else dq,
                      _common.empty(k.shape, k.dtype, device) if dk is None else dk,
                      _common.empty(v.shape, v.dtype, device) if dv is None else dv)
        fargs = self.fargs
        if fargs is None and self.varlen_fargs is not None:  # its only tensors are the varlen offsets
            fargs = self.varlen_fargs.with_offsets(req.cu_seqlens_q, req.cu_seqlens_k)
        elif fargs is None:  # the request has tensors of its own (offsets, slopes, mask, sinks, seed)
            fargs = Features(req).kernel_args(q, self.use_tma, *self.lengths)
        call.fargs = fargs
        if self.use_tma:
            configs._set_tma_allocator(device)
        # The preprocess reads lse and dlse as rows of unit stride; they are small, so copy any other layout
        # (autograd hands an expanded, stride-0 dlse for lse.sum()). dlse: lse stands in when there is none.
        lse = lse.contiguous()
        # The Gluon kernel's dQ buffer, zeroed by the preprocess (_preprocess_launch's zero_width).
        dq_acc = None
        if self.gluon is not None:
            dq_acc = self.gluon.dq_buffer(True)
        self.preprocess(stream, out, dout, lse, lse if dlse is None else dlse.contiguous(), call.rows,
                        fargs.cu_seqlens.q, lse if dq_acc is None else dq_acc)
        call.dbias_full = None
        if self.gluon is not None:
            call.dbias_full = _gluon_dbias(req, self.full_shape, device) if self.bias_grad else None
            self.gluon.run(stream, q, k, v, dout, *call.grads, call.rows.lse_log2, call.rows.delta, req,
                           call.dbias_full, dq_addend, dq_acc)
            return call
        assert dq_addend is None, "the portable kernels store dQ: flashtile/dispatch.backward adds dq_addend"
        # The bias gradient is dS, written whole by the dQ kernel ([B, H, Sq, Sk]) and summed over the bias's
        # broadcast dimensions here; tiles the kernel skips (outside the band, fully masked) stay 0.
        call.dbias = fargs.bias._replace(strides=(0, 0, 0, 0))  # a placeholder, never written without DBIAS
        if self.bias_grad:
            call.dbias_full = torch.zeros(self.full_shape, dtype=self.dbias_dtype, device=device)
            call.dbias = call.dbias._replace(ptr=call.dbias_full, strides=call.dbias_full.stride())
        return call

    def _blocks(self, call, transpose):
        # A bool attn_mask's block lists for the launch's tiles (values of the mask: per call), or the placeholder.
        if self.fargs is None:
            blocks = Features(call.req).block_lists(*self.tiles[not transpose], transpose, *self.lengths[:2])
            if blocks is not None:
                return blocks
        return call.fargs.no_blocks

    def launch_dkdv(self, stream, call):
        strides, seq, kv_heads, _, band, scale = self.groups
        fargs = call.fargs
        return self.dkdv(stream, *call.tensors, *call.grads[1:], call.rows, strides, seq, fargs.cu_seqlens, kv_heads,
                         band, scale, fargs.alibi, fargs.bias, self._blocks(call, True),
                         Dropout(fargs.seed, *self.dropout_scalars))

    def launch_dq(self, stream, call):
        strides, seq, _, heads, band, scale = self.groups
        fargs = call.fargs
        return self.dq(stream, *call.tensors, call.grads[0], call.rows, strides, seq, fargs.cu_seqlens, heads, band,
                       scale, fargs.alibi, fargs.bias, self._blocks(call, False), call.dbias,
                       Dropout(fargs.seed, *self.dropout_scalars))

    def finish(self, call):
        rows, req = call.rows, call.req
        return (*call.grads, _reduce_dbias(call.dbias_full, req),
                _sinks_grad(req, rows.lse_log2, rows.delta, self.delta_scale))


class _BwdCall:
    """One backward call's buffers and feature arguments, between BwdPlan's steps."""
    __slots__ = ("req", "tensors", "rows", "grads", "fargs", "dbias_full", "dbias")


def _bwd_plan(spec, q, k, v, dout, out, lse, dlse, req, gluon, grads, bias_grad):
    """The BwdPlan of (q, k, v, req) but its portable launches (_bind_dkdv / _bind_dq bind them with their tiles);
    with it, the flags of those launches."""
    feats = Features(req)
    seqlen_q, num_heads, num_kv_heads = q.shape[-3], q.shape[-2], k.shape[-2]
    seqlen_k, head_dim_v = k.shape[-3], v.shape[-1]
    batch = req.cu_seqlens_q.numel() - 1 if req.varlen else q.shape[0]
    if req.varlen:
        seqlen_q, seqlen_k = req.max_seqlen_q, req.max_seqlen_k
    plan = BwdPlan()
    plan.device, plan.use_tma, plan.bias_grad = q.device, spec.use_tma, bias_grad
    plan.pad = triton.cdiv(max(seqlen_q, 1), ROW_PAD) * ROW_PAD
    plan.rows_shape = (batch, num_heads, plan.pad)
    plan.lengths = (seqlen_q, seqlen_k, k.shape[0])
    fargs = feats.kernel_args(q, spec.use_tma, *plan.lengths)
    tensors = req.tensors()
    plan.fargs = None if tensors else fargs
    # A request whose only tensors are the varlen offsets (the plan key says which are set, so every call of this
    # plan's) takes these arguments with the call's offsets swapped in.
    plan.varlen_fargs = fargs if tensors and {name for name, _ in tensors} <= _OFFSETS else None
    plan.full_shape = (batch, num_heads, seqlen_q, seqlen_k)
    plan.delta_scale = req.softmax_scale if gluon else 1.0  # the Gluon kernel wants delta in its scaled dS's units
    plan.gluon = hopper_bwd.gluon_plan(q, k, v, dout, grads, plan.rows_shape, req, bias_grad) if gluon else None
    # The preprocess zeroes the Gluon kernel's dQ buffer (fixed-length: its rows are Rows' rows; varlen: [total_q,
    # heads, the tile width]).
    zero_width = 0
    if gluon:
        zero_width = plan.gluon.acc_shape[-1] if req.varlen else hopper_bwd.dq_width(q.shape[-1])
    plan.preprocess = _preprocess_launch(out, dout, lse, dlse, req.varlen, seqlen_q, batch, plan.delta_scale,
                                         spec.block_d(head_dim_v), plan.pad, zero_width)
    plan.dbias_dtype = None
    if bias_grad and not gluon:
        plan.dbias_dtype = req.attn_bias.dtype if tuple(req.attn_bias.shape) == plan.full_shape else torch.float32
    # The gradients not given are allocated contiguous.
    grad_strides = [_common.contiguous_strides(t.shape) if g is None else g.stride() for t, g in zip((q, k, v), grads)]
    plan.groups = (Strides(*(_common.batch_strides(t, req.varlen) for t in (q, k, v, dout)),
                           *(_batch_strides(st, req.varlen) for st in grad_strides)),
                   Seq(seqlen_q, seqlen_k, req.diagonal_offset), Heads(num_kv_heads, num_heads // num_kv_heads),
                   Heads(num_heads, num_heads // num_kv_heads), feats.band,
                   Scale(req.softmax_scale, req.softmax_scale * LOG2E.value, req.softcap))
    plan.dropout_scalars = (fargs.dropout_threshold, 1.0 / (1.0 - req.dropout_p))
    plan.tiles = ((0, 0), (0, 0))
    return plan, fargs.flags._replace(HAS_SINKS=False)  # the sinks' gradient is _sinks_grad's


def _batch_strides(strides, varlen):
    # _common.batch_strides of a tensor with these strides.
    return (0,) + tuple(strides[:2]) if varlen else tuple(strides[:3])


def _config(spec, q, v, cfg, even_n):
    head_dim, head_dim_v = q.shape[-1], v.shape[-1]
    return Config(head_dim, head_dim_v, cfg.block_m, cfg.block_n, spec.block_d(head_dim), spec.block_d(head_dim_v),
                  even_n, spec.use_tma, spec.precision, spec.dot_upcast)


def _bind_dkdv(plan, spec, q, k, v, req, flags, cfg):
    plan.tiles = ((cfg.block_m, cfg.block_n), plan.tiles[1])
    batch, seqlen_k = plan.rows_shape[0], plan.lengths[1]
    plan.dkdv = _launch.Bound(
        _bwd_dkdv_kernel, (triton.cdiv(seqlen_k, cfg.block_n), batch * k.shape[-2]), (),
        _common.constexpr_groups(FEAT=flags._replace(BLOCK_SKIP=Features(req).bias_kind == features.BIAS_BOOL),
                                 CFG=_config(spec, q, v, cfg, False)),
        dict(num_warps=cfg.num_warps, num_stages=cfg.num_stages))


def _bind_dq(plan, spec, q, k, v, req, flags, cfg):
    plan.tiles = (plan.tiles[0], (cfg.block_m, cfg.block_n))
    batch, seqlen_q, seqlen_k = plan.rows_shape[0], plan.lengths[0], plan.lengths[1]
    even_n = not req.banded and not req.varlen and seqlen_k % cfg.block_n == 0
    plan.dq = _launch.Bound(
        _bwd_dq_kernel, (triton.cdiv(seqlen_q, cfg.block_m), batch * q.shape[-2]), (),
        _common.constexpr_groups(FEAT=flags._replace(BLOCK_SKIP=Features(req).bias_kind == features.BIAS_BOOL,
                                                     DBIAS=plan.bias_grad), CFG=_config(spec, q, v, cfg, even_n)),
        dict(num_warps=cfg.num_warps, num_stages=cfg.num_stages))


def plan_backward(dout, q, k, v, out, lse, dlse, req: AttentionRequest, gluon=False, grads=(None, None, None),
                  bias_grad=False, dq_addend=None):
    """(BwdPlan, dq, dk, dv, dbias, dsinks): the plan of this call's key, its tiles the first candidates that compile
    (the dK/dV kernel's on its launch, then the dQ kernel's on its own), and the call's gradients
    (attention_backward's arguments; grads: the given (dq, dk, dv) buffers, None where not given). flashtile/dispatch
    keeps the plan for later calls with the same key. dq_addend (gluon only): None, or a float32 tensor shaped like
    q that dQ is added to in float32 before it is rounded into dq (the Gluon kernel's dQ pass reads it; the
    portable kernels store dQ as they compute it, so flashtile/dispatch adds it after them)."""
    stream = _launch.stream_for(q.get_device())
    # The gradients the plan allocates (contiguous) join the TMA check as tensors without storage.
    spec = configs.launch_spec(q, (q, k, v, dout) + tuple(
        torch.empty(t.shape, dtype=t.dtype, device="meta") if g is None else g for t, g in zip((q, k, v), grads)))
    plan, flags = _bwd_plan(spec, q, k, v, dout, out, lse, dlse, req, gluon, grads, bias_grad)
    call = plan.prepare(stream, dout, q, k, v, out, lse, dlse, req, grads, dq_addend)
    if not gluon:
        head_dim = max(q.shape[-1], v.shape[-1])
        dkdv_candidates, dq_candidates = configs.backward_candidates(head_dim, req.mask_right, q.dtype, spec)
        key = (head_dim, req.mask_right, q.dtype, spec, Features(req).variant() + (bias_grad, flags.BIAS_TMA))

        def launch_dkdv(cfg):
            _bind_dkdv(plan, spec, q, k, v, req, flags, cfg)
            return plan.launch_dkdv(stream, call)

        def launch_dq(cfg):
            _bind_dq(plan, spec, q, k, v, req, flags, cfg)
            return plan.launch_dq(stream, call)

        configs.launch_first_that_compiles(("bwd_dkdv",) + key, dkdv_candidates, launch_dkdv)
        configs.launch_first_that_compiles(("bwd_dq",) + key, dq_candidates, launch_dq)
    return (plan,) + plan.finish(call)


def _preprocess_launch(out, dout, lse, dlse, varlen, seqlen_q, batch, delta_scale, block_dv, pad, zero_width=0):
    """The bound launch of _bwd_preprocess_kernel (Rows from out, dout, lse and dlse; None: no LSE gradient); its call
    takes (stream, out, dout, lse, dlse or lse, rows, cu_seqlens_q, dq buffer), lse and dlse made contiguous.
    zero_width > 0: the dq buffer (the Gluon kernel's, zero_width columns per row) is zeroed; otherwise it is a
    placeholder, never read."""
    lse_strides = _common.contiguous_strides(lse.shape)
    if varlen:
        row_strides = [(0, lse_strides[0]), (0, lse_strides[0]) if dlse is not None else (0, 0)]
    else:
        row_strides = [lse_strides[:2], lse_strides[:2] if dlse is not None else (0, 0)]
    num_heads = out.shape[-2]
    strides = (_common.batch_strides(out, varlen), _common.batch_strides(dout, varlen), *row_strides)
    return _launch.Bound(
        _bwd_preprocess_kernel, (pad // _PREPROCESS_BLOCK_M, batch * num_heads),
        (out.shape[0] if varlen else 0, strides, seqlen_q, num_heads, delta_scale),
        dict(HEAD_DIM_V=out.shape[-1], HAS_DLSE=dlse is not None, VARLEN=varlen, BLOCK_M=_PREPROCESS_BLOCK_M,
             BLOCK_DV=block_dv, ZERO_WIDTH=zero_width), {}, background=True)


def _gluon_dbias(req, full_shape, device):
    """The bias-gradient buffer of the Hopper Gluon backward (kernels/hopper_bwd.py: 16-bit, d 64/128; an attn_mask
    is read by TMA, not with dropout; varlen batches come without one), which reads delta and lse_log2 as the
    portable kernels do (Rows, varlen rows by position in the sequence). Its bias gradient is dS in the bias's
    dtype, whatever the bias's shape (hopper_bwd.attention_backward's DBIAS note), with rows padded to TMA's 16
    bytes; only a band leaves tiles unwritten."""
    dtype = req.attn_bias.dtype
    seqlen_k = full_shape[3]
    row = triton.cdiv(seqlen_k, 16 // dtype.itemsize) * (16 // dtype.itemsize)
    shape = full_shape[:3] + (row,)
    if req.banded:
        dbias_full = torch.zeros(shape, dtype=dtype, device=device)
    else:
        dbias_full = _common.empty(shape, dtype, device)
    return dbias_full[..., :seqlen_k]


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


def _reduce_dbias(dbias_full, req):
    """The bias's gradient from dS over [B, H, Sq, Sk] (None without one): summed over the bias's broadcast
    dimensions in fp32, in the bias's dtype. A sum over batch and/or heads is one pass of _dbias_sum_kernel (torch's
    16-bit sum over a strided dim of 16, returning fp32 for the cast, took 5.0 ms for the Gluon backward's [1, 16,
    16k, 16k] bf16 on an H200: docs/design-record.md, "The bias gradient and its sum over broadcast dims"); a bias
    broadcast along Sq or Sk is summed by torch."""
    if dbias_full is None:
        return None
    bias = req.attn_bias
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


def _sinks_grad(req, lse_log2, delta, delta_scale=1.0):
    """The sinks' gradient (None without sinks): d loss / d sink_h = -sum_{b, i} P_sink(b, h, i) * delta(b, h, i),
    P_sink = exp(sink - lse) (docs/derivation.md#8); padded rows have lse = +inf, so they add 0. delta: as the
    preprocess stored it, times delta_scale."""
    if req.sinks is None:
        return None
    p_sink = torch.exp2(req.sinks.float()[None, :, None] * LOG2E.value - lse_log2)
    return -(p_sink * delta).sum(dim=(0, 2)) / delta_scale
