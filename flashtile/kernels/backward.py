"""Attention backward: delta preprocess, a dK/dV kernel (K/V block resident, streams Q) and a dQ kernel
(Q block resident, streams K/V). No atomics, so gradients are bit-for-bit deterministic.

q, out, dout, dq: [B, Sq, Hq, D]; k, v, dk, dv: [B, Sk, Hk, D]; lse, dlse: [B, Hq, Sq].
The math is docs/derivation.md#6-backward: delta = rowsum(dO * O) - dLSE, P = exp(S - LSE), dV = P^T dO,
dP = dO V^T, dS = P * (dP - delta), dQ = scale * dS K, dK = scale * dS^T Q.
"""
import torch
import triton
import triton.language as tl

from . import configs
from . import _common
from ._common import LOG2E, _key_range, _load_tile, _mma, _query_start, _store_tile, _tile_view

# Delta and the log2 LSE are stored per (batch, head) padded to a multiple of this many rows (the largest query
# tile the backward uses), with LSE = +inf and delta = 0 in the padding: a streamed query tile that runs past Sq
# then needs no mask, since its P = exp2(s - inf) = 0.
ROW_PAD = 128


@triton.jit
def _bwd_preprocess_kernel(Out, dOut, Lse, dLse, Delta, LseLog2,
                           stride_ob, stride_os, stride_oh,
                           stride_dob, stride_dos, stride_doh,
                           stride_dlb, stride_dlh,
                           seqlen_q, seqlen_q_pad, num_heads,
                           HEAD_DIM: tl.constexpr, HAS_DLSE: tl.constexpr,
                           BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr):
    i_m = tl.program_id(0)
    i_bh = tl.program_id(1)
    i_b = i_bh // num_heads
    i_h = i_bh % num_heads
    o_m = i_m * BLOCK_M + tl.arange(0, BLOCK_M)
    o_d = tl.arange(0, BLOCK_D)
    m_m = o_m < seqlen_q
    m_md = m_m[:, None] & (o_d[None, :] < HEAD_DIM)
    p_o = Out + i_b.to(tl.int64) * stride_ob + i_h.to(tl.int64) * stride_oh
    p_do = dOut + i_b.to(tl.int64) * stride_dob + i_h.to(tl.int64) * stride_doh
    b_o = tl.load(p_o + o_m[:, None].to(tl.int64) * stride_os + o_d[None, :], mask=m_md, other=0.0)
    b_do = tl.load(p_do + o_m[:, None].to(tl.int64) * stride_dos + o_d[None, :], mask=m_md, other=0.0)
    b_delta = tl.sum(b_o.to(tl.float32) * b_do.to(tl.float32), 1)  # [BLOCK_M]
    if HAS_DLSE:
        # A loss that also uses the LSE adds dLSE_i * P_ij to dS_ij (d lse_i / d s_ij = P_ij): fold it into delta.
        p_dlse = dLse + i_b.to(tl.int64) * stride_dlb + i_h.to(tl.int64) * stride_dlh
        b_delta -= tl.load(p_dlse + o_m, mask=m_m, other=0.0)
    b_lse = tl.load(Lse + i_bh.to(tl.int64) * seqlen_q + o_m, mask=m_m, other=float("-inf"))
    # A row that sees no key has LSE = -inf; +inf makes its P = exp2(s - inf) = 0 instead of exp2(-inf + inf) = NaN.
    b_lse_log2 = tl.where(b_lse == float("-inf"), float("inf"), b_lse * LOG2E)
    tl.store(Delta + i_bh.to(tl.int64) * seqlen_q_pad + o_m, b_delta)
    tl.store(LseLog2 + i_bh.to(tl.int64) * seqlen_q_pad + o_m, b_lse_log2)


