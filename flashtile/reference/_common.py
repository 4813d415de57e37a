"""Argument checks, the causal mask, and head grouping shared by the pure-PyTorch references.

Public layout (flash-attn): q [B, Sq, Hq, D], k [B, Sk, Hk, D], v [B, Sk, Hk, Dv], Hq % Hk == 0.
Internally the references work head-major with the query heads split into groups of G = Hq // Hk that share one
kv head: q -> [B, Hk, G, Sq, D], k/v -> [B, Hk, 1, Sk, D]. Query head h = hk * G + r uses kv head hk = h // G, and
broadcasting over the size-1 group axis of k/v does grouped-query attention without copying K/V.
"""

import math
import numbers
import operator

import torch

# The masking value. exp(-inf) == 0 exactly, so a masked key gets no weight; the price is that a row with no
# visible key has max -inf and -inf - (-inf) is NaN, which every step below guards (see finite_or_zero).
NEG_INF = float("-inf")


def accum_dtype(dtype):
    """Accumulation dtype of the tiled references and the backward: float64 stays float64, everything else float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def check_qkv(q, k, v):
    """Validate q [B, Sq, Hq, D], k [B, Sk, Hk, D], v [B, Sk, Hk, Dv]; return (Sq, Sk, Hk)."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}.")
        if not t.is_floating_point():
            raise TypeError(f"{name} has dtype {t.dtype}; attention needs a floating-point dtype.")
        if t.dim() != 4:
            raise ValueError(f"{name} has shape {tuple(t.shape)}; expected 4 dims (batch, seqlen, heads, headdim) "
                             f"(flash-attn layout; transpose(1, 2) an SDPA-layout tensor).")
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"q, k, v have dtypes {q.dtype}, {k.dtype}, {v.dtype}; cast them to one dtype.")
    b, sq, hq, d = q.shape
    bk, sk, hk, dk = k.shape
    if k.shape[:3] != v.shape[:3]:
        raise ValueError(f"k has shape {tuple(k.shape)} and v {tuple(v.shape)}; they must agree in batch, seqlen "
                         f"and heads.")
    if bk != b:
        raise ValueError(f"q has batch {b} but k/v have batch {bk}; they must match.")
    if dk != d:
        raise ValueError(f"q has head dim {d} but k has {dk}; q and k must share the head dim.")
    if hk == 0 or hq % hk != 0:
        raise ValueError(f"q has {hq} heads but k/v have {hk}; the number of query heads must be a multiple of the "
                         f"number of key/value heads (grouped-query attention).")
    return sq, sk, hk


def check_rows(name, t, shape):
    """Validate a per-row tensor such as lse [B, Hq, Sq] or a per-element one such as dout [B, Sq, Hq, Dv]."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}.")
    if tuple(t.shape) != tuple(shape):
        raise ValueError(f"{name} has shape {tuple(t.shape)}; expected {tuple(shape)}.")


def check_backward_rows(q, v, out, dout, lse, dlse):
    """Shapes of the backward's per-row inputs: out, dout (B, Sq, Hq, Dv); lse, dlse (B, Hq, Sq)."""
    b, sq, hq, _ = q.shape
    dv_dim = v.shape[-1]
    check_rows("out", out, (b, sq, hq, dv_dim))
    check_rows("dout", dout, (b, sq, hq, dv_dim))
    check_rows("lse", lse, (b, hq, sq))
    if dlse is not None:
        check_rows("dlse", dlse, (b, hq, sq))


def check_blocks(block_m, block_n):
    for name, value in (("block_m", block_m), ("block_n", block_n)):
        if not isinstance(value, numbers.Integral) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name}={value!r}; tile sizes must be positive integers.")


def resolve_scale(softmax_scale, head_dim):
    if softmax_scale is None:
        return 1.0 / math.sqrt(head_dim)
    if not isinstance(softmax_scale, numbers.Real) or isinstance(softmax_scale, bool):
        raise TypeError(f"softmax_scale={softmax_scale!r}; pass a Python number or None for 1/sqrt(head_dim).")
    return float(softmax_scale)


def resolve_offset(causal, diagonal_offset, sq, sk):
    """The causal diagonal offset, or None when there is no mask. None with causal=True means sk - sq."""
    if not causal:
        return None
    if diagonal_offset is None:
        return sk - sq
    if not isinstance(diagonal_offset, numbers.Integral) or isinstance(diagonal_offset, bool):
        raise TypeError(f"diagonal_offset={diagonal_offset!r}; pass an int (query i sees key j iff "
                        f"j <= i + diagonal_offset) or None for bottom-right alignment.")
    return int(diagonal_offset)


def _as_int(value):
    """value as a Python int if it is an integer (Python, NumPy or 0-d torch int; not bool), else None."""
    if isinstance(value, bool):
        return None
    try:
        return operator.index(value)
    except TypeError:
        return None


