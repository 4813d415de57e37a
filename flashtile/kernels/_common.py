"""Pieces every attention kernel shares: constants, tile loads/stores, the matmul wrapper, the causal ranges.

Tensor layout in every kernel file: q, out: [B, Sq, Hq, D]; k, v: [B, Sk, Hk, D]; lse: [B, Hq, Sq].
A tile is BLOCK_R rows of one (batch, head) slice with the head dim padded to BLOCK_D (a power of two).

Two ways to reach memory, chosen per launch by the constexpr USE_TMA:
- TMA tensor descriptors built on the device (Hopper and newer, 16-byte aligned base and strides): the copy
  engine does the address arithmetic and zero-fills rows/columns outside the tensor, so ragged edges cost nothing.
- Plain pointers with masks: any GPU, any strides, and what the interpreter tests by default.
"""
import torch
import triton
import triton.language as tl
from triton.language.random import philox

# Compiled kernels may only read globals that are constexpr; host code reads LOG2E.value.
LOG2E = tl.constexpr(1.4426950408889634)  # log2(e): exp(x) = exp2(x * LOG2E), see docs/derivation.md#5-kernel-tricks
LN2 = tl.constexpr(0.6931471805599453)  # ln(2): natural-log LSE = log2-LSE * LN2


def empty(shape, dtype, device):
    """Every buffer a launcher hands to a kernel comes from here (outputs and scratch). The tests replace it with a
    NaN-filled allocation, so an element a kernel fails to write shows up as NaN instead of passing by luck."""
    return torch.empty(shape, dtype=dtype, device=device)


@triton.jit
def _slice_base(ptr, i_b, row0, i_h, stride_b, stride_s, stride_h):
    """Start of the (batch i_b, head i_h) slice, from sequence row row0 on (a varlen sequence's first row, else 0).
    int64 before multiplying by strides: B * S * H * D may pass 2^31 elements."""
    return (ptr + tl.cast(i_b, tl.int64) * stride_b + tl.cast(row0, tl.int64) * stride_s
            + tl.cast(i_h, tl.int64) * stride_h)


@triton.jit
def _seq_bounds(CuSeqQ, CuSeqK, i_b, seqlen_q, seqlen_k, diag_offset, VARLEN: tl.constexpr):
    """(q_start, k_start, seqlen_q, seqlen_k, diag_offset) of batch entry i_b: a varlen sequence's rows in the
    packed tensors (sequence b is rows [cu[b], cu[b + 1])) and its own bottom-right offset, or the fixed-length
    launch's values."""
    if VARLEN:
        q_start = tl.load(CuSeqQ + i_b)
        seqlen_q = tl.load(CuSeqQ + i_b + 1) - q_start
        k_start = tl.load(CuSeqK + i_b)
        seqlen_k = tl.load(CuSeqK + i_b + 1) - k_start
        diag_offset = seqlen_k - seqlen_q
    else:
        q_start = 0
        k_start = 0
    return q_start, k_start, seqlen_q, seqlen_k, diag_offset


@triton.jit
def _tile_view(base, rows, stride_row, HEAD_DIM: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr,
               USE_TMA: tl.constexpr):
    """The handle tiles of one (batch, head) slice are read through: a descriptor, or the base pointer itself."""
    if USE_TMA:
        view = tl.make_tensor_descriptor(base, shape=[rows, HEAD_DIM], strides=[stride_row, 1],
                                         block_shape=[BLOCK_R, BLOCK_D])
    else:
        view = base
    return view


@triton.jit
def _load_tile(view, start, rows, stride_row, HEAD_DIM: tl.constexpr, BLOCK_R: tl.constexpr,
               BLOCK_D: tl.constexpr, USE_TMA: tl.constexpr):
    """Rows [start, start + BLOCK_R) of a slice; rows >= `rows` and columns >= HEAD_DIM read as 0."""
    if USE_TMA:
        tile = view.load([start, 0])
    else:
        o_r = tl.arange(0, BLOCK_R)
        o_d = tl.arange(0, BLOCK_D)
        # The row offset goes through int64 once, so S * stride past 2^31 elements does not wrap.
        p_tile = view + tl.cast(start, tl.int64) * stride_row + o_r[:, None] * stride_row + o_d[None, :]
        tile = tl.load(p_tile, mask=((start + o_r)[:, None] < rows) & (o_d[None, :] < HEAD_DIM), other=0.0)
    return tile


