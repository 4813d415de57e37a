"""Pieces every portable kernel shares: constants, argument groups, tile loads/stores, the matmul wrapper, and the
one component that decides which keys each query sees (sequences, block ranges, the band and the mask).

Tensor layout in every kernel file: q, out: [B, Sq, Hq, D]; k, v: [B, Sk, Hk, D]; lse: [B, Hq, Sq].
A tile is BLOCK_R rows of one (batch, head) slice with the head dim padded to BLOCK_D (a power of two).

Two ways to reach memory, chosen per launch by the constexpr USE_TMA:
- TMA tensor descriptors built on the device (Hopper and newer, 16-byte aligned base and strides): the copy
  engine does the address arithmetic and zero-fills rows/columns outside the tensor, so ragged edges cost nothing.
- Plain pointers with masks: any GPU, any strides, and what the interpreter tests by default.

Arguments travel in groups (typing.NamedTuple below). Triton passes a tuple argument field by field, each field
specialized as a flat argument would be (a stride of 1 becomes a constant, an integer divisible by 16 is marked
so), and a kernel reads the fields by name; a group of constexprs is one constexpr argument. Triton 3.6 and 3.9
keep a constexpr group's fields constexpr when read as `GROUP.FIELD` (not when unpacked into names).
"""
from typing import NamedTuple

import torch
import triton
import triton.language as tl
from triton.language.random import philox

from . import _launch

# Compiled kernels may only read globals that are constexpr; host code reads LOG2E.value.
LOG2E = tl.constexpr(1.4426950408889634)  # log2(e): exp(x) = exp2(x * LOG2E), see docs/derivation.md#5-kernel-tricks
LN2 = tl.constexpr(0.6931471805599453)  # ln(2): natural-log LSE = log2-LSE * LN2

# What attn_mask holds: the BIAS constexpr of every kernel, portable and Gluon (features.Features.bias_kind; the
# host reads .value). Whether its tiles are read through TMA descriptors is the separate constexpr BIAS_TMA.
BIAS_NONE = tl.constexpr(0)
BIAS_FLOAT = tl.constexpr(1)  # an additive float bias
BIAS_BOOL = tl.constexpr(2)  # a bool mask, True = attend


@triton.jit
def _probe_kernel():
    pass


# Triton decides at decoration time whether kernels are compiled or interpreted (TRITON_INTERPRET=1).
INTERPRETING = type(_probe_kernel).__name__ == "InterpretedFunction"


def _scalar_index(self):
    # A scalar's value in the interpreter, whose data is a one-element array: of shape (1,) for a kernel argument
    # and anything computed from one, () for some results.
    return int(self.handle.data.reshape(()))


def _patch_interpreter_index():
    """Make the interpreter's scalars usable as `range` bounds under current NumPy.

    While a kernel runs, Triton's interpreter gives `tl.tensor` an `__index__` (what a `range` bound or `int()`
    calls). Triton 3.6's is `int(data)`, and a scalar's data there is an array of shape (1,), which current NumPy
    (2.4; older versions warned) refuses to convert: "only 0-dimensional arrays can be converted to Python
    scalars". Every portable kernel, whose key loops are bounded by a sequence's lengths, then failed under
    TRITON_INTERPRET=1 with Triton 3.6. Newer Triton squeezes the array first. The interpreter's tensor patch is
    wrapped so that each kernel run then sets an `__index__` that takes the one element, as newer Triton's does;
    the interpreter's own scope records the attribute and restores it after the run, as it does its own. Nothing
    else about the interpreter changes."""
    from triton.runtime import interpreter
    patch = getattr(interpreter, "_patch_lang_tensor", None)
    if patch is None or getattr(patch, "_flashtile_index", False):
        return

    def patched(tensor, scope):
        patch(tensor, scope)
        scope.set_attr(tensor, "__index__", _scalar_index)

    patched._flashtile_index = True
    interpreter._patch_lang_tensor = patched


if INTERPRETING:
    _patch_interpreter_index()


def batch_strides(t, varlen):
    """(batch, seqlen, head) strides of a [B, S, H, D] tensor, or of a packed [total, H, D] one (batch stride 0)."""
    return (0,) + tuple(t.stride()[:2]) if varlen else tuple(t.stride()[:3])


def contiguous_strides(shape):
    """The strides of a contiguous tensor of this shape (what torch.empty gives)."""
    strides, step = [], 1
    for n in reversed(shape):
        strides.append(step)
        step *= max(n, 1)
    return tuple(reversed(strides))


def empty(shape, dtype, device):
    """Every buffer a launcher hands to a kernel comes from here (outputs and scratch). The tests replace it with a
    NaN-filled allocation, so an element a kernel fails to write shows up as NaN instead of passing by luck."""
    return torch.empty(shape, dtype=dtype, device=device)


# ----------------------------------------------------------------------------------------------------------------
# Argument groups of the forward and backward kernels


