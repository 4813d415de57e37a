"""Attention over a KV cache for inference: split-KV flash decoding, paged caches, append in place with rotary.

    q, out: [B, Sq, Hq, D]                           lse: [B, Hq, Sq] fp32, natural log
    k_cache, v_cache: [B_cache, S_cache, Hk, D]      contiguous cache (cache_batch_idx maps batch row -> cache row)
                  or  [num_pages, PAGE_SIZE, Hk, D]  paged cache; block_table [B, max_pages] lists each sequence's
                                                     pages in order: cache row p of sequence b is row p % PAGE_SIZE
                                                     of page block_table[b, p // PAGE_SIZE]
    k_new, v_new: [B, S_new, Hk, D]                  appended at cache rows cache_seqlens[b] + i
    part: o_part [B, Sq, Hq, NUM_SPLITS, D] fp32,    each split's normalised output, then (from lse_part_offset)
          lse_part [B, Sq, Hq, NUM_SPLITS] fp32      each split's LSE in base 2 (lse_log2)

Sequence b attends to its cache rows [leftpad_b, seqlen_b + S_new), seqlen_b = cache_seqlens[b] being its length
before the append. Inside the kernels keys are numbered from leftpad_b, so there are n_k = seqlen_b + S_new -
leftpad_b of them, and the bottom-right alignment of causal, window and ALiBi uses diag = n_k - Sq: query i sees
key j iff i + diag - left <= j <= i + diag + right (causal: right = 0).

Three kernels, explained in docs/kvcache.md:
1. _kvcache_append_kernel writes k_new (rotated) and v_new into the cache, in place.
2. _kvcache_split_kernel: one program per (batch, kv head, split, row block). The G = Hq / Hk query heads that
   share a kv head are packed into the rows of one tile (row r = query i * G + head g), so each K/V block is read
   once per kv head instead of once per query head. A split runs the online softmax over its slice of the keys
   (docs/derivation.md#4-tiled-attention-fa1-and-fa2-loop-orders) and writes (O_s, lse_s); with a single split it
   writes the final output directly.
3. _kvcache_combine_kernel merges the splits: LSE = logsumexp_s lse_s, O = sum_s exp(lse_s - LSE) O_s
   (docs/derivation.md#7-merging-partial-results).
Paged addressing is a constexpr variant (PAGED) of the same row addressing in all of them; when pages and key
blocks nest (PAGE_SLAB: a block lies inside one page, or covers whole pages) the split kernel adds a page's offset
to row offsets that are the same for every block, as it does for a contiguous cache.

Which keys a query sees (the band, the cache's end) is _common's component, as in the forward and backward:
_band_span for a row block's key range, _visible for the band's mask.

A decode step is a few microseconds of GPU time, so the host side matters as much: everything a launch derives
from shapes, strides, dtypes and flags (tiles, split count, grid, scalar arguments, the compiled kernel) is built
once per such key (_AttnPlan, _AppendPlan, each launch a _launch.Bound) and each call only allocates its outputs and
hands its tensors to the compiled kernel (docs/kvcache.md#the-host-side-of-a-decode-step).
"""
import contextlib
import functools
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from . import _common, _launch, configs
from .._settings import SETTINGS
from ._common import LN2, LOG2E, Band, Heads, Seq, _band_span, _mma, _tanh, _visible
from ._launch import fast_stream, off_device
from .configs import TileConfig

# tl.dot needs at least 16 rows: a q_len-1 decode with G = 4 query heads per kv head pads its 4 rows to 16.
MIN_BLOCK_M = 16
# Largest finite float8 e4m3 value: appends into an fp8 cache saturate there instead of becoming NaN.
FP8_E4M3_MAX = tl.constexpr(448.0)

# num_splits=0 heuristic. Decode at q_len 1 is one program per (batch, kv head) without splitting: 8 programs for
# batch 1 at Hk = 8, on a GPU with 132 SMs. With s splits of equal length, the launch takes
# ceil(programs * s / slots) waves of 1/s the work each (slots: programs the GPU holds at once), so the time is
# proportional to ceil(programs * s / slots) / s; the fewest splits within SPLIT_TOLERANCE of the best are chosen
# (fewer, longer programs: a probe found programs beyond one wave cost 3-8%). E.g. 132 SMs, one
# program each: batch 8 -> 2 splits (128 programs), batch 1 -> 16 (128), batch 64 -> 1 (512). Not yet measured
# for these kernels: `python -m flashtile bench decode --sweep` times the alternatives.
SPLIT_TOLERANCE = 0.05
# Never fewer than this many key blocks per split: each split also loads q, writes a partial row and adds work to
# the combine.
MIN_BLOCKS_PER_SPLIT = 2
MAX_AUTO_SPLITS = 128
# Resident programs per SM are bounded by shared memory (the pipelined K/V buffers) and by this many warps.
MAX_WARPS_PER_SM = 64
# The interpreter has no SMs; pretending to have a few makes num_splits=0 split at test sizes too.
INTERPRETER_SM_COUNT = 4
# Splits merged per step of the combine's loop: a [16, D] fp32 tile.
COMBINE_BLOCK_S = 16
# Appended rows per program of the append kernel.
APPEND_BLOCK_R = 16
# Smallest normal float8 e4m3 value: below it the e4m3 grid is uniform, multiples of 2^-9.
FP8_E4M3_MIN_NORMAL = tl.constexpr(2.0 ** -6)
# Adding and subtracting 1.5 * 2^14 rounds an fp32 |x| < 2^-6 to a multiple of 2^-9 (fp32's unit in that binade),
# to nearest even: the e4m3 subnormal grid.
FP8_E4M3_SUBNORMAL_ROUNDER = tl.constexpr(1.5 * 2.0 ** 14)

# Paged caches whose pages and key blocks nest (page size a multiple or a divisor of BLOCK_N) are read by slabs
# (PAGE_SLAB): a block is one slab of a page (one table entry per block) or BLOCK_N / page size whole pages, and its
# row offsets are a page offset plus loop-invariant row-in-page offsets. Otherwise, and with SETTINGS.page_slabs off
# (tests, the sweep's comparison), the general per-row form: row % page size and a 64-bit multiply per row (1030
# instead of 700 SASS instructions per loop iteration at pages of 16, sm90).
# Plans kept (one per distinct shape / dtype / flag combination); past this many the cache starts over.
MAX_PLANS = 1024

# SETTINGS.decode_tiles (tests, the sweep: `python -m flashtile bench decode --sweep`) replaces the candidate tiles
# below. TileConfig.block_m is the most packed rows (query position x query head of the group) per tile; a launch uses
# the next power of two of Sq * G up to it, at least MIN_BLOCK_M. block_n is the key rows per step.
# Interpreter: 32-key blocks put several blocks into each split at the test sizes.
_INTERPRETER_TILES = [TileConfig(64, 32, 4, 1)]
# Last resorts when a table entry does not fit.
_SAFE_TILES = [TileConfig(64, 64, 4, 2), TileConfig(32, 32, 4, 1)]


def split_candidates(head_dim, dtype, spec):
    """Tiles for the split kernel, best first. dtype is the cache's element type."""
    if SETTINGS.decode_tiles is not None:
        return list(SETTINGS.decode_tiles)
    if spec.arch == 0:
        return _INTERPRETER_TILES
    if dtype == torch.float32:
        # Sized by shared memory (2 x 32x256 fp32 tiles x 2 stages = 128 KB at d256); correctness only.
        first = [TileConfig(32, 32, 4, 2)]
    elif spec.arch >= 9:
        # Hopper, 16-bit or fp8 cache: 128-key blocks (32 KB of K and of V per stage at d128) in 3 stages keep
        # ~128 KB of loads in flight per SM; d256 halves the block. Not yet measured.
        first = [TileConfig(64, 128, 4, 3)] if head_dim <= 128 else [TileConfig(64, 64, 4, 3)]
    else:
        # Ampere-sized shared memory; not measured.
        first = [TileConfig(64, 64, 4, 2)]
    return first + _SAFE_TILES


