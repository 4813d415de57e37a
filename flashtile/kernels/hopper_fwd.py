"""Hopper forward written in Gluon: warp-specialized, the FA3 structure spelled out (docs/derivation.md ch. 5).

The plain-Triton forward (kernels/forward.py) leaves the schedule to the compiler, which keeps one warpgroup
busy with both the matrix multiplies and the softmax. This kernel fixes the schedule by hand:

* plain attention runs persistent: one program per SM walks a list of (query tile, batch*head) work items, so the
  loads of the next tile overlap the end of the current one, and the output store of a tile is only waited for
  when its buffer is needed again (causal calls launch one program per tile, see PERSISTENT);
* a producer warp (``_load_partition``) brings each query tile in (two 64-row halves behind a "full" and an
  "empty" mbarrier) and streams K and V blocks by TMA into a ring of ``STAGES`` shared-memory slots, each guarded
  the same way. It runs ahead across tiles: the next query tile comes in as soon as both consumers have finished
  their last ``Q K^T`` of the current one;
* two consumer warpgroups (``_softmax_partition``), each owning 64 of the tile's 128 query rows, read the same
  ring. Step j of a warpgroup issues ``S_j = Q K_j^T`` and ``P_{j-1} V_{j-1}`` together, waits for ``S_j``
  alone and computes its softmax while ``P_{j-1} V_{j-1}`` is still on the tensor cores.

Two facts about ptxas (Triton 3.6) shape the code; benchmarks/NOTES.md ("Gluon forward: persistence and d64")
has the SASS. (1) ptxas hoists ``wgmma.wait_group`` above independent arithmetic of the same basic block: with
the wait for ``P_{j-1} V_{j-1}`` simply written after the softmax, it landed before the exponentials and a
warpgroup never overlapped its own ``P V``. The softmax is therefore written in two branches (masked and
unmasked block), which puts the wait in a block of its own after them. (2) ptxas does not keep the register
operand of a wgmma alive across a loop iteration: leaving ``P_{j-1} V_{j-1}`` in flight into step j+1 let it
reuse the P registers while the tensor cores still read them (wrong results), so every step retires its own
``P V``.

It covers the plain and causal forward (bottom-right aligned, as everywhere in flashtile) for fp16/bf16 at head
dims 64 and 128, GQA included; every other feature runs on the portable kernel. ``supports`` is the dispatch
rule, and tests/test_gluon.py compares the two kernels on the GPU. Gluon does not run in Triton's interpreter, so
this module only compiles on a Hopper GPU; importing it anywhere is safe.
"""
# q, out: [B, Sq, H, D]; k, v: [B, Sk, Hk, D]; lse: [B, H, Sq] (fp32, natural log)
import functools
import os

import torch
import triton

from . import _common, configs
from ._common import LN2, LOG2E
from ._gluon import AVAILABLE, CONSUMER_REGS, PRODUCER_REGS
from .features import Features

if AVAILABLE:
    from ._gluon import (TensorDescriptor, fence_async_shared, gl, gluon, mbarrier, tma, tma_load, tma_store,
                         warpgroup_mma, warpgroup_mma_wait)

# Query rows per work item (two consumer warpgroups of 64) and key rows per block.
BLOCK_M = 128
BLOCK_N = 128
HEAD_DIMS = (64, 128)
# Ring depth per head dim. d128: 2 K + 2 V slots of 32 KB, the query tile and the output buffer (32 KB each) use
# 192 of the 227 KB of shared memory; a third stage does not fit. d64: 3 stages, 128 KB.
STAGES = {64: 3, 128: 2}
# One program per SM looping over work items (plain attention); False, and every causal call, launches one program
# per work item instead (the same kernel): causal tiles differ in cost, and a static round-robin share per program
# was unbalanced (B1 H16 S16k d128: 474 TFLOP/s persistent vs 629 with one program per tile, NOTES.md).
PERSISTENT = True
# FLASHTILE_GLUON=0 turns the fast path off (to compare with the portable kernel, or to work around a problem).
ENABLED = os.environ.get("FLASHTILE_GLUON", "1") != "0"

