"""Attention forward, FA2 loop order: one program per (query block, batch * head), streaming K/V blocks.

q: [B, Sq, Hq, D]; k: [B, Sk, Hk, D]; v: [B, Sk, Hk, Dv]; out: [B, Sq, Hq, Dv]; lse: [B, Hq, Sq] fp32, natural
log. Variable length (VARLEN): q, k, v, out are [total, H, D] packed sequences delimited by cu_seqlens and lse is
[Hq, total_q], flash-attn's layouts.
The math is docs/derivation.md#4-tiled-attention-fa1-and-fa2-loop-orders; the exp2 and causal-stage tricks are
docs/derivation.md#5-kernel-tricks-exp2-and-the-causal-stages; the masks, score modifications, sinks and dropout
are docs/derivation.md#8. Every feature is a constexpr: a launch without it compiles none of its code.
"""
import torch
import triton
import triton.language as tl

from . import _common, _launch, configs, hopper_fwd
from ._common import (LN2, LOG2E, _dropout_keep, _head_features, _key_range, _load_bias, _load_tile, _mma, _mod_unit,
                      _score_mod, _seq_bounds, _slice_base, _store_tile, _tile_view, _visible)
from .features import Features


@triton.jit
def _attn_fwd_inner(acc, l_i, m_i, b_q, k_view, v_view, start_m, lo, hi, seqlen_q, seqlen_k, stride_ks, stride_vs,
                    diag_offset, sm_scale, qk_scale, window_left, window_right, softcap, slope,
                    p_bias, stride_bias_m, stride_bias_n, p_block_list, seed, i_bh, dropout_threshold,
                    MASKED: tl.constexpr, MASK_LEFT: tl.constexpr, MASK_RIGHT: tl.constexpr,
                    SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr, BIAS: tl.constexpr, BLOCK_SKIP: tl.constexpr,
                    DROPOUT: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
                    USE_TMA: tl.constexpr, PRECISION: tl.constexpr, DOT_UPCAST: tl.constexpr,
                    WARP_SPECIALIZE: tl.constexpr):
    """Online softmax over the key blocks [lo, hi); m_i and the exponents are in log2 units.

    Without score modifications the max is taken on the raw scores and scaled after (qk_scale = scale * log2(e)
    > 0, the launcher's contract), so that s * qk_scale - m is one fused multiply-add per score: at head dim 64
    the softmax's elementwise work is a large share of the loop. With softcap, ALiBi or a float bias the scores
    are built by _score_mod, already in log2 units."""
    o_m = start_m + tl.arange(0, BLOCK_M)
    r_m = o_m[:, None]
    # log2 units per unit of score: scale * log2(e) on the raw products, or _score_mod's unit.
    if SOFTCAP or HAS_ALIBI or BIAS % 2 == 1:
        unit = _mod_unit(sm_scale, softcap, SOFTCAP, HAS_ALIBI, BIAS)
    else:
        unit = qk_scale
    # BLOCK_SKIP: [lo, hi) indexes the list of key blocks a bool attn_mask lets this query block see
    # (Features.block_lists); fully masked tiles are not in it.
    for it in tl.range(lo, hi, 1 if BLOCK_SKIP else BLOCK_N, warp_specialize=WARP_SPECIALIZE):
        if BLOCK_SKIP:
            start_n = tl.load(p_block_list + it) * BLOCK_N
        else:
            start_n = it
        r_n = (start_n + tl.arange(0, BLOCK_N))[None, :]
        b_k = _load_tile(k_view, start_n, seqlen_k, stride_ks, HEAD_DIM, BLOCK_N, BLOCK_D, USE_TMA)
        b_s = _mma(b_q, tl.trans(b_k), None, PRECISION, DOT_UPCAST)  # [BLOCK_M, BLOCK_N], unscaled
        bias = 0.0
        if BIAS:
            bias = _load_bias(p_bias, start_m, start_n, seqlen_q, seqlen_k, stride_bias_m, stride_bias_n, BIAS,
                              BLOCK_M, BLOCK_N, False)
        if SOFTCAP or HAS_ALIBI or BIAS % 2 == 1:
            b_s, _ = _score_mod(b_s, r_m, r_n, sm_scale, softcap, slope, bias, diag_offset, SOFTCAP, HAS_ALIBI,
                                BIAS)  # units of `unit` below
        if MASKED or (BIAS and BIAS % 2 == 0):
            if MASKED:
                m_visible = _visible(r_m, r_n, seqlen_k, diag_offset, window_left, window_right,
                                     MASK_LEFT, MASK_RIGHT, True)
                if BIAS and BIAS % 2 == 0:
                    m_visible = m_visible & (bias != 0)
            else:
                m_visible = bias != 0
            b_s = tl.where(m_visible, b_s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(b_s, 1) * unit)
        if MASKED or BIAS != 0:
            # A mask can hide all of a row's keys so far (m = -inf); subtracting it would give
            # -inf - (-inf) = NaN, so such rows subtract 0 instead (their p and alpha are then exp2(-inf) = 0,
            # and l stays 0).
            m_sub = tl.where(m_new == float("-inf"), 0.0, m_new)
        else:
            m_sub = m_new
        b_p = tl.exp2(b_s * unit - m_sub[:, None])  # [BLOCK_M, BLOCK_N], one fused multiply-add per score
        alpha = tl.exp2(m_i - m_sub)  # [BLOCK_M], rescales what was accumulated under the old max
        l_i = l_i * alpha + tl.sum(b_p, 1)
        if DROPOUT:
            # l sums every probability; only the kept ones reach the output (1 / (1 - p) is applied at the end).
            b_p = tl.where(_dropout_keep(seed, i_bh, start_m, start_n, dropout_threshold, BLOCK_M, BLOCK_N, False),
                           b_p, 0.0)
        b_v = _load_tile(v_view, start_n, seqlen_k, stride_vs, HEAD_DIM_V, BLOCK_N, BLOCK_DV, USE_TMA)
        acc = _mma(b_p.to(b_v.dtype), b_v, acc * alpha[:, None], PRECISION, DOT_UPCAST)  # [BLOCK_M, BLOCK_DV]
        m_i = m_new
    return acc, l_i, m_i


