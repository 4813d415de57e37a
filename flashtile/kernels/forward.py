"""Attention forward, FA2 loop order: one program per (query block, batch * head), streaming K/V blocks.

q, out: [B, Sq, Hq, D]; k, v: [B, Sk, Hk, D]; lse: [B, Hq, Sq] fp32, natural log.
The math is docs/derivation.md#4-tiled-attention-fa1-and-fa2-loop-orders; the exp2 and two-stage causal
tricks are docs/derivation.md#5-kernel-tricks-exp2-and-the-causal-stages.
"""
import torch
import triton
import triton.language as tl

from . import configs
from . import _common
from ._common import LN2, LOG2E, _key_range, _load_tile, _mma, _store_tile, _tile_view


@triton.jit
def _attn_fwd_inner(acc, l_i, m_i, b_q, k_view, v_view, start_m, lo, hi, seqlen_k, stride_ks, stride_vs,
                    diag_offset, qk_scale,
                    MASKED: tl.constexpr, IS_CAUSAL: tl.constexpr, HEAD_DIM: tl.constexpr,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                    USE_TMA: tl.constexpr, PRECISION: tl.constexpr, DOT_UPCAST: tl.constexpr,
                    WARP_SPECIALIZE: tl.constexpr):
    """Online softmax over the key blocks [lo, hi); m_i and the exponents are in log2 units (qk_scale holds
    log2(e)). The max is taken on the raw scores and scaled after (qk_scale > 0, the launcher's contract), so that
    s * qk_scale - m is one fused multiply-add per score: at head dim 64 the softmax's elementwise work is a large
    share of the loop."""
    o_m = start_m + tl.arange(0, BLOCK_M)
    for start_n in tl.range(lo, hi, BLOCK_N, warp_specialize=WARP_SPECIALIZE):
        b_k = _load_tile(k_view, start_n, seqlen_k, stride_ks, HEAD_DIM, BLOCK_N, BLOCK_D, USE_TMA)  # [BLOCK_N, BLOCK_D]
        b_s = _mma(b_q, tl.trans(b_k), None, PRECISION, DOT_UPCAST)  # [BLOCK_M, BLOCK_N], unscaled
        if MASKED:
            o_n = start_n + tl.arange(0, BLOCK_N)
            m_visible = o_n[None, :] < seqlen_k
            if IS_CAUSAL:
                m_visible = m_visible & (o_n[None, :] <= o_m[:, None] + diag_offset)
            b_s = tl.where(m_visible, b_s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(b_s, 1) * qk_scale)
            # A row that has seen no visible key yet keeps m = -inf; subtracting it would give -inf - (-inf) = NaN,
            # so such rows subtract 0 instead (their p and alpha are then exp2(-inf) = 0, and l stays 0).
            m_sub = tl.where(m_new == float("-inf"), 0.0, m_new)
        else:
            m_new = tl.maximum(m_i, tl.max(b_s, 1) * qk_scale)
            m_sub = m_new
        b_p = tl.exp2(b_s * qk_scale - m_sub[:, None])  # [BLOCK_M, BLOCK_N]
        alpha = tl.exp2(m_i - m_sub)  # [BLOCK_M], rescales what was accumulated under the old max
        l_i = l_i * alpha + tl.sum(b_p, 1)
        b_v = _load_tile(v_view, start_n, seqlen_k, stride_vs, HEAD_DIM, BLOCK_N, BLOCK_D, USE_TMA)  # [BLOCK_N, BLOCK_D]
        acc = _mma(b_p.to(b_v.dtype), b_v, acc * alpha[:, None], PRECISION, DOT_UPCAST)  # [BLOCK_M, BLOCK_D]
        m_i = m_new
    return acc, l_i, m_i