@triton.jit
def _bwd_dkdv_inner(b_dk, b_dv, b_k, b_v, q_view, do_view, p_lse, p_delta, start_n, lo, hi,
                    seqlen_q, stride_qs, stride_dos, diag_offset, qk_scale,
                    MASKED: tl.constexpr, HEAD_DIM: tl.constexpr,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                    USE_TMA: tl.constexpr, PRECISION: tl.constexpr, DOT_UPCAST: tl.constexpr):
    """Accumulate dK, dV of one key block over the query blocks [lo, hi), in the transposed orientation
    (keys as rows) so that P^T and dS^T come out of the matmuls without a transpose. MASKED applies the causal
    mask; rows past Sq need none (their padded LSE is +inf, so P = 0), nor do keys past Sk (their dK, dV rows are
    never stored and no other row depends on them)."""
    o_n = start_n + tl.arange(0, BLOCK_N)
    for start_m in tl.range(lo, hi, BLOCK_M):
        o_m = start_m + tl.arange(0, BLOCK_M)
        b_q = _load_tile(q_view, start_m, seqlen_q, stride_qs, HEAD_DIM, BLOCK_M, BLOCK_D, USE_TMA)  # [BLOCK_M, BLOCK_D]
        b_lse = tl.load(p_lse + o_m)  # [BLOCK_M] log2 units, padded rows +inf
        b_st = _mma(b_k, tl.trans(b_q), None, PRECISION, DOT_UPCAST) * qk_scale  # [BLOCK_N, BLOCK_M]
        b_pt = tl.exp2(b_st - b_lse[None, :])  # [BLOCK_N, BLOCK_M]
        if MASKED:
            b_pt = tl.where(o_n[:, None] <= o_m[None, :] + diag_offset, b_pt, 0.0)
        b_do = _load_tile(do_view, start_m, seqlen_q, stride_dos, HEAD_DIM, BLOCK_M, BLOCK_D, USE_TMA)  # [BLOCK_M, BLOCK_D]
        b_dv = _mma(b_pt.to(b_do.dtype), b_do, b_dv, PRECISION, DOT_UPCAST)  # [BLOCK_N, BLOCK_D]
        b_delta = tl.load(p_delta + o_m)  # [BLOCK_M]
        b_dpt = _mma(b_v, tl.trans(b_do), None, PRECISION, DOT_UPCAST)  # [BLOCK_N, BLOCK_M]
        b_dst = b_pt * (b_dpt - b_delta[None, :])  # [BLOCK_N, BLOCK_M]
        b_dk = _mma(b_dst.to(b_q.dtype), b_q, b_dk, PRECISION, DOT_UPCAST)  # [BLOCK_N, BLOCK_D]
    return b_dk, b_dv


@triton.jit
def _bwd_dkdv_kernel(Q, K, V, dOut, dK, dV, LseLog2, Delta,
                     stride_qb, stride_qs, stride_qh,
                     stride_kb, stride_ks, stride_kh,
                     stride_vb, stride_vs, stride_vh,
                     stride_dob, stride_dos, stride_doh,
                     stride_dkb, stride_dks, stride_dkh,
                     stride_dvb, stride_dvs, stride_dvh,
                     seqlen_q, seqlen_k, seqlen_q_pad, diag_offset, sm_scale, qk_scale, num_kv_heads, group_size,
                     HEAD_DIM: tl.constexpr, IS_CAUSAL: tl.constexpr,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                     USE_TMA: tl.constexpr, PRECISION: tl.constexpr, DOT_UPCAST: tl.constexpr):
    i_n = tl.program_id(0)
    i_bhk = tl.program_id(1)
    i_b = i_bhk // num_kv_heads
    i_hk = i_bhk % num_kv_heads
    start_n = i_n * BLOCK_N

    k_base = K + i_b.to(tl.int64) * stride_kb + i_hk.to(tl.int64) * stride_kh
    v_base = V + i_b.to(tl.int64) * stride_vb + i_hk.to(tl.int64) * stride_vh
    k_view = _tile_view(k_base, seqlen_k, stride_ks, HEAD_DIM, BLOCK_N, BLOCK_D, USE_TMA)
    v_view = _tile_view(v_base, seqlen_k, stride_vs, HEAD_DIM, BLOCK_N, BLOCK_D, USE_TMA)
    b_k = _load_tile(k_view, start_n, seqlen_k, stride_ks, HEAD_DIM, BLOCK_N, BLOCK_D, USE_TMA)  # [BLOCK_N, BLOCK_D]
    b_v = _load_tile(v_view, start_n, seqlen_k, stride_vs, HEAD_DIM, BLOCK_N, BLOCK_D, USE_TMA)  # [BLOCK_N, BLOCK_D]
    b_dk = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    b_dv = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)

    lo = _query_start(start_n, diag_offset, IS_CAUSAL, BLOCK_M)
    # Grouped-query attention: this program owns the kv head, so it sums the grads of all its query heads in
    # registers -- no atomics, and the order of the sum is fixed.
    for g in range(0, group_size):
        i_h = i_hk * group_size + g
        q_base = Q + i_b.to(tl.int64) * stride_qb + i_h.to(tl.int64) * stride_qh
        do_base = dOut + i_b.to(tl.int64) * stride_dob + i_h.to(tl.int64) * stride_doh
        q_view = _tile_view(q_base, seqlen_q, stride_qs, HEAD_DIM, BLOCK_M, BLOCK_D, USE_TMA)
        do_view = _tile_view(do_base, seqlen_q, stride_dos, HEAD_DIM, BLOCK_M, BLOCK_D, USE_TMA)
        row0 = (i_b * num_kv_heads * group_size + i_h).to(tl.int64) * seqlen_q_pad
        # One loop over the query blocks that see the key block, the causal mask applied to each: measured 5%
        # faster at d128 causal on an H200 than a masked diagonal stage plus an unmasked loop (388 -> 409
        # TFLOP/s, benchmarks/NOTES.md); the likely cause is code size: two copies of this 4-matmul body inside the
        # head loop. The compare-select costs less.
        b_dk, b_dv = _bwd_dkdv_inner(b_dk, b_dv, b_k, b_v, q_view, do_view, LseLog2 + row0, Delta + row0, start_n,
                                     lo, seqlen_q, seqlen_q, stride_qs, stride_dos, diag_offset, qk_scale,
                                     IS_CAUSAL, HEAD_DIM, BLOCK_M, BLOCK_N, BLOCK_D, USE_TMA, PRECISION, DOT_UPCAST)

    dk_base = dK + i_b.to(tl.int64) * stride_dkb + i_hk.to(tl.int64) * stride_dkh
    dv_base = dV + i_b.to(tl.int64) * stride_dvb + i_hk.to(tl.int64) * stride_dvh
    dk_view = _tile_view(dk_base, seqlen_k, stride_dks, HEAD_DIM, BLOCK_N, BLOCK_D, USE_TMA)
    dv_view = _tile_view(dv_base, seqlen_k, stride_dvs, HEAD_DIM, BLOCK_N, BLOCK_D, USE_TMA)
    _store_tile(dk_view, (b_dk * sm_scale).to(dK.dtype.element_ty), start_n, seqlen_k, stride_dks, HEAD_DIM,
                BLOCK_N, BLOCK_D, USE_TMA)
    _store_tile(dv_view, b_dv.to(dV.dtype.element_ty), start_n, seqlen_k, stride_dvs, HEAD_DIM,
                BLOCK_N, BLOCK_D, USE_TMA)