if AVAILABLE:
    @gluon.jit
    def _tile_coords(tile, n_m, num_heads, BLOCK_M: gl.constexpr, CAUSAL: gl.constexpr):
        """Work item -> (first query row, batch, head). The query tiles of one head are consecutive items, so the
        programs running at one time share few heads' K/V in L2; causal: the tiles that see the most keys first."""
        i_bh = tile // n_m
        i_m = tile % n_m
        if CAUSAL:
            i_m = n_m - 1 - i_m
        return i_m * BLOCK_M, i_bh // num_heads, i_bh % num_heads

    @gluon.jit
    def _num_blocks(start_m, seqlen_k, diag_offset, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                    CAUSAL: gl.constexpr):
        """Key blocks a query tile sees: all of them, or up to the causal diagonal of its last row."""
        kv_end = seqlen_k
        if CAUSAL:
            kv_end = gl.maximum(gl.minimum(seqlen_k, start_m + BLOCK_M + diag_offset), 0)
        return gl.cdiv(kv_end, BLOCK_N)

    @gluon.jit
    def _load_partition(q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_full, q_empty, k_full, k_empty, v_full,
                        v_empty, n_tiles, n_m, num_heads, group_size, seqlen_k, diag_offset,
                        HALF_M: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                        HEAD_DIM: gl.constexpr, STAGES: gl.constexpr, CAUSAL: gl.constexpr):
        c = 0  # blocks loaded so far by this program: slot c % STAGES, pass c // STAGES through the ring
        it = 0  # work items so far
        for tile in range(gl.program_id(0), n_tiles, gl.num_programs(0)):
            start_m, i_b, i_h = _tile_coords(tile, n_m, num_heads, BLOCK_M, CAUSAL)
            i_hk = i_h // group_size
            n_blocks = _num_blocks(start_m, seqlen_k, diag_offset, BLOCK_M, BLOCK_N, CAUSAL)
            # A fresh barrier has completed no phase, so the first wait on an "empty" barrier (parity 1) does not
            # block; after that, each wait needs both consumers' release of the previous use.
            mbarrier.wait(q_empty, (it & 1) ^ 1)
            mbarrier.expect(q_full, 2 * q_desc.block_type.nbytes)
            for half in gl.static_range(2):
                tma_load(q_desc, [i_b, start_m + half * HALF_M, i_h, 0], q_full,
                                                q_smem.index(half).reshape([1, HALF_M, 1, HEAD_DIM]))
            # K runs one block ahead of V, the order the consumers use them in: step j reads K_j and V_{j-1}.
            for j in range(n_blocks + 1):
                if j < n_blocks:
                    slot = (c + j) % STAGES
                    mbarrier.wait(k_empty.index(slot), (((c + j) // STAGES) & 1) ^ 1)
                    mbarrier.expect(k_full.index(slot), k_desc.block_type.nbytes)
                    tma_load(k_desc, [i_b, j * BLOCK_N, i_hk, 0], k_full.index(slot),
                                                    k_smem.index(slot).reshape([1, BLOCK_N, 1, HEAD_DIM]))
                if j > 0:
                    slot = (c + j - 1) % STAGES
                    mbarrier.wait(v_empty.index(slot), (((c + j - 1) // STAGES) & 1) ^ 1)
                    mbarrier.expect(v_full.index(slot), v_desc.block_type.nbytes)
                    tma_load(v_desc, [i_b, (j - 1) * BLOCK_N, i_hk, 0], v_full.index(slot),
                                                    v_smem.index(slot).reshape([1, BLOCK_N, 1, HEAD_DIM]))
            c += n_blocks
            it += 1

    @gluon.jit
    def _softmax_core(s, m_i, l_i, qk_scale):
        """Online softmax of one score block (docs/derivation.md ch. 3) in log2 units: returns p, alpha, m, l."""
        m_new = gl.maximum(m_i, gl.max(s, 1) * qk_scale)
        # A row that has seen no key yet keeps m = -inf; subtracting 0 instead keeps exp2 away from NaN.
        m_new = gl.where(m_new == float("-inf"), 0.0, m_new)
        p = gl.exp2(s * qk_scale - gl.expand_dims(m_new, 1))
        alpha = gl.exp2(m_i - m_new)
        l_i = l_i * alpha + gl.sum(p, 1)
        return p, alpha, m_new, l_i

    @gluon.jit
    def _softmax_step(s, m_i, l_i, row, col, seqlen_k, diag_offset, qk_scale, mask, CAUSAL: gl.constexpr):
        """`mask` (runtime): apply Sk and the causal diagonal. Both branches hold a whole softmax, so the wait that
        follows a call starts a basic block of its own and ptxas cannot hoist it above the exponentials."""
        if mask:
            keep = gl.expand_dims(col, 0) < seqlen_k
            if CAUSAL:
                keep = keep & (gl.expand_dims(col, 0) <= gl.expand_dims(row, 1) + diag_offset)
            p, alpha, m_n, l_n = _softmax_core(gl.where(keep, s, float("-inf")), m_i, l_i, qk_scale)
        else:
            p, alpha, m_n, l_n = _softmax_core(s, m_i, l_i, qk_scale)
        return p, alpha, m_n, l_n

    @gluon.jit
    def _consume_block(q, k_smem, v_smem, k_full, k_empty, v_full, v_empty, j, c, p_prev, alpha_prev, acc, m_i, l_i,
                       s_zero, row, seqlen_k, diag_offset, qk_scale, n_full, BLOCK_N: gl.constexpr,
                       STAGES: gl.constexpr, CAUSAL: gl.constexpr, dot_a: gl.constexpr):
        """Step j >= 1 of a warpgroup: in P_{j-1} and its alpha, out P_j and its alpha; O holds P_{<j} V_{<j}."""
        k_slot = (c + j) % STAGES
        v_slot = (c + j - 1) % STAGES
        acc = acc * gl.expand_dims(gl.convert_layout(alpha_prev, gl.SliceLayout(1, acc.type.layout)), 1)
        mbarrier.wait(k_full.index(k_slot), ((c + j) // STAGES) & 1)
        s_tok = warpgroup_mma(q, k_smem.index(k_slot).permute((1, 0)), s_zero, use_acc=False, is_async=True)
        mbarrier.wait(v_full.index(v_slot), ((c + j - 1) // STAGES) & 1)
        acc_tok = warpgroup_mma(p_prev, v_smem.index(v_slot), acc, is_async=True)
        # wgmma groups retire in issue order: one left outstanding means S_j is done, P_{j-1} V_{j-1} may not be.
        s = warpgroup_mma_wait(1, deps=(s_tok, ))
        mbarrier.arrive(k_empty.index(k_slot), count=1)
        col = j * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s.type.layout))
        p, alpha, m_i, l_i = _softmax_step(s, m_i, l_i, row, col, seqlen_k, diag_offset, qk_scale, j >= n_full,
                                           CAUSAL)
        acc = warpgroup_mma_wait(0, deps=(acc_tok, ))
        mbarrier.arrive(v_empty.index(v_slot), count=1)
        p = gl.convert_layout(p.to(q.dtype), dot_a)
        return p, alpha, acc, m_i, l_i

    @gluon.jit
    def _softmax_partition(half: gl.constexpr, o_desc, Lse, stride_lb, stride_lh, q_smem, k_smem, v_smem, o_smem,
                           q_full, q_empty, k_full, k_empty, v_full, v_empty, n_tiles, n_m, num_heads, seqlen_q,
                           seqlen_k, diag_offset, qk_scale, HALF_M: gl.constexpr, BLOCK_M: gl.constexpr,
                           BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr, STAGES: gl.constexpr,
                           CAUSAL: gl.constexpr):
        dtype: gl.constexpr = o_desc.dtype
        s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                           instr_shape=[16, BLOCK_N, 16])
        o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                           instr_shape=[16, HEAD_DIM, 16])
        dot_a: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
        row_layout: gl.constexpr = gl.SliceLayout(1, s_layout)
        s_zero = gl.zeros([HALF_M, BLOCK_N], gl.float32, layout=s_layout)
        q = q_smem.index(half)
        o_buf = o_smem.index(half)

        c = 0  # blocks consumed so far by this program, counted as the producer counts them
        it = 0  # work items so far
        for tile in range(gl.program_id(0), n_tiles, gl.num_programs(0)):
            start_m, i_b, i_h = _tile_coords(tile, n_m, num_heads, BLOCK_M, CAUSAL)
            n_blocks = _num_blocks(start_m, seqlen_k, diag_offset, BLOCK_M, BLOCK_N, CAUSAL)
            row_start = start_m + half * HALF_M
            row = row_start + gl.arange(0, HALF_M, layout=row_layout)
            # Blocks below n_full are visible to every row of this half (and lie inside Sk): no mask there.
            n_full = seqlen_k // BLOCK_N
            if CAUSAL:
                n_full = gl.minimum(n_full, gl.maximum(row_start + diag_offset + 1, 0) // BLOCK_N)

            m_i = gl.full([HALF_M], float("-inf"), gl.float32, layout=row_layout)
            l_i = gl.zeros([HALF_M], gl.float32, layout=row_layout)
            acc = gl.zeros([HALF_M, HEAD_DIM], gl.float32, layout=o_layout)
            mbarrier.wait(q_full, it & 1)
            if n_blocks > 0:
                # Step 0: the first block's scores and softmax; nothing to multiply into V yet.
                slot = c % STAGES
                mbarrier.wait(k_full.index(slot), (c // STAGES) & 1)
                s_tok = warpgroup_mma(q, k_smem.index(slot).permute((1, 0)), s_zero, use_acc=False, is_async=True)
                s = warpgroup_mma_wait(0, deps=(s_tok, ))
                mbarrier.arrive(k_empty.index(slot), count=1)
                col = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
                p, alpha, m_i, l_i = _softmax_step(s, m_i, l_i, row, col, seqlen_k, diag_offset, qk_scale,
                                                   n_full == 0, CAUSAL)
                p = gl.convert_layout(p.to(dtype), dot_a)
                for j in range(1, n_blocks):
                    p, alpha, acc, m_i, l_i = _consume_block(q, k_smem, v_smem, k_full, k_empty, v_full, v_empty,
                                                             j, c, p, alpha, acc, m_i, l_i, s_zero, row, seqlen_k,
                                                             diag_offset, qk_scale, n_full, BLOCK_N, STAGES, CAUSAL,
                                                             dot_a)
                # Every Q K^T of this tile is done: the producer may load the next query tile.
                mbarrier.arrive(q_empty, count=1)
                # Last step: P_{n-1} V_{n-1}.
                acc = acc * gl.expand_dims(gl.convert_layout(alpha, gl.SliceLayout(1, o_layout)), 1)
                last = (c + n_blocks - 1) % STAGES
                mbarrier.wait(v_full.index(last), ((c + n_blocks - 1) // STAGES) & 1)
                acc_tok = warpgroup_mma(p, v_smem.index(last), acc, is_async=True)
                acc = warpgroup_mma_wait(0, deps=(acc_tok, ))
                mbarrier.arrive(v_empty.index(last), count=1)
            else:
                mbarrier.arrive(q_empty, count=1)

            # A row that saw no key has l = 0: it outputs 0 and its LSE is -inf (as in kernels/forward.py).
            empty = l_i == 0.0
            l_safe = gl.where(empty, 1.0, l_i)
            lse = gl.where(empty, float("-inf"), (m_i + gl.log2(l_safe)) * LN2)
            acc = acc / gl.expand_dims(gl.convert_layout(l_safe, gl.SliceLayout(1, o_layout)), 1)
            lse_base = Lse + i_b.to(gl.int64) * stride_lb + i_h.to(gl.int64) * stride_lh
            gl.store(lse_base + row, lse, mask=row < seqlen_q)
            # The previous tile's output store must have read the buffer before it is overwritten.
            tma.store_wait(pendings=0)
            o_buf.store(acc.to(dtype))
            fence_async_shared()
            # Rows past Sq are clipped by the descriptor's bounds.
            tma_store(o_desc, [i_b, row_start, i_h, 0],
                                            o_buf.reshape([1, HALF_M, 1, HEAD_DIM]))
            c += n_blocks
            it += 1
        tma.store_wait(pendings=0)

    @gluon.jit
    def _fwd_kernel(q_desc, k_desc, v_desc, o_desc, Lse, stride_lb, stride_lh, seqlen_q, seqlen_k, diag_offset,
                    qk_scale, num_heads, group_size, n_m, n_tiles,
                    HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
                    CAUSAL: gl.constexpr):
        HALF_M: gl.constexpr = BLOCK_M // 2
        dtype: gl.constexpr = q_desc.dtype
        layout: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
        q_smem = gl.allocate_shared_memory(dtype, [2, HALF_M, HEAD_DIM], layout)
        k_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, HEAD_DIM], layout)
        v_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, HEAD_DIM], layout)
        o_smem = gl.allocate_shared_memory(dtype, [2, HALF_M, HEAD_DIM], layout)
        q_full = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        q_empty = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        k_full = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        k_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        v_full = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        v_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        # Each "empty" barrier waits for both consumer warpgroups.
        mbarrier.init(q_full, count=1)
        mbarrier.init(q_empty, count=2)
        for i in gl.static_range(STAGES):
            mbarrier.init(k_full.index(i), count=1)
            mbarrier.init(v_full.index(i), count=1)
            mbarrier.init(k_empty.index(i), count=2)
            mbarrier.init(v_empty.index(i), count=2)

        gl.warp_specialize([
            (_softmax_partition, (0, o_desc, Lse, stride_lb, stride_lh, q_smem, k_smem, v_smem, o_smem, q_full,
                                  q_empty, k_full, k_empty, v_full, v_empty, n_tiles, n_m, num_heads, seqlen_q,
                                  seqlen_k, diag_offset, qk_scale, HALF_M, BLOCK_M, BLOCK_N, HEAD_DIM, STAGES,
                                  CAUSAL)),
            (_softmax_partition, (1, o_desc, Lse, stride_lb, stride_lh, q_smem, k_smem, v_smem, o_smem, q_full,
                                  q_empty, k_full, k_empty, v_full, v_empty, n_tiles, n_m, num_heads, seqlen_q,
                                  seqlen_k, diag_offset, qk_scale, HALF_M, BLOCK_M, BLOCK_N, HEAD_DIM, STAGES,
                                  CAUSAL)),
            (_load_partition, (q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_full, q_empty, k_full, k_empty,
                               v_full, v_empty, n_tiles, n_m, num_heads, group_size, seqlen_k, diag_offset, HALF_M,
                               BLOCK_M, BLOCK_N, HEAD_DIM, STAGES, CAUSAL)),
        ], [4, 1], [CONSUMER_REGS, PRODUCER_REGS])


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


@functools.lru_cache(maxsize=None)
def _num_sms(device_index):
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def _descriptor(t, rows):
    """A 4-D TMA descriptor over a [B, S, H, D] tensor with its own strides, one [rows, D] tile of one (batch,
    head) per copy: rows past S are zero-filled on loads and dropped on stores, whatever the layout."""
    layout = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=4)
    return TensorDescriptor(t, list(t.shape), list(t.stride()), [1, rows, 1, t.shape[-1]], layout)


def attention_forward(q, k, v, softmax_scale, diagonal_offset, causal):
    """Same contract as kernels.forward.attention_forward for the cases `supports` accepts."""
    batch, seqlen_q, num_heads, head_dim = q.shape
    seqlen_k, num_kv_heads = k.shape[1], k.shape[2]
    out = _common.empty((batch, seqlen_q, num_heads, head_dim), q.dtype, q.device)
    lse = _common.empty((batch, num_heads, seqlen_q), torch.float32, q.device)
    n_m = triton.cdiv(seqlen_q, BLOCK_M)
    n_tiles = n_m * batch * num_heads
    grid = (min(n_tiles, _num_sms(q.device.index)) if PERSISTENT and not causal else n_tiles, )
    _fwd_kernel[grid](
        _descriptor(q, BLOCK_M // 2), _descriptor(k, BLOCK_N), _descriptor(v, BLOCK_N), _descriptor(out, BLOCK_M // 2),
        lse, lse.stride(0), lse.stride(1), seqlen_q, seqlen_k, diagonal_offset, softmax_scale * LOG2E.value, num_heads,
        num_heads // num_kv_heads, n_m, n_tiles,
        HEAD_DIM=head_dim, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, STAGES=STAGES[head_dim], CAUSAL=causal,
        num_warps=4)
    return out, lse