def resolve_window(window_size):
    """(left, right) from window_size: two ints >= -1, -1 meaning unbounded on that side."""
    try:
        left, right = window_size
    except (TypeError, ValueError):
        raise TypeError(f"window_size={window_size!r}; pass a pair (left, right) of ints, -1 for an unbounded side "
                        f"(default (-1, -1): no window).") from None
    sides = []
    for side, value in (("left", left), ("right", right)):
        as_int = _as_int(value)
        if as_int is None:
            raise TypeError(f"window_size={window_size!r}: its {side} entry {value!r} is not an int; pass ints "
                            f"(left, right), -1 for an unbounded side.")
        if as_int < -1:
            raise ValueError(f"window_size={window_size!r}: its {side} entry is {as_int}; each side is a number of "
                             f"keys >= 0, or -1 for unbounded.")
        sides.append(as_int)
    return tuple(sides)


def band_mask(seqlen_q, seqlen_k, diagonal_offset, causal, window, device=None):
    """Bool [seqlen_q, seqlen_k], True where query i sees key j under the causal mask and the local window, or None
    when neither applies. With (left, right) = window and off = diagonal_offset:

        causal:  j <= i + off
        window:  (left < 0 or j >= i + off - left) and (right < 0 or j <= i + off + right)

    Both apply when both are given (causal is the window's right = 0). With Sq = 3, Sk = 5, window (1, 0):

            0 1 1 0 0
            0 0 1 1 0
            0 0 0 1 1
    """
    left, right = window
    if not causal and left < 0 and right < 0:
        return None
    rel = _relative(0, seqlen_q, 0, seqlen_k, device)                         # j - i
    visible = torch.ones(seqlen_q, seqlen_k, dtype=torch.bool, device=device)
    if causal:
        visible &= rel <= _clamp_rel(diagonal_offset, seqlen_q, seqlen_k)
    if left >= 0:
        visible &= rel >= _clamp_rel(diagonal_offset - left, seqlen_q, seqlen_k)
    if right >= 0:
        visible &= rel <= _clamp_rel(diagonal_offset + right, seqlen_q, seqlen_k)
    return visible


def _relative(i0, i1, j0, j1, device):
    """[i1 - i0, j1 - j0] of j - i: the masks compare it with bounds rather than add a bound to i, so that no window
    or offset (any Python int, 2**63 - 1 included) can overflow int64."""
    return torch.arange(j0, j1, device=device)[None, :] - torch.arange(i0, i1, device=device)[:, None]


def _clamp_rel(bound, rows, cols):
    """A bound on j - i (a Python int of any size) clamped into [-rows, cols], just past the values j - i takes for
    i < rows, j < cols: every comparison with it comes out the same."""
    return max(-rows, min(cols, bound))


def causal_block_mask(i0, i1, j0, j1, diagonal_offset, device=None):
    """Bool [i1 - i0, j1 - j0], True where query i in [i0, i1) sees key j in [j0, j1): j <= i + diagonal_offset."""
    return _relative(i0, i1, j0, j1, device) <= _clamp_rel(diagonal_offset, i1, j1)


def causal_mask(seqlen_q, seqlen_k, diagonal_offset=None, *, device=None):
    """Bool [seqlen_q, seqlen_k], True where query i sees key j, i.e. j <= i + diagonal_offset.

    diagonal_offset=None aligns the diagonal to the bottom-right corner (offset seqlen_k - seqlen_q, flash-attn);
    0 aligns it to the top-left (torch SDPA's is_causal). With seqlen_q = 2, seqlen_k = 5:

        bottom-right (None)     top-left (0)
            1 1 1 1 0            1 0 0 0 0
            1 1 1 1 1            1 1 0 0 0

    With seqlen_q = 5, seqlen_k = 2 bottom-right, rows 0-2 see no key at all (their output is 0, their LSE -inf):

            0 0
            0 0
            0 0
            1 0
            1 1
    """
    offset = resolve_offset(True, diagonal_offset, seqlen_q, seqlen_k)
    return causal_block_mask(0, seqlen_q, 0, seqlen_k, offset, device)


def finite_or_zero(m):
    """Running max with -inf (no visible key yet) replaced by 0, used as the shift in exp(s - m).

    Every s in such a row is -inf, so exp(s - 0) == 0 as it should be, where exp(-inf - (-inf)) would be NaN.
    """
    return m.masked_fill(m == NEG_INF, 0.0)


def group_q(x, hk, dtype):
    """[B, S, Hq, D] -> [B, Hk, G, S, D] in dtype (q, out, dout)."""
    return x.to(dtype).transpose(1, 2).unflatten(1, (hk, -1))


def group_kv(x, dtype):
    """[B, S, Hk, D] -> [B, Hk, 1, S, D] in dtype (k, v)."""
    return x.to(dtype).transpose(1, 2).unsqueeze(2)


def group_rows(x, hk, dtype):
    """[B, Hq, S] -> [B, Hk, G, S] in dtype (lse, dlse)."""
    return x.to(dtype).unflatten(1, (hk, -1))


def ungroup_q(x, dtype):
    """[B, Hk, G, S, D] -> contiguous [B, S, Hq, D] in dtype."""
    return x.flatten(1, 2).transpose(1, 2).to(dtype).contiguous()


def ungroup_kv(x, dtype):
    """[B, Hk, 1, S, D] (already summed over the group) -> contiguous [B, S, Hk, D] in dtype."""
    return x.squeeze(2).transpose(1, 2).to(dtype).contiguous()


def ungroup_rows(x, dtype):
    """[B, Hk, G, S] -> contiguous [B, Hq, S] in dtype."""
    return x.flatten(1, 2).to(dtype).contiguous()
