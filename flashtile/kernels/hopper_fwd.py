"""Hopper forward written in Gluon: warp-specialized, the FA3 structure spelled out (docs/derivation.md ch. 5).

The plain-Triton forward (kernels/forward.py) leaves the schedule to the compiler, which keeps one warpgroup
busy with both the matrix multiplies and the softmax. This kernel fixes the schedule by hand:

* a producer warp (``_load_partition``) brings the query tile in once, then streams K and V blocks by TMA into a
  ring of ``STAGES`` shared-memory slots, each guarded by a "full" and an "empty" mbarrier;
* two consumer warpgroups (``_softmax_partition``), each owning 64 of the tile's 128 query rows, read the same
  ring. Inside each, the scores of block j (``Q Kj^T``) are issued asynchronously together with ``P(j-1) V(j-1)``,
  so the tensor cores work on both while the warpgroup computes the softmax of block j; the two warpgroups run
  out of phase, so one's exponentials overlap the other's matrix multiplies.

It covers the plain and causal forward (bottom-right aligned, as everywhere in flashtile) for fp16/bf16 at head
dims 64 and 128, GQA included; every other feature runs on the portable kernel. ``supports`` is the dispatch
rule, and tests/test_gpu.py compares the two kernels on the GPU. Gluon does not run in Triton's interpreter, so
this module only compiles on a Hopper GPU; importing it anywhere is safe.
"""
import os

import torch
import triton

try:  # Gluon ships with Triton >= 3.5; its Hopper module is all this kernel needs.
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma,
                                                                    warpgroup_mma, warpgroup_mma_wait)
    AVAILABLE = True
except ImportError:  # pragma: no cover - depends on the installed Triton
    AVAILABLE = False

from . import _common, configs
from .features import Features

# Query rows per program (two consumer warpgroups of 64) and key rows per block.
BLOCK_M = 128
BLOCK_N = 128
HEAD_DIMS = (64, 128)
# Ring depth per head dim: two K and two V slots of 128 x 128 bf16 plus the query tile use 160 KB at d128.
STAGES = {64: 3, 128: 2}
# FLASHTILE_GLUON=0 turns the fast path off (to compare with the portable kernel, or to work around a problem).
ENABLED = os.environ.get("FLASHTILE_GLUON", "1") != "0"