# triton.cdiv and triton.next_power_of_2 are Triton functions in recent versions (jit / constexpr_function): from
# the host each call costs microseconds, which a small decode step (~10 us of GPU time) cannot spare.
def _cdiv(a, b):
    return -(-a // b)


def _next_pow2(n):
    return 1 << max(n - 1, 0).bit_length()


def _block_d(head_dim):
    return max(configs.MIN_BLOCK_D, _next_pow2(head_dim))


@functools.lru_cache(maxsize=None)
def _device_limits(device_index):
    """(SMs, shared memory per SM in bytes) of a CUDA device."""
    props = torch.cuda.get_device_properties(device_index)
    smem = getattr(props, "shared_memory_per_multiprocessor", 0) or getattr(props, "shared_memory_per_block_optin", 0)
    return props.multi_processor_count, smem


def split_slots(device, cfg, head_dim, cache_elem_size):
    """Programs of the split kernel the device runs at once: SMs x resident programs per SM, the latter estimated
    from the shared memory of the pipelined K and V tiles (num_stages buffers of each) and the warp limit."""
    if configs.INTERPRETING or device.type != "cuda":
        return INTERPRETER_SM_COUNT
    sms, smem_per_sm = _device_limits(device.index if device.index is not None else torch.cuda.current_device())
    smem = max(cfg.num_stages, 1) * 2 * cfg.block_n * _block_d(head_dim) * cache_elem_size
    resident = max(1, min(smem_per_sm // smem, MAX_WARPS_PER_SM // cfg.num_warps))
    return sms * resident


@functools.lru_cache(maxsize=4096)
def _best_splits(programs, slots, max_splits):
    def time(s):  # waves x work per program, in units of one unsplit program
        return _cdiv(programs * s, slots) / s
    best = min(time(s) for s in range(1, max_splits + 1))
    return next(s for s in range(1, max_splits + 1) if time(s) <= best * (1 + SPLIT_TOLERANCE))


def choose_num_splits(requested, programs, max_keys, block_n, slots):
    """Splits of the key range: `requested` when > 0, else the wave-quantised choice above.

    programs: the launch's programs without splitting (batch x kv heads x row blocks). max_keys: an upper bound on
    the keys one row block sees (the cache's capacity, narrowed by a sliding window); the actual lengths live on
    the device and reading them would synchronise. slots: programs the device runs at once (split_slots).
    """
    if requested > 0:
        return requested
    max_splits = max(1, min(MAX_AUTO_SPLITS, _cdiv(max_keys, MIN_BLOCKS_PER_SPLIT * block_n)))
    return _best_splits(programs, slots, max_splits)


# ----------------------------------------------------------------------------------------------------------------
# Argument groups and shared pieces


class CacheIndex(NamedTuple):
    """Where each sequence's rows are: int32 per-sequence tensors, a placeholder where absent (constexpr flags)."""
    seqlens: object  # [B] rows before the append (HAS_SEQLENS; else the int cache_seqlen argument)
    batch_idx: object  # [B] cache batch row of sequence b (HAS_BATCH_IDX)
    leftpad: object  # [B] first valid row (HAS_LEFTPAD)
    block_table: object  # [B, max_pages] (PAGED)


class Strides(NamedTuple):
    """Strides of a launch's tensors: (batch, seqlen, head) of the 4-D ones, the rows' of the 2-D ones."""
    q: tuple  # q, or k_new in the append
    k: tuple  # k_cache
    v: tuple  # v_cache
    out: tuple  # out, or v_new in the append
    block_table: int
    cos: int
    sin: int
    alibi: int  # batch stride of (B, Hq) slopes, 0 for (Hq,)
    descale: int  # batch stride of the [B, Hk] descales


class Dims(NamedTuple):
    """Sizes a launch's plan fixes."""
    seqlen_q: int  # query rows (the append: new rows)
    seqlen_new: int  # rows appended by this step (attention: keys past seqlen_b)
    capacity: int  # rows one sequence can hold
    heads: Heads  # kv heads, query heads per kv head
    num_splits: int
    lse_part_offset: int  # where lse_part starts in the partial-results buffer
    seqlen_ro: int  # rows of cos / sin
    cache_rows: int  # k_cache.shape[0]: the pages of a paged cache, the sequences of a contiguous one


class DecodeFlags(NamedTuple):
    """The split kernel's feature constexprs (FEAT; one constexpr argument, _common.constexpr_groups)."""
    HAS_SEQLENS: bool
    HAS_BATCH_IDX: bool
    HAS_LEFTPAD: bool
    PAGED: bool
    PAGE_SIZE: int  # 1 for a contiguous cache
    PAGE_SLAB: bool  # pages and key blocks nest: per-block page offsets (_block_offsets)
    ROTARY: bool
    ROTARY_DIM: int
    INTERLEAVED: bool
    ROTARY_PER_ROW: bool  # query i at position seqlen + i (a causal or local mask), else every query at seqlen
    MASK_LEFT: bool  # the band, as _common.Flags
    MASK_RIGHT: bool
    HAS_SOFTCAP: bool
    HAS_ALIBI: bool
    HAS_DESCALE: bool  # fp8 cache
    SPLIT: bool  # write partial results for the combine


class DecodeConfig(NamedTuple):
    """The split kernel's code-generation constexprs (CFG; one constexpr argument, _common.constexpr_groups)."""
    HEAD_DIM: int
    BLOCK_M: int  # packed rows (query position x query head of the group) per tile
    BLOCK_N: int  # key rows per step
    BLOCK_D: int
    PRECISION: str
    DOT_UPCAST: bool


@triton.jit
def _cache_seq(cache, i_b, cache_seqlen, dims, HAS_SEQLENS: tl.constexpr, HAS_BATCH_IDX: tl.constexpr):
    """(seqlen, cache_b, valid) of sequence i_b: its cache rows before this step's append, its batch row of a
    contiguous cache (int64), and whether that row exists. Device values are not checked on the host by default
    (docs/safety.md), so they are clamped here: a length into [0, capacity], and a cache row out of range reads
    nothing and writes nothing (the caller masks with `valid`; row 0 stands in for addressing)."""
    if HAS_SEQLENS:
        seqlen = tl.minimum(tl.maximum(tl.load(cache.seqlens + i_b).to(tl.int32), 0), dims.capacity)
    else:
        seqlen = cache_seqlen
    if HAS_BATCH_IDX:
        cache_b = tl.load(cache.batch_idx + i_b).to(tl.int64)
        valid = (cache_b >= 0) & (cache_b < dims.cache_rows)
        cache_b = tl.where(valid, cache_b, 0)
    else:
        cache_b = i_b.to(tl.int64)
        valid = i_b >= 0
    return seqlen, cache_b, valid


@triton.jit
def _cache_slots(BlockTableRow, cache_b, pos, mask, PAGED: tl.constexpr, PAGE_SIZE: tl.constexpr):
    """Where cache rows `pos` of one sequence live, as (major, minor) indices of the cache's first two dims:
    (page, row in page) for a paged cache, (cache batch row, pos) for a contiguous one (major then a scalar). int64,
    so that major * stride passes 2^31 elements safely. `pos` is never negative (// and % would round differently)."""
    if PAGED:
        major = tl.load(BlockTableRow + pos // PAGE_SIZE, mask=mask, other=0).to(tl.int64)
        minor = (pos % PAGE_SIZE).to(tl.int64)
    else:
        major = cache_b
        minor = pos.to(tl.int64)
    return major, minor


@triton.jit
def _block_pages(BlockTableRow, r0, end, num_pages, BLOCK_N: tl.constexpr, PAGED: tl.constexpr,
                 PAGE_SIZE: tl.constexpr, PAGE_SLAB: tl.constexpr):
    """Block-table entries of the key block of cache rows r0 + [0, BLOCK_N) (r0 a multiple of BLOCK_N; rows from
    `end` on are not read), one per row, or with PAGE_SLAB and pages of at least BLOCK_N rows one scalar (the block
    lies inside one page). 0 for a contiguous cache. Entries are clamped into [0, num_pages): a bad one reads some
    page of the pool into this sequence's own result, never memory past the cache (docs/safety.md)."""
    if PAGE_SLAB and PAGE_SIZE >= BLOCK_N:
        pages = tl.load(BlockTableRow + r0 // PAGE_SIZE, mask=r0 < end, other=0)
    elif PAGE_SLAB:
        # Whole pages: row o of the block is in page r0 / PAGE_SIZE + o / PAGE_SIZE (PAGE_SIZE divides r0). One entry
        # per row, not a [BLOCK_N / PAGE_SIZE] vector broadcast to the rows by tl.reshape: Triton 3.6's alignment
        # analysis does not see through the reshape, and the K/V loads lose their 16-byte vectors and their
        # pipelining (sm90: plain LDG, no shared-memory buffers). It is one load per thread either way.
        o_n = tl.arange(0, BLOCK_N)
        pages = tl.load(BlockTableRow + r0 // PAGE_SIZE + o_n // PAGE_SIZE, mask=r0 + o_n < end, other=0)
    elif PAGED:
        rows = r0 + tl.arange(0, BLOCK_N)
        pages = tl.load(BlockTableRow + rows // PAGE_SIZE, mask=rows < end, other=0)
    else:
        pages = 0
    if PAGED:
        pages = tl.minimum(tl.maximum(pages, 0), num_pages - 1)
    return pages


@triton.jit
def _block_offsets(pages, cache_b, r0, stride_b, stride_s, BLOCK_N: tl.constexpr, PAGED: tl.constexpr,
                   PAGE_SIZE: tl.constexpr, PAGE_SLAB: tl.constexpr):
    """Element offsets (int64, so that they pass 2^31 safely) of the key block's rows r0 + [0, BLOCK_N) in a cache
    tensor with strides stride_b, stride_s for its first two dims, from the block's _block_pages.

    With PAGE_SLAB the block is one slab of a page or a run of whole pages: the row-in-page offsets are the same
    for every block (they are hoisted out of the loop) and each row adds its page's offset; otherwise row r is
    row r % PAGE_SIZE of its page."""
    o_n = tl.arange(0, BLOCK_N)
    # r0 is a Python int in the interpreter, hence tl.cast rather than .to.
    if PAGE_SLAB and PAGE_SIZE >= BLOCK_N:
        first_row = pages.to(tl.int64) * stride_b + tl.cast(r0 % PAGE_SIZE, tl.int64) * stride_s  # scalar
        offsets = first_row + o_n.to(tl.int64) * stride_s
    elif PAGE_SLAB:
        offsets = pages.to(tl.int64) * stride_b + (o_n % PAGE_SIZE).to(tl.int64) * stride_s
    elif PAGED:
        offsets = pages.to(tl.int64) * stride_b + ((r0 + o_n) % PAGE_SIZE).to(tl.int64) * stride_s
    else:
        first_row = cache_b * stride_b + tl.cast(r0, tl.int64) * stride_s  # scalar
        offsets = first_row + o_n.to(tl.int64) * stride_s
    return offsets


@triton.jit
def _row_mask(m_r, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr):
    """[BLOCK_R, BLOCK_D] mask of valid rows and real head-dim columns. When the head dim is a power of two the
    mask is constant along it, which keeps the loads vectorised."""
    if HEAD_DIM == BLOCK_D:
        mask = m_r[:, None]
    else:
        mask = m_r[:, None] & (tl.arange(0, BLOCK_D) < HEAD_DIM)[None, :]
    return mask


@triton.jit
def _rotary_rows(X, p_rows, m_r, pos, rope, strides, seqlen_ro, HEAD_DIM: tl.constexpr, ROTARY_DIM: tl.constexpr,
                 BLOCK_D: tl.constexpr, INTERLEAVED: tl.constexpr):
    """Rows X + p_rows of a [rows, D] slice with rotary embedding at positions `pos`, in fp32; rope = (cos, sin),
    their row strides in strides (Strides).

    The first ROTARY_DIM dims are rotated in pairs by the angle of row `pos` of cos/sin ([seqlen_ro,
    ROTARY_DIM / 2]): pairs (2t, 2t + 1) when INTERLEAVED (GPT-J), (t, t + ROTARY_DIM / 2) otherwise (GPT-NeoX):
        out[a] = x[a] cos_t - x[b] sin_t        out[b] = x[b] cos_t + x[a] sin_t
    Dims past ROTARY_DIM pass through. A position past seqlen_ro reads angle 0 instead of out-of-bounds memory.
    """
    HALF: tl.constexpr = ROTARY_DIM // 2
    o_d = tl.arange(0, BLOCK_D)
    mask = _row_mask(m_r, HEAD_DIM, BLOCK_D)
    x = tl.load(X + p_rows[:, None] + o_d[None, :], mask=mask, other=0.0).to(tl.float32)  # [BLOCK_R, BLOCK_D]
    if INTERLEAVED:
        o_pair = o_d ^ 1
        o_t = o_d // 2
        first = o_d % 2 == 0
    else:
        first = o_d < HALF
        o_pair = tl.where(first, o_d + HALF, o_d - HALF)
        o_t = tl.where(first, o_d, o_d - HALF)
    m_rot = o_d < ROTARY_DIM
    m_pair = mask & m_rot[None, :]
    x_pair = tl.load(X + p_rows[:, None] + o_pair[None, :], mask=m_pair, other=0.0).to(tl.float32)
    m_angle = m_pair & (pos < seqlen_ro)[:, None]
    cos = tl.load(rope[0] + pos[:, None] * strides.cos + o_t[None, :], mask=m_angle, other=1.0).to(tl.float32)
    sin = tl.load(rope[1] + pos[:, None] * strides.sin + o_t[None, :], mask=m_angle, other=0.0).to(tl.float32)
    sin = tl.where(first[None, :], -sin, sin)
    return x * cos + x_pair * sin


# ----------------------------------------------------------------------------------------------------------------
# 1. Append


@triton.jit
def _quantize_e4m3(x, descale):
    """x / descale (fp32, IEEE-rounded division as torch divides) saturated to +-448 and rounded to the nearest
    float8 e4m3 value, ties to even, returned as an exactly representable fp32 value.

    Rounding here instead of in the cast makes the cast exact, so the GPU (cvt.rn.satfinite) and Triton's
    interpreter store the same bits as torch's .to(torch.float8_e4m3fn): the interpreter's fp32 -> fp8 cast
    rounds ties away from zero and loses the carry when rounding up crosses into the next binade (the value halves).
    """
    x = tl.math.div_rn(x, descale + tl.zeros_like(x))
    x = tl.minimum(tl.maximum(x, -FP8_E4M3_MAX), FP8_E4M3_MAX)
    bits = x.to(tl.int32, bitcast=True)
    mag_bits = bits & 0x7FFFFFFF
    sign = bits ^ mag_bits  # kept apart, so that a negative value rounding to 0 stays -0 as in torch
    # Normal range: keep 3 of fp32's 23 mantissa bits; adding 2^19 - 1 plus the lowest kept bit to the bit pattern
    # rounds to nearest even, and a carry out of the mantissa bumps the exponent as it should.
    normal = ((mag_bits + ((1 << 19) - 1) + ((mag_bits >> 20) & 1)) & -(1 << 20)).to(tl.float32, bitcast=True)
    mag = mag_bits.to(tl.float32, bitcast=True)
    subnormal = (mag + FP8_E4M3_SUBNORMAL_ROUNDER) - FP8_E4M3_SUBNORMAL_ROUNDER
    rounded = tl.where(mag >= FP8_E4M3_MIN_NORMAL, normal, subnormal)
    return (rounded.to(tl.int32, bitcast=True) | sign).to(tl.float32, bitcast=True)


@triton.jit(do_not_specialize=["cache_seqlen"])
def _kvcache_append_kernel(KNew, VNew, KCache, VCache, cache, rope, descale, cache_seqlen, strides, dims,
                           HEAD_DIM: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr,
                           HAS_SEQLENS: tl.constexpr, HAS_BATCH_IDX: tl.constexpr,
                           PAGED: tl.constexpr, PAGE_SIZE: tl.constexpr,
                           ROTARY: tl.constexpr, ROTARY_DIM: tl.constexpr, INTERLEAVED: tl.constexpr,
                           QUANTIZE: tl.constexpr):
    """Rows [i_r * BLOCK_R, ...) of k_new / v_new of one (batch, kv head) into cache rows seqlen_b + i. Rows past
    the cache's capacity are dropped rather than written out of bounds. cache: the CacheIndex fields as a tuple;
    rope: (cos, sin); descale: (k, v) [B, Hk] fp32 (QUANTIZE); strides: Strides (q: k_new, out: v_new); dims:
    Dims (seqlen_q: the rows appended)."""
    cache = CacheIndex(*cache)
    i_r = tl.program_id(0)
    i_bh = tl.program_id(1)
    i_b = i_bh // dims.heads.num_heads
    i_hk = i_bh % dims.heads.num_heads
    seqlen, cache_b, valid = _cache_seq(cache, i_b, cache_seqlen, dims, HAS_SEQLENS, HAS_BATCH_IDX)

    o_r = i_r * BLOCK_R + tl.arange(0, BLOCK_R)
    pos = seqlen + o_r  # cache rows written
    # (tl.where, not `& valid`: Triton's interpreter gives a scalar-and-vector `&` a non-boolean mask dtype.)
    m_r = tl.where(valid, (o_r < dims.seqlen_new) & (pos < dims.capacity), False)
    o_d = tl.arange(0, BLOCK_D)
    major, minor = _cache_slots(cache.block_table + i_b.to(tl.int64) * strides.block_table, cache_b, pos, m_r, PAGED,
                                PAGE_SIZE)
    if PAGED:
        # A bad page is not written (masked rather than clamped: a clamped page may be another sequence's).
        m_r = m_r & (major >= 0) & (major < dims.cache_rows)
    mask = _row_mask(m_r, HEAD_DIM, BLOCK_D)

    s_kn, s_vn = strides.q, strides.out
    p_kn = i_b.to(tl.int64) * s_kn[0] + o_r.to(tl.int64) * s_kn[1] + i_hk * s_kn[2]  # [BLOCK_R]
    p_vn = i_b.to(tl.int64) * s_vn[0] + o_r.to(tl.int64) * s_vn[1] + i_hk * s_vn[2]
    if ROTARY:
        b_k = _rotary_rows(KNew, p_kn, m_r, pos, rope, strides, dims.seqlen_ro, HEAD_DIM, ROTARY_DIM, BLOCK_D,
                           INTERLEAVED)  # [BLOCK_R, BLOCK_D] fp32
    else:
        b_k = tl.load(KNew + p_kn[:, None] + o_d[None, :], mask=mask, other=0.0).to(tl.float32)
    b_v = tl.load(VNew + p_vn[:, None] + o_d[None, :], mask=mask, other=0.0)
    if QUANTIZE:
        # fp8 cache with per-(batch, kv head) descale factors: the cache holds value / descale.
        b_k = _quantize_e4m3(b_k, tl.load(descale[0] + i_b * strides.descale + i_hk))
        b_v = _quantize_e4m3(b_v.to(tl.float32), tl.load(descale[1] + i_b * strides.descale + i_hk))

    p_kc = major * strides.k[0] + minor * strides.k[1] + i_hk * strides.k[2]  # [BLOCK_R]
    p_vc = major * strides.v[0] + minor * strides.v[1] + i_hk * strides.v[2]
    tl.store(KCache + p_kc[:, None] + o_d[None, :], b_k.to(KCache.dtype.element_ty), mask=mask)
    tl.store(VCache + p_vc[:, None] + o_d[None, :], b_v.to(VCache.dtype.element_ty), mask=mask)


# ----------------------------------------------------------------------------------------------------------------
# 2. Split: partial attention over a slice of the keys


@triton.jit
def _softcap_log2(s, cap_scale, cap_log2):
    """cap * tanh(scale * s / cap) in log2 units (cap_log2 = cap * log2(e), cap_scale = scale / cap)."""
    return cap_log2 * _tanh(s * cap_scale)


class DecodeScale(NamedTuple):
    qk_scale: float  # softmax scale * log2(e): scores in log2 units
    cap_scale: float  # softmax scale / softcap (HAS_SOFTCAP)
    cap_log2: float  # softcap * log2(e)


class SplitProgram(NamedTuple):
    """What the key loop of one split program reads, fixed for the program."""
    b_q: object  # [BLOCK_M, BLOCK_D] the packed query rows (rotated)
    o_i: object  # [BLOCK_M] query position of each row
    slope_log2: object  # [BLOCK_M] ALiBi slope of each row's head, log2 units (HAS_ALIBI)
    k_head: object  # the kv head's keys and values in the cache
    v_head: object
    table_row: object  # the sequence's block-table row (PAGED)
    cache_b: object  # its batch row of a contiguous cache
    kv_start: object  # its first valid cache row: key j is cache row kv_start + j
    row_lo: object  # cache rows [row_lo, row_hi) hold the keys the row block sees
    row_hi: object
    seq: object  # _common.Seq: (Sq, keys n_k, diag = n_k - Sq)
    band: object  # _common.Band
    scale: object  # DecodeScale, with the fp8 cache's k descale folded in
    strides: object  # Strides
    num_pages: object  # pages in the pool (PAGED): table entries are clamped below it


@triton.jit
def _split_inner(m_i, l_i, acc, prog, start, end, FEAT: tl.constexpr, CFG: tl.constexpr):
    """Online softmax of the program's rows over cache rows [start, end) in BLOCK_N-row blocks; scores in log2
    units: exp2(b_s - m) = exp(S - m') (docs/derivation.md#5-kernel-tricks)."""
    o_d = tl.arange(0, CFG.BLOCK_D)
    o_i = prog.o_i
    dtype = prog.b_q.dtype
    # A paged cache's table entries for the next block are loaded one iteration ahead (carried through the loop).
    # Loaded in the iteration that uses them, they would make the K/V loads indirect ones, which Triton 3.6
    # pipelines a stage later with a single buffer and a wait for all copies each iteration (sm90 TTGIR): no
    # overlap of loads and compute, which a lone program per SM (decode at batch 1-8) cannot hide.
    pages = _block_pages(prog.table_row, start, end, prog.num_pages, CFG.BLOCK_N, FEAT.PAGED, FEAT.PAGE_SIZE,
                         FEAT.PAGE_SLAB)
    for r0 in tl.range(start, end, CFG.BLOCK_N):
        rows = r0 + tl.arange(0, CFG.BLOCK_N)  # cache rows
        m_n = (rows >= prog.row_lo) & (rows < prog.row_hi)
        o_n = rows - prog.kv_start  # key numbers j
        off_k = _block_offsets(pages, prog.cache_b, r0, prog.strides.k[0], prog.strides.k[1], CFG.BLOCK_N, FEAT.PAGED,
                               FEAT.PAGE_SIZE, FEAT.PAGE_SLAB)
        off_v = _block_offsets(pages, prog.cache_b, r0, prog.strides.v[0], prog.strides.v[1], CFG.BLOCK_N, FEAT.PAGED,
                               FEAT.PAGE_SIZE, FEAT.PAGE_SLAB)
        pages = _block_pages(prog.table_row, r0 + CFG.BLOCK_N, end, prog.num_pages, CFG.BLOCK_N, FEAT.PAGED,
                             FEAT.PAGE_SIZE, FEAT.PAGE_SLAB)
        m_kv = _row_mask(m_n, CFG.HEAD_DIM, CFG.BLOCK_D)
        b_k = tl.load(prog.k_head + off_k[:, None] + o_d[None, :], mask=m_kv, other=0.0).to(dtype)  # [BLOCK_N, D]
        b_s = _mma(prog.b_q, tl.trans(b_k), None, CFG.PRECISION, CFG.DOT_UPCAST)  # [BLOCK_M, BLOCK_N], raw q.k
        if FEAT.HAS_SOFTCAP:
            b_s = _softcap_log2(b_s, prog.scale.cap_scale, prog.scale.cap_log2)
        else:
            b_s = b_s * prog.scale.qk_scale
        if FEAT.HAS_ALIBI:
            dist = tl.abs(o_i[:, None] + prog.seq.diag - o_n[None, :]).to(tl.float32)
            b_s = b_s - prog.slope_log2[:, None] * dist
        m_visible = m_n[None, :]
        if FEAT.MASK_LEFT or FEAT.MASK_RIGHT:
            m_visible = m_visible & _visible(o_i[:, None], o_n[None, :], prog.seq, prog.band, FEAT.MASK_LEFT,
                                             FEAT.MASK_RIGHT, False)
        b_s = tl.where(m_visible, b_s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(b_s, 1))
        # A row that has seen no visible key keeps m = -inf; subtracting it would give -inf - (-inf) = NaN, so such
        # rows subtract 0 (their p and alpha are exp2(-inf) = 0 and l stays 0).
        m_sub = tl.where(m_new == float("-inf"), 0.0, m_new)
        b_p = tl.exp2(b_s - m_sub[:, None])  # [BLOCK_M, BLOCK_N]
        alpha = tl.exp2(m_i - m_sub)
        l_i = l_i * alpha + tl.sum(b_p, 1)
        b_v = tl.load(prog.v_head + off_v[:, None] + o_d[None, :], mask=m_kv, other=0.0).to(dtype)  # [BLOCK_N, D]
        acc = _mma(b_p.to(dtype), b_v, acc * alpha[:, None], CFG.PRECISION, CFG.DOT_UPCAST)
        m_i = m_new
    return m_i, l_i, acc


@triton.jit
def _split_keys(first_i, last_i, kv_start, seq, band, i_s, num_splits, FEAT: tl.constexpr, BLOCK_N: tl.constexpr):
    """The cache rows of split i_s for the row block of query positions [first_i, last_i]: (start, end, row_lo,
    row_hi). The row block sees keys [lo, hi) (_common._band_span), cache rows [row_lo, row_hi); those are visited in
    BLOCK_N-row blocks aligned to cache rows (so that a block never straddles pages when the page size is a
    multiple of BLOCK_N), split evenly in whole blocks across the num_splits programs of the row block."""
    lo = 0
    hi = seq.seqlen_k
    if FEAT.MASK_LEFT or FEAT.MASK_RIGHT:
        lo, hi = _band_span(first_i, last_i, seq.seqlen_k, seq.diag, band, FEAT.MASK_LEFT, FEAT.MASK_RIGHT)
        hi = tl.maximum(hi, lo)
    row_lo = kv_start + lo
    row_hi = kv_start + hi
    blk_lo = row_lo // BLOCK_N
    blocks_per_split = tl.cdiv(tl.cdiv(row_hi, BLOCK_N) - blk_lo, num_splits)
    start = (blk_lo + i_s * blocks_per_split) * BLOCK_N
    end = tl.minimum(start + blocks_per_split * BLOCK_N, row_hi)
    return start, end, row_lo, row_hi


@triton.jit
def _split_store(Out, Lse, Part, b_o, lse_log2, i_b, i_s, o_i, o_h, m_r, strides, dims, FEAT: tl.constexpr,
                 CFG: tl.constexpr):
    """A split's rows: (O_s, lse_s) into the partial buffer (SPLIT: o_part [B, Sq, Hq, S, D], then lse_part
    [B, Sq, Hq, S] from lse_part_offset on), or with one split the final out and LSE (natural log)."""
    o_d = tl.arange(0, CFG.BLOCK_D)
    m_o = _row_mask(m_r, CFG.HEAD_DIM, CFG.BLOCK_D)
    num_heads = dims.heads.num_heads * dims.heads.group_size
    if FEAT.SPLIT:
        row = (i_b.to(tl.int64) * dims.seqlen_q + o_i) * num_heads + o_h  # [BLOCK_M]
        tl.store(Part + dims.lse_part_offset + row * dims.num_splits + i_s, lse_log2, mask=m_r)
        tl.store(Part + ((row * dims.num_splits + i_s) * CFG.HEAD_DIM)[:, None] + o_d[None, :], b_o, mask=m_o)
    else:
        p_o = i_b.to(tl.int64) * strides.out[0] + o_i.to(tl.int64) * strides.out[1] + o_h.to(tl.int64) * strides.out[2]
        tl.store(Out + p_o[:, None] + o_d[None, :], b_o.to(Out.dtype.element_ty), mask=m_o)
        row_lse = (i_b.to(tl.int64) * num_heads + o_h) * dims.seqlen_q + o_i
        tl.store(Lse + row_lse, lse_log2 * LN2, mask=m_r)


@triton.jit(do_not_specialize=["cache_seqlen"])
def _kvcache_split_kernel(Q, K, V, Out, Lse, Part, cache, rope, Alibi, descale, cache_seqlen, strides, dims, scale,
                          band, FEAT: tl.constexpr, CFG: tl.constexpr):
    """One program per (batch * kv head, split, row block). cache: the CacheIndex fields as a tuple; rope: (cos,
    sin); descale: (k, v) [B, Hk] fp32 (HAS_DESCALE); strides: Strides; dims: Dims; scale: DecodeScale; band:
    _common.Band; FEAT: DecodeFlags; CFG: DecodeConfig."""
    HEAD_DIM: tl.constexpr = CFG.HEAD_DIM
    BLOCK_M: tl.constexpr = CFG.BLOCK_M
    BLOCK_D: tl.constexpr = CFG.BLOCK_D
    cache = CacheIndex(*cache)
    group_size = dims.heads.group_size
    i_bh = tl.program_id(0)
    i_s = tl.program_id(1)
    i_m = tl.program_id(2)
    i_b = i_bh // dims.heads.num_heads
    i_hk = i_bh % dims.heads.num_heads

    # This sequence's keys: cache rows [kv_start, kv_end), numbered j = 0 .. n_k - 1 from kv_start.
    seqlen, cache_b, valid = _cache_seq(cache, i_b, cache_seqlen, dims, FEAT.HAS_SEQLENS, FEAT.HAS_BATCH_IDX)
    # The clamps keep bad device values in bounds (docs/safety.md); a cache row that does not exist has no keys.
    kv_end = tl.where(valid, tl.minimum(seqlen + dims.seqlen_new, dims.capacity), 0)
    if FEAT.HAS_LEFTPAD:
        kv_start = tl.minimum(tl.maximum(tl.load(cache.leftpad + i_b).to(tl.int32), 0), kv_end)
    else:
        kv_start = 0
    n_k = tl.maximum(kv_end - kv_start, 0)
    seq = Seq(dims.seqlen_q, n_k, n_k - dims.seqlen_q)  # bottom-right alignment: query i is at key i + diag

    # Rows of the tile: query position o_i of query head o_h = i_hk * G + o_g, packed as r = o_i * G + o_g.
    o_r = i_m * BLOCK_M + tl.arange(0, BLOCK_M)
    m_r = o_r < dims.seqlen_q * group_size
    o_i = o_r // group_size
    o_h = i_hk * group_size + o_r % group_size
    p_q = i_b.to(tl.int64) * strides.q[0] + o_i.to(tl.int64) * strides.q[1] + o_h.to(tl.int64) * strides.q[2]
    if FEAT.ROTARY:
        # flash-attn's convention: with a causal or local mask query i sits at position seqlen + i; without one
        # every query sits at seqlen (the new tokens are treated as one step).
        if FEAT.ROTARY_PER_ROW:
            pos_q = seqlen + o_i
        else:
            pos_q = seqlen + tl.zeros_like(o_i)
        b_q = _rotary_rows(Q, p_q, m_r, pos_q, rope, strides, dims.seqlen_ro, HEAD_DIM, FEAT.ROTARY_DIM, BLOCK_D,
                           FEAT.INTERLEAVED).to(Q.dtype.element_ty)
    else:
        o_d = tl.arange(0, BLOCK_D)
        b_q = tl.load(Q + p_q[:, None] + o_d[None, :], mask=_row_mask(m_r, HEAD_DIM, BLOCK_D), other=0.0)

    if FEAT.HAS_DESCALE:
        # fp8 cache: K = descale_k * K8, so S = descale_k * (q . K8); V's descale multiplies the output.
        k_descale = tl.load(descale[0] + i_b * strides.descale + i_hk)
        v_descale = tl.load(descale[1] + i_b * strides.descale + i_hk)
        scale = DecodeScale(scale.qk_scale * k_descale, scale.cap_scale * k_descale, scale.cap_log2)
    slope_log2 = 0.0
    if FEAT.HAS_ALIBI:
        slope_log2 = tl.load(Alibi + i_b * strides.alibi + o_h, mask=m_r, other=0.0) * LOG2E  # [BLOCK_M]

    # The keys this row block (query positions [first_i, last_i]) sees, as this split's share of cache rows.
    first_i = (i_m * BLOCK_M) // group_size
    last_i = (tl.minimum((i_m + 1) * BLOCK_M, dims.seqlen_q * group_size) - 1) // group_size
    start, end, row_lo, row_hi = _split_keys(first_i, last_i, kv_start, seq, band, i_s, dims.num_splits, FEAT,
                                             CFG.BLOCK_N)
    k_head = K + i_hk.to(tl.int64) * strides.k[2]
    v_head = V + i_hk.to(tl.int64) * strides.v[2]
    table_row = cache.block_table + i_b.to(tl.int64) * strides.block_table
    prog = SplitProgram(b_q, o_i, slope_log2, k_head, v_head, table_row, cache_b, kv_start, row_lo, row_hi, seq, band,
                        scale, strides, dims.cache_rows)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    m_i, l_i, acc = _split_inner(m_i, l_i, acc, prog, start, end, FEAT, CFG)

    # A row that sees no key here has l = 0: output 0, LSE -inf (the combine gives such a split weight 0).
    m_empty = l_i == 0.0
    l_safe = tl.where(m_empty, 1.0, l_i)
    if FEAT.HAS_DESCALE:
        l_safe = l_safe / v_descale
    b_o = acc / l_safe[:, None]
    lse_log2 = tl.where(m_empty, float("-inf"), m_i + tl.log2(tl.where(m_empty, 1.0, l_i)))
    _split_store(Out, Lse, Part, b_o, lse_log2, i_b, i_s, o_i, o_h, m_r, strides, dims, FEAT, CFG)


# ----------------------------------------------------------------------------------------------------------------
# 3. Combine


@triton.jit
def _kvcache_combine_kernel(Part, Out, Lse, lse_part_offset, num_splits, seqlen_q, num_heads,
                            HEAD_DIM: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr):
    """One output row (b, i, h): the online softmax of docs/derivation.md ch. 4 with the splits as blocks, each
    carrying its weight exp2(lse_s) instead of a block of scores."""
    row = tl.program_id(0).to(tl.int64)  # (b * Sq + i) * Hq + h, also the row of out [B, Sq, Hq, D]
    o_d = tl.arange(0, BLOCK_D)
    m_d = o_d < HEAD_DIM
    m_i = tl.max(tl.full([BLOCK_S], float("-inf"), tl.float32), 0)
    l_i = tl.sum(tl.zeros([BLOCK_S], tl.float32), 0)
    acc = tl.zeros([BLOCK_D], tl.float32)
    for s0 in range(0, num_splits, BLOCK_S):
        o_s = s0 + tl.arange(0, BLOCK_S)
        m_s = o_s < num_splits
        # [BLOCK_S], base 2
        b_lse = tl.load(Part + lse_part_offset + row * num_splits + o_s, mask=m_s, other=float("-inf"))
        m_new = tl.maximum(m_i, tl.max(b_lse, 0))
        m_sub = tl.where(m_new == float("-inf"), 0.0, m_new)
        w = tl.exp2(b_lse - m_sub)  # 0 for a split that saw no key
        alpha = tl.exp2(m_i - m_sub)
        # An empty split's output is never read: 0 * garbage could be NaN.
        m_o = (m_s & (b_lse > float("-inf")))[:, None] & m_d[None, :]
        b_o = tl.load(Part + (row * num_splits + o_s)[:, None] * HEAD_DIM + o_d[None, :], mask=m_o, other=0.0)
        acc = acc * alpha + tl.sum(w[:, None] * b_o, 0)  # [BLOCK_D]
        l_i = l_i * alpha + tl.sum(w, 0)
        m_i = m_new
    m_empty = l_i == 0.0
    l_safe = tl.where(m_empty, 1.0, l_i)
    tl.store(Out + row * HEAD_DIM + o_d, (acc / l_safe).to(Out.dtype.element_ty), mask=m_d)
    i_h = row % num_heads
    i_i = (row // num_heads) % seqlen_q
    i_b = row // (num_heads * seqlen_q)
    lse = tl.where(m_empty, float("-inf"), (m_i + tl.log2(l_safe)) * LN2)
    tl.store(Lse + (i_b * num_heads + i_h) * seqlen_q + i_i, lse)


# ----------------------------------------------------------------------------------------------------------------
# Launchers


def _page_size(k_cache, block_table):
    return k_cache.shape[1] if block_table is not None else 1


def _pages_nest(page_size, block_n):
    """Whether key blocks of block_n rows, aligned to cache rows, each lie inside one page or cover whole pages."""
    return page_size % block_n == 0 or block_n % page_size == 0


def _capacity(k_cache, block_table):
    """Rows one sequence can hold: the cache's seqlen, or pages per sequence x page size."""
    if block_table is not None:
        return block_table.shape[1] * k_cache.shape[1]
    return k_cache.shape[1]


@functools.lru_cache(maxsize=None)
def _dummy(device):
    # Stands in for an absent optional tensor: its pointer is passed but never read (the constexpr flag is off).
    return torch.empty(1, dtype=torch.int32, device=device)


def _spec(q):
    """The LaunchSpec of a decode launch (the kernels use pointers, never TMA descriptors)."""
    return configs.launch_spec(q, (), tma=False)


def _tensor_key(t):
    """What a launch's compiled kernel and scalar arguments depend on in a tensor: dtype, shape, strides and
    whether its address is 16-byte aligned (Triton specializes pointers on that)."""
    return None if t is None else (t.dtype, t.shape, t.stride(), t.data_ptr() % configs.TMA_ALIGN_BYTES == 0)


def _settings_key(q):
    """The settings a plan depends on besides its tensors: SETTINGS.decode_tiles and .page_slabs, torch's tf32 flag."""
    tiles = None if SETTINGS.decode_tiles is None else tuple(SETTINGS.decode_tiles)
    tf32 = q.dtype == torch.float32 and torch.backends.cuda.matmul.allow_tf32
    return tiles, SETTINGS.page_slabs, tf32


# The decode plans: key (append_key / attention_key: every shape, stride, dtype, 16-byte alignment and option a
# launch depends on, and _settings_key) -> plan: everything a call with that key launches, its launches bound
# (_launch.Bound) to the compiled kernels. They exist for host time: a cached decode call allocates its outputs and
# calls the compiled kernels' launchers, with no tile choice, key hashing or argument specialization (the module
# docstring). The compiled kernels themselves are in _launch's one compile cache.
_PLANS: dict = {}


def _store_plan(key, plan):
    if len(_PLANS) >= MAX_PLANS:
        _PLANS.clear()
    _PLANS[key] = plan


def plan(key):
    """The plan built for key (append_key / attention_key), or None."""
    return _PLANS.get(key)


def append_key(k_cache, v_cache, k_new, v_new, cache_seqlens, cache_batch_idx, block_table, rotary_cos, rotary_sin,
               rotary_interleaved, k_descale, v_descale):
    return ("append", k_new.get_device(), _tensor_key(k_cache), _tensor_key(v_cache), _tensor_key(k_new),
            _tensor_key(v_new), _tensor_key(cache_seqlens), _tensor_key(cache_batch_idx), _tensor_key(block_table),
            _tensor_key(rotary_cos), _tensor_key(rotary_sin), rotary_interleaved, _tensor_key(k_descale),
            _tensor_key(v_descale))


def attention_key(q, k_cache, v_cache, cache_seqlens, seqlen_new, cache_batch_idx, cache_leftpad, block_table,
                  rotary_cos, rotary_sin, rotary_interleaved, alibi_slopes, softmax_scale, causal, window_left,
                  window_right, softcap, num_splits, k_descale, v_descale):
    return ("attn", q.get_device(), _tensor_key(q), _tensor_key(k_cache), _tensor_key(v_cache),
            _tensor_key(cache_seqlens), _tensor_key(cache_batch_idx), _tensor_key(cache_leftpad),
            _tensor_key(block_table), _tensor_key(rotary_cos), _tensor_key(rotary_sin), rotary_interleaved,
            _tensor_key(alibi_slopes), softmax_scale, causal, window_left, window_right, softcap, num_splits,
            seqlen_new, _tensor_key(k_descale), _tensor_key(v_descale), _settings_key(q))


class _AppendPlan:
    __slots__ = ("launch", "dummy")

    def run(self, stream, k_cache, v_cache, k_new, v_new, cache_seqlens, cache_seqlen, cache_batch_idx, block_table,
            rotary_cos, rotary_sin, k_descale, v_descale):
        dummy = self.dummy
        self.launch(stream, k_new, v_new, k_cache, v_cache,
                    (dummy if cache_seqlens is None else cache_seqlens,
                     dummy if cache_batch_idx is None else cache_batch_idx, dummy,
                     dummy if block_table is None else block_table),
                    (dummy if rotary_cos is None else rotary_cos, dummy if rotary_sin is None else rotary_sin),
                    (dummy if k_descale is None else k_descale, dummy if v_descale is None else v_descale),
                    cache_seqlen)


def _append_plan(k_cache, v_cache, k_new, v_new, cache_seqlens, cache_batch_idx, block_table, rotary_cos,
                 rotary_sin, rotary_interleaved, k_descale):
    batch, seqlen_new, num_kv_heads, head_dim = k_new.shape
    rotary = rotary_cos is not None
    block_r = min(APPEND_BLOCK_R, _next_pow2(seqlen_new))
    strides = _strides(k_new, k_cache, v_cache, v_new.stride()[:3], block_table, rotary_cos, rotary_sin, None,
                       k_descale)
    dims = Dims(seqlen_new, seqlen_new, _capacity(k_cache, block_table), Heads(num_kv_heads, 1), 1, 0,
                rotary_cos.shape[0] if rotary else 0, k_cache.shape[0])
    constexprs = dict(
        HEAD_DIM=head_dim, BLOCK_R=block_r, BLOCK_D=_block_d(head_dim),
        HAS_SEQLENS=cache_seqlens is not None, HAS_BATCH_IDX=cache_batch_idx is not None,
        PAGED=block_table is not None, PAGE_SIZE=_page_size(k_cache, block_table),
        ROTARY=rotary, ROTARY_DIM=2 * rotary_cos.shape[1] if rotary else 0, INTERLEAVED=bool(rotary_interleaved),
        QUANTIZE=k_descale is not None,
    )
    plan = _AppendPlan()
    plan.dummy = _dummy(k_new.device)
    plan.launch = _launch.Bound(_kvcache_append_kernel, (_cdiv(seqlen_new, block_r), batch * num_kv_heads, 1),
                                (strides, dims), constexprs, dict(num_warps=4))
    return plan


def _strides(q, k_cache, v_cache, out_strides, block_table, rotary_cos, rotary_sin, alibi_slopes, k_descale):
    """The Strides of a launch (q: k_new for the append; out_strides: v_new's for the append)."""
    return Strides(tuple(q.stride()[:3]), tuple(k_cache.stride()[:3]), tuple(v_cache.stride()[:3]), out_strides,
                   block_table.stride(0) if block_table is not None else 0,
                   rotary_cos.stride(0) if rotary_cos is not None else 0,
                   rotary_sin.stride(0) if rotary_sin is not None else 0,
                   alibi_slopes.stride(0) if alibi_slopes is not None and alibi_slopes.dim() == 2 else 0,
                   k_descale.stride(0) if k_descale is not None else 0)


def kvcache_append(k_cache, v_cache, k_new, v_new, cache_seqlens, cache_seqlen, cache_batch_idx, block_table,
                   rotary_cos, rotary_sin, rotary_interleaved, k_descale=None, v_descale=None):
    """Write k_new (rotated when rotary_cos is given) and v_new into the cache at rows cache_seqlens[b] + i, in
    place. cache_seqlens None means every sequence has length cache_seqlen. An fp8 cache stores value / descale
    (descales [B, Hk] fp32), rounded to nearest even. Inputs are assumed validated (flashtile.kvcache)."""
    if k_new.shape[1] == 0:
        return
    device_index = k_new.get_device()
    key = append_key(k_cache, v_cache, k_new, v_new, cache_seqlens, cache_batch_idx, block_table, rotary_cos,
                     rotary_sin, rotary_interleaved, k_descale, v_descale)
    plan = _PLANS.get(key)
    if plan is None:
        plan = _append_plan(k_cache, v_cache, k_new, v_new, cache_seqlens, cache_batch_idx, block_table, rotary_cos,
                            rotary_sin, rotary_interleaved, k_descale)
        _store_plan(key, plan)
    args = (k_cache, v_cache, k_new, v_new, cache_seqlens, cache_seqlen, cache_batch_idx, block_table, rotary_cos,
            rotary_sin, k_descale, v_descale)
    if off_device(device_index):
        with torch.cuda.device(device_index):
            plan.run(None, *args)
        return
    plan.run(fast_stream(device_index), *args)


class _AttnPlan:
    __slots__ = ("split", "combine", "out_shape", "lse_shape", "part_shape", "device", "dummy", "cfg")

    def run(self, stream, q, k_cache, v_cache, cache_seqlens, cache_seqlen, cache_batch_idx, cache_leftpad,
            block_table, rotary_cos, rotary_sin, alibi_slopes, k_descale, v_descale):
        """Launch with this call's tensors (stream: fast_stream's, None for the JIT path). Returns (out, lse, the
        split kernel's compiled kernel). The host work of a cached call: the outputs' allocations, a placeholder
        for each absent tensor, three small tuples for the kernel's tensor groups (cache index, rotary, descales)
        and one call of each compiled kernel's launcher through its _launch.Bound (no key, no lookup). The grid,
        the scalar groups and the constexprs are the plan's, built once. Before the groups a call did the same
        without the tuples but passed ~35 more positional arguments: measured with the launchers stubbed, the
        Python of a cached call is no slower (1.4-2.1 us against 1.6-2.3 us, CPU)."""
        device, dummy = self.device, self.dummy
        out = _common.empty(self.out_shape, q.dtype, device)
        lse = _common.empty(self.lse_shape, torch.float32, device)
        # One fp32 buffer for the splits' partial results: o_part [B, Sq, Hq, S, D], then lse_part [B, Sq, Hq, S].
        part = dummy if self.combine is None else _common.empty(self.part_shape, torch.float32, device)
        compiled = self.split(stream, q, k_cache, v_cache, out, lse, part,
                              (dummy if cache_seqlens is None else cache_seqlens,
                               dummy if cache_batch_idx is None else cache_batch_idx,
                               dummy if cache_leftpad is None else cache_leftpad,
                               dummy if block_table is None else block_table),
                              (dummy if rotary_cos is None else rotary_cos,
                               dummy if rotary_sin is None else rotary_sin),
                              dummy if alibi_slopes is None else alibi_slopes,
                              (dummy if k_descale is None else k_descale,
                               dummy if v_descale is None else v_descale),
                              cache_seqlen)
        if self.combine is not None:
            self.combine(stream, part, out, lse)
        return out, lse, compiled


def _attn_plan(cfg, spec, q, k_cache, v_cache, cache_seqlens, cache_batch_idx, cache_leftpad, block_table,
               rotary_cos, rotary_sin, rotary_interleaved, alibi_slopes, softmax_scale, causal, window_left,
               window_right, softcap, num_splits, seqlen_new, k_descale):
    """The launches of kvcache_attention with tile cfg."""
    batch, seqlen_q, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    device = q.device
    page_size = _page_size(k_cache, block_table)
    # The band (_common.Band): MASK_LEFT / MASK_RIGHT where a bound applies; causal is MASK_RIGHT with right = 0.
    mask_left, mask_right = window_left >= 0, bool(causal) or window_right >= 0
    band = Band(window_left if mask_left else 0, 0 if causal or not mask_right else window_right)
    capacity = _capacity(k_cache, block_table)
    # Keys one row block can see: the capacity, or less under a sliding window.
    max_keys = capacity
    if mask_left:
        max_keys = min(max_keys, band.left + seqlen_q + band.right + 1)
    rows = seqlen_q * num_heads // num_kv_heads
    block_m = min(cfg.block_m, max(MIN_BLOCK_M, _next_pow2(rows)))
    m_blocks = _cdiv(rows, block_m)
    splits = choose_num_splits(num_splits, batch * num_kv_heads * m_blocks, max_keys, cfg.block_n,
                               split_slots(device, cfg, head_dim, k_cache.element_size()))
    n_rows = batch * seqlen_q * num_heads * splits

    plan = _AttnPlan()
    plan.cfg = cfg
    plan.device = device
    plan.dummy = _dummy(device)
    plan.out_shape = (batch, seqlen_q, num_heads, head_dim)
    plan.lse_shape = (batch, num_heads, seqlen_q)
    plan.part_shape = (n_rows * (head_dim + 1),)
    # out is allocated contiguous: its strides follow from its shape.
    strides = _strides(q, k_cache, v_cache, (seqlen_q * num_heads * head_dim, num_heads * head_dim, head_dim),
                       block_table, rotary_cos, rotary_sin, alibi_slopes, k_descale)
    dims = Dims(seqlen_q, seqlen_new, capacity, Heads(num_kv_heads, num_heads // num_kv_heads), splits,
                n_rows * head_dim, rotary_cos.shape[0] if rotary_cos is not None else 0, k_cache.shape[0])
    scale = DecodeScale(softmax_scale * LOG2E.value, softmax_scale / softcap if softcap > 0.0 else 0.0,
                        softcap * LOG2E.value)
    config = DecodeConfig(head_dim, block_m, cfg.block_n, _block_d(head_dim), spec.precision, spec.dot_upcast)
    flags = DecodeFlags(
        HAS_SEQLENS=cache_seqlens is not None, HAS_BATCH_IDX=cache_batch_idx is not None,
        HAS_LEFTPAD=cache_leftpad is not None, PAGED=block_table is not None, PAGE_SIZE=page_size,
        PAGE_SLAB=block_table is not None and SETTINGS.page_slabs and _pages_nest(page_size, cfg.block_n),
        ROTARY=rotary_cos is not None, ROTARY_DIM=2 * rotary_cos.shape[1] if rotary_cos is not None else 0,
        INTERLEAVED=bool(rotary_interleaved), ROTARY_PER_ROW=mask_left or mask_right, MASK_LEFT=mask_left,
        MASK_RIGHT=mask_right, HAS_SOFTCAP=softcap > 0.0, HAS_ALIBI=alibi_slopes is not None,
        HAS_DESCALE=k_descale is not None, SPLIT=splits > 1)
    plan.split = _launch.Bound(_kvcache_split_kernel, (batch * num_kv_heads, splits, m_blocks),
                               (strides, dims, scale, band), _common.constexpr_groups(FEAT=flags, CFG=config),
                               dict(num_warps=cfg.num_warps, num_stages=cfg.num_stages))
    plan.combine = None
    if splits > 1:
        plan.combine = _launch.Bound(_kvcache_combine_kernel, (batch * seqlen_q * num_heads, 1, 1),
                                     (dims.lse_part_offset, splits, seqlen_q, num_heads),
                                     dict(HEAD_DIM=head_dim, BLOCK_S=min(COMBINE_BLOCK_S, _next_pow2(splits)),
                                          BLOCK_D=config.BLOCK_D), dict(num_warps=4))
    return plan


def kvcache_attention(q, k_cache, v_cache, cache_seqlens, cache_seqlen, seqlen_new, cache_batch_idx, cache_leftpad,
                      block_table, rotary_cos, rotary_sin, rotary_interleaved, alibi_slopes, softmax_scale, causal,
                      window_left, window_right, softcap, num_splits, k_descale=None, v_descale=None):
    """Attention of q over each sequence's cache rows [leftpad, seqlen + seqlen_new). Returns (out [B, Sq, Hq, D]
    in q's dtype, lse [B, Hq, Sq] fp32 natural log).

    window_left / window_right: -1 unbounded (flash-attn's convention); causal sets the right bound to 0. Rotary
    (cos/sin given) rotates q on load. num_splits 0 chooses the split count (choose_num_splits). Inputs are
    assumed validated (flashtile.kvcache).
    """
    device_index = q.get_device()
    key = attention_key(q, k_cache, v_cache, cache_seqlens, seqlen_new, cache_batch_idx, cache_leftpad, block_table,
                        rotary_cos, rotary_sin, rotary_interleaved, alibi_slopes, softmax_scale, causal, window_left,
                        window_right, softcap, num_splits, k_descale, v_descale)
    args = (q, k_cache, v_cache, cache_seqlens, cache_seqlen, cache_batch_idx, cache_leftpad, block_table,
            rotary_cos, rotary_sin, alibi_slopes, k_descale, v_descale)
    plan = _PLANS.get(key)
    if plan is None or off_device(device_index):
        with torch.cuda.device(device_index) if device_index >= 0 else contextlib.nullcontext():
            if plan is None:
                plan, out, lse = _first_attn_launch(key, args, rotary_interleaved, softmax_scale, causal,
                                                    window_left, window_right, softcap, num_splits, seqlen_new)
                return out, lse
            return plan.run(None, *args)[:2]
    return plan.run(fast_stream(device_index), *args)[:2]


def _first_attn_launch(key, args, rotary_interleaved, softmax_scale, causal, window_left, window_right, softcap,
                       num_splits, seqlen_new):
    """Build the plan for key with the first candidate tile that compiles, launching it; store and return it with
    the call's (out, lse)."""
    (q, k_cache, v_cache, cache_seqlens, cache_seqlen, cache_batch_idx, cache_leftpad, block_table, rotary_cos,
     rotary_sin, alibi_slopes, k_descale, v_descale) = args
    spec = _spec(q)
    head_dim = q.shape[3]
    result = {}

    def launch(cfg):
        plan = _attn_plan(cfg, spec, q, k_cache, v_cache, cache_seqlens, cache_batch_idx, cache_leftpad,
                          block_table, rotary_cos, rotary_sin, rotary_interleaved, alibi_slopes, softmax_scale,
                          causal, window_left, window_right, softcap, num_splits, seqlen_new, k_descale)
        out, lse, compiled = plan.run(None, *args)
        result.update(plan=plan, out=out, lse=lse)
        return compiled

    candidates = split_candidates(head_dim, k_cache.dtype, spec)
    configs.launch_first_that_compiles(("decode", head_dim, bool(causal), q.dtype, k_cache.dtype,
                                        block_table is not None, spec), candidates, launch)
    _store_plan(key, result["plan"])
    return result["plan"], result["out"], result["lse"]