@triton.jit
def _bwd_dq_inner(b_dq, b_q, b_do, b_lse, b_delta, k_view, v_view, start_m, lo, hi,
                  seqlen_k, stride_ks, stride_vs, diag_offset, qk_scale,
                  MASKED: tl.constexpr, IS_CAUSAL: tl.constexpr, HEAD_DIM: tl.constexpr,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                  USE_TMA: tl.constexpr, PRECISION: tl.constexpr, DOT_UPCAST: tl.constexpr):
    """Accumulate dQ of one query block over the key blocks [lo, hi)."""
    o_m = start_m + tl.arange(0, BLOCK_M)
    for start_n in tl.range(lo, hi, BLOCK_N):
        b_k = _load_tile(k_view, start_n, seqlen_k, stride_ks, HEAD_DIM, BLOCK_N, BLOCK_D, USE_TMA)  # [BLOCK_N, BLOCK_D]
        b_v = _load_tile(v_view, start_n, seqlen_k, stride_vs, HEAD_DIM, BLOCK_N, BLOCK_D, USE_TMA)  # [BLOCK_N, BLOCK_D]
        b_s = _mma(b_q, tl.trans(b_k), None, PRECISION, DOT_UPCAST) * qk_scale  # [BLOCK_M, BLOCK_N]
        b_p = tl.exp2(b_s - b_lse[:, None])  # [BLOCK_M, BLOCK_N]
        if MASKED:
            # Keys past Sk read as 0, which would give them P = exp2(-lse) (possibly inf): mask them with the diagonal.
            o_n = start_n + tl.arange(0, BLOCK_N)
            m_visible = o_n[None, :] < seqlen_k
            if IS_CAUSAL:
                m_visible = m_visible & (o_n[None, :] <= o_m[:, None] + diag_offset)
            b_p = tl.where(m_visible, b_p, 0.0)
        b_dp = _mma(b_do, tl.trans(b_v), None, PRECISION, DOT_UPCAST)  # [BLOCK_M, BLOCK_N]
        b_ds = b_p * (b_dp - b_delta[:, None])  # [BLOCK_M, BLOCK_N]
        b_dq = _mma(b_ds.to(b_k.dtype), b_k, b_dq, PRECISION, DOT_UPCAST)  # [BLOCK_M, BLOCK_D]
    return b_dq