@triton.jit
def _attn_fwd_kernel(Q, K, V, Out, Lse, Alibi, Bias, BlockCount, BlockList, Sinks, Seed, CuSeqQ, CuSeqK,
                     stride_qb, stride_qs, stride_qh,
                     stride_kb, stride_ks, stride_kh,
                     stride_vb, stride_vs, stride_vh,
                     stride_ob, stride_os, stride_oh,
                     stride_lb, stride_lh,
                     stride_alibi_b, stride_bias_b, stride_bias_h, stride_bias_m, stride_bias_n,
                     stride_map_b, stride_map_h, map_cols,
                     seqlen_q, seqlen_k, diag_offset, sm_scale, qk_scale, num_heads, group_size,
                     window_left, window_right, softcap, dropout_threshold, dropout_scale,
                     HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr, MASK_LEFT: tl.constexpr,
                     MASK_RIGHT: tl.constexpr, EVEN_N: tl.constexpr, SOFTCAP: tl.constexpr,
                     HAS_ALIBI: tl.constexpr, BIAS: tl.constexpr, BLOCK_SKIP: tl.constexpr, HAS_SINKS: tl.constexpr,
                     DROPOUT: tl.constexpr, VARLEN: tl.constexpr,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
                     USE_TMA: tl.constexpr, PRECISION: tl.constexpr, DOT_UPCAST: tl.constexpr,
                     WARP_SPECIALIZE: tl.constexpr):
    i_m = tl.program_id(0)
    if MASK_RIGHT:
        # Query blocks near the end see the most keys under a causal mask: launch them first so the last wave is
        # short.
        i_m = tl.num_programs(0) - 1 - i_m
    i_bh = tl.program_id(1)
    i_b = i_bh // num_heads
    i_h = i_bh % num_heads
    i_hk = i_h // group_size  # grouped-query attention: query heads share kv head h // group_size
    start_m = i_m * BLOCK_M
    q_start, k_start, seqlen_q, seqlen_k, diag_offset = _seq_bounds(CuSeqQ, CuSeqK, i_b, seqlen_q, seqlen_k,
                                                                    diag_offset, VARLEN)
    if start_m < seqlen_q:  # a varlen grid covers the longest sequence; shorter ones have nothing here
        q_base = _slice_base(Q, i_b, q_start, i_h, stride_qb, stride_qs, stride_qh)
        k_base = _slice_base(K, i_b, k_start, i_hk, stride_kb, stride_ks, stride_kh)
        v_base = _slice_base(V, i_b, k_start, i_hk, stride_vb, stride_vs, stride_vh)
        o_base = _slice_base(Out, i_b, q_start, i_h, stride_ob, stride_os, stride_oh)
        q_view = _tile_view(q_base, seqlen_q, stride_qs, HEAD_DIM, BLOCK_M, BLOCK_D, USE_TMA)
        k_view = _tile_view(k_base, seqlen_k, stride_ks, HEAD_DIM, BLOCK_N, BLOCK_D, USE_TMA)
        v_view = _tile_view(v_base, seqlen_k, stride_vs, HEAD_DIM_V, BLOCK_N, BLOCK_DV, USE_TMA)
        o_view = _tile_view(o_base, seqlen_q, stride_os, HEAD_DIM_V, BLOCK_M, BLOCK_DV, USE_TMA)

        slope, p_bias = _head_features(Alibi, Bias, i_b, i_h, stride_alibi_b, stride_bias_b, stride_bias_h,
                                       stride_bias_m, seqlen_q, seqlen_k, HAS_ALIBI, BIAS, BLOCK_M, BLOCK_N)
        seed = 0
        if DROPOUT:
            seed = tl.load(Seed)

        b_q = _load_tile(q_view, start_m, seqlen_q, stride_qs, HEAD_DIM, BLOCK_M, BLOCK_D, USE_TMA)
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)

        if BLOCK_SKIP:
            # One masked loop over the listed key blocks (a bool attn_mask comes without a band).
            map_row = i_b * stride_map_b + i_h * stride_map_h + i_m
            p_block_list = BlockList + map_row.to(tl.int64) * map_cols
            acc, l_i, m_i = _attn_fwd_inner(
                acc, l_i, m_i, b_q, k_view, v_view, start_m, 0, tl.load(BlockCount + map_row), seqlen_q, seqlen_k,
                stride_ks, stride_vs, diag_offset, sm_scale, qk_scale, window_left, window_right, softcap, slope,
                p_bias, stride_bias_m, stride_bias_n, p_block_list, seed, i_bh, dropout_threshold,
                True, MASK_LEFT, MASK_RIGHT, SOFTCAP, HAS_ALIBI, BIAS, BLOCK_SKIP, DROPOUT, HEAD_DIM, HEAD_DIM_V,
                BLOCK_M, BLOCK_N, BLOCK_D, BLOCK_DV, USE_TMA, PRECISION, DOT_UPCAST, False)
        else:
            p_block_list = BlockList
            lo, full_lo, full_hi, hi = _key_range(start_m, seqlen_q, seqlen_k, diag_offset, window_left, window_right,
                                                  MASK_LEFT, MASK_RIGHT, BLOCK_M, BLOCK_N)
            if MASK_LEFT:
                # Stage 0: the band's left edge, masked.
                acc, l_i, m_i = _attn_fwd_inner(
                    acc, l_i, m_i, b_q, k_view, v_view, start_m, lo, tl.minimum(full_lo, hi), seqlen_q, seqlen_k,
                    stride_ks, stride_vs, diag_offset, sm_scale, qk_scale, window_left, window_right, softcap, slope,
                    p_bias, stride_bias_m, stride_bias_n, p_block_list, seed, i_bh, dropout_threshold,
                    True, MASK_LEFT, MASK_RIGHT, SOFTCAP, HAS_ALIBI, BIAS, BLOCK_SKIP, DROPOUT, HEAD_DIM, HEAD_DIM_V,
                    BLOCK_M, BLOCK_N, BLOCK_D, BLOCK_DV, USE_TMA, PRECISION, DOT_UPCAST, False)
            # Stage 1: key blocks every row sees, no mask.
            acc, l_i, m_i = _attn_fwd_inner(
                acc, l_i, m_i, b_q, k_view, v_view, start_m, full_lo, full_hi, seqlen_q, seqlen_k,
                stride_ks, stride_vs, diag_offset, sm_scale, qk_scale, window_left, window_right, softcap, slope,
                p_bias, stride_bias_m, stride_bias_n, p_block_list, seed, i_bh, dropout_threshold,
                False, MASK_LEFT, MASK_RIGHT, SOFTCAP, HAS_ALIBI, BIAS, BLOCK_SKIP, DROPOUT, HEAD_DIM, HEAD_DIM_V,
                BLOCK_M, BLOCK_N, BLOCK_D, BLOCK_DV, USE_TMA, PRECISION, DOT_UPCAST, WARP_SPECIALIZE)
            # Stage 2: the diagonal (or the band's right edge) and the ragged last block, masked. EVEN_N (no band, Sk a
            # multiple of BLOCK_N) compiles it out; one loop is also what warp specialization needs (two crash
            # Triton 3.6's compiler).
            if not EVEN_N:
                acc, l_i, m_i = _attn_fwd_inner(
                    acc, l_i, m_i, b_q, k_view, v_view, start_m, tl.maximum(full_lo, full_hi), hi, seqlen_q, seqlen_k,
                    stride_ks, stride_vs, diag_offset, sm_scale, qk_scale, window_left, window_right, softcap, slope,
                    p_bias, stride_bias_m, stride_bias_n, p_block_list, seed, i_bh, dropout_threshold,
                    True, MASK_LEFT, MASK_RIGHT, SOFTCAP, HAS_ALIBI, BIAS, BLOCK_SKIP, DROPOUT, HEAD_DIM, HEAD_DIM_V,
                    BLOCK_M, BLOCK_N, BLOCK_D, BLOCK_DV, USE_TMA, PRECISION, DOT_UPCAST, False)

        if HAS_SINKS:
            # The head's sink logit joins the denominator (docs/derivation.md#8): one more term exp(sink - m).
            sink = tl.load(Sinks + i_h) * LOG2E
            m_fin = tl.maximum(m_i, sink)
            alpha = tl.exp2(m_i - m_fin)
            l_i = l_i * alpha + tl.exp2(sink - m_fin)
            acc = acc * alpha[:, None]
            m_i = m_fin
        # A row that sees no key (and has no sink) has l = 0: it outputs 0 and its LSE is -inf.
        m_empty = l_i == 0.0
        l_safe = tl.where(m_empty, 1.0, l_i)
        if DROPOUT:
            l_safe = l_safe * dropout_scale  # dropout_scale = 1 - p: kept probabilities are scaled by 1 / (1 - p)
        acc = acc / l_safe[:, None]
        if DROPOUT:
            l_safe = l_safe / dropout_scale
        lse = tl.where(m_empty, float("-inf"), (m_i + tl.log2(l_safe)) * LN2)
        _store_tile(o_view, acc.to(Out.dtype.element_ty), start_m, seqlen_q, stride_os, HEAD_DIM_V, BLOCK_M,
                    BLOCK_DV, USE_TMA)
        o_m = start_m + tl.arange(0, BLOCK_M)
        p_lse = Lse + i_b.to(tl.int64) * stride_lb + i_h.to(tl.int64) * stride_lh + q_start
        tl.store(p_lse + o_m, lse, mask=o_m < seqlen_q)