@triton.jit
def _attn_fwd_kernel(Q, K, V, Out, Lse,
                     stride_qb, stride_qs, stride_qh,
                     stride_kb, stride_ks, stride_kh,
                     stride_vb, stride_vs, stride_vh,
                     stride_ob, stride_os, stride_oh,
                     seqlen_q, seqlen_k, diag_offset, qk_scale, num_heads, group_size,
                     HEAD_DIM: tl.constexpr, IS_CAUSAL: tl.constexpr, EVEN_N: tl.constexpr,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                     USE_TMA: tl.constexpr, PRECISION: tl.constexpr, DOT_UPCAST: tl.constexpr,
                     WARP_SPECIALIZE: tl.constexpr):
    i_m = tl.program_id(0)
    if IS_CAUSAL:
        # Query blocks near the end see the most keys: launch them first so the last wave is short.
        i_m = tl.num_programs(0) - 1 - i_m
    i_bh = tl.program_id(1)
    i_b = i_bh // num_heads
    i_h = i_bh % num_heads
    i_hk = i_h // group_size  # grouped-query attention: query heads share kv head h // group_size
    start_m = i_m * BLOCK_M

    # int64 before multiplying by strides: B * S * H * D may pass 2^31 elements.
    q_base = Q + i_b.to(tl.int64) * stride_qb + i_h.to(tl.int64) * stride_qh
    k_base = K + i_b.to(tl.int64) * stride_kb + i_hk.to(tl.int64) * stride_kh
    v_base = V + i_b.to(tl.int64) * stride_vb + i_hk.to(tl.int64) * stride_vh
    o_base = Out + i_b.to(tl.int64) * stride_ob + i_h.to(tl.int64) * stride_oh
    q_view = _tile_view(q_base, seqlen_q, stride_qs, HEAD_DIM, BLOCK_M, BLOCK_D, USE_TMA)
    k_view = _tile_view(k_base, seqlen_k, stride_ks, HEAD_DIM, BLOCK_N, BLOCK_D, USE_TMA)
    v_view = _tile_view(v_base, seqlen_k, stride_vs, HEAD_DIM, BLOCK_N, BLOCK_D, USE_TMA)
    o_view = _tile_view(o_base, seqlen_q, stride_os, HEAD_DIM, BLOCK_M, BLOCK_D, USE_TMA)

    b_q = _load_tile(q_view, start_m, seqlen_q, stride_qs, HEAD_DIM, BLOCK_M, BLOCK_D, USE_TMA)  # [BLOCK_M, BLOCK_D]
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)

    full_hi, hi = _key_range(start_m, seqlen_q, seqlen_k, diag_offset, IS_CAUSAL, BLOCK_M, BLOCK_N)
    # Stage 1: key blocks every row sees, no mask.
    acc, l_i, m_i = _attn_fwd_inner(acc, l_i, m_i, b_q, k_view, v_view, start_m, 0, full_hi, seqlen_k,
                                    stride_ks, stride_vs, diag_offset, qk_scale,
                                    False, IS_CAUSAL, HEAD_DIM, BLOCK_M, BLOCK_N, BLOCK_D,
                                    USE_TMA, PRECISION, DOT_UPCAST, WARP_SPECIALIZE)
    # Stage 2: the diagonal and the ragged last block, masked. EVEN_N (not causal, Sk a multiple of BLOCK_N)
    # compiles it out; one loop is also what warp specialization needs (two crash Triton 3.6's compiler).
    if not EVEN_N:
        acc, l_i, m_i = _attn_fwd_inner(acc, l_i, m_i, b_q, k_view, v_view, start_m, full_hi, hi, seqlen_k,
                                        stride_ks, stride_vs, diag_offset, qk_scale,
                                        True, IS_CAUSAL, HEAD_DIM, BLOCK_M, BLOCK_N, BLOCK_D,
                                        USE_TMA, PRECISION, DOT_UPCAST, False)

    # A row that sees no key (causal with Sq > Sk) has l = 0: it outputs 0 and its LSE is -inf.
    m_empty = l_i == 0.0
    l_safe = tl.where(m_empty, 1.0, l_i)
    acc = acc / l_safe[:, None]
    lse = tl.where(m_empty, float("-inf"), (m_i + tl.log2(l_safe)) * LN2)
    _store_tile(o_view, acc.to(Out.dtype.element_ty), start_m, seqlen_q, stride_os, HEAD_DIM, BLOCK_M, BLOCK_D,
                USE_TMA)
    o_m = start_m + tl.arange(0, BLOCK_M)
    tl.store(Lse + i_bh.to(tl.int64) * seqlen_q + o_m, lse, mask=o_m < seqlen_q)


def attention_forward(q, k, v, softmax_scale, causal, diagonal_offset):
    """Launch the forward kernel. Returns (out [B, Sq, Hq, D], lse [B, Hq, Sq] fp32 natural log).

    Inputs are assumed validated (flashtile._validate); softmax_scale must be > 0 (the public API turns a negative
    scale into a positive one on -q). diagonal_offset: query i sees key j iff j <= i + diagonal_offset when causal
    (Sk - Sq aligns the mask bottom-right, 0 top-left).
    """
    assert softmax_scale > 0, "the kernel takes the row max before scaling: the scale must be positive"
    batch, seqlen_q, num_heads, head_dim = q.shape
    seqlen_k, num_kv_heads = k.shape[1], k.shape[2]
    out = _common.empty((batch, seqlen_q, num_heads, head_dim), q.dtype, q.device)
    lse = _common.empty((batch, num_heads, seqlen_q), torch.float32, q.device)
    spec = configs.launch_spec(q, (q, k, v, out))
    candidates = configs.forward_candidates(head_dim, causal, q.dtype, spec)

    def launch(cfg):
        grid = (triton.cdiv(seqlen_q, cfg.block_m), batch * num_heads)
        # The single-loop form, except for fp32 under tf32: there the operand rounding (_common._round_tf32) gave
        # wrong results inside it on Triton 3.6 while the two-stage form is right (tests/test_gpu.py).
        even_n = not causal and seqlen_k % cfg.block_n == 0 and not (q.dtype == torch.float32
                                                                       and spec.precision == "tf32")
        return _attn_fwd_kernel[grid](
            q, k, v, out, lse,
            q.stride(0), q.stride(1), q.stride(2),
            k.stride(0), k.stride(1), k.stride(2),
            v.stride(0), v.stride(1), v.stride(2),
            out.stride(0), out.stride(1), out.stride(2),
            seqlen_q, seqlen_k, diagonal_offset, softmax_scale * LOG2E.value, num_heads, num_heads // num_kv_heads,
            HEAD_DIM=head_dim, IS_CAUSAL=causal, EVEN_N=even_n,
            BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_D=spec.block_d(head_dim),
            USE_TMA=spec.use_tma, PRECISION=spec.precision, DOT_UPCAST=spec.dot_upcast,
            WARP_SPECIALIZE=cfg.warp_specialize and even_n,
            num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        )

    configs.launch_first_that_compiles(("fwd", head_dim, causal, q.dtype, spec), candidates, launch)
    return out, lse
