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

# Compiled kernels may only read globals that are constexpr; host code reads LOG2E.value.
LOG2E = tl.constexpr(1.4426950408889634)  # log2(e): exp(x) = exp2(x * LOG2E), see docs/derivation.md#5-kernel-tricks
LN2 = tl.constexpr(0.6931471805599453)  # ln(2): natural-log LSE = log2-LSE * LN2


def empty(shape, dtype, device):
    """Every buffer a launcher hands to a kernel comes from here (outputs and scratch). The tests replace it with a
    NaN-filled allocation, so an element a kernel fails to write shows up as NaN instead of passing by luck."""
    return torch.empty(shape, dtype=dtype, device=device)


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
def _key_range(start_m, seqlen_q, seqlen_k, diag_offset, IS_CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr,
               BLOCK_N: tl.constexpr):
    """Key ranges for the query block starting at start_m (docs/derivation.md#5-kernel-tricks).

    Keys [0, full_hi) are whole blocks every row of the block sees: no mask. Keys [full_hi, hi) need one: the
    causal diagonal (query i sees key j iff j <= i + diag_offset) and the ragged last block. Keys >= hi are
    invisible to every row and never loaded.
    """
    if IS_CAUSAL:
        last_row = tl.minimum(start_m + BLOCK_M, seqlen_q) - 1
        hi = tl.maximum(tl.minimum(seqlen_k, last_row + diag_offset + 1), 0)
        full_hi = tl.maximum(tl.minimum(seqlen_k, start_m + diag_offset + 1), 0)
    else:
        hi = seqlen_k
        full_hi = seqlen_k
    full_hi = (full_hi // BLOCK_N) * BLOCK_N
    return full_hi, hi


@triton.jit
def _query_start(start_n, diag_offset, IS_CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr):
    """First query block that sees any key of the key block starting at start_n (the transpose of _key_range):
    query i sees key j iff i >= j - diag_offset. Earlier query blocks are skipped."""
    if IS_CAUSAL:
        lo = (tl.maximum(start_n - diag_offset, 0) // BLOCK_M) * BLOCK_M
    else:
        lo = 0
    return lo
