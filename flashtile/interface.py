"""Public attention functions: flash-attn's `flash_attn_func` and torch's `scaled_dot_product_attention`.

Both validate their arguments, then call the `flashtile::attn_fwd` custom op (flashtile._ops), which runs the
Triton kernels on CUDA tensors and is differentiable.
"""
from . import _ops
from ._validate import check_qkv, not_built, resolve_scale

_FEATURES_ISSUE = "planned: dropout, sliding window, softcap, ALiBi and masks come with the features work"


def _attention(q, k, v, scale, causal, diagonal_offset):
    """The op call both APIs share. The kernels need scale > 0 (they take the row max before scaling); a negative
    scale is the same function of -q with |scale|, and negating is exact (autograd flips dq back)."""
    if scale < 0:
        q, scale = -q, -scale
    elif scale == 0:
        # Every score is 0: uniform attention over the visible keys. Zero scores under any positive scale give it;
        # q * 0 (not a fresh zeros tensor) keeps q in the graph, so q.grad is the exact 0.
        q, scale = q * 0.0, 1.0
    return _ops.attn_fwd(q, k, v, scale, causal, diagonal_offset)


def flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                    alibi_slopes=None, deterministic=False, return_attn_probs=False):
    """Exact attention, flash-attn compatible.

    Arguments:
        q: (batch, seqlen_q, nheads, headdim), float16 / bfloat16 / float32, CUDA (or CPU, see the README).
        k, v: (batch, seqlen_k, nheads_k, headdim). nheads must be a multiple of nheads_k: grouped-query
            attention, query head h uses key/value head h // (nheads // nheads_k) (nheads_k = 1 is MQA).
            headdim: a multiple of 8, at most 256. The last dimension must be contiguous; any other strides work.
        dropout_p: float, default 0.0. Only 0.0 is supported in this version.
        softmax_scale: float, default 1 / sqrt(headdim). Scores are softmax_scale * q @ k^T.
        causal: bool, default False. Query i sees key j iff j <= i + seqlen_k - seqlen_q: the mask is aligned to
            the bottom-right corner. With seqlen_q = 2, seqlen_k = 5:
                1 1 1 1 0
                1 1 1 1 1
            and with seqlen_q = 5, seqlen_k = 2 (rows 0-2 see no key: their output is 0, their LSE -inf):
                0 0
                0 0
                0 0
                1 0
                1 1
        window_size, softcap, alibi_slopes: defaults only ((-1, -1), 0.0, None) in this version; other values
            raise NotImplementedError.
        deterministic: bool, default False. Accepted for compatibility: the backward is always deterministic
            (no atomics).
        return_attn_probs: bool, default False. If True, also return the log-sum-exp and, as flash-attn does
            without dropout, None in place of the dropout mask.

    Returns:
        out: (batch, seqlen_q, nheads, headdim), q's dtype.
        softmax_lse (only if return_attn_probs): (batch, nheads, seqlen_q) float32, natural-log
            logsumexp of each row's scaled scores (-inf for a row that sees no key). It is differentiable.
        S_dmask (only if return_attn_probs): None.
    """
    check_qkv(q, k, v, layout="bshd")
    if dropout_p != 0.0:
        raise not_built(f"dropout (dropout_p={dropout_p})", _FEATURES_ISSUE)
    if not isinstance(window_size, (tuple, list)) or len(window_size) != 2:
        raise TypeError(f"window_size must be a pair (left, right) of ints, -1 meaning unbounded; got "
                        f"{window_size!r}. Use (-1, -1) for full attention.")
    if tuple(window_size) != (-1, -1):
        raise not_built(f"sliding-window attention (window_size={tuple(window_size)})", _FEATURES_ISSUE)
    if softcap != 0.0:
        raise not_built(f"softcap (softcap={softcap})", _FEATURES_ISSUE)
    if alibi_slopes is not None:
        raise not_built("ALiBi (alibi_slopes)", _FEATURES_ISSUE)
    scale = resolve_scale(softmax_scale, q.shape[-1])
    diagonal_offset = k.shape[1] - q.shape[1]  # bottom-right alignment
    out, lse = _attention(q, k, v, scale, bool(causal), diagonal_offset)
    if return_attn_probs:
        return out, lse, None
    return out


def scaled_dot_product_attention(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                                 enable_gqa=False):
    """torch.nn.functional.scaled_dot_product_attention with flashtile's kernels.

    Arguments (torch's names, layout and semantics):
        query: (batch, heads, seqlen_q, headdim); key, value: (batch, heads_kv, seqlen_k, headdim).
        attn_mask: only None in this version (other values raise NotImplementedError).
        dropout_p: only 0.0 in this version.
        is_causal: bool. As in torch, the mask is aligned to the top-left corner: query i sees key j iff j <= i.
            With seqlen_q = 2, seqlen_k = 5:
                1 0 0 0 0
                1 1 0 0 0
        scale: float, default 1 / sqrt(headdim).
        enable_gqa: bool. If False, query and key/value must have the same number of heads; if True, heads must be
            a multiple of heads_kv (query head h uses key/value head h // (heads // heads_kv)).

    Returns: (batch, heads, seqlen_q, headdim) in query's dtype (a transposed view of a (batch, seqlen, heads,
    headdim) buffer, as torch's flash backend returns).
    """
    check_qkv(query, key, value, layout="bhsd")
    if attn_mask is not None:
        raise not_built("attn_mask (bias and boolean masks)", _FEATURES_ISSUE)
    if dropout_p != 0.0:
        raise not_built(f"dropout (dropout_p={dropout_p})", _FEATURES_ISSUE)
    if query.shape[1] != key.shape[1] and not enable_gqa:
        raise ValueError(f"query has {query.shape[1]} heads but key/value have {key.shape[1]}; pass "
                         f"enable_gqa=True for grouped-query attention, or repeat the key/value heads.")
    scale = resolve_scale(scale, query.shape[-1], name="scale")
    q, k, v = (t.transpose(1, 2) for t in (query, key, value))  # views: the kernels take any strides
    out, _ = _attention(q, k, v, scale, bool(is_causal), 0)  # diagonal offset 0: top-left alignment
    return out.transpose(1, 2)
