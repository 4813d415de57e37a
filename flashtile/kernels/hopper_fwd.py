"""Hopper forward written in Gluon: warp-specialized, the FA3 structure spelled out (docs/derivation.md ch. 5).

The plain-Triton forward (kernels/forward.py) leaves the schedule to the compiler, which keeps one warpgroup
busy with both the matrix multiplies and the softmax. This kernel fixes the schedule by hand:

* one program per SM walks a list of work items (a query tile of one batch*head), so the loads of the next tile
  overlap the end of the current one, and the output store of a tile is only waited for when its buffer is needed
  again. Plain d128 takes items round-robin; the other calls take them from a global counter (dynamic schedule,
  ``DYNAMIC``): causal tiles differ in cost, and so does a last tile whose lower warpgroups lie past Sq;
* a producer warp (``_load_partition``) brings each query tile in (one 64-row part per consumer, ``QBUF``
  buffers deep, behind "full" and "empty" mbarriers) and streams K and V blocks by TMA into a ring of ``STAGES``
  shared-memory slots, each guarded the same way. With dynamic scheduling it also hands the consumers each item's
  index through shared memory, written before the item's query tile arrives;
* two or three consumer warpgroups (``_softmax_partition``), each owning 64 of the tile's query rows, read the
  same ring. Step j of a warpgroup issues ``S_j = Q K_j^T`` and ``P_{j-1} V_{j-1}`` together, waits for ``S_j``
  alone and computes its softmax while ``P_{j-1} V_{j-1}`` is still on the tensor cores. Three (192-row tiles,
  160 registers each) at plain d64, where the softmax costs as much as the two products and a third warpgroup
  fills the gaps the other two leave; a warpgroup whose rows all lie past Sq only follows the ring;
* on two warpgroups without an attn_mask, a left window or ALiBi, a step after a work item's first takes no row maximum
  and does not rescale O (``LAZY_MAX``): its exponentials are taken against the reference the rows already have,
  which the online softmax allows for any reference (docs/derivation.md ch. 3) as long as P keeps its range. The
  rows' sums say whether it did; if one passes ``LAZY_LIMIT``, the warpgroup (which agrees through one barrier)
  takes the block again with the maximum;
* a float attn_mask shared by the heads is read by groups of ``HEAD_GROUP`` heads' items at about the same time
  (``_tile_coords``), once from memory.

Facts about ptxas (Triton 3.6) that shape the code; benchmarks/NOTES.md ("Gluon forward: persistence and d64")
has the SASS. (1) ptxas hoists ``wgmma.wait_group`` above independent arithmetic of the same basic block: with
the wait for ``P_{j-1} V_{j-1}`` simply written after the softmax, it landed before the exponentials and a
warpgroup never overlapped its own ``P V``. The softmax is therefore written in two branches (masked and
unmasked block), which puts the wait in a block of its own after them. (2) ptxas does not keep the register
operand of a wgmma alive across a loop iteration: leaving ``P_{j-1} V_{j-1}`` in flight into step j+1 let it
reuse the P registers while the tensor cores still read them (wrong results), so every step retires its own
``P V``. (3) Any accumulator left in flight across a loop back-edge (e.g. issuing ``S_{j+1}`` during step j, with
two score blocks alternating) made ptxas serialize every wgmma (C7514), even where no instruction read it early.

It covers the plain and causal forward (bottom-right aligned, as everywhere in flashtile) for fp16/bf16 at head
dims 64 and 128, GQA included, and as constexpr variants of the same loops: sliding windows (the producer and
consumers walk only the band's blocks), softcap, ALiBi, sinks and attn_mask. An attn_mask (a float bias of the
inputs' dtype, or a bool mask) comes by TMA through a ring of its own, one [64, 128] tile per warpgroup and block;
a bool mask walks the list of key blocks it does not hide entirely (Features.block_lists), and blocks it leaves
entirely visible load no tile. Varlen batches (packed sequences) take the same loops, their items listed by
``varlen_tile_map``. Dropout zeroes P after its row sums, with the portable kernels' Philox bits
(_gluon.dropout_tile_keep). ``supports`` is the dispatch rule,
and tests/test_gluon.py and tests/test_gluon_features.py compare the two kernels on the GPU. Gluon does not run
in Triton's interpreter, so this module only compiles on a Hopper GPU; importing it anywhere is safe.
"""
# q, out: [B, Sq, H, D]; k, v: [B, Sk, Hk, D]; lse: [B, H, Sq] (fp32, natural log)
import functools
import os

import torch
import triton
import triton.language as tl

from ..reference.dropout import dropout_threshold
from . import _common, _launch, configs
from ._common import LN2, LOG2E
from ._gluon import AVAILABLE, CONSUMER_REGS, PRODUCER_REGS
from .features import BIAS_BOOL, BIAS_FLOAT, Features

if AVAILABLE:
    from ._gluon import (TensorDescriptor, dropout_tile_keep, fence_async_shared, gl, gluon, mbarrier, tanh_approx,
                         tma, tma_load, tma_store, to_float32, warpgroup_mma, warpgroup_mma_wait)

# Query rows per consumer warpgroup (a work item has NUM_WG of them) and key rows per block.
WG_M = 64
BLOCK_N = 128
HEAD_DIMS = (64, 128)
# Ring depth per head dim. d128: 2 K + 2 V slots of 32 KB, two query buffers and the output buffer (32 KB each) use
# 224 of the 227 KB of shared memory; a third stage does not fit. d64: 3 stages, 96 KB, and up to 72 KB more.
STAGES = {64: 3, 128: 2}
# (head_dim, causal) -> (consumer warpgroups NUM_WG, query buffers QBUF, dynamic schedule DYNAMIC). Same H200 run,
# TFLOP/s at S4k / S16k against the previous kernel (2 warpgroups, 1 buffer, causal one program per tile):
# plain d64 477 / 492 vs 441 / 446; causal d64 412 / 441 vs 386 / 444 (3 warpgroups there: 388 / 449);
# causal d128 553 / 627 vs 528 / 611; plain d128 626 / 638 vs 624 / 642 (2 buffers: +1-2% in two other runs).
CONFIGS = {(64, False): (3, 2, True), (64, True): (2, 2, True), (128, False): (2, 2, False), (128, True): (2, 1, True)}
# Registers per thread of the two worker consumers when there are three (16 warps: 512 per thread slot in all; the
# producer's warpgroup keeps 24, the first consumer gets what is left, 168).
CONSUMER_REGS_3WG = tl.constexpr(160)
# attn_mask tiles (a float bias or a bool mask) come through a ring of their own, BIAS_STAGES deep (at d128 a third
# 32 KB stage of a 16-bit bias does not fit beside K/V); _smem_plan fits it into SMEM_BYTES (of the 227 KB an
# H100/H200 block may use, what is left beside the barriers).
BIAS_STAGES = 2
SMEM_BYTES = 224 * 1024
# LAZY_MAX = 1: without an attn_mask, a left window or ALiBi, on two warpgroups, blocks after a work item's first take
# their exponentials against the rows' reference from earlier blocks, with no row maximum and no rescale of O,
# unless a row's sum passes LAZY_LIMIT (_finish_step): 2-5% faster forwards (benchmarks/NOTES.md, "The forward
# without a row maximum"). FLASHTILE_LAZY_MAX=0 turns it off; 2 (set here by probes only) skips the check: a
# measure of its cost, with wrong results once scores grow. 2^15: every P then fits fp16 (65504), and so does its
# sum.
LAZY_MAX = 0 if os.environ.get("FLASHTILE_LAZY_MAX", "1") == "0" else 1
LAZY_LIMIT = tl.constexpr(32768.0)
# An attn_mask shared by the heads ((B|1, 1, Sq, Sk), the usual shape of a padding or causal float mask) is read by
# every head. Items in the default order (a head's query tiles in turn) read each mask tile once per head from
# memory: 16 heads at 16k stream 8.6 GB for a 0.5 GB mask. HEAD_GROUP heads are then interleaved (_tile_coords), so
# that they read a tile at about the same time and L2 serves all but the first. 8: at 16k d128 a wave of programs
# covers ~16 query tiles of 8 heads, and the K/V the wave also reads (8 heads' worth, from memory once per wave)
# and the mask (twice in all) are then about equal. 1 keeps the default order. (FLASHTILE_HEAD_GROUP: probes.)
HEAD_GROUP = int(os.environ.get("FLASHTILE_HEAD_GROUP", "8"))
# False launches one program per work item instead of persistent ones (the same kernel, no dynamic schedule).
PERSISTENT = True
# FLASHTILE_GLUON=0 turns the fast path off (to compare with the portable kernel, or to work around a problem).
ENABLED = os.environ.get("FLASHTILE_GLUON", "1") != "0"

