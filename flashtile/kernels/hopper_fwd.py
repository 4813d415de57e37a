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
  fills the gaps the other two leave (but where Sq leaves a head's last 192-row tile mostly empty:
  ``three_warpgroups_fill``, and where the call takes ``DEFER``, below, which runs on two); a warpgroup whose rows
  all lie past Sq only follows the ring, and so does one through the key blocks a causal band hides from all its
  rows (``TAIL``: 64-key blocks, d192 and d256);
* on two warpgroups without an attn_mask, a left window or ALiBi, a step after a work item's first takes no row maximum
  and does not rescale O (``LAZY_MAX``): its exponentials are taken against the reference the rows already have,
  which the online softmax allows for any reference (docs/derivation.md ch. 3) as long as P keeps its range. The
  rows' sums say whether it did; if one passes ``LAZY_LIMIT``, the warpgroup (which agrees through one barrier)
  takes the block again with the maximum. bfloat16 calls of some size skip that check (``DEFER``): P keeps fp32's
  range, so a part only has to tell at its item's end whether its sums stayed under ``DEFER_LIMIT``, and flags the
  item otherwise; a second launch of the kernel compiled with ``REDO`` computes the flagged items again with the
  maximum (usually none, and its programs return at once);
* a float attn_mask shared by the heads is read by groups of ``HEAD_GROUP`` heads' items at about the same time
  (``_tile_coords``), once from memory.

The partitions share one ``FwdProgram``, built once in ``_fwd_kernel``: Gluon aggregates of the launch's constexprs
and layouts (``FwdConfig``), the shared memory with its mbarrier rings (``FwdSmem``, ``_gluon.Ring``), the work list,
the band, the scores' modifications, the outputs and what only the producer reads; a work item and a warpgroup's
rows of it are aggregates too (``FwdItem``, ``FwdRows``).