class Flags(NamedTuple):
    """The feature constexprs (FEAT) of the forward and backward kernels: a launch without a feature compiles none
    of its code (docs/derivation.md#8). A kernel ignores the flags it has no use for; its launcher leaves them at
    their defaults. Passed as one constexpr (constexpr_groups)."""
    MASK_LEFT: bool = False  # the band's left edge: j >= i + diag - left
    MASK_RIGHT: bool = False  # the band's right edge: j <= i + diag + right (causal: right = 0)
    SOFTCAP: int = 0  # 0 off, 1 exact tanh, 2 the hardware approximation (16-bit inputs on a GPU)
    HAS_ALIBI: bool = False
    BIAS: int = 0  # BIAS_NONE / BIAS_FLOAT / BIAS_BOOL
    BIAS_TMA: bool = False  # attn_mask tiles read through a TMA descriptor
    BLOCK_SKIP: bool = False  # loop over the lists of blocks a bool mask leaves visible (Features.block_lists)
    HAS_SINKS: bool = False
    DROPOUT: bool = False
    VARLEN: bool = False  # packed sequences delimited by cu_seqlens
    DBIAS: bool = False  # the dQ kernel also writes dS, the gradient of a float bias
    PAGED: bool = False  # keys and values read through a block table (Paged; the forward only)
    PAGE_SIZE: int = 0  # rows per page (PAGED)
    FP8: bool = False  # float8_e4m3fn q, k, v with their descale factors (the forward only)


class Config(NamedTuple):
    """The code-generation constexprs (CFG): tiles, head dims, memory path and matmul precision. Passed as one
    constexpr (constexpr_groups)."""
    HEAD_DIM: int
    HEAD_DIM_V: int
    BLOCK_M: int  # query rows per tile
    BLOCK_N: int  # key rows per tile
    BLOCK_D: int  # HEAD_DIM padded to a power of two
    BLOCK_DV: int
    EVEN_N: bool  # no band, no varlen, Sk a multiple of BLOCK_N: no masked stage after the unmasked one
    USE_TMA: bool
    PRECISION: str  # tl.dot input_precision for fp32 operands: "ieee" or "tf32"
    DOT_UPCAST: bool  # the interpreter's 16-bit workaround (_mma)


class CuSeqlens(NamedTuple):
    """VARLEN: int32 (B + 1,) row offsets of the packed sequences in q and in k (placeholders otherwise), and the
    packed tensors' row counts, which bound every offset the kernels use (docs/safety.md: a bad offset spoils its
    own sequence's rows at worst, never memory past the tensors)."""
    q: object
    k: object
    total_q: int = 0
    total_k: int = 0


class Paged(NamedTuple):
    """PAGED (flash_attn_varlen_func with block_table): k, v are [num_pages, PAGE_SIZE, Hk, D] caches and key j of
    sequence b is row j % PAGE_SIZE of page table[b, j // PAGE_SIZE]; sequence b has used[b] keys, clamped into
    [0, limit] (limit: the table's capacity, max_pages * PAGE_SIZE, or max_seqlen_k if smaller). Placeholders
    (never read) otherwise."""
    table: object  # int32/int64 [B, max_pages]
    table_stride: int
    num_pages: int  # table entries outside [0, num_pages) are not read: their keys and values read as 0
    limit: int
    used: object  # int32/int64 (B,) key counts
    page_stride_k: int  # k's stride between pages
    page_stride_v: int


def constexpr_groups(**groups):
    """Constexpr arguments by name for a launch whose kernel takes NamedTuple groups of constexprs (FEAT, CFG).
    Compiled, each group's fields are wrapped as tl.constexpr: Triton 3.6 hands a NamedTuple constexpr's plain
    fields to the kernel as Python values, which its builtins (tl.zeros, calls of jit functions) reject; wrapped,
    they are constexprs in 3.6 and 3.9 alike, and hash and compare by value (launch keys, Triton's cache). The
    interpreter takes the plain values (its loop indices are Python ints, which do not combine with tl.constexpr
    in every operator)."""
    if INTERPRETING:
        return groups
    key = tuple(groups.items())
    wrapped = _WRAPPED_GROUPS.get(key)
    if wrapped is None:
        wrapped = Constexprs({name: type(group)(*map(tl.constexpr, group)) for name, group in groups.items()})
        wrapped.key = key
        if len(_WRAPPED_GROUPS) >= _MAX_WRAPPED_GROUPS:
            _WRAPPED_GROUPS.clear()
        _WRAPPED_GROUPS[key] = wrapped
    return wrapped


class Constexprs(dict):
    """constexpr_groups' result: constexprs by name, and `key`, the same groups of plain values, which launch keys
    use (kernels/_launch._key): hashing and comparing tl.constexpr objects costs several Python calls each."""
    __slots__ = ("key",)


# constexpr_groups' results by their plain groups (a launch's constexprs are built once, not per call); past this
# many the cache starts over.
_WRAPPED_GROUPS: dict = {}
_MAX_WRAPPED_GROUPS = 4096


class Seq(NamedTuple):
    """Extent of one (batch entry's) sequence: what flash-attn's SeqlenInfoQK holds."""
    seqlen_q: int
    seqlen_k: int
    diag: int  # query i sits at key position i + diag (bottom-right alignment: Sk - Sq)


class Band(NamedTuple):
    """Query i sees key j iff i + diag - left <= j <= i + diag + right, each bound only where its MASK_* flag is on."""
    left: int
    right: int