if AVAILABLE:

    @gluon.jit
    def _load_partition(q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_bar, k_full, k_empty, v_full, v_empty,
                        start_m, n_blocks, HALF_M: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr):
        # The query tile, as two halves (one per consumer warpgroup), on one barrier.
        mbarrier.expect(q_bar, 2 * q_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(q_desc, [start_m, 0], q_bar, q_smem.index(0))
        tma.async_copy_global_to_shared(q_desc, [start_m + HALF_M, 0], q_bar, q_smem.index(1))
        for j in range(n_blocks):
            slot = j % STAGES
            # A fresh barrier has completed no phase, so the first pass through the ring waits on parity 1 and
            # does not block; after that, each slot waits for both consumers to release it.
            phase = ((j // STAGES) & 1) ^ 1
            mbarrier.wait(k_empty.index(slot), phase)
            mbarrier.expect(k_full.index(slot), k_desc.block_type.nbytes)
            tma.async_copy_global_to_shared(k_desc, [j * BLOCK_N, 0], k_full.index(slot), k_smem.index(slot))
            mbarrier.wait(v_empty.index(slot), phase)
            mbarrier.expect(v_full.index(slot), v_desc.block_type.nbytes)
            tma.async_copy_global_to_shared(v_desc, [j * BLOCK_N, 0], v_full.index(slot), v_smem.index(slot))

    @gluon.jit
    def _softmax_step(s, m_i, l_i, row, col, seqlen_k, diag_offset, qk_scale, MASK: gl.constexpr,
                      CAUSAL: gl.constexpr):
        """Online softmax of one score block (docs/derivation.md ch. 3) in log2 units: returns p, alpha, m, l."""
        if MASK:
            keep = gl.expand_dims(col, 0) < seqlen_k
            if CAUSAL:
                keep = keep & (gl.expand_dims(col, 0) <= gl.expand_dims(row, 1) + diag_offset)
            s = gl.where(keep, s, float("-inf"))
        m_new = gl.maximum(m_i, gl.max(s, 1) * qk_scale)
        if MASK:
            # A row that has seen no key yet keeps m = -inf; subtracting 0 instead keeps exp2 away from NaN.
            m_new = gl.where(m_new == float("-inf"), 0.0, m_new)
        p = gl.exp2(s * qk_scale - gl.expand_dims(m_new, 1))
        alpha = gl.exp2(m_i - m_new)
        l_i = l_i * alpha + gl.sum(p, 1)
        return p, alpha, m_new, l_i

    @gluon.jit
    def _consume_block(q, k_smem, v_smem, k_full, k_empty, v_full, v_empty, j, p_prev, acc, m_i, l_i, s_zero,
                       row, seqlen_k, diag_offset, qk_scale, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
                       MASK: gl.constexpr, CAUSAL: gl.constexpr, dot_a: gl.constexpr):
        """One steady-state step: S_j = Q K_j^T and O += P_{j-1} V_{j-1} in flight while softmax(S_j) runs."""
        slot = j % STAGES
        prev = (j - 1) % STAGES
        mbarrier.wait(k_full.index(slot), (j // STAGES) & 1)
        s_tok = warpgroup_mma(q, k_smem.index(slot).permute((1, 0)), s_zero, use_acc=False, is_async=True)
        mbarrier.wait(v_full.index(prev), ((j - 1) // STAGES) & 1)
        acc_tok = warpgroup_mma(p_prev, v_smem.index(prev), acc, is_async=True)
        # wgmma groups retire in issue order: one left outstanding means the scores are done.
        s, acc_tok = warpgroup_mma_wait(1, deps=(s_tok, acc_tok))
        mbarrier.arrive(k_empty.index(slot), count=1)
        col = j * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s.type.layout))
        p, alpha, m_i, l_i = _softmax_step(s, m_i, l_i, row, col, seqlen_k, diag_offset, qk_scale, MASK, CAUSAL)
        acc = warpgroup_mma_wait(0, deps=(acc_tok, ))
        mbarrier.arrive(v_empty.index(prev), count=1)
        acc = acc * gl.expand_dims(gl.convert_layout(alpha, gl.SliceLayout(1, acc.type.layout)), 1)
        p_prev = gl.convert_layout(p.to(q.dtype), dot_a)
        return p_prev, acc, m_i, l_i

    @gluon.jit
    def _softmax_partition(half: gl.constexpr, o_desc, Lse, q_smem, k_smem, v_smem, q_bar, k_full, k_empty, v_full,
                           v_empty, start_m, n_blocks, seqlen_q, seqlen_k, diag_offset, qk_scale,
                           HALF_M: gl.constexpr, BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr,
                           STAGES: gl.constexpr, CAUSAL: gl.constexpr):
        dtype: gl.constexpr = o_desc.dtype
        s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                           instr_shape=[16, BLOCK_N, 16])
        o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                           instr_shape=[16, HEAD_DIM, 16])
        dot_a: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
        row_layout: gl.constexpr = gl.SliceLayout(1, s_layout)

        row_start = start_m + half * HALF_M
        row = row_start + gl.arange(0, HALF_M, layout=row_layout)
        # Blocks below n_full are visible to every row of this half (and lie inside Sk): no mask there.
        n_full = seqlen_k // BLOCK_N
        if CAUSAL:
            n_full = gl.minimum(n_full, gl.maximum(row_start + diag_offset + 1, 0) // BLOCK_N)
        n_full = gl.minimum(n_full, n_blocks)

        m_i = gl.full([HALF_M], float("-inf"), gl.float32, layout=row_layout)
        l_i = gl.zeros([HALF_M], gl.float32, layout=row_layout)
        acc = gl.zeros([HALF_M, HEAD_DIM], gl.float32, layout=o_layout)
        s_zero = gl.zeros([HALF_M, BLOCK_N], gl.float32, layout=s_layout)
        q = q_smem.index(half)
        mbarrier.wait(q_bar, 0)
        if n_blocks > 0:
            # Prologue: the first block's scores and softmax; nothing to multiply into V yet.
            mbarrier.wait(k_full.index(0), 0)
            s_tok = warpgroup_mma(q, k_smem.index(0).permute((1, 0)), s_zero, use_acc=False, is_async=True)
            s = warpgroup_mma_wait(0, deps=(s_tok, ))
            mbarrier.arrive(k_empty.index(0), count=1)
            col = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
            if n_full > 0:
                p, alpha, m_i, l_i = _softmax_step(s, m_i, l_i, row, col, seqlen_k, diag_offset, qk_scale, False,
                                                   CAUSAL)
            else:
                p, alpha, m_i, l_i = _softmax_step(s, m_i, l_i, row, col, seqlen_k, diag_offset, qk_scale, True,
                                                   CAUSAL)
            p_prev = gl.convert_layout(p.to(dtype), dot_a)
            for j in range(1, gl.maximum(n_full, 1)):
                p_prev, acc, m_i, l_i = _consume_block(q, k_smem, v_smem, k_full, k_empty, v_full, v_empty, j,
                                                       p_prev, acc, m_i, l_i, s_zero, row, seqlen_k, diag_offset,
                                                       qk_scale, BLOCK_N, STAGES, False, CAUSAL, dot_a)
            for j in range(gl.maximum(n_full, 1), n_blocks):
                p_prev, acc, m_i, l_i = _consume_block(q, k_smem, v_smem, k_full, k_empty, v_full, v_empty, j,
                                                       p_prev, acc, m_i, l_i, s_zero, row, seqlen_k, diag_offset,
                                                       qk_scale, BLOCK_N, STAGES, True, CAUSAL, dot_a)
            # Epilogue: the last block's P V.
            last = (n_blocks - 1) % STAGES
            mbarrier.wait(v_full.index(last), ((n_blocks - 1) // STAGES) & 1)
            acc_tok = warpgroup_mma(p_prev, v_smem.index(last), acc, is_async=True)
            acc = warpgroup_mma_wait(0, deps=(acc_tok, ))
            mbarrier.arrive(v_empty.index(last), count=1)

        # A row that saw no key has l = 0: it outputs 0 and its LSE is -inf (as in kernels/forward.py).
        empty = l_i == 0.0
        l_safe = gl.where(empty, 1.0, l_i)
        lse = gl.where(empty, float("-inf"), (m_i + gl.log2(l_safe)) * 0.6931471805599453)
        acc = acc / gl.expand_dims(gl.convert_layout(l_safe, gl.SliceLayout(1, o_layout)), 1)
        gl.store(Lse + row, lse, mask=row < seqlen_q)
        # This half of the query tile is no longer read: the output goes out through it, clipped at Sq by TMA.
        q.store(acc.to(dtype))
        fence_async_shared()
        tma.async_copy_shared_to_global(o_desc, [row_start, 0], q)
        tma.store_wait(pendings=0)

    @gluon.jit
    def _fwd_kernel(Q, K, V, Out, Lse, stride_qb, stride_qs, stride_qh, stride_kb, stride_ks, stride_kh,
                    stride_vb, stride_vs, stride_vh, stride_ob, stride_os, stride_oh, stride_lb, stride_lh,
                    seqlen_q, seqlen_k, diag_offset, qk_scale, num_heads, group_size,
                    HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
                    CAUSAL: gl.constexpr):
        HALF_M: gl.constexpr = BLOCK_M // 2
        dtype: gl.constexpr = Q.dtype.element_ty
        i_m = gl.program_id(0)
        if CAUSAL:
            # The last query blocks see the most keys: launch them first so the final wave is short.
            i_m = gl.num_programs(0) - 1 - i_m
        i_bh = gl.program_id(1)
        i_b = i_bh // num_heads
        i_h = i_bh % num_heads
        i_hk = i_h // group_size
        start_m = i_m * BLOCK_M

        layout: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
        q_desc = tma.make_tensor_descriptor(Q + i_b.to(gl.int64) * stride_qb + i_h.to(gl.int64) * stride_qh,
                                            [seqlen_q, HEAD_DIM], [stride_qs, 1], [HALF_M, HEAD_DIM], layout)
        k_desc = tma.make_tensor_descriptor(K + i_b.to(gl.int64) * stride_kb + i_hk.to(gl.int64) * stride_kh,
                                            [seqlen_k, HEAD_DIM], [stride_ks, 1], [BLOCK_N, HEAD_DIM], layout)
        v_desc = tma.make_tensor_descriptor(V + i_b.to(gl.int64) * stride_vb + i_hk.to(gl.int64) * stride_vh,
                                            [seqlen_k, HEAD_DIM], [stride_vs, 1], [BLOCK_N, HEAD_DIM], layout)
        o_desc = tma.make_tensor_descriptor(Out + i_b.to(gl.int64) * stride_ob + i_h.to(gl.int64) * stride_oh,
                                            [seqlen_q, HEAD_DIM], [stride_os, 1], [HALF_M, HEAD_DIM], layout)
        lse_base = Lse + i_b.to(gl.int64) * stride_lb + i_h.to(gl.int64) * stride_lh

        # Key blocks this query tile sees: all of them, or up to the causal diagonal of its last row.
        kv_end = seqlen_k
        if CAUSAL:
            kv_end = gl.maximum(gl.minimum(seqlen_k, start_m + BLOCK_M + diag_offset), 0)
        n_blocks = gl.cdiv(kv_end, BLOCK_N)

        q_smem = gl.allocate_shared_memory(dtype, [2, HALF_M, HEAD_DIM], layout)
        k_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, HEAD_DIM], layout)
        v_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, HEAD_DIM], layout)
        q_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        k_full = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        k_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        v_full = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        v_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        mbarrier.init(q_bar, count=1)
        for i in gl.static_range(STAGES):
            mbarrier.init(k_full.index(i), count=1)
            mbarrier.init(v_full.index(i), count=1)
            # Both consumer warpgroups release a slot before the producer refills it.
            mbarrier.init(k_empty.index(i), count=2)
            mbarrier.init(v_empty.index(i), count=2)

        gl.warp_specialize([
            (_softmax_partition, (0, o_desc, lse_base, q_smem, k_smem, v_smem, q_bar, k_full, k_empty, v_full,
                                  v_empty, start_m, n_blocks, seqlen_q, seqlen_k, diag_offset, qk_scale, HALF_M,
                                  BLOCK_N, HEAD_DIM, STAGES, CAUSAL)),
            (_softmax_partition, (1, o_desc, lse_base, q_smem, k_smem, v_smem, q_bar, k_full, k_empty, v_full,
                                  v_empty, start_m, n_blocks, seqlen_q, seqlen_k, diag_offset, qk_scale, HALF_M,
                                  BLOCK_N, HEAD_DIM, STAGES, CAUSAL)),
            (_load_partition, (q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_bar, k_full, k_empty, v_full,
                               v_empty, start_m, n_blocks, HALF_M, BLOCK_N, STAGES)),
        ], [4, 1], [232, 24])


def supports(q, k, v, feats: Features, softmax_scale) -> bool:
    """Whether this kernel computes the request: a Hopper GPU, fp16/bf16, d = dv in HEAD_DIMS, and no feature
    besides a causal mask. Anything else (and FLASHTILE_GLUON=0) takes the portable kernel."""
    if not (AVAILABLE and ENABLED and q.is_cuda and not configs.INTERPRETING):
        return False
    if torch.cuda.get_device_capability(q.device)[0] != 9:
        return False
    if q.dtype not in (torch.float16, torch.bfloat16) or not (q.dtype == k.dtype == v.dtype):
        return False
    if q.shape[-1] not in HEAD_DIMS or k.shape[-1] != q.shape[-1] or v.shape[-1] != q.shape[-1]:
        return False
    if (feats.varlen or feats.mask_left or feats.softcap or feats.alibi_slopes is not None
            or feats.attn_bias is not None):
        return False
    if feats.sinks is not None or feats.dropout_p > 0:
        return False
    if feats.mask_right and feats.window_right != 0:
        return False  # a right window other than the causal diagonal
    return configs._tma_ok((q, k, v)) and softmax_scale > 0


def attention_forward(q, k, v, softmax_scale, diagonal_offset, causal):
    """Same contract as kernels.forward.attention_forward for the cases `supports` accepts."""
    batch, seqlen_q, num_heads, head_dim = q.shape
    seqlen_k, num_kv_heads = k.shape[1], k.shape[2]
    out = _common.empty((batch, seqlen_q, num_heads, head_dim), q.dtype, q.device)
    lse = _common.empty((batch, num_heads, seqlen_q), torch.float32, q.device)
    configs._set_tma_allocator(q.device)
    grid = (triton.cdiv(seqlen_q, BLOCK_M), batch * num_heads)
    _fwd_kernel[grid](
        q, k, v, out, lse, *q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *out.stride()[:3],
        lse.stride(0), lse.stride(1), seqlen_q, seqlen_k, diagonal_offset,
        softmax_scale * 1.4426950408889634, num_heads, num_heads // num_kv_heads,
        HEAD_DIM=head_dim, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, STAGES=STAGES[head_dim], CAUSAL=causal, num_warps=4)
    return out, lse