if AVAILABLE:
    @gluon.jit
    def _tile_coords(tile, n_m, num_heads, head_group, BLOCK_M: gl.constexpr, REVERSE: gl.constexpr):
        """Work item -> (first query row, batch, head). With head_group 1 the query tiles of one head are
        consecutive items, so the programs running at one time share few heads' K/V in L2. With head_group g > 1
        (an attn_mask shared by the heads: HEAD_GROUP) the heads go in groups of g and a group's items take its
        heads in turn for each query tile, so that g programs read each mask tile at about the same time, once
        from memory. REVERSE (causal, and bool masks, which are often causal-like): last tiles first, the ones
        that see the most keys."""
        if head_group == 1:
            i_bh = tile // n_m
            i_m = tile % n_m
            i_b = i_bh // num_heads
            i_h = i_bh % num_heads
        else:
            per_b = n_m * num_heads
            i_b = tile // per_b
            r = tile - i_b * per_b
            g0 = (r // (head_group * n_m)) * head_group
            size = gl.minimum(head_group, num_heads - g0)
            r = r - g0 * n_m
            i_m = r // size
            i_h = g0 + r - i_m * size
        if REVERSE:
            i_m = n_m - 1 - i_m
        return i_m * BLOCK_M, i_b, i_h

    @gluon.jit
    def _block_range(start_m, seqlen_k, diag_offset, left_offset, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                     CAUSAL: gl.constexpr, MASK_LEFT: gl.constexpr):
        """Key blocks a query tile sees, (first, count): all of them, or up to the right bound of its last row
        (CAUSAL), from the left bound of its first row on (MASK_LEFT)."""
        kv_end = seqlen_k
        if CAUSAL:
            kv_end = gl.maximum(gl.minimum(seqlen_k, start_m + BLOCK_M + diag_offset), 0)
        j_hi = gl.cdiv(kv_end, BLOCK_N)
        j_lo = 0
        if MASK_LEFT:
            j_lo = gl.minimum(gl.maximum(start_m + left_offset, 0) // BLOCK_N, j_hi)
        return j_lo, j_hi - j_lo

    @gluon.jit
    def _item_blocks(start_m, i_b, i_h, seqlen_k, diag_offset, left_offset, Counts, Idx, stride_cb, stride_ch,
                     idx_cols, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, CAUSAL: gl.constexpr,
                     MASK_LEFT: gl.constexpr, LISTS: gl.constexpr):
        """A work item's key blocks: (first, count, its block list). LISTS (a bool attn_mask): the count and the
        list of the blocks that hold any attended key, from Features.block_lists (see _block_at); otherwise a
        contiguous range (_block_range; idx_row is not read)."""
        if LISTS:
            off = i_b * stride_cb + i_h * stride_ch + start_m // BLOCK_M
            return 0, gl.load(Counts + off), Idx + off.to(gl.int64) * idx_cols
        else:
            j_lo, n_blocks = _block_range(start_m, seqlen_k, diag_offset, left_offset, BLOCK_M, BLOCK_N, CAUSAL,
                                          MASK_LEFT)
            return j_lo, n_blocks, Idx

    @gluon.jit
    def _block_at(j_lo, j, idx_row, LISTS: gl.constexpr):
        """A work item's j-th key block: (index, whether its attn_mask tile is read). Listed blocks the mask leaves
        entirely visible come as -1 - index (block_lists' mark_full): no tile is loaded or read for them."""
        if LISTS:
            raw = gl.load(idx_row + j)
            return gl.where(raw < 0, -1 - raw, raw), raw >= 0
        else:
            return j_lo + j, True

    @gluon.jit
    def _write_tile(tile_smem, tile):
        """Store a work item's index (dynamic schedule) from the producer warp."""
        layout: gl.constexpr = gl.BlockedLayout([1], [32], [1], [0])
        tile_smem.store(gl.full([1], tile, gl.int32, layout))

    # Varlen (VARLEN): q, k, v, out are [total, H, D] packed sequences, read through 4-D descriptors over
    # [1, total, H, D], so a tile may run into the next sequence's rows: keys past a sequence's end are masked by its
    # own Sk, queries past it computed and dropped, and the outputs of its last query tile stored from registers
    # under a mask. Work items are (compact query tile c, head), item = head * n_upper + c; varlen_tile_map lists
    # per c its sequence and that sequence's bounds (n_upper bounds the tiles: the map's rows past the last tile
    # have batch -1, and the producer skips them). The producer hands the consumers each item's fields through
    # tile_smem, one entry each after the item's index (ITEM_FIELDS).

    ITEM_FIELDS = gl.constexpr(8)  # tile_smem entries per query buffer under VARLEN: the index, then _varlen_item's

    @gluon.jit
    def _varlen_item(TileMap, tile, n_upper):
        """Work item -> (batch (-1: no tile), first query row, q_start, Sq, k_start, Sk, head) from its map row."""
        row = TileMap + (tile % n_upper) * 8
        return (gl.load(row), gl.load(row + 1), gl.load(row + 2), gl.load(row + 3), gl.load(row + 4),
                gl.load(row + 5), tile // n_upper)

    @gluon.jit
    def _load_partition(q_desc, k_desc, v_desc, bias_desc, q_smem, k_smem, v_smem, bias_smem, tile_smem, Counter,
                        TileMap, q_full, q_empty, k_full, k_empty, v_full, v_empty, b_full, b_empty, n_tiles, n_m,
                        num_heads, head_group, group_size, seqlen_k, diag_offset, left_offset, bias_mul_b, bias_mul_h,
                        Counts, Idx, stride_cb, stride_ch, idx_cols, PART_M: gl.constexpr, BLOCK_M: gl.constexpr,
                        BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr, STAGES: gl.constexpr, CAUSAL: gl.constexpr,
                        MASK_LEFT: gl.constexpr, BIAS: gl.constexpr, BSTAGES: gl.constexpr, NUM_WG: gl.constexpr,
                        DYNAMIC: gl.constexpr, QBUF: gl.constexpr, VARLEN: gl.constexpr):
        c = 0  # blocks loaded so far by this program: slot c % STAGES, pass c // STAGES through the ring
        bc = 0  # attn_mask tiles loaded so far (its own ring: slot bc % BSTAGES)
        it = 0  # work items so far
        tile = gl.program_id(0)
        while tile < n_tiles:
            if VARLEN:
                # n_m is n_upper here; the item's sequence and its own bottom-right offsets.
                i_b, start_m, q_start, seqlen_q_i, k_start, seqlen_k_i, i_h = _varlen_item(TileMap, tile, n_m)
                offset = seqlen_k_i - seqlen_q_i
                t_b = 0  # the descriptors' batch index
                valid = i_b >= 0
            else:
                start_m, i_b, i_h = _tile_coords(tile, n_m, num_heads, head_group, BLOCK_M, CAUSAL | (BIAS == 2))
                q_start = 0
                k_start = 0
                seqlen_k_i = seqlen_k
                offset = 0
                t_b = i_b
                seqlen_q_i = 0  # (not read)
                valid = True
            if valid:
                c, bc, it = _load_item(q_desc, k_desc, v_desc, bias_desc, q_smem, k_smem, v_smem, bias_smem,
                                       tile_smem, q_full, q_empty, k_full, k_empty, v_full, v_empty, b_full, b_empty,
                                       c, bc, it, tile, start_m, i_b, i_h, t_b, q_start, seqlen_q_i,
                                       k_start, group_size, seqlen_k_i, diag_offset + offset, left_offset + offset,
                                       bias_mul_b, bias_mul_h, Counts, Idx, stride_cb, stride_ch, idx_cols, PART_M,
                                       BLOCK_M, BLOCK_N, HEAD_DIM, STAGES, CAUSAL, MASK_LEFT, BIAS, BSTAGES, NUM_WG,
                                       DYNAMIC, QBUF, VARLEN)
            if DYNAMIC:
                # Items after the first one per program come from a global counter, in list order. Taken here,
                # after this item's loads are issued, its latency hides behind the wait for a free query buffer.
                tile = gl.num_programs(0) + gl.atomic_add(Counter, 1)
            else:
                tile += gl.num_programs(0)
        if DYNAMIC:
            # No item left: hand the consumers n_tiles in place of an index.
            qb = it % QBUF
            mbarrier.wait(q_empty.index(qb), ((it // QBUF) & 1) ^ 1)
            _write_tile(tile_smem.index(qb * (ITEM_FIELDS if VARLEN else 1)), n_tiles)
            mbarrier.arrive(q_full.index(qb), count=1)

    @gluon.jit
    def _load_item(q_desc, k_desc, v_desc, bias_desc, q_smem, k_smem, v_smem, bias_smem, tile_smem, q_full, q_empty,
                   k_full, k_empty, v_full, v_empty, b_full, b_empty, c, bc, it, tile, start_m, i_b, i_h, t_b,
                   q_start, seqlen_q, k_start, group_size, seqlen_k, diag_offset, left_offset, bias_mul_b,
                   bias_mul_h, Counts, Idx, stride_cb, stride_ch, idx_cols, PART_M: gl.constexpr, BLOCK_M: gl.constexpr,
                   BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr, STAGES: gl.constexpr, CAUSAL: gl.constexpr,
                   MASK_LEFT: gl.constexpr, BIAS: gl.constexpr, BSTAGES: gl.constexpr, NUM_WG: gl.constexpr,
                   DYNAMIC: gl.constexpr, QBUF: gl.constexpr, VARLEN: gl.constexpr):
        """The producer's loads for one work item (query rows from start_m of batch i_b, head i_h; the descriptors'
        rows offset by q_start / k_start and their batch index t_b under VARLEN). Returns the ring counters."""
        i_hk = i_h // group_size
        j_lo, n_blocks, idx_row = _item_blocks(start_m, i_b, i_h, seqlen_k, diag_offset, left_offset, Counts,
                                               Idx, stride_cb, stride_ch, idx_cols, BLOCK_M, BLOCK_N, CAUSAL,
                                               MASK_LEFT, BIAS == 2)
        # A fresh barrier has completed no phase, so the first wait on an "empty" barrier (parity 1) does not
        # block; after that, each wait needs every consumer's release of the previous use.
        qb = it % QBUF
        mbarrier.wait(q_empty.index(qb), ((it // QBUF) & 1) ^ 1)
        if DYNAMIC:
            # The consumers read the item's index once its query tile has arrived (the barrier's completion
            # orders this store before their read); they are done with this slot's previous index (q_empty).
            if VARLEN:
                base = qb * ITEM_FIELDS
                _write_tile(tile_smem.index(base), tile)
                _write_tile(tile_smem.index(base + 1), i_b)
                _write_tile(tile_smem.index(base + 2), start_m)
                _write_tile(tile_smem.index(base + 3), q_start)
                _write_tile(tile_smem.index(base + 4), seqlen_q)
                _write_tile(tile_smem.index(base + 5), seqlen_k)
                _write_tile(tile_smem.index(base + 6), i_h)
            else:
                _write_tile(tile_smem.index(qb), tile)
        mbarrier.expect(q_full.index(qb), NUM_WG * q_desc.block_type.nbytes)
        for part in gl.static_range(NUM_WG):
            tma_load(q_desc, [t_b, q_start + start_m + part * PART_M, i_h, 0], q_full.index(qb),
                     q_smem.index(qb * NUM_WG + part).reshape([1, PART_M, 1, HEAD_DIM]))
        # K runs one block ahead of V, the order the consumers use them in: step j reads K_j (and its bias
        # tile) and V_{j-1}.
        for j in range(n_blocks + 1):
            if j < n_blocks:
                blk, partial = _block_at(j_lo, j, idx_row, BIAS == 2)
                col = blk * BLOCK_N
                slot = (c + j) % STAGES
                mbarrier.wait(k_empty.index(slot), (((c + j) // STAGES) & 1) ^ 1)
                mbarrier.expect(k_full.index(slot), k_desc.block_type.nbytes)
                tma_load(k_desc, [t_b, k_start + col, i_hk, 0], k_full.index(slot),
                         k_smem.index(slot).reshape([1, BLOCK_N, 1, HEAD_DIM]))
                if BIAS != 0:
                    if partial:
                        # One attn_mask tile per consumer warpgroup: its PART_M rows, this block's keys.
                        slot = bc % BSTAGES
                        mbarrier.wait(b_empty.index(slot), ((bc // BSTAGES) & 1) ^ 1)
                        mbarrier.expect(b_full.index(slot), NUM_WG * bias_desc.block_type.nbytes)
                        for part in gl.static_range(NUM_WG):
                            tma_load(bias_desc,
                                     [i_b * bias_mul_b, i_h * bias_mul_h, start_m + part * PART_M, col],
                                     b_full.index(slot),
                                     bias_smem.index(slot * NUM_WG + part).reshape([1, 1, PART_M, BLOCK_N]))
                        bc += 1
            if j > 0:
                blk, partial = _block_at(j_lo, j - 1, idx_row, BIAS == 2)
                col = blk * BLOCK_N
                slot = (c + j - 1) % STAGES
                mbarrier.wait(v_empty.index(slot), (((c + j - 1) // STAGES) & 1) ^ 1)
                mbarrier.expect(v_full.index(slot), v_desc.block_type.nbytes)
                tma_load(v_desc, [t_b, k_start + col, i_hk, 0], v_full.index(slot),
                         v_smem.index(slot).reshape([1, BLOCK_N, 1, HEAD_DIM]))
        return c + n_blocks, bc, it + 1

    @gluon.jit
    def _softmax_core(s, m_i, l_i, qk_scale, KEEP_NEG_INF: gl.constexpr):
        """Online softmax of one score block (docs/derivation.md ch. 3) in log2 units: returns p, alpha, m, l."""
        m_new = gl.maximum(m_i, gl.max(s, 1) * qk_scale)
        # A row that has seen no key yet keeps m = -inf; subtracting 0 instead keeps exp2 away from NaN.
        m_sub = gl.where(m_new == float("-inf"), 0.0, m_new)
        p = gl.exp2(s * qk_scale - gl.expand_dims(m_sub, 1))
        alpha = gl.exp2(m_i - m_sub)
        l_i = l_i * alpha + gl.sum(p, 1)
        if KEEP_NEG_INF:
            # The state keeps -inf: with a left bound or an attn_mask a row's keys can start after fully masked
            # blocks, and a 0 there would join the max of its first visible block (P scaled away from its own
            # maximum: one key gave v only to an ulp, and scores below -126 in log2 units underflowed). Without
            # them, a row that sees no key in its first block sees none at all, and the 0 saves registers (d64's
            # three warpgroups spill 12 more stores keeping -inf).
            return p, alpha, m_new, l_i
        else:
            return p, alpha, m_sub, l_i

    @gluon.jit
    def _score_mod(s, col0, arow, slope, pre_scale, b, mod_unit, SOFTCAP: gl.constexpr, HAS_ALIBI: gl.constexpr,
                   BIAS: gl.constexpr):
        """The scores' modifications, in the units the caller's qk_scale turns into log2 units (the host picks
        them, mod_scalars): softcap as tanh(pre_scale s) (qk_scale = softcap log2 e), then a float attn_mask tile
        b (BIAS 1; times mod_unit, the same unit), then ALiBi as
        - slope |i + a - j|, the slope divided by the same unit (arow: i + a per row, fp32)."""
        if SOFTCAP:
            s = tanh_approx(s * pre_scale)
        if BIAS == 1:
            s = s + to_float32(b) * mod_unit
        if HAS_ALIBI:
            col = (gl.arange(0, s.shape[1], layout=gl.SliceLayout(0, s.type.layout)) + col0).to(gl.float32)
            s = s - slope * gl.abs(gl.expand_dims(arow, 1) - gl.expand_dims(col, 0))
        return s

    @gluon.jit
    def _softmax_step(s, m_i, l_i, row, col0, seqlen_k, diag_offset, left_offset, qk_scale, mask, arow, slope,
                      pre_scale, mod_unit, bias_smem, b_full, b_empty, bc, part: gl.constexpr,
                      CAUSAL: gl.constexpr, MASK_LEFT: gl.constexpr, SOFTCAP: gl.constexpr, HAS_ALIBI: gl.constexpr,
                      BIAS: gl.constexpr, BSTAGES: gl.constexpr, NUM_WG: gl.constexpr):
        """Scores -> online softmax for one block: returns p, alpha, m, l and the attn_mask tiles read so far.
        `mask` (runtime): apply Sk and the band (CAUSAL: the right bound i + diag_offset; MASK_LEFT: the left
        bound i + left_offset) and a bool attn_mask's tile (BIAS 2: the block is masked iff it has a tile). A float
        attn_mask's tile (BIAS 1) is read for every block. Both branches hold a whole softmax, so the wait that
        follows a call starts a basic block of its own and ptxas cannot hoist it above the exponentials."""
        b = 0.0
        # A float attn_mask is added here only after a softcap; without one it is already in s (_issue_scores).
        BIAS_MOD: gl.constexpr = BIAS if SOFTCAP else BIAS & 2
        if BIAS_MOD == 1:
            b = _read_bias(bias_smem, b_full, b_empty, bc, s, part, NUM_WG, BSTAGES, BIAS, True)
            bc += 1
        s = _score_mod(s, col0, arow, slope, pre_scale, b, mod_unit, SOFTCAP, HAS_ALIBI, BIAS_MOD)
        KEEP_NEG_INF: gl.constexpr = MASK_LEFT | (BIAS != 0)
        if mask:
            keep = _visible(s, row, col0, seqlen_k, diag_offset, left_offset, CAUSAL, MASK_LEFT)
            if BIAS == 2:
                keep = keep & (_read_bias(bias_smem, b_full, b_empty, bc, s, part, NUM_WG, BSTAGES, BIAS,
                                          True) != 0)
                bc += 1
            p, alpha, m_n, l_n = _softmax_core(gl.where(keep, s, float("-inf")), m_i, l_i, qk_scale, KEEP_NEG_INF)
        else:
            p, alpha, m_n, l_n = _softmax_core(s, m_i, l_i, qk_scale, KEEP_NEG_INF)
        return p, alpha, m_n, l_n, bc

    @gluon.jit
    def _visible(s, row, col0, seqlen_k, diag_offset, left_offset, CAUSAL: gl.constexpr, MASK_LEFT: gl.constexpr):
        """Which scores of the block at columns col0 + (0 .. BLOCK_N-1) a row sees: Sk and the band (CAUSAL: the
        right bound i + diag_offset; MASK_LEFT: the left bound i + left_offset). The block-relative column is
        compared with one limit per row (the row's last visible key, relative to the block): one compare per
        score."""
        rel = gl.arange(0, s.shape[1], layout=gl.SliceLayout(0, s.type.layout))
        if CAUSAL:
            lim = gl.minimum(row + diag_offset, seqlen_k - 1) - col0
            keep = gl.expand_dims(rel, 0) <= gl.expand_dims(lim, 1)
        else:
            keep = gl.expand_dims(rel, 0) < gl.expand_dims(gl.full_like(row, seqlen_k) - col0, 1)
        if MASK_LEFT:
            keep = keep & (gl.expand_dims(rel, 0) >= gl.expand_dims(row + left_offset - col0, 1))
        return keep

    @gluon.jit
    def _lazy_exp(s, m_i, row, col0, seqlen_k, diag_offset, qk_scale, mask, pre_scale, mod_unit, CAUSAL: gl.constexpr,
                  SOFTCAP: gl.constexpr):
        """The exponentials of one block against the row's current reference m_i, with no row maximum and no
        rescale (LAZY; docs/derivation.md ch. 3 holds for any reference, not only the running maximum): returns
        P = exp2(qk_scale s - m_i) and its row sums. Unless a row's new scores exceed m_i by more than
        log2(LAZY_LIMIT), every P is at most LAZY_LIMIT and the sums say so; the caller checks them and redoes
        the block with the maximum (_softmax_step) when one does not hold."""
        # (LAZY runs without ALiBi, a left window or an attn_mask: the softcap is the only modification.)
        s = _score_mod(s, col0, 0.0, 0.0, pre_scale, 0.0, mod_unit, SOFTCAP, False, 0)
        # m_i is finite: without a left bound or an attn_mask the state never keeps -inf (_softmax_core), and a
        # row that saw no key in its first block sees none here either.
        ref = gl.expand_dims(m_i, 1)
        if mask:
            keep = _visible(s, row, col0, seqlen_k, diag_offset, 0, CAUSAL, False)
            p = gl.exp2(gl.where(keep, s, float("-inf")) * qk_scale - ref)
        else:
            p = gl.exp2(s * qk_scale - ref)
        return p, gl.sum(p, 1)

    @gluon.jit
    def _wg_max(x, buf):
        """The maximum of a warpgroup's row values x ([64], 16 rows per warp), in every thread, through buf (4
        floats of shared memory, not in use by the previous call: callers alternate two) and one barrier: each
        warp's maximum (shuffles), stored, then all four read back. (gl.max over x would use two barriers.)"""
        w = gl.max(gl.reshape(x, [4, x.shape[0] // 4]), 1)
        buf.store(w)
        gl.thread_barrier()
        layout: gl.constexpr = gl.BlockedLayout([4], [32], [4], [0])
        return gl.max(buf.load(layout), 0)

    @gluon.jit
    def _issue_s(q, k_smem, k_full, i, s_buf, STAGES: gl.constexpr, USE_ACC: gl.constexpr):
        """Issue S = Q K_i^T for the program's block i (a running count: slot i % STAGES) into the registers of
        s_buf: S = s_buf + Q K_i^T with USE_ACC, else s_buf's values are not read."""
        slot = i % STAGES
        mbarrier.wait(k_full.index(slot), (i // STAGES) & 1)
        return warpgroup_mma(q, k_smem.index(slot).permute((1, 0)), s_buf, use_acc=USE_ACC, is_async=True)

    @gluon.jit
    def _issue_scores(q, k_smem, k_full, i, s_zero, bias_smem, b_full, b_empty, bc, part: gl.constexpr,
                      STAGES: gl.constexpr, SOFTCAP: gl.constexpr, BIAS: gl.constexpr, BSTAGES: gl.constexpr,
                      NUM_WG: gl.constexpr):
        """_issue_s, except that a float attn_mask without softcap starts the accumulator at its tile (read here,
        the next one in the ring, bc): the tensor cores add it, and the softmax, which bounds the loop, does not.
        Q was scaled by the softmax scale for this path (_scale_q), so the tile needs no multiply: only its
        widening. Returns (the product's token, bc)."""
        if BIAS == 1 and not SOFTCAP:
            b = _read_bias(bias_smem, b_full, b_empty, bc, s_zero, part, NUM_WG, BSTAGES, BIAS, False)
            tok = _issue_s(q, k_smem, k_full, i, to_float32(b), STAGES, True)
            # The product's issue needed the tile in registers: its read is complete, the slot may be refilled.
            mbarrier.arrive(b_empty.index(bc % BSTAGES), count=1)
            return tok, bc + 1
        else:
            return _issue_s(q, k_smem, k_full, i, s_zero, STAGES, False), bc

    @gluon.jit
    def _scale_q(q, factor):
        """Multiply this warpgroup's query tile in shared memory by factor, in place, before its first product.
        For a float attn_mask without softcap (_issue_scores): S = (scale Q) K^T + bias then comes out of the
        tensor cores in the units the bias is in, and the tile is widened but not multiplied, 64 fewer
        instructions per thread and block at d128. Q is rounded once more (to its dtype after the multiply), the
        rounding PyTorch's own math path applies to its scaled q."""
        layout: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
        x = q.load(layout)
        q.store((x.to(gl.float32) * factor).to(q.dtype))
        # The products read Q through the async proxy, issued once every warp of the warpgroup has stored.
        fence_async_shared()
        gl.thread_barrier()

    @gluon.jit
    def _issue_pv(p, v_smem, v_full, i, acc, alpha, STAGES: gl.constexpr, RESCALE: gl.constexpr = True):
        """Rescale O by the alpha of P's block (RESCALE), then issue O += P V_i."""
        if RESCALE:
            acc = acc * gl.expand_dims(gl.convert_layout(alpha, gl.SliceLayout(1, acc.type.layout)), 1)
        slot = i % STAGES
        mbarrier.wait(v_full.index(slot), (i // STAGES) & 1)
        return warpgroup_mma(p, v_smem.index(slot), acc, is_async=True)

    @gluon.jit
    def _read_bias(bias_smem, b_full, b_empty, i, s, part: gl.constexpr, NUM_WG: gl.constexpr,
                   BSTAGES: gl.constexpr, BIAS: gl.constexpr, RELEASE: gl.constexpr):
        """This warpgroup's attn_mask tile of the program's i-th tile (slot i % BSTAGES), in the layout of the
        scores s (0.0: no attn_mask). RELEASE: hand the slot back to the producer here, behind a proxy fence;
        otherwise the caller releases it once an instruction has consumed the tile.

        The fence matters: the tile is read by the generic proxy and the slot refilled by TMA (the async proxy),
        and the warpgroup barrier before the arrive does not order the two. In a trial where the producer refilled
        sooner (the tile loaded before K and prefetched into L2), releasing without the fence read the next
        tile's values into some rows in 6-10 of 12 runs on an H100 (benchmarks/NOTES.md, "The bias ring's
        release")."""
        if BIAS != 0:
            slot = i % BSTAGES
            mbarrier.wait(b_full.index(slot), (i // BSTAGES) & 1)
            b = bias_smem.index(slot * NUM_WG + part).load(s.type.layout)
            if RELEASE:
                fence_async_shared()
                mbarrier.arrive(b_empty.index(slot), count=1)
            return b
        else:
            return 0.0

    @gluon.jit
    def _drop(p, row, col0, seed, bh, threshold):
        """Dropout on a block's probabilities P (queries `row`, keys from col0), after their row sums went into l:
        the dropped ones become 0 (the epilogue divides O by l (1 - p)); the bits are _gluon.dropout_bits'."""
        keep = dropout_tile_keep(row, col0, seed, bh, threshold, p.shape[1], False)
        return gl.where(keep, p, 0.0)

    @gluon.jit
    def _finish_step(q, s_tok, k_smem, k_full, s_zero, flag_smem, v_smem, k_empty, v_full, v_empty, bias_smem, b_full,
                     b_empty, j, c, bc, p_prev, alpha_prev, acc, m_i, l_i, row, seqlen_k, diag_offset, left_offset,
                     qk_scale, n_full, full_lo, j_lo, idx_row, arow, slope, pre_scale, mod_unit, seed, bh,
                     drop_threshold, part: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
                     CAUSAL: gl.constexpr, MASK_LEFT: gl.constexpr, SOFTCAP: gl.constexpr, HAS_ALIBI: gl.constexpr,
                     BIAS: gl.constexpr, BSTAGES: gl.constexpr, NUM_WG: gl.constexpr, LAZY: gl.constexpr,
                     DROPOUT: gl.constexpr, dot_a: gl.constexpr):
        """Step j >= 1 with S_j issued and nothing after it: issue P_{j-1} V_{j-1}, softmax(S_j) while it runs,
        retire it. In P_{j-1} and its alpha, out P_j and its alpha (and the attn_mask tile count); O then holds
        P_{<j} V_{<j}.

        LAZY (no attn_mask): the block's exponentials are taken against the rows' current reference m_i
        (_lazy_exp), so the step has no row maximum and O no rescale. Once P_{j-1} V_{j-1} is retired, the
        warpgroup agrees on its largest row sum (_wg_max). If it passes LAZY_LIMIT (some row's scores grew past
        m_i + log2(LAZY_LIMIT): P would lose range in fp16, or overflow), it issues S_j again (K_j's slot is
        released only after the check) and takes the usual softmax step, rescaling O there; the next P V never
        rescales. LAZY 2 (probes only) skips the check."""
        acc_tok = _issue_pv(p_prev, v_smem, v_full, c + j - 1, acc, alpha_prev, STAGES, not LAZY)
        # wgmma groups retire in issue order: one left outstanding means S_j is done, P_{j-1} V_{j-1} may not be.
        s = warpgroup_mma_wait(1, deps=(s_tok, ))
        if not LAZY:
            mbarrier.arrive(k_empty.index((c + j) % STAGES), count=1)
        blk, partial = _block_at(j_lo, j, idx_row, BIAS == 2)
        mask = j >= n_full
        if MASK_LEFT:
            mask = mask | (j < full_lo)
        if BIAS == 2:
            mask = partial
        if LAZY:
            p, l_blk = _lazy_exp(s, m_i, row, blk * BLOCK_N, seqlen_k, diag_offset, qk_scale, mask, pre_scale,
                                 mod_unit, CAUSAL, SOFTCAP)
            alpha = alpha_prev  # not read: LAZY never rescales at issue
            acc, p_prev = warpgroup_mma_wait(0, deps=(acc_tok, p_prev))
            big = 0.0
            if LAZY == 1:
                # (A NaN sum, from NaN inputs, stays on this path as it would through the maximum.)
                big = _wg_max(l_blk, flag_smem.index(part * 2 + (c + j) % 2))
            if big > LAZY_LIMIT:
                s_tok = _issue_s(q, k_smem, k_full, c + j, s_zero, STAGES, False)
                s = warpgroup_mma_wait(0, deps=(s_tok, ))
                p, alpha, m_i, l_i, bc = _softmax_step(s, m_i, l_i, row, blk * BLOCK_N, seqlen_k, diag_offset,
                                                       left_offset, qk_scale, mask, arow, slope, pre_scale,
                                                       mod_unit, bias_smem, b_full, b_empty, bc, part, CAUSAL,
                                                       MASK_LEFT, SOFTCAP, HAS_ALIBI, BIAS, BSTAGES, NUM_WG)
                acc = acc * gl.expand_dims(gl.convert_layout(alpha, gl.SliceLayout(1, acc.type.layout)), 1)
            else:
                l_i = l_i + l_blk
            mbarrier.arrive(k_empty.index((c + j) % STAGES), count=1)
        else:
            p, alpha, m_i, l_i, bc = _softmax_step(s, m_i, l_i, row, blk * BLOCK_N, seqlen_k, diag_offset,
                                                   left_offset, qk_scale, mask, arow, slope, pre_scale, mod_unit,
                                                   bias_smem, b_full, b_empty, bc, part, CAUSAL, MASK_LEFT, SOFTCAP,
                                                   HAS_ALIBI, BIAS, BSTAGES, NUM_WG)
            acc, p_prev = warpgroup_mma_wait(0, deps=(acc_tok, p_prev))
        mbarrier.arrive(v_empty.index((c + j - 1) % STAGES), count=1)
        if DROPOUT:
            p = _drop(p, row, blk * BLOCK_N, seed, bh, drop_threshold)
        p = gl.convert_layout(p.to(q.dtype), dot_a)
        return p, alpha, acc, m_i, l_i, bc

    @gluon.jit
    def _last_pv(p, v_smem, v_full, v_empty, i, acc, alpha, STAGES: gl.constexpr, RESCALE: gl.constexpr):
        """The work item's last P V (block i), retired at once: the epilogue needs O."""
        acc_tok = _issue_pv(p, v_smem, v_full, i, acc, alpha, STAGES, RESCALE)
        acc, p = warpgroup_mma_wait(0, deps=(acc_tok, p))
        mbarrier.arrive(v_empty.index(i % STAGES), count=1)
        return acc

    @gluon.jit
    def _tile_blocks(q, k_smem, v_smem, flag_smem, k_full, k_empty, v_full, v_empty, bias_smem, b_full, b_empty,
                     q_empty, c, bc, n_blocks, acc, m_i, l_i, s_zero, row, seqlen_k, diag_offset, left_offset,
                     qk_scale, n_full, full_lo, j_lo, idx_row, arow, slope, pre_scale, mod_unit, seed, bh,
                     drop_threshold, part: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
                     CAUSAL: gl.constexpr, MASK_LEFT: gl.constexpr, SOFTCAP: gl.constexpr, HAS_ALIBI: gl.constexpr,
                     BIAS: gl.constexpr, BSTAGES: gl.constexpr, NUM_WG: gl.constexpr, LAZY: gl.constexpr,
                     DROPOUT: gl.constexpr, dot_a: gl.constexpr):
        """All key blocks of one work item (n_blocks >= 1; block j is _block_at(j_lo, j, idx_row)) for one
        warpgroup: returns O (unnormalized), m, l and the attn_mask tile count bc. Blocks j below full_lo or from
        n_full on are masked (with a bool attn_mask: those with a mask tile)."""
        s_tok, bc = _issue_scores(q, k_smem, k_full, c, s_zero, bias_smem, b_full, b_empty, bc, part, STAGES,
                                  SOFTCAP, BIAS, BSTAGES, NUM_WG)
        s = warpgroup_mma_wait(0, deps=(s_tok, ))
        mbarrier.arrive(k_empty.index(c % STAGES), count=1)
        # Step 0: the first block's scores and softmax; nothing to multiply into V yet.
        blk, partial = _block_at(j_lo, 0, idx_row, BIAS == 2)
        mask = n_full <= 0
        if MASK_LEFT:
            mask = mask | (full_lo > 0)
        if BIAS == 2:
            mask = partial
        p, alpha, m_i, l_i, bc = _softmax_step(s, m_i, l_i, row, blk * BLOCK_N, seqlen_k, diag_offset, left_offset,
                                               qk_scale, mask, arow, slope, pre_scale, mod_unit, bias_smem, b_full,
                                               b_empty, bc, part, CAUSAL, MASK_LEFT, SOFTCAP, HAS_ALIBI, BIAS,
                                               BSTAGES, NUM_WG)
        if DROPOUT:
            p = _drop(p, row, blk * BLOCK_N, seed, bh, drop_threshold)
        p = gl.convert_layout(p.to(q.dtype), dot_a)
        for j in range(1, n_blocks):
            s_tok, bc = _issue_scores(q, k_smem, k_full, c + j, s_zero, bias_smem, b_full, b_empty, bc, part,
                                      STAGES, SOFTCAP, BIAS, BSTAGES, NUM_WG)
            p, alpha, acc, m_i, l_i, bc = _finish_step(q, s_tok, k_smem, k_full, s_zero, flag_smem, v_smem,
                                                       k_empty, v_full, v_empty, bias_smem, b_full, b_empty, j, c,
                                                       bc, p, alpha, acc, m_i, l_i, row, seqlen_k, diag_offset,
                                                       left_offset, qk_scale, n_full, full_lo, j_lo, idx_row, arow,
                                                       slope, pre_scale, mod_unit, seed, bh, drop_threshold, part,
                                                       BLOCK_N, STAGES, CAUSAL, MASK_LEFT, SOFTCAP, HAS_ALIBI, BIAS,
                                                       BSTAGES, NUM_WG, LAZY, DROPOUT, dot_a)
        # Every Q K^T of this tile is done: the producer may load the next query tile.
        mbarrier.arrive(q_empty, count=1)
        # Last step: P_{n-1} V_{n-1}.
        # (LAZY: O was rescaled where a step took the maximum, and is 0 after step 0.)
        acc = _last_pv(p, v_smem, v_full, v_empty, c + n_blocks - 1, acc, alpha, STAGES, not LAZY)
        return acc, m_i, l_i, bc

    @gluon.jit
    def _skip_blocks(k_full, k_empty, v_full, v_empty, b_full, b_empty, q_empty, c, bc, n_blocks, j_lo, idx_row,
                     STAGES: gl.constexpr, BIAS: gl.constexpr, BSTAGES: gl.constexpr):
        """A warpgroup whose rows all lie past Sq (the last query tile) computes nothing: it only follows the ring,
        releasing each K (and attn_mask tile) and V block once loaded, in the producer's order (K_j, then
        V_{j-1}). Returns the attn_mask tile count."""
        for j in range(n_blocks):
            i = c + j
            mbarrier.wait(k_full.index(i % STAGES), (i // STAGES) & 1)
            mbarrier.arrive(k_empty.index(i % STAGES), count=1)
            if BIAS != 0:
                blk, partial = _block_at(j_lo, j, idx_row, BIAS == 2)
                if partial:
                    mbarrier.wait(b_full.index(bc % BSTAGES), (bc // BSTAGES) & 1)
                    mbarrier.arrive(b_empty.index(bc % BSTAGES), count=1)
                    bc += 1
            if j > 0:
                mbarrier.wait(v_full.index((i - 1) % STAGES), ((i - 1) // STAGES) & 1)
                mbarrier.arrive(v_empty.index((i - 1) % STAGES), count=1)
        mbarrier.arrive(q_empty, count=1)
        if n_blocks > 0:
            i = c + n_blocks - 1
            mbarrier.wait(v_full.index(i % STAGES), (i // STAGES) & 1)
            mbarrier.arrive(v_empty.index(i % STAGES), count=1)
        return bc

    @gluon.jit
    def _stage_o(o, o_buf, o_desc, i_b, row0, i_h):
        """Store a warpgroup's output rows through its staging buffer by TMA (rows past the descriptor's end are
        clipped); the previous store from the buffer must have read it first."""
        tma.store_wait(pendings=0)
        o_buf.store(o)
        fence_async_shared()
        tma_store(o_desc, [i_b, row0, i_h, 0], o_buf.reshape([1, o_buf.shape[0], 1, o_buf.shape[1]]))

    @gluon.jit
    def _store_o(o, Out, i_b, i_h, q_start, row, seqlen_q, stride_ob, stride_os, stride_oh, o_layout: gl.constexpr):
        """Store a warpgroup's output rows (those below seqlen_q) from registers."""
        o_rows = gl.convert_layout(row, gl.SliceLayout(1, o_layout))
        o_cols = gl.arange(0, o.shape[1], layout=gl.SliceLayout(0, o_layout))
        o_ptr = (Out + i_b.to(gl.int64) * stride_ob + i_h.to(gl.int64) * stride_oh
                 + gl.expand_dims((q_start + o_rows).to(gl.int64) * stride_os, 1) + gl.expand_dims(o_cols, 0))
        gl.store(o_ptr, o, mask=gl.expand_dims(o_rows < seqlen_q, 1))

    @gluon.jit
    def _read_tile(tile_smem):
        """The work item the producer wrote for this warpgroup (dynamic schedule)."""
        layout: gl.constexpr = gl.BlockedLayout([1], [32], [4], [0])
        return gl.max(tile_smem.load(layout), 0)

    @gluon.jit
    def _softmax_partition(part: gl.constexpr, o_desc, Out, stride_ob, stride_os, stride_oh, Lse, stride_lb, stride_lh,
                           q_smem, k_smem, v_smem, o_smem, bias_smem, tile_smem, flag_smem, q_full, q_empty, k_full,
                           k_empty, v_full, v_empty, b_full, b_empty, n_tiles, n_m, num_heads, head_group, seqlen_q,
                           seqlen_k, diag_offset, left_offset, qk_scale, Alibi, stride_alibi_b, alibi_offset,
                           mod_unit, pre_scale, Sinks, Seed, drop_threshold, drop_keep, Counts, Idx, stride_cb,
                           stride_ch, idx_cols,
                           PART_M: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr,
                           STAGES: gl.constexpr, CAUSAL: gl.constexpr, MASK_LEFT: gl.constexpr, SOFTCAP: gl.constexpr,
                           HAS_ALIBI: gl.constexpr, HAS_SINKS: gl.constexpr, BIAS: gl.constexpr, BSTAGES: gl.constexpr,
                           STAGE_O: gl.constexpr, NUM_WG: gl.constexpr, DYNAMIC: gl.constexpr, QBUF: gl.constexpr,
                           VARLEN: gl.constexpr, LAZY: gl.constexpr, DROPOUT: gl.constexpr):
        dtype: gl.constexpr = o_desc.dtype
        s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                           instr_shape=[16, BLOCK_N, 16])
        o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                           instr_shape=[16, HEAD_DIM, 16])
        dot_a: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
        row_layout: gl.constexpr = gl.SliceLayout(1, s_layout)
        s_zero = gl.zeros([PART_M, BLOCK_N], gl.float32, layout=s_layout)

        c = 0  # blocks consumed so far by this program, counted as the producer counts them
        bc = 0  # attn_mask tiles read so far, likewise
        seed = 0
        if DROPOUT:
            seed = gl.load(Seed)  # the call's Philox key (int64), drawn on the device by the caller
        it = 0  # work items so far
        if DYNAMIC:
            # The producer writes each item's index before its query tile arrives, and n_tiles after the last.
            mbarrier.wait(q_full.index(0), 0)
            tile = _read_tile(tile_smem.index(0))  # (entry 0 of buffer 0 under VARLEN too)
        else:
            tile = gl.program_id(0)
        while tile < n_tiles:
            if VARLEN:
                # The item's row from the producer (_varlen_item): its sequence's bounds and own offsets.
                base = (it % QBUF) * ITEM_FIELDS
                i_b = _read_tile(tile_smem.index(base + 1))
                start_m = _read_tile(tile_smem.index(base + 2))
                q_start = _read_tile(tile_smem.index(base + 3))
                seqlen_q_i = _read_tile(tile_smem.index(base + 4))
                seqlen_k_i = _read_tile(tile_smem.index(base + 5))
                i_h = _read_tile(tile_smem.index(base + 6))
                offset = seqlen_k_i - seqlen_q_i
                o_b = 0
            else:
                start_m, i_b, i_h = _tile_coords(tile, n_m, num_heads, head_group, BLOCK_M, CAUSAL | (BIAS == 2))
                q_start = 0
                seqlen_q_i = seqlen_q
                seqlen_k_i = seqlen_k
                offset = 0
                o_b = i_b
            diag_i = diag_offset + offset
            left_i = left_offset + offset
            j_lo, n_blocks, idx_row = _item_blocks(start_m, i_b, i_h, seqlen_k_i, diag_i, left_i, Counts, Idx,
                                                   stride_cb, stride_ch, idx_cols, BLOCK_M, BLOCK_N, CAUSAL,
                                                   MASK_LEFT, BIAS == 2)
            row_start = start_m + part * PART_M
            row = row_start + gl.arange(0, PART_M, layout=row_layout)
            # Blocks from full_lo to below n_full (counted from the item's first block) are visible to every row of
            # this part and lie inside Sk: no mask there.
            n_full = seqlen_k_i // BLOCK_N
            if CAUSAL:
                n_full = gl.minimum(n_full, gl.maximum(row_start + diag_i + 1, 0) // BLOCK_N)
            n_full -= j_lo
            full_lo = 0
            if MASK_LEFT:
                full_lo = gl.cdiv(gl.maximum(row_start + PART_M - 1 + left_i, 0), BLOCK_N) - j_lo
            # ALiBi (_score_mod): the slope in score units and i + a per row.
            slope = 0.0
            arow = gl.zeros([PART_M], gl.float32, layout=row_layout)
            if HAS_ALIBI:
                slope = gl.load(Alibi + i_b * stride_alibi_b + i_h) * mod_unit
                arow = (row + (alibi_offset + offset)).to(gl.float32)

            qb = it % QBUF
            q = q_smem.index(qb * NUM_WG + part)
            if not DYNAMIC:
                mbarrier.wait(q_full.index(qb), (it // QBUF) & 1)
            if row_start >= seqlen_q_i:
                # Every row of this part lies past Sq (the last query tile): follow the ring, compute nothing.
                bc = _skip_blocks(k_full, k_empty, v_full, v_empty, b_full, b_empty, q_empty.index(qb), c, bc,
                                  n_blocks, j_lo, idx_row, STAGES, BIAS, BSTAGES)
            else:
                m_i = gl.full([PART_M], float("-inf"), gl.float32, layout=row_layout)
                l_i = gl.zeros([PART_M], gl.float32, layout=row_layout)
                acc = gl.zeros([PART_M, HEAD_DIM], gl.float32, layout=o_layout)
                if n_blocks > 0:
                    if BIAS == 1 and not SOFTCAP:
                        _scale_q(q, pre_scale)
                    acc, m_i, l_i, bc = _tile_blocks(q, k_smem, v_smem, flag_smem, k_full, k_empty, v_full, v_empty,
                                                     bias_smem, b_full, b_empty, q_empty.index(qb), c, bc, n_blocks,
                                                     acc, m_i, l_i, s_zero, row, seqlen_k_i, diag_i, left_i,
                                                     qk_scale, n_full, full_lo, j_lo, idx_row, arow, slope,
                                                     pre_scale, mod_unit, seed, i_b * num_heads + i_h,
                                                     drop_threshold, part, BLOCK_N, STAGES, CAUSAL, MASK_LEFT,
                                                     SOFTCAP, HAS_ALIBI, BIAS, BSTAGES, NUM_WG, LAZY, DROPOUT, dot_a)
                else:
                    mbarrier.arrive(q_empty.index(qb), count=1)
                if HAS_SINKS:
                    # The head's sink logit joins the denominator (docs/derivation.md#8): one more term, exp(sink -
                    # m), and m grows to cover it. A row that saw no key then outputs 0 and has LSE = sink.
                    sink = gl.load(Sinks + i_h) * LOG2E
                    m_fin = gl.maximum(m_i, sink)
                    alpha = gl.exp2(m_i - m_fin)
                    l_i = l_i * alpha + gl.exp2(sink - m_fin)
                    acc = acc * gl.expand_dims(gl.convert_layout(alpha, gl.SliceLayout(1, o_layout)), 1)
                    m_i = m_fin

                # A row that saw no key has l = 0: it outputs 0 and its LSE is -inf (as in kernels/forward.py).
                empty = l_i == 0.0
                l_safe = gl.where(empty, 1.0, l_i)
                lse = gl.where(empty, float("-inf"), (m_i + gl.log2(l_safe)) * LN2)
                if DROPOUT:
                    l_safe = l_safe * drop_keep  # 1 - p: the kept probabilities are scaled by 1 / (1 - p)
                acc = acc / gl.expand_dims(gl.convert_layout(l_safe, gl.SliceLayout(1, o_layout)), 1)
                # (Varlen: lse is [H, total_q], stride_lb 0; the sequence's rows start at q_start.)
                lse_base = Lse + i_b.to(gl.int64) * stride_lb + i_h.to(gl.int64) * stride_lh + q_start
                gl.store(lse_base + row, lse, mask=row < seqlen_q_i)
                if STAGE_O:
                    if VARLEN:
                        # A descriptor clips rows past Sq, but under VARLEN the rows past a sequence's end belong
                        # to the next one: a part that runs past it is stored from registers.
                        if row_start + PART_M <= seqlen_q_i:
                            _stage_o(acc.to(dtype), o_smem.index(part), o_desc, o_b, q_start + row_start, i_h)
                        else:
                            _store_o(acc.to(dtype), Out, i_b, i_h, q_start, row, seqlen_q_i, stride_ob, stride_os,
                                     stride_oh, o_layout)
                    else:
                        _stage_o(acc.to(dtype), o_smem.index(part), o_desc, o_b, q_start + row_start, i_h)
                else:
                    # No staging buffer (its shared memory holds attn_mask tiles).
                    _store_o(acc.to(dtype), Out, i_b, i_h, q_start, row, seqlen_q_i, stride_ob, stride_os, stride_oh,
                             o_layout)
            c += n_blocks
            it += 1
            if DYNAMIC:
                mbarrier.wait(q_full.index(it % QBUF), (it // QBUF) & 1)
                tile = _read_tile(tile_smem.index((it % QBUF) * (ITEM_FIELDS if VARLEN else 1)))
            else:
                tile += gl.num_programs(0)
        tma.store_wait(pendings=0)

    # seqlen_q and n_m are not specialized on the value 1: with both constant, a warpgroup's "rows past Sq" branch
    # (_skip_blocks) is decided at compile time and Triton 3.6's lowering fails on the dead partition body.
    @gluon.jit(do_not_specialize=["seqlen_q", "n_m"])
    def _fwd_kernel(q_desc, k_desc, v_desc, o_desc, bias_desc, Out, Lse, Counter, TileMap, Alibi, Sinks, Seed, Counts,
                    Idx, stride_ob, stride_os, stride_oh, stride_lb, stride_lh, stride_alibi_b, bias_mul_b, bias_mul_h,
                    stride_cb, stride_ch, idx_cols, seqlen_q, seqlen_k, diag_offset, left_offset, alibi_offset,
                    qk_scale, mod_unit, pre_scale, drop_threshold, drop_keep, num_heads, head_group, group_size, n_m,
                    n_tiles,
                    HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
                    CAUSAL: gl.constexpr, MASK_LEFT: gl.constexpr, SOFTCAP: gl.constexpr, HAS_ALIBI: gl.constexpr,
                    HAS_SINKS: gl.constexpr, BIAS: gl.constexpr, BSTAGES: gl.constexpr, STAGE_O: gl.constexpr,
                    NUM_WG: gl.constexpr, DYNAMIC: gl.constexpr, QBUF: gl.constexpr, VARLEN: gl.constexpr,
                    LAZY: gl.constexpr, DROPOUT: gl.constexpr):
        # VARLEN (see _varlen_item): TileMap is varlen_tile_map's [n_upper, 8] int32 rows and n_m is n_upper; items
        # come from the counter (the producer skips the map's empty rows), and nothing else changes.
        gl.static_assert(not VARLEN or (DYNAMIC and BIAS == 0))
        gl.static_assert(LAZY == 0 or (BIAS == 0 and not MASK_LEFT and not HAS_ALIBI and NUM_WG == 2))
        PART_M: gl.constexpr = BLOCK_M // NUM_WG
        dtype: gl.constexpr = q_desc.dtype
        layout: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
        q_smem = gl.allocate_shared_memory(dtype, [NUM_WG * QBUF, PART_M, HEAD_DIM], layout)
        k_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, HEAD_DIM], layout)
        v_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, HEAD_DIM], layout)
        if STAGE_O:
            o_smem = gl.allocate_shared_memory(dtype, [NUM_WG, PART_M, HEAD_DIM], layout)
        else:
            o_smem = q_smem  # not read: the epilogue stores from registers
        # Per query buffer, the item's index (dynamic schedule), and with VARLEN its fields (_varlen_item).
        tile_smem = gl.allocate_shared_memory(gl.int32, [QBUF * ITEM_FIELDS if VARLEN else QBUF, 1],
                                              gl.SwizzledSharedLayout(1, 1, 1, [0]))
        if LAZY != 0:
            # The warpgroup maxima of _wg_max: two buffers of 4 floats per consumer warpgroup.
            flag_smem = gl.allocate_shared_memory(gl.float32, [2 * NUM_WG, 4], gl.SwizzledSharedLayout(1, 1, 1, [0]))
        else:
            flag_smem = tile_smem  # not read
        q_full = gl.allocate_shared_memory(gl.int64, [QBUF, 1], mbarrier.MBarrierLayout())
        q_empty = gl.allocate_shared_memory(gl.int64, [QBUF, 1], mbarrier.MBarrierLayout())
        k_full = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        k_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        v_full = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        v_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        # Each "empty" barrier waits for every consumer warpgroup.
        for i in gl.static_range(QBUF):
            mbarrier.init(q_full.index(i), count=1)
            mbarrier.init(q_empty.index(i), count=NUM_WG)
        for i in gl.static_range(STAGES):
            mbarrier.init(k_full.index(i), count=1)
            mbarrier.init(v_full.index(i), count=1)
            mbarrier.init(k_empty.index(i), count=NUM_WG)
            mbarrier.init(v_empty.index(i), count=NUM_WG)
        if BIAS != 0:
            # attn_mask tiles: a ring of BSTAGES slots, one [PART_M, BLOCK_N] tile per consumer in each.
            b_layout: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128,
                                                          element_bitwidth=bias_desc.dtype.primitive_bitwidth, rank=2)
            bias_smem = gl.allocate_shared_memory(bias_desc.dtype, [BSTAGES * NUM_WG, PART_M, BLOCK_N], b_layout)
            b_full = gl.allocate_shared_memory(gl.int64, [BSTAGES, 1], mbarrier.MBarrierLayout())
            b_empty = gl.allocate_shared_memory(gl.int64, [BSTAGES, 1], mbarrier.MBarrierLayout())
            for i in gl.static_range(BSTAGES):
                mbarrier.init(b_full.index(i), count=1)
                mbarrier.init(b_empty.index(i), count=NUM_WG)
        else:
            bias_smem, b_full, b_empty = k_smem, k_full, k_empty  # not read

        # (The partitions' argument lists are written out: a tuple built once and concatenated loses the
        # constexpr-ness of its entries in Triton 3.6.)
        if NUM_WG == 3:
            # 16 warps: the worker consumers get CONSUMER_REGS_3WG, the first one what the others leave.
            gl.warp_specialize([
                (_softmax_partition, (0, o_desc, Out, stride_ob, stride_os, stride_oh, Lse, stride_lb, stride_lh,
                                      q_smem, k_smem, v_smem, o_smem, bias_smem, tile_smem, flag_smem, q_full,
                                      q_empty, k_full, k_empty, v_full, v_empty, b_full, b_empty, n_tiles, n_m,
                                      num_heads, head_group, seqlen_q, seqlen_k, diag_offset, left_offset, qk_scale,
                                      Alibi, stride_alibi_b, alibi_offset, mod_unit, pre_scale, Sinks, Seed,
                                      drop_threshold, drop_keep, Counts, Idx, stride_cb, stride_ch, idx_cols, PART_M,
                                      BLOCK_M, BLOCK_N, HEAD_DIM, STAGES, CAUSAL, MASK_LEFT, SOFTCAP, HAS_ALIBI,
                                      HAS_SINKS, BIAS, BSTAGES, STAGE_O, NUM_WG, DYNAMIC, QBUF, VARLEN, LAZY, DROPOUT)),
                (_softmax_partition, (1, o_desc, Out, stride_ob, stride_os, stride_oh, Lse, stride_lb, stride_lh,
                                      q_smem, k_smem, v_smem, o_smem, bias_smem, tile_smem, flag_smem, q_full,
                                      q_empty, k_full, k_empty, v_full, v_empty, b_full, b_empty, n_tiles, n_m,
                                      num_heads, head_group, seqlen_q, seqlen_k, diag_offset, left_offset, qk_scale,
                                      Alibi, stride_alibi_b, alibi_offset, mod_unit, pre_scale, Sinks, Seed,
                                      drop_threshold, drop_keep, Counts, Idx, stride_cb, stride_ch, idx_cols, PART_M,
                                      BLOCK_M, BLOCK_N, HEAD_DIM, STAGES, CAUSAL, MASK_LEFT, SOFTCAP, HAS_ALIBI,
                                      HAS_SINKS, BIAS, BSTAGES, STAGE_O, NUM_WG, DYNAMIC, QBUF, VARLEN, LAZY, DROPOUT)),
                (_softmax_partition, (2, o_desc, Out, stride_ob, stride_os, stride_oh, Lse, stride_lb, stride_lh,
                                      q_smem, k_smem, v_smem, o_smem, bias_smem, tile_smem, flag_smem, q_full,
                                      q_empty, k_full, k_empty, v_full, v_empty, b_full, b_empty, n_tiles, n_m,
                                      num_heads, head_group, seqlen_q, seqlen_k, diag_offset, left_offset, qk_scale,
                                      Alibi, stride_alibi_b, alibi_offset, mod_unit, pre_scale, Sinks, Seed,
                                      drop_threshold, drop_keep, Counts, Idx, stride_cb, stride_ch, idx_cols, PART_M,
                                      BLOCK_M, BLOCK_N, HEAD_DIM, STAGES, CAUSAL, MASK_LEFT, SOFTCAP, HAS_ALIBI,
                                      HAS_SINKS, BIAS, BSTAGES, STAGE_O, NUM_WG, DYNAMIC, QBUF, VARLEN, LAZY, DROPOUT)),
                (_load_partition, (q_desc, k_desc, v_desc, bias_desc, q_smem, k_smem, v_smem, bias_smem, tile_smem,
                                   Counter, TileMap, q_full, q_empty, k_full, k_empty, v_full, v_empty, b_full,
                                   b_empty, n_tiles, n_m, num_heads, head_group, group_size, seqlen_k, diag_offset,
                                   left_offset, bias_mul_b, bias_mul_h, Counts, Idx, stride_cb, stride_ch, idx_cols,
                                   PART_M, BLOCK_M, BLOCK_N, HEAD_DIM, STAGES, CAUSAL, MASK_LEFT, BIAS, BSTAGES, NUM_WG,
                                   DYNAMIC, QBUF, VARLEN)),
            ], [4, 4, 1], [CONSUMER_REGS_3WG, CONSUMER_REGS_3WG, PRODUCER_REGS])
        else:
            gl.warp_specialize([
                (_softmax_partition, (0, o_desc, Out, stride_ob, stride_os, stride_oh, Lse, stride_lb, stride_lh,
                                      q_smem, k_smem, v_smem, o_smem, bias_smem, tile_smem, flag_smem, q_full,
                                      q_empty, k_full, k_empty, v_full, v_empty, b_full, b_empty, n_tiles, n_m,
                                      num_heads, head_group, seqlen_q, seqlen_k, diag_offset, left_offset, qk_scale,
                                      Alibi, stride_alibi_b, alibi_offset, mod_unit, pre_scale, Sinks, Seed,
                                      drop_threshold, drop_keep, Counts, Idx, stride_cb, stride_ch, idx_cols, PART_M,
                                      BLOCK_M, BLOCK_N, HEAD_DIM, STAGES, CAUSAL, MASK_LEFT, SOFTCAP, HAS_ALIBI,
                                      HAS_SINKS, BIAS, BSTAGES, STAGE_O, NUM_WG, DYNAMIC, QBUF, VARLEN, LAZY, DROPOUT)),
                (_softmax_partition, (1, o_desc, Out, stride_ob, stride_os, stride_oh, Lse, stride_lb, stride_lh,
                                      q_smem, k_smem, v_smem, o_smem, bias_smem, tile_smem, flag_smem, q_full,
                                      q_empty, k_full, k_empty, v_full, v_empty, b_full, b_empty, n_tiles, n_m,
                                      num_heads, head_group, seqlen_q, seqlen_k, diag_offset, left_offset, qk_scale,
                                      Alibi, stride_alibi_b, alibi_offset, mod_unit, pre_scale, Sinks, Seed,
                                      drop_threshold, drop_keep, Counts, Idx, stride_cb, stride_ch, idx_cols, PART_M,
                                      BLOCK_M, BLOCK_N, HEAD_DIM, STAGES, CAUSAL, MASK_LEFT, SOFTCAP, HAS_ALIBI,
                                      HAS_SINKS, BIAS, BSTAGES, STAGE_O, NUM_WG, DYNAMIC, QBUF, VARLEN, LAZY, DROPOUT)),
                (_load_partition, (q_desc, k_desc, v_desc, bias_desc, q_smem, k_smem, v_smem, bias_smem, tile_smem,
                                   Counter, TileMap, q_full, q_empty, k_full, k_empty, v_full, v_empty, b_full,
                                   b_empty, n_tiles, n_m, num_heads, head_group, group_size, seqlen_k, diag_offset,
                                   left_offset, bias_mul_b, bias_mul_h, Counts, Idx, stride_cb, stride_ch, idx_cols,
                                   PART_M, BLOCK_M, BLOCK_N, HEAD_DIM, STAGES, CAUSAL, MASK_LEFT, BIAS, BSTAGES, NUM_WG,
                                   DYNAMIC, QBUF, VARLEN)),
            ], [4, 1], [CONSUMER_REGS, PRODUCER_REGS])


def inputs_ok(q, k, v, softmax_scale) -> bool:
    """Whether the Hopper Gluon kernels (this forward, kernels/hopper_bwd.py) can take these tensors: a Hopper GPU
    outside the interpreter, fp16/bf16, d = dv in HEAD_DIMS, TMA-compatible strides and a positive scale."""
    if not (AVAILABLE and q.is_cuda and not configs.INTERPRETING):
        return False
    if torch.cuda.get_device_capability(q.device)[0] != 9:
        return False
    if q.dtype not in (torch.float16, torch.bfloat16) or not (q.dtype == k.dtype == v.dtype):
        return False
    if q.shape[-1] not in HEAD_DIMS or k.shape[-1] != q.shape[-1] or v.shape[-1] != q.shape[-1]:
        return False
    return configs._tma_ok((q, k, v)) and softmax_scale > 0


def features_supported(feats: Features) -> bool:
    """The options of a fixed-length call this kernel implements: causal and sliding-window masks, softcap, ALiBi,
    sinks, dropout and attn_mask (a float bias or a bool mask, where TMA can read it: supports checks that).
    (Varlen calls: varlen_supported.)"""
    return not feats.varlen


def varlen_supported(feats: Features) -> bool:
    """Varlen calls this kernel implements: every option of features_supported except attn_mask (which varlen
    does not take anywhere), on the persistent kernel (its items come from the dynamic schedule)."""
    return feats.varlen and feats.attn_bias is None and PERSISTENT


def supports(q, k, v, feats: Features, softmax_scale) -> bool:
    """Whether this kernel computes the request (inputs_ok, features_supported or varlen_supported, and an
    attn_mask that Features.gluon_bias_ok accepts). Anything else (and FLASHTILE_GLUON=0) takes the portable
    kernel."""
    if not (ENABLED and inputs_ok(q, k, v, softmax_scale)):
        return False
    if feats.varlen:
        # (No descriptor over an empty packed tensor: a call with no queries or no keys at all takes the portable
        # kernel.)
        return varlen_supported(feats) and q.shape[0] > 0 and k.shape[0] > 0
    if not features_supported(feats):
        return False
    return feats.attn_bias is None or feats.gluon_bias_ok(q.dtype, q.shape[1], k.shape[1])


def _smem_plan(head_dim, num_wg, qbuf, bias_bytes):
    """(QBUF, STAGE_O) for a launch with attn_mask tiles of bias_bytes per element: the configuration's query
    buffers and output staging buffer if the ring of BIAS_STAGES tiles fits beside them, else one query buffer,
    else no staging buffer either (d128 with a 16-bit bias: 32 KB of Q, 128 KB of K/V, 64 KB of bias)."""
    tile = WG_M * head_dim * 2
    fixed = 2 * STAGES[head_dim] * BLOCK_N * head_dim * 2 + BIAS_STAGES * num_wg * WG_M * BLOCK_N * bias_bytes
    for qb, stage_o in ((qbuf, True), (1, True), (1, False)):
        if fixed + num_wg * tile * (qb + stage_o) <= SMEM_BYTES:
            return qb, stage_o
    raise ValueError(f"no shared-memory plan for head_dim={head_dim} with a {bias_bytes}-byte attn_mask")


@functools.lru_cache(maxsize=None)
def _num_sms(device_index):
    return torch.cuda.get_device_properties(device_index).multi_processor_count


@functools.lru_cache(maxsize=None)
def _layout(bits, rank):
    """The 128-byte swizzled shared layout of TMA tiles of bits-wide elements (built once: a launch makes several
    descriptors)."""
    return gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=bits, rank=rank)


def _descriptor(t, rows):
    """A 4-D TMA descriptor over a [B, S, H, D] tensor with its own strides, one [rows, D] tile of one (batch,
    head) per copy: rows past S are zero-filled on loads and dropped on stores, whatever the layout."""
    return TensorDescriptor(t, list(t.shape), list(t.stride()), [1, rows, 1, t.shape[-1]], _layout(16, 4))


def bias_descriptor(bias, rows, cols):
    """attn_mask tiles for the Gluon kernels (Features.gluon_bias_ok): a 4-D TMA descriptor over the [B|1, H|1, Sq,
    Sk] bias (a bool mask read as uint8; expanded batch and head dims narrowed to 1), one [rows, cols] tile of one
    (batch, head) per copy, and the factors (0 or 1) that turn a batch and a head index into the bias's own (0
    along a broadcast dimension). Tiles past Sq or Sk are zero-filled: a bool mask's zeros hide those keys."""
    if bias.dtype == torch.bool:
        bias = bias.view(torch.uint8)
    for dim in (0, 1):
        # An expanded batch or head dim (stride 0, which TMA does not take) is read as a broadcast one.
        if bias.shape[dim] > 1 and bias.stride(dim) == 0:
            bias = bias.narrow(dim, 0, 1)
    strides = list(bias.stride())
    for dim in (1, 0):
        # A broadcast dimension is only ever indexed at 0, but its stride must still be a valid TMA stride.
        if bias.shape[dim] == 1:
            strides[dim] = strides[dim + 1] * bias.shape[dim + 1]
    desc = TensorDescriptor(bias, list(bias.shape), strides, [1, 1, rows, cols], _layout(8 * bias.element_size(), 4))
    return desc, int(bias.shape[0] > 1), int(bias.shape[1] > 1)


@triton.jit
def _varlen_tile_map_kernel(CuSeqQ, CuSeqK, Map, batch, n_upper, BLOCK_M: tl.constexpr, REVERSE: tl.constexpr,
                            BLOCK_C: tl.constexpr, CHUNK: tl.constexpr):
    """Row c of Map: [sequence b, first query row, q_start, Sq, k_start, Sk, 0, 0] of the c-th query tile of BLOCK_M
    rows over all sequences in order (b = -1 past the last tile). A sequence's tiles are listed last first with
    REVERSE. The tile's sequence is the number of sequences whose tiles all come before c, counted CHUNK at a
    time."""
    c = tl.program_id(0) * BLOCK_C + tl.arange(0, BLOCK_C)
    seq = tl.zeros([BLOCK_C], tl.int32)  # sequences wholly before tile c
    start = tl.zeros([BLOCK_C], tl.int32)  # and their tiles
    done = tl.full([], 0, tl.int32)  # tiles of the chunks so far
    for i in range(0, batch, CHUNK):
        b = i + tl.arange(0, CHUNK)
        in_batch = b < batch
        lo = tl.load(CuSeqQ + b, mask=in_batch, other=0)
        tiles = (tl.load(CuSeqQ + b + 1, mask=in_batch, other=0) - lo + BLOCK_M - 1) // BLOCK_M
        before = ((done + tl.cumsum(tiles, 0))[None, :] <= c[:, None]) & in_batch[None, :]
        seq += tl.sum(before.to(tl.int32), 1)
        start += tl.sum(tl.where(before, tiles[None, :], 0), 1)
        done += tl.sum(tiles, 0)
    valid = seq < batch
    q_lo = tl.load(CuSeqQ + seq, mask=valid, other=0)
    seqlen_q = tl.load(CuSeqQ + seq + 1, mask=valid, other=0) - q_lo
    k_lo = tl.load(CuSeqK + seq, mask=valid, other=0)
    seqlen_k = tl.load(CuSeqK + seq + 1, mask=valid, other=0) - k_lo
    m = c - start
    if REVERSE:
        m = (seqlen_q + BLOCK_M - 1) // BLOCK_M - 1 - m
    row = Map + c * 8
    keep = c < n_upper
    tl.store(row, tl.where(valid, seq, -1), mask=keep)
    tl.store(row + 1, m * BLOCK_M, mask=keep)
    tl.store(row + 2, q_lo, mask=keep)
    tl.store(row + 3, seqlen_q, mask=keep)
    tl.store(row + 4, k_lo, mask=keep)
    tl.store(row + 5, seqlen_k, mask=keep)
    tl.store(row + 6, tl.zeros_like(m), mask=keep)
    tl.store(row + 7, tl.zeros_like(m), mask=keep)


def varlen_tile_map(cu_seqlens_q, cu_seqlens_k, total_q, block_m, reverse=False):
    """The work list of a varlen forward without reading the lengths on the host: (map, n_upper). n_upper =
    cdiv(total_q, block_m) + batch bounds the number of query tiles (sum of cdiv(len_b, block_m)); map is
    [n_upper, 8] int32, row c the c-th tile's [sequence (-1 past the last tile), first query row within it,
    q_start, Sq, k_start, Sk, 0, 0], tiles in sequence order (each sequence's last first with reverse)."""
    batch = cu_seqlens_q.numel() - 1
    n_upper = triton.cdiv(total_q, block_m) + batch
    tile_map = torch.empty((n_upper, 8), dtype=torch.int32, device=cu_seqlens_q.device)
    # 64 tiles per program against 64 sequences at a time: a [64, 64] comparison per step, small enough for the
    # default 4 warps without spilling.
    block_c = chunk = 64
    _launch.launch(_varlen_tile_map_kernel, (triton.cdiv(n_upper, block_c), ),
                   (cu_seqlens_q, cu_seqlens_k, tile_map, batch, n_upper),
                   dict(BLOCK_M=block_m, REVERSE=reverse, BLOCK_C=block_c, CHUNK=chunk), tile_map.device.index)
    return tile_map, n_upper


def mod_scalars(softmax_scale, softcap, scaled_q=False):
    """(qk_scale, pre_scale, mod_unit) for _score_mod: with a softcap the scores become tanh(pre_scale s) and
    qk_scale = softcap log2(e) turns them into log2 units; without, qk_scale = scale log2(e). ALiBi slopes and a
    float attn_mask are divided by the same scale (times mod_unit) so that one multiply-add applies them before
    it. scaled_q (the forward with a float attn_mask and no softcap): the kernel multiplies Q by pre_scale =
    scale (_scale_q), the scores come out scaled, and qk_scale = log2(e), mod_unit = 1."""
    if softcap > 0:
        return softcap * LOG2E.value, softmax_scale / softcap, 1.0 / softcap
    if scaled_q:
        return LOG2E.value, softmax_scale, 1.0
    return softmax_scale * LOG2E.value, 1.0, 1.0 / softmax_scale


def attention_forward(q, k, v, softmax_scale, diagonal_offset, feats: Features, out_dtype=None):
    """Same contract as kernels.forward.attention_forward for the cases `supports` accepts. An out_dtype other
    than q's (float32) is stored from registers: the output staging buffer holds q's dtype."""
    varlen = feats.varlen
    out_dtype = out_dtype or q.dtype
    if varlen:
        # Packed [total, H, D] sequences (kernel note at _varlen_item): 4-D views [1, total, H, D] for the
        # descriptors, lse [H, total_q]; each item adds its sequence's own Sk - Sq to the offsets below.
        total_q, num_heads, head_dim = q.shape
        num_kv_heads = k.shape[1]
        batch = feats.cu_seqlens_q.numel() - 1
        seqlen_q, seqlen_k = feats.max_seqlen_q, feats.max_seqlen_k
        out = _common.empty((total_q, num_heads, head_dim), out_dtype, q.device)
        lse = _common.empty((num_heads, total_q), torch.float32, q.device)
        diagonal_offset = 0
        q4, k4, v4, o4 = (t.unsqueeze(0) for t in (q, k, v, out))
        out_strides = (0, out.stride(0), out.stride(1))
        lse_strides = (0, lse.stride(0))
    else:
        batch, seqlen_q, num_heads, head_dim = q.shape
        seqlen_k, num_kv_heads = k.shape[1], k.shape[2]
        out = _common.empty((batch, seqlen_q, num_heads, head_dim), out_dtype, q.device)
        lse = _common.empty((batch, num_heads, seqlen_q), torch.float32, q.device)
        q4, k4, v4, o4 = q, k, v, out
        out_strides = (out.stride(0), out.stride(1), out.stride(2))
        lse_strides = (lse.stride(0), lse.stride(1))
    # The kernel's right bound is i + diag_offset (CAUSAL): causal, or a right window folded into the offset; its
    # left bound i + left_offset (MASK_LEFT).
    right_offset = diagonal_offset + (feats.window_right if feats.mask_right else 0)
    alibi, stride_alibi_b = feats.alibi_args(lse)  # lse: a placeholder, never read without ALiBi
    left_offset = diagonal_offset - feats.window_left if feats.mask_left else 0
    bias_kind = feats.bias_kind
    num_wg, qbuf, dynamic = CONFIGS[(head_dim, feats.banded)]
    if num_wg == 3 and (feats.softcap > 0 or feats.alibi_slopes is not None or bias_kind or feats.dropout_p > 0):
        # Three warpgroups have 160 registers each: a softcap or ALiBi spills there (17-24 stores offline), two
        # warpgroups of the causal configuration do not.
        num_wg, qbuf, dynamic = CONFIGS[(head_dim, True)]
    if feats.softcap > 0:
        # Two query buffers for a softcap on every configuration (d128's causal and banded one has one): the causal
        # softcap forward ran 6.5-7% faster with them at 16k and 4k (H200), outputs bit-identical, while the plain
        # causal, ALiBi, sinks and window forwards moved within +-1% and dropout's lost 1-2% (NOTES, "Two query
        # buffers for the causal softcap forward").
        qbuf = 2
    block_m = WG_M * num_wg
    # attn_mask: its tiles' descriptor, room for them in shared memory, and for a bool mask the list of key blocks
    # each query tile visits (lse and 0: placeholders, never read).
    bias_desc, bias_mul_b, bias_mul_h, stage_o = None, 0, 0, True
    counts, indices, count_strides, idx_cols = lse, lse, (0, 0), 0
    if bias_kind:
        bias_desc, bias_mul_b, bias_mul_h = bias_descriptor(feats.attn_bias, WG_M, BLOCK_N)
        qbuf, stage_o = _smem_plan(head_dim, num_wg, qbuf, feats.attn_bias.element_size())
        if bias_kind == BIAS_BOOL:
            dynamic = True  # tiles see as many blocks as the mask lets them: take them from the counter
            # Without a band, the blocks the mask leaves entirely visible need no tile (mark_full); with one,
            # every listed block is masked anyway.
            counts, indices, count_strides, idx_cols = feats.block_lists(block_m, BLOCK_N, False, seqlen_q,
                                                                         seqlen_k, mark_full=not feats.banded)
    stage_o = stage_o and out_dtype == q.dtype
    n_m = triton.cdiv(seqlen_q, block_m)
    tile_map = lse  # a placeholder, never read without varlen
    if varlen:
        # Items: (tile of the map, head); the producer skips the map's rows past the last tile.
        tile_map, n_m = varlen_tile_map(feats.cu_seqlens_q, feats.cu_seqlens_k, total_q, block_m, feats.mask_right)
        dynamic = True
    n_tiles = n_m * batch * num_heads if not varlen else n_m * num_heads
    head_group = min(HEAD_GROUP, num_heads) if bias_kind == BIAS_FLOAT and not bias_mul_h and not varlen else 1
    dynamic = PERSISTENT and dynamic
    persistent = PERSISTENT and (dynamic or not feats.banded)
    grid = (min(n_tiles, _num_sms(q.device.index)) if persistent else n_tiles, )
    # The dynamic schedule's item counter (items after each program's first); unused otherwise.
    counter = torch.zeros(1, dtype=torch.int32, device=q.device) if dynamic else lse
    # LAZY_MAX: not with an attn_mask (a redone block would need its tile again) or a left window (a row may see
    # its first key in a later block, and needs that block's maximum as its reference), nor on three warpgroups
    # (their 160 registers spill ~90 stores with it, and plain d64 ran 5% slower), nor with ALiBi: its scores rise
    # toward the diagonal by design, past the first block's maximum in every later block, and each redone block
    # costs a second Q K^T (the forward measured +59% over plain instead of +22%).
    lazy = not bias_kind and not feats.mask_left and feats.alibi_slopes is None and num_wg == 2
    seed = feats.seed if feats.dropout_p > 0 else lse  # the call's Philox key; lse: a placeholder, never read
    qk_scale, pre_scale, mod_unit = mod_scalars(softmax_scale, feats.softcap,
                                                scaled_q=bias_kind == BIAS_FLOAT and not feats.softcap > 0)
    _launch.launch(_fwd_kernel, grid, (
        _descriptor(q4, WG_M), _descriptor(k4, BLOCK_N), _descriptor(v4, BLOCK_N), _descriptor(o4, WG_M), bias_desc,
        out, lse, counter, tile_map, alibi, lse if feats.sinks is None else feats.sinks, seed, counts, indices,
        *out_strides, *lse_strides, stride_alibi_b, bias_mul_b,
        bias_mul_h, *count_strides, idx_cols, seqlen_q, seqlen_k, right_offset, left_offset, diagonal_offset,
        qk_scale, mod_unit, pre_scale, dropout_threshold(feats.dropout_p), 1.0 - feats.dropout_p, num_heads,
        max(head_group, 1), num_heads // num_kv_heads, n_m, n_tiles), dict(
        HEAD_DIM=head_dim, BLOCK_M=block_m, BLOCK_N=BLOCK_N, STAGES=STAGES[head_dim], CAUSAL=feats.mask_right,
        MASK_LEFT=feats.mask_left, SOFTCAP=feats.softcap > 0, HAS_ALIBI=feats.alibi_slopes is not None,
        HAS_SINKS=feats.sinks is not None, BIAS=bias_kind, BSTAGES=BIAS_STAGES, STAGE_O=stage_o, NUM_WG=num_wg,
        DYNAMIC=dynamic, QBUF=qbuf if persistent else 1, VARLEN=varlen, LAZY=LAZY_MAX if lazy else 0,
        DROPOUT=feats.dropout_p > 0),
        q.device.index, num_warps=4)
    return out, lse