def attention_forward(q, k, v, softmax_scale, diagonal_offset, feats: Features, out_dtype=None):
    """Launch the forward kernel. Returns (out, lse fp32 natural log); shapes in the module docstring. out_dtype:
    out's dtype, default q's (float32 for context parallelism's block outputs, which are merged across ranks:
    flashtile/distributed).

    Inputs are assumed validated (flashtile._validate) and `feats` resolved (flashtile.kernels.features);
    softmax_scale must be > 0 (the public API turns a negative scale into a positive one on -q). Query i sees key
    j iff j <= i + diagonal_offset + right and j >= i + diagonal_offset - left, where the window bounds
    (feats.window_left / window_right; causal is right = 0) that are < 0 do not apply. Varlen computes each
    sequence's offset as Sk - Sq itself.
    """
    assert softmax_scale > 0, "the kernel takes the row max before scaling: the scale must be positive"
    if hopper_fwd.supports(q, k, v, feats, softmax_scale):
        # Hopper, 16-bit, d 64/128 (an attn_mask is read by TMA; varlen and dropout too): the warp-specialized
        # Gluon kernel (kernels/hopper_fwd.py).
        return hopper_fwd.attention_forward(q, k, v, softmax_scale, diagonal_offset, feats, out_dtype)
    out_dtype = out_dtype or q.dtype
    seqlen_q, num_heads, head_dim = q.shape[-3], q.shape[-2], q.shape[-1]
    seqlen_k, num_kv_heads, head_dim_v = k.shape[-3], k.shape[-2], v.shape[-1]
    if feats.varlen:
        batch = feats.cu_seqlens_q.numel() - 1
        out = _common.empty((q.shape[0], num_heads, head_dim_v), out_dtype, q.device)
        lse = _common.empty((num_heads, q.shape[0]), torch.float32, q.device)
        strides = [(0,) + tuple(t.stride()[:2]) for t in (q, k, v, out)]
        lse_strides = (0, lse.stride(0))
        seqlen_q, seqlen_k = feats.max_seqlen_q, feats.max_seqlen_k
    else:
        batch = q.shape[0]
        out = _common.empty((batch, seqlen_q, num_heads, head_dim_v), out_dtype, q.device)
        lse = _common.empty((batch, num_heads, seqlen_q), torch.float32, q.device)
        strides = [tuple(t.stride()[:3]) for t in (q, k, v, out)]
        lse_strides = (lse.stride(0), lse.stride(1))
    spec = configs.launch_spec(q, (q, k, v, out))
    fargs = feats.kernel_args(q, spec.use_tma, seqlen_q, seqlen_k)
    candidates = configs.forward_candidates(max(head_dim, head_dim_v), feats.mask_right, q.dtype, spec,
                                            fargs.bias_kind, feats.softcap > 0)

    def launch(cfg):
        grid = (triton.cdiv(seqlen_q, cfg.block_m), batch * num_heads)
        # The single-loop form, except for fp32 under tf32: there the operand rounding (_common._round_tf32) gave
        # wrong results inside it on Triton 3.6 while the two-stage form is right (tests/test_gpu.py).
        even_n = (not feats.banded and not feats.varlen and seqlen_k % cfg.block_n == 0
                  and not (q.dtype == torch.float32 and spec.precision == "tf32"))
        lists = feats.block_lists(cfg.block_m, cfg.block_n, False, seqlen_q, seqlen_k)
        counts, indices, map_strides, map_cols = lists if lists is not None else (fargs.cu_q, fargs.cu_q, (0, 0), 0)
        return _launch.launch(_attn_fwd_kernel, grid, (
            q, k, v, out, lse, fargs.alibi, fargs.bias, counts, indices, fargs.sinks, fargs.seed, fargs.cu_q,
            fargs.cu_k,
            *strides[0], *strides[1], *strides[2], *strides[3], *lse_strides,
            fargs.stride_alibi_b, *fargs.bias_strides, *map_strides, map_cols,
            seqlen_q, seqlen_k, diagonal_offset, softmax_scale, softmax_scale * LOG2E.value, num_heads,
            num_heads // num_kv_heads, feats.window_left, feats.window_right, feats.softcap,
            fargs.dropout_threshold, 1.0 - feats.dropout_p), dict(
            HEAD_DIM=head_dim, HEAD_DIM_V=head_dim_v, MASK_LEFT=feats.mask_left, MASK_RIGHT=feats.mask_right,
            EVEN_N=even_n, SOFTCAP=feats.softcap_mode(q.dtype), HAS_ALIBI=fargs.has_alibi, BIAS=fargs.bias_kind,
            BLOCK_SKIP=lists is not None, HAS_SINKS=fargs.has_sinks, DROPOUT=feats.dropout_p > 0,
            VARLEN=feats.varlen, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_D=spec.block_d(head_dim),
            BLOCK_DV=spec.block_d(head_dim_v), USE_TMA=spec.use_tma, PRECISION=spec.precision,
            DOT_UPCAST=spec.dot_upcast, WARP_SPECIALIZE=cfg.warp_specialize and even_n),
            q.device.index, num_warps=cfg.num_warps, num_stages=cfg.num_stages)

    configs.launch_first_that_compiles(("fwd", max(head_dim, head_dim_v), feats.mask_right, q.dtype, spec,
                                        feats.variant(), fargs.bias_kind), candidates, launch)
    return out, lse