class Heads(NamedTuple):
    num_heads: int  # query heads (kv heads in the dK/dV kernel's grid)
    group_size: int  # query heads per kv head (grouped-query attention)


class Scale(NamedTuple):
    sm_scale: float  # the softmax scale, > 0
    qk_scale: float  # sm_scale * log2(e)
    softcap: float  # 0: off


class Alibi(NamedTuple):
    slopes: object  # fp32 (H,) or (B, H)
    stride_b: int  # 0 for (H,)


class Bias(NamedTuple):
    """attn_mask: [B|1, H|1, Sq, Sk] (a bool mask viewed as uint8), strides (b, h, i, j), 0 along broadcast dims."""
    ptr: object
    strides: tuple


class Blocks(NamedTuple):
    """Features.block_lists: per (batch|1, head|1, resident block) the count and indices of the streamed blocks."""
    counts: object
    indices: object
    strides: tuple  # (b, h) of the counts, 0 along broadcast dims
    cols: int  # indices per list


class Dropout(NamedTuple):
    seed: object  # int64 (1,) tensor
    threshold: int  # keep iff the top 31 bits of the draw are >= threshold = round(p * 2^31)
    scale: float  # 1 - p in the forward, 1 / (1 - p) in the backward


class View(NamedTuple):
    """Rows of one (batch, head) slice: a TMA descriptor or the slice's base pointer, its rows and row stride."""
    handle: object
    rows: int
    stride: int


class BiasView(NamedTuple):
    """attn_mask tiles of one (batch, head): a TMA descriptor or the base pointer, the extent and the strides."""
    handle: object
    seq: Seq
    stride_m: int
    stride_n: int


# ----------------------------------------------------------------------------------------------------------------
# Memory


@triton.jit
def _slice_base(ptr, i_b, row0, i_h, strides):
    """Start of the (batch i_b, head i_h) slice, from sequence row row0 on (a varlen sequence's first row, else 0);
    strides (b, s, h). int64 before multiplying by strides: B * S * H * D may pass 2^31 elements."""
    return (ptr + tl.cast(i_b, tl.int64) * strides[0] + tl.cast(row0, tl.int64) * strides[1]
            + tl.cast(i_h, tl.int64) * strides[2])


@triton.jit
def _descriptor_or_pointer(base, rows, cols, stride_row, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr,
                           USE_TMA: tl.constexpr):
    """The handle tiles of a [rows, cols] matrix with unit column stride are read through: a TMA descriptor
    (copies of [BLOCK_R, BLOCK_C], zero-filled outside the matrix), or the base pointer itself."""
    if USE_TMA:
        handle = tl.make_tensor_descriptor(base, shape=[rows, cols], strides=[stride_row, 1],
                                           block_shape=[BLOCK_R, BLOCK_C])
    else:
        handle = base
    return handle


@triton.jit
def _slice_view(ptr, strides, i_b, row0, i_h, rows, HEAD_DIM: tl.constexpr, BLOCK_R: tl.constexpr,
                BLOCK_D: tl.constexpr, USE_TMA: tl.constexpr):
    """The View of rows [row0, row0 + rows) of head i_h of batch entry i_b in a [B, S, H, D] tensor."""
    return View(_descriptor_or_pointer(_slice_base(ptr, i_b, row0, i_h, strides), rows, HEAD_DIM, strides[1],
                                       BLOCK_R, BLOCK_D, USE_TMA), rows, strides[1])


@triton.jit
def _head_views(A, B, strides_a, strides_b, i_b, row0, i_h, rows, BLOCK_R: tl.constexpr, CFG: tl.constexpr):
    """Views of head i_h of batch entry i_b, rows [row0, row0 + rows), in two [B, S, H, D] tensors read or written
    together: A with CFG.HEAD_DIM (q, k, dk) and B with CFG.HEAD_DIM_V (out or dout, v, dv)."""
    view_a = _slice_view(A, strides_a, i_b, row0, i_h, rows, CFG.HEAD_DIM, BLOCK_R, CFG.BLOCK_D, CFG.USE_TMA)
    view_b = _slice_view(B, strides_b, i_b, row0, i_h, rows, CFG.HEAD_DIM_V, BLOCK_R, CFG.BLOCK_DV, CFG.USE_TMA)
    return view_a, view_b


@triton.jit
def _load_tile(view, start, HEAD_DIM: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr,
               USE_TMA: tl.constexpr):
    """Rows [start, start + BLOCK_R) of a View; rows >= view.rows and columns >= HEAD_DIM read as 0."""
    if USE_TMA:
        tile = view.handle.load([start, 0])
    else:
        o_r = tl.arange(0, BLOCK_R)
        o_d = tl.arange(0, BLOCK_D)
        # The row offset goes through int64 once, so S * stride past 2^31 elements does not wrap.
        p_tile = (view.handle + tl.cast(start, tl.int64) * view.stride + o_r[:, None] * view.stride
                  + o_d[None, :])
        tile = tl.load(p_tile, mask=((start + o_r)[:, None] < view.rows) & (o_d[None, :] < HEAD_DIM), other=0.0)
    return tile