@triton.jit
def _store_tile(view, tile, start, rows, stride_row, HEAD_DIM: tl.constexpr, BLOCK_R: tl.constexpr,
                BLOCK_D: tl.constexpr, USE_TMA: tl.constexpr):
    """Write a tile back; what falls outside the slice is dropped."""
    if USE_TMA:
        view.store([start, 0], tile)
    else:
        o_r = tl.arange(0, BLOCK_R)
        o_d = tl.arange(0, BLOCK_D)
        p_tile = view + tl.cast(start, tl.int64) * stride_row + o_r[:, None] * stride_row + o_d[None, :]
        tl.store(p_tile, tile, mask=((start + o_r)[:, None] < rows) & (o_d[None, :] < HEAD_DIM))


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


@triton.jit
def _key_range(start_m, seqlen_q, seqlen_k, diag_offset, window_left, window_right,
               MASK_LEFT: tl.constexpr, MASK_RIGHT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Key ranges for the query block starting at start_m (docs/derivation.md#5-kernel-tricks and #8).

    Query i sees key j iff j <= i + diag_offset + window_right (MASK_RIGHT; causal is window_right = 0) and
    j >= i + diag_offset - window_left (MASK_LEFT). Returns (lo, full_lo, full_hi, hi):
    keys [full_lo, full_hi) are whole blocks every row of the block sees (no mask); [lo, full_lo) and
    [full_hi, hi) need the mask (the band's edges and the ragged last block); keys outside [lo, hi) are invisible
    to every row and never loaded. The masked stages are [lo, min(full_lo, hi)) and [max(full_lo, full_hi), hi),
    which together with the unmasked one cover [lo, hi) exactly once whatever the order of full_lo and full_hi.
    """
    last_row = tl.minimum(start_m + BLOCK_M, seqlen_q) - 1
    if MASK_RIGHT:
        hi = tl.maximum(tl.minimum(seqlen_k, last_row + diag_offset + window_right + 1), 0)
        full_hi = tl.maximum(tl.minimum(seqlen_k, start_m + diag_offset + window_right + 1), 0)
    else:
        hi = seqlen_k
        full_hi = seqlen_k
    full_hi = (full_hi // BLOCK_N) * BLOCK_N
    if MASK_LEFT:
        lo = (tl.maximum(start_m + diag_offset - window_left, 0) // BLOCK_N) * BLOCK_N
        full_lo = tl.cdiv(tl.maximum(last_row + diag_offset - window_left, 0), BLOCK_N) * BLOCK_N
    else:
        lo = 0
        full_lo = 0
    return lo, full_lo, full_hi, hi


@triton.jit
def _query_range(start_n, seqlen_q, diag_offset, window_left, window_right,
                 MASK_LEFT: tl.constexpr, MASK_RIGHT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Query rows [lo, hi) that see any key of the key block starting at start_n (the transpose of _key_range):
    query i sees key j iff j - diag_offset - window_right <= i <= j - diag_offset + window_left. lo is rounded
    down to a query block; rows outside [lo, hi) are skipped."""
    if MASK_RIGHT:
        lo = (tl.maximum(start_n - diag_offset - window_right, 0) // BLOCK_M) * BLOCK_M
    else:
        lo = 0
    if MASK_LEFT:
        hi = tl.minimum(seqlen_q, start_n + BLOCK_N - 1 - diag_offset + window_left + 1)
    else:
        hi = seqlen_q
    return lo, hi


@triton.jit
def _visible(r_m, r_n, seqlen_k, diag_offset, window_left, window_right,
             MASK_LEFT: tl.constexpr, MASK_RIGHT: tl.constexpr, KEY_BOUND: tl.constexpr):
    """Which (query r_m, key r_n) pairs are inside the band (and, with KEY_BOUND, inside the sequence: the dK/dV
    kernel leaves keys past Sk unmasked, since their rows are never stored). r_m and r_n are index tensors that
    broadcast to the tile ([M, 1] and [1, N], or transposed for the dK/dV kernel)."""
    if MASK_RIGHT:
        vis = r_n <= r_m + (diag_offset + window_right)  # one add on the index vector
        if MASK_LEFT:
            vis = vis & (r_n >= r_m + (diag_offset - window_left))
        if KEY_BOUND:
            vis = vis & (r_n < seqlen_k)
    elif MASK_LEFT:
        vis = r_n >= r_m + (diag_offset - window_left)
        if KEY_BOUND:
            vis = vis & (r_n < seqlen_k)
    else:
        vis = r_n < seqlen_k
    return vis


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
def _score_mod(b_s, r_m, r_n, sm_scale, softcap, slope, bias, diag_offset, SOFTCAP: tl.constexpr,
               HAS_ALIBI: tl.constexpr, BIAS: tl.constexpr):
    """Modified scores from the raw products q.k, in flash-attn's order (docs/derivation.md#8): scale, then
    softcap * tanh(s / softcap), then the ALiBi bias -slope * |i + diag_offset - j|, then an additive float bias
    (the tile `bias`, from _load_bias, when BIAS is a float kind). SOFTCAP: 0 off, 1 exact tanh, 2 the hardware
    approximation.

    Returns (s, t): s in the units of _mod_unit (multiply by it for log2 units; the callers fold that into the
    exp2's fused multiply-add, as the plain path does with scale * log2(e)), and t = tanh(scale q.k / softcap),
    which the backward needs for d softcap(x) / dx = 1 - t^2 (t is s without softcap). With softcap alone s is
    t itself: one multiply per score fewer."""
    if SOFTCAP:
        if SOFTCAP == 2:
            t = _tanh_approx(b_s * (sm_scale / softcap))
        else:
            t = _tanh(b_s * (sm_scale / softcap))
        if HAS_ALIBI or BIAS % 2 == 1:
            s = t * softcap
        else:
            s = t
    else:
        s = b_s * sm_scale
        t = s
    if HAS_ALIBI:
        s = s - slope * tl.abs(r_m + diag_offset - r_n).to(tl.float32)
    if BIAS % 2 == 1:
        s = s + bias.to(tl.float32)
    return s, t


@triton.jit
def _mod_unit(sm_scale, softcap, SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr, BIAS: tl.constexpr):
    """log2 units per unit of _score_mod's scores (> 0, so a row max can be taken before scaling)."""
    if SOFTCAP and not (HAS_ALIBI or BIAS % 2 == 1):
        unit = softcap * LOG2E
    else:
        unit = LOG2E + 0.0 * sm_scale
    return unit


# BIAS constexpr of the kernels: what attn_mask holds and how its tiles are read.
#   0 none; 1 float bias, 2 bool mask (pointer loads); 3 float bias, 4 bool mask (TMA descriptor loads).
# Odd: a float bias; even and > 0: a bool mask; >= 3: TMA.

@triton.jit
def _bias_view(p_bias, seqlen_q, seqlen_k, stride_bias_m, BIAS: tl.constexpr, BLOCK_M: tl.constexpr,
               BLOCK_N: tl.constexpr):
    """The handle attn_mask tiles of one (batch, head) are read through: a descriptor or the pointer itself."""
    if BIAS >= 3:
        view = tl.make_tensor_descriptor(p_bias, shape=[seqlen_q, seqlen_k], strides=[stride_bias_m, 1],
                                         block_shape=[BLOCK_M, BLOCK_N])
    else:
        view = p_bias
    return view


@triton.jit
def _head_features(Alibi, Bias, i_b, i_h, stride_alibi_b, stride_bias_b, stride_bias_h, stride_bias_m, seqlen_q,
                   seqlen_k, HAS_ALIBI: tl.constexpr, BIAS: tl.constexpr, BLOCK_M: tl.constexpr,
                   BLOCK_N: tl.constexpr):
    """What the score modifications need for query head i_h of batch entry i_b: its ALiBi slope (0 without) and
    the view its attn_mask tiles are read through."""
    slope = 0.0
    if HAS_ALIBI:
        slope = tl.load(Alibi + i_b * stride_alibi_b + i_h)
    p_bias = _bias_view(Bias + tl.cast(i_b, tl.int64) * stride_bias_b + tl.cast(i_h, tl.int64) * stride_bias_h,
                        seqlen_q, seqlen_k, stride_bias_m, BIAS, BLOCK_M, BLOCK_N)
    return slope, p_bias


@triton.jit
def _load_bias(view, start_m, start_n, seqlen_q, seqlen_k, stride_bias_m, stride_bias_n, BIAS: tl.constexpr,
               BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, TRANSPOSE: tl.constexpr):
    """The attn_mask tile of queries [start_m, +BLOCK_M) x keys [start_n, +BLOCK_N), as [BLOCK_M, BLOCK_N] or
    (TRANSPOSE) [BLOCK_N, BLOCK_M]; outside the sequence it reads 0 (not attended, for a bool mask). A TMA load
    costs no per-element address arithmetic, which at a 128 x 64 tile is otherwise several integer ops per score."""
    if BIAS >= 3:
        tile = view.load([start_m, start_n])
        if TRANSPOSE:
            tile = tl.trans(tile)
    else:
        if TRANSPOSE:
            r_m = (start_m + tl.arange(0, BLOCK_M))[None, :]
            r_n = (start_n + tl.arange(0, BLOCK_N))[:, None]
        else:
            r_m = (start_m + tl.arange(0, BLOCK_M))[:, None]
            r_n = (start_n + tl.arange(0, BLOCK_N))[None, :]
        tile = tl.load(view + r_m.to(tl.int64) * stride_bias_m + r_n.to(tl.int64) * stride_bias_n,
                       mask=(r_m < seqlen_q) & (r_n < seqlen_k), other=0)
    return tile


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
