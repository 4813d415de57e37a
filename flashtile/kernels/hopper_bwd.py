"""Hopper backward written in Gluon: one warp-specialized kernel with the five products of docs/derivation.md ch. 6.

The portable backward (kernels/backward.py) runs two kernels, dK/dV and dQ, and recomputes S and dP in both:
seven products for five. This kernel computes each product once:

* a producer warp (``_bwd_load_partition``) loads the key block's K and V once, then streams the query blocks'
  Q and dO tiles by TMA into a ``STAGES``-deep ring (full/empty mbarriers);
* two consumer warpgroups (``_bwd_partition``), each owning 64 of the block's 128 keys, compute
  S^T = K Q^T and dP^T = V dO^T (issued together), P^T = exp2(S^T - LSE), dS^T = P^T (dP^T - delta), then
  dV += P^T dO and dK += dS^T Q with P^T and dS^T as register operands; both dS^T halves meet in shared memory
  and each warpgroup computes its [64, 64] share of dQ_i = dS K over all 128 keys;
* a writer warp (``_bwd_dq_partition``) adds each staged dQ share into an fp32 buffer by bulk TMA reductions
  (the one reduction a key-block-parallel backward needs).

The partitions share one ``BwdProgram``, built once in ``_bwd_kernel`` (Gluon aggregates: the constexprs and layouts,
the shared memory with its ring, the key block's walk over the query tiles, the band, ...); the loader and the
writer walk the tiles through ``_walk_tiles``. A program owns one key block (of one batch entry and kv head), or
with ``PERSISTENT`` (fixed-length calls up to ``PERSISTENT_MAX_SEQLEN_K`` keys) one program per SM takes such work
items in turn from a global counter: the loader hands each item's walk over through shared memory and loads its
K and V while the consumers still store the previous item's dK and dV.

The reductions land in a varying order, so dQ's rounding varies from run to run (as in flash-attn's default
backward); ``deterministic=True`` (or ``torch.use_deterministic_algorithms(True)``) takes the portable kernels.
Coverage: fp16/bf16, head dims 64, 128 and 256 (96 on d128's tiles, 192 on d256's: TILE_DIM), GQA (the key block
loops over the query heads of its group, so dK and dV are written once, without atomics), and as constexpr variants
of the same loops: sliding windows (causal is the right bound 0, bottom-right aligned), softcap and ALiBi
(docs/derivation.md#8), and sinks (they only change the LSE, which the forward folded them into; their gradient is
computed from LSE and delta in kernels/backward.py). At 256 columns (WIDE) a program owns a block of 64 keys that
both consumer warpgroups share (_bwd_step_wide), without ALiBi, an attn_mask or dropout; at d192 warpgroup 0
accumulates dV and warpgroup 1 dK (WIDE_OWNERS), each with the work item's K in registers (WIDE_K_REGS). MLA's
192/128 runs HALVES instead (HALVES_DIMS, _bwd_step_halves): 128-key blocks as at d128, each query tile taken in two
halves of 32 rows so that a warpgroup's dK and dV of 64 keys fit its registers.
Varlen batches (VARLEN: packed [total, H, D] sequences, flash_attn_varlen_func) run the same loops per sequence:
each program reads its sequence's bounds, bases its descriptors at the sequence's first row with its own length
(TMA zero-fills and clips at the sequence's end) and aligns the band to the sequence's own bottom-right corner.
Each key block visits only the query tiles inside the band, the ones the band's edges cross with the mask.
An attn_mask (BIAS: 1 a float bias of the inputs' dtype, at d128; 2 a bool mask) rides in the ring: the producer
loads each step's [BLOCK_M queries, 128 keys] tile by TMA into the slot of its Q and dO, and each consumer reads
its 64 keys transposed (ldmatrix.trans for a 16-bit bias). A bool mask's key blocks walk lists of the query tiles
it does not hide entirely (Features.block_lists) instead of the band's ranges. The float bias's gradient (DBIAS)
is dS: each consumer writes its 64 keys of it, in the bias's dtype, over the bias tile it has just read
(stmatrix.trans: queries as rows, as the bias), and one TMA store per warpgroup and step puts them in a [B, H, Sq,
Sk] buffer; without softcap that tile is also the dQ product's dS operand, in place of ds_smem.
Dropout (DROPOUT, not with an attn_mask) regenerates the forward's keep-mask per step while S^T and dP^T are in the
tensor cores (_gluon.dropout_tile_keep, keys as rows); at d128 the Philox states spill ~40 registers per step.
"""
import collections

import torch
import triton
import triton.language as tl

from ..reference.dropout import dropout_threshold
from ..request import AttentionRequest
from . import _launch, configs, hopper_fwd
from ._common import LOG2E
from ._gluon import AVAILABLE, CONSUMER_REGS, PRODUCER_REGS
from .features import BIAS_FLOAT, Features

if AVAILABLE:
    from ._gluon import (Ring, TensorDescriptor, Value, aggregate, dropout_tile_keep, fence_async_shared, gl, gluon,
                         mbarrier, mma_over_96, row_pieces_layout, tanh_approx, thread_barrier, tma, tma_load,
                         tma_reduce_add, tma_store, to_float32, warpgroup_mma, warpgroup_mma_wait)
    from .hopper_fwd import _write_tile  # (the forward's hand-over of one int32 to shared memory)

# Key rows per program, by tile width: two consumer warpgroups of 64 keys each up to 128; at 256 (WIDE) both
# warpgroups share one block of 64 keys and split its dK and dV by columns (_bwd_step_wide).
BLOCK_NS = {64: 128, 128: 128, 256: 64}
# Query rows per streamed tile, by tile width: each warpgroup's dQ share is a [64, 64] fp32 tile (see _bwd_step).
BLOCK_M = {64: 128, 128: 64, 256: 64}
# The kernel's tile width by head dim: d96 runs d128's kernel and d192 d256's, their tiles' last columns
# zero-filled by TMA on the loads and masked on the stores (PAD_D), as the forward does for d96 (hopper_fwd.TILE_DIM).
# Every other head dim takes its kernel_dim's path (hopper_fwd.kernel_dim: d80 d96's, d112 d128's, d160 d192's,
# d224 d256's), over its own zero-filled columns.
TILE_DIM = {64: 64, 96: 128, 128: 128, 192: 256, 256: 256}


def kernel_dims(head_dim, head_dim_v):
    """The (q/k, v) head dims whose kernel path a call takes (hopper_fwd.kernel_dim of each): the keys of
    WIDE_ROLES, WIDE_OWNERS, WIDE_K_REGS and HALVES_DIMS."""
    return hopper_fwd.kernel_dim(head_dim), hopper_fwd.kernel_dim(head_dim_v)


def dq_width(head_dim):
    """Columns per query row of the fixed-length dQ buffer (the kernel's dq_desc note): the tile width, but 192 on
    d192's path and MLA's, whose tiles' fourth [64, 64] share (columns 192-255) would only be zeroed and read back."""
    kd = hopper_fwd.kernel_dim(head_dim)
    return 192 if kd == 192 else TILE_DIM[kd]


# Query tiles in flight (the ring of Q, LSE and delta; dO's too below 256, where dO has one buffer of its own).
STAGES = 2
# The (q/k, v) head dims whose WIDE backward has warpgroup 0 compute S^T and warpgroup 1 dP^T for a whole query tile
# (_wide_roles), rather than each both for half of its queries: d256 only. H100, one run, three alternating rounds
# (2026-11-26-h100-bwd-wide-roles-ab.json): d256 1.015-1.09x; d192 0.975x and MLA 0.96-0.97x (their products over
# fewer columns save less of K's and V's reads than the hand-over of P^T costs).
WIDE_ROLES = ((256, 256),)
# The (q/k, v) head dims whose WIDE backward has warpgroup 0 accumulate all of dV and warpgroup 1 all of dK (OWNERS),
# over the head dims' columns only, rather than each half of both over the tile's 256: d192 and MLA's 192/128. Split by
# halves, at d192 a quarter of both products (warpgroup 1's) ran over TMA's zero columns, and under MLA warpgroup 0
# carried dV, dK and two dQ shares per step while warpgroup 1 carried dK (half of it zero columns) and one. Per step
# in [64, 64, 64] products, warpgroup 0 / 1: MLA 6 / 3 (split) against 4 / 4 (owners), d192 6 / 5 against 5 / 4 (their
# S^T and dP^T, 2.5 and 3, apart). H100 (2026-11-27-h100-bwd-wide-owners-ab.json): d192 1.01-1.05x at 4k-16k, MLA
# 0.98-1.03x: the MLA step is held by what it moves through L2, not by the products (docs/design-record.md).
WIDE_OWNERS = ((192, 128), (192, 192))
# The (q/k, v) head dims whose WIDE backward loads each work item's K into registers, once, as the S^T = K Q^T
# products' A operand (K_REGS), rather than reading it from shared memory in every product (each step's S^T read all
# of K per warpgroup). 48 registers a thread at 192 columns. With OWNERS (-bwd-wide-kregs-ab.json): d192 1.02-1.08x
# and MLA 0.99-1.04x over the split kernel.
WIDE_K_REGS = ((192, 128), (192, 192))
# The (q/k, v) head dims whose backward runs HALVES instead of WIDE: a program owns 128 keys, 64 per consumer
# warpgroup as at d128, and takes each 64-row query tile as two 32-row halves, so that a warpgroup's dK and dV of 64
# keys over 192 + 128 columns (160 registers a thread) leave room for [64 keys, 32 queries] scores; Q and K travel as
# three 64-column chunks. Each query tile's dQ shares then sum 128 keys where WIDE's sum 64: half the reductions and
# half the query-side loads per key (_bwd_step_halves; docs/design-record.md).
HALVES_DIMS = ((192, 128),)
# Calls with at most this many keys (varlen: in the longest sequence) run a persistent grid (PERSISTENT: one program
# per SM taking work items from a counter, the next item's K and V loaded while the last one's dK and dV are
# stored); longer ones one program per item. docs/design-record.md, "A persistent backward for short sequences".
PERSISTENT_MAX_SEQLEN_K = 8192
# The persistent consumers' register budget: the work loop's state spills at CONSUMER_REGS (232); 240 still fits the
# register file with the other partitions' (256 + 240 per thread of the two warpgroups, 24 for the two warps).
PERSISTENT_CONSUMER_REGS = tl.constexpr(240)
# Which calls this kernel takes (head dims, a float attn_mask's head dims, the shortest key lengths): the
# GluonHopper allow-list in flashtile/dispatch.py, with its measurements.
# kv heads launched together under a float attn_mask shared by the heads (_grouped_order): 4, where the forward
# takes 8 (attention_backward says why).
HEAD_GROUP = 4
# The kernel's scalar arguments come in named groups (as hopper_fwd's): the batch and row strides of q, k, v, dout,
# (batch, row, head) of dk and dv, alibi's batch stride; the scores' scalars (hopper_fwd.mod_scalars), the softmax
# scale, dropout's threshold and 1 / (1 - p); the query and kv heads and how many kv heads launch together; the
# attn_mask's batch and head factors (_Mul); a bool mask's lists' batch and head strides and columns (_Lists).
_Strides = collections.namedtuple("_Strides", "q_b q_s k_b k_s v_b v_s do_b do_s dk_b dk_s dk_h dv_b dv_s dv_h alibi_b")
_Scales, _Heads, _Mul, _Lists = (collections.namedtuple(name, fields) for name, fields in (
    ("_Scales", "pre_scale qk_scale sm_scale drop_threshold drop_rescale"),
    ("_Heads", "num_heads num_kv_heads head_group n_bh total_q total_k"), ("_Mul", "b h"), ("_Lists", "b h cols")))