@triton.jit
def _bwd_dq_kernel(Q, K, V, dOut, dQ, LseLog2, Delta,
                   stride_qb, stride_qs, stride_qh,
                   stride_kb, stride_ks, stride_kh,
                   stride_vb, stride_vs, stride_vh,
                   stride_dob, stride_dos, stride_doh,
                   stride_dqb, stride_dqs, stride_dqh,
                   seqlen_q, seqlen_k, seqlen_q_pad, diag_offset, sm_scale, qk_scale, num_heads, group_size,
                   HEAD_DIM: tl.constexpr, IS_CAUSAL: tl.constexpr, EVEN_N: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                   USE_TMA: tl.constexpr, PRECISION: tl.constexpr, DOT_UPCAST: tl.constexpr):
    i_m = tl.program_id(0)
    if IS_CAUSAL:
        i_m = tl.num_programs(0) - 1 - i_m  # heaviest query blocks first, as in the forward
    i_bh = tl.program_id(1)
    i_b = i_bh // num_heads
    i_h = i_bh % num_heads
    i_hk = i_h // group_size
    start_m = i_m * BLOCK_M

    q_base = Q + i_b.to(tl.int64) * stride_qb + i_h.to(tl.int64) * stride_qh
    do_base = dOut + i_b.to(tl.int64) * stride_dob + i_h.to(tl.int64) * stride_doh
    k_base = K + i_b.to(tl.int64) * stride_kb + i_hk.to(tl.int64) * stride_kh
    v_base = V + i_b.to(tl.int64) * stride_vb + i_hk.to(tl.int64) * stride_vh
    q_view = _tile_view(q_base, seqlen_q, stride_qs, HEAD_DIM, BLOCK_M, BLOCK_D, USE_TMA)
    do_view = _tile_view(do_base, seqlen_q, stride_dos, HEAD_DIM, BLOCK_M, BLOCK_D, USE_TMA)
    k_view = _tile_view(k_base, seqlen_k, stride_ks, HEAD_DIM, BLOCK_N, BLOCK_D, USE_TMA)
    v_view = _tile_view(v_base, seqlen_k, stride_vs, HEAD_DIM, BLOCK_N, BLOCK_D, USE_TMA)
    b_q = _load_tile(q_view, start_m, seqlen_q, stride_qs, HEAD_DIM, BLOCK_M, BLOCK_D, USE_TMA)  # [BLOCK_M, BLOCK_D]
    b_do = _load_tile(do_view, start_m, seqlen_q, stride_dos, HEAD_DIM, BLOCK_M, BLOCK_D, USE_TMA)  # [BLOCK_M, BLOCK_D]
    o_m = start_m + tl.arange(0, BLOCK_M)
    b_lse = tl.load(LseLog2 + i_bh.to(tl.int64) * seqlen_q_pad + o_m)  # [BLOCK_M]
    b_delta = tl.load(Delta + i_bh.to(tl.int64) * seqlen_q_pad + o_m)  # [BLOCK_M]
    b_dq = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)

    full_hi, hi = _key_range(start_m, seqlen_q, seqlen_k, diag_offset, IS_CAUSAL, BLOCK_M, BLOCK_N)
    b_dq = _bwd_dq_inner(b_dq, b_q, b_do, b_lse, b_delta, k_view, v_view, start_m, 0, full_hi,
                         seqlen_k, stride_ks, stride_vs, diag_offset, qk_scale,
                         False, IS_CAUSAL, HEAD_DIM, BLOCK_M, BLOCK_N, BLOCK_D, USE_TMA, PRECISION, DOT_UPCAST)
    if not EVEN_N:  # as in the forward: no masked stage when nothing needs a mask
        b_dq = _bwd_dq_inner(b_dq, b_q, b_do, b_lse, b_delta, k_view, v_view, start_m, full_hi, hi,
                             seqlen_k, stride_ks, stride_vs, diag_offset, qk_scale,
                             True, IS_CAUSAL, HEAD_DIM, BLOCK_M, BLOCK_N, BLOCK_D, USE_TMA, PRECISION, DOT_UPCAST)

    dq_base = dQ + i_b.to(tl.int64) * stride_dqb + i_h.to(tl.int64) * stride_dqh
    dq_view = _tile_view(dq_base, seqlen_q, stride_dqs, HEAD_DIM, BLOCK_M, BLOCK_D, USE_TMA)
    _store_tile(dq_view, (b_dq * sm_scale).to(dQ.dtype.element_ty), start_m, seqlen_q, stride_dqs, HEAD_DIM,
                BLOCK_M, BLOCK_D, USE_TMA)


# Rows per preprocess program: a light, memory-bound pass; 128 divides ROW_PAD.
_PREPROCESS_BLOCK_M = 128