@triton.jit
def _paged_seq(paged, i_b, seq):
    """Seq of batch entry i_b of a paged batch: its key count clamped into [0, paged.limit], its own diagonal."""
    seqlen_k = tl.minimum(tl.maximum(tl.load(paged.used + i_b), 0), paged.limit).to(tl.int32)
    return Seq(seq.seqlen_q, seqlen_k, seqlen_k - seq.seqlen_q)


@triton.jit
def _tile_pages(table_row, start, rows, num_pages, BLOCK_R: tl.constexpr, PAGE_SIZE: tl.constexpr):
    """(page, ok) of the rows [start, start + BLOCK_R) of a paged sequence of `rows` keys (start a multiple of
    BLOCK_R): one table entry when the tile lies in one page (PAGE_SIZE a multiple of BLOCK_R), else one per row.
    Rows at or past `rows` read no entry (page 0; their keys are masked by the loads). ok: the entry is a page of
    the pool; a bad entry is never dereferenced (docs/safety.md)."""
    if PAGE_SIZE % BLOCK_R == 0:
        page = tl.load(table_row + start // PAGE_SIZE, mask=start < rows, other=0)
    else:
        o_r = start + tl.arange(0, BLOCK_R)
        page = tl.load(table_row + o_r // PAGE_SIZE, mask=o_r < rows, other=0)
    return page.to(tl.int64), (page >= 0) & (page < num_pages)


@triton.jit
def _load_paged_tile(view, page, ok, page_stride, start, HEAD_DIM: tl.constexpr, BLOCK_R: tl.constexpr,
                     BLOCK_D: tl.constexpr, PAGE_SIZE: tl.constexpr):
    """Rows [start, start + BLOCK_R) of a paged View (its handle: page 0 of the head, its stride: a row's) at the
    pages of _tile_pages; rows >= view.rows, columns >= HEAD_DIM and rows of a bad page read as 0. Row r is row
    r % PAGE_SIZE of its page; when pages and tiles nest that offset is loop-invariant (docs/design-record.md,
    "Paged caches: the per-row address arithmetic")."""
    o_r = tl.arange(0, BLOCK_R)
    o_d = tl.arange(0, BLOCK_D)
    if PAGE_SIZE % BLOCK_R == 0:  # one page: a scalar base; a bad page reads no row
        base = view.handle + page * page_stride + tl.cast(start % PAGE_SIZE, tl.int64) * view.stride
        p_tile = base + o_r[:, None] * view.stride + o_d[None, :]
        mask = ((start + o_r)[:, None] < tl.where(ok, view.rows, 0)) & (o_d[None, :] < HEAD_DIM)
    else:
        mask = ((start + o_r)[:, None] < view.rows) & (o_d[None, :] < HEAD_DIM)
        if BLOCK_R % PAGE_SIZE == 0:  # whole pages: start is a multiple of PAGE_SIZE
            in_page = o_r % PAGE_SIZE
        else:
            in_page = (start + o_r) % PAGE_SIZE
        p_tile = (view.handle + (page * page_stride + tl.cast(in_page, tl.int64) * view.stride)[:, None]
                  + o_d[None, :])
        mask = mask & ok[:, None]
    return tl.load(p_tile, mask=mask, other=0.0)


@triton.jit
def _store_tile(view, tile, start, HEAD_DIM: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr,
                USE_TMA: tl.constexpr):
    """Write a tile back into a View; what falls outside the slice is dropped."""
    if USE_TMA:
        view.handle.store([start, 0], tile)
    else:
        o_r = tl.arange(0, BLOCK_R)
        o_d = tl.arange(0, BLOCK_D)
        p_tile = (view.handle + tl.cast(start, tl.int64) * view.stride + o_r[:, None] * view.stride
                  + o_d[None, :])
        tl.store(p_tile, tile, mask=((start + o_r)[:, None] < view.rows) & (o_d[None, :] < HEAD_DIM))


@triton.jit
def _round_tf32(x):
    """Round fp32 to the nearest tf32 (10-bit mantissa). The tensor cores' tf32 mode drops the low 13 bits, a
    truncation whose bias grows with the length of the sum; rounding first matches what cuBLAS computes under
    torch.backends.cuda.matmul.allow_tf32, which the tests use as the baseline."""
    return tl.inline_asm_elementwise("cvt.rna.tf32.f32 $0, $1;", "=r,r", [x], dtype=tl.float32, is_pure=True,
                                     pack=1)


@triton.jit
def _mma(a, b, acc, PRECISION: tl.constexpr, DOT_UPCAST: tl.constexpr):
    """acc + a @ b in fp32 (acc None: just a @ b). The accumulator goes into the dot itself so the tensor cores add
    into it in place; `acc + dot(a, b)` can hold a second accumulator-sized tile in registers.

    PRECISION is "ieee" or "tf32" (only fp32 operands care). DOT_UPCAST is for Triton's interpreter only: its dot
    multiplies bf16 operands as their raw 16-bit integer storage, and runs fp16 through numpy's slow non-BLAS
    float16 loop. Upcasting 16-bit operands to fp32 there changes no result: a 16-bit x 16-bit product is exact
    in fp32, and the accumulation is fp32 either way.
    """
    if DOT_UPCAST:
        c = tl.dot(a.to(tl.float32), b.to(tl.float32), acc)
    elif PRECISION == "tf32" and a.dtype == tl.float32:
        c = tl.dot(_round_tf32(a), _round_tf32(b), acc, input_precision=PRECISION)
    else:
        c = tl.dot(a, b, acc, input_precision=PRECISION)
    return c


# ----------------------------------------------------------------------------------------------------------------
# Which keys each query sees: the one component the forward, the backward and decode share (flash-attn's CuTe code
# splits it into SeqlenInfoQK, BlockInfo and AttentionMask). The rule is docs/derivation.md#8 (window): query i
# sees key j iff i + diag - left <= j <= i + diag + right, each side only where its MASK_* flag is on (causal is
# MASK_RIGHT with right = 0), j < Sk, and, with a bool attn_mask, where the mask is True. The block ranges that
# follow from it are docs/derivation.md#5-kernel-tricks (stages) and #8 (tiles wholly outside or inside the band).


@triton.jit
def _seq_bounds(cu_seqlens, i_b, seq, VARLEN: tl.constexpr):
    """((q_start, k_start), Seq) of batch entry i_b: a varlen sequence's first rows in the packed tensors
    (sequence b is rows [cu[b], cu[b + 1])), its lengths and its own bottom-right diagonal; else (0, 0) and the
    launch's Seq."""
    if VARLEN:
        # Offsets are clamped into [0, total] and each end to at least its start: values that are out of range or
        # decrease (the caller did not check device tensors' values) then cover no row outside the tensors.
        q_start = tl.minimum(tl.maximum(tl.load(cu_seqlens.q + i_b), 0), cu_seqlens.total_q)
        seqlen_q = tl.minimum(tl.maximum(tl.load(cu_seqlens.q + i_b + 1), q_start), cu_seqlens.total_q) - q_start
        k_start = tl.minimum(tl.maximum(tl.load(cu_seqlens.k + i_b), 0), cu_seqlens.total_k)
        seqlen_k = tl.minimum(tl.maximum(tl.load(cu_seqlens.k + i_b + 1), k_start), cu_seqlens.total_k) - k_start
        # The launch covers max_seqlen_q / _k (seq's lengths): rows past them are not computed, and no program
        # indexes a per-row buffer sized by them past its end. The diagonal stays the sequence's own.
        seq = Seq(tl.minimum(seqlen_q, seq.seqlen_q), tl.minimum(seqlen_k, seq.seqlen_k), seqlen_k - seqlen_q)
        starts = (q_start, k_start)
    else:
        starts = (0, 0)
    return starts, seq


@triton.jit
def _running_max(a, b):
    return tl.maximum(a, b)


@triton.jit
def _clamp_block(src, dst, idx, inside, rows, top):
    """One block of a running-maximum clamp: dst[idx] = max(top, clamp(src[j], 0, rows) for j <= idx) -> the new
    top (the block's last value)."""
    x = tl.minimum(tl.maximum(tl.load(src + idx, mask=inside, other=0), 0), rows)
    x = tl.maximum(tl.associative_scan(x, 0, _running_max), top)
    tl.store(dst + idx, x, mask=inside)
    return tl.max(x, 0)


@triton.jit
def _safe_offsets_kernel(CuQ, CuK, Safe, n, rows_q, rows_k, BLOCK: tl.constexpr, BOTH: tl.constexpr):
    """One program: Safe[0] = CuQ's n offsets clamped into [0, rows_q] and made non-decreasing (a running maximum,
    BLOCK offsets at a time, carried across blocks); with BOTH, Safe[1] = CuK's against rows_k."""
    top_q = tl.full([], 0, tl.int32)
    top_k = tl.full([], 0, tl.int32)
    i = 0
    while i < n:  # (not `range`: Triton 3.6's interpreter cannot take a scalar argument as its bound)
        idx = i + tl.arange(0, BLOCK)
        inside = idx < n
        top_q = _clamp_block(CuQ, Safe, idx, inside, rows_q, top_q)
        if BOTH:
            top_k = _clamp_block(CuK, Safe + n, idx, inside, rows_k, top_k)
        i += BLOCK


# Bound launches of _safe_offsets_kernel by (device, offsets, rows_q, rows_k or -1); cleared past _SAFE_MAX keys
# (a serving loop's packed lengths change every step).
_SAFE_LAUNCHES: dict = {}
_SAFE_MAX = 512
# Offsets per step of the scan: batches of up to 1023 sequences in one step, larger ones in several (4 warps: 8
# offsets a thread).
_SAFE_BLOCK = 1024


def safe_offsets(cu_q, rows_q, cu_k=None, rows_k=0):
    """flashtile._values.clamp_offsets on the device, in one launch and one allocation: cu_q (and cu_k, when given)
    clamped into [0, rows] and made non-decreasing, without reading them on the host. Returns (safe_q, safe_k or
    None), views of one int32 tensor."""
    n = cu_q.numel()
    device = cu_q.get_device()
    both = cu_k is not None
    key = (device, n, rows_q, rows_k if both else -1)
    launch = _SAFE_LAUNCHES.get(key)
    if launch is None:
        if len(_SAFE_LAUNCHES) >= _SAFE_MAX:
            _SAFE_LAUNCHES.clear()
        block = min(_SAFE_BLOCK, triton.next_power_of_2(n))
        launch = _SAFE_LAUNCHES[key] = _launch.Bound(_safe_offsets_kernel, (1, ), (n, rows_q, rows_k),
                                                     dict(BLOCK=block, BOTH=both), {})
    # torch.empty, not empty(): the tests' NaN poison cannot fill int32, and the kernel writes every entry.
    safe = torch.empty((2 if both else 1, n), dtype=torch.int32, device=cu_q.device)
    launch(_launch.stream_for(device), cu_q, cu_k if both else cu_q, safe)
    return tuple(safe.unbind(0)) if both else (safe[0], None)


@triton.jit
def _query_block(heads, cu_seqlens, seq, FEAT: tl.constexpr, BLOCK_M: tl.constexpr):
    """The coordinates of a program that owns one query block: block i_m (program id 0; under MASK_RIGHT the
    blocks near the end, which see the most keys, are launched first so that the last wave is short) of query head
    i_h of batch entry i_b (program id 1 = i_bh = i_b * H + i_h), its kv head i_hk (grouped-query attention: query
    heads share kv head h // group_size), and _seq_bounds' (starts, Seq). Returns (i_m, i_bh, i_b, i_h, i_hk,
    starts, seq)."""
    i_m = tl.program_id(0)
    if FEAT.MASK_RIGHT:
        i_m = tl.num_programs(0) - 1 - i_m
    i_bh = tl.program_id(1)
    i_b = i_bh // heads.num_heads
    i_h = i_bh % heads.num_heads
    i_hk = i_h // heads.group_size
    starts, seq = _seq_bounds(cu_seqlens, i_b, seq, FEAT.VARLEN)
    return i_m, i_bh, i_b, i_h, i_hk, starts, seq


@triton.jit
def _band_span(first, last, n_keys, diag, band, MASK_LEFT: tl.constexpr, MASK_RIGHT: tl.constexpr):
    """Keys [lo, hi) that query `first` or query `last` (first <= last, hence every query between) may see, of
    n_keys keys: lo = first + diag - left, hi = last + diag + right + 1, clipped to [0, n_keys].
    With first > last it is the keys that both see: the intersection, used for the blocks no row needs masked."""
    if MASK_RIGHT:
        hi = tl.maximum(tl.minimum(n_keys, last + diag + band.right + 1), 0)
    else:
        hi = n_keys
    if MASK_LEFT:
        lo = tl.maximum(first + diag - band.left, 0)
    else:
        lo = 0
    return lo, hi


@triton.jit
def _key_range(start_m, seq, band, MASK_LEFT: tl.constexpr, MASK_RIGHT: tl.constexpr, BLOCK_M: tl.constexpr,
               BLOCK_N: tl.constexpr):
    """Key ranges for the query block starting at start_m (flash-attn's BlockInfo). Returns (lo, full_lo, full_hi,
    hi): keys [full_lo, full_hi) are whole blocks every row of the block sees (no mask); [lo, full_lo) and
    [full_hi, hi) need the mask (the band's edges and the ragged last block); keys outside [lo, hi) are invisible
    to every row and never loaded. The masked stages are [lo, min(full_lo, hi)) and [max(full_lo, full_hi), hi),
    which together with the unmasked one cover [lo, hi) exactly once whatever the order of full_lo and full_hi.
    """
    last_row = tl.minimum(start_m + BLOCK_M, seq.seqlen_q) - 1
    lo, hi = _band_span(start_m, last_row, seq.seqlen_k, seq.diag, band, MASK_LEFT, MASK_RIGHT)
    # The keys both the first and the last row see, rounded inwards to whole blocks.
    full_lo, full_hi = _band_span(last_row, start_m, seq.seqlen_k, seq.diag, band, MASK_LEFT, MASK_RIGHT)
    full_hi = (full_hi // BLOCK_N) * BLOCK_N
    if MASK_LEFT:
        lo = (lo // BLOCK_N) * BLOCK_N
        full_lo = tl.cdiv(full_lo, BLOCK_N) * BLOCK_N
    return lo, full_lo, full_hi, hi


@triton.jit
def _query_range(start_n, seq, band, MASK_LEFT: tl.constexpr, MASK_RIGHT: tl.constexpr, BLOCK_M: tl.constexpr,
                 BLOCK_N: tl.constexpr):
    """Query rows [lo, hi) that see any key of the key block starting at start_n: the transpose of _band_span (query
    i sees key j iff j - diag - right <= i <= j - diag + left). lo is rounded down to a query block; rows outside
    [lo, hi) are skipped."""
    if MASK_RIGHT:
        lo = (tl.maximum(start_n - seq.diag - band.right, 0) // BLOCK_M) * BLOCK_M
    else:
        lo = 0
    if MASK_LEFT:
        hi = tl.minimum(seq.seqlen_q, start_n + BLOCK_N - 1 - seq.diag + band.left + 1)
    else:
        hi = seq.seqlen_q
    return lo, hi


@triton.jit
def _streamed_block(block_list, it, BLOCK: tl.constexpr, BLOCK_SKIP: tl.constexpr):
    """First row of the block an inner loop streams at iteration `it` of tl.range(lo, hi, 1 if BLOCK_SKIP else
    BLOCK): `it` itself, or with BLOCK_SKIP the it-th block of the list (Features.block_lists)."""
    if BLOCK_SKIP:
        start = tl.load(block_list + it) * BLOCK
    else:
        start = it
    return start


@triton.jit
def _visible(r_m, r_n, seq, band, MASK_LEFT: tl.constexpr, MASK_RIGHT: tl.constexpr, KEY_BOUND: tl.constexpr):
    """Which (query r_m, key r_n) pairs are inside the band (and, with KEY_BOUND, inside the sequence: the dK/dV
    kernel leaves keys past Sk unmasked, since their rows are never stored). r_m and r_n are index tensors that
    broadcast to the tile ([M, 1] and [1, N], or transposed for the dK/dV kernel)."""
    if MASK_RIGHT:
        vis = r_n <= r_m + (seq.diag + band.right)  # one add on the index vector
        if MASK_LEFT:
            vis = vis & (r_n >= r_m + (seq.diag - band.left))
        if KEY_BOUND:
            vis = vis & (r_n < seq.seqlen_k)
    elif MASK_LEFT:
        vis = r_n >= r_m + (seq.diag - band.left)
        if KEY_BOUND:
            vis = vis & (r_n < seq.seqlen_k)
    else:
        vis = r_n < seq.seqlen_k
    return vis


@triton.jit
def _attention_mask(r_m, r_n, seq, band, mask_tile, MASKED: tl.constexpr, MASK_LEFT: tl.constexpr,
                    MASK_RIGHT: tl.constexpr, BIAS: tl.constexpr, KEY_BOUND: tl.constexpr):
    """The visible pairs of a tile (flash-attn's AttentionMask): the band and the sequence's end in a MASKED stage
    (_visible), and a bool attn_mask tile (`mask_tile`, nonzero = attend) in every stage. Call it only when
    MASKED or BIAS == BIAS_BOOL."""
    if MASKED:
        vis = _visible(r_m, r_n, seq, band, MASK_LEFT, MASK_RIGHT, KEY_BOUND)
        if BIAS == BIAS_BOOL:
            vis = vis & (mask_tile != 0)
    else:
        vis = mask_tile != 0
    return vis


# ----------------------------------------------------------------------------------------------------------------
# Score modifications (docs/derivation.md#8)


@triton.jit
def _tanh(x):
    """tanh from exp2 (no libdevice, so the interpreter runs it too): 1 - 2 / (e^2x + 1), exact at both limits."""
    return 1.0 - 2.0 / (tl.exp2(x * (2.0 * LOG2E)) + 1.0)


@triton.jit
def _tanh_approx(x):
    """The GPU's tanh.approx.f32 (one special-function op, relative error ~2^-11): for 16-bit inputs, whose own
    rounding (2^-8 to 2^-11) dominates it. fp32 and the interpreter use _tanh."""
    return tl.inline_asm_elementwise("tanh.approx.f32 $0, $1;", "=f,f", [x], dtype=tl.float32, is_pure=True, pack=1)


@triton.jit
def _score_mod(b_s, r_m, r_n, scale, slope, bias, diag, FEAT: tl.constexpr):
    """Modified scores from the raw products q.k, in flash-attn's order (docs/derivation.md#8): scale, then
    softcap * tanh(s / softcap), then the ALiBi bias -slope * |i + diag - j|, then an additive float bias (the tile
    `bias`, from _load_bias, when FEAT.BIAS is BIAS_FLOAT). FEAT.SOFTCAP: 0 off, 1 exact tanh, 2 the hardware
    approximation.

    Returns (s, t): s in the units of _score_unit (multiply by it for log2 units; the callers fold that into the
    exp2's fused multiply-add, as the plain path does with scale * log2(e)), and t = tanh(scale q.k / softcap),
    which the backward needs for d softcap(x) / dx = 1 - t^2 (t is s without softcap). With softcap alone s is
    t itself: one multiply per score fewer."""
    if FEAT.SOFTCAP:
        if FEAT.SOFTCAP == 2:
            t = _tanh_approx(b_s * (scale.sm_scale / scale.softcap))
        else:
            t = _tanh(b_s * (scale.sm_scale / scale.softcap))
        if FEAT.HAS_ALIBI or FEAT.BIAS == BIAS_FLOAT:
            s = t * scale.softcap
        else:
            s = t
    else:
        s = b_s * scale.sm_scale
        t = s
    if FEAT.HAS_ALIBI:
        s = s - slope * tl.abs(r_m + diag - r_n).to(tl.float32)
    if FEAT.BIAS == BIAS_FLOAT:
        s = s + bias.to(tl.float32)
    return s, t


@triton.jit
def _score_unit(scale, FEAT: tl.constexpr):
    """log2 units per unit of the scores the kernels take the row max of (> 0, so the max can be taken before
    scaling): scale * log2(e) on the raw products, or _score_mod's unit when a modification is on."""
    if FEAT.SOFTCAP or FEAT.HAS_ALIBI or FEAT.BIAS == BIAS_FLOAT:
        if FEAT.SOFTCAP and not (FEAT.HAS_ALIBI or FEAT.BIAS == BIAS_FLOAT):
            unit = scale.softcap * LOG2E
        else:
            unit = LOG2E + 0.0 * scale.sm_scale
    else:
        unit = scale.qk_scale
    return unit


@triton.jit
def _head_features(alibi, bias, i_b, i_h, seq, FEAT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """What the score modifications need for query head i_h of batch entry i_b: its ALiBi slope (0 without) and
    the BiasView its attn_mask tiles are read through."""
    slope = 0.0
    if FEAT.HAS_ALIBI:
        slope = tl.load(alibi.slopes + i_b * alibi.stride_b + i_h)
    base = bias.ptr + tl.cast(i_b, tl.int64) * bias.strides[0] + tl.cast(i_h, tl.int64) * bias.strides[1]
    handle = _descriptor_or_pointer(base, seq.seqlen_q, seq.seqlen_k, bias.strides[2], BLOCK_M, BLOCK_N,
                                    FEAT.BIAS_TMA)
    return slope, BiasView(handle, seq, bias.strides[2], bias.strides[3])


@triton.jit
def _load_bias(view, start_m, start_n, BIAS_TMA: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
               TRANSPOSE: tl.constexpr):
    """The attn_mask tile of queries [start_m, +BLOCK_M) x keys [start_n, +BLOCK_N) of a BiasView, as
    [BLOCK_M, BLOCK_N] or (TRANSPOSE) [BLOCK_N, BLOCK_M]; outside the sequence it reads 0 (not attended, for a bool
    mask). A TMA load costs no per-element address arithmetic, which at a 128 x 64 tile is otherwise several
    integer ops per score."""
    if BIAS_TMA:
        tile = view.handle.load([start_m, start_n])
        if TRANSPOSE:
            tile = tl.trans(tile)
    else:
        if TRANSPOSE:
            r_m = (start_m + tl.arange(0, BLOCK_M))[None, :]
            r_n = (start_n + tl.arange(0, BLOCK_N))[:, None]
        else:
            r_m = (start_m + tl.arange(0, BLOCK_M))[:, None]
            r_n = (start_n + tl.arange(0, BLOCK_N))[None, :]
        tile = tl.load(view.handle + r_m.to(tl.int64) * view.stride_m + r_n.to(tl.int64) * view.stride_n,
                       mask=(r_m < view.seq.seqlen_q) & (r_n < view.seq.seqlen_k), other=0)
    return tile


@triton.jit
def _block_list(blocks, i_b, i_h, i_r):
    """(pointer to the list, its length) of resident block i_r of head i_h of batch entry i_b (Blocks)."""
    row = i_b * blocks.strides[0] + i_h * blocks.strides[1] + i_r
    return blocks.indices + row.to(tl.int64) * blocks.cols, tl.load(blocks.counts + row)


@triton.jit
def _dropout_keep(seed, i_bh, start_m, start_n, threshold, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                  TRANSPOSE: tl.constexpr):
    """Philox keep-mask of dropout for queries [start_m, +BLOCK_M) x keys [start_n, +BLOCK_N) ([BLOCK_N, BLOCK_M]
    when TRANSPOSE); start_m, start_n, BLOCK_M and BLOCK_N are multiples of 16. One Philox-4x32-10 call under the
    64-bit key `seed` covers the elements {i, i + 8} x {j, j + 8} (bit 3 of i and j clear) of (b, h): its counter is
    (g(j), g(i), b * H + h, 0), g(x) = (x >> 4) * 8 + (x & 7), and output 2 * (bit 3 of i) + (bit 3 of j) goes to
    each; an element is kept iff that output's top 31 bits are >= threshold = round(p * 2^31). The Gluon kernels
    (_gluon.dropout_bits) and reference.dropout.dropout_mask evaluate the same counters and get the same bits."""
    # Queries i = 16 a + 8 b + c and keys j = 16 d + 8 e + f: the calls form a [BLOCK_M // 16, 8, BLOCK_N // 16, 8]
    # grid over (a, c, d, f), and output 2 b + e lands at (a, b, c, d, e, f).
    g_i = (start_m // 16 + tl.arange(0, BLOCK_M // 16))[:, None] * 8 + tl.arange(0, 8)[None, :]
    g_j = (start_n // 16 + tl.arange(0, BLOCK_N // 16))[:, None] * 8 + tl.arange(0, 8)[None, :]
    c1 = (g_i[:, :, None, None] + 0 * g_j[None, None, :, :]).to(tl.uint32, bitcast=True)
    c0 = (g_j[None, None, :, :] + 0 * g_i[:, :, None, None]).to(tl.uint32, bitcast=True)
    c2 = c0 * 0 + i_bh.to(tl.uint32, bitcast=True)
    r0, r1, r2, r3 = philox(seed, c0, c1, c2, c0 * 0)
    # tl.join stacks along a new last dim: the inner joins over e, the outer over b, giving (a, c, d, f, e, b).
    bits = tl.join(tl.join(r0, r1), tl.join(r2, r3))
    if TRANSPOSE:
        bits = tl.reshape(tl.permute(bits, (2, 4, 3, 0, 5, 1)), [BLOCK_N, BLOCK_M])
    else:
        bits = tl.reshape(tl.permute(bits, (0, 5, 1, 2, 4, 3)), [BLOCK_M, BLOCK_N])
    return (bits >> 1).to(tl.int32, bitcast=True) >= threshold