@triton.jit
def _dq_from_tiles_kernel(Acc, dQ, Addend, stride_b, stride_s, stride_h, add_b, add_s, add_h, seqlen_q, seqlen_q_pad,
                          num_heads, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, ADD: tl.constexpr,
                          D: tl.constexpr):
    """dQ from the kernel's fp32 tile buffer ([B, H, Sq_pad / BLOCK_M, SHARES, 4096], _bwd_kernel's dq_desc note):
    one program per [64, 64] share of a query tile and (batch, head), cast to dQ's dtype. Each share is an
    accumulator stored by _stage_dq in the order [i, j, w, r, q, e] for row w*16 + i*8 + r, column j*8 + q*2 + e;
    the share is columns 64*share of the tile's 64 rows at d128, d192 and d256 (two, three and four shares), rows
    64*share of its 128 at d64. ADD: a float32 tensor shaped like dQ (strides add_b, add_s, add_h) is added before
    the cast, so the sum is rounded once. D: dQ's head dim; HEAD_DIM: the buffer's columns per query row (dq_width:
    128 for d96, whose columns from D on are not stored; 192 at d192 and MLA)."""
    SHARES: tl.constexpr = BLOCK_M * HEAD_DIM // 4096
    i_share = tl.program_id(0)
    i_bh = tl.program_id(1)
    i_b = i_bh // num_heads
    i_h = i_bh % num_heads
    tile = i_share // SHARES
    share = i_share % SHARES
    row = tl.arange(0, 64)[:, None]
    col = tl.arange(0, 64)[None, :]
    offset = (((row // 8) % 2 * 8 + col // 8) * 128 + row // 16 * 32 + row % 8 * 4 + col // 2 % 4) * 2 + col % 2
    base = (i_bh.to(tl.int64) * seqlen_q_pad + tile * BLOCK_M) * HEAD_DIM + share * 4096
    x = tl.load(Acc + base + offset)
    if BLOCK_M == 64:
        query = tile * BLOCK_M + row
        dim = share * 64 + col
    else:
        query = tile * BLOCK_M + share * 64 + row
        dim = col
    inside = query < seqlen_q
    if D < HEAD_DIM:
        inside = inside & (dim < D)
    if ADD:
        x += tl.load(Addend + i_b.to(tl.int64) * add_b + query.to(tl.int64) * add_s + i_h * add_h + dim, mask=inside,
                     other=0.0)
    ptr = dQ + i_b.to(tl.int64) * stride_b + query.to(tl.int64) * stride_s + i_h * stride_h + dim
    tl.store(ptr, x.to(dQ.dtype.element_ty), mask=inside)


def dq_from_tiles(acc, dq, seqlen_q_pad, addend=None):
    """Write dq ([B, Sq, H, D]) from the Gluon backward's fp32 tile buffer (_dq_from_tiles_kernel); addend: None,
    or a float32 tensor shaped like dq added before the rounding."""
    launch = _dq_from_tiles_launch(dq, seqlen_q_pad, addend)
    launch(_launch.stream_for(dq.get_device()), acc, dq, acc if addend is None else addend)
    return dq


def _dq_from_tiles_launch(dq, seqlen_q_pad, addend=None):
    """dq_from_tiles' launch for dq's shape and strides (and addend's, where given), bound: its call takes
    (stream, acc, dq, addend or acc)."""
    batch, seqlen_q, num_heads, head_dim = dq.shape
    block_m = BLOCK_M[hopper_fwd.tile_dim(head_dim)]
    shares = block_m * dq_width(head_dim) // 4096  # [64, 64] shares per query tile
    grid = (shares * seqlen_q_pad // block_m, batch * num_heads)
    add_strides = (0, 0, 0) if addend is None else addend.stride()[:3]
    return _launch.Bound(_dq_from_tiles_kernel, grid, (dq.stride(0), dq.stride(1), dq.stride(2), *add_strides,
                                                       seqlen_q, seqlen_q_pad, num_heads),
                         dict(HEAD_DIM=dq_width(head_dim), BLOCK_M=block_m, ADD=addend is not None, D=head_dim),
                         dict(num_warps=4), background=True)


if AVAILABLE:

    @aggregate
    class BwdConfig:
        """A launch's compile-time choices (the kernel's constexprs, documented at _bwd_kernel) and what follows
        from them: FLAT (dQ's tile-by-tile buffer, fixed-length batches), ROTATE (no right bound: each key block
        starts its unmasked tiles at a different one), WIDE (tiles of 256 columns: _bwd_step_wide's split of the
        work), the layouts of a warpgroup's [64, BLOCK_M] transposed scores (s_layout; WIDE: [64, BLOCK_M / 2])
        and [64, KV_COLS] dK / dV accumulators (kv_layout; KV_COLS is HEAD_DIM, or its half for WIDE), and the
        register-operand layout dot_a. KV_SPLIT (d96 on d128's tiles): dK and dV are each a pair of accumulators,
        [64, 64] (kv_layout) and [64, 32] (kv_layout_b), over the head dim's 96 columns instead of the tile's 128.
        OWNERS (WIDE at d192 and MLA: WIDE_OWNERS): warpgroup 0 accumulates dV and warpgroup 1 dK, each over its
        head dim's columns: [64, 128] (kv_layout), at 192 with a second [64, 64] accumulator (kv_layout_b).
        K_REGS (WIDE at d192 and MLA: WIDE_K_REGS): the work item's K in registers, the S^T products' A operand.
        HALVES (MLA's 192/128 on HEAD_DIM 256's dQ buffer: HALVES_DIMS): 128-key blocks and 32-query halves
        (_bwd_step_halves), not WIDE; s_layout is [64, 32], kv_layout dV's [64, 128] and kv_layout_b each of dK's
        three [64, 64] column chunks. SKIP_DEAD: a warpgroup skips its products on masked tiles that see none of
        its keys (_dead_keys)."""
        HEAD_DIM: gl.constexpr
        BLOCK_M: gl.constexpr
        BLOCK_N: gl.constexpr
        STAGES: gl.constexpr
        MASK_LEFT: gl.constexpr
        MASK_RIGHT: gl.constexpr
        SOFTCAP: gl.constexpr
        HAS_ALIBI: gl.constexpr
        BIAS: gl.constexpr
        DBIAS: gl.constexpr
        VARLEN: gl.constexpr
        DROPOUT: gl.constexpr
        PERSISTENT: gl.constexpr
        D: gl.constexpr
        D_V: gl.constexpr
        PAD_D: gl.constexpr
        FLAT: gl.constexpr
        ROTATE: gl.constexpr
        WIDE: gl.constexpr
        ROLES: gl.constexpr
        OWNERS: gl.constexpr
        K_REGS: gl.constexpr
        HALVES: gl.constexpr
        SKIP_DEAD: gl.constexpr
        DQ_WIDTH: gl.constexpr
        KV_COLS: gl.constexpr
        KV_SPLIT: gl.constexpr
        dtype: gl.constexpr
        s_layout: gl.constexpr
        kv_layout: gl.constexpr
        kv_layout_b: gl.constexpr
        dot_a: gl.constexpr

        @gluon.constexpr_function
        def __init__(self, HEAD_DIM, BLOCK_M, BLOCK_N, STAGES, MASK_LEFT, MASK_RIGHT, SOFTCAP, HAS_ALIBI, BIAS, DBIAS,
                     VARLEN, DROPOUT, PERSISTENT, D, D_V, dtype, ROLES=False, OWNERS=False, K_REGS=False,
                     HALVES=False):
            self.HEAD_DIM = gl.constexpr(HEAD_DIM)
            self.BLOCK_M = gl.constexpr(BLOCK_M)
            self.BLOCK_N = gl.constexpr(BLOCK_N)
            self.STAGES = gl.constexpr(STAGES)
            self.MASK_LEFT = gl.constexpr(MASK_LEFT)
            self.MASK_RIGHT = gl.constexpr(MASK_RIGHT)
            self.SOFTCAP = gl.constexpr(SOFTCAP)
            self.HAS_ALIBI = gl.constexpr(HAS_ALIBI)
            self.BIAS = gl.constexpr(BIAS)
            self.DBIAS = gl.constexpr(DBIAS)
            self.VARLEN = gl.constexpr(VARLEN)
            self.DROPOUT = gl.constexpr(DROPOUT)
            self.PERSISTENT = gl.constexpr(PERSISTENT)
            self.D = gl.constexpr(D)
            self.D_V = gl.constexpr(D_V)
            self.PAD_D = gl.constexpr(D != HEAD_DIM or D_V != HEAD_DIM)
            self.FLAT = gl.constexpr(not VARLEN)
            self.ROTATE = gl.constexpr(not MASK_RIGHT)
            self.HALVES = gl.constexpr(HEAD_DIM == 256 and D == 192 and D_V == 128 and HALVES)
            self.DQ_WIDTH = gl.constexpr(192 if HEAD_DIM == 256 and 128 < D <= 192 else HEAD_DIM)  # (dq_width)
            wide = HEAD_DIM == 256 and not self.HALVES
            self.WIDE = gl.constexpr(wide)
            self.ROLES = gl.constexpr(wide and ROLES)
            self.OWNERS = gl.constexpr(wide and 128 < D <= 192 and OWNERS and not ROLES)
            self.K_REGS = gl.constexpr(wide and 128 < D <= 192 and K_REGS and not ROLES)
            # A banded call's masked tiles may see none of a warpgroup's 64 keys (_dead_keys): that warpgroup then
            # computes nothing but its dQ share (_dead_step). On d128's tiles (d96 and d128), whose 64-row query tiles
            # meet a causal diagonal twice per 128-key block, the second warpgroup's keys unseen by the first:
            # d128 causal 1.056x / 1.043x / 1.009x at 1k / 2k / 4k on an H100, d96 within +-1%
            # (docs/design-record.md, "Masked tiles that see none of a warpgroup's keys"). Not with an attn_mask,
            # whose tiles and bias gradient go through the step.
            self.SKIP_DEAD = gl.constexpr((MASK_RIGHT or MASK_LEFT) and BIAS == 0 and HEAD_DIM == 128)
            self.KV_COLS = gl.constexpr(HEAD_DIM // 2 if HEAD_DIM == 256 else HEAD_DIM)
            # (d96's path: head dims 72-96, their columns past D TMA's zeros.)
            self.KV_SPLIT = gl.constexpr(HEAD_DIM == 128 and 64 < D <= 96 and D_V == D)
            self.dtype = gl.constexpr(dtype)
            kv_layout = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                  instr_shape=[16, 64 if self.KV_SPLIT else self.KV_COLS.value, 16])
            # (KV_SPLIT: P^T and dS^T are both products' operand in kv_layout's dot_a, as the forward's P for d192's
            # two V products: a register operand's layout does not depend on the product's width.)
            self.kv_layout_b = gl.constexpr(gl.NVMMADistributedLayout(
                version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 64 if self.OWNERS or self.HALVES else 32, 16]))
            s_cols = BLOCK_M // 2 if HEAD_DIM == 256 and not ROLES else BLOCK_M
            self.s_layout = gl.constexpr(gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                                   instr_shape=[16, s_cols, 16]))
            self.kv_layout = gl.constexpr(kv_layout)
            self.dot_a = gl.constexpr(gl.DotOperandLayout(operand_index=0, parent=kv_layout, k_width=2))

    # The aggregates below group what the partitions share; BwdProgram holds them all. Their field order is not
    # free: warp_specialize hands the worker partitions their values (those a worker uses) in the order they first
    # appear in the flattened arguments, and that order shapes ptxas's schedule of each partition. The order here
    # (the consumers' values first, in these groups; then the loader's own, BwdLoads; then the dQ writer's, BwdDq)
    # is the one the kernel was measured with.

    @aggregate
    class BwdPtrs:
        """The tensors the consumers address in global memory: dK and dV (stored at the end), ALiBi's slopes."""
        dK: gl.tensor
        dV: gl.tensor
        Alibi: gl.tensor

    @aggregate
    class BwdSmem:
        """The backward's shared memory. The ring (q_bar, STAGES slots) holds each step's Q and dO tiles, its rows'
        LSE and delta and its attn_mask tile (bias; its gradient goes out from there through dbias_desc);
        offsets: ALiBi's query offsets per warpgroup (_bwd_step); k, v: the key block (kv_bar); ds: dS^T in two
        alternating buffers (both halves in: ds_ready); dq: each warpgroup's staged dQ share for the writer
        (dq_bars[2w] "staged", dq_bars[2w + 1] "read by the writer"; HALVES: one dS tile, ds_ready[0] both halves in
        and ds_ready[1] both dQ products done, and three staging tiles s with dq_bars[2s], [2s + 1]); item: the index
        of the program's j-th work item in slot j % 2, written by the loader before that item's K and V are loaded
        (kv_bar's j-th phase); kv_free: both consumers are done with the item's K and V (their last step's products
        have completed)."""
        lse: gl.shared_memory_descriptor
        delta: gl.shared_memory_descriptor
        offsets: gl.shared_memory_descriptor
        bias: gl.shared_memory_descriptor
        dbias_desc: Value
        dq_bars: gl.shared_memory_descriptor
        k: gl.shared_memory_descriptor
        v: gl.shared_memory_descriptor
        q: gl.shared_memory_descriptor
        do: gl.shared_memory_descriptor
        ds: gl.shared_memory_descriptor
        ds_ready: gl.shared_memory_descriptor
        dq: gl.shared_memory_descriptor
        kv_bar: gl.shared_memory_descriptor
        q_bar: Ring
        item: gl.shared_memory_descriptor
        kv_free: gl.shared_memory_descriptor

    @aggregate
    class BwdWalk:
        """The key block this program owns (keys from start_n of kv head i_hk, batch entry i_b) and the query
        tiles it visits for each of the group_size query heads of its kv head: m_lo + i * BLOCK_M for i < n_q, the
        n_mask masked ones first (_masked_tile), then the others rotated by shift (_free_tile); see "Tile
        order". q0, k0: the first rows of the item's sequence in the packed tensors when a persistent varlen program
        reads them through descriptors over all rows (else 0: the pointers are based there)."""
        i_b: Value
        i_hk: Value
        start_n: Value
        m_lo: Value
        n_q: Value
        i_full: Value
        i_diag: Value
        i_diag_end: Value
        i_end: Value
        n_mask: Value
        shift: Value
        group_size: Value
        q0: Value
        k0: Value

    @aggregate
    class BwdBand:
        """Sk (the sequence's own under VARLEN) and the band: query i sees key j iff j - diag_offset - window_right
        <= i <= j - diag_offset + window_left (a window of -1 is unbounded)."""
        seqlen_k: Value
        diag_offset: Value
        window_left: Value
        window_right: Value

    @aggregate
    class BwdMods:
        """The scores' scalars (hopper_fwd.mod_scalars: pre_scale, qk_scale; sm_scale, which dS carries) and
        ALiBi's batch stride."""
        pre_scale: Value
        qk_scale: Value
        sm_scale: Value
        stride_alibi_b: Value

    @aggregate
    class BwdStrides:
        """dK's and dV's batch, row and head strides."""
        dk_b: Value
        dk_s: Value
        dk_h: Value
        dv_b: Value
        dv_s: Value
        dv_h: Value

    @aggregate
    class BwdLists:
        """A bool attn_mask's lists of query tiles per key block (_list_row): Counts, Idx with strides stride_b,
        stride_h and n_cols columns."""
        Counts: gl.tensor
        Idx: gl.tensor
        stride_b: Value
        stride_h: Value
        n_cols: Value

    @aggregate
    class BwdDropout:
        """Dropout: the Philox key Seed, bh0 = i_b * num_heads (a query head's counter word is bh0 + i_h), the keep
        threshold and rescale = 1 / (1 - p)."""
        Seed: gl.tensor
        bh0: Value
        threshold: Value
        rescale: Value

    @aggregate
    class BwdLoads:
        """What only the loader reads: the descriptors of Q, dO, K, V, LSE, delta and the attn_mask's tiles (bias:
        a placeholder without one), num_heads, and the factors that turn a batch and a head index into the
        attn_mask's (0 along a broadcast dim)."""
        q_desc: Value
        do_desc: Value
        k_desc: Value
        v_desc: Value
        lse_desc: Value
        delta_desc: Value
        bias_desc: Value
        num_heads: Value
        bias_mul_b: Value
        bias_mul_h: Value

    @aggregate
    class BwdDq:
        """What only the dQ writer reads: the fp32 buffer's descriptor and its rows per batch entry (FLAT)."""
        desc: Value
        batch_rows: Value

    @aggregate
    class BwdSched:
        """The work list: n_items = n_blocks * n_bh work items (a key block of one batch entry x kv head), taken
        by a persistent grid (the first per program its index, the others from the global Counter) in the order of
        _walk_at (varlen batches: _varlen_walk_at, over the longest sequence's key blocks, CuSeqQ and CuSeqK giving
        each item's own); or one item per program (n_items 1, its walk computed in _bwd_kernel). head_group,
        num_kv_heads, seqlen_q (the longest under VARLEN) and group_size as in _bwd_kernel."""
        Counter: gl.tensor
        CuSeqQ: gl.tensor
        CuSeqK: gl.tensor
        n_items: Value
        n_blocks: Value
        n_bh: Value
        head_group: Value
        num_kv_heads: Value
        seqlen_q: Value
        group_size: Value

    @aggregate
    class BwdProgram:
        """Everything the partitions of one program share (built once in _bwd_kernel; walk and drop.bh0 are the
        current work item's: _item_program)."""
        cfg: BwdConfig
        ptrs: BwdPtrs
        smem: BwdSmem
        walk: BwdWalk
        band: BwdBand
        mods: BwdMods
        strides: BwdStrides
        lists: BwdLists
        drop: BwdDropout
        loads: BwdLoads
        dq: BwdDq
        sched: BwdSched

    @aggregate
    class BwdHalf:
        """One consumer warpgroup's half of the key block: keys key0 + (0 .. 63) (key, in the rows of the scores'
        layout), its K and V rows, its dQ staging tile and ALiBi offsets row, and its index half."""
        key0: Value
        key: gl.tensor
        k: gl.shared_memory_descriptor
        v: gl.shared_memory_descriptor
        dq: gl.shared_memory_descriptor
        offsets: gl.shared_memory_descriptor
        half: gl.constexpr

    # Tile order. A key block visits the query tiles m_lo + i * BLOCK_M, i < n_q, that see it; every partition
    # (loader, consumers, writer) walks them in the same order: first the n_mask masked ones, i in [0, i_full)
    # (crossed by the band's right edge), [i_diag, i_diag_end) (crossed by the diagonal; ALiBi only, see
    # _bwd_step) and [i_end, n_q) (crossed by the band's left edge); then the n_q - n_mask unmasked ones,
    # [i_full, i_diag) and [i_diag_end, i_end), rotated by shift (_bwd_kernel says why).

    @gluon.jit
    def _masked_tile(walk, p):
        """Index of the p-th masked tile."""
        i = p + gl.where(p >= walk.i_full, walk.i_diag - walk.i_full, 0)
        return i + gl.where(i >= walk.i_diag_end, walk.i_end - walk.i_diag_end, 0)

    @gluon.jit
    def _free_tile(walk, j, ROTATE: gl.constexpr):
        """Index of the j-th unmasked tile (n_q - n_mask of them)."""
        n_free = walk.n_q - walk.n_mask
        if ROTATE:
            j += walk.shift  # < 2 n_free: a compare instead of a division
            j = gl.where(j >= n_free, j - n_free, j)
        i = walk.i_full + j
        return i + gl.where(i >= walk.i_diag, walk.i_diag_end - walk.i_diag, 0)

    @gluon.jit
    def _tile_start(walk, p, BLOCK_M: gl.constexpr, ROTATE: gl.constexpr):
        """First query row of the p-th tile in the partitions' order."""
        if p < walk.n_mask:
            i = _masked_tile(walk, p)
        else:
            i = _free_tile(walk, p - walk.n_mask, ROTATE)
        return walk.m_lo + i * BLOCK_M

    # A bool attn_mask (BIAS == 2) replaces the ranges by a list (Features.block_lists, transposed): per (batch,
    # head, key block) the count and ascending indices of the query tiles with any attended element, so the tiles
    # the mask hides entirely cost nothing. Every listed tile takes the masked path (the mask applies elementwise,
    # with the band's edges where a window is set too). The walk starts at entry i_n % count, for the reason
    # ROTATE does.

    @gluon.jit
    def _list_row(lists, i_b, i_h, i_n):
        """(row of the lists, count of its tiles, rotation) for query head i_h and key block i_n."""
        row = i_b * lists.stride_b + i_h * lists.stride_h + i_n
        count = gl.load(lists.Counts + row)
        return row, count, i_n % gl.maximum(count, 1)

    @gluon.jit
    def _listed_tile(lists, row, p, count, shift, BLOCK_M: gl.constexpr):
        """First query row of the p-th listed tile of the list `row`, rotated by shift (< count)."""
        p += shift
        p = gl.where(p >= count, p - count, p)
        return gl.load(lists.Idx + row * lists.n_cols + p) * BLOCK_M

    @gluon.jit
    def _load_q_tile(prog, t, m, i_h):
        """The loader's loads for the t-th step: query rows [m, m + BLOCK_M) of head i_h into ring slot t % STAGES
        (with the attn_mask tile of those rows and the key block)."""
        cfg = prog.cfg
        loads = prog.loads
        smem = prog.smem
        slot = smem.q_bar.wait_empty(t)
        nbytes: gl.constexpr = (loads.q_desc.block_type.nbytes + loads.do_desc.block_type.nbytes
                                + 2 * loads.lse_desc.block_type.nbytes)
        if cfg.BIAS:
            mbarrier.expect(smem.q_bar.full.index(slot), nbytes + loads.bias_desc.block_type.nbytes)
        else:
            mbarrier.expect(smem.q_bar.full.index(slot), nbytes)
        i_b = prog.walk.i_b
        row = prog.walk.q0 + m
        _load_rows(cfg, loads.q_desc, i_b, row, i_h, smem.q_bar.full.index(slot), smem.q.index(slot))
        _load_rows(cfg, loads.do_desc, i_b, row, i_h, smem.q_bar.full.index(slot), smem.do.index(slot))
        # The rows' LSE and delta ride along: read from shared memory where the softmax needs them, they hold
        # no registers across the products (at d128 registers are what the consumers run short of).
        tma_load(loads.lse_desc, [i_b * loads.num_heads + i_h, m], smem.q_bar.full.index(slot), smem.lse.index(slot))
        tma_load(loads.delta_desc, [i_b * loads.num_heads + i_h, m], smem.q_bar.full.index(slot),
                 smem.delta.index(slot))
        if cfg.BIAS:
            # The attn_mask tile [BLOCK_M queries, BLOCK_N keys] rides in the same slot (released with Q and dO).
            tile = smem.bias.index(slot)
            tma_load(loads.bias_desc, [i_b * loads.bias_mul_b, i_h * loads.bias_mul_h, m, prog.walk.start_n],
                     smem.q_bar.full.index(slot), tile.reshape([1, 1, tile.shape[0], tile.shape[1]]))

    @gluon.jit
    def _load_q_tile_wide(prog, t, m, i_h):
        """_load_q_tile for WIDE: Q with its rows' LSE and delta into ring slot t % STAGES; dO into its one buffer
        (barriers q_bar.full / q_bar.empty at index STAGES), once both consumers' dV products of step t - 1 have
        read it. (Two dO buffers would not fit: at 256 columns each tile is 32 KB.)"""
        cfg = prog.cfg
        loads = prog.loads
        smem = prog.smem
        i_b = prog.walk.i_b
        row = prog.walk.q0 + m
        slot = smem.q_bar.wait_empty(t)
        bar = smem.q_bar.full.index(slot)
        mbarrier.expect(bar, loads.q_desc.block_type.nbytes + 2 * loads.lse_desc.block_type.nbytes)
        _load_rows(cfg, loads.q_desc, i_b, row, i_h, bar, smem.q.index(slot))
        tma_load(loads.lse_desc, [i_b * loads.num_heads + i_h, m], bar, smem.lse.index(slot))
        tma_load(loads.delta_desc, [i_b * loads.num_heads + i_h, m], bar, smem.delta.index(slot))
        mbarrier.wait(smem.q_bar.empty.index(cfg.STAGES), (t & 1) ^ 1)
        do_bar = smem.q_bar.full.index(cfg.STAGES)
        mbarrier.expect(do_bar, loads.do_desc.block_type.nbytes)
        _load_rows(cfg, loads.do_desc, i_b, row, i_h, do_bar, smem.do.index(0))

    @gluon.jit
    def _load_q_tile_halves(prog, t, m, i_h):
        """_load_q_tile for HALVES: Q's three 64-column chunks, dO, and the rows' LSE and delta into ring slot
        t % STAGES."""
        cfg = prog.cfg
        loads = prog.loads
        smem = prog.smem
        i_b = prog.walk.i_b
        row = prog.walk.q0 + m
        slot = smem.q_bar.wait_empty(t)
        bar = smem.q_bar.full.index(slot)
        mbarrier.expect(bar, 3 * loads.q_desc.block_type.nbytes + loads.do_desc.block_type.nbytes
                        + 2 * loads.lse_desc.block_type.nbytes)
        for c in gl.static_range(3):
            _load_cols(cfg, loads.q_desc, i_b, row, i_h * cfg.D + 64 * c, bar, smem.q.index(3 * slot + c))
        _load_cols(cfg, loads.do_desc, i_b, row, i_h * cfg.D_V, bar, smem.do.index(slot))
        tma_load(loads.lse_desc, [i_b * loads.num_heads + i_h, m], bar, smem.lse.index(slot))
        tma_load(loads.delta_desc, [i_b * loads.num_heads + i_h, m], bar, smem.delta.index(slot))

    @gluon.jit
    def _load_cols(cfg, desc, i_b, row, col, bar, dst):
        """TMA-load the tile of dst's shape at sequence row `row`, column `col` (a head's offset; under HALVES plus a
        chunk's) of batch entry i_b into dst: 2-D descriptors over [rows, heads * head dim] under VARLEN, else 3-D
        ones with the batch entries first (_bwd_descriptors)."""
        if cfg.VARLEN:
            tma_load(desc, [row, col], bar, dst)
        else:
            tma_load(desc, [i_b, row, col], bar, dst.reshape([1, dst.shape[0], dst.shape[1]]))

    @gluon.jit
    def _load_rows(cfg, desc, i_b, row, i_h, bar, dst):
        """TMA-load the [rows, HEAD_DIM] tile at sequence row `row`, head i_h of batch entry i_b into dst: 2-D
        descriptors of one sequence under VARLEN, else 3-D ones over [B, S, heads * HEAD_DIM] (_bwd_descriptors)."""
        if cfg.PAD_D:
            # One more dimension, the heads', so that TMA zero-fills the tile's columns from D on.
            if cfg.VARLEN:
                tma_load(desc, [row, i_h, 0], bar, dst.reshape([dst.shape[0], 1, dst.shape[1]]))
            else:
                tma_load(desc, [i_b, row, i_h, 0], bar, dst.reshape([1, dst.shape[0], 1, dst.shape[1]]))
        else:
            _load_cols(cfg, desc, i_b, row, i_h * cfg.HEAD_DIM, bar, dst)

    @gluon.jit
    def _bwd_load_partition(prog):
        """The loader warp: for each work item of the program (_next_item), its index handed over (smem.item), the
        key block's K and V once both consumers are done with the previous item's (kv_free), then each step's
        query-side tiles (_load_q_tile); at the end n_items in place of an index."""
        cfg = prog.cfg
        smem = prog.smem
        if cfg.PERSISTENT:
            sched = prog.sched
            item = gl.program_id(0)
            j = 0  # items so far
            u = 0  # query tiles so far (the ring's uses)
            while item < sched.n_items:
                if cfg.VARLEN:
                    walk, band, valid = _varlen_walk_at(cfg, sched, prog.band, item)
                else:
                    walk = _walk_at(cfg, sched, prog.band, item)
                    band = prog.band
                    valid = item >= 0
                if valid:  # (a varlen key block past its sequence's keys is no item)
                    if j > 0:
                        mbarrier.wait(smem.kv_free, (j - 1) & 1)
                    _hand_over(smem.item, j, walk, band, cfg.VARLEN)
                    _load_kv(prog, walk)
                    if cfg.WIDE:
                        u = _walk_tiles(_item_program(prog, walk, band), u, _load_q_tile_wide)
                    elif cfg.HALVES:
                        u = _walk_tiles(_item_program(prog, walk, band), u, _load_q_tile_halves)
                    else:
                        u = _walk_tiles(_item_program(prog, walk, band), u, _load_q_tile)
                    j += 1
                item = _next_item(prog)
            if j > 0:
                mbarrier.wait(smem.kv_free, (j - 1) & 1)
            _write_tile(smem.item.index(j % 2 * ITEM_FIELDS), -1)  # no item left
            mbarrier.arrive(smem.kv_bar, count=1)
        else:
            _load_kv(prog, prog.walk)
            if cfg.WIDE:
                _walk_tiles(prog, gl.program_id(0) * 0, _load_q_tile_wide)
            elif cfg.HALVES:
                _walk_tiles(prog, gl.program_id(0) * 0, _load_q_tile_halves)
            else:
                _walk_tiles(prog, gl.program_id(0) * 0, _load_q_tile)  # (a tensor: the count is loop-carried)

    @gluon.jit
    def _load_kv(prog, walk):
        """The work item's K and V blocks, on kv_bar."""
        smem = prog.smem
        cfg = prog.cfg
        loads = prog.loads
        row = walk.k0 + walk.start_n
        if cfg.HALVES:
            # K in three 64-column chunks.
            mbarrier.expect(smem.kv_bar, 3 * loads.k_desc.block_type.nbytes + loads.v_desc.block_type.nbytes)
            for c in gl.static_range(3):
                _load_cols(cfg, loads.k_desc, walk.i_b, row, walk.i_hk * cfg.D + 64 * c, smem.kv_bar, smem.k.index(c))
            _load_cols(cfg, loads.v_desc, walk.i_b, row, walk.i_hk * cfg.D_V, smem.kv_bar, smem.v.index(0))
        else:
            mbarrier.expect(smem.kv_bar, loads.k_desc.block_type.nbytes + loads.v_desc.block_type.nbytes)
            _load_rows(cfg, loads.k_desc, walk.i_b, row, walk.i_hk, smem.kv_bar, smem.k)
            _load_rows(cfg, loads.v_desc, walk.i_b, row, walk.i_hk, smem.kv_bar, smem.v)

    @gluon.jit
    def _next_item(prog):
        """The loader's next work item (PERSISTENT): from the global counter, in list order after the grid's first
        items. Every program takes once per item it runs (the grid has at most n_items programs), so the takes
        number n_items, and the one that returns n_items - 1 is the launch's last: it zeroes the counter for the
        next launch (hopper_fwd._schedule_counter, which the forward's dynamic schedule leaves at zero the same
        way). The take is relaxed, as the forward's: an index orders no data."""
        sched = prog.sched
        taken = gl.atomic_add(sched.Counter, 1, sem="relaxed")
        if taken == sched.n_items - 1:
            gl.atomic_xchg(sched.Counter, 0)
        return gl.num_programs(0) + taken

    # A work item's walk goes from the loader to the other partitions through shared memory (smem.item: two slots
    # of ITEM_FIELDS int32, the j-th item's in slot j % 2), written before its K and V are loaded: the consumers and
    # the writer read it once kv_bar's j-th phase has completed, and hold none of the work list's scalars
    # themselves (at d128 the consumers have no registers to spare). A batch index of -1 ends the list. 11 fields
    # are used; 16 keeps a slot's offset a shift.
    ITEM_FIELDS = gl.constexpr(16)

    @gluon.jit
    def _hand_over(item_smem, j, walk, band, VARLEN: gl.constexpr):
        """The loader's hand-over of the j-th work item's walk (all but group_size; under VARLEN also its rows'
        offsets and its sequence's band)."""
        base = (j % 2) * ITEM_FIELDS
        _write_tile(item_smem.index(base), walk.i_b)
        _write_tile(item_smem.index(base + 1), walk.i_hk)
        _write_tile(item_smem.index(base + 2), walk.start_n)
        _write_tile(item_smem.index(base + 3), walk.m_lo)
        _write_tile(item_smem.index(base + 4), walk.n_q)
        _write_tile(item_smem.index(base + 5), walk.i_full)
        _write_tile(item_smem.index(base + 6), walk.i_diag)
        _write_tile(item_smem.index(base + 7), walk.i_diag_end)
        _write_tile(item_smem.index(base + 8), walk.i_end)
        _write_tile(item_smem.index(base + 9), walk.n_mask)
        _write_tile(item_smem.index(base + 10), walk.shift)
        if VARLEN:
            _write_tile(item_smem.index(base + 11), walk.q0)
            _write_tile(item_smem.index(base + 12), walk.k0)
            _write_tile(item_smem.index(base + 13), band.seqlen_k)
            _write_tile(item_smem.index(base + 14), band.diag_offset)

    @gluon.jit
    def _read_field(item_smem, i, WARPS: gl.constexpr):
        """Entry i of smem.item, read by a partition of WARPS warps (hopper_fwd._read_tile's read, for any warps)."""
        layout: gl.constexpr = gl.BlockedLayout([1], [32], [WARPS], [0])
        return gl.max(item_smem.index(i).load(layout), 0)

    @gluon.jit
    def _item_batch(prog, j, WARPS: gl.constexpr):
        """The j-th work item's batch index (-1: no item left), once its K and V have arrived (or the loader's
        end mark): read by a partition of WARPS warps."""
        mbarrier.wait(prog.smem.kv_bar, j & 1)
        return _read_field(prog.smem.item, (j % 2) * ITEM_FIELDS, WARPS)

    @gluon.jit
    def _read_walk(prog, j, i_b, WARPS: gl.constexpr):
        """The j-th work item's walk and band (after _item_batch)."""
        item_smem = prog.smem.item
        base = (j % 2) * ITEM_FIELDS
        q0 = i_b * 0
        k0 = q0
        band = prog.band
        if prog.cfg.VARLEN:
            q0 = _read_field(item_smem, base + 11, WARPS)
            k0 = _read_field(item_smem, base + 12, WARPS)
            band = BwdBand(_read_field(item_smem, base + 13, WARPS), _read_field(item_smem, base + 14, WARPS),
                           band.window_left, band.window_right)
        walk = BwdWalk(i_b, _read_field(item_smem, base + 1, WARPS), _read_field(item_smem, base + 2, WARPS),
                       _read_field(item_smem, base + 3, WARPS), _read_field(item_smem, base + 4, WARPS),
                       _read_field(item_smem, base + 5, WARPS), _read_field(item_smem, base + 6, WARPS),
                       _read_field(item_smem, base + 7, WARPS), _read_field(item_smem, base + 8, WARPS),
                       _read_field(item_smem, base + 9, WARPS), _read_field(item_smem, base + 10, WARPS),
                       prog.sched.group_size, q0, k0)
        return walk, band

    @gluon.jit
    def _walk_at(cfg, sched, band, item):
        """The BwdWalk of work item `item` of a fixed-length batch: key block i_n of batch entry x kv head i_bh,
        item = i_bh * n_blocks + i_n before _bwd_kernel's reordering."""
        n_blocks = sched.n_blocks
        i_n = item % n_blocks
        i_bh = item // n_blocks
        if cfg.MASK_RIGHT or cfg.BIAS == 2:
            i_n, i_bh = _grouped_order(i_n, i_bh, gl.maximum(gl.cdiv(128, n_blocks), sched.head_group), n_blocks,
                                       sched.n_bh)
        elif sched.head_group > 1:
            i_n, i_bh = _grouped_order(i_n, i_bh, sched.head_group, n_blocks, sched.n_bh)
        start_n = i_n * cfg.BLOCK_N
        m_lo, n_q, i_full, i_diag, i_diag_end, i_end, n_mask, shift = _query_tiles(
            cfg, i_n, start_n, sched.seqlen_q, band.seqlen_k, band.diag_offset, band.window_left, band.window_right)
        none = i_n * 0
        return BwdWalk(i_bh // sched.num_kv_heads, i_bh % sched.num_kv_heads, start_n, m_lo, n_q, i_full, i_diag,
                       i_diag_end, i_end, n_mask, shift, sched.group_size, none, none)

    @gluon.jit
    def _varlen_walk_at(cfg, sched, band, item):
        """(walk, band, whether it is an item) of entry `item` of a persistent varlen program's list: key block i_n
        of sequence i_b, kv head i_hk, item = (i_b * num_kv_heads + i_hk) * n_blocks + i_n (n_blocks over the
        longest sequence: blocks past this one's keys are none), with the sequence's own lengths and bottom-right
        diagonal, as _bwd_kernel's one-item varlen programs."""
        i_n = item % sched.n_blocks
        i_bh = item // sched.n_blocks
        i_b = i_bh // sched.num_kv_heads
        start_n = i_n * cfg.BLOCK_N
        q_start, len_q = _seq_span(sched.CuSeqQ, i_b, sched.seqlen_q)
        k_start, len_k = _seq_span(sched.CuSeqK, i_b, band.seqlen_k)
        diag_offset = (gl.load(sched.CuSeqK + i_b + 1) - k_start) - (gl.load(sched.CuSeqQ + i_b + 1) - q_start)
        m_lo, n_q, i_full, i_diag, i_diag_end, i_end, n_mask, shift = _query_tiles(
            cfg, i_n, start_n, len_q, len_k, diag_offset, band.window_left, band.window_right)
        walk = BwdWalk(i_b, i_bh % sched.num_kv_heads, start_n, m_lo, n_q, i_full, i_diag, i_diag_end, i_end, n_mask,
                       shift, sched.group_size, q_start, k_start)
        return walk, BwdBand(len_k, diag_offset, band.window_left, band.window_right), start_n < len_k

    @gluon.jit
    def _item_program(prog, walk, band):
        """prog with a work item's walk, band and dropout counter base."""
        drop = prog.drop
        if prog.cfg.DROPOUT:
            drop = BwdDropout(drop.Seed, walk.i_b * prog.loads.num_heads, drop.threshold, drop.rescale)
        return BwdProgram(prog.cfg, prog.ptrs, prog.smem, walk, band, prog.mods, prog.strides, prog.lists, drop,
                          prog.loads, prog.dq, prog.sched)

    @gluon.jit
    def _walk_tiles(prog, u, STEP: gl.constexpr):
        """STEP(prog, u, m, i_h) for the query tiles the work item visits (rows from m of query head i_h; u counts
        the program's tiles, from the given u on), in the partitions' order: the kv head's query heads in turn,
        each one's listed tiles (a bool attn_mask) or its range (_tile_start). (The consumers walk the same order
        in two loops, masked tiles and the rest.) Returns the count after them."""
        cfg = prog.cfg
        walk = prog.walk
        if cfg.BIAS == 2:
            for g in range(walk.group_size):
                i_h = walk.i_hk * walk.group_size + g
                row, count, rot = _list_row(prog.lists, walk.i_b, i_h, walk.start_n // cfg.BLOCK_N)
                for p in range(count):
                    m = _listed_tile(prog.lists, row, p, count, rot, cfg.BLOCK_M)
                    STEP(prog, u, m, i_h)
                    u += 1
        else:
            for v in range(walk.group_size * walk.n_q):
                i_h = walk.i_hk * walk.group_size + v // walk.n_q
                m = _tile_start(walk, v % walk.n_q, cfg.BLOCK_M, cfg.ROTATE)
                STEP(prog, u + v, m, i_h)
            u += walk.group_size * walk.n_q
        return u

    @gluon.jit
    def _stage_dq(dq, dq_smem, dq_bars, u, half: gl.constexpr, FLAT: gl.constexpr):
        """Hand a partial dQ tile to the writer warp (_bwd_dq_partition) through this warpgroup's staging tile:
        wait until the writer's previous reduction has read the tile, store, then signal it. FLAT: the [64, 64]
        share goes to a plain [16, 256] tile in the order of the product's accumulator fragments (_dq_from_tiles_kernel
        reads it back)."""
        mbarrier.wait(dq_bars.index(2 * half + 1), (u & 1) ^ 1)
        if FLAT:
            # Rows w*16 + i*8 + r, columns j*8 + q*2 + e (w the warp, r and q the lane's row and column in it,
            # i, j, e register indices in wgmma's fragment) to [i, j | w, r, q, e]: each thread's two adjacent
            # values are 8 bytes of a warp's 256 contiguous ones, so every store is two full wavefronts. (The
            # 128-byte swizzled [64, 64] tile took four: the rows r, r ^ 1 of a half-warp hit the same banks.)
            dq_smem.store(dq.reshape([4, 2, 8, 8, 4, 2]).permute((1, 3, 0, 2, 4, 5)).reshape([16, 256]))
        else:
            dq_smem.store(dq)
        fence_async_shared()
        thread_barrier()
        mbarrier.arrive(dq_bars.index(2 * half), count=1)

    @gluon.jit
    def _reduce_dq(prog, u, m, i_h):
        """The writer's u-th step: add both warpgroups' staged shares of query head i_h's dQ tile at query m of
        the program's batch entry into the buffer (the kernel's dq_desc note)."""
        cfg = prog.cfg
        if cfg.WIDE:
            _reduce_dq_wide(prog, u, m, i_h)
        elif cfg.HALVES:
            _reduce_dq_halves(prog, u, m, i_h)
        else:
            _reduce_dq_shares(prog, u, m, i_h)

    @gluon.jit
    def _reduce_dq_halves(prog, t, m, i_h):
        """_reduce_dq under HALVES: shares 0, 1 (warpgroup 0) and 2 (warpgroup 1) of the step's dQ tile, each
        staged in its own tile (staging tile s, barriers dq_bars[2 s] staged and [2 s + 1] read) and released as
        soon as its reduction has read it."""
        dq_bars = prog.smem.dq_bars
        PER: gl.constexpr = 1 if prog.cfg.FLAT else 2  # bulk groups per share
        for s in gl.static_range(3):
            mbarrier.wait(dq_bars.index(2 * s), t & 1)
            _reduce_share(prog, s, s, m, i_h)
        tma.store_wait(pendings=2 * PER)
        mbarrier.arrive(dq_bars.index(1), count=1)
        tma.store_wait(pendings=PER)
        mbarrier.arrive(dq_bars.index(3), count=1)
        tma.store_wait(pendings=0)
        mbarrier.arrive(dq_bars.index(5), count=1)

    @gluon.constexpr_function
    def _wide_dq_shares(D, w):
        """WIDE: how many [64, 64] dQ shares warpgroup w stages per step: those of its columns 128 w + 64 j that
        hold any of the head dim D (2 and 2 at d256, 2 and 1 at d192)."""
        return min(2, (D - 128 * w + 63) // 64)

    @gluon.jit
    def _reduce_dq_wide(prog, t, m, i_h):
        """_reduce_dq under WIDE: warpgroup w stages shares 2 w + j, j < _wide_dq_shares (its u-th staging is
        N_w t + j); pass j reduces both warpgroups' j-th and releases each tile once its reduction has read it."""
        cfg = prog.cfg
        dq_bars = prog.smem.dq_bars
        N0: gl.constexpr = _wide_dq_shares(cfg.D, 0)
        N1: gl.constexpr = _wide_dq_shares(cfg.D, 1)
        PER: gl.constexpr = 1 if cfg.FLAT else 2  # bulk groups per share
        for j in gl.static_range(2):
            mbarrier.wait(dq_bars.index(0), (N0 * t + j) & 1)
            _reduce_share(prog, 0, j, m, i_h)
            if j < N1:
                mbarrier.wait(dq_bars.index(2), (N1 * t + j) & 1)
                _reduce_share(prog, 1, 2 + j, m, i_h)
                tma.store_wait(pendings=PER)
                mbarrier.arrive(dq_bars.index(1), count=1)
                tma.store_wait(pendings=0)
                mbarrier.arrive(dq_bars.index(3), count=1)
            else:
                tma.store_wait(pendings=0)
                mbarrier.arrive(dq_bars.index(1), count=1)

    @gluon.jit
    def _reduce_share(prog, w: gl.constexpr, share: gl.constexpr, m, i_h):
        """Add warpgroup w's staged tile, share `share` of query head i_h's dQ tile at query m (WIDE: columns
        64 share), into the buffer (the kernel's dq_desc note)."""
        cfg = prog.cfg
        dq = prog.dq
        dq_smem = prog.smem.dq
        if cfg.FLAT:
            # DQ_WIDTH // 4 rows of 256 per 64 query rows (three shares at 192, four at 256).
            row = ((prog.walk.i_b * prog.loads.num_heads + i_h) * (dq.batch_rows * cfg.DQ_WIDTH // 256)
                   + m * cfg.DQ_WIDTH // 256 + share * 16)
            tma_reduce_add(dq.desc, [row, 0], dq_smem.index(w))
        else:
            col = i_h * cfg.HEAD_DIM + share * 64
            row = prog.walk.i_b * dq.batch_rows + prog.walk.q0 + m
            tma_reduce_add(dq.desc, [row, col], dq_smem.index(w).slice(0, 32, dim=1))
            tma_reduce_add(dq.desc, [row, col + 32], dq_smem.index(w).slice(32, 32, dim=1))

    @gluon.jit
    def _reduce_dq_shares(prog, u, m, i_h):
        """_reduce_dq below 256 columns: both warpgroups' staged shares."""
        cfg = prog.cfg
        dq = prog.dq
        dq_smem = prog.smem.dq
        dq_bars = prog.smem.dq_bars
        # Both warpgroups' tiles in flight at once; each is released as soon as its reductions have read it.
        for w in gl.static_range(2):
            mbarrier.wait(dq_bars.index(2 * w), u & 1)
            if cfg.FLAT:
                # The tile's two shares are 32 consecutive rows of 256 (batch_rows: Sq_pad here).
                row = ((prog.walk.i_b * prog.loads.num_heads + i_h) * (dq.batch_rows * cfg.HEAD_DIM // 256)
                       + m * cfg.HEAD_DIM // 256 + w * 16)
                tma_reduce_add(dq.desc, [row, 0], dq_smem.index(w))
            else:
                # Warpgroup w's share of the tile (_bwd_step): 64 columns from w * 64 at d128, 64 rows at d64,
                # from 128-byte swizzled staging: 32 columns per reduction.
                col = i_h * cfg.HEAD_DIM + w * 64 if cfg.BLOCK_M == 64 else i_h * cfg.HEAD_DIM
                row = prog.walk.i_b * dq.batch_rows + prog.walk.q0 + m + (0 if cfg.BLOCK_M == 64 else w * 64)
                tma_reduce_add(dq.desc, [row, col], dq_smem.index(w).slice(0, 32, dim=1))
                tma_reduce_add(dq.desc, [row, col + 32], dq_smem.index(w).slice(32, 32, dim=1))
        # Warpgroup 0's reductions are the first 1 (FLAT) or 2 bulk groups: its tile is free once they have read it.
        tma.store_wait(pendings=1 if cfg.FLAT else 2)
        mbarrier.arrive(dq_bars.index(1), count=1)
        tma.store_wait(pendings=0)
        mbarrier.arrive(dq_bars.index(3), count=1)

    @gluon.jit
    def _bwd_dq_partition(prog):
        """The writer warp: adds each staged dQ share into the fp32 buffer by bulk TMA reductions, so the consumer
        warpgroups never wait on one (the items, steps and tiles mirror _bwd_partition's)."""
        if prog.cfg.PERSISTENT:
            j = 0
            u = 0
            i_b = _item_batch(prog, j, 1)
            while i_b >= 0:
                walk, band = _read_walk(prog, j, i_b, 1)
                u = _walk_tiles(_item_program(prog, walk, band), u, _reduce_dq)
                j += 1
                i_b = _item_batch(prog, j, 1)
        else:
            _walk_tiles(prog, gl.program_id(0) * 0, _reduce_dq)

    @gluon.jit
    def _band_keep(cfg, band, key, cols, keep):
        """keep, narrowed to the pairs inside the band's edges (kernels/_common._visible, transposed: key, the keys
        of the scores' rows; cols, the queries of its columns). The WIDE steps' mask; _bwd_step keeps its own
        inline copy, which its measured d64 SASS depends on (through this helper ptxas orders it differently)."""
        if cfg.MASK_RIGHT:
            keep = keep & (gl.expand_dims(key, 1) <= gl.expand_dims(cols + (band.diag_offset + band.window_right), 0))
        if cfg.MASK_LEFT:
            keep = keep & (gl.expand_dims(key, 1) >= gl.expand_dims(cols + (band.diag_offset - band.window_left), 0))
        return keep

    @gluon.jit
    def _bwd_step(prog, wg, t, m, i_h, dk, dv, slope, seed, bh, MASK: gl.constexpr):
        """One query tile (rows from m of query head i_h, the program's t-th step) for the warpgroup's half of the
        key block (wg). The scores in log2 units are S^T * qk_scale, or with a softcap tanh(S^T * pre_scale) *
        qk_scale (kernels/_common._score_mod's order: scale, softcap, ALiBi, a float attn_mask; the scalars of
        hopper_fwd.mod_scalars), minus slope * |i + diag - j| with ALiBi, plus the bias * log2(e) (BIAS 1). MASK:
        the tile needs the band's mask (or the key bound's, or it crosses the diagonal under ALiBi, or a bool
        attn_mask applies: BIAS 2). DBIAS: also write the bias's gradient, dS before softcap's factor (see the
        DBIAS note in _bwd_kernel). DROPOUT: the forward's keep-mask Z of (b, h) = bh, regenerated under the key
        seed (docs/derivation.md#8): dV takes P o Z (its 1 / (1 - p) is applied once, to dV at the end) and dP^T
        becomes dP^T o Z / (1 - p). Returns dK, dV."""
        cfg = prog.cfg
        smem = prog.smem
        s_layout: gl.constexpr = cfg.s_layout
        slot = smem.q_bar.wait_full(t)
        q = smem.q.index(slot)
        do = smem.do.index(slot)
        zero = gl.zeros([64, cfg.BLOCK_M], gl.float32, layout=s_layout)
        if cfg.KV_SPLIT:
            # d96 on d128's tiles: S^T and dP^T sum over the head dim's 96 columns only (64 + 32), not over TMA's
            # zeros past them. (dV and dK have the head dim as their width: KV_SPLIT; dQ's shares keep 64 + 64.)
            st_tok = _head_dim_product(wg.k, q, zero, cfg.D)
            dpt_tok = _head_dim_product(wg.v, do, zero, cfg.D_V)
        else:
            st_tok = warpgroup_mma(wg.k, q.permute((1, 0)), zero, use_acc=False, is_async=True)
            dpt_tok = warpgroup_mma(wg.v, do.permute((1, 0)), zero, use_acc=False, is_async=True)
        ds_scale = prog.mods.sm_scale
        if cfg.DROPOUT:
            # Drawn while the products run: keys as rows, this tile's queries as columns, in four chunks (fewer
            # Philox states live at once; offline at d128 the loop still spills ~40 registers per step).
            keep_t = dropout_tile_keep(wg.key, m, seed, bh, prog.drop.threshold, cfg.BLOCK_M, True)
            ds_scale = prog.mods.sm_scale * prog.drop.rescale

        if cfg.SOFTCAP:
            # dS needs t = tanh(scale q.k / softcap) again (d softcap(x) / dx = 1 - t^2): P and dS are computed in
            # one pass once both products are in, so t never lives across the dP wait (at d128 the consumers have
            # no registers for another score tile; at d64 not for half of one).
            st, dpt = warpgroup_mma_wait(0, deps=(st_tok, dpt_tok))
            tt = tanh_approx(st * prog.mods.pre_scale)
            score = tt
        else:
            # (wgmma groups retire in order: dP^T's products may stay outstanding, one, or two at d96.)
            st, dpt_tok = warpgroup_mma_wait(1 + cfg.KV_SPLIT, deps=(st_tok, dpt_tok))
            score = st
        # Rows past Sq are padding: LSE = +inf there (P = 0) and delta = 0, so they need no mask; so is a row that
        # sees no key (the preprocess turned its LSE of -inf into +inf). Both are read as [1, BLOCK_M] rows of the
        # scores' layout: broadcast along the keys with no layout conversion.
        lse = smem.lse.index(slot).load(s_layout)
        band = prog.band
        if cfg.HAS_ALIBI:
            # -slope * |i + diag - j| (slope in log2 units), with i + diag - j = c - k: c = d0 + the query's offset in
            # the tile, d0 the distance at the tile's corner (query m, key key0), k the key's offset. Exact in fp32.
            # The query offsets 0..BLOCK_M-1 come as a constant fp32 row from shared memory: recomputed from the
            # thread index they cost ~6 integer instructions per column per step.
            d0 = m + band.diag_offset - wg.key0
            c = wg.offsets.load(s_layout) + d0
            k = gl.expand_dims(gl.arange(0, 64, layout=gl.SliceLayout(1, s_layout)).to(gl.float32), 1)
            if MASK:
                xt = score * prog.mods.qk_scale - lse - slope * gl.abs(c - k)
            else:
                # No unmasked tile crosses the diagonal (_bwd_kernel), so the distance has one sign in the tile and
                # the bias splits into a term per query, folded into its LSE, and one per key: one add per score,
                # and no register beyond the plain path's.
                s = gl.where(d0 > 0, slope, -slope)
                xt = score * prog.mods.qk_scale - (lse + s * c) + s * k
        else:
            xt = score * prog.mods.qk_scale - lse
        if cfg.BIAS:
            # The slot's attn_mask tile is [BLOCK_M queries, 128 keys]; this warpgroup's 64 keys, read transposed.
            b_t = smem.bias.index(slot).slice(wg.half * 64, 64, dim=1).permute((1, 0)).load(s_layout)
        if cfg.BIAS == 1:
            xt = xt + to_float32(b_t) * LOG2E
        pt = gl.exp2(xt)
        if MASK:
            # Keys past Sk and the band's edges (kernels/_common._visible, transposed: keys are the rows here).
            # A bool mask reads 0 (hidden) past Sk (TMA's zero fill): it is the key bound then.
            cols = m + gl.arange(0, cfg.BLOCK_M, layout=gl.SliceLayout(0, s_layout))
            if cfg.BIAS == 2:
                keep = b_t != 0
            else:
                keep = gl.expand_dims(wg.key, 1) < band.seqlen_k
            if cfg.MASK_RIGHT:
                keep = keep & (gl.expand_dims(wg.key, 1)
                               <= gl.expand_dims(cols + (band.diag_offset + band.window_right), 0))
            if cfg.MASK_LEFT:
                keep = keep & (gl.expand_dims(wg.key, 1)
                               >= gl.expand_dims(cols + (band.diag_offset - band.window_left), 0))
            pt = gl.where(keep, pt, 0.0)
        if not cfg.SOFTCAP:
            dpt = warpgroup_mma_wait(0, deps=(dpt_tok, ))
        # dS times the softmax scale, which dK = dS^T Q and dQ = dS K both carry, so that the products come out
        # scaled: delta comes scaled from the preprocess, and the scale costs an FMA in place of a subtraction.
        if cfg.DROPOUT:
            dpt = gl.where(keep_t, dpt, 0.0)
        dst = pt * (dpt * ds_scale - smem.delta.index(slot).load(s_layout))
        if cfg.DBIAS:
            # The slot's attn_mask tile was read above and is dead until the slot is released: this warpgroup's
            # 64 keys of it take the bias's gradient, queries as rows like the bias itself, for one TMA store.
            db_tile = smem.bias.index(slot).slice(wg.half * 64, 64, dim=1)
            db_tile.permute((1, 0)).store((dst * (1.0 / prog.mods.sm_scale)).to(cfg.dtype))  # dS itself
        if cfg.SOFTCAP:
            dst = dst * (1.0 - tt * tt)
        dst = dst.to(cfg.dtype)
        if cfg.DROPOUT:
            pt = gl.where(keep_t, pt, 0.0)  # (dS above took P before dropout)
        dv_tok = _kv_product(gl.convert_layout(pt.to(cfg.dtype), cfg.dot_a), do, dv, cfg.KV_SPLIT)
        dk_tok = _kv_product(gl.convert_layout(dst, cfg.dot_a), q, dk, cfg.KV_SPLIT)
        return _dq_step(prog, wg, t, slot, m, i_h, dst, dv_tok, dk_tok)

    @gluon.jit
    def _kv_product(a, rows, acc, PAIR: gl.constexpr):
        """acc += a rows (a: P^T or dS^T, in registers or shared memory; rows: the step's dO or Q tile), issued
        asynchronously, over the rows' first acc.shape[1] columns. PAIR: acc is a pair of accumulators over the
        rows' columns [0, w) and [w, w + w') (d96's KV_SPLIT: 64 and 32, past them TMA's zeros; OWNERS at 192: 128
        and 64), and the two products return a pair of tokens."""
        if PAIR:
            lo, hi = acc
            W: gl.constexpr = lo.shape[1]
            return (warpgroup_mma(a, rows.slice(0, W, dim=1), lo, is_async=True),
                    warpgroup_mma(a, rows.slice(W, hi.shape[1], dim=1), hi, is_async=True))
        elif acc.shape[1] < rows.shape[1]:
            return warpgroup_mma(a, rows.slice(0, acc.shape[1], dim=1), acc, is_async=True)
        else:
            return warpgroup_mma(a, rows, acc, is_async=True)

    @gluon.jit
    def _kv_views(smem, t):
        """WIDE: views of K and V (smem.bias holds both: _bwd_smem) indexed by a number that is 0 but that the
        compilers cannot fold (t >= 0: the step count). With the block's fixed views, ptxas kept the descriptors of
        every 16-column step of the 256-column products as loop invariants (64 registers for K and V) and spilled
        them; from a view taken per step it derives them from one base."""
        zero = t // (1 << 30)
        return smem.bias.index(zero), smem.bias.index(zero + 1)

    @gluon.jit
    def _head_dim_product(a, rows, zero, D: gl.constexpr):
        """a rows^T (a: [64, 256], rows: [n, 256] tiles in shared memory) over the head dim's first D columns,
        issued asynchronously: one product at d256, two (128 and 64 columns) at d192, one over 128 columns at d128
        (MLA's v and dO); and on d128's [64, 128] tiles two (64 and 32 columns) at d96 (its S^T and dP^T in
        _bwd_step). The columns past D are TMA's zero fill."""
        if D > 192:
            acc = warpgroup_mma(a, rows.permute((1, 0)), zero, use_acc=False, is_async=True)
        elif D > 64 and D <= 96:
            acc = mma_over_96(a, rows, zero, False)
        elif D <= 128:
            acc = warpgroup_mma(a.slice(0, 128, dim=1), rows.slice(0, 128, dim=1).permute((1, 0)), zero,
                                use_acc=False, is_async=True)
        else:
            acc = warpgroup_mma(a.slice(0, 128, dim=1), rows.slice(0, 128, dim=1).permute((1, 0)), zero,
                                use_acc=False, is_async=True)
            acc = warpgroup_mma(a.slice(128, 64, dim=1), rows.slice(128, 64, dim=1).permute((1, 0)), acc,
                                is_async=True)
        return acc

    @gluon.jit
    def _k_regs(cfg, k):
        """K_REGS: the work item's K ([64 keys, 256] in shared memory) as the three [64, 64] column chunks of the
        head dim's 192, in the register-operand layout of the S^T products (_k_regs_product)."""
        dl: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=cfg.s_layout, k_width=2)
        return k.slice(0, 64, dim=1).load(dl), k.slice(64, 64, dim=1).load(dl), k.slice(128, 64, dim=1).load(dl)

    @gluon.jit
    def _k_regs_product(kr, rows, zero):
        """K_REGS: S^T = K rows^T over the 192 columns, K's chunks from registers (kr), issued asynchronously;
        returns the last product's token."""
        acc = warpgroup_mma(kr[0], rows.slice(0, 64, dim=1).permute((1, 0)), zero, use_acc=False, is_async=True)
        acc = warpgroup_mma(kr[1], rows.slice(64, 64, dim=1).permute((1, 0)), acc, is_async=True)
        return warpgroup_mma(kr[2], rows.slice(128, 64, dim=1).permute((1, 0)), acc, is_async=True)

    @gluon.jit
    def _wide_roles(prog, wg, t, m, slot, q, do, k, v, ds_tile, p_tile, MASK: gl.constexpr):
        """_bwd_step_wide's first half with ROLES: warpgroup 0 computes S^T and P^T for all 64 queries ([64 keys,
        64 queries]: K read once per step, not once per warpgroup), warpgroup 1 dP^T, then dS^T from P^T as
        warpgroup 0 stored it (with softcap, P^T (1 - t^2), stored where dS^T goes and replaced by it)."""
        cfg = prog.cfg
        smem = prog.smem
        s_layout: gl.constexpr = cfg.s_layout
        zero = gl.zeros([64, cfg.BLOCK_M], gl.float32, layout=s_layout)
        if wg.half == 0:
            st = warpgroup_mma_wait(0, deps=(_head_dim_product(k, q, zero, cfg.D), ))
            if cfg.SOFTCAP:
                tt = tanh_approx(st * prog.mods.pre_scale)
                score = tt
            else:
                score = st
            pt = gl.exp2(score * prog.mods.qk_scale - smem.lse.index(slot).load(s_layout))
            if MASK:
                band = prog.band
                cols = m + gl.arange(0, cfg.BLOCK_M, layout=gl.SliceLayout(0, s_layout))
                keep = gl.expand_dims(wg.key, 1) < band.seqlen_k
                pt = gl.where(_band_keep(cfg, band, wg.key, cols, keep), pt, 0.0)
            p_tile.permute((1, 0)).store(pt.to(cfg.dtype))
            if cfg.SOFTCAP:
                ds_tile.permute((1, 0)).store((pt * (1.0 - tt * tt)).to(cfg.dtype))
            fence_async_shared()
            thread_barrier()
            mbarrier.arrive(smem.ds_ready.index(2 + t % 2), count=1)
        else:
            dpt = warpgroup_mma_wait(0, deps=(_head_dim_product(v, do, zero, cfg.D_V), ))
            delta = smem.delta.index(slot).load(s_layout)
            mbarrier.wait(smem.ds_ready.index(2 + t % 2), (t // 2) & 1)
            if cfg.SOFTCAP:
                g = ds_tile.permute((1, 0)).load(s_layout).to(gl.float32)
                thread_barrier()  # (every thread's read before any write over the tile)
            else:
                g = p_tile.permute((1, 0)).load(s_layout).to(gl.float32)
            ds_tile.permute((1, 0)).store((g * (dpt * prog.mods.sm_scale - delta)).to(cfg.dtype))
            fence_async_shared()
            thread_barrier()
        mbarrier.arrive(smem.ds_ready.index(t % 2), count=1)
        mbarrier.wait(smem.ds_ready.index(t % 2), (t // 2) & 1)

    @gluon.jit
    def _p_and_ds(prog, wg, st_tok, dpt_tok, slot, m, row0: gl.constexpr, N: gl.constexpr, DP_PENDING: gl.constexpr,
                  MASK: gl.constexpr):
        """P^T and dS^T (fp32, [64 keys, N queries] in s_layout) of the step's queries m + row0 .. + N - 1 from the
        S^T and dP^T products in flight (_bwd_step_wide's and _half_products' halves of a tile): S^T waited for with
        DP_PENDING of dP^T's products still in flight (without softcap, which needs both at once), those queries'
        LSE and delta read as [1, N] rows of the scores' layout (see _bwd_step), MASK as in _bwd_step."""
        cfg = prog.cfg
        smem = prog.smem
        s_layout: gl.constexpr = cfg.s_layout
        if cfg.SOFTCAP:
            st, dpt = warpgroup_mma_wait(0, deps=(st_tok, dpt_tok))
            tt = tanh_approx(st * prog.mods.pre_scale)
            score = tt
        else:
            st, dpt_tok = warpgroup_mma_wait(DP_PENDING, deps=(st_tok, dpt_tok))
            score = st
        lse = smem.lse.index(slot).slice(row0, N, dim=1).load(s_layout)
        pt = gl.exp2(score * prog.mods.qk_scale - lse)
        if MASK:
            band = prog.band
            cols = m + row0 + gl.arange(0, N, layout=gl.SliceLayout(0, s_layout))
            keep = gl.expand_dims(wg.key, 1) < band.seqlen_k
            pt = gl.where(_band_keep(cfg, band, wg.key, cols, keep), pt, 0.0)
        if not cfg.SOFTCAP:
            dpt = warpgroup_mma_wait(0, deps=(dpt_tok, ))
        delta = smem.delta.index(slot).slice(row0, N, dim=1).load(s_layout)
        dst = pt * (dpt * prog.mods.sm_scale - delta)
        if cfg.SOFTCAP:
            dst = dst * (1.0 - tt * tt)
        return pt, dst

    @gluon.jit
    def _bwd_step_wide(prog, wg, t, m, i_h, dk, dv, kr, MASK: gl.constexpr):
        """_bwd_step for tiles of 256 columns (WIDE: d192 and d256). A consumer warpgroup cannot hold dK and dV
        of 64 keys at 256 columns (256 registers a thread), so both warpgroups share the block's 64 keys and split
        the work: warpgroup w computes S^T and dP^T for the step's queries 32 w .. 32 w + 31 (all 256 columns of
        the contraction, [64 keys, 32 queries] each), P^T and dS^T from them, and stores both into shared memory
        ([64 queries, 64 keys] tiles, two alternating pairs, as dS^T's at d128); once both halves are in, it adds
        columns 128 w .. 128 w + 127 of dV = P^T dO and dK = dS^T Q over all 64 queries, and computes the same
        columns of dQ_i = dS K as two [64, 64] shares for the writer (with OWNERS the second half is _wide_owned's
        instead: all of dV in warpgroup 0, all of dK in warpgroup 1). dO has one buffer (_load_q_tile_wide): it is
        released as soon as the dV product has read it, Q's slot once dK's has. With ROLES (d256: WIDE_ROLES) the
        first half differs: warpgroup 0 computes S^T and P^T, warpgroup 1 dP^T and dS^T, each for all the tile's
        queries (_wide_roles). kr: with K_REGS the work item's K in registers (_k_regs), else unused. MASK as in
        _bwd_step; no ALiBi, attn_mask or dropout here (flashtile/dispatch.py declines them). Returns dK, dV."""
        cfg = prog.cfg
        smem = prog.smem
        s_layout: gl.constexpr = cfg.s_layout
        HALF_M: gl.constexpr = cfg.BLOCK_M // 2
        slot = smem.q_bar.wait_full(t)
        q = smem.q.index(slot)
        mbarrier.wait(smem.q_bar.full.index(cfg.STAGES), t & 1)
        do = smem.do.index(0)
        k, v = _kv_views(smem, t)
        ds_tile = smem.ds.index(2 * (t % 2))
        p_tile = smem.ds.index(2 * (t % 2) + 1)
        if cfg.ROLES:
            _wide_roles(prog, wg, t, m, slot, q, do, k, v, ds_tile, p_tile, MASK)
        else:
            zero = gl.zeros([64, HALF_M], gl.float32, layout=s_layout)
            if cfg.K_REGS:
                st_tok = _k_regs_product(kr, q.slice(wg.half * HALF_M, HALF_M), zero)
            else:
                st_tok = _head_dim_product(k, q.slice(wg.half * HALF_M, HALF_M), zero, cfg.D)
            dpt_tok = _head_dim_product(v, do.slice(wg.half * HALF_M, HALF_M), zero, cfg.D_V)
            # (dP^T's products, one or two, still in flight while P^T is computed.)
            pt, dst = _p_and_ds(prog, wg, st_tok, dpt_tok, slot, m, wg.half * HALF_M, HALF_M,
                                1 + (128 < cfg.D_V and cfg.D_V <= 192), MASK)
            p_tile.slice(wg.half * HALF_M, HALF_M).permute((1, 0)).store(pt.to(cfg.dtype))
            ds_tile.slice(wg.half * HALF_M, HALF_M).permute((1, 0)).store(dst.to(cfg.dtype))
            fence_async_shared()
            thread_barrier()
            mbarrier.arrive(smem.ds_ready.index(t % 2), count=1)
            mbarrier.wait(smem.ds_ready.index(t % 2), (t // 2) & 1)
        if cfg.OWNERS:
            dk, dv = _wide_owned(prog, wg, t, slot, q, do, k, ds_tile, p_tile, dk, dv)
        else:
            col0: gl.constexpr = wg.half * cfg.KV_COLS
            # dV's columns of this warpgroup hold some of v's head dim (not warpgroup 1's under MLA: D_V 128).
            HAS_DV: gl.constexpr = col0 < cfg.D_V
            if HAS_DV:
                dv_tok = warpgroup_mma(p_tile.permute((1, 0)), do.slice(col0, cfg.KV_COLS, dim=1), dv, is_async=True)
            else:
                mbarrier.arrive(smem.q_bar.empty.index(cfg.STAGES), count=1)  # dO read (by dP^T's product)
            dk_tok = warpgroup_mma(ds_tile.permute((1, 0)), q.slice(col0, cfg.KV_COLS, dim=1), dk, is_async=True)
            dq_zero = _dq_zero()
            # dQ's shares of this warpgroup's columns that hold any of the head dim (d192: one for warpgroup 1).
            N_DQ: gl.constexpr = _wide_dq_shares(cfg.D, wg.half)
            dq0_tok = warpgroup_mma(ds_tile, k.slice(col0, 64, dim=1), dq_zero, use_acc=False, is_async=True)
            if N_DQ == 2:
                dq1_tok = warpgroup_mma(ds_tile, k.slice(col0 + 64, 64, dim=1), dq_zero, use_acc=False,
                                        is_async=True)
            if HAS_DV:
                dv = warpgroup_mma_wait(N_DQ + 1, deps=(dv_tok, ))
                mbarrier.arrive(smem.q_bar.empty.index(cfg.STAGES), count=1)  # dO read
            if N_DQ == 2:
                dk, dq0, dq1 = warpgroup_mma_wait(0, deps=(dk_tok, dq0_tok, dq1_tok))
            else:
                dk, dq0 = warpgroup_mma_wait(0, deps=(dk_tok, dq0_tok))
            mbarrier.arrive(smem.q_bar.empty.index(slot), count=1)
            _stage_dq(dq0, wg.dq, smem.dq_bars, N_DQ * t, wg.half, cfg.FLAT)
            if N_DQ == 2:
                _stage_dq(dq1, wg.dq, smem.dq_bars, N_DQ * t + 1, wg.half, cfg.FLAT)
        return dk, dv

    @gluon.jit
    def _dq_zero():
        """A zero [64, 64] fp32 accumulator of one dQ share (the products' start: use_acc=False never reads it)."""
        layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 64, 16])
        return gl.zeros([64, 64], gl.float32, layout=layout)

    @gluon.jit
    def _wide_owned(prog, wg, t, slot, q, do, k, ds_tile, p_tile, dk, dv):
        """_bwd_step_wide's second half with OWNERS, once both warpgroups' P^T and dS^T are in shared memory:
        warpgroup 0 adds dV += P^T dO over v's head dim and computes dQ's shares 0 and 1 (columns 0-127), warpgroup
        1 adds dK += dS^T Q over the 192 columns and computes share 2. Returns dK, dV (the one the warpgroup does not
        own passed through)."""
        cfg = prog.cfg
        smem = prog.smem
        dq_zero = _dq_zero()
        PAIR_V: gl.constexpr = cfg.D_V > 128
        if wg.half == 0:
            dv_tok = _kv_product(p_tile.permute((1, 0)), do, dv, PAIR_V)
            dq0_tok = warpgroup_mma(ds_tile, k.slice(0, 64, dim=1), dq_zero, use_acc=False, is_async=True)
            dq1_tok = warpgroup_mma(ds_tile, k.slice(64, 64, dim=1), dq_zero, use_acc=False, is_async=True)
            if PAIR_V:
                dv = warpgroup_mma_wait(2, deps=(dv_tok[0], dv_tok[1]))
            else:
                dv = warpgroup_mma_wait(2, deps=(dv_tok, ))
            mbarrier.arrive(smem.q_bar.empty.index(cfg.STAGES), count=1)  # dO read
            dq0, dq1 = warpgroup_mma_wait(0, deps=(dq0_tok, dq1_tok))
            mbarrier.arrive(smem.q_bar.empty.index(slot), count=1)
            _stage_dq(dq0, wg.dq, smem.dq_bars, 2 * t, 0, cfg.FLAT)
            _stage_dq(dq1, wg.dq, smem.dq_bars, 2 * t + 1, 0, cfg.FLAT)
        else:
            mbarrier.arrive(smem.q_bar.empty.index(cfg.STAGES), count=1)  # dO read (by dP^T's product)
            dk_tok = _kv_product(ds_tile.permute((1, 0)), q, dk, True)
            dq_tok = warpgroup_mma(ds_tile, k.slice(128, 64, dim=1), dq_zero, use_acc=False, is_async=True)
            dk0, dk1, dq = warpgroup_mma_wait(0, deps=(dk_tok[0], dk_tok[1], dq_tok))
            dk = (dk0, dk1)
            mbarrier.arrive(smem.q_bar.empty.index(slot), count=1)
            _stage_dq(dq, wg.dq, smem.dq_bars, t, 1, cfg.FLAT)
        return dk, dv

    @gluon.jit
    def _half_products(prog, wg, t, slot, m, h: gl.constexpr, dv, dk0, dk1, dk2, MASK: gl.constexpr):
        """_bwd_step_halves's work for half h of the query tile at m (queries m + 32 h .. + 31): S^T and dP^T, P^T
        and dS^T, dS^T into the dS tile, dV += P^T dO_h and dK_c += dS^T Q_h,c issued. Returns dV and dK's chunks
        (their products in flight)."""
        cfg = prog.cfg
        smem = prog.smem
        s_layout: gl.constexpr = cfg.s_layout
        k_rows: gl.constexpr = wg.half * 64
        # K's chunks and V through an index that is 0 but that no compiler can fold, as _kv_views: from fixed views
        # ptxas kept every product's descriptors as loop invariants and spilled them.
        none = t // (1 << 30)
        k0 = smem.k.index(none)
        k1 = smem.k.index(none + 1)
        k2 = smem.k.index(none + 2)
        v = smem.v.index(none).slice(k_rows, 64)
        ds_tile = smem.ds.index(0)
        zero = gl.zeros([64, 32], gl.float32, layout=s_layout)
        do = smem.do.index(slot)
        q0 = smem.q.index(3 * slot).slice(32 * h, 32)
        q1 = smem.q.index(3 * slot + 1).slice(32 * h, 32)
        q2 = smem.q.index(3 * slot + 2).slice(32 * h, 32)
        do_h = do.slice(32 * h, 32)
        st_tok = warpgroup_mma(k0.slice(k_rows, 64), q0.permute((1, 0)), zero, use_acc=False, is_async=True)
        st_tok = warpgroup_mma(k1.slice(k_rows, 64), q1.permute((1, 0)), st_tok, is_async=True)
        st_tok = warpgroup_mma(k2.slice(k_rows, 64), q2.permute((1, 0)), st_tok, is_async=True)
        dpt_tok = warpgroup_mma(v, do_h.permute((1, 0)), zero, use_acc=False, is_async=True)
        # (In order: the previous half's dV and dK products retire before S^T; dP^T stays in flight.)
        pt, dst = _p_and_ds(prog, wg, st_tok, dpt_tok, slot, m, 32 * h, 32, 1, MASK)
        dst = dst.to(cfg.dtype)
        if h == 0:
            # Both warpgroups' dQ products of the previous step have read the dS tile.
            mbarrier.wait(smem.ds_ready.index(1), (t & 1) ^ 1)
        ds_tile.slice(32 * h, 32).slice(k_rows, 64, dim=1).permute((1, 0)).store(dst)
        dst = gl.convert_layout(dst, cfg.dot_a)
        dv = warpgroup_mma(gl.convert_layout(pt.to(cfg.dtype), cfg.dot_a), do_h, dv, is_async=True)
        dk0 = warpgroup_mma(dst, q0, dk0, is_async=True)
        dk1 = warpgroup_mma(dst, q1, dk1, is_async=True)
        dk2 = warpgroup_mma(dst, q2, dk2, is_async=True)
        return dv, dk0, dk1, dk2

    @gluon.jit
    def _bwd_step_halves(prog, wg, t, m, i_h, dk, dv, MASK: gl.constexpr):
        """_bwd_step for HALVES (MLA's 192/128): the warpgroup's 64 keys of the 128-key block against the query
        tile's rows in two halves of 32. Per half h: S^T = K Q_h^T over Q's and K's three 64-column chunks and
        dP^T = V dO_h^T ([64 keys, 32 queries] each, 16 registers a thread), P^T and dS^T, dS^T stored (queries as
        rows) into the step's [64 queries, 128 keys] dS tile, and dV += P^T dO_h, dK_c += dS^T Q_h,c with P^T and
        dS^T as register operands (dV [64, 128] and dK's three [64, 64] chunks: 160 registers a thread). Once both
        warpgroups' halves are in (smem.ds_ready[0]), dQ = dS K over all 128 keys: warpgroup 0 computes shares 0
        and 1 (columns 0-127), warpgroup 1 share 2, each staged in a tile of its own (_reduce_dq_halves). The one dS
        tile is written again only once both warpgroups' dQ products have read it (ds_ready[1]). MASK as in
        _bwd_step; no ALiBi, attn_mask or dropout here (flashtile/dispatch.py declines them). Returns dK, dV."""
        cfg = prog.cfg
        smem = prog.smem
        slot = smem.q_bar.wait_full(t)
        none = t // (1 << 30)  # (K's views for the dQ products, as in _half_products)
        k0 = smem.k.index(none)
        k1 = smem.k.index(none + 1)
        k2 = smem.k.index(none + 2)
        ds_tile = smem.ds.index(0)
        dk0, dk1, dk2 = dk
        for h in gl.static_range(2):
            if h == 1:
                # The first half's dV and dK products have read their register operands (P^T, dS^T): with them
                # still held, the second half's scores did not fit the registers.
                dv, dk0, dk1, dk2 = warpgroup_mma_wait(0, deps=(dv, dk0, dk1, dk2))
            dv, dk0, dk1, dk2 = _half_products(prog, wg, t, slot, m, h, dv, dk0, dk1, dk2, MASK)
        fence_async_shared()
        thread_barrier()
        mbarrier.arrive(smem.ds_ready.index(0), count=1)
        mbarrier.wait(smem.ds_ready.index(0), t & 1)
        dq_zero = _dq_zero()
        if wg.half == 0:
            # One share at a time: both in flight, with dK and dV, did not fit the registers.
            dq_tok = warpgroup_mma(ds_tile, k0, dq_zero, use_acc=False, is_async=True)
            dv, dk0, dk1, dk2, dq = warpgroup_mma_wait(0, deps=(dv, dk0, dk1, dk2, dq_tok))
            mbarrier.arrive(smem.q_bar.empty.index(slot), count=1)
            _stage_dq(dq, smem.dq.index(0), smem.dq_bars, t, 0, cfg.FLAT)
            dq_tok = warpgroup_mma(ds_tile, k1, dq_zero, use_acc=False, is_async=True)
            dq = warpgroup_mma_wait(0, deps=(dq_tok, ))
            mbarrier.arrive(smem.ds_ready.index(1), count=1)
            _stage_dq(dq, smem.dq.index(1), smem.dq_bars, t, 1, cfg.FLAT)
        else:
            dq_tok = warpgroup_mma(ds_tile, k2, dq_zero, use_acc=False, is_async=True)
            dv, dk0, dk1, dk2, dq = warpgroup_mma_wait(0, deps=(dv, dk0, dk1, dk2, dq_tok))
            mbarrier.arrive(smem.q_bar.empty.index(slot), count=1)
            mbarrier.arrive(smem.ds_ready.index(1), count=1)
            _stage_dq(dq, smem.dq.index(2), smem.dq_bars, t, 2, cfg.FLAT)
        return (dk0, dk1, dk2), dv

    @gluon.jit
    def _dq_step(prog, wg, t, slot, m, i_h, dst, dv_tok, dk_tok, LIVE: gl.constexpr = True):
        """The end of _bwd_step, once dV's and dK's products are issued: dQ_i's share from both warpgroups' dS^T
        halves (and the bias's gradient stored), the ring slot released, the share handed to the writer. Returns
        dK, dV. LIVE False (_dead_step): dst is zero and dv_tok, dk_tok are the accumulators as they are, no
        products in flight."""
        cfg = prog.cfg
        smem = prog.smem
        # dQ_i += dS K needs dS with the queries as rows: through shared memory, read back transposed.
        dq_zero = _dq_zero()
        # Both warpgroups' dS^T halves go into one [128 keys, BLOCK_M] tile (two buffers, alternating); each
        # warpgroup then multiplies all 128 keys into its share of the dQ tile, so every dQ element is reduced once
        # per key block rather than once per warpgroup. Shares: at d128 (64 query rows) 64 of the columns, at d64
        # (128 query rows) 64 of the rows -- a [64, 64] fp32 tile per warpgroup either way.
        ds_tile = smem.ds.index(t % 2)
        # Without softcap the dbias tile is dS itself, [BLOCK_M queries, 128 keys] once both halves are in: the
        # dQ product reads it as its A operand (keys contiguous: K-major) and ds_smem goes unused.
        DS_IN_BIAS: gl.constexpr = cfg.DBIAS and not cfg.SOFTCAP
        if not DS_IN_BIAS:
            ds_tile.slice(wg.half * 64, 64).store(dst)
        fence_async_shared()
        thread_barrier()
        if cfg.DBIAS:
            # Rows past Sq and keys past Sk are clipped by the descriptor's bounds.
            # (Triton 3.6 reshapes no subslice: the slot's 4-D view, sliced.)
            tile4 = smem.bias.index(slot).reshape([1, 1, cfg.BLOCK_M, 2 * 64])
            tma_store(smem.dbias_desc, [prog.walk.i_b, i_h, m, wg.key0], tile4.slice(wg.half * 64, 64, dim=3))
        mbarrier.arrive(smem.ds_ready.index(t % 2), count=1)
        mbarrier.wait(smem.ds_ready.index(t % 2), (t // 2) & 1)
        if DS_IN_BIAS:
            dq_tok = warpgroup_mma(smem.bias.index(slot), smem.k.slice(wg.half * 64, 64, dim=1), dq_zero,
                                   use_acc=False, is_async=True)
        elif cfg.BLOCK_M == 64:
            dq_tok = warpgroup_mma(ds_tile.permute((1, 0)), smem.k.slice(wg.half * 64, 64, dim=1), dq_zero,
                                   use_acc=False, is_async=True)
        else:
            dq_tok = warpgroup_mma(ds_tile.slice(wg.half * 64, 64, dim=1).permute((1, 0)), smem.k, dq_zero,
                                   use_acc=False, is_async=True)
        if not LIVE:
            dq = warpgroup_mma_wait(0, deps=(dq_tok, ))
            dv = dv_tok
            dk = dk_tok
        elif cfg.KV_SPLIT:
            dv0, dv1, dk0, dk1, dq = warpgroup_mma_wait(0, deps=(dv_tok[0], dv_tok[1], dk_tok[0], dk_tok[1], dq_tok))
            dv = (dv0, dv1)
            dk = (dk0, dk1)
        else:
            dv, dk, dq = warpgroup_mma_wait(0, deps=(dv_tok, dk_tok, dq_tok))
        if cfg.DBIAS:
            tma.store_wait(pendings=0)  # the store has read the tile: the producer may refill the slot
        mbarrier.arrive(smem.q_bar.empty.index(slot), count=1)
        if DS_IN_BIAS:
            dq = dq * prog.mods.sm_scale  # the bias tile holds dS itself
        _stage_dq(dq, wg.dq, smem.dq_bars, t, wg.half, cfg.FLAT)
        return dk, dv

    @gluon.jit
    def _dead_keys(prog, wg, m):
        """Whether none of the warpgroup's 64 keys is visible to the query tile's rows m .. m + BLOCK_M - 1: all past
        the band's right edge (on a causal diagonal, the second warpgroup's keys against a 64-row tile's first rows),
        before its left edge, or past Sk. Its scores there are all masked, so P^T and dS^T are zero (SKIP_DEAD)."""
        cfg = prog.cfg
        band = prog.band
        dead = wg.key0 >= band.seqlen_k
        if cfg.MASK_RIGHT:
            dead = dead | (wg.key0 > m + (cfg.BLOCK_M - 1) + band.diag_offset + band.window_right)
        if cfg.MASK_LEFT:
            dead = dead | (wg.key0 + 63 < m + band.diag_offset - band.window_left)
        return dead

    @gluon.jit
    def _dead_step(prog, wg, t, m, i_h, dk, dv):
        """_bwd_step for a query tile that sees none of the warpgroup's keys (_dead_keys): no products of its own,
        only its zero half of dS^T for the dQ product both warpgroups share, and that product (_dq_step). dK, dV
        unchanged."""
        cfg = prog.cfg
        slot = prog.smem.q_bar.wait_full(t)
        dst = gl.zeros([64, cfg.BLOCK_M], cfg.dtype, layout=cfg.s_layout)
        return _dq_step(prog, wg, t, slot, m, i_h, dst, dv, dk, False)

    @gluon.jit
    def _bwd_partition(prog, half: gl.constexpr):
        """Consumer warpgroup `half`: for each work item of the program, keys start_n + 64 * half .. + 63 of its
        block; every query tile of every query head of the kv head (_bwd_item), then kv_free signalled and dK and
        dV stored (the loader brings the next item's K and V meanwhile)."""
        cfg = prog.cfg
        smem = prog.smem
        offsets = smem.offsets.index(half)
        if cfg.HAS_ALIBI:
            offsets.store(gl.expand_dims(gl.arange(0, cfg.BLOCK_M, layout=gl.SliceLayout(0, cfg.s_layout))
                                         .to(gl.float32), 0))
            thread_barrier()
        seed = 0
        if cfg.DROPOUT:
            seed = gl.load(prog.drop.Seed)
        if cfg.PERSISTENT:
            j = 0
            t = 0  # query tiles so far (the ring's uses)
            i_b = _item_batch(prog, j, 4)
            while i_b >= 0:
                walk, band = _read_walk(prog, j, i_b, 4)
                iprog = _item_program(prog, walk, band)
                wg = _half(iprog, offsets, half)
                dk, dv, t = _bwd_item(iprog, wg, t, seed)
                mbarrier.arrive(smem.kv_free, count=1)
                _store_dkdv(iprog, wg, dk, dv, t)
                j += 1
                i_b = _item_batch(prog, j, 4)
        else:
            wg = _half(prog, offsets, half)
            mbarrier.wait(smem.kv_bar, 0)
            dk, dv, t = _bwd_item(prog, wg, gl.program_id(0) * 0, seed)
            _store_dkdv(prog, wg, dk, dv, t)

    @gluon.jit
    def _half(prog, offsets, half: gl.constexpr):
        """Consumer warpgroup half's BwdHalf of the work item."""
        smem = prog.smem
        if prog.cfg.WIDE:
            # Both warpgroups take all 64 keys of the block (_bwd_step_wide).
            key0 = prog.walk.start_n
            k = smem.k
            v = smem.v
        elif prog.cfg.HALVES:
            # (_bwd_step_halves takes its own views of K's three column chunks and of V.)
            key0 = prog.walk.start_n + half * 64
            k = smem.k
            v = smem.v
        else:
            key0 = prog.walk.start_n + half * 64
            k = smem.k.slice(half * 64, 64)
            v = smem.v.slice(half * 64, 64)
        return BwdHalf(key0, key0 + gl.arange(0, 64, layout=gl.SliceLayout(1, prog.cfg.s_layout)), k, v,
                       smem.dq.index(half), offsets, half)

    @gluon.jit
    def _bwd_item(prog, wg, t, seed):
        """One work item's steps for warpgroup wg (from the program's t-th query tile on): returns dK, dV and the
        count of tiles after them."""
        cfg = prog.cfg
        walk = prog.walk
        if cfg.KV_SPLIT:
            dk = (gl.zeros([64, 64], gl.float32, layout=cfg.kv_layout),
                  gl.zeros([64, 32], gl.float32, layout=cfg.kv_layout_b))
            dv = (gl.zeros([64, 64], gl.float32, layout=cfg.kv_layout),
                  gl.zeros([64, 32], gl.float32, layout=cfg.kv_layout_b))
        elif cfg.HALVES:
            dk = (gl.zeros([64, 64], gl.float32, layout=cfg.kv_layout_b),
                  gl.zeros([64, 64], gl.float32, layout=cfg.kv_layout_b),
                  gl.zeros([64, 64], gl.float32, layout=cfg.kv_layout_b))
            dv = gl.zeros([64, cfg.D_V], gl.float32, layout=cfg.kv_layout)
        elif cfg.OWNERS:
            # Warpgroup 0 accumulates dV, warpgroup 1 dK (_wide_owned); the other is a placeholder, never updated.
            unused = gl.zeros([64, 64], gl.float32, layout=cfg.kv_layout_b)
            if wg.half == 0:
                dk = unused
                dv = _owned_zeros(cfg, cfg.D_V)
            else:
                dk = _owned_zeros(cfg, cfg.D)
                dv = unused
        else:
            dk = gl.zeros([64, cfg.KV_COLS], gl.float32, layout=cfg.kv_layout)
            dv = gl.zeros([64, cfg.KV_COLS], gl.float32, layout=cfg.kv_layout)
        kr = 0
        if cfg.K_REGS:
            # (Read once K has arrived: _bwd_partition's wait on kv_bar. The loop does not change them: they stay
            # live, and unchanged, through every product that reads them.)
            kr = _k_regs(cfg, wg.k)
        for g in range(walk.group_size):
            i_h = walk.i_hk * walk.group_size + g
            slope = 0.0
            if cfg.HAS_ALIBI:
                slope = gl.load(prog.ptrs.Alibi + walk.i_b * prog.mods.stride_alibi_b + i_h) * LOG2E
            if cfg.BIAS == 2:
                # The listed tiles, each masked (_list_row).
                row, count, rot = _list_row(prog.lists, walk.i_b, i_h, walk.start_n // cfg.BLOCK_N)
                for p in range(count):
                    m = _listed_tile(prog.lists, row, p, count, rot, cfg.BLOCK_M)
                    dk, dv = _bwd_step(prog, wg, t, m, i_h, dk, dv, slope, seed, prog.drop.bh0 + i_h, True)
                    t += 1
            else:
                # The masked query tiles first, then the rest (the order of _tile_start).
                for p in range(0, walk.n_mask):
                    m = walk.m_lo + _masked_tile(walk, p) * cfg.BLOCK_M
                    if cfg.WIDE:
                        dk, dv = _bwd_step_wide(prog, wg, t, m, i_h, dk, dv, kr, True)
                    elif cfg.HALVES:
                        dk, dv = _bwd_step_halves(prog, wg, t, m, i_h, dk, dv, True)
                    elif cfg.SKIP_DEAD:
                        if _dead_keys(prog, wg, m):
                            dk, dv = _dead_step(prog, wg, t, m, i_h, dk, dv)
                        else:
                            dk, dv = _bwd_step(prog, wg, t, m, i_h, dk, dv, slope, seed, prog.drop.bh0 + i_h, True)
                    else:
                        dk, dv = _bwd_step(prog, wg, t, m, i_h, dk, dv, slope, seed, prog.drop.bh0 + i_h, True)
                    t += 1
                for jj in range(0, walk.n_q - walk.n_mask):
                    m = walk.m_lo + _free_tile(walk, jj, cfg.ROTATE) * cfg.BLOCK_M
                    if cfg.WIDE:
                        dk, dv = _bwd_step_wide(prog, wg, t, m, i_h, dk, dv, kr, False)
                    elif cfg.HALVES:
                        dk, dv = _bwd_step_halves(prog, wg, t, m, i_h, dk, dv, False)
                    else:
                        dk, dv = _bwd_step(prog, wg, t, m, i_h, dk, dv, slope, seed, prog.drop.bh0 + i_h, False)
                    t += 1
        return dk, dv, t

    @gluon.jit
    def _owned_zeros(cfg, D: gl.constexpr):
        """OWNERS: a zero accumulator over a head dim of D columns: [64, 128], at 192 with a [64, 64] one."""
        acc = gl.zeros([64, 128], gl.float32, layout=cfg.kv_layout)
        if D > 128:
            return acc, gl.zeros([64, 64], gl.float32, layout=cfg.kv_layout_b)
        else:
            return acc

    @gluon.jit
    def _store_dkdv(prog, wg, dk, dv, t):
        """Store the warpgroup's 64 rows of dK and dV (those below Sk; DROPOUT: dV's 1 / (1 - p) applied here); t:
        the program's query tiles so far (_store_halves)."""
        cfg = prog.cfg
        if cfg.KV_SPLIT:
            if cfg.DROPOUT:
                dv = (dv[0] * prog.drop.rescale, dv[1] * prog.drop.rescale)
            _store_kv_cols(prog, wg, dk[0], dv[0], 0)
            _store_kv_cols(prog, wg, dk[1], dv[1], 64)
        elif cfg.HALVES:
            _store_halves(prog, wg, dk, dv, t)
        elif cfg.WIDE and prog.ptrs.dK.dtype.element_ty.primitive_bitwidth == 16:
            _store_wide_staged(prog, wg, dk, dv, t)
        elif cfg.OWNERS:
            # (WIDE: no dropout.) Warpgroup 0 owns dV, warpgroup 1 dK.
            ptrs = prog.ptrs
            strides = prog.strides
            if wg.half == 0:
                _store_owned(prog, wg, ptrs.dV, strides.dv_b, strides.dv_s, strides.dv_h, dv, cfg.D_V)
            else:
                _store_owned(prog, wg, ptrs.dK, strides.dk_b, strides.dk_s, strides.dk_h, dk, cfg.D)
        else:
            if cfg.DROPOUT:
                dv = dv * prog.drop.rescale  # dV = (P o Z)^T dO / (1 - p): the steps leave the factor to here
            _store_kv_cols(prog, wg, dk, dv, 0)

    @gluon.jit
    def _store_wide_staged(prog, wg, dk, dv, t):
        """WIDE (d192, d256) into 16-bit buffers: the warpgroup's dK and dV columns (with OWNERS its one accumulator,
        dV's or dK's) through its dQ staging tile, one piece at a time (_via_tile), as _store_halves does, once the
        writer has read the item's last share from the tile (the warpgroup stages N shares a step, so its next
        staging is use N t and waits on the same phase)."""
        cfg = prog.cfg
        ptrs = prog.ptrs
        st = prog.strides
        N: gl.constexpr = _wide_dq_shares(cfg.D, wg.half)
        mbarrier.wait(prog.smem.dq_bars.index(2 * wg.half + 1), ((N * t) & 1) ^ 1)
        if cfg.OWNERS:
            if wg.half == 0:
                _via_owned(prog, wg, ptrs.dV, st.dv_b, st.dv_s, st.dv_h, dv, cfg.D_V)
            else:
                _via_owned(prog, wg, ptrs.dK, st.dk_b, st.dk_s, st.dk_h, dk, cfg.D)
        else:
            _via_tile(prog, wg, wg.dq, dk, ptrs.dK, st.dk_b, st.dk_s, st.dk_h, 0, cfg.D)
            _via_tile(prog, wg, wg.dq, dv, ptrs.dV, st.dv_b, st.dv_s, st.dv_h, 0, cfg.D_V)

    @gluon.jit
    def _via_owned(prog, wg, ptr, stride_b, stride_s, stride_h, acc, D: gl.constexpr):
        """_store_owned through the warpgroup's staging tile (_via_tile)."""
        if D > 128:
            _via_tile(prog, wg, wg.dq, acc[0], ptr, stride_b, stride_s, stride_h, 0, D)
            _via_tile(prog, wg, wg.dq, acc[1], ptr, stride_b, stride_s, stride_h, 128, D)
        else:
            _via_tile(prog, wg, wg.dq, acc, ptr, stride_b, stride_s, stride_h, 0, D)

    @gluon.jit
    def _via_tile(prog, wg, tile, acc, ptr, stride_b, stride_s, stride_h, col0: gl.constexpr, D: gl.constexpr):
        """Store acc ([64, W] fp32, W <= 128: dK's or dV's columns from col0) at ptr through `tile`, a free 16 KB
        staging tile: stored there in the buffer's 16-bit dtype from the accumulator's layout, read back in
        row_pieces_layout and stored as 16-byte row pieces (_rows_for_store's conversion, in memory of the kernel's
        own). Every thread's read is done before it returns (the tile's next writer may be any of the warpgroup's
        threads)."""
        ty: gl.constexpr = ptr.dtype.element_ty
        layout: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
        W: gl.constexpr = acc.shape[1]
        view = tile._reinterpret(ty, [128 // W, 64, W], layout).index(0)
        view.store(acc.to(ty))
        thread_barrier()
        _store_rows(prog, wg, ptr, stride_b, stride_s, stride_h, view.load(row_pieces_layout(W)), col0, D)
        thread_barrier()

    @gluon.jit
    def _store_halves(prog, wg, dk, dv, t):
        """HALVES: store the warpgroup's dK (three [64, 64] chunks) and dV ([64, 128]). Into 16-bit buffers through
        the warpgroup's own dQ staging tiles (0 and 1 for warpgroup 0, 2 for warpgroup 1), as _rows_for_store's
        conversion, which finds no shared memory free here: each piece is stored there from the accumulator's
        layout and read back in row_pieces_layout, 16 KB per tile at a time, once the writer has read the item's
        last shares from the tiles (t: the program's query tiles so far; the next staging waits on the same phase).
        A probe that kept the products but not these stores ran MLA's causal backward 1.04-1.09x faster at 1k-4k
        with the accumulators stored directly. Float32 buffers (context parallelism's) are stored directly."""
        cfg = prog.cfg
        ptrs = prog.ptrs
        st = prog.strides
        ty: gl.constexpr = ptrs.dK.dtype.element_ty
        if ty.primitive_bitwidth == 16:
            smem = prog.smem
            tile: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
            first: gl.constexpr = 0 if wg.half == 0 else 2
            mbarrier.wait(smem.dq_bars.index(2 * first + 1), (t & 1) ^ 1)
            dv_tile = smem.dq.index(first)._reinterpret(ty, [64, cfg.D_V], tile)
            dv_tile.store(dv.to(ty))
            if wg.half == 0:
                mbarrier.wait(smem.dq_bars.index(3), (t & 1) ^ 1)
                dk_pair = smem.dq.index(1)._reinterpret(ty, [2, 64, 64], tile)
                dk_pair.index(0).store(dk[0].to(ty))
                dk_pair.index(1).store(dk[1].to(ty))
            thread_barrier()
            _store_rows(prog, wg, ptrs.dV, st.dv_b, st.dv_s, st.dv_h, dv_tile.load(row_pieces_layout(cfg.D_V)), 0,
                        cfg.D_V)
            if wg.half == 1:
                thread_barrier()  # (every thread's read of dV before dK's chunks go over it)
                dk_pair = smem.dq.index(2)._reinterpret(ty, [2, 64, 64], tile)
                dk_pair.index(0).store(dk[0].to(ty))
                dk_pair.index(1).store(dk[1].to(ty))
                thread_barrier()
            for c in gl.static_range(2):
                _store_rows(prog, wg, ptrs.dK, st.dk_b, st.dk_s, st.dk_h, dk_pair.index(c).load(row_pieces_layout(64)),
                            64 * c, cfg.D)
            thread_barrier()
            last = smem.dq.index(first)._reinterpret(ty, [2, 64, 64], tile).index(0)
            last.store(dk[2].to(ty))
            thread_barrier()
            _store_rows(prog, wg, ptrs.dK, st.dk_b, st.dk_s, st.dk_h, last.load(row_pieces_layout(64)), 128, cfg.D)
            thread_barrier()  # (every thread's read before the next item's staging)
        else:
            for c in gl.static_range(3):
                _store_kv_rows(prog, wg, ptrs.dK, st.dk_b, st.dk_s, st.dk_h, dk[c], 64 * c, cfg.D)
            _store_kv_rows(prog, wg, ptrs.dV, st.dv_b, st.dv_s, st.dv_h, dv, 0, cfg.D_V)

    @gluon.jit
    def _rows_for_store(x, ty, CONVERT: gl.constexpr):
        """An accumulator tile in the dtype ty of the buffer it goes to; 16-bit ones in _gluon.row_pieces_layout
        (through shared memory, the conversion's scratch): from the accumulator's layout, each 4-byte store of a
        warp wrote to eight rows, and a work item's dK and dV stores took ~4 us (H100, d128; docs/design-record.md,
        "A work item's edge in the backward"); now a quarter as many stores, of whole 16-byte pieces. CONVERT: the
        shared memory has room for the scratch (16 KB at d128): not with WIDE's tiles nor an attn_mask's ring (a
        float mask's calls failed to launch with it); float32 buffers, context parallelism's, keep the
        accumulator's layout too, as their scratch would not fit."""
        x = x.to(ty)
        if CONVERT and ty.primitive_bitwidth == 16:
            x = gl.convert_layout(x, row_pieces_layout(x.shape[1]))
        return x

    @gluon.jit
    def _store_kv_cols(prog, wg, dk, dv, col0: gl.constexpr):
        """_store_dkdv's stores of dK's and dV's columns col0 on (WIDE: of this warpgroup's half of them), rows below
        Sk and, with PAD_D, columns below the head dims."""
        cfg = prog.cfg
        ptrs = prog.ptrs
        strides = prog.strides
        _store_kv_rows(prog, wg, ptrs.dK, strides.dk_b, strides.dk_s, strides.dk_h, dk, col0, cfg.D)
        _store_kv_rows(prog, wg, ptrs.dV, strides.dv_b, strides.dv_s, strides.dv_h, dv, col0, cfg.D_V)

    @gluon.jit
    def _store_owned(prog, wg, ptr, stride_b, stride_s, stride_h, acc, D: gl.constexpr):
        """OWNERS: store a warpgroup's accumulator (_owned_zeros's, over D columns) at ptr."""
        if D > 128:
            _store_kv_rows(prog, wg, ptr, stride_b, stride_s, stride_h, acc[0], 0, D)
            _store_kv_rows(prog, wg, ptr, stride_b, stride_s, stride_h, acc[1], 128, D)
        else:
            _store_kv_rows(prog, wg, ptr, stride_b, stride_s, stride_h, acc, 0, D)

    @gluon.jit
    def _store_kv_rows(prog, wg, ptr, stride_b, stride_s, stride_h, acc, col0: gl.constexpr, D: gl.constexpr):
        """One of _store_kv_cols's stores: acc (dK's or dV's columns from col0, head dim D) at ptr."""
        cfg = prog.cfg
        # In the buffer's dtype: q's for the public API; float32 for context parallelism's block gradients, which
        # are summed over the ring (flashtile/distributed/_local.py) and would otherwise be rounded once per block.
        x = _rows_for_store(acc, ptr.dtype.element_ty, not cfg.WIDE and not cfg.HALVES and not cfg.BIAS)
        _store_rows(prog, wg, ptr, stride_b, stride_s, stride_h, x, col0, D)

    @gluon.constexpr_function
    def _masks_columns(cfg, D):
        """Whether stores of dK's or dV's columns (head dim D) mask those from D on: KV_SPLIT's accumulators end at
        96 columns and OWNERS' at 128 or 192, so d96, d128 and d192 need no mask there; every other padded head dim
        (and every other path) does."""
        if cfg.KV_SPLIT:
            return D != 96
        if cfg.OWNERS:
            return D != 128 and D != 192
        return True

    @gluon.jit
    def _store_rows(prog, wg, ptr, stride_b, stride_s, stride_h, x, col0: gl.constexpr, D: gl.constexpr):
        """Store x, the warpgroup's 64 rows of dK's or dV's columns from col0 (head dim D) in the buffer's dtype and
        any layout, at ptr: the rows below Sk (and, with PAD_D, the columns below D)."""
        cfg = prog.cfg
        layout: gl.constexpr = x.type.layout
        rows = wg.key0 + gl.arange(0, 64, layout=gl.SliceLayout(1, layout))  # in the sequence
        dcol = gl.expand_dims(gl.arange(0, x.shape[1], layout=gl.SliceLayout(0, layout)), 0) + col0
        if cfg.WIDE and not cfg.OWNERS:
            dcol += wg.half * cfg.KV_COLS  # (this warpgroup's columns: _bwd_step_wide)
        keep = gl.expand_dims(rows < prog.band.seqlen_k, 1)
        if cfg.PAD_D and _masks_columns(cfg, D):
            keep = keep & (dcol < D)
        k0 = prog.walk.k0.to(gl.int64)
        p = (ptr + prog.walk.i_b.to(gl.int64) * stride_b + prog.walk.i_hk.to(gl.int64) * stride_h + k0 * stride_s
             + gl.expand_dims(rows.to(gl.int64) * stride_s, 1) + dcol)
        gl.store(p, x, mask=keep)

    @gluon.jit
    def _grouped_order(i_n, i_bh, group, n_blocks, n_bh):
        """List index (i_n fastest, n_blocks key blocks x n_bh batch entries x kv heads) -> (key block, batch x kv
        head) with the heads in groups of `group` and each group's key blocks in turn across its heads: block 0 of
        each head, then block 1, ..."""
        pid = i_bh * n_blocks + i_n
        g0 = (pid // (group * n_blocks)) * group
        size = gl.minimum(group, n_bh - g0)
        r = pid - g0 * n_blocks
        return r // size, g0 + r % size

    @gluon.jit
    def _seq_span(cu_seqlens, i_b, longest):
        """(first row, length) of sequence i_b of a varlen batch: rows [cu[i_b], cu[i_b + 1]), the length capped at
        the launch's longest (max_seqlen: the per-row buffers hold that many rows; rows past it are not computed)."""
        start = gl.load(cu_seqlens + i_b)
        return start, gl.minimum(gl.load(cu_seqlens + i_b + 1) - start, longest)

    @gluon.jit
    def _query_tiles(cfg, i_n, start_n, seqlen_q, seqlen_k, diag_offset, window_left, window_right):
        """The query tiles key block i_n visits, in the fields of BwdWalk: (m_lo, n_q, i_full, i_diag, i_diag_end,
        i_end, n_mask, shift); see "Tile order"."""
        BLOCK_M: gl.constexpr = cfg.BLOCK_M
        # Query rows that see this key block (kernels/_common._query_range): query i sees key j iff
        # j - diag - window_right <= i <= j - diag + window_left. Tiles m_lo + i * BLOCK_M, i < n_q.
        m_lo = 0
        if cfg.MASK_RIGHT:
            m_lo = (gl.maximum(start_n - diag_offset - window_right, 0) // BLOCK_M) * BLOCK_M
        m_hi = seqlen_q
        if cfg.MASK_LEFT:
            m_hi = gl.minimum(seqlen_q, gl.minimum(start_n + cfg.BLOCK_N, seqlen_k) - diag_offset + window_left)
        n_q = gl.cdiv(gl.maximum(m_hi - m_lo, 0), BLOCK_M)
        # Tiles i in [i_full, i_end) see every key of the block: no mask. Below i_full the band's right edge crosses
        # the tile, from i_end on its left edge; a key block past Sk masks every tile.
        i_full = 0
        if cfg.MASK_RIGHT:
            i_full = gl.cdiv(gl.maximum(start_n + cfg.BLOCK_N - 1 - diag_offset - window_right - m_lo, 0), BLOCK_M)
        i_end = n_q
        if cfg.MASK_LEFT:
            i_end = gl.maximum(start_n - diag_offset + window_left + 1 - m_lo, 0) // BLOCK_M
        if start_n + cfg.BLOCK_N > seqlen_k:
            i_full = n_q
        i_full = gl.minimum(i_full, n_q)
        i_end = gl.minimum(gl.maximum(i_end, i_full), n_q)
        # With ALiBi the tiles the diagonal crosses, [i_diag, i_diag_end), take the masked path too (the bounds of a
        # window (0, 0)): in every other tile i + diag - j has one sign (see _bwd_step).
        i_diag = i_end
        i_diag_end = i_end
        if cfg.HAS_ALIBI:
            i_diag = gl.maximum(start_n - diag_offset + 1 - m_lo, 0) // BLOCK_M
            i_diag_end = gl.cdiv(gl.maximum(start_n + cfg.BLOCK_N - 1 - diag_offset - m_lo, 0), BLOCK_M)
            i_diag = gl.minimum(gl.maximum(i_diag, i_full), i_end)
            i_diag_end = gl.minimum(gl.maximum(i_diag_end, i_diag), i_end)
        n_mask = i_full + (i_diag_end - i_diag) + (n_q - i_end)
        # Without a right bound every key block would start at the same query tile: start each at a different one
        # of its unmasked tiles (ROTATE), so that the programs' dQ reductions do not all land on the same rows at
        # once. With one, the blocks' ranges start at different rows anyway.
        shift = i_n % gl.maximum(n_q - n_mask, 1)
        return m_lo, n_q, i_full, i_diag, i_diag_end, i_end, n_mask, shift

    @gluon.jit
    def _bwd_descriptors(cfg, Q, K, V, dOut, LseLog2, Delta, strides, heads, n_bh, q_rows, seqlen_k, seqlen_q_pad):
        """TMA descriptors of Q, dO, K, V and of LSE and delta. One descriptor per tensor: rows are sequence
        positions, columns (head, dim), so every head is a column offset (supports() checks that the heads of a row
        are contiguous); under VARLEN over one sequence (the pointers based at its first row), else 3-D with the
        batch entries first ([B, S, heads * HEAD_DIM]: a persistent program's work items all read through them,
        and TMA still zero-fills at each entry's own end; offline, the one-item grid's d128 kernels spilled less
        with them than with one batch entry's 2-D ones)."""
        HEAD_DIM: gl.constexpr = cfg.HEAD_DIM
        if cfg.HALVES:
            # Q and K in 64-column chunks of their head dim, V and dO whole (_load_cols): no zero columns.
            q_desc = _chunk_descriptor(cfg, Q, heads.num_heads * cfg.D, n_bh // heads.num_kv_heads, q_rows, strides.q_b,
                                       strides.q_s, cfg.BLOCK_M, 64)
            k_desc = _chunk_descriptor(cfg, K, heads.num_kv_heads * cfg.D, n_bh // heads.num_kv_heads, seqlen_k,
                                       strides.k_b, strides.k_s, cfg.BLOCK_N, 64)
            do_desc = _chunk_descriptor(cfg, dOut, heads.num_heads * cfg.D_V, n_bh // heads.num_kv_heads, q_rows,
                                        strides.do_b, strides.do_s, cfg.BLOCK_M, cfg.D_V)
            v_desc = _chunk_descriptor(cfg, V, heads.num_kv_heads * cfg.D_V, n_bh // heads.num_kv_heads, seqlen_k,
                                       strides.v_b, strides.v_s, cfg.BLOCK_N, cfg.D_V)
        elif cfg.PAD_D:
            q_desc = _padded_descriptor(cfg, Q, heads.num_heads, n_bh // heads.num_kv_heads, q_rows, strides.q_b,
                                        strides.q_s, cfg.BLOCK_M, cfg.D)
            do_desc = _padded_descriptor(cfg, dOut, heads.num_heads, n_bh // heads.num_kv_heads, q_rows,
                                         strides.do_b, strides.do_s, cfg.BLOCK_M, cfg.D_V)
            k_desc = _padded_descriptor(cfg, K, heads.num_kv_heads, n_bh // heads.num_kv_heads, seqlen_k, strides.k_b,
                                        strides.k_s, cfg.BLOCK_N, cfg.D)
            v_desc = _padded_descriptor(cfg, V, heads.num_kv_heads, n_bh // heads.num_kv_heads, seqlen_k, strides.v_b,
                                        strides.v_s, cfg.BLOCK_N, cfg.D_V)
        elif cfg.VARLEN:
            layout: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
            q_desc = tma.make_tensor_descriptor(Q, [q_rows, heads.num_heads * HEAD_DIM], [strides.q_s, 1],
                                                [cfg.BLOCK_M, HEAD_DIM], layout)
            do_desc = tma.make_tensor_descriptor(dOut, [q_rows, heads.num_heads * HEAD_DIM], [strides.do_s, 1],
                                                 [cfg.BLOCK_M, HEAD_DIM], layout)
            k_desc = tma.make_tensor_descriptor(K, [seqlen_k, heads.num_kv_heads * HEAD_DIM], [strides.k_s, 1],
                                                [cfg.BLOCK_N, HEAD_DIM], layout)
            v_desc = tma.make_tensor_descriptor(V, [seqlen_k, heads.num_kv_heads * HEAD_DIM], [strides.v_s, 1],
                                                [cfg.BLOCK_N, HEAD_DIM], layout)
        else:
            layout3: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=3)
            batch = n_bh // heads.num_kv_heads
            q_desc = tma.make_tensor_descriptor(Q, [batch, q_rows, heads.num_heads * HEAD_DIM],
                                                [strides.q_b, strides.q_s, 1], [1, cfg.BLOCK_M, HEAD_DIM], layout3)
            do_desc = tma.make_tensor_descriptor(dOut, [batch, q_rows, heads.num_heads * HEAD_DIM],
                                                 [strides.do_b, strides.do_s, 1], [1, cfg.BLOCK_M, HEAD_DIM], layout3)
            k_desc = tma.make_tensor_descriptor(K, [batch, seqlen_k, heads.num_kv_heads * HEAD_DIM],
                                                [strides.k_b, strides.k_s, 1], [1, cfg.BLOCK_N, HEAD_DIM], layout3)
            v_desc = tma.make_tensor_descriptor(V, [batch, seqlen_k, heads.num_kv_heads * HEAD_DIM],
                                                [strides.v_b, strides.v_s, 1], [1, cfg.BLOCK_N, HEAD_DIM], layout3)
        # LSE and delta: [B * H, Sq_pad] fp32, one [1, BLOCK_M] row piece per query tile.
        row_layout: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=2)
        bh_rows = (n_bh // heads.num_kv_heads) * heads.num_heads
        lse_desc = tma.make_tensor_descriptor(LseLog2, [bh_rows, seqlen_q_pad], [seqlen_q_pad, 1], [1, cfg.BLOCK_M],
                                              row_layout)
        delta_desc = tma.make_tensor_descriptor(Delta, [bh_rows, seqlen_q_pad], [seqlen_q_pad, 1], [1, cfg.BLOCK_M],
                                                row_layout)
        return q_desc, do_desc, k_desc, v_desc, lse_desc, delta_desc

    @gluon.jit
    def _chunk_descriptor(cfg, T, cols, batch, rows, stride_b, stride_s, BLOCK: gl.constexpr, WIDTH: gl.constexpr):
        """HALVES: the descriptor of [BLOCK, WIDTH] tiles over T seen as [B, S, cols] (VARLEN: [S, cols]), cols
        its heads times its head dim. (The other kernels build the same descriptors inline in _bwd_descriptors:
        routed through this function, their SASS changed, offline, in register allocation and instruction order,
        and those kernels' timings were taken with it as it is.)"""
        if cfg.VARLEN:
            layout: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
            desc = tma.make_tensor_descriptor(T, [rows, cols], [stride_s, 1], [BLOCK, WIDTH], layout)
        else:
            layout3: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=3)
            desc = tma.make_tensor_descriptor(T, [batch, rows, cols], [stride_b, stride_s, 1], [1, BLOCK, WIDTH],
                                              layout3)
        return desc

    @gluon.jit
    def _padded_descriptor(cfg, T, heads, batch, rows, stride_b, stride_s, BLOCK: gl.constexpr, D: gl.constexpr):
        """PAD_D: the descriptor of [BLOCK, HEAD_DIM] tiles over T's [B, S, heads, D] (VARLEN: [S, heads, D]) with
        the head dim apart, so that the columns from D on are zero-filled (D: cfg.D for q and k, cfg.D_V for v
        and dO)."""
        if cfg.VARLEN:
            layout3: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=3)
            desc = tma.make_tensor_descriptor(T, [rows, heads, D], [stride_s, D, 1], [BLOCK, 1, cfg.HEAD_DIM],
                                              layout3)
        else:
            layout4: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=4)
            desc = tma.make_tensor_descriptor(T, [batch, rows, heads, D], [stride_b, stride_s, D, 1],
                                              [1, BLOCK, 1, cfg.HEAD_DIM], layout4)
        return desc

    @gluon.jit
    def _bwd_smem(cfg, DqAcc, Bias, DBias, heads, n_bh, q_rows, seqlen_q_pad):
        """dQ's fp32 buffer descriptor (BwdDq) and the backward's shared memory (BwdSmem), barriers initialized.

        dQ accumulates in fp32. FLAT (fixed-length batches): tile by tile, [B, H, Sq_pad / BLOCK_M, shares, 4096]
        in _stage_dq's order (BLOCK_M * DQ_WIDTH / 4096 shares: 2 at d64-d128, 3 at d192 and MLA, 4 at d256), seen
        as rows of 256 (one [16, 256] reduction per share); attention_backward's
        _dq_from_tiles_kernel puts it in dQ's layout. VARLEN: laid out as dQ itself, [total_q, H, D], this sequence's
        rows, reduced by [64, 32] boxes of 128-byte swizzled staging (the reductions clip the tiles at the
        sequence's end)."""
        HEAD_DIM: gl.constexpr = cfg.HEAD_DIM
        BLOCK_M: gl.constexpr = cfg.BLOCK_M
        STAGES: gl.constexpr = cfg.STAGES
        dq_batch_rows = seqlen_q_pad
        if cfg.FLAT:
            dq_layout: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=2)
            dq_rows = (n_bh // heads.num_kv_heads) * heads.num_heads * (seqlen_q_pad * cfg.DQ_WIDTH // 256)
            dq_desc = tma.make_tensor_descriptor(DqAcc, [dq_rows, 256], [256, 1], [16, 256], dq_layout)
            dq_smem = gl.allocate_shared_memory(gl.float32, [2 + cfg.HALVES, 16, 256], dq_layout)
        else:
            dq_layout: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=32, rank=2)
            dq_batch_rows = 0
            dq_desc = tma.make_tensor_descriptor(DqAcc, [q_rows, heads.num_heads * HEAD_DIM],
                                                 [heads.num_heads * HEAD_DIM, 1], [64, 32], dq_layout)
            dq_smem = gl.allocate_shared_memory(gl.float32, [2 + cfg.HALVES, 64, 64], dq_layout)

        layout: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
        row_layout: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=2)
        if cfg.WIDE:
            # K and V in one allocation: _bwd_step_wide takes its views of them anew each step (_kv_views).
            kv_smem = gl.allocate_shared_memory(cfg.dtype, [2, cfg.BLOCK_N, HEAD_DIM], layout)
            k_smem = kv_smem.index(0)
            v_smem = kv_smem.index(1)
        elif cfg.HALVES:
            # K as three [128, 64] column chunks, Q as three [64, 64] ones per ring slot (slot s: 3 s .. 3 s + 2),
            # V and dO whole; one [64 queries, 128 keys] dS tile; a third dQ staging tile (above). 224 KB in all.
            k_smem = gl.allocate_shared_memory(cfg.dtype, [3, cfg.BLOCK_N, 64], layout)
            v_smem = gl.allocate_shared_memory(cfg.dtype, [1, cfg.BLOCK_N, cfg.D_V], layout)
        else:
            k_smem = gl.allocate_shared_memory(cfg.dtype, [cfg.BLOCK_N, HEAD_DIM], layout)
            v_smem = gl.allocate_shared_memory(cfg.dtype, [cfg.BLOCK_N, HEAD_DIM], layout)
        if cfg.HALVES:
            q_smem = gl.allocate_shared_memory(cfg.dtype, [3 * STAGES, BLOCK_M, 64], layout)
        else:
            q_smem = gl.allocate_shared_memory(cfg.dtype, [STAGES, BLOCK_M, HEAD_DIM], layout)
        if cfg.HALVES:
            do_smem = gl.allocate_shared_memory(cfg.dtype, [STAGES, BLOCK_M, cfg.D_V], layout)
            ds_smem = gl.allocate_shared_memory(cfg.dtype, [1, BLOCK_M, cfg.BLOCK_N], layout)
        elif cfg.WIDE:
            # One dO buffer (_load_q_tile_wide); dS and P as [queries, keys] tiles, dS at 2 (t % 2), P after it
            # (_bwd_step_wide). 224 KB in all at d256.
            do_smem = gl.allocate_shared_memory(cfg.dtype, [1, BLOCK_M, HEAD_DIM], layout)
            ds_smem = gl.allocate_shared_memory(cfg.dtype, [4, BLOCK_M, cfg.BLOCK_N], layout)
        else:
            do_smem = gl.allocate_shared_memory(cfg.dtype, [STAGES, BLOCK_M, HEAD_DIM], layout)
            if cfg.DBIAS and not cfg.SOFTCAP:
                ds_smem = q_smem  # never read: dS rides in the ring's bias tiles (_dq_step)
            else:
                ds_smem = gl.allocate_shared_memory(cfg.dtype, [2, cfg.BLOCK_N, BLOCK_M], layout)
        # (ROLES: two more, P^T's, from warpgroup 0 to warpgroup 1: _bwd_step_wide.)
        ds_ready = gl.allocate_shared_memory(gl.int64, [2 + 2 * cfg.ROLES, 1], mbarrier.MBarrierLayout())
        dq_bars = gl.allocate_shared_memory(gl.int64, [4 + 2 * cfg.HALVES, 1], mbarrier.MBarrierLayout())
        lse_smem = gl.allocate_shared_memory(gl.float32, [STAGES, 1, BLOCK_M], row_layout)
        delta_smem = gl.allocate_shared_memory(gl.float32, [STAGES, 1, BLOCK_M], row_layout)
        offsets_smem = gl.allocate_shared_memory(gl.float32, [2, 1, BLOCK_M], row_layout)  # ALiBi: see _bwd_step
        if cfg.BIAS:
            # One attn_mask tile per ring slot (a [64, 128] bf16 tile at d128 is 16 KB: 226 KB in all).
            b_type: gl.constexpr = Bias.block_type.element_ty
            b_layout: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128,
                                                          element_bitwidth=b_type.primitive_bitwidth, rank=2)
            bias_smem = gl.allocate_shared_memory(b_type, [STAGES, BLOCK_M, cfg.BLOCK_N], b_layout)
        else:
            bias_smem = lse_smem  # never read
            if cfg.WIDE:
                bias_smem = kv_smem  # (no attn_mask at 256 columns: the field carries K and V for _kv_views)
        kv_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        kv_free = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        item_smem = gl.allocate_shared_memory(gl.int32, [2 * ITEM_FIELDS, 1], gl.SwizzledSharedLayout(1, 1, 1, [0]))
        # (WIDE: one more pair at index STAGES, dO's buffer's.)
        q_full = gl.allocate_shared_memory(gl.int64, [STAGES + cfg.WIDE, 1], mbarrier.MBarrierLayout())
        q_empty = gl.allocate_shared_memory(gl.int64, [STAGES + cfg.WIDE, 1], mbarrier.MBarrierLayout())
        mbarrier.init(kv_bar, count=1)
        mbarrier.init(kv_free, count=2)  # both consumer warpgroups
        for i in gl.static_range(STAGES + cfg.WIDE):
            mbarrier.init(q_full.index(i), count=1)
            mbarrier.init(q_empty.index(i), count=2)  # both consumer warpgroups release a slot
        for i in gl.static_range(2):
            # Both halves of dS^T are in shared memory (HALVES: [0]; [1] both dQ products have read it).
            mbarrier.init(ds_ready.index(i), count=2)
        for i in gl.static_range(2 * cfg.ROLES):
            mbarrier.init(ds_ready.index(2 + i), count=1)
        for i in gl.static_range(4 + 2 * cfg.HALVES):
            mbarrier.init(dq_bars.index(i), count=1)
        smem = BwdSmem(lse_smem, delta_smem, offsets_smem, bias_smem, DBias, dq_bars, k_smem, v_smem, q_smem, do_smem,
                       ds_smem, ds_ready, dq_smem, kv_bar, Ring(q_full, q_empty, STAGES), item_smem, kv_free)
        return smem, BwdDq(dq_desc, dq_batch_rows)

    @gluon.jit
    def _bwd_kernel(Q, K, V, dOut, dK, dV, LseLog2, Delta, DqAcc, Alibi, CuSeqQ, CuSeqK, Seed, Counter, strides,
                    seqlen_q, seqlen_k, seqlen_q_pad, diag_offset, window_left, window_right, scales, heads, Bias,
                    bias_mul, DBias, Counts, Idx, lists, HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr,
                    BLOCK_N: gl.constexpr, STAGES: gl.constexpr, MASK_LEFT: gl.constexpr, MASK_RIGHT: gl.constexpr,
                    SOFTCAP: gl.constexpr, HAS_ALIBI: gl.constexpr, BIAS: gl.constexpr, DBIAS: gl.constexpr,
                    VARLEN: gl.constexpr, DROPOUT: gl.constexpr, PERSISTENT: gl.constexpr, D: gl.constexpr,
                    D_V: gl.constexpr, ROLES: gl.constexpr = False, OWNERS: gl.constexpr = False,
                    K_REGS: gl.constexpr = False, HALVES: gl.constexpr = False):
        """One program per (key block, batch entry x kv head), or PERSISTENT one per SM over them (BwdSched); the
        partitions and their roles are the module docstring's. strides, scales, heads, bias_mul and lists: the named
        tuples _Strides, _Scales, _Heads, _Mul, _Lists (attention_backward).
        Seed: the call's Philox key (int64) with DROPOUT (scales' drop_threshold, drop_rescale = 1 / (1 - p)).
        Counter: PERSISTENT's work counter (int32, zero before the launch and after it; BwdSched); heads.n_bh:
        batch entries x kv heads.
        VARLEN: Q, dOut, K, V, dK, dV and DqAcc are packed sequences ([total, H, D]; the host passes batch strides
        of 0): batch entry i_b is rows [CuSeqQ[i_b], CuSeqQ[i_b + 1]) of the query-side tensors and
        [CuSeqK[i_b], CuSeqK[i_b + 1]) of the key-side ones; seqlen_q / seqlen_k are the longest sequences (the
        grid's), replaced by each item's own (PERSISTENT: _varlen_walk_at, its descriptors over all the packed
        rows, heads.total_q / total_k of them). LseLog2 and Delta stay [B, H, Sq_pad] rows, indexed by the
        query's position in its sequence. CuSeqQ, CuSeqK are unused without.
        Bias: with BIAS (1 a float bias of q's dtype, 2 a bool mask) a TMA descriptor of [BLOCK_M, BLOCK_N] tiles
        over the [B|1, H|1, Sq, Sk] attn_mask (hopper_fwd.bias_descriptor; bias_mul's factors are 0 along its
        broadcast dims); Counts, Idx: a bool mask's tile lists (_list_row). Unused (placeholders) without.
        DBias: with DBIAS (a float bias that wants its gradient) a TMA descriptor of [BLOCK_M, 64] tiles over a
        [B, H, Sq, Sk] buffer of the bias's dtype (attention_backward sums it over the bias's broadcast dims).
        dbias = dS, the gradient of the score after softcap (the bias is added after it); every visited tile
        (query tile x key block x query head) is stored once, from the ring slot its bias tile came in."""
        gl.static_assert(not DBIAS or (BIAS == 1 and BLOCK_M == 64))
        # The dQ shares of _bwd_step: 64 query rows at d128 (split by columns), 128 at d64 (split by rows).
        gl.static_assert(BLOCK_M * HEAD_DIM == 8192 or (HEAD_DIM == 256 and BLOCK_M == 64
                                                       and BLOCK_N == (128 if HALVES else 64)))
        # (The WIDE step has no ALiBi, attn_mask or dropout.)
        gl.static_assert(HEAD_DIM != 256 or not (HAS_ALIBI or BIAS or DROPOUT))
        cfg = BwdConfig(HEAD_DIM, BLOCK_M, BLOCK_N, STAGES, MASK_LEFT, MASK_RIGHT, SOFTCAP, HAS_ALIBI, BIAS, DBIAS,
                        VARLEN, DROPOUT, PERSISTENT, D, D_V, Q.dtype.element_ty, ROLES, OWNERS,
                        K_REGS, HALVES)
        # Query heads per key head, computed here rather than passed: Triton specializes an integer argument equal
        # to 1 into a constant, and with group_size == 1 known at compile time ptxas allocated the consumers'
        # unmasked loop with 15 spill stores and 17 reloads per step (Triton 3.6, sm90, d128; ncu counted 34M
        # local-memory requests in a 4k backward).
        group_size = heads.num_heads // heads.num_kv_heads
        n_bh = heads.n_bh
        band = BwdBand(seqlen_k, diag_offset, window_left, window_right)
        q_rows = seqlen_q  # rows of the query-side descriptors
        k_rows = seqlen_k  # and of the key-side ones
        n_blocks = gl.cdiv(seqlen_k, BLOCK_N)  # (the longest sequence's under VARLEN)
        sched = BwdSched(Counter, CuSeqQ, CuSeqK, n_blocks * n_bh, n_blocks, n_bh, heads.head_group,
                         heads.num_kv_heads, seqlen_q, group_size)
        if PERSISTENT:
            # A persistent grid over the work list (BwdSched): the loader computes each item's walk and hands it to
            # the other partitions (_hand_over). Under a causal-like band, key block i_n sees fewer query tiles the
            # larger i_n is: the list puts each head's heaviest block first, with heads in groups of `group` whose
            # key blocks go heaviest first across the group's heads (block 0 of each head, then block 1, ...;
            # _walk_at). group * n_blocks >= 128, about the programs in flight at once (132 SMs, one program each),
            # keeps about one group in flight (its Q, dO and dQ rows stay in L2) while the counter balances a full
            # wave. A bool mask (BIAS 2) takes the same order: its block lists are most often causal-shaped (as the
            # forward assumes in _tile_coords), and for any other shape the order only permutes the blocks within a
            # group. A float attn_mask shared by the heads (attention_backward's head_group): the same order, so
            # that the group's programs for one key block read each mask tile at about the same time, once from
            # memory. Varlen batches list the longest sequence's key blocks for every sequence and kv head
            # (_varlen_walk_at skips those past a sequence's keys) and read through descriptors over all the packed
            # rows: a tile may then run into the next sequence's rows, which the band's key bound masks (keys) or
            # the padding's infinite LSE zeroes (queries: their dS rows are 0, so their dQ reductions add zeros).
            none = gl.program_id(0) * 0
            walk = BwdWalk(none, none, none, none, none, none, none, none, none, none, none, group_size, none, none)
            if VARLEN:
                q_rows = heads.total_q
                k_rows = heads.total_k
        elif VARLEN:
            # One work item per program: key block i_n of sequence i_b, kv head i_hk. This sequence alone: its own
            # lengths and bottom-right diagonal (kernels/_common._seq_bounds), every tensor based at its first row,
            # and descriptors of its own length, so that TMA zero-fills (loads) and clips (dQ reductions) at the
            # sequence's end, never touching a neighbour's rows.
            i_n = gl.program_id(0)
            i_bh = gl.program_id(1)
            i_b = i_bh // heads.num_kv_heads
            i_hk = i_bh % heads.num_kv_heads
            start_n = i_n * BLOCK_N
            q_start, len_q = _seq_span(CuSeqQ, i_b, seqlen_q)
            k_start, len_k = _seq_span(CuSeqK, i_b, seqlen_k)
            diag_offset = (gl.load(CuSeqK + i_b + 1) - k_start) - (gl.load(CuSeqQ + i_b + 1) - q_start)
            seqlen_q = len_q
            seqlen_k = len_k
            if start_n >= seqlen_k:  # the grid covers the longest sequence; this key block is past this one's end
                return
            Q += q_start.to(gl.int64) * strides.q_s
            dOut += q_start.to(gl.int64) * strides.do_s
            DqAcc += q_start.to(gl.int64) * (heads.num_heads * HEAD_DIM)
            K += k_start.to(gl.int64) * strides.k_s
            V += k_start.to(gl.int64) * strides.v_s
            dK += k_start.to(gl.int64) * strides.dk_s
            dV += k_start.to(gl.int64) * strides.dv_s
            # A sequence without queries still writes its keys' dK, dV (zeros: it visits no query tile); a
            # descriptor takes no empty dimension, and this one is never read then.
            q_rows = gl.maximum(seqlen_q, 1)
            k_rows = seqlen_k
            band = BwdBand(seqlen_k, diag_offset, window_left, window_right)
            m_lo, n_q, i_full, i_diag, i_diag_end, i_end, n_mask, shift = _query_tiles(
                cfg, i_n, start_n, seqlen_q, seqlen_k, diag_offset, window_left, window_right)
            none = i_n * 0
            walk = BwdWalk(i_b, i_hk, start_n, m_lo, n_q, i_full, i_diag, i_diag_end, i_end, n_mask, shift,
                           group_size, none, none)
        else:
            # One work item per program, in the list's order (grid (n_blocks, n_bh)).
            walk = _walk_at(cfg, sched, band, gl.program_id(1) * n_blocks + gl.program_id(0))
        q_desc, do_desc, k_desc, v_desc, lse_desc, delta_desc = _bwd_descriptors(
            cfg, Q, K, V, dOut, LseLog2, Delta, strides, heads, n_bh, q_rows, k_rows, seqlen_q_pad)
        smem, dq = _bwd_smem(cfg, DqAcc, Bias, DBias, heads, n_bh, q_rows, seqlen_q_pad)
        prog = BwdProgram(
            cfg, BwdPtrs(dK, dV, Alibi), smem, walk, band,
            BwdMods(scales.pre_scale, scales.qk_scale, scales.sm_scale, strides.alibi_b),
            BwdStrides(strides.dk_b, strides.dk_s, strides.dk_h, strides.dv_b, strides.dv_s, strides.dv_h),
            BwdLists(Counts, Idx, lists.b, lists.h, lists.cols),
            BwdDropout(Seed, walk.i_b * heads.num_heads, scales.drop_threshold, scales.drop_rescale),
            BwdLoads(q_desc, do_desc, k_desc, v_desc, lse_desc, delta_desc, Bias, heads.num_heads, bias_mul.b,
                     bias_mul.h), dq, sched)
        if PERSISTENT or HALVES:
            # (HALVES: on the one-item grid too; at 232 ptxas serialized its products for want of registers.)
            gl.warp_specialize([(_bwd_partition, (prog, 0)), (_bwd_partition, (prog, 1)),
                                (_bwd_load_partition, (prog, )), (_bwd_dq_partition, (prog, ))], [4, 1, 1],
                               [PERSISTENT_CONSUMER_REGS, PRODUCER_REGS, PRODUCER_REGS])
        else:
            gl.warp_specialize([(_bwd_partition, (prog, 0)), (_bwd_partition, (prog, 1)),
                                (_bwd_load_partition, (prog, )), (_bwd_dq_partition, (prog, ))], [4, 1, 1],
                               [CONSUMER_REGS, PRODUCER_REGS, PRODUCER_REGS])


def _rows(t):
    """t, or a copy of it whose heads are contiguous within each sequence row ([B, S, H, D] or [total, H, D] in
    memory): the kernel's descriptors span a row's heads. SDPA's (B, H, S, D) tensors, seen as (B, S, H, D), are
    copied (four q-sized copies, freed after the kernel): on an H100, fwd+bwd at d128 ran 1.12x faster than on the
    portable kernels they took before at 16k, 1.03x at 4k B4 (docs/design-record.md, "SDPA's tensor layout")."""
    return t if t.stride(-2) == t.shape[-1] and t.stride(-1) == 1 else t.contiguous()


def attention_backward(q, k, v, dout, dq, dk, dv, lse_log2, delta, req: AttentionRequest, dbias=None):
    """q, k, v, dout: [B, S, H, D], or [total, H, D] packed sequences with req.varlen (diagonal_offset is then unused:
    the kernel aligns each sequence to its own corner), any strides (_rows). dq, dk, dv: output buffers (their shapes,
    any strides); lse_log2, delta: [B, H, Sq_pad] (Sq_pad from max_seqlen_q for varlen) from the portable backward's
    preprocess (kernels/backward.py), the sinks and dLSE already folded in, delta times softmax_scale (the kernel's dS
    carries the scale: _bwd_step); req: the call's request (flashtile/dispatch.py chose this kernel for it). dbias:
    None, or a [B, H, Sq, Sk]
    buffer of the float bias's dtype (unit key stride, 16-byte aligned rows) that takes dS; the tiles outside a band are
    not written."""
    plan = gluon_plan(q, k, v, dout, (dq, dk, dv), lse_log2.shape, req, dbias is not None)
    plan.run(_launch.stream_for(q.get_device()), q, k, v, dout, dq, dk, dv, lse_log2, delta, req, dbias)
    return dq, dk, dv


class GluonBwdPlan:
    """The launches of attention_backward for one plan key (kernels/backward.BwdPlan holds it), everything but the
    call's tensors fixed: the grid, the scalar groups, the constexprs and the compiled kernels (_launch.Bound)."""
    __slots__ = ("launch", "to_dq", "acc_shape", "scalars", "mul", "lists", "tiles", "varlen", "dropout", "device",
                 "persistent")

    def dq_buffer(self, zeroed_elsewhere):
        """The kernel's float32 dQ buffer: [total_q, H, D] for varlen, each sequence's reductions stopping at its
        end; else tile by tile (the kernel's dq_desc note). The kernel adds into it: zeroed here unless
        zeroed_elsewhere (kernels/backward.py's preprocess zeroes it, fixed-length and varlen)."""
        if zeroed_elsewhere:
            return torch.empty(self.acc_shape, dtype=torch.float32, device=self.device)
        return torch.zeros(self.acc_shape, dtype=torch.float32, device=self.device)

    def run(self, stream, q, k, v, dout, dq, dk, dv, lse_log2, delta, req, dbias, dq_addend=None, dq_acc=None):
        """Launch the kernel and write dq, dk, dv; dq_addend: None, or a float32 tensor shaped like q that dQ is
        added to before it is rounded into dq (kernels/backward.BwdPlan.run); dq_acc: the zeroed dq_buffer, or
        None (one is made here)."""
        q, k, v, dout = _rows(q), _rows(k), _rows(v), _rows(dout)
        if dq_acc is None:
            dq_acc = self.dq_buffer(False)
        cu_q = cu_k = delta  # placeholders, never read
        if self.varlen:
            cu_q, cu_k = req.cu_seqlens_q, req.cu_seqlens_k
        alibi = delta if req.alibi_slopes is None else req.alibi_slopes  # delta: never read without ALiBi
        # attn_mask: its tile descriptor, and for a bool mask the lists of query tiles to visit per key block
        # (placeholders, never read, without).
        bias, counts, indices, dbias_desc = delta, delta, delta, delta
        if req.attn_bias is not None:
            bias = hopper_fwd.bias_descriptor(req.attn_bias, *self.tiles)[0]
            lists = Features(req).block_lists(*self.tiles, True, *self.lists[3:])
            if lists is not None:
                counts, indices = lists.counts, lists.indices
        if dbias is not None:
            # Each consumer warpgroup stores its 64 keys of a [BLOCK_M, 128] tile.
            dbias_desc = TensorDescriptor(dbias, list(dbias.shape), list(dbias.stride()), [1, 1, self.tiles[0], 64],
                                          hopper_fwd._layout(8 * dbias.element_size(), 4))
        configs._set_tma_allocator(self.device)
        counter = hopper_fwd._schedule_counter(self.device, stream) if self.persistent else delta  # (never read)
        self.launch(stream, q, k, v, dout, dk, dv, lse_log2, delta, dq_acc, alibi, cu_q, cu_k,
                    req.seed if self.dropout else delta, counter, *self.scalars, bias, self.mul, dbias_desc, counts,
                    indices,
                    _Lists(*self.lists[:3]))
        if self.varlen:
            dq_acc = dq_acc[..., :dq.shape[-1]]  # (d96: the tiles' zero columns)
            dq.copy_(dq_acc if dq_addend is None else dq_acc.add_(dq_addend))
        elif dq_addend is None:
            self.to_dq(stream, dq_acc, dq, dq_acc)
        else:
            _dq_from_tiles_launch(dq, lse_log2.shape[-1], dq_addend)(stream, dq_acc, dq, dq_addend)


def gluon_plan(q, k, v, dout, grads, rows_shape, req: AttentionRequest, bias_grad):
    """The GluonBwdPlan of a call (attention_backward's arguments; grads: (dq, dk, dv), None for those the caller
    allocates contiguous; rows_shape: lse_log2's)."""
    feats = Features(req)
    varlen = req.varlen
    q, k, v, dout = (_rows(t) for t in (q, k, v, dout))
    dk, dv = (g if g is not None else torch.empty(t.shape, dtype=t.dtype, device="meta")
              for g, t in zip(grads[1:], (k, v)))
    num_heads, head_dim = q.shape[-2:]
    num_kv_heads = k.shape[-2]
    seqlen_q_pad = rows_shape[-1]
    plan = GluonBwdPlan()
    plan.device, plan.varlen, plan.dropout = q.device, varlen, req.dropout_p > 0
    if varlen:
        batch = req.cu_seqlens_q.numel() - 1
        seqlen_q, seqlen_k = req.max_seqlen_q, req.max_seqlen_k  # the grid's; each program reads its own
        # (batch, row) strides of the inputs, (batch, row, head) of the outputs: a packed tensor's batch stride is
        # 0 (the kernel bases each at its sequence's first row).
        strides = [(0, t.stride(0)) for t in (q, k, v, dout)] + [(0,) + t.stride()[:2] for t in (dk, dv)]
        plan.acc_shape = tuple(q.shape[:-1]) + (hopper_fwd.tile_dim(head_dim), )
    else:
        batch, seqlen_q = q.shape[:2]
        seqlen_k = k.shape[1]
        strides = [t.stride()[:2] for t in (q, k, v, dout)] + [t.stride()[:3] for t in (dk, dv)]
        plan.acc_shape = (batch * num_heads * seqlen_q_pad * dq_width(head_dim) // 256, 256)
    # The scores in log2 units: st * qk_scale, or with a softcap tanh(st * pre_scale) * qk_scale (as the forward).
    qk_scale, pre_scale, _ = hopper_fwd.mod_scalars(req.softmax_scale, req.softcap)
    stride_alibi_b = feats.alibi_args(None)[1]
    dims = kernel_dims(head_dim, v.shape[-1])
    halves = dims in HALVES_DIMS
    tile = hopper_fwd.tile_dim(head_dim)
    block_m, block_n = BLOCK_M[tile], 128 if halves else BLOCK_NS[tile]
    plan.tiles = (block_m, block_n)
    bias_mul_b, bias_mul_h, stride_cnt_b, stride_cnt_h, n_cols = 0, 0, 0, 0, 0
    if req.attn_bias is not None:
        bias_mul_b, bias_mul_h = hopper_fwd.bias_descriptor(req.attn_bias, block_m, block_n)[1:]
        lists = feats.block_lists(block_m, block_n, True, seqlen_q, seqlen_k)
        if lists is not None:
            (stride_cnt_b, stride_cnt_h), n_cols = lists.strides, lists.cols
    plan.mul, plan.lists = _Mul(bias_mul_b, bias_mul_h), (stride_cnt_b, stride_cnt_h, n_cols, seqlen_q, seqlen_k)
    # A float attn_mask shared by the heads is read by every head's programs: launched in groups of HEAD_GROUP
    # heads (_grouped_order), a group's programs read each tile from memory once. 4, where the forward takes 8:
    # here a wave holds fewer key blocks per head the larger the group, and each head's Q, dO and dQ rows are
    # then read, and dQ reduced, once per wave instead of once in all.
    head_group = 1
    if feats.bias_kind == BIAS_FLOAT and not bias_mul_h and not varlen:
        head_group = min(HEAD_GROUP, num_kv_heads)
    plan.scalars = (
        _Strides(*(st for t in strides for st in t), stride_alibi_b), seqlen_q, seqlen_k, seqlen_q_pad,
        req.diagonal_offset, req.window_left, req.window_right,
        _Scales(pre_scale, qk_scale, req.softmax_scale, dropout_threshold(req.dropout_p), 1.0 / (1.0 - req.dropout_p)),
        _Heads(num_heads, num_kv_heads, head_group, batch * num_kv_heads, q.shape[0], k.shape[0]))
    n_blocks = triton.cdiv(seqlen_k, block_n)
    plan.persistent = seqlen_k <= PERSISTENT_MAX_SEQLEN_K  # (varlen: the longest sequence's)
    if plan.persistent:
        grid = (min(n_blocks * batch * num_kv_heads, hopper_fwd._num_sms(q.get_device())), )
    else:
        grid = (n_blocks, batch * num_kv_heads)  # one work item per program
    plan.launch = _launch.Bound(_bwd_kernel, grid, (), dict(
        HEAD_DIM=tile, BLOCK_M=block_m, BLOCK_N=block_n, STAGES=STAGES, MASK_LEFT=req.mask_left,
        MASK_RIGHT=req.mask_right, SOFTCAP=req.softcap > 0, HAS_ALIBI=req.alibi_slopes is not None,
        BIAS=feats.bias_kind, DBIAS=bias_grad, VARLEN=varlen, DROPOUT=req.dropout_p > 0, PERSISTENT=plan.persistent,
        D=head_dim, D_V=v.shape[-1], ROLES=dims in WIDE_ROLES, OWNERS=dims in WIDE_OWNERS and not halves,
        K_REGS=dims in WIDE_K_REGS and not halves, HALVES=halves),
        dict(num_warps=4), background=True)
    dq = grads[0] if grads[0] is not None else torch.empty(q.shape, dtype=q.dtype, device="meta")  # contiguous
    plan.to_dq = None if varlen else _dq_from_tiles_launch(dq, seqlen_q_pad)
    return plan