def attention_backward(dout, q, k, v, out, lse, dlse, softmax_scale, causal, diagonal_offset):
    """Launch the three backward kernels. Returns (dq, dk, dv) with the layouts of q, k, v.

    dlse (optional, [B, Hq, Sq]) is the gradient reaching the returned LSE. Inputs are assumed validated.
    """
    batch, seqlen_q, num_heads, head_dim = q.shape
    seqlen_k, num_kv_heads = k.shape[1], k.shape[2]
    seqlen_q_pad = triton.cdiv(seqlen_q, ROW_PAD) * ROW_PAD
    # The preprocess reads lse and dlse as contiguous [B, H, Sq] rows; they are small, so copy any other layout.
    lse = lse.contiguous()
    dlse = None if dlse is None else dlse.contiguous()
    delta = _common.empty((batch, num_heads, seqlen_q_pad), torch.float32, q.device)
    lse_log2 = _common.empty((batch, num_heads, seqlen_q_pad), torch.float32, q.device)
    dq = _common.empty(q.shape, q.dtype, q.device)
    dk = _common.empty(k.shape, k.dtype, k.device)
    dv = _common.empty(v.shape, v.dtype, v.device)
    spec = configs.launch_spec(q, (q, k, v, dout, dq, dk, dv))
    block_d = spec.block_d(head_dim)
    qk_scale = softmax_scale * LOG2E.value
    group_size = num_heads // num_kv_heads

    has_dlse = dlse is not None
    dlse_arg = dlse if has_dlse else lse  # never read when HAS_DLSE is False
    _bwd_preprocess_kernel[(seqlen_q_pad // _PREPROCESS_BLOCK_M, batch * num_heads)](
        out, dout, lse, dlse_arg, delta, lse_log2,
        out.stride(0), out.stride(1), out.stride(2),
        dout.stride(0), dout.stride(1), dout.stride(2),
        dlse_arg.stride(0), dlse_arg.stride(1),
        seqlen_q, seqlen_q_pad, num_heads,
        HEAD_DIM=head_dim, HAS_DLSE=has_dlse, BLOCK_M=_PREPROCESS_BLOCK_M, BLOCK_D=block_d,
    )

    dkdv_candidates, dq_candidates = configs.backward_candidates(head_dim, causal, q.dtype, spec)

    def launch_dkdv(cfg):
        return _bwd_dkdv_kernel[(triton.cdiv(seqlen_k, cfg.block_n), batch * num_kv_heads)](
            q, k, v, dout, dk, dv, lse_log2, delta,
            q.stride(0), q.stride(1), q.stride(2),
            k.stride(0), k.stride(1), k.stride(2),
            v.stride(0), v.stride(1), v.stride(2),
            dout.stride(0), dout.stride(1), dout.stride(2),
            dk.stride(0), dk.stride(1), dk.stride(2),
            dv.stride(0), dv.stride(1), dv.stride(2),
            seqlen_q, seqlen_k, seqlen_q_pad, diagonal_offset, softmax_scale, qk_scale, num_kv_heads, group_size,
            HEAD_DIM=head_dim, IS_CAUSAL=causal, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_D=block_d,
            USE_TMA=spec.use_tma, PRECISION=spec.precision, DOT_UPCAST=spec.dot_upcast,
            num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        )

    def launch_dq(cfg):
        return _bwd_dq_kernel[(triton.cdiv(seqlen_q, cfg.block_m), batch * num_heads)](
            q, k, v, dout, dq, lse_log2, delta,
            q.stride(0), q.stride(1), q.stride(2),
            k.stride(0), k.stride(1), k.stride(2),
            v.stride(0), v.stride(1), v.stride(2),
            dout.stride(0), dout.stride(1), dout.stride(2),
            dq.stride(0), dq.stride(1), dq.stride(2),
            seqlen_q, seqlen_k, seqlen_q_pad, diagonal_offset, softmax_scale, qk_scale, num_heads, group_size,
            HEAD_DIM=head_dim, IS_CAUSAL=causal, EVEN_N=not causal and seqlen_k % cfg.block_n == 0, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_D=block_d,
            USE_TMA=spec.use_tma, PRECISION=spec.precision, DOT_UPCAST=spec.dot_upcast,
            num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        )

    key = (head_dim, causal, q.dtype, spec)
    configs.launch_first_that_compiles(("bwd_dkdv",) + key, dkdv_candidates, launch_dkdv)
    configs.launch_first_that_compiles(("bwd_dq",) + key, dq_candidates, launch_dq)
    return dq, dk, dv