Facts about ptxas (Triton 3.6) that shape the code; docs/design-record.md ("Gluon forward: persistence and d64")
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
(_gluon.dropout_tile_keep). Float8 inputs (``FP8``, d128) take the same loops on float8 tensor cores: V arrives
transposed (``_load_vt``), P goes through shared memory (``_stage_p``), and each item's factors scale its scores
and output (``_fp8_item``). ``supports`` is the dispatch rule,
and tests/test_gluon.py and tests/test_gluon_features.py compare the two kernels on the GPU. Gluon does not run
in Triton's interpreter, so this module only compiles on a Hopper GPU; importing it anywhere is safe.
"""
# q, out: [B, Sq, H, D]; k, v: [B, Sk, Hk, D]; lse: [B, H, Sq] (fp32, natural log)
import collections
import functools

import torch
import triton
import triton.language as tl

from ..reference.dropout import dropout_threshold
from . import _common, _launch
from ._common import LN2, LOG2E
from .._settings import SETTINGS
from ._gluon import AVAILABLE, CONSUMER_REGS, PRODUCER_REGS
from ..request import AttentionRequest
from .features import BIAS_BOOL, BIAS_FLOAT, Features

if AVAILABLE:
    from ._gluon import (Ring, TensorDescriptor, Value, aggregate, dropout_tile_keep, fence_async_shared, gl, gluon,
                         mbarrier, mma_over_96, row_pieces_layout, tanh_approx, thread_barrier, tma, tma_load,
                         tma_store, to_float32, warpgroup_mma, warpgroup_mma_wait)

# Query rows per consumer warpgroup (a work item has NUM_WG of them).
WG_M = 64
# Key rows per block by tile width (TILE_DIM): 128, but d256's [128, 256] K and V blocks would take 128 KB a stage,
# so it reads 64 rows.
BLOCK_NS = {64: 128, 128: 128, 256: 64}
# A paged batch's table entries past a row's columns read as this page index, past any cache: TMA fills the copy
# with zeros (_load_block).
PAGE_PAST_CACHE = tl.constexpr(2 ** 30)
# The head dims the forward is written for (dispatch.GLUON_KERNEL_DIMS lists the same) and the tile width each runs at
# (the configuration tables' key, and V's and the output's width): d96 and d192 run d128's and d256's kernels over
# columns zero-filled past the head dim (TMA fills them on loads and clips them on stores; _store_o masks them,
# PAD_D): d96's P V gains zero output columns, which nothing stores (its Q K^T sums over its own 96 columns,
# FwdConfig.NARROW_QK; d192's Q and K come in chunks of their own width, QK_TILE_DIM, and its P V covers its own 192
# columns, FwdConfig.V_SPLIT).
TILE_DIM = {64: 64, 96: 128, 128: 128, 192: 256, 256: 256}
# Q's and K's width where it differs from TILE_DIM: d192's 192 columns, read as three 64-column chunks (the
# descriptors' tile width QK_CHUNK; Gluon's shapes are powers of two) whose products add up (FwdConfig.QK_CHUNKS).
QK_TILE_DIM = {192: 192}
QK_CHUNK = 64


def kernel_dim(head_dim):
    """The head dim whose kernel a head dim runs (a multiple of 8 from 40 to 256; dispatch.gluon_head_dim): every
    other one takes the next of TILE_DIM's keys, its columns past the head dim zero-filled on loads and masked on
    stores as d96's and d192's are (d80 runs d96's path on d128's tiles, d112 d128's, d160 d192's, d224 d256's)."""
    return next(d for d in TILE_DIM if d >= head_dim)


def tile_dim(head_dim):
    """The tile width of a head dim (TILE_DIM of its kernel_dim)."""
    return TILE_DIM[kernel_dim(head_dim)]


def qk_tile_dim(head_dim):
    """Q's and K's width in shared memory (QK_TILE_DIM of its kernel_dim, else its tile's)."""
    kd = kernel_dim(head_dim)
    return QK_TILE_DIM.get(kd, TILE_DIM[kd])
# Ring depth per head dim. d128: 2 K + 2 V slots of 32 KB, two query buffers and the output buffer (32 KB each) use
# 224 of the 227 KB of shared memory; a third stage does not fit. d64: 3 stages, 96 KB, and up to 72 KB more.
# d256: 2 stages of 64-row K and V blocks (128 KB) and one query buffer (64 KB); its output is stored from
# registers (a staging buffer would need 64 KB more).
STAGES = {64: 3, 128: 2, 256: 2}
# (q/k head dim, v head dim) -> (BLOCK_N, STAGES) of a shape whose Q and K come in 64-column chunks
# (QK_TILE_DIM), which take 192 columns of shared memory rather than their tile's 256. MLA's 192/128 then has room
# for d128's 128-key blocks (2 x 48 KB of K, 2 x 32 KB of V, 48 KB of Q): 1.09-1.21x its 64-key blocks on an H100.
# d192 keeps d256's tiling: two query buffers (208 KB) or three stages (216 KB) ran no faster there
# (docs/design-record.md, "The forward at head dims 96 and 192").
CHUNKED_TILES = {(192, 128): (128, 2)}
# Q/K tiles at least this wide (d192, d256, MLA's) have no room for an output staging buffer: without an attn_mask
# they store O from registers in 64-column chunks through a layout conversion, 8 KB of scratch per warpgroup
# (FwdConfig.CHUNK_O, _store_o; _smem_plan counts the scratch).
CHUNK_O_MIN_DIM = 192
# (head_dim, causal) -> (consumer warpgroups NUM_WG, query buffers QBUF, dynamic schedule DYNAMIC); plain d64 takes
# the causal configuration where its tiles fill poorly or it defers its check (_fwd_plan). Same H200 run,
# TFLOP/s at S4k / S16k against the previous kernel (2 warpgroups, 1 buffer, causal one program per tile):
# plain d64 477 / 492 vs 441 / 446; causal d64 412 / 441 vs 386 / 444 (3 warpgroups there: 388 / 449);
# causal d128 553 / 627 vs 528 / 611; plain d128 626 / 638 vs 624 / 642 (2 buffers: +1-2% in two other runs).
# d256 takes d128's schedules with one query buffer (STAGES above), not tuned apart.
CONFIGS = {(64, False): (3, 2, True), (64, True): (2, 2, True), (128, False): (2, 2, False), (128, True): (2, 1, True),
           (256, False): (2, 1, False), (256, True): (2, 1, True)}
# Three warpgroups' 192-row tiles leave the last tile of a head partly empty unless 192 divides Sq: at Sq = 1k its
# sixth tile holds 64 rows, and two of its three warpgroups only follow the ring. A fixed-length call whose rows fill
# the 192-row tiles less than THREE_WG_MIN_FILL times as well as they fill two warpgroups' 128-row tiles takes the
# two-warpgroup configuration (the causal one's, with LAZY_MAX) instead. H100, one run, the two against each other at
# d64 (docs/design-record.md, "Two warpgroups for short d64 forwards"): 1.046x at 1k (fill 0.89), 0.99x at 2k and 4k
# (0.97), 0.97x at 16k (0.99).
THREE_WG_MIN_FILL = 0.95
# Tile widths whose forward takes neither an attn_mask nor dropout (offline sm90 compiles): at 256 a [64, 64] mask
# tile is narrower than the mask ring's 128-byte swizzle, and dropout spills 93 stores.
NO_MASK_OR_DROPOUT_TILES = (256,)
# Registers per thread of the two worker consumers when there are three (16 warps: 512 per thread slot in all; the
# producer's warpgroup keeps 24, the first consumer gets what is left, 168).
CONSUMER_REGS_3WG = tl.constexpr(160)
# attn_mask tiles (a float bias or a bool mask) come through a ring of their own, BIAS_STAGES deep (at d128 a third
# 32 KB stage of a 16-bit bias does not fit beside K/V); _smem_plan fits it into SMEM_BYTES (of the 227 KB an
# H100/H200 block may use, what is left beside the barriers).
BIAS_STAGES = 2
SMEM_BYTES = 224 * 1024
# The float8 forward's (K/V ring depth, query buffers) at d128: 16 KB per K or V block (32 KB at 256-key blocks) and
# 16 KB per query tile, beside two P buffers of 8 KB (16 KB; _stage_p). Rings of 3 and 4 stages fit but ran no faster
# at 16k on an H100, and one query buffer lost 4% there (docs/design-record.md, "The FP8 forward").
FP8_RING = (2, 2)
# The float8 forward's key blocks (fp8_block_n): 256 keys where a row sees many of them, 128 otherwise. A 256-key step
# halves the steps' fixed costs (the waits, P's fence and barrier, the LAZY check's barrier) per key, and P is
# stored before that check (_finish_step's EARLY: its fp32 exponentials beside O spilled 145 stores offline). On an
# H100 (docs/design-record.md, "The FP8 forward"), 256 / 128 at d128: 1.03-1.10x from 2k keys without a band,
# 0.97x at 1k; causal 1.06x at 16k, 0.98-1.00x at 4k-8k, 0.74-0.85x at 1k-2k. Varlen batches keep 128 (their
# transposed copy spaces sequences VT_GAP apart for 128-key blocks), as do dropout (its P stays fp32 through the
# check) and paged caches.
FP8_WIDE_BLOCK_N = tl.constexpr(256)
FP8_WIDE_MIN_KEYS = {False: 2048, True: 16384}  # by whether the call has a band (causal, a window)
# LAZY_MAX (SETTINGS.lazy_max, on by default): without an attn_mask, a left window or ALiBi, on two warpgroups, blocks
# after a work item's first take their exponentials against the rows' reference from earlier blocks, with no row
# maximum and no rescale of O, unless a row's sum passes LAZY_LIMIT (_finish_step): 2-5% faster forwards
# (docs/design-record.md, "The forward without a row maximum"). 2^15: every P then fits fp16 (65504), and so does its
# sum.
LAZY_LIMIT = tl.constexpr(32768.0)
# The float8 forward's limit: P is rounded to float8 e4m3 for P V, whose largest value is 448; the largest power of
# two under it (a row's block sum bounds each of its P).
LAZY_LIMIT_FP8 = tl.constexpr(256.0)
# DEFER (bfloat16 under LAZY_MAX): blocks take their exponentials against the reference unchecked, and a warpgroup
# part whose row sum l passes DEFER_LIMIT at the item's end is flagged (_flag_redo); a second launch, the redo pass
# (the kernel compiled with REDO), computes the flagged items again with the row maximum at every step
# (_finish_step, _next_flagged). bfloat16 P has fp32's range, so only overflow matters: every P and l stay under
# 2^64, O under 2^64 times V's largest value. The check's warpgroup barrier per block had cost 1-8% of the forward
# (4-12% in a probe without the redo pass; docs/design-record.md, "The forward's check at the item's end").
DEFER_LIMIT = tl.constexpr(18446744073709551616.0)
# An attn_mask shared by the heads ((B|1, 1, Sq, Sk), the usual shape of a padding or causal float mask) is read by
# every head. Items in the default order (a head's query tiles in turn) read each mask tile once per head from
# memory: 16 heads at 16k stream 8.6 GB for a 0.5 GB mask. HEAD_GROUP heads are then interleaved (_tile_coords), so
# that they read a tile at about the same time and L2 serves all but the first. 8: at 16k d128 a wave of programs
# covers ~16 query tiles of 8 heads, and the K/V the wave also reads (8 heads' worth, from memory once per wave)
# and the mask (twice in all) are then about equal.
HEAD_GROUP = 8
# The kernel's scalar arguments come in named groups: Triton specializes each field as an argument of its own, and
# the kernel reads them by name (FwdProgram's aggregates).
# Strides of out (batch, row, head), lse (batch, head) and alibi (batch).
_Strides = collections.namedtuple("_Strides", "out_b out_s out_h lse_b lse_h alibi_b")
# The attn_mask: the factors that turn a batch and a head index into its own (0 along a broadcast dim); a bool
# mask's block lists (Features.block_lists): batch and head strides, columns.
_Mask = collections.namedtuple("_Mask", "mul_b mul_h lists_b lists_h lists_cols")
# Sk; the band's right and left bounds i + diag_offset, i + left_offset; ALiBi's distance |i + alibi_offset - j|.
_Band = collections.namedtuple("_Band", "seqlen_k diag_offset left_offset alibi_offset")
_Scales = collections.namedtuple("_Scales", "qk_scale mod_unit pre_scale drop_threshold drop_keep")  # mod_scalars
# Query heads, heads interleaved in a group (HEAD_GROUP), query heads per kv head.
_Heads = collections.namedtuple("_Heads", "num_heads head_group group_size")
# A bool attn_mask's block lists (Features.block_lists' counts and indices; placeholders without one).
_Lists = collections.namedtuple("_Lists", "counts idx")
# A paged batch's block table, its row stride and columns (a placeholder and zeros without one).
_Pages = collections.namedtuple("_Pages", "table stride cols")
# The features' tensors: ALiBi's slopes, the sinks, dropout's Philox key (a placeholder where a feature is off).
_Extras = collections.namedtuple("_Extras", "alibi sinks seed descale")

if AVAILABLE:
    @aggregate
    class FwdConfig:
        """A launch's compile-time choices (the kernel's constexprs, documented at _fwd_kernel; BSTAGES is
        BIAS_STAGES) and the layouts that follow from them: s_layout for a warpgroup's [PART_M, BLOCK_N] scores,
        o_layout for its [PART_M, HEAD_DIM_V] output, dot_a for P as the register operand of P V, row_layout for
        per-row values. HEAD_DIM is Q's and K's tile width, HEAD_DIM_V V's and the output's (the same but for MLA's
        192/128)."""
        HEAD_DIM: gl.constexpr
        HEAD_DIM_V: gl.constexpr
        QK_W: gl.constexpr
        QK_CHUNKS: gl.constexpr
        BLOCK_M: gl.constexpr
        BLOCK_N: gl.constexpr
        PART_M: gl.constexpr
        STAGES: gl.constexpr
        MASK_RIGHT: gl.constexpr
        MASK_LEFT: gl.constexpr
        SOFTCAP: gl.constexpr
        HAS_ALIBI: gl.constexpr
        HAS_SINKS: gl.constexpr
        BIAS: gl.constexpr
        BSTAGES: gl.constexpr
        STAGE_O: gl.constexpr
        NUM_WG: gl.constexpr
        DYNAMIC: gl.constexpr
        QBUF: gl.constexpr
        VARLEN: gl.constexpr
        LAZY: gl.constexpr
        DEFER: gl.constexpr
        REDO: gl.constexpr
        HAND: gl.constexpr
        DROPOUT: gl.constexpr
        PAGE: gl.constexpr
        PAD_D: gl.constexpr
        V_SPLIT: gl.constexpr
        V_LO: gl.constexpr
        V_HI: gl.constexpr
        NARROW_QK: gl.constexpr
        Q_REGS: gl.constexpr
        CHUNK_O: gl.constexpr
        FP8: gl.constexpr
        dtype: gl.constexpr
        s_layout: gl.constexpr
        o_layout: gl.constexpr
        o_layout_b: gl.constexpr
        dot_a: gl.constexpr
        row_layout: gl.constexpr

        @gluon.constexpr_function
        def __init__(self, HEAD_DIM, HEAD_DIM_V, BLOCK_M, BLOCK_N, STAGES, MASK_RIGHT, MASK_LEFT, SOFTCAP, HAS_ALIBI,
                     HAS_SINKS, BIAS, STAGE_O, NUM_WG, DYNAMIC, QBUF, VARLEN, LAZY, DROPOUT, PAGE, PAD_D, dtype, QK_W,
                     DEFER, REDO):
            self.HEAD_DIM = gl.constexpr(HEAD_DIM)
            self.HEAD_DIM_V = gl.constexpr(HEAD_DIM_V)
            # Q and K arrive in QK_CHUNKS column chunks of QK_W (the descriptors' tile width): one, or three of 64
            # at head dim 192, whose 192-column tile Gluon cannot hold (its shapes are powers of two).
            self.QK_W = gl.constexpr(QK_W)
            self.QK_CHUNKS = gl.constexpr(HEAD_DIM // QK_W)
            self.BLOCK_M = gl.constexpr(BLOCK_M)
            self.BLOCK_N = gl.constexpr(BLOCK_N)
            self.PART_M = gl.constexpr(BLOCK_M // NUM_WG)
            self.STAGES = gl.constexpr(STAGES)
            self.MASK_RIGHT = gl.constexpr(MASK_RIGHT)
            self.MASK_LEFT = gl.constexpr(MASK_LEFT)
            self.SOFTCAP = gl.constexpr(SOFTCAP)
            self.HAS_ALIBI = gl.constexpr(HAS_ALIBI)
            self.HAS_SINKS = gl.constexpr(HAS_SINKS)
            self.BIAS = gl.constexpr(BIAS)
            self.BSTAGES = gl.constexpr(BIAS_STAGES)
            self.STAGE_O = gl.constexpr(STAGE_O)
            self.NUM_WG = gl.constexpr(NUM_WG)
            self.DYNAMIC = gl.constexpr(DYNAMIC)
            self.QBUF = gl.constexpr(QBUF)
            self.VARLEN = gl.constexpr(VARLEN)
            self.LAZY = gl.constexpr(LAZY)
            # DEFER (with LAZY, bfloat16 inputs): no per-block check; a part whose sum passes DEFER_LIMIT is flagged
            # for the redo pass, a launch of this kernel compiled with REDO, which walks the flagged items with the
            # row maximum at every step (_finish_step, _flag_redo, _next_flagged). Under DEFER the producer hands
            # each item's index to the consumers whatever the schedule (HAND), as the redo pass needs.
            self.DEFER = gl.constexpr(DEFER)
            self.REDO = gl.constexpr(REDO)
            self.HAND = gl.constexpr(DYNAMIC or DEFER)
            self.DROPOUT = gl.constexpr(DROPOUT)
            self.PAGE = gl.constexpr(PAGE)
            self.PAD_D = gl.constexpr(PAD_D)
            # d192's V (256-column tiles, PAD_D): P V over its 192 columns only, as two products of V_LO + V_HI
            # (128 + 64) columns into an accumulator each (Gluon's tensors are powers of two; _issue_pv), not one
            # over 256. (MLA's 192/128 has V on d128's tiles, unpadded.) d96's Q K^T sums over its 96 columns
            # (64 + 32, NARROW_QK) rather than 128; its P V stays on 128 columns: split like d192's, it stores O from
            # registers (no staging buffer takes the 32-column part), which cost more at 1k-2k (0.95-0.99x) than the
            # products saved at 16k (1.03-1.08x, H100).
            # PAD_D is the kernel_dim whose path a padded head dim takes: the products cover that many columns,
            # those past the head dim being TMA's zeros (d80 runs d96's, d160 d192's; d112 and d224 run their tiles'
            # whole products).
            v_split = PAD_D == 192 and HEAD_DIM_V == 256
            self.V_SPLIT = gl.constexpr(v_split)
            self.V_LO = gl.constexpr(HEAD_DIM_V // 2)
            self.V_HI = gl.constexpr(HEAD_DIM_V // 4)
            self.NARROW_QK = gl.constexpr(PAD_D == 96 and HEAD_DIM == 128)
            # d192 also takes Q K^T with Q as the register operand, loaded once per work item (_tile_blocks): of
            # 64-key blocks, each product read the 64-row query chunk from shared memory again. 1.00-1.09x on an
            # H100; d256 (64 more registers) and MLA's 192/128 (128-key blocks) spill 17-88 stores with it.
            self.Q_REGS = gl.constexpr(v_split)
            # O from registers in 64-column chunks through a layout conversion (CHUNK_O_MIN_DIM).
            self.CHUNK_O = gl.constexpr(HEAD_DIM >= CHUNK_O_MIN_DIM and not BIAS)
            # float8 inputs (FP8): wgmma's K step is 32 elements instead of 16, a register operand packs 4 of them
            # per 32 bits instead of 2, and both shared operands are K-major (V comes transposed: _load_vt).
            fp8 = dtype.primitive_bitwidth == 8
            self.FP8 = gl.constexpr(fp8)
            self.dtype = gl.constexpr(dtype)
            k_step = 32 if fp8 else 16
            s_layout = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                 instr_shape=[16, BLOCK_N, k_step])
            o_layout = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                 instr_shape=[16, HEAD_DIM_V // 2 if v_split else HEAD_DIM_V,
                                                              k_step])
            self.s_layout = gl.constexpr(s_layout)
            self.o_layout = gl.constexpr(o_layout)
            # (V_SPLIT: the second accumulator's, over columns V_LO to V_LO + V_HI.)
            self.o_layout_b = gl.constexpr(gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                                     instr_shape=[16, HEAD_DIM_V // 4, k_step]))
            self.dot_a = gl.constexpr(gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=4 if fp8 else 2))
            self.row_layout = gl.constexpr(gl.SliceLayout(1, s_layout))

    # The aggregates below group what the partitions share; FwdProgram holds them all. Their field order is not
    # free: warp_specialize hands the worker partitions their values (those a worker uses) in the order they first
    # appear in the flattened arguments, and that order shapes ptxas's schedule of each partition. The order here
    # (consumer values first, in these groups; then the producer's own, FwdProducer) is the one the kernel was
    # measured with.

    @aggregate
    class FwdProducer:
        """What only the producer reads: the descriptors it loads from (bias_desc: None without an attn_mask), the
        dynamic schedule's Counter, the varlen TileMap, group_size query heads per kv head, the factors that
        turn a batch and a head index into the attn_mask's (0 along a broadcast dim), and a paged batch's block
        Table (its row stride and columns; PAGE > 0)."""
        q_desc: Value
        k_desc: Value
        v_desc: Value
        bias_desc: Value
        Counter: gl.tensor
        TileMap: gl.tensor
        group_size: Value
        bias_mul_b: Value
        bias_mul_h: Value
        Table: gl.tensor
        stride_table: Value
        table_cols: Value

    @aggregate
    class FwdOut:
        """The outputs: o_desc (stores through staging buffers), Out and its strides, Lse and its strides; under
        DEFER the redo state Redo ([count, done, one flag per item], int32)."""
        o_desc: Value
        Out: gl.tensor
        stride_ob: Value
        stride_os: Value
        stride_oh: Value
        Lse: gl.tensor
        stride_lb: Value
        stride_lh: Value
        Redo: gl.tensor

    @aggregate
    class FwdSmem:
        """The forward's shared memory: query tiles (q: QBUF buffers of NUM_WG [PART_M, HEAD_DIM] parts, at d192 their
        column chunks stacked along the rows), K and V blocks (STAGES of [BLOCK_N, HEAD_DIM], K chunked likewise; V
        [BLOCK_N, HEAD_DIM_V], transposed under FP8), output staging tiles (o), attn_mask tiles (b: BSTAGES slots of
        NUM_WG [PART_M, BLOCK_N] parts), the work items the producer hands over (tile: per query buffer the item's
        index, and under VARLEN its ITEM_FIELDS), _wg_max's buffers (flag), the rings' barriers, and under FP8 each
        consumer's float8 P ([PART_M, BLOCK_N], _stage_p). Buffers and rings a launch does not use alias used ones
        and are never read."""
        q: gl.shared_memory_descriptor
        k: gl.shared_memory_descriptor
        v: gl.shared_memory_descriptor
        o: gl.shared_memory_descriptor
        b: gl.shared_memory_descriptor
        tile: gl.shared_memory_descriptor
        flag: gl.shared_memory_descriptor
        q_bar: Ring
        k_bar: Ring
        v_bar: Ring
        b_bar: Ring
        p: gl.shared_memory_descriptor

    @aggregate
    class FwdWork:
        """The work list: n_tiles items over n_m query tiles (varlen: the map's n_upper), num_heads heads
        interleaved in groups of head_group (_tile_coords)."""
        n_tiles: Value
        n_m: Value
        num_heads: Value
        head_group: Value

    @aggregate
    class FwdBand:
        """The keys a query sees: seqlen_q / seqlen_k (a varlen launch's longest), the band's right and left
        bounds i + diag_offset and i + left_offset (kernel coordinates; a varlen item adds its own Sk - Sq)."""
        seqlen_q: Value
        seqlen_k: Value
        diag_offset: Value
        left_offset: Value

    @aggregate
    class FwdMods:
        """The scores' modifications and what the epilogue adds: qk_scale, mod_unit and pre_scale of mod_scalars;
        ALiBi's slopes (Alibi, stride_alibi_b; the distance is |i + alibi_offset - j|); Sinks; dropout's Philox key
        Seed, its threshold and keep probability drop_keep = 1 - p; FP8's factors Descale (fp32 [B, Hk, 3]: q's,
        k's and v's of each batch entry and kv head, _fp8_item)."""
        qk_scale: Value
        Alibi: gl.tensor
        stride_alibi_b: Value
        alibi_offset: Value
        mod_unit: Value
        pre_scale: Value
        Sinks: gl.tensor
        Seed: gl.tensor
        drop_threshold: Value
        drop_keep: Value
        Descale: gl.tensor

    @aggregate
    class FwdLists:
        """A bool attn_mask's lists of key blocks per query tile (Features.block_lists: Counts, Idx with strides
        stride_cb, stride_ch and idx_cols columns; _item_blocks)."""
        Counts: gl.tensor
        Idx: gl.tensor
        stride_cb: Value
        stride_ch: Value
        idx_cols: Value

    @aggregate
    class FwdProgram:
        """Everything the partitions of one program share (built once in _fwd_kernel)."""
        cfg: FwdConfig
        producer: FwdProducer
        out: FwdOut
        smem: FwdSmem
        work: FwdWork
        band: FwdBand
        mods: FwdMods
        lists: FwdLists

    @aggregate
    class FwdItem:
        """One work item: query rows from start_m of batch i_b, head i_h. Under VARLEN its sequence's rows start
        at q_start / k_start of the packed tensors, it has its own seqlen_q / seqlen_k and adds offset = Sk - Sq
        to the band's offsets (diag_offset, left_offset here are the item's); t_b is the descriptors' batch index
        (0 under VARLEN)."""
        start_m: Value
        i_b: Value
        i_h: Value
        t_b: Value
        q_start: Value
        seqlen_q: Value
        k_start: Value
        seqlen_k: Value
        offset: Value
        diag_offset: Value
        left_offset: Value

    @aggregate
    class FwdRows:
        """A consumer warpgroup's rows of a work item: row (PART_M query positions from row_start), the item's key
        bound and band offsets, its blocks (the j-th is _block_at(j_lo, j, idx_row)) of which those below full_lo
        or from n_full on are masked, ALiBi's per-row i + a (arow) and slope, the warpgroup's index part, and
        whether this is DEFER's redo pass (redo, constexpr: its steps take the row maximum, _finish_step)."""
        row_start: Value
        row: gl.tensor
        seqlen_k: Value
        diag_offset: Value
        left_offset: Value
        j_lo: Value
        n_full: Value
        full_lo: Value
        idx_row: gl.tensor
        arow: gl.tensor
        slope: Value
        part: gl.constexpr
        redo: gl.constexpr

    @aggregate
    class Dropout:
        """Dropout's Philox key (seed), the (batch, head) counter word bh and the keep threshold."""
        seed: Value
        bh: Value
        threshold: Value

    @gluon.jit
    def _tile_coords(work, tile, BLOCK_M: gl.constexpr, REVERSE: gl.constexpr):
        """Work item -> (first query row, batch, head). With head_group 1 the query tiles of one head are
        consecutive items, so the programs running at one time share few heads' K/V in L2. With head_group g > 1
        (an attn_mask shared by the heads: HEAD_GROUP) the heads go in groups of g and a group's items take its
        heads in turn for each query tile, so that g programs read each mask tile at about the same time, once
        from memory. REVERSE (causal, and bool masks, which are often causal-like): last tiles first, the ones
        that see the most keys."""
        if work.head_group == 1:
            i_bh = tile // work.n_m
            i_m = tile % work.n_m
            i_b = i_bh // work.num_heads
            i_h = i_bh % work.num_heads
        else:
            per_b = work.n_m * work.num_heads
            i_b = tile // per_b
            r = tile - i_b * per_b
            g0 = (r // (work.head_group * work.n_m)) * work.head_group
            size = gl.minimum(work.head_group, work.num_heads - g0)
            r = r - g0 * work.n_m
            i_m = r // size
            i_h = g0 + r - i_m * size
        if REVERSE:
            i_m = work.n_m - 1 - i_m
        return i_m * BLOCK_M, i_b, i_h

    @gluon.jit
    def _block_range(start_m, seqlen_k, diag_offset, left_offset, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                     MASK_RIGHT: gl.constexpr, MASK_LEFT: gl.constexpr):
        """Key blocks a query tile sees, (first, count): all of them, or up to the right bound of its last row
        (MASK_RIGHT), from the left bound of its first row on (MASK_LEFT)."""
        kv_end = seqlen_k
        if MASK_RIGHT:
            kv_end = gl.maximum(gl.minimum(seqlen_k, start_m + BLOCK_M + diag_offset), 0)
        j_hi = gl.cdiv(kv_end, BLOCK_N)
        j_lo = 0
        if MASK_LEFT:
            j_lo = gl.minimum(gl.maximum(start_m + left_offset, 0) // BLOCK_N, j_hi)
        return j_lo, j_hi - j_lo

    @gluon.jit
    def _item_blocks(cfg, lists, item):
        """A work item's key blocks: (first, count, its block list). A bool attn_mask (BIAS 2): the count and the
        list of the blocks that hold any attended key, from Features.block_lists (see _block_at); otherwise a
        contiguous range (_block_range; idx_row is not read)."""
        if cfg.BIAS == 2:
            off = item.i_b * lists.stride_cb + item.i_h * lists.stride_ch + item.start_m // cfg.BLOCK_M
            return 0, gl.load(lists.Counts + off), lists.Idx + off.to(gl.int64) * lists.idx_cols
        else:
            j_lo, n_blocks = _block_range(item.start_m, item.seqlen_k, item.diag_offset, item.left_offset,
                                          cfg.BLOCK_M, cfg.BLOCK_N, cfg.MASK_RIGHT, cfg.MASK_LEFT)
            return j_lo, n_blocks, lists.Idx

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

    @gluon.jit
    def _read_tile(tile_smem):
        """The work item the producer wrote for this warpgroup (dynamic schedule)."""
        layout: gl.constexpr = gl.BlockedLayout([1], [32], [4], [0])
        return gl.max(tile_smem.load(layout), 0)

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
    def _hand_over(tile_smem, qb, tile, item, VARLEN: gl.constexpr):
        """The producer's hand-over of a work item to the consumers (dynamic schedule): its index, and under
        VARLEN the fields the consumers cannot compute (_consumer_item reads them)."""
        if VARLEN:
            base = qb * ITEM_FIELDS
            _write_tile(tile_smem.index(base), tile)
            _write_tile(tile_smem.index(base + 1), item.i_b)
            _write_tile(tile_smem.index(base + 2), item.start_m)
            _write_tile(tile_smem.index(base + 3), item.q_start)
            _write_tile(tile_smem.index(base + 4), item.seqlen_q)
            _write_tile(tile_smem.index(base + 5), item.seqlen_k)
            _write_tile(tile_smem.index(base + 6), item.i_h)
        else:
            _write_tile(tile_smem.index(qb), tile)

    @gluon.jit
    def _load_partition(prog):
        """The producer warp: walks the program's work items and loads each one's query tile, K/V blocks and
        attn_mask tiles into the rings (_load_item)."""
        cfg = prog.cfg
        work = prog.work
        band = prog.band
        c = 0  # blocks loaded so far by this program: slot c % STAGES, pass c // STAGES through the ring
        bc = 0  # attn_mask tiles loaded so far (its own ring: slot bc % BSTAGES)
        it = 0  # work items so far
        tile = gl.program_id(0)
        flagged = 0
        if cfg.REDO:
            # The redo pass walks the items the first pass flagged (none: no item at all).
            flagged = gl.load(prog.out.Redo)
            tile = work.n_tiles
            if flagged > 0:
                tile = _next_flagged(prog.out.Redo, gl.program_id(0), work.n_tiles)
        while tile < work.n_tiles:
            if cfg.VARLEN:
                # n_m is n_upper here; the item's sequence and its own bottom-right offsets.
                i_b, start_m, q_start, seqlen_q, k_start, seqlen_k, i_h = _varlen_item(prog.producer.TileMap, tile,
                                                                                       work.n_m)
                offset = seqlen_k - seqlen_q
                t_b = 0  # the descriptors' batch index
                valid = i_b >= 0
            else:
                start_m, i_b, i_h = _tile_coords(work, tile, cfg.BLOCK_M, cfg.MASK_RIGHT | (cfg.BIAS == 2))
                q_start = 0
                k_start = 0
                seqlen_k = band.seqlen_k
                offset = 0
                t_b = i_b
                seqlen_q = 0  # (not read)
                valid = True
            if valid:
                item = FwdItem(start_m, i_b, i_h, t_b, q_start, seqlen_q, k_start, seqlen_k, offset,
                               band.diag_offset + offset, band.left_offset + offset)
                c, bc, it = _load_item(prog, c, bc, it, tile, item)
            if cfg.REDO:
                tile = _next_flagged(prog.out.Redo, tile + gl.num_programs(0), work.n_tiles)
            elif cfg.DYNAMIC:
                # Items after the first one per program come from a global counter, in list order. Taken here,
                # after this item's loads are issued, its latency hides behind the wait for a free query buffer.
                # Relaxed: the index orders no data. (acq_rel, the default, put a GPU-scope fence before the add and
                # an L1 invalidation after it: the forward of 1-block items ran 13% slower.)
                taken = gl.atomic_add(prog.producer.Counter, 1, sem="relaxed")
                tile = gl.num_programs(0) + taken
                if taken == work.n_tiles - 1:
                    # The launch's last take: every program enters the loop once (the grid has at most n_tiles
                    # programs) and takes once more per item after its first, so the takes number n_tiles and no
                    # program takes again after this one. Zero again for the next launch (_schedule_counter).
                    gl.atomic_xchg(prog.producer.Counter, 0)
            else:
                tile += gl.num_programs(0)
        if cfg.HAND:
            # No item left: hand the consumers n_tiles in place of an index.
            qb = prog.smem.q_bar.wait_empty(it)
            _write_tile(prog.smem.tile.index(qb * (ITEM_FIELDS if cfg.VARLEN else 1)), work.n_tiles)
            mbarrier.arrive(prog.smem.q_bar.full.index(qb), count=1)
        if cfg.REDO and flagged > 0:
            # The redo pass's last program sets the count back to zero for the next launch (each program read it
            # at its start, before its own add: the add depends on what it read; the flags were cleared as their
            # items were taken). Relaxed, as the schedule's takes: nothing else is ordered by it.
            if gl.atomic_add(prog.out.Redo + 1, 1, sem="relaxed") == gl.num_programs(0) - 1:
                gl.store(prog.out.Redo, 0)
                gl.store(prog.out.Redo + 1, 0)

    @gluon.jit
    def _next_flagged(Redo, tile, n_tiles):
        """DEFER's redo pass: the first item from `tile` on, in steps of the grid, that the first pass flagged
        (n_tiles if none), its flag cleared. Redo: [count, done, one flag per item] (_flag_redo)."""
        step = gl.num_programs(0)
        flag = gl.load(Redo + 2 + tile, mask=tile < n_tiles, other=1)
        while flag == 0:
            tile += step
            flag = gl.load(Redo + 2 + tile, mask=tile < n_tiles, other=1)
        if tile < n_tiles:
            gl.store(Redo + 2 + tile, 0)
        return tile

    @gluon.jit
    def _flag_redo(out, tile, l_i, redo: gl.constexpr):
        """DEFER, at a part's end: flag the item for the redo pass where a row's sum passed DEFER_LIMIT in the
        first pass (l bounds each P of the row; an overflowed P makes it inf). NaN sums, from NaN inputs, are not
        flagged: their rows are NaN either way, as under LAZY's check. Every flagged row's thread stores the same
        flag; the count only has to leave zero."""
        if not redo:
            over = l_i > DEFER_LIMIT
            one = gl.full(l_i.shape, 1, gl.int32, layout=l_i.type.layout)
            gl.store(out.Redo + 2 + tile + one * 0, one, mask=over)
            gl.atomic_add(out.Redo + one * 0, one, mask=over, sem="relaxed")

    @gluon.jit
    def _load_item(prog, c, bc, it, tile, item):
        """The producer's loads for one work item (the descriptors' rows offset by q_start / k_start and their
        batch index t_b under VARLEN). Returns the ring counters."""
        cfg = prog.cfg
        smem = prog.smem
        producer = prog.producer
        i_hk = item.i_h // producer.group_size
        j_lo, n_blocks, idx_row = _item_blocks(cfg, prog.lists, item)
        qb = smem.q_bar.wait_empty(it)
        if cfg.HAND:
            # The consumers read the item's index once its query tile has arrived (the barrier's completion
            # orders this store before their read); they are done with this slot's previous index (q_empty).
            _hand_over(smem.tile, qb, tile, item, cfg.VARLEN)
        mbarrier.expect(smem.q_bar.full.index(qb), cfg.NUM_WG * cfg.QK_CHUNKS * producer.q_desc.block_type.nbytes)
        for part in gl.static_range(cfg.NUM_WG):
            for ch in gl.static_range(cfg.QK_CHUNKS):
                tma_load(producer.q_desc,
                         [item.t_b, item.q_start + item.start_m + part * cfg.PART_M, item.i_h, ch * cfg.QK_W],
                         smem.q_bar.full.index(qb),
                         _tma_chunk(_tile_view(smem.q, qb * cfg.NUM_WG + part, cfg.QK_CHUNKS), ch, cfg.PART_M,
                                    cfg.QK_CHUNKS))
        # K runs one block ahead of V, the order the consumers use them in: step j reads K_j (and its bias
        # tile) and V_{j-1}.
        for j in range(n_blocks + 1):
            if j < n_blocks:
                blk, partial = _block_at(j_lo, j, idx_row, cfg.BIAS == 2)
                col = blk * cfg.BLOCK_N
                _load_block(cfg, smem.k, smem.k_bar, producer.k_desc, c + j, item, col, i_hk, producer,
                            cfg.QK_CHUNKS)
                if cfg.BIAS != 0:
                    if partial:
                        # One attn_mask tile per consumer warpgroup: its PART_M rows, this block's keys.
                        slot = smem.b_bar.wait_empty(bc)
                        mbarrier.expect(smem.b_bar.full.index(slot), cfg.NUM_WG * producer.bias_desc.block_type.nbytes)
                        for part in gl.static_range(cfg.NUM_WG):
                            tma_load(producer.bias_desc,
                                     [item.i_b * producer.bias_mul_b, item.i_h * producer.bias_mul_h,
                                      item.start_m + part * cfg.PART_M, col], smem.b_bar.full.index(slot),
                                     smem.b.index(slot * cfg.NUM_WG + part).reshape([1, 1, cfg.PART_M, cfg.BLOCK_N]))
                        bc += 1
            if j > 0:
                blk, partial = _block_at(j_lo, j - 1, idx_row, cfg.BIAS == 2)
                col = blk * cfg.BLOCK_N
                if cfg.FP8:
                    _load_vt(cfg, smem.v, smem.v_bar, producer.v_desc, c + j - 1, item, col, i_hk)
                else:
                    _load_block(cfg, smem.v, smem.v_bar, producer.v_desc, c + j - 1, item, col, i_hk, producer)
        return c + n_blocks, bc, it + 1

    @gluon.jit
    def _load_block(cfg, buf, ring, desc, i, item, col, i_hk, producer, CHUNKS: gl.constexpr = 1):
        """Load the key block at col (K or V: its buffers, ring and descriptor) of the item's kv head i_hk as the
        ring's i-th use, in CHUNKS column chunks of the buffers' width (K at head dim 192: FwdConfig.QK_CHUNKS),
        each into a buffer of its own (_tile_view). Paged (PAGE > 0): the descriptor is over the
        [pages, PAGE, Hk, D] cache, one copy per page the block spans (PAGE < BLOCK_N) or one from within a page; a
        table entry past the row's columns becomes a page past the cache, which the copy fills with zeros (the
        block's rows past the sequence are masked, and a bad entry reads zeros: the safety policy of
        docs/safety.md)."""
        W: gl.constexpr = buf.shape[2]
        if cfg.PAGE == 0:
            slot = ring.wait_empty(i)
            mbarrier.expect(ring.full.index(slot), CHUNKS * desc.block_type.nbytes)
            for ch in gl.static_range(CHUNKS):
                tma_load(desc, [item.t_b, item.k_start + col, i_hk, ch * W], ring.full.index(slot),
                         _tma_chunk(_tile_view(buf, slot, CHUNKS), ch, cfg.BLOCK_N, CHUNKS))
        else:
            # The table entries are read before the wait for a free slot, so their latency hides behind it.
            row = producer.Table + item.i_b.to(gl.int64) * producer.stride_table
            first = col // cfg.PAGE
            if cfg.PAGE >= cfg.BLOCK_N:
                page = gl.load(row + first, mask=first < producer.table_cols, other=PAGE_PAST_CACHE)
                page = gl.where(page < 0, PAGE_PAST_CACHE, page)
                slot = ring.wait_empty(i)
                mbarrier.expect(ring.full.index(slot), CHUNKS * desc.block_type.nbytes)
                for ch in gl.static_range(CHUNKS):
                    tma_load(desc, [page, col % cfg.PAGE, i_hk, ch * W], ring.full.index(slot),
                             _tma_chunk(_tile_view(buf, slot, CHUNKS), ch, cfg.BLOCK_N, CHUNKS))
            else:
                # Every lane holds all the block's entries (at most 16: pages of 8 rows or more), so a page index
                # is a register: the copies need no cross-lane reduction (one lane per entry took three dependent
                # shuffles a page, docs/kvcache.md).
                n_pages: gl.constexpr = cfg.BLOCK_N // cfg.PAGE
                offs = gl.arange(0, n_pages, layout=gl.BlockedLayout([n_pages], [32], [1], [0]))
                pages = gl.load(row + first + offs, mask=first + offs < producer.table_cols, other=PAGE_PAST_CACHE)
                pages = gl.where(pages < 0, PAGE_PAST_CACHE, pages)
                slot = ring.wait_empty(i)
                mbarrier.expect(ring.full.index(slot), n_pages * CHUNKS * desc.block_type.nbytes)
                for p in gl.static_range(n_pages):
                    for ch in gl.static_range(CHUNKS):
                        tma_load(desc, [gl.sum(gl.where(offs == p, pages, 0), 0), 0, i_hk, ch * W],
                                 ring.full.index(slot),
                                 _tma_chunk(_tile_view(buf, slot, CHUNKS), ch, cfg.BLOCK_N, CHUNKS, p * cfg.PAGE,
                                            cfg.PAGE))

    @gluon.jit
    def _tile_view(buf, i, CHUNKS: gl.constexpr):
        """Tile i of a Q or K buffer ([n * CHUNKS, rows, W]): the [rows, W] buffer i, or with CHUNKS > 1 (three: d192's
        Q and K, FwdConfig.QK_CHUNKS) the tuple of its column chunks' buffers, entries i * CHUNKS on. (Shared
        buffers have power-of-two shapes: stacked along the rows of one, three chunks would take four's memory.)"""
        if CHUNKS == 1:
            return buf.index(i)
        else:
            gl.static_assert(CHUNKS == 3)
            return buf.index(i * 3), buf.index(i * 3 + 1), buf.index(i * 3 + 2)

    @gluon.jit
    def _chunk(tile, ch: gl.constexpr, rows: gl.constexpr, CHUNKS: gl.constexpr):
        """Column chunk ch of a _tile_view: the whole tile when there is one chunk."""
        if CHUNKS == 1:
            return tile
        else:
            return tile[ch]

    @gluon.jit
    def _tma_chunk(tile, ch: gl.constexpr, rows: gl.constexpr, CHUNKS: gl.constexpr, first: gl.constexpr = 0,
                   count: gl.constexpr = 0):
        """_chunk of a _tile_view as a TMA copy's [1, rows, 1, W] destination (rows first .. first + count of it,
        count > 0: one page of a paged block). (A sliced buffer cannot be reshaped, so the slice comes last.)"""
        if CHUNKS == 1:
            W: gl.constexpr = tile.shape[1]
            dst = tile.reshape([1, rows, 1, W])
        else:
            W: gl.constexpr = tile[ch].shape[1]
            dst = tile[ch].reshape([1, rows, 1, W])
        if count > 0:
            dst = dst.slice(first, count, 1)
        return dst

    @gluon.jit
    def _load_vt(cfg, buf, ring, desc, i, item, col, i_hk):
        """FP8: load the value block at col of kv head i_hk, transposed ([HEAD_DIM, BLOCK_N], keys contiguous), as
        the V ring's i-th use. float8 wgmma reads both shared operands K-major, and for P V the keys are the K
        dimension: the descriptor is over the call's transposed copy of V ([B, Hk, D, Sk], plan.start)."""
        slot = ring.wait_empty(i)
        mbarrier.expect(ring.full.index(slot), desc.block_type.nbytes)
        key = item.k_start + col
        if cfg.VARLEN:
            # Each sequence's keys start on a 16-key boundary of the copy, VT_GAP keys apart (_transposed_v).
            key = (item.k_start + VT_ALIGN - 1) // VT_ALIGN * VT_ALIGN + VT_GAP * item.i_b + col
        tma_load(desc, [item.t_b, i_hk, 0, key], ring.full.index(slot),
                 buf.index(slot).reshape([1, 1, cfg.HEAD_DIM_V, cfg.BLOCK_N]))

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
    def _softmax_step(cfg, smem, mods, rows, s, m_i, l_i, col0, mask, bc):
        """Scores -> online softmax for the block at columns col0 + (0 .. BLOCK_N-1): returns p, alpha, m, l and
        the attn_mask tiles read so far. `mask` (runtime): apply Sk and the band (_visible) and a bool attn_mask's
        tile (BIAS 2: the block is masked iff it has a tile). A float attn_mask's tile (BIAS 1) is read for every
        block. Both branches hold a whole softmax, so the wait that follows a call starts a basic block of its own
        and ptxas cannot hoist it above the exponentials."""
        b = 0.0
        # A float attn_mask is added here only after a softcap; without one it is already in s (_issue_scores).
        BIAS_MOD: gl.constexpr = cfg.BIAS if cfg.SOFTCAP else cfg.BIAS & 2
        if BIAS_MOD == 1:
            b = _read_bias(cfg, smem, bc, s, rows.part, True)
            bc += 1
        s = _score_mod(s, col0, rows.arow, rows.slope, mods.pre_scale, b, mods.mod_unit, cfg.SOFTCAP,
                       cfg.HAS_ALIBI, BIAS_MOD)
        KEEP_NEG_INF: gl.constexpr = cfg.MASK_LEFT | (cfg.BIAS != 0)
        if mask:
            keep = _visible(s, rows.row, col0, rows.seqlen_k, rows.diag_offset, rows.left_offset, cfg.MASK_RIGHT,
                            cfg.MASK_LEFT)
            if cfg.BIAS == 2:
                keep = keep & (_read_bias(cfg, smem, bc, s, rows.part, True) != 0)
                bc += 1
            p, alpha, m_n, l_n = _softmax_core(gl.where(keep, s, float("-inf")), m_i, l_i, mods.qk_scale,
                                               KEEP_NEG_INF)
        else:
            p, alpha, m_n, l_n = _softmax_core(s, m_i, l_i, mods.qk_scale, KEEP_NEG_INF)
        return p, alpha, m_n, l_n, bc

    @gluon.jit
    def _visible(s, row, col0, seqlen_k, diag_offset, left_offset, MASK_RIGHT: gl.constexpr,
                 MASK_LEFT: gl.constexpr):
        """Which scores of the block at columns col0 + (0 .. BLOCK_N-1) a row sees: Sk and the band (MASK_RIGHT:
        the right bound i + diag_offset; MASK_LEFT: the left bound i + left_offset). The block-relative column is
        compared with one limit per row (the row's last visible key, relative to the block): one compare per
        score."""
        rel = gl.arange(0, s.shape[1], layout=gl.SliceLayout(0, s.type.layout))
        if MASK_RIGHT:
            lim = gl.minimum(row + diag_offset, seqlen_k - 1) - col0
            keep = gl.expand_dims(rel, 0) <= gl.expand_dims(lim, 1)
        else:
            keep = gl.expand_dims(rel, 0) < gl.expand_dims(gl.full_like(row, seqlen_k) - col0, 1)
        if MASK_LEFT:
            keep = keep & (gl.expand_dims(rel, 0) >= gl.expand_dims(row + left_offset - col0, 1))
        return keep

    @gluon.jit
    def _lazy_exp(cfg, mods, rows, s, m_i, col0, mask):
        """The exponentials of one block against the row's current reference m_i, with no row maximum and no
        rescale (LAZY; docs/derivation.md ch. 3 holds for any reference, not only the running maximum): returns
        P = exp2(qk_scale s - m_i) and its row sums. Unless a row's new scores exceed m_i by more than
        log2(LAZY_LIMIT), every P is at most LAZY_LIMIT and the sums say so; the caller checks them and redoes
        the block with the maximum (_softmax_step) when one does not hold."""
        # (LAZY runs without ALiBi, a left window or an attn_mask: the softcap is the only modification.)
        s = _score_mod(s, col0, 0.0, 0.0, mods.pre_scale, 0.0, mods.mod_unit, cfg.SOFTCAP, False, 0)
        # m_i is finite: without a left bound or an attn_mask the state never keeps -inf (_softmax_core), and a
        # row that saw no key in its first block sees none here either.
        ref = gl.expand_dims(m_i, 1)
        if mask:
            keep = _visible(s, rows.row, col0, rows.seqlen_k, rows.diag_offset, 0, cfg.MASK_RIGHT, False)
            p = gl.exp2(gl.where(keep, s, float("-inf")) * mods.qk_scale - ref)
        else:
            p = gl.exp2(s * mods.qk_scale - ref)
        return p, gl.sum(p, 1)

    @gluon.jit
    def _wg_max(x, buf):
        """The maximum of a warpgroup's row values x ([64], 16 rows per warp), in every thread, through buf (4
        floats of shared memory, not in use by the previous call: callers alternate two) and one barrier: each
        warp's maximum (shuffles), stored, then all four read back. (gl.max over x would use two barriers.)"""
        w = gl.max(gl.reshape(x, [4, x.shape[0] // 4]), 1)
        buf.store(w)
        thread_barrier()
        layout: gl.constexpr = gl.BlockedLayout([4], [32], [4], [0])
        return gl.max(buf.load(layout), 0)

    @gluon.jit
    def _issue_s(smem, q, i, s_buf, USE_ACC: gl.constexpr, CHUNKS: gl.constexpr = 1, NARROW: gl.constexpr = False):
        """Issue S = Q K_i^T for the program's block i (the K ring's i-th use) into the registers of s_buf:
        S = s_buf + Q K_i^T with USE_ACC, else s_buf's values are not read. CHUNKS > 1: q and the K slot are
        _tile_views of column chunks (q's may be in registers: FwdConfig.Q_REGS); their products add up. NARROW (d96 on
        128-column tiles, FwdConfig.NARROW_QK): over the first 96 columns, as two products (64 and 32)."""
        slot = smem.k_bar.wait_full(i)
        if CHUNKS == 1:
            if NARROW:
                return mma_over_96(q, smem.k.index(slot), s_buf, USE_ACC)
            else:
                return warpgroup_mma(q, smem.k.index(slot).permute((1, 0)), s_buf, use_acc=USE_ACC, is_async=True)
        else:
            rows: gl.constexpr = s_buf.shape[0]
            keys: gl.constexpr = s_buf.shape[1]
            k = _tile_view(smem.k, slot, CHUNKS)
            s = warpgroup_mma(_chunk(q, 0, rows, CHUNKS), _chunk(k, 0, keys, CHUNKS).permute((1, 0)), s_buf,
                              use_acc=USE_ACC, is_async=True)
            for ch in gl.static_range(1, CHUNKS):
                s = warpgroup_mma(_chunk(q, ch, rows, CHUNKS), _chunk(k, ch, keys, CHUNKS).permute((1, 0)), s,
                                  use_acc=True, is_async=True)
            return s

    @gluon.jit
    def _issue_scores(cfg, smem, q, i, s_zero, bc, part: gl.constexpr):
        """_issue_s, except that a float attn_mask without softcap starts the accumulator at its tile (read here,
        the next one in the ring, bc): the tensor cores add it, and the softmax, which bounds the loop, does not.
        Q was scaled by the softmax scale for this path (_scale_q), so the tile needs no multiply: only its
        widening. Returns (the product's token, bc)."""
        if cfg.BIAS == 1 and not cfg.SOFTCAP:
            b = _read_bias(cfg, smem, bc, s_zero, part, False)
            tok = _issue_s(smem, q, i, to_float32(b), True, cfg.QK_CHUNKS, cfg.NARROW_QK)
            # The product's issue needed the tile in registers: its read is complete, the slot may be refilled.
            smem.b_bar.release(bc)
            return tok, bc + 1
        else:
            return _issue_s(smem, q, i, s_zero, False, cfg.QK_CHUNKS, cfg.NARROW_QK), bc

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
        thread_barrier()

    @gluon.jit
    def _issue_pv(smem, p, i, acc, alpha, RESCALE: gl.constexpr = True, V_SPLIT: gl.constexpr = False):
        """Rescale O by the alpha of P's block (RESCALE), then issue O += P V_i (the V ring's i-th use; float8 P:
        the slot holds V_i transposed, _load_vt). V_SPLIT: O is d192's pair of accumulators
        (FwdConfig.V_SPLIT), and the two products, of V's columns below V_LO and the V_HI after, return a pair of
        tokens."""
        if V_SPLIT:
            if RESCALE:
                acc = _split_times(acc, alpha)
            v = smem.v.index(smem.v_bar.wait_full(i))
            lo, hi = acc
            V_LO: gl.constexpr = lo.shape[1]
            return (warpgroup_mma(p, v.slice(0, V_LO, dim=1), lo, is_async=True),
                    warpgroup_mma(p, v.slice(V_LO, hi.shape[1], dim=1), hi, is_async=True))
        else:
            if RESCALE:
                acc = acc * gl.expand_dims(gl.convert_layout(alpha, gl.SliceLayout(1, acc.type.layout)), 1)
            slot = smem.v_bar.wait_full(i)
            if p.dtype.primitive_bitwidth == 8:
                return warpgroup_mma(p, smem.v.index(slot).permute((1, 0)), acc, is_async=True)
            else:
                return warpgroup_mma(p, smem.v.index(slot), acc, is_async=True)

    @gluon.jit
    def _split_times(acc, f):
        """The pair of accumulators of FwdConfig.V_SPLIT, each row times f (per row)."""
        lo, hi = acc
        return (lo * gl.expand_dims(gl.convert_layout(f, gl.SliceLayout(1, lo.type.layout)), 1),
                hi * gl.expand_dims(gl.convert_layout(f, gl.SliceLayout(1, hi.type.layout)), 1))

    @gluon.jit
    def _retire_split_pv(acc_tok, p):
        """V_SPLIT: wait for every product issued, P V's two last (p: their register operand, kept alive until
        then): (O's pair of accumulators, p)."""
        lo, hi, p = warpgroup_mma_wait(0, deps=(acc_tok[0], acc_tok[1], p))
        return (lo, hi), p

    @gluon.jit
    def _read_bias(cfg, smem, i, s, part: gl.constexpr, RELEASE: gl.constexpr):
        """This warpgroup's attn_mask tile of the program's i-th tile (the ring's i-th use), in the layout of the
        scores s (0.0: no attn_mask). RELEASE: hand the slot back to the producer here, behind a proxy fence;
        otherwise the caller releases it once an instruction has consumed the tile.

        The fence matters: the tile is read by the generic proxy and the slot refilled by TMA (the async proxy),
        and the warpgroup barrier before the arrive does not order the two. In a trial where the producer refilled
        sooner (the tile loaded before K and prefetched into L2), releasing without the fence read the next
        tile's values into some rows in 6-10 of 12 runs on an H100 (docs/design-record.md, "The bias ring's
        release")."""
        if cfg.BIAS != 0:
            slot = smem.b_bar.wait_full(i)
            b = smem.b.index(slot * cfg.NUM_WG + part).load(s.type.layout)
            if RELEASE:
                fence_async_shared()
                mbarrier.arrive(smem.b_bar.empty.index(slot), count=1)
            return b
        else:
            return 0.0

    @gluon.jit
    def _drop(p, row, col0, drop):
        """Dropout on a block's probabilities P (queries `row`, keys from col0), after their row sums went into l:
        the dropped ones become 0 (the epilogue divides O by l (1 - p)); the bits are _gluon.dropout_bits'."""
        keep = dropout_tile_keep(row, col0, drop.seed, drop.bh, drop.threshold, p.shape[1], False)
        return gl.where(keep, p, 0.0)

    @gluon.jit
    def _block_mask(cfg, rows, j):
        """The item's j-th key block and whether it is masked: it lies below full_lo or from n_full on, or (a bool
        attn_mask) it has a mask tile."""
        blk, partial = _block_at(rows.j_lo, j, rows.idx_row, cfg.BIAS == 2)
        mask = j >= rows.n_full
        if cfg.MASK_LEFT:
            mask = mask | (j < rows.full_lo)
        if cfg.BIAS == 2:
            mask = partial
        return blk, mask

    @gluon.jit
    def _finish_step(cfg, smem, mods, rows, drop, q, s_tok, s_zero, j, c, bc, p_prev, alpha_prev, acc, m_i, l_i):
        """Step j >= 1 with S_j issued and nothing after it: issue P_{j-1} V_{j-1}, softmax(S_j) while it runs,
        retire it. In P_{j-1} and its alpha, out P_j and its alpha (and the attn_mask tile count); O then holds
        P_{<j} V_{<j}.

        LAZY (no attn_mask): the block's exponentials are taken against the rows' current reference m_i
        (_lazy_exp), so the step has no row maximum and O no rescale. Once P_{j-1} V_{j-1} is retired, the
        warpgroup agrees on its largest row sum (_wg_max). If it passes LAZY_LIMIT (LAZY_LIMIT_FP8 under FP8; some
        row's scores grew past m_i + log2 of it: P would lose range in fp16 or float8, or overflow), it issues S_j
        again (K_j's slot is released only after the check) and takes the usual softmax step, rescaling O there; the
        next P V never rescales.

        DEFER (bfloat16, where P keeps fp32's range): no check and no barrier, so P_{j-1} V_{j-1} runs on through this
        softmax as it does without LAZY. l_i then bounds every P the part took: the item's end flags the part for
        the launch's redo pass when it passes DEFER_LIMIT (_flag_redo), and that pass takes the maximum at every step
        (rows.redo)."""
        acc_tok = _issue_pv(smem, p_prev, c + j - 1, acc, alpha_prev, not cfg.LAZY, cfg.V_SPLIT)
        # wgmma groups retire in issue order: one left outstanding (two: V_SPLIT's two products) means S_j is
        # done (however many products it took), P_{j-1} V_{j-1} may not be.
        if cfg.Q_REGS:
            # (Q's registers stay alive until the product that reads them is done.)
            s, q0, q1, q2 = warpgroup_mma_wait(2, deps=(s_tok, q[0], q[1], q[2]))
        else:
            s = warpgroup_mma_wait(1, deps=(s_tok, ))
        if not cfg.LAZY or cfg.DEFER:
            smem.k_bar.release(c + j)
        blk, mask = _block_mask(cfg, rows, j)
        if cfg.DEFER:
            if rows.redo:
                # The redo pass: the usual step with the row maximum; O is rescaled once P_{j-1} V_{j-1} is retired
                # (LAZY's products never rescale at issue).
                p, alpha, m_i, l_i, bc = _softmax_step(cfg, smem, mods, rows, s, m_i, l_i, blk * cfg.BLOCK_N, mask,
                                                       bc)
                if cfg.V_SPLIT:
                    acc, p_prev = _retire_split_pv(acc_tok, p_prev)
                    acc = _split_times(acc, alpha)
                else:
                    acc, p_prev = warpgroup_mma_wait(0, deps=(acc_tok, p_prev))
                    acc = acc * gl.expand_dims(gl.convert_layout(alpha, gl.SliceLayout(1, acc.type.layout)), 1)
            else:
                # Against the rows' reference, unchecked: the item's end flags a part whose sum left range.
                p, l_blk = _lazy_exp(cfg, mods, rows, s, m_i, blk * cfg.BLOCK_N, mask)
                l_i = l_i + l_blk
                alpha = alpha_prev  # not read: DEFER's first pass never rescales
                if cfg.V_SPLIT:
                    acc, p_prev = _retire_split_pv(acc_tok, p_prev)
                else:
                    acc, p_prev = warpgroup_mma_wait(0, deps=(acc_tok, p_prev))
        elif cfg.LAZY:
            p, l_blk = _lazy_exp(cfg, mods, rows, s, m_i, blk * cfg.BLOCK_N, mask)
            # FP8's 256-key blocks (EARLY): P goes to its buffer once the previous P V is done, before the check, so
            # the block's fp32 exponentials are not kept through it (beside O they spilled); a redone block stores its
            # own P over it. No float8 tensor crosses the branches' join (its bytes would be unpacked and repacked).
            EARLY: gl.constexpr = cfg.FP8 and not cfg.DROPOUT and cfg.BLOCK_N == FP8_WIDE_BLOCK_N
            alpha = alpha_prev  # not read: LAZY never rescales at issue
            if cfg.V_SPLIT:
                acc, p_prev = _retire_split_pv(acc_tok, p_prev)
            else:
                acc, p_prev = warpgroup_mma_wait(0, deps=(acc_tok, p_prev))
            if EARLY:
                # (_store_p without its barrier: _wg_max's, just below, orders every warp's store before the product.)
                smem.p.index(rows.part).store(_key_order(p).to(cfg.dtype))
                fence_async_shared()
            # (A NaN sum, from NaN inputs, stays on this path as it would through the maximum.)
            big = _wg_max(l_blk, smem.flag.index(rows.part * 2 + (c + j) % 2))
            if cfg.FP8:
                limit = LAZY_LIMIT_FP8
            else:
                limit = LAZY_LIMIT
            if big > limit:
                s_tok = _issue_s(smem, q, c + j, s_zero, False, cfg.QK_CHUNKS, cfg.NARROW_QK)
                s = warpgroup_mma_wait(0, deps=(s_tok, ))
                p_r, alpha, m_i, l_i, bc = _softmax_step(cfg, smem, mods, rows, s, m_i, l_i, blk * cfg.BLOCK_N,
                                                         mask, bc)
                if cfg.V_SPLIT:
                    acc = _split_times(acc, alpha)
                else:
                    acc = acc * gl.expand_dims(gl.convert_layout(alpha, gl.SliceLayout(1, acc.type.layout)), 1)
                if EARLY:
                    _store_p(smem, _key_order(p_r).to(cfg.dtype), rows.part)
                else:
                    p = p_r
            else:
                l_i = l_i + l_blk
            smem.k_bar.release(c + j)
            if EARLY:
                smem.v_bar.release(c + j - 1)
                return smem.p.index(rows.part), alpha, acc, m_i, l_i, bc
        else:
            p, alpha, m_i, l_i, bc = _softmax_step(cfg, smem, mods, rows, s, m_i, l_i, blk * cfg.BLOCK_N, mask, bc)
            if cfg.V_SPLIT:
                acc, p_prev = _retire_split_pv(acc_tok, p_prev)
            else:
                acc, p_prev = warpgroup_mma_wait(0, deps=(acc_tok, p_prev))
        smem.v_bar.release(c + j - 1)
        if cfg.DROPOUT:
            p = _drop(p, rows.row, blk * cfg.BLOCK_N, drop)
        p = _stage_p(cfg, smem, p, rows.part)
        return p, alpha, acc, m_i, l_i, bc

    @gluon.jit
    def _stage_p(cfg, smem, p, part: gl.constexpr):
        """P in the inputs' dtype as the A operand of P V: in registers (dot_a), or under FP8 in this warpgroup's
        shared buffer, which the previous P V has finished reading (every step retires its own). As a register
        operand float8 P ran 0.79-0.90x this (retired at once, or in flight through the next softmax: the permutes
        into the operand's key order cost more than the store; docs/design-record.md, "The FP8 forward")."""
        if cfg.FP8:
            return _store_p(smem, _key_order(p).to(cfg.dtype), part)
        else:
            return gl.convert_layout(p.to(cfg.dtype), cfg.dot_a)

    @gluon.jit
    def _store_p(smem, p, part: gl.constexpr):
        """FP8: P, already float8 in the buffer's key order (_key_order), into this warpgroup's buffer: returns it."""
        buf = smem.p.index(part)
        buf.store(p)
        # The product reads P through the async proxy, issued once every warp of the warpgroup has stored.
        fence_async_shared()
        thread_barrier()
        return buf

    @gluon.jit
    def _key_order(p):
        """FP8: a block's P with its columns in the key order of V's transposed copy (_vt_keys): column 8 i + 2 q + e
        (the wgmma accumulator's thread q = lane % 4 holds columns 2 q and 2 q + 1 of each group i of 8) goes to
        BLOCK_N / 4 q + 2 i + e. A thread's values of a row are then contiguous, and the store into P's buffer
        takes two 16-byte stores per row instead of one 2-byte store per pair (32 per thread at d128). P V sums over
        the keys, so the same order on both sides leaves it unchanged. Only the registers' names change."""
        rows: gl.constexpr = p.shape[0]
        n: gl.constexpr = p.shape[1]
        return gl.reshape(gl.permute(gl.reshape(p, [rows, n // 8, 4, 2]), [0, 2, 1, 3]), [rows, n])

    @gluon.jit
    def _last_pv(smem, p, i, acc, alpha, RESCALE: gl.constexpr, V_SPLIT: gl.constexpr = False):
        """The work item's last P V (block i), retired at once: the epilogue needs O."""
        if V_SPLIT:
            acc, p = _retire_split_pv(_issue_pv(smem, p, i, acc, alpha, RESCALE, True), p)
        else:
            acc_tok = _issue_pv(smem, p, i, acc, alpha, RESCALE)
            acc, p = warpgroup_mma_wait(0, deps=(acc_tok, p))
        smem.v_bar.release(i)
        return acc

    @gluon.jit
    def _tile_blocks(cfg, smem, mods, rows, drop, q, q_empty, c, bc, n_blocks, acc, m_i, l_i, s_zero):
        """All key blocks of one work item (n_blocks >= 1) for one warpgroup: returns O (unnormalized), m, l and
        the attn_mask tile count bc."""
        if cfg.Q_REGS:
            # The query tile's chunks into registers, once for all the item's products; its buffer goes back to
            # the producer at once (behind a proxy fence: TMA refills what the generic proxy read).
            dl: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=cfg.s_layout, k_width=2)
            q = (q[0].load(dl), q[1].load(dl), q[2].load(dl))
            fence_async_shared()
            mbarrier.arrive(q_empty, count=1)
        s_tok, bc = _issue_scores(cfg, smem, q, c, s_zero, bc, rows.part)
        s = warpgroup_mma_wait(0, deps=(s_tok, ))
        smem.k_bar.release(c)
        # Step 0: the first block's scores and softmax; nothing to multiply into V yet.
        blk, mask = _block_mask(cfg, rows, 0)
        p, alpha, m_i, l_i, bc = _softmax_step(cfg, smem, mods, rows, s, m_i, l_i, blk * cfg.BLOCK_N, mask, bc)
        if cfg.DROPOUT:
            p = _drop(p, rows.row, blk * cfg.BLOCK_N, drop)
        p = _stage_p(cfg, smem, p, rows.part)
        for j in range(1, n_blocks):
            s_tok, bc = _issue_scores(cfg, smem, q, c + j, s_zero, bc, rows.part)
            p, alpha, acc, m_i, l_i, bc = _finish_step(cfg, smem, mods, rows, drop, q, s_tok, s_zero, j, c, bc, p,
                                                       alpha, acc, m_i, l_i)
        # Every Q K^T of this tile is done: the producer may load the next query tile.
        if not cfg.Q_REGS:
            mbarrier.arrive(q_empty, count=1)
        # Last step: P_{n-1} V_{n-1}.
        # (LAZY: O was rescaled where a step took the maximum, and is 0 after step 0.)
        acc = _last_pv(smem, p, c + n_blocks - 1, acc, alpha, not cfg.LAZY, cfg.V_SPLIT)
        return acc, m_i, l_i, bc

    @gluon.jit
    def _skip_blocks(cfg, smem, rows, q_empty, c, bc, n_blocks):
        """A warpgroup whose rows all lie past Sq (the last query tile) computes nothing: it only follows the ring,
        releasing each K (and attn_mask tile) and V block once loaded, in the producer's order (K_j, then
        V_{j-1}). Returns the attn_mask tile count."""
        for j in range(n_blocks):
            i = c + j
            smem.k_bar.wait_full(i)
            smem.k_bar.release(i)
            if cfg.BIAS != 0:
                blk, partial = _block_at(rows.j_lo, j, rows.idx_row, cfg.BIAS == 2)
                if partial:
                    smem.b_bar.wait_full(bc)
                    smem.b_bar.release(bc)
                    bc += 1
            if j > 0:
                smem.v_bar.wait_full(i - 1)
                smem.v_bar.release(i - 1)
        mbarrier.arrive(q_empty, count=1)
        if n_blocks > 0:
            i = c + n_blocks - 1
            smem.v_bar.wait_full(i)
            smem.v_bar.release(i)
        return bc

    @gluon.jit
    def _follow_blocks(smem, c, n):
        """A warpgroup's part of n key blocks, from the ring's c-th use on, that hold no key its rows see (TAIL):
        each K and V slot released once loaded, in the producer's order, nothing computed."""
        for j in range(n):
            smem.k_bar.wait_full(c + j)
            smem.k_bar.release(c + j)
            smem.v_bar.wait_full(c + j)
            smem.v_bar.release(c + j)

    @gluon.jit
    def _stage_o(o, o_buf, o_desc, i_b, row0, i_h):
        """Store a warpgroup's output rows through its staging buffer by TMA (rows past the descriptor's end are
        clipped); the previous store from the buffer must have read it first."""
        tma.store_wait(pendings=0)
        o_buf.store(o)
        fence_async_shared()
        tma_store(o_desc, [i_b, row0, i_h, 0], o_buf.reshape([1, o_buf.shape[0], 1, o_buf.shape[1]]))

    @gluon.jit
    def _store_o(out, o, item, row, o_layout: gl.constexpr, PAD_D: gl.constexpr, COL0: gl.constexpr = 0,
                 CHUNKS: gl.constexpr = False):
        """Store a warpgroup's output rows (those below the item's seqlen_q) from registers, o's columns from
        column COL0 on; PAD_D: of their columns only those below the head dim (TILE_DIM pads d96 and d192 tiles
        to d128 and d256; out is contiguous, so its head stride is the head dim). CHUNKS (FwdConfig.CHUNK_O): a
        16-bit tile goes in 64-column chunks through _gluon.row_pieces_layout (_store_o_chunk)."""
        if CHUNKS and o.dtype.primitive_bitwidth == 16 and o.shape[1] >= 64:
            if o.shape[1] == 64:
                _store_o_chunk(out, o, item, row, PAD_D, COL0)
            else:
                # Column c = 64 j + i of the tile to (i, j) and split along j (both halves are in every lane).
                _store_o_halves(out, o, item, row, PAD_D, COL0)
        else:
            _store_o_cols(out, o, item, row, o_layout, PAD_D, COL0)

    @gluon.jit
    def _store_o_halves(out, o, item, row, PAD_D: gl.constexpr, COL0: gl.constexpr):
        """_store_o of a tile of 128 or 256 columns: its two column halves, each in 64-column chunks."""
        HALF: gl.constexpr = o.shape[1] // 2
        lo, hi = o.reshape([o.shape[0], 2, HALF]).permute((0, 2, 1)).split()
        if HALF == 64:
            _store_o_chunk(out, lo, item, row, PAD_D, COL0)
            _store_o_chunk(out, hi, item, row, PAD_D, COL0 + 64)
        else:
            a, b = lo.reshape([o.shape[0], 2, 64]).permute((0, 2, 1)).split()
            _store_o_chunk(out, a, item, row, PAD_D, COL0)
            _store_o_chunk(out, b, item, row, PAD_D, COL0 + 64)
            c, d = hi.reshape([o.shape[0], 2, 64]).permute((0, 2, 1)).split()
            _store_o_chunk(out, c, item, row, PAD_D, COL0 + HALF)
            _store_o_chunk(out, d, item, row, PAD_D, COL0 + HALF + 64)

    @gluon.jit
    def _store_o_chunk(out, o, item, row, PAD_D: gl.constexpr, COL0: gl.constexpr):
        """_store_o of 64 columns from COL0, through shared memory (the conversion's 8 KB of scratch) into a layout
        whose warp stores write whole 16-byte pieces of consecutive columns."""
        layout: gl.constexpr = row_pieces_layout(64)
        _store_o_cols(out, gl.convert_layout(o, layout), item, row, layout, PAD_D, COL0)

    @gluon.jit
    def _store_o_cols(out, o, item, row, layout: gl.constexpr, PAD_D: gl.constexpr, COL0: gl.constexpr):
        """The stores of _store_o: o (in layout) at the output's columns COL0 on, rows below seqlen_q (PAD_D:
        columns below the head dim)."""
        o_rows = gl.convert_layout(row, gl.SliceLayout(1, layout))
        o_cols = gl.arange(0, o.shape[1], layout=gl.SliceLayout(0, layout)) + COL0
        o_ptr = (out.Out + item.i_b.to(gl.int64) * out.stride_ob + item.i_h.to(gl.int64) * out.stride_oh
                 + gl.expand_dims((item.q_start + o_rows).to(gl.int64) * out.stride_os, 1) + gl.expand_dims(o_cols, 0))
        mask = gl.expand_dims(o_rows < item.seqlen_q, 1)
        if PAD_D:
            mask = mask & gl.expand_dims(o_cols < out.stride_oh, 0)
        gl.store(o_ptr, o, mask=mask)

    @gluon.jit
    def _consumer_item(prog, tile, it):
        """The work item `tile`, as the consumers see it: under VARLEN the fields the producer handed over
        (_hand_over), else the item's coordinates."""
        cfg = prog.cfg
        band = prog.band
        if cfg.VARLEN:
            # The item's row from the producer (_varlen_item): its sequence's bounds and own offsets.
            base = (it % cfg.QBUF) * ITEM_FIELDS
            i_b = _read_tile(prog.smem.tile.index(base + 1))
            start_m = _read_tile(prog.smem.tile.index(base + 2))
            q_start = _read_tile(prog.smem.tile.index(base + 3))
            seqlen_q = _read_tile(prog.smem.tile.index(base + 4))
            seqlen_k = _read_tile(prog.smem.tile.index(base + 5))
            i_h = _read_tile(prog.smem.tile.index(base + 6))
            offset = seqlen_k - seqlen_q
            t_b = 0
        else:
            start_m, i_b, i_h = _tile_coords(prog.work, tile, cfg.BLOCK_M, cfg.MASK_RIGHT | (cfg.BIAS == 2))
            q_start = 0
            seqlen_q = band.seqlen_q
            seqlen_k = band.seqlen_k
            offset = 0
            t_b = i_b
        return FwdItem(start_m, i_b, i_h, t_b, q_start, seqlen_q, 0, seqlen_k, offset, band.diag_offset + offset,
                       band.left_offset + offset)

    @gluon.jit
    def _item_rows(prog, item, part: gl.constexpr):
        """Warpgroup `part`'s rows of the item (FwdRows) and the item's block count."""
        cfg = prog.cfg
        j_lo, n_blocks, idx_row = _item_blocks(cfg, prog.lists, item)
        row_start = item.start_m + part * cfg.PART_M
        row = row_start + gl.arange(0, cfg.PART_M, layout=cfg.row_layout)
        # Blocks from full_lo to below n_full (counted from the item's first block) are visible to every row of
        # this part and lie inside Sk: no mask there.
        n_full = item.seqlen_k // cfg.BLOCK_N
        if cfg.MASK_RIGHT:
            n_full = gl.minimum(n_full, gl.maximum(row_start + item.diag_offset + 1, 0) // cfg.BLOCK_N)
        n_full -= j_lo
        full_lo = 0
        if cfg.MASK_LEFT:
            full_lo = gl.cdiv(gl.maximum(row_start + cfg.PART_M - 1 + item.left_offset, 0), cfg.BLOCK_N) - j_lo
        # ALiBi (_score_mod): the slope in score units and i + a per row.
        slope = 0.0
        arow = gl.zeros([cfg.PART_M], gl.float32, layout=cfg.row_layout)
        if cfg.HAS_ALIBI:
            mods = prog.mods
            slope = gl.load(mods.Alibi + item.i_b * mods.stride_alibi_b + item.i_h) * mods.mod_unit
            arow = (row + (mods.alibi_offset + item.offset)).to(gl.float32)
        rows = FwdRows(row_start, row, item.seqlen_k, item.diag_offset, item.left_offset, j_lo, n_full, full_lo,
                       idx_row, arow, slope, part, cfg.REDO)
        return rows, n_blocks

    @gluon.jit
    def _consume_item(prog, item, rows, q, qb, c, bc, n_blocks, s_zero, seed, tile):
        """One warpgroup's work on one item whose rows start below Sq (its query tile in buffer qb): all its
        blocks, then the epilogue (O = acc / l, after the sinks and dropout's 1 / (1 - p), and the rows' LSE,
        stored). Returns the attn_mask tile count. (The epilogue stays in this function: as a function of its own
        it moved ptxas's schedule of a few variants, whose debug scopes change with it.)"""
        cfg = prog.cfg
        m_i = gl.full([cfg.PART_M], float("-inf"), gl.float32, layout=cfg.row_layout)
        l_i = gl.zeros([cfg.PART_M], gl.float32, layout=cfg.row_layout)
        if cfg.V_SPLIT:
            acc = (gl.zeros([cfg.PART_M, cfg.V_LO], gl.float32, layout=cfg.o_layout),
                   gl.zeros([cfg.PART_M, cfg.V_HI], gl.float32, layout=cfg.o_layout_b))
        else:
            acc = gl.zeros([cfg.PART_M, cfg.HEAD_DIM_V], gl.float32, layout=cfg.o_layout)
        mods = prog.mods
        v_factor = 1.0
        if cfg.FP8:
            mods, v_factor, q_sign = _fp8_item(prog, item)
        # TAIL (key blocks narrower than the tile under a causal band: d192, d256): the item's last blocks may lie
        # wholly past this warpgroup's last row's right bound. It computes only the blocks its rows see (n_own,
        # possibly none: Sq > Sk) and follows the ring through the rest (_follow_blocks).
        TAIL: gl.constexpr = cfg.MASK_RIGHT and cfg.BLOCK_N < cfg.BLOCK_M and cfg.BIAS == 0
        n_own = n_blocks
        if TAIL:
            last = gl.maximum(gl.minimum(rows.seqlen_k, rows.row_start + cfg.PART_M + rows.diag_offset), 0)
            n_own = gl.minimum(n_blocks, gl.maximum(gl.cdiv(last, cfg.BLOCK_N) - rows.j_lo, 0))
        if n_own > 0:
            if cfg.BIAS == 1 and not cfg.SOFTCAP:
                _scale_q(q, prog.mods.pre_scale)
            if cfg.FP8:
                if q_sign != 1.0:
                    _scale_q(q, q_sign)  # (rare) a negative or zero product of q's and k's factors
            q_empty = prog.smem.q_bar.empty.index(qb)
            drop = Dropout(seed, item.i_b * prog.work.num_heads + item.i_h, prog.mods.drop_threshold)
            acc, m_i, l_i, bc = _tile_blocks(cfg, prog.smem, mods, rows, drop, q, q_empty, c, bc, n_own, acc,
                                             m_i, l_i, s_zero)
            if cfg.DEFER:
                _flag_redo(prog.out, tile, l_i, rows.redo)
        else:
            mbarrier.arrive(prog.smem.q_bar.empty.index(qb), count=1)
        if TAIL:
            _follow_blocks(prog.smem, c + n_own, n_blocks - n_own)
        out = prog.out
        if cfg.HAS_SINKS:
            # The head's sink logit joins the denominator (docs/derivation.md#8): one more term, exp(sink - m),
            # and m grows to cover it. A row that saw no key then outputs 0 and has LSE = sink.
            sink = gl.load(prog.mods.Sinks + item.i_h) * LOG2E
            m_fin = gl.maximum(m_i, sink)
            # A row that saw no key with a sink of -inf keeps m = -inf: subtract 0 there (-inf - -inf is NaN).
            m_sub = gl.where(m_fin == float("-inf"), 0.0, m_fin)
            alpha = gl.exp2(m_i - m_sub)
            l_i = l_i * alpha + gl.exp2(sink - m_sub)
            if cfg.V_SPLIT:
                acc = _split_times(acc, alpha)
            else:
                acc = acc * gl.expand_dims(gl.convert_layout(alpha, gl.SliceLayout(1, cfg.o_layout)), 1)
            m_i = m_fin
        # A row that saw no key has l = 0: it outputs 0 and its LSE is -inf (as in kernels/forward.py).
        empty = l_i == 0.0
        l_safe = gl.where(empty, 1.0, l_i)
        lse = gl.where(empty, float("-inf"), (m_i + gl.log2(l_safe)) * LN2)
        if cfg.DROPOUT:
            l_safe = l_safe * prog.mods.drop_keep  # 1 - p: the kept probabilities are scaled by 1 / (1 - p)
        if cfg.FP8:
            # v's factor (any sign or 0) times the weighted sum: one multiply per row, with the division.
            acc = acc * gl.expand_dims(gl.convert_layout(v_factor / l_safe, gl.SliceLayout(1, cfg.o_layout)), 1)
        elif cfg.V_SPLIT:
            acc = _split_times(acc, 1.0 / l_safe)
        else:
            acc = acc / gl.expand_dims(gl.convert_layout(l_safe, gl.SliceLayout(1, cfg.o_layout)), 1)
        # (Varlen: lse is [H, total_q], stride_lb 0; the sequence's rows start at q_start.)
        lse_base = (out.Lse + item.i_b.to(gl.int64) * out.stride_lb + item.i_h.to(gl.int64) * out.stride_lh
                    + item.q_start)
        gl.store(lse_base + rows.row, lse, mask=rows.row < item.seqlen_q)
        if cfg.V_SPLIT:
            # (d192 stores from registers: the plan gives it no staging buffer, _fwd_plan.)
            gl.static_assert(not cfg.STAGE_O)
            dtype: gl.constexpr = out.Out.dtype.element_ty
            # (Columns 128-191: those past the head dim masked, d136-d184 taking d192's path.)
            _store_o(out, acc[0].to(dtype), item, rows.row, cfg.o_layout, False, 0, cfg.CHUNK_O)
            _store_o(out, acc[1].to(dtype), item, rows.row, cfg.o_layout_b, cfg.PAD_D, cfg.V_LO, cfg.CHUNK_O)
        elif cfg.STAGE_O:
            if cfg.VARLEN:
                # A descriptor clips rows past Sq, but under VARLEN the rows past a sequence's end belong to the
                # next one: a part that runs past it is stored from registers.
                if rows.row_start + cfg.PART_M <= item.seqlen_q:
                    _stage_o(acc.to(cfg.dtype), prog.smem.o.index(rows.part), out.o_desc, item.t_b,
                             item.q_start + rows.row_start, item.i_h)
                else:
                    _store_o(out, acc.to(out.Out.dtype.element_ty), item, rows.row, cfg.o_layout, cfg.PAD_D, 0,
                             cfg.CHUNK_O)
            else:
                _stage_o(acc.to(cfg.dtype), prog.smem.o.index(rows.part), out.o_desc, item.t_b,
                         item.q_start + rows.row_start, item.i_h)
        else:
            # No staging buffer (its shared memory holds attn_mask tiles, or out is float32: distributed/_local.py).
            _store_o(out, acc.to(out.Out.dtype.element_ty), item, rows.row, cfg.o_layout, cfg.PAD_D, 0, cfg.CHUNK_O)
        return bc

    @gluon.jit
    def _fp8_item(prog, item):
        """FP8: the scores' modifications of one item with the product f of q's and k's factors of its (batch
        entry, kv head) in qk_scale, v's factor, and the sign the query tile takes (mods.Descale: fp32 [B, Hk, 3]).
        The softmax takes the row maximum before scaling, so the scale must be positive: a negative f moves its
        sign into the tile and a zero one zeroes it under a unit factor (every score 0), both exact in float8."""
        mods = prog.mods
        num_kv_heads = prog.work.num_heads // prog.producer.group_size
        p_factor = mods.Descale + (item.i_b.to(gl.int64) * num_kv_heads + item.i_h // prog.producer.group_size) * 3
        f = gl.load(p_factor) * gl.load(p_factor + 1)
        q_sign = gl.where(f > 0, 1.0, gl.where(f < 0, -1.0, 0.0))
        f = gl.where(f == 0, 1.0, gl.abs(f))
        return (FwdMods(mods.qk_scale * f, mods.Alibi, mods.stride_alibi_b, mods.alibi_offset, mods.mod_unit,
                        mods.pre_scale, mods.Sinks, mods.Seed, mods.drop_threshold, mods.drop_keep, mods.Descale),
                gl.load(p_factor + 2), q_sign)

    @gluon.jit
    def _softmax_partition(prog, part: gl.constexpr):
        """Consumer warpgroup `part`: walks the program's work items in the producer's order, each one's PART_M
        query rows from start_m + part * PART_M."""
        cfg = prog.cfg
        smem = prog.smem
        s_zero = gl.zeros([cfg.PART_M, cfg.BLOCK_N], gl.float32, layout=cfg.s_layout)
        c = 0  # blocks consumed so far by this program, counted as the producer counts them
        bc = 0  # attn_mask tiles read so far, likewise
        seed = 0
        if cfg.DROPOUT:
            seed = gl.load(prog.mods.Seed)  # the call's Philox key (int64), drawn on the device by the caller
        it = 0  # work items so far
        if cfg.HAND:
            # The producer writes each item's index before its query tile arrives, and n_tiles after the last.
            mbarrier.wait(smem.q_bar.full.index(0), 0)
            tile = _read_tile(smem.tile.index(0))  # (entry 0 of buffer 0 under VARLEN too)
        else:
            tile = gl.program_id(0)
        while tile < prog.work.n_tiles:
            item = _consumer_item(prog, tile, it)
            rows, n_blocks = _item_rows(prog, item, part)
            qb = it % cfg.QBUF
            q = _tile_view(smem.q, qb * cfg.NUM_WG + part, cfg.QK_CHUNKS)
            if not cfg.HAND:
                smem.q_bar.wait_full(it)
            if rows.row_start >= item.seqlen_q:
                # Every row of this part lies past Sq (the last query tile): follow the ring, compute nothing.
                bc = _skip_blocks(cfg, smem, rows, smem.q_bar.empty.index(qb), c, bc, n_blocks)
            else:
                bc = _consume_item(prog, item, rows, q, qb, c, bc, n_blocks, s_zero, seed, tile)
            c += n_blocks
            it += 1
            if cfg.HAND:
                qb = smem.q_bar.wait_full(it)
                tile = _read_tile(smem.tile.index(qb * (ITEM_FIELDS if cfg.VARLEN else 1)))
            else:
                tile += gl.num_programs(0)
        tma.store_wait(pendings=0)

    @gluon.jit
    def _fwd_smem(cfg, bias_desc):
        """Allocate the forward's shared memory (FwdSmem) and initialize its barriers."""
        layout: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128,
                                                    element_bitwidth=cfg.dtype.primitive_bitwidth, rank=2)
        # (Q's and K's column chunks, QK_CHUNKS > 1, take a buffer each: _tile_view.)
        q_smem = gl.allocate_shared_memory(cfg.dtype, [cfg.NUM_WG * cfg.QBUF * cfg.QK_CHUNKS, cfg.PART_M, cfg.QK_W],
                                           layout)
        k_smem = gl.allocate_shared_memory(cfg.dtype, [cfg.STAGES * cfg.QK_CHUNKS, cfg.BLOCK_N, cfg.QK_W], layout)
        if cfg.FP8:
            v_smem = gl.allocate_shared_memory(cfg.dtype, [cfg.STAGES, cfg.HEAD_DIM_V, cfg.BLOCK_N], layout)
        else:
            v_smem = gl.allocate_shared_memory(cfg.dtype, [cfg.STAGES, cfg.BLOCK_N, cfg.HEAD_DIM_V], layout)
        if cfg.STAGE_O:
            o_smem = gl.allocate_shared_memory(cfg.dtype, [cfg.NUM_WG, cfg.PART_M, cfg.HEAD_DIM_V], layout)
        else:
            o_smem = q_smem  # not read: the epilogue stores from registers
        if cfg.FP8:
            p_smem = gl.allocate_shared_memory(cfg.dtype, [cfg.NUM_WG, cfg.PART_M, cfg.BLOCK_N], layout)
        else:
            p_smem = q_smem  # not read: P stays in registers
        # Per query buffer, the item's index (dynamic schedule), and with VARLEN its fields (_hand_over).
        tile_smem = gl.allocate_shared_memory(gl.int32, [cfg.QBUF * ITEM_FIELDS if cfg.VARLEN else cfg.QBUF, 1],
                                              gl.SwizzledSharedLayout(1, 1, 1, [0]))
        if cfg.LAZY:
            # The warpgroup maxima of _wg_max: two buffers of 4 floats per consumer warpgroup.
            flag_smem = gl.allocate_shared_memory(gl.float32, [2 * cfg.NUM_WG, 4],
                                                  gl.SwizzledSharedLayout(1, 1, 1, [0]))
        else:
            flag_smem = tile_smem  # not read
        q_full = gl.allocate_shared_memory(gl.int64, [cfg.QBUF, 1], mbarrier.MBarrierLayout())
        q_empty = gl.allocate_shared_memory(gl.int64, [cfg.QBUF, 1], mbarrier.MBarrierLayout())
        k_full = gl.allocate_shared_memory(gl.int64, [cfg.STAGES, 1], mbarrier.MBarrierLayout())
        k_empty = gl.allocate_shared_memory(gl.int64, [cfg.STAGES, 1], mbarrier.MBarrierLayout())
        v_full = gl.allocate_shared_memory(gl.int64, [cfg.STAGES, 1], mbarrier.MBarrierLayout())
        v_empty = gl.allocate_shared_memory(gl.int64, [cfg.STAGES, 1], mbarrier.MBarrierLayout())
        # Each "empty" barrier waits for every consumer warpgroup.
        for i in gl.static_range(cfg.QBUF):
            mbarrier.init(q_full.index(i), count=1)
            mbarrier.init(q_empty.index(i), count=cfg.NUM_WG)
        for i in gl.static_range(cfg.STAGES):
            mbarrier.init(k_full.index(i), count=1)
            mbarrier.init(v_full.index(i), count=1)
            mbarrier.init(k_empty.index(i), count=cfg.NUM_WG)
            mbarrier.init(v_empty.index(i), count=cfg.NUM_WG)
        k_bar = Ring(k_full, k_empty, cfg.STAGES)
        if cfg.BIAS != 0:
            # attn_mask tiles: a ring of BSTAGES slots, one [PART_M, BLOCK_N] tile per consumer in each.
            b_layout: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128,
                                                          element_bitwidth=bias_desc.dtype.primitive_bitwidth, rank=2)
            bias_smem = gl.allocate_shared_memory(bias_desc.dtype, [cfg.BSTAGES * cfg.NUM_WG, cfg.PART_M,
                                                                    cfg.BLOCK_N], b_layout)
            b_full = gl.allocate_shared_memory(gl.int64, [cfg.BSTAGES, 1], mbarrier.MBarrierLayout())
            b_empty = gl.allocate_shared_memory(gl.int64, [cfg.BSTAGES, 1], mbarrier.MBarrierLayout())
            for i in gl.static_range(cfg.BSTAGES):
                mbarrier.init(b_full.index(i), count=1)
                mbarrier.init(b_empty.index(i), count=cfg.NUM_WG)
            b_bar = Ring(b_full, b_empty, cfg.BSTAGES)
        else:
            bias_smem, b_bar = k_smem, k_bar  # not read
        return FwdSmem(q_smem, k_smem, v_smem, o_smem, bias_smem, tile_smem, flag_smem, Ring(q_full, q_empty, cfg.QBUF),
                       k_bar, Ring(v_full, v_empty, cfg.STAGES), b_bar, p_smem)

    # seqlen_q and n_m are not specialized on the value 1: with both constant, a warpgroup's "rows past Sq" branch
    # (_skip_blocks) is decided at compile time and Triton 3.6's lowering fails on the dead partition body.
    @gluon.jit(do_not_specialize=["seqlen_q", "n_m"])
    def _fwd_kernel(q_desc, k_desc, v_desc, o_desc, bias_desc, Out, Lse, Counter, TileMap, Redo, extras, lists,
                    strides, mask, seqlen_q, band, scales, heads, n_m, n_tiles, pages, HEAD_DIM: gl.constexpr,
                    HEAD_DIM_V: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
                    MASK_RIGHT: gl.constexpr, MASK_LEFT: gl.constexpr, SOFTCAP: gl.constexpr, HAS_ALIBI: gl.constexpr,
                    HAS_SINKS: gl.constexpr,
                    BIAS: gl.constexpr, STAGE_O: gl.constexpr, NUM_WG: gl.constexpr, DYNAMIC: gl.constexpr,
                    QBUF: gl.constexpr, VARLEN: gl.constexpr, LAZY: gl.constexpr, DROPOUT: gl.constexpr,
                    PAGE: gl.constexpr, PAD_D: gl.constexpr, DEFER: gl.constexpr, REDO: gl.constexpr):
        """One program per SM (persistent) walking work items; the partitions and their roles are the module
        docstring's. strides, mask, band, scales and heads: the named tuples _Strides, _Mask, _Band, _Scales, _Heads;
        extras: the features' tensors (_Extras); lists: a bool attn_mask's block lists (_Lists); pages: a paged
        batch's block table (_Pages). Constexprs:
        MASK_RIGHT, the band's right bound i + diag_offset (causal, or a right window folded into the offset);
        MASK_LEFT, its left bound i + left_offset; BIAS 0 none, 1 a float attn_mask, 2 a bool one (tiles in a ring
        of BIAS_STAGES); STAGE_O: stores through a staging buffer; NUM_WG consumer warpgroups of BLOCK_M // NUM_WG
        rows; DYNAMIC: the global counter's schedule; QBUF query buffers; LAZY: LAZY_MAX's steps (_finish_step);
        PAGE: a paged varlen batch's page size (0: none), K and V then read page by page through the block table
        (_load_block); PAD_D: 0, or where V's tile is wider than its head dim (tile_dim), the kernel_dim whose path
        it takes (FwdConfig): stores from registers mask the columns past the head dim (_store_o)."""
        # VARLEN (see _varlen_item): TileMap is varlen_tile_map's [n_upper, 8] int32 rows and n_m is n_upper; items
        # come from the counter (the producer skips the map's empty rows), and nothing else changes.
        gl.static_assert(not VARLEN or (DYNAMIC and BIAS == 0))
        gl.static_assert(PAGE == 0 or (VARLEN and (PAGE % BLOCK_N == 0 or BLOCK_N % PAGE == 0)))
        gl.static_assert(not LAZY or (BIAS == 0 and not MASK_LEFT and not HAS_ALIBI and NUM_WG == 2))
        gl.static_assert(not DEFER or (LAZY and q_desc.dtype == gl.bfloat16))
        gl.static_assert(not REDO or DEFER)
        gl.static_assert(q_desc.block_type.shape[3] == HEAD_DIM or (BIAS == 0 and q_desc.dtype.primitive_bitwidth > 8))
        cfg = FwdConfig(HEAD_DIM, HEAD_DIM_V, BLOCK_M, BLOCK_N, STAGES, MASK_RIGHT, MASK_LEFT, SOFTCAP, HAS_ALIBI,
                        HAS_SINKS, BIAS, STAGE_O, NUM_WG, DYNAMIC, QBUF, VARLEN, LAZY, DROPOUT, PAGE, PAD_D,
                        q_desc.dtype, q_desc.block_type.shape[3], DEFER, REDO)
        # (The tuples' fields are read where they are passed: an assignment would turn the ones Triton specialized
        # into constants, integer arguments equal to 1, into runtime values.)
        prog = FwdProgram(
            cfg, FwdProducer(q_desc, k_desc, v_desc, bias_desc, Counter, TileMap, heads.group_size, mask.mul_b,
                             mask.mul_h, pages.table, pages.stride, pages.cols),
            FwdOut(o_desc, Out, strides.out_b, strides.out_s, strides.out_h, Lse, strides.lse_b, strides.lse_h, Redo),
            _fwd_smem(cfg, bias_desc), FwdWork(n_tiles, n_m, heads.num_heads, heads.head_group),
            FwdBand(seqlen_q, band.seqlen_k, band.diag_offset, band.left_offset),
            FwdMods(scales.qk_scale, extras.alibi, strides.alibi_b, band.alibi_offset, scales.mod_unit,
                    scales.pre_scale, extras.sinks, extras.seed, scales.drop_threshold, scales.drop_keep,
                    extras.descale),
            FwdLists(lists.counts, lists.idx, mask.lists_b, mask.lists_h, mask.lists_cols))
        if NUM_WG == 3:
            # 16 warps: the worker consumers get CONSUMER_REGS_3WG, the first one what the others leave.
            gl.warp_specialize([(_softmax_partition, (prog, 0)), (_softmax_partition, (prog, 1)),
                                (_softmax_partition, (prog, 2)), (_load_partition, (prog, ))], [4, 4, 1],
                               [CONSUMER_REGS_3WG, CONSUMER_REGS_3WG, PRODUCER_REGS])
        else:
            gl.warp_specialize([(_softmax_partition, (prog, 0)), (_softmax_partition, (prog, 1)),
                                (_load_partition, (prog, ))], [4, 1], [CONSUMER_REGS, PRODUCER_REGS])


def fp8_block_n(seqlen_k, req: AttentionRequest):
    """Keys per block of the float8 forward (FP8_WIDE_BLOCK_N's rule): 256 for fixed-length calls whose rows see
    at least FP8_WIDE_MIN_KEYS keys, else the transposed copy's 128."""
    if req.varlen or req.paged or req.dropout_p > 0 or seqlen_k < FP8_WIDE_MIN_KEYS[req.banded]:
        return _TRANSPOSE_KEYS
    return FP8_WIDE_BLOCK_N.value


def key_block_rows(head_dim, head_dim_v):
    """Key rows per block of the forward at these head dims (q/k, v): the tile width's (BLOCK_NS), or CHUNKED_TILES'."""
    tiles = CHUNKED_TILES.get((head_dim, head_dim_v))
    return BLOCK_NS[tile_dim(head_dim)] if tiles is None else tiles[0]


def _smem_plan(num_wg, qbuf, bias_bytes, qk_d, v_d, block_n, stages, stage_o=True):
    """(QBUF, STAGE_O) for a launch with attn_mask tiles of bias_bytes per element, Q and K qk_d columns wide in
    shared memory and V and the output v_d, STAGES of BLOCK_N keys: the configuration's query buffers and output
    staging buffer (unless stage_o is False) if the ring of BIAS_STAGES tiles fits beside them, else one query
    buffer, else no staging buffer either (d128 with a 16-bit bias: 32 KB of Q, 128 KB of K/V, 64 KB of bias).
    Without one, Q/K tiles of CHUNK_O_MIN_DIM columns or more store O through a [WG_M, 64] 16-bit scratch per
    warpgroup (FwdConfig.CHUNK_O)."""
    fixed = stages * block_n * (qk_d + v_d) * 2 + BIAS_STAGES * num_wg * WG_M * block_n * bias_bytes
    for qb, staged in ((qbuf, stage_o), (1, stage_o), (1, False)):
        chunks = 0 if staged or bias_bytes or qk_d < CHUNK_O_MIN_DIM else num_wg * WG_M * 64 * 2
        if fixed + num_wg * WG_M * 2 * (qb * qk_d + staged * v_d) + chunks <= SMEM_BYTES:
            return qb, staged
    raise ValueError(f"no shared-memory plan for head dims {qk_d}/{v_d} with a {bias_bytes}-byte attn_mask")


@functools.lru_cache(maxsize=None)
def _num_sms(device_index):
    return torch.cuda.get_device_properties(device_index).multi_processor_count


@functools.lru_cache(maxsize=None)
def _layout(bits, rank):
    """The 128-byte swizzled shared layout of TMA tiles of bits-wide elements (built once: a launch makes several
    descriptors)."""
    return gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=bits, rank=rank)


def _descriptor(t, rows, cols):
    """A 4-D TMA descriptor over a [B, S, H, D] tensor with its own strides, one [rows, cols] tile of one (batch,
    head) per copy: rows past S and columns past D (cols = tile_dim(D)) are zero-filled on loads and dropped on
    stores, whatever the layout."""
    return TensorDescriptor(t, list(t.shape), list(t.stride()), [1, rows, 1, cols], _layout(8 * t.element_size(), 4))


def _vt_descriptor(vt, head_dim, block_n):
    """FP8: a 4-D TMA descriptor over V transposed ([B, Hk, D, L], keys contiguous, each block of BLOCK_N keys in
    _vt_keys' order; _transposed_v), one [head_dim, block_n] tile of one (batch, kv head) per copy. The copy holds
    whole blocks (zeros for keys past Sk: their P is 0, and 0 times what lies past the end could be a NaN)."""
    return TensorDescriptor(vt, list(vt.shape), list(vt.stride()), [1, 1, head_dim, block_n], _layout(8, 4))


@triton.jit
def _vt_keys(pos, BLOCK_S: tl.constexpr):
    """The key (within its block of BLOCK_S) that V's transposed copy holds at position pos of the block: position
    BLOCK_S / 4 q + 2 i + e holds key 8 i + 2 q + e, the order of the Gluon kernel's P (_key_order)."""
    q = pos // (BLOCK_S // 4)
    i = (pos // 2) % (BLOCK_S // 8)
    return 8 * i + 2 * q + pos % 2


@triton.jit
def _transpose_v_kernel(V, Vt, CuSeqK, seqlen, num_heads, stride_vb, stride_vs, stride_vh, stride_tb, stride_th,
                        stride_td, HEAD_DIM: tl.constexpr, BLOCK_S: tl.constexpr, VARLEN: tl.constexpr):
    """One block of BLOCK_S keys of one (batch, head) per program (bytes: float8 read as uint8): position p of the
    block in Vt[b, h, :, :] holds V[b, block start + _vt_keys(p), h, :], and 0 for a key past the end. Both sides
    move whole rows: the load along the head dim, the store along the keys. VARLEN: b is a sequence of the packed
    V (batch dims of 1), its keys from CuSeqK[b], stored from VT_ALIGN-rounded CuSeqK[b] + VT_GAP * b
    (_transposed_v); a block past the sequence's keys stores nothing."""
    i_bh = tl.program_id(1)
    i_b = (i_bh // num_heads).to(tl.int64)
    i_h = (i_bh % num_heads).to(tl.int64)
    block = tl.program_id(0) * BLOCK_S
    pos = tl.arange(0, BLOCK_S)
    keys = block + _vt_keys(pos, BLOCK_S)
    dims = tl.arange(0, HEAD_DIM)
    if VARLEN:
        start = tl.load(CuSeqK + i_b).to(tl.int64)
        n_keys = tl.load(CuSeqK + i_b + 1) - start
        src = V + i_h * stride_vh + (start + keys.to(tl.int64))[:, None] * stride_vs + dims[None, :]
        dst = Vt + i_h * stride_th + dims.to(tl.int64)[:, None] * stride_td
        dst += (start + VT_ALIGN - 1) // VT_ALIGN * VT_ALIGN + VT_GAP * i_b + block + pos[None, :]
    else:
        n_keys = seqlen
        src = V + i_b * stride_vb + i_h * stride_vh + keys.to(tl.int64)[:, None] * stride_vs + dims[None, :]
        dst = Vt + i_b * stride_tb + i_h * stride_th + dims.to(tl.int64)[:, None] * stride_td + block + pos[None, :]
    x = tl.load(src, mask=keys[:, None] < n_keys, other=0)
    # (The whole block, or nothing: the mask's shape is the store's.)
    tl.store(dst, tl.trans(x), mask=dims[:, None] * 0 + pos[None, :] * 0 + block < n_keys)


# Keys per program of the transposed copy: a [128, D] tile of bytes, one key block of the Gluon kernel (_key_order's
# order holds within a block).
_TRANSPOSE_KEYS = 128
# Varlen FP8: each sequence's keys start at a multiple of VT_ALIGN in V's transposed copy, since a TMA copy whose
# first key (the contiguous dimension, one byte each) is not on a 16-byte boundary stopped the kernel with an
# illegal instruction on an H100. Sequence b starts at VT_ALIGN-rounded cu_seqlens_k[b] + VT_GAP * b: the rounding
# adds at most 15 keys and the last block's whole 128 at most 127 past the sequence's end, so the next sequence
# starts after it, and the producer needs no other offsets (_load_vt computes it from the item).
VT_ALIGN = tl.constexpr(16)
VT_GAP = tl.constexpr(144)


def _transposed_v(v, cu_seqlens_k=None, max_seqlen_k=0, block_s=_TRANSPOSE_KEYS):
    """V as [B, Hk, D, L] with the keys contiguous, for the FP8 forward's P V (float8 wgmma takes its shared
    operands K-major only), each block of block_s keys (the kernel's BLOCK_N) in _vt_keys' order: one pass per call
    over B * Sk * Hk * D bytes (_transpose_v_kernel; torch's copy of the permuted view took ~0.22 ms for 32 MB on an
    H100). L: Sk rounded up to whole blocks, zeros past Sk (the kernel's last block reads them with P = 0 there,
    and 0 times a stale float8 NaN would not be 0). Varlen (cu_seqlens_k given, v [total_k, Hk, D]): [1, Hk, D, L]
    with sequence b from VT_ALIGN-rounded cu_seqlens_k[b] + VT_GAP * b, zeros between. A plan keeps its _VtCopy."""
    stream = _launch.stream_for(v.get_device()) if v.is_cuda else None
    return _VtCopy(v, cu_seqlens_k, max_seqlen_k, block_s).run(stream, v, cu_seqlens_k)


class _VtCopy:
    """_transposed_v for one plan: the copy's shape, and the bound launch of _transpose_v_kernel (its grid, strides
    and constexprs follow from the plan key's shapes and strides), so a call allocates and launches only."""
    __slots__ = ("shape", "zeros", "varlen", "launch")

    def __init__(self, v, cu_seqlens_k=None, max_seqlen_k=0, block_s=_TRANSPOSE_KEYS):
        self.varlen = varlen = cu_seqlens_k is not None
        v4 = v.unsqueeze(0) if varlen else v
        batch, seqlen_k, num_kv_heads, head_dim = v4.shape
        assert v4.stride(-1) == 1 and head_dim == triton.next_power_of_2(head_dim)
        if varlen:
            n_seqs = cu_seqlens_k.numel() - 1
            length = -(-seqlen_k // VT_ALIGN.value) * VT_ALIGN.value + VT_GAP.value * (n_seqs + 1)
            assert block_s == _TRANSPOSE_KEYS  # (VT_GAP spaces the sequences for 128-key blocks)
            grid = (triton.cdiv(max_seqlen_k, block_s), n_seqs * num_kv_heads)
        else:
            length = triton.cdiv(seqlen_k, block_s) * block_s
            grid = (length // block_s, batch * num_kv_heads)
        # (Varlen: zeros between the sequences, which no program writes.)
        self.shape, self.zeros = (batch, num_kv_heads, head_dim, length), varlen
        dst_strides = (num_kv_heads * head_dim * length, head_dim * length, length)
        self.launch = None
        if grid[0] * grid[1] > 0 and v4.numel() > 0:
            self.launch = _launch.Bound(_transpose_v_kernel, grid,
                                        (seqlen_k, num_kv_heads, *v4.stride()[:3], *dst_strides),
                                        dict(HEAD_DIM=head_dim, BLOCK_S=block_s, VARLEN=varlen), dict(num_warps=4))

    def run(self, stream, v, cu_seqlens_k=None):
        """The copy of v (a call's tensor with the plan's shape and strides; meta: the buffer alone)."""
        if self.zeros:
            vt = torch.zeros(self.shape, dtype=v.dtype, device=v.device)
        else:
            vt = _common.empty(self.shape, v.dtype, v.device)
        if self.launch is not None and v.device.type != "meta":
            src = (v.unsqueeze(0) if self.varlen else v).view(torch.uint8)
            self.launch(stream, src, vt.view(torch.uint8), cu_seqlens_k if self.varlen else src)
        return vt


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
def _varlen_tile_map_kernel(CuSeqQ, CuSeqK, SeqUsedK, Map, batch, n_upper, BLOCK_M: tl.constexpr,
                            REVERSE: tl.constexpr, BLOCK_C: tl.constexpr, CHUNK: tl.constexpr, USED: tl.constexpr):
    """Row c of Map: [sequence b, first query row, q_start, Sq, k_start, Sk, 0, 0] of the c-th query tile of BLOCK_M
    rows over all sequences in order (b = -1 past the last tile). A sequence's tiles are listed last first with
    REVERSE. The tile's sequence is the number of sequences whose tiles all come before c, counted CHUNK at a
    time. USED: Sk = SeqUsedK[b] and k_start 0 (a paged batch's keys are found through its block table)."""
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
    if USED:
        k_lo = tl.zeros_like(seq)
        seqlen_k = tl.load(SeqUsedK + seq, mask=valid, other=0)
    else:
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


def varlen_tile_map(cu_seqlens_q, cu_seqlens_k, total_q, block_m, reverse=False, seqused_k=None):
    """The work list of a varlen forward without reading the lengths on the host: (map, n_upper). n_upper =
    cdiv(total_q, block_m) + batch bounds the number of query tiles (sum of cdiv(len_b, block_m)); map is
    [n_upper, 8] int32, row c the c-th tile's [sequence (-1 past the last tile), first query row within it,
    q_start, Sq, k_start, Sk, 0, 0], tiles in sequence order (each sequence's last first with reverse).
    seqused_k: a paged batch's key counts (Sk = seqused_k[b], k_start 0; cu_seqlens_k unread)."""
    tiles = _TileMap(total_q, cu_seqlens_q.numel() - 1, block_m, reverse, seqused_k is not None)
    stream = _launch.stream_for(cu_seqlens_q.get_device())
    return tiles.run(stream, cu_seqlens_q, cu_seqlens_k, seqused_k), tiles.shape[0]


# The tile map kernel's programs: 64 tiles each, against 64 sequences at a time (a [64, 64] comparison per step,
# small enough for the default 4 warps without spilling).
_TILE_MAP_CHUNK = 64


class _TileMap:
    """varlen_tile_map for one plan: the map's shape and the bound launch of _varlen_tile_map_kernel, whose grid and
    scalars follow from the packed queries' rows and the number of sequences (both in a plan's key), so a call
    allocates and launches only."""
    __slots__ = ("shape", "launch")

    def __init__(self, total_q, batch, block_m, reverse, used):
        n_upper = triton.cdiv(total_q, block_m) + batch
        self.shape = (n_upper, 8)
        grid = (triton.cdiv(n_upper, _TILE_MAP_CHUNK), )
        self.launch = _launch.Bound(_varlen_tile_map_kernel, grid, (batch, n_upper),
                                    dict(BLOCK_M=block_m, REVERSE=reverse, BLOCK_C=_TILE_MAP_CHUNK,
                                         CHUNK=_TILE_MAP_CHUNK, USED=used), {})

    def run(self, stream, cu_seqlens_q, cu_seqlens_k, seqused_k=None):
        """The map of a call's offsets (and a paged batch's key counts); stream: _launch.stream_for's."""
        tile_map = torch.empty(self.shape, dtype=torch.int32, device=cu_seqlens_q.device)
        self.launch(stream, cu_seqlens_q, cu_seqlens_k, cu_seqlens_k if seqused_k is None else seqused_k, tile_map)
        return tile_map


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


def attention_forward(q, k, v, req: AttentionRequest, out_dtype=None):
    """Same contract as kernels.forward.attention_forward, for the requests flashtile.dispatch gives this kernel
    (GluonHopper's allow-list). An out_dtype other than q's (float32) is stored from registers: the output staging
    buffer holds q's dtype."""
    return plan_forward(q, k, v, req, out_dtype)[1:]


def plan_forward(q, k, v, req: AttentionRequest, out_dtype=None):
    """(GluonFwdPlan, out, lse): the plan of this call's key and the call launched with it (flashtile/dispatch.py
    keeps the plan for later calls with the same key)."""
    plan = _fwd_plan(q, k, v, req, out_dtype or q.dtype)
    out, lse = plan.start(_launch.stream_for(q.get_device()), q, k, v, req)
    return plan, out, lse


def _meta(t):
    """A tensor without storage with t's shape, strides and dtype (data_ptr 0: 16-byte aligned)."""
    return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="meta")


# The dynamic schedule's item counters, one per (device, stream): zero before a launch, and the launch's last take
# sets its counter back to zero (_load_partition), so that no call pays for a zero-fill kernel (it was a second
# launch before each forward: at 1k tokens the GPU waited on the host between the two). Launches on one stream run
# in order; two streams get two counters.
_COUNTERS = {}


# DEFER's redo pass pays for itself from about this much work (FLOPs as the benchmarks count them, ~55 us of an H100
# forward): its launch costs ~2-3 us of GPU time with nothing flagged (and host time), DEFER saves 1-8%.
DEFER_MIN_FLOPS = 2 ** 35


def defer_pays(rows, num_heads, seqlen_q, seqlen_k, head_dims, causal, block_n):
    """Whether a bfloat16 forward under LAZY_MAX takes DEFER: rows query rows (all batch entries or sequences) of
    num_heads heads, seqlen_q / seqlen_k the (longest) lengths, head_dims q's plus v's head dim, block_n keys per
    block; at least DEFER_MIN_FLOPS of work, and rows that see more than one key block (with one there is no block
    to defer the check of)."""
    keys = seqlen_k / 2 if causal and seqlen_q == seqlen_k else seqlen_k
    return seqlen_k > block_n and 2 * rows * num_heads * keys * head_dims >= DEFER_MIN_FLOPS


# DEFER's redo state per (device, stream) (_redo_state). A state a larger one replaced is kept for the process's
# life: a CUDA graph captured over it launches at its address, and freed memory would be another tensor's by then.
_REDO = {}
_REDO_RETIRED = []


def _stream_key(device, stream):
    """The key of the per-stream state of launches on device's stream (stream: _launch.stream_for's, None: torch's
    current stream there): launches on one stream run in order, so their state may be shared."""
    return device, stream if stream is not None else torch.cuda.current_stream(device).cuda_stream


def _redo_state(device, stream, n_tiles):
    """DEFER's state for launches on device's stream (stream: _launch.stream_for's, None: torch's current stream
    there): int32 [count, done, a flag per item], at least 2 + n_tiles long, all zero between launches (the redo
    pass clears what the first pass set)."""
    key = _stream_key(device, stream)
    state = _REDO.get(key)
    if state is None or state.numel() < 2 + n_tiles:
        # (Doubling, from 16 KB: few replacements, each kept in _REDO_RETIRED.)
        size = max(2 + n_tiles, 2 * state.numel() if state is not None else 4096)
        if state is not None:
            _REDO_RETIRED.append(state)
        state = _REDO[key] = torch.zeros(size, dtype=torch.int32, device=device)
    return state


def _schedule_counter(device, stream):
    """The zeroed item counter of launches on device's stream (stream: _launch.stream_for's, None: torch's
    current stream there)."""
    key = _stream_key(device, stream)
    counter = _COUNTERS.get(key)
    if counter is None:
        counter = _COUNTERS[key] = torch.zeros(1, dtype=torch.int32, device=device)
    return counter


class GluonFwdPlan:
    """The launch of attention_forward for one plan key (flashtile/dispatch.py), everything but the call's tensors
    fixed: the configuration, the grid, the scalar groups, the constexprs, and the compiled kernel with the
    descriptors' templates (_launch.Bound). run allocates out, lse (and the dynamic schedule's counter), takes the
    call's feature tensors, and launches over its q, k, v and out."""
    __slots__ = ("launch", "out_shape", "lse_shape", "out_dtype", "device", "groups", "dynamic", "block_m",
                 "block_n", "varlen", "lists", "o_from_q", "paged", "fp8", "vt", "tile_map", "defer", "n_tiles", "redo",
                 "redo_thread")

    def run(self, q, k, v, req):
        """(out, lse) of a call with this plan's key."""
        return self.start(_launch.stream_for(q.get_device()), q, k, v, req)

    def start(self, stream, q, k, v, req):
        """(out, lse); stream: _launch.stream_for's."""
        out = _common.empty(self.out_shape, self.out_dtype, self.device)
        lse = _common.empty(self.lse_shape, torch.float32, self.device)
        # lse: a placeholder where a feature is off (never read).
        bias_desc, counts, indices, tile_map = None, lse, lse, lse
        if req.attn_bias is not None:
            bias_desc = bias_descriptor(req.attn_bias, WG_M, self.block_n)[0]
            if self.lists is not None:
                lists = Features(req).block_lists(*self.lists)
                counts, indices = lists.counts, lists.indices
        table = (lse, 0, 0)
        if self.varlen:
            if self.paged:
                table = (req.block_table, req.block_table.stride(0), req.block_table.shape[1])
            tile_map = self.tile_map.run(stream, req.cu_seqlens_q, req.cu_seqlens_k, req.seqused_k)
        counter = _schedule_counter(self.device, stream) if self.dynamic else lse
        redo = _redo_state(self.device, stream, self.n_tiles) if self.defer else lse
        if self.fp8:
            v = self.vt.run(stream, v, req.cu_seqlens_k)
        # (q, k, v and the output as the bases of the descriptors the launch makes from the plan's templates.)
        args = (_Extras(lse if req.alibi_slopes is None else req.alibi_slopes,
                        lse if req.sinks is None else req.sinks, req.seed if req.dropout_p > 0 else lse,
                        lse if req.descale is None else req.descale),
                _Lists(counts, indices), *self.groups, _Pages(*table))
        args = (q, k, v, q if self.o_from_q else out, bias_desc, out, lse, counter, tile_map, redo) + args
        self.launch(stream, *args)
        if self.defer and self.redo_thread is None and stream is not None and not self.redo.find(*args):
            # Compiled aside, started once the first pass has compiled: a process's first call then compiles nothing
            # more on its way, as long as no item is flagged. (A new plan whose kernels an earlier plan compiled,
            # such as a varlen batch of another total length, finds it in the compile cache.) It starts once the
            # backward's compile-ahead helpers are done (_ahead.py): the first training step waits for those, and a
            # compile beside them slowed them down (docs/design-record.md, "Cold start").
            from .. import _ahead
            self.redo_thread = self.redo.compile_aside(*args, after=_ahead.pending())
        if self.defer:
            # The redo pass: the items the first one flagged (usually none: its programs then return at once).
            thread = self.redo_thread
            if self.redo.compiled is None and thread is not None and thread.is_alive():
                # Its kernel still compiling (a process's first calls of the plan): needed only if an item was
                # flagged, which reading the count tells (a wait for the first pass, until the compile is done).
                capturing = torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()
                if not capturing and not int(redo[0]):
                    return out, lse
                thread.join()
            self.redo(stream, *args)
        return out, lse


def three_warpgroups_fill(seqlen_q):
    """Whether seqlen_q query rows fill three warpgroups' tiles well enough for a configuration of three
    (THREE_WG_MIN_FILL); with fewer, a fixed-length call takes two."""
    def fill(block_m):
        return seqlen_q / (triton.cdiv(seqlen_q, block_m) * block_m) if seqlen_q else 1.0
    return fill(3 * WG_M) >= THREE_WG_MIN_FILL * fill(2 * WG_M)


def _fwd_plan(q, k, v, req, out_dtype):
    """The GluonFwdPlan of (q, k, v, req)."""
    feats = Features(req)
    varlen = req.varlen
    diagonal_offset = req.diagonal_offset
    plan = GluonFwdPlan()
    plan.out_dtype, plan.device, plan.varlen, plan.paged = out_dtype, q.device, varlen, req.paged
    plan.fp8 = q.dtype == torch.float8_e4m3fn  # (bfloat16 out: stored from registers, o_from_q)
    page = k.shape[1] if req.paged else 0  # paged: k, v are [pages, page size, Hk, D] caches
    if varlen:
        # Packed [total, H, D] sequences (kernel note at _varlen_item): 4-D views [1, total, H, D] for the
        # descriptors, lse [H, total_q]; each item adds its sequence's own Sk - Sq to the offsets below.
        total_q, num_heads, head_dim = q.shape
        head_dim_v = v.shape[-1]
        num_kv_heads = k.shape[-2]
        batch = req.cu_seqlens_q.numel() - 1
        seqlen_q, seqlen_k = req.max_seqlen_q, req.max_seqlen_k
        plan.out_shape, plan.lse_shape = (total_q, num_heads, head_dim_v), (num_heads, total_q)
        diagonal_offset = 0
        out = torch.empty(plan.out_shape, dtype=out_dtype, device="meta")  # allocated contiguous by run
        q4, k4, v4, o4 = (t if t.dim() == 4 else t.unsqueeze(0) for t in (q, k, v, out))
        out_strides = (0, out.stride(0), out.stride(1))
        lse_strides = (0, total_q)
    else:
        batch, seqlen_q, num_heads, head_dim = q.shape
        seqlen_k, num_kv_heads, head_dim_v = k.shape[1], k.shape[2], v.shape[-1]
        plan.out_shape, plan.lse_shape = (batch, seqlen_q, num_heads, head_dim_v), (batch, num_heads, seqlen_q)
        out = torch.empty(plan.out_shape, dtype=out_dtype, device="meta")
        q4, k4, v4, o4 = q, k, v, out
        out_strides = out.stride()[:3]
        lse_strides = (num_heads * seqlen_q, seqlen_q)
    # Outputs in another dtype (fp32 blocks for flashtile.distributed) are stored from registers; the descriptor
    # slot then gets q's, never read (a 16-bit layout over an fp32 tensor is no valid TMA descriptor).
    plan.o_from_q = out_dtype != q.dtype
    # The descriptors' templates, over storage-less stand-ins of q, k, v and out (a plan keeps no tensor of a
    # call): the bound launch makes each call's descriptors over its own tensors (_launch.Bound's templates).
    # V and the output have their own tile width where their head dim differs (MLA's 192/128: GLUON_FWD_SPLIT_DIMS).
    # tile_d keys the configuration tables; Q and K may read narrower chunks of their own width (QK_TILE_DIM).
    tile_d, tile_dv = tile_dim(head_dim), tile_dim(head_dim_v)
    tile_qk = qk_tile_dim(head_dim)
    qk_cols = tile_qk if tile_qk == tile_d else QK_CHUNK
    block_n = plan.block_n = fp8_block_n(seqlen_k, req) if plan.fp8 else key_block_rows(head_dim, head_dim_v)
    kv_rows = min(page, block_n) if page else block_n  # paged: one copy per page, or a block within one
    # FP8: P's columns and V's transposed copy share an order within each key block (_key_order, _vt_keys).
    plan.vt = None
    if plan.fp8:
        plan.vt = _VtCopy(_meta(v), req.cu_seqlens_k if varlen else None, req.max_seqlen_k if varlen else 0, block_n)
        v_desc = _vt_descriptor(plan.vt.run(None, _meta(v)), tile_dv, block_n)
    else:
        v_desc = _descriptor(_meta(v4), kv_rows, tile_dv)
    descs = (_descriptor(_meta(q4), WG_M, qk_cols), _descriptor(_meta(k4), kv_rows, qk_cols), v_desc,
             _descriptor(_meta(q4 if plan.o_from_q else o4), WG_M, tile_dv))
    # The kernel's right bound is i + diag_offset (MASK_RIGHT): causal, or a right window folded into the offset;
    # its left bound i + left_offset (MASK_LEFT).
    right_offset = diagonal_offset + (req.window_right if req.mask_right else 0)
    stride_alibi_b = feats.alibi_args(None)[1]
    left_offset = diagonal_offset - req.window_left if req.mask_left else 0
    bias_kind = feats.bias_kind
    num_wg, qbuf, dynamic = CONFIGS[(tile_d, req.banded)]
    # LAZY_MAX: not with an attn_mask (a redone block would need its tile again) or a left window (a row may see
    # its first key in a later block, and needs that block's maximum as its reference), nor on three warpgroups
    # (their 160 registers spill ~90 stores with it, and plain d64 ran 5% slower), nor with ALiBi: its scores rise
    # toward the diagonal by design, past the first block's maximum in every later block, and each redone block
    # costs a second Q K^T (the forward measured +59% over plain instead of +22%).
    # Float8 P (FP8) takes LAZY_LIMIT_FP8, under its largest value 448.
    lazy = SETTINGS.lazy_max and not bias_kind and not req.mask_left and req.alibi_slopes is None
    # DEFER: bfloat16 calls with work enough for its redo pass's launch to pay (defer_pays); SETTINGS.defer_check
    # off keeps LAZY_MAX's check per block.
    defer = bool(lazy) and SETTINGS.defer_check and q.dtype == torch.bfloat16 and defer_pays(
        total_q if varlen else batch * seqlen_q, num_heads, seqlen_q, seqlen_k, head_dim + head_dim_v,
        req.mask_right, block_n)
    # Three warpgroups give way to the causal configuration's two where the rows fill their 192-row tiles poorly
    # (three_warpgroups_fill), and with a softcap, ALiBi, an attn_mask or dropout: at 160 registers each a softcap
    # or ALiBi spills there (17-24 stores offline), two warpgroups do not. And where the call takes DEFER: two
    # warpgroups with it ran 1.05-1.08x three at d64 (full, 2k-16k; three with DEFER, 1.01-1.04x) (H100;
    # docs/design-record.md, "Two warpgroups where the forward defers its check").
    if num_wg == 3 and (defer or (not varlen and not three_warpgroups_fill(seqlen_q)) or req.softcap > 0
                        or req.alibi_slopes is not None or bias_kind or req.dropout_p > 0):
        num_wg, qbuf, dynamic = CONFIGS[(tile_d, True)]
    if req.softcap > 0:
        # Two query buffers for a softcap on every configuration (d128's causal and banded one has one): the causal
        # softcap forward ran 6.5-7% faster with them at 16k and 4k (H200), outputs bit-identical, while the plain
        # causal, ALiBi, sinks and window forwards moved within +-1% and dropout's lost 1-2% (docs/design-record.md,
        # "Two query buffers for the causal softcap forward").
        qbuf = 2
    block_m = plan.block_m = WG_M * num_wg
    # attn_mask: room for its tiles in shared memory, and for a bool mask the lists of key blocks each query tile
    # visits (made per call: Features.block_lists).
    bias_mul_b, bias_mul_h = 0, 0
    stages = STAGES[tile_d]
    chunked = CHUNKED_TILES.get((head_dim, head_dim_v))
    if chunked is not None:
        stages = chunked[1]
    # Shared memory: Q and K at their chunks' width, V and the output at their tile's. d192 stores its output from
    # registers (FwdConfig.V_SPLIT's rule: V's 256-column tile over fewer columns; two accumulators).
    pad_d = kernel_dim(head_dim_v) if tile_dv != head_dim_v else 0
    v_split = pad_d == 192
    ring = (tile_qk, tile_dv, block_n, stages, not v_split)
    if plan.fp8:
        # Float8 tiles take half the shared memory: two query buffers at every configuration (FP8_RING).
        (stages, qbuf), stage_o = FP8_RING, False
    else:
        qbuf, stage_o = _smem_plan(num_wg, qbuf, 0, *ring)
    count_strides, idx_cols, plan.lists = (0, 0), 0, None
    if bias_kind:
        bias_mul_b, bias_mul_h = bias_descriptor(req.attn_bias, WG_M, block_n)[1:]
        qbuf, stage_o = _smem_plan(num_wg, qbuf, req.attn_bias.element_size(), *ring)
        if bias_kind == BIAS_BOOL:
            dynamic = True  # tiles see as many blocks as the mask lets them: take them from the counter
            # Without a band, the blocks the mask leaves entirely visible need no tile (mark_full); with one,
            # every listed block is masked anyway.
            plan.lists = (block_m, block_n, False, seqlen_q, seqlen_k, not req.banded)
            lists = feats.block_lists(*plan.lists[:5], mark_full=plan.lists[5])
            count_strides, idx_cols = lists.strides, lists.cols
    stage_o = stage_o and out_dtype == q.dtype
    n_m = triton.cdiv(seqlen_q, block_m)
    plan.tile_map = None
    if varlen:
        # Items: (tile of the map, head); the producer skips the map's rows past the last tile.
        plan.tile_map = _TileMap(total_q, batch, block_m, req.mask_right, req.seqused_k is not None)
        n_m = plan.tile_map.shape[0]  # n_upper
        dynamic = True
    plan.dynamic = dynamic
    n_tiles = n_m * batch * num_heads if not varlen else n_m * num_heads
    head_group = min(HEAD_GROUP, num_heads) if bias_kind == BIAS_FLOAT and not bias_mul_h and not varlen else 1
    lazy = lazy and num_wg == 2
    plan.defer = defer and lazy
    plan.n_tiles = n_tiles
    qk_scale, pre_scale, mod_unit = mod_scalars(req.softmax_scale, req.softcap,
                                                scaled_q=bias_kind == BIAS_FLOAT and not req.softcap > 0)
    plan.groups = (_Strides(*out_strides, *lse_strides, stride_alibi_b),
                   _Mask(bias_mul_b, bias_mul_h, *count_strides, idx_cols), seqlen_q,
                   _Band(seqlen_k, right_offset, left_offset, diagonal_offset),
                   _Scales(qk_scale, mod_unit, pre_scale, dropout_threshold(req.dropout_p), 1.0 - req.dropout_p),
                   _Heads(num_heads, max(head_group, 1), num_heads // num_kv_heads), n_m, n_tiles)
    # One program per SM (every banded configuration takes the dynamic schedule, so does every call with more
    # work items than programs).
    constexprs = dict(
        HEAD_DIM=tile_qk, HEAD_DIM_V=tile_dv, BLOCK_M=block_m, BLOCK_N=block_n, STAGES=stages,
        MASK_RIGHT=req.mask_right, MASK_LEFT=req.mask_left, SOFTCAP=req.softcap > 0,
        HAS_ALIBI=req.alibi_slopes is not None, HAS_SINKS=req.sinks is not None, BIAS=bias_kind, STAGE_O=stage_o,
        NUM_WG=num_wg, DYNAMIC=dynamic, QBUF=qbuf, VARLEN=varlen, LAZY=bool(lazy), DROPOUT=req.dropout_p > 0,
        PAGE=page, PAD_D=pad_d, DEFER=plan.defer, REDO=False)
    grid = (min(n_tiles, _num_sms(q.device.index)), )
    plan.launch = _launch.Bound(_fwd_kernel, grid, (), constexprs, dict(num_warps=4), templates=dict(enumerate(descs)))
    # DEFER's redo pass: the same kernel compiled with REDO (its own compile, started aside once the first pass has
    # launched: GluonFwdPlan.start).
    plan.redo = plan.redo_thread = None
    if plan.defer:
        plan.redo = _launch.Bound(_fwd_kernel, grid, (), dict(constexprs, REDO=True), dict(num_warps=4),
                                  templates=dict(enumerate(descs)))
    return plan
