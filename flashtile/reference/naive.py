"""Naive attention and its dense backward: the oracle every test compares against (docs/derivation.md, ch. 1, 6, 8).

# q: [B, Sq, Hq, D]   k: [B, Sk, Hk, D]   v: [B, Sk, Hk, Dv]   out: [B, Sq, Hq, Dv]   lse: [B, Hq, Sq]
# varlen: q [total_q, Hq, D]   k, v [total_k, Hk, D]   out [total_q, Hq, Dv]   lse [Hq, total_q]
"""

import numbers

import torch

from ._common import (NEG_INF, accum_dtype, band_mask, check_backward_rows, check_qkv, finite_or_zero,
                      group_kv, group_q, group_rows, resolve_offset, resolve_scale, resolve_window, ungroup_kv,
                      ungroup_q, ungroup_rows)


def _check_number(name, value, low, high, hint):
    """A real Python number in [low, high) (high None: no upper bound); returns it as float."""
    if not isinstance(value, numbers.Real) or isinstance(value, bool):
        raise TypeError(f"{name}={value!r}; pass a Python number ({hint}).")
    value = float(value)
    if not (low <= value and (high is None or value < high)):
        raise ValueError(f"{name}={value!r} is out of range; {hint}.")
    return value


def _check_tensor(name, t, *, bool_dtype):
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor or None, got {type(t).__name__}.")
    if bool_dtype and t.dtype != torch.bool:
        raise TypeError(f"{name} has dtype {t.dtype}; it must be torch.bool (True = keep)"
                        + (". For an additive float mask pass attn_bias instead." if name == "attn_mask" else "."))
    if not bool_dtype and not t.is_floating_point():
        raise TypeError(f"{name} has dtype {t.dtype}; it must be a floating-point tensor (float32 is usual).")


def _check_broadcast(name, t, shape):
    """t must broadcast to shape = (B, Hq, Sq, Sk) the way torch SDPA's attn_mask does: at most 4 dims, aligned at
    the right, each of size 1 or equal to the target."""
    target = "(batch, heads, seqlen_q, seqlen_k) = " + str(tuple(shape))
    if t.dim() > 4 or any(n not in (1, m) for n, m in zip(t.shape[::-1], shape[::-1])):
        raise ValueError(f"{name} has shape {tuple(t.shape)}, which does not broadcast to {target}; give each of "
                         f"those dims its full size or 1 (fewer dims count from the right, e.g. (seqlen_q, "
                         f"seqlen_k)).")


def _check_exact(name, t, shapes, names):
    if tuple(t.shape) not in [tuple(s) for s in shapes]:
        raise ValueError(f"{name} has shape {tuple(t.shape)}; expected " + " or ".join(
            f"{n} = {tuple(s)}" for n, s in zip(names, shapes)) + ".")


def _group_heads(x, hk):
    """[B|1, Hq|1, Sq|1, Sk|1] (anything broadcastable to [B, Hq, Sq, Sk], 4 dims) -> [B|1, Hk|1, G|1, Sq|1, Sk|1],
    matching the grouped score layout [B, Hk, G, Sq, Sk]: query head h = hk * G + r."""
    return x.unflatten(1, (hk, -1)) if x.shape[1] != 1 else x.unsqueeze(2)


def _as_4d(x):
    return x.reshape((1,) * (4 - x.dim()) + tuple(x.shape))


def _modified_scores(qg, kg, scale, offset, causal, window, softcap, alibi_slopes, attn_bias, attn_mask):
    """S of grouped q, k ([B, Hk, G, Sq, D], [B, Hk, 1, Sk, D]) with the score modifications and masks of
    naive_attention, in qg's dtype: [B, Hk, G, Sq, Sk], masked entries -inf. Also returns tanh(scale q k^T /
    softcap) (None without softcap), which the backward needs."""
    hk, hq = qg.shape[1], qg.shape[1] * qg.shape[2]
    sq, sk, dtype, device = qg.shape[3], kg.shape[3], qg.dtype, qg.device
    s = scale * (qg @ kg.mT)                                                 # [B, Hk, G, Sq, Sk]
    t = None
    if softcap > 0:
        t = torch.tanh(s / softcap)
        s = softcap * t
    if alibi_slopes is not None:
        rel = torch.arange(sk, device=device)[None, :] - torch.arange(sq, device=device)[:, None]   # j - i
        distance = (float(offset) - rel.double()).abs().to(dtype)            # |i + off - j|, [Sq, Sk]
        slopes = alibi_slopes.to(dtype).reshape(-1, hq, 1, 1)                # [B|1, Hq, 1, 1]
        s = s - _group_heads(slopes, hk) * distance
    if attn_bias is not None:
        s = s + _group_heads(_as_4d(attn_bias.to(dtype)), hk)
    visible = band_mask(sq, sk, offset, causal, window, device=device)       # [Sq, Sk] or None
    if attn_mask is not None:
        keep = _group_heads(_as_4d(attn_mask), hk)
        visible = keep if visible is None else keep & visible
    if visible is not None:
        s = s.masked_fill(~visible, NEG_INF)
    return s, t


def naive_attention(q, k, v, *, softmax_scale=None, causal=False, diagonal_offset=None, window_size=(-1, -1),
                    softcap=0.0, alibi_slopes=None, attn_bias=None, attn_mask=None, sinks=None, dropout_p=0.0,
                    dropout_mask=None):
    """Attention with the full score matrix materialised: S = scale * q k^T, modify and mask S, P = softmax(S),
    out = P v.

    Args:
        q: [B, Sq, Hq, D]. k: [B, Sk, Hk, D]. v: [B, Sk, Hk, Dv]. Hq must be a multiple of Hk (grouped-query
            attention: query head h uses kv head h // (Hq // Hk)).
        softmax_scale: multiplies q k^T; default None means 1 / sqrt(D).
        causal: default False. When True, query i sees key j iff j <= i + diagonal_offset.
        diagonal_offset: default None means Sk - Sq, the bottom-right alignment of flash-attn; 0 is top-left
            (torch SDPA). It places the diagonal that causal, window_size and alibi_slopes measure from, and is
            ignored when none of them is used. With Sq = 2, Sk = 5 and the default, causal is:
                1 1 1 1 0
                1 1 1 1 1
        window_size: (left, right), default (-1, -1). Local attention: query i sees key j iff
            i + off - left <= j <= i + off + right (off = diagonal_offset), inclusive; -1 leaves that side
            unbounded. Combines with causal (both apply). With Sq = Sk = 4 and window (1, 0):
                1 0 0 0
                1 1 0 0
                0 1 1 0
                0 0 1 1
        softcap: default 0.0 (off). When > 0, S = softcap * tanh(S / softcap) before anything else is added.
        alibi_slopes: [Hq] or [B, Hq], default None. Adds -slope_h * |i + off - j| to S.
        attn_bias: float tensor broadcastable to [B, Hq, Sq, Sk] (torch SDPA rules: any dim may be 1, fewer dims
            count from the right), default None. Added to S; differentiable.
        attn_mask: bool tensor broadcastable to [B, Hq, Sq, Sk], default None. False hides the key (torch SDPA's
            convention).
        sinks: [Hq], default None. Per-head logits in the units of S that join every row's softmax denominator
            (gpt-oss attention sinks): lse_i = log(sum_j exp S_ij + exp sink_h), P_ij = exp(S_ij - lse_i). The sink
            has no value row, so the output weights sum to less than 1. Differentiable.
        dropout_p: default 0.0. Probability of dropping an entry of P; needs dropout_mask when > 0 (this reference
            draws no random numbers).
        dropout_mask: bool [B, Hq, Sq, Sk], True = kept, default None. out = (P * mask / (1 - dropout_p)) v; lse is
            not affected. Applied whenever given, also with dropout_p = 0 (then with scale 1).

    The order is: softcap, ALiBi, attn_bias, then attn_mask, causal and window set S to -inf (docs/derivation.md,
    ch. 8). Masking comes last, so a masked entry is -inf whatever was added to it.

    Returns:
        out [B, Sq, Hq, Dv] in q.dtype, and lse [B, Hq, Sq] = log(sum_j exp S_ij [+ exp sink]) (natural log),
        float64 for float64 inputs and float32 otherwise. A row that sees no key gets out 0 and lse -inf (lse = sink
        with sinks), and zero gradients through out; nothing is NaN, gradients included.

    Everything up to the final log runs in q.dtype (bias, slopes and sinks are cast to it): float64 inputs give the
    oracle, bf16/fp16 inputs give "plain PyTorch in that dtype", the baseline error the kernels are judged against.
    """
    sq, sk, hk = check_qkv(q, k, v)
    b, hq = q.shape[0], q.shape[2]
    scores_shape = (b, hq, sq, sk)
    scale = resolve_scale(softmax_scale, q.shape[-1])
    window = resolve_window(window_size)
    windowed = window != (-1, -1)
    offset = resolve_offset(causal or windowed or alibi_slopes is not None, diagonal_offset, sq, sk)
    softcap = _check_number("softcap", softcap, 0.0, float("inf"), "0 turns it off, > 0 caps scores to "
                            "(-softcap, softcap)")
    dropout_p = _check_number("dropout_p", dropout_p, 0.0, 1.0, "it is a probability in [0, 1)")
    if alibi_slopes is not None:
        _check_tensor("alibi_slopes", alibi_slopes, bool_dtype=False)
        _check_exact("alibi_slopes", alibi_slopes, [(hq,), (b, hq)], ["(heads,)", "(batch, heads)"])
    if attn_bias is not None:
        _check_tensor("attn_bias", attn_bias, bool_dtype=False)
        _check_broadcast("attn_bias", attn_bias, scores_shape)
    if attn_mask is not None:
        _check_tensor("attn_mask", attn_mask, bool_dtype=True)
        _check_broadcast("attn_mask", attn_mask, scores_shape)
    if sinks is not None:
        _check_tensor("sinks", sinks, bool_dtype=False)
        _check_exact("sinks", sinks, [(hq,)], ["(heads,)"])
    if dropout_mask is not None:
        _check_tensor("dropout_mask", dropout_mask, bool_dtype=True)
        _check_exact("dropout_mask", dropout_mask, [scores_shape], ["(batch, heads, seqlen_q, seqlen_k)"])
    elif dropout_p > 0:
        raise ValueError(f"dropout_p={dropout_p} needs dropout_mask, a bool (batch, heads, seqlen_q, seqlen_k) "
                         f"keep-mask: the reference draws no random numbers. Pass the mask the kernel used, or "
                         f"dropout_p=0.")

    dtype, lse_dtype = q.dtype, accum_dtype(q.dtype)
    qg, kg, vg = group_q(q, hk, dtype), group_kv(k, dtype), group_kv(v, dtype)

    s, _ = _modified_scores(qg, kg, scale, offset, causal, window, softcap, alibi_slopes, attn_bias, attn_mask)

    # Safe softmax (ch. 2). The max only shifts S and cancels in P and in lse, so it carries no gradient: detaching
    # it keeps autograd out of amax, whose backward would see the ties of an all -inf row.
    if sk > 0:
        m = s.detach().amax(dim=-1, keepdim=True)                            # [B, Hk, G, Sq, 1]
    else:
        m = s.new_full(s.shape[:-1] + (1,), NEG_INF)
    if sinks is not None:
        sink = _group_heads(sinks.to(dtype).reshape(1, hq, 1, 1), hk)        # [1, Hk, G, 1, 1]
        m = torch.maximum(m, sink.detach())                                  # the sink is one more column of S
    m = finite_or_zero(m)
    p = torch.exp(s - m)                                                     # unnormalised P, masked keys -> 0
    l = p.sum(dim=-1, keepdim=True)
    if sinks is not None:
        l = l + torch.exp(sink - m)
    # A row with no visible key (and no sink) has l == 0: divide and take the log of 1 instead, so neither the value
    # nor the gradient (1/l) can become NaN, and write 0 / -inf explicitly.
    seen = l > 0
    l_safe = torch.where(seen, l, torch.ones_like(l))
    probs = p / l_safe
    if dropout_mask is not None:
        # Dropout acts on P after normalisation (ch. 8): lse, hence the softmax itself, does not see it.
        probs = probs.masked_fill(~_group_heads(dropout_mask, hk), 0.0) / (1.0 - dropout_p)
    out = probs @ vg                                                         # [B, Hk, G, Sq, Dv]
    lse = torch.where(seen, m.to(lse_dtype) + torch.log(l_safe.to(lse_dtype)), NEG_INF).squeeze(-1)
    return ungroup_q(out, dtype), ungroup_rows(lse, lse_dtype)


def _check_cu_seqlens(name, cu, total):
    if not isinstance(cu, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(cu).__name__}.")
    if cu.dtype != torch.int32:
        raise TypeError(f"{name} has dtype {cu.dtype}; it must be torch.int32 (flash-attn's varlen convention): "
                        f"convert it with .to(torch.int32).")
    if cu.dim() != 1 or cu.numel() < 1:
        raise ValueError(f"{name} has shape {tuple(cu.shape)}; expected (batch + 1,), the cumulative sequence "
                         f"lengths starting at 0.")
    bounds = cu.tolist()
    if bounds[0] != 0 or any(a > b for a, b in zip(bounds[:-1], bounds[1:])) or bounds[-1] != total:
        raise ValueError(f"{name}={bounds}; it must start at 0, never decrease, and end at the number of tokens "
                         f"{total}.")
    return bounds


def naive_attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, *, softmax_scale=None, causal=False,
                           diagonal_offset=None, window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                           attn_bias=None, attn_mask=None, sinks=None, dropout_p=0.0, dropout_mask=None):
    """naive_attention over a packed batch of variable-length sequences, one sequence at a time.

    Sequence b is q[cu_seqlens_q[b]:cu_seqlens_q[b + 1]] against k, v[cu_seqlens_k[b]:cu_seqlens_k[b + 1]]; its
    causal diagonal (and window and ALiBi) is aligned to its own bottom-right corner unless diagonal_offset is given,
    which then applies to every sequence. Sequences of length 0 (q or k) are allowed.

    Args:
        q: [total_q, Hq, D]. k: [total_k, Hk, D]. v: [total_k, Hk, Dv].
        cu_seqlens_q, cu_seqlens_k: int32 [B + 1], cumulative lengths: 0, len_0, len_0 + len_1, ..., total.
        alibi_slopes: [Hq] for every sequence, or [B, Hq], row b for sequence b.
        softmax_scale, causal, diagonal_offset, window_size, softcap, sinks: as for naive_attention.
        attn_bias, attn_mask, dropout_p, dropout_mask: not supported here (their dense layouts do not fit a packed
            batch); call naive_attention per sequence instead.

    Returns:
        out [total_q, Hq, Dv] in q.dtype and lse [Hq, total_q] (flash-attn's varlen LSE layout), float32 (float64
        for float64 inputs).
    """
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}.")
        if t.dim() != 3:
            raise ValueError(f"{name} has shape {tuple(t.shape)}; varlen inputs have 3 dims (total_tokens, heads, "
                             f"headdim): concatenate the sequences along the first dim.")
    for name, value in (("attn_bias", attn_bias), ("attn_mask", attn_mask), ("dropout_mask", dropout_mask)):
        if value is not None:
            raise ValueError(f"{name} is not supported by naive_attention_varlen; call naive_attention on each "
                             f"sequence (batch 1) with its own {name}.")
    if dropout_p != 0:
        raise ValueError(f"dropout_p={dropout_p!r} is not supported by naive_attention_varlen (it takes no "
                         f"dropout_mask); call naive_attention on each sequence with its dropout_mask.")
    bounds_q = _check_cu_seqlens("cu_seqlens_q", cu_seqlens_q, q.shape[0])
    bounds_k = _check_cu_seqlens("cu_seqlens_k", cu_seqlens_k, k.shape[0])
    if len(bounds_q) != len(bounds_k):
        raise ValueError(f"cu_seqlens_q has {len(bounds_q)} entries but cu_seqlens_k has {len(bounds_k)}; both are "
                         f"(batch + 1,) for the same batch.")
    batch, hq = len(bounds_q) - 1, q.shape[1]
    per_sequence_slopes = isinstance(alibi_slopes, torch.Tensor) and alibi_slopes.dim() == 2
    if per_sequence_slopes:
        _check_exact("alibi_slopes", alibi_slopes, [(hq,), (batch, hq)], ["(heads,)", "(batch, heads)"])

    kwargs = dict(softmax_scale=softmax_scale, causal=causal, diagonal_offset=diagonal_offset,
                  window_size=window_size, softcap=softcap, sinks=sinks)
    outs, lses = [], []
    for i in range(batch):
        slopes = alibi_slopes[i] if per_sequence_slopes else alibi_slopes
        qs, ks = slice(bounds_q[i], bounds_q[i + 1]), slice(bounds_k[i], bounds_k[i + 1])
        out, lse = naive_attention(q[None, qs], k[None, ks], v[None, ks], alibi_slopes=slopes, **kwargs)
        outs.append(out[0])                                                  # [len_q, Hq, Dv]
        lses.append(lse[0])                                                  # [Hq, len_q]
    if batch == 0:
        check_qkv(q[None], k[None], v[None])
        return q.new_zeros(0, hq, v.shape[-1]), q.new_zeros(hq, 0, dtype=accum_dtype(q.dtype))
    return torch.cat(outs, dim=0), torch.cat(lses, dim=1)


def attention_backward(q, k, v, out, lse, dout, *, softmax_scale=None, causal=False, diagonal_offset=None,
                       dlse=None, window_size=(-1, -1), softcap=0.0, alibi_slopes=None, attn_bias=None, attn_mask=None,
                       sinks=None, dropout_p=0.0, dropout_mask=None, feature_grads=False):
    """Dense delta-based backward of attention (docs/derivation.md, ch. 6 and 8); not autograd.

        delta = rowsum(dout * out) - dlse     P = exp(S - lse)      dV = (P * Z / (1 - p))^T dO
        dP = (dO V^T) * Z / (1 - p)           dS = P * (dP - delta)
        dX = dS * (1 - tanh^2)  (softcap)     dQ = scale dX K       dK = scale dX^T Q
        dbias = dS                            dsink_h = -sum_{b, i} exp(sink_h - lse_i) delta_i

    Args:
        q, k, v, softmax_scale, causal, diagonal_offset and the features (window_size ... dropout_mask): as for
            naive_attention.
        out: [B, Sq, Hq, Dv], the forward output. lse: [B, Hq, Sq], the forward's natural-log LSE.
        dout: [B, Sq, Hq, Dv], the gradient of the loss with respect to out.
        dlse: optional [B, Hq, Sq], the gradient of the loss with respect to lse, for losses that use the returned
            LSE (d lse_i / d S_ij = P_ij, so it enters as dS = P * (dP - delta + dlse)). Default None means 0.
        feature_grads: also return dbias (attn_bias's shape, broadcast dims summed; None without a bias) and
            dsinks (None without sinks).

    Returns:
        dq [B, Sq, Hq, D], dk [B, Sk, Hk, D], dv [B, Sk, Hk, Dv] in the dtypes of q, k, v (then dbias, dsinks with
        feature_grads). dk and dv sum over the query heads that share each kv head. Rows with lse = -inf (no
        visible key) contribute nothing.

    Computes in float32 (float64 for float64 inputs). This is the CPU fallback backward: it holds a few
    [B, Hq, Sq, Sk] matrices (P, dP, dS) and never the autograd graph.
    """
    sq, sk, hk = check_qkv(q, k, v)
    check_backward_rows(q, v, out, dout, lse, dlse)
    scale = resolve_scale(softmax_scale, q.shape[-1])
    window = resolve_window(window_size)
    offset = resolve_offset(causal or window != (-1, -1) or alibi_slopes is not None, diagonal_offset, sq, sk)
    acc = accum_dtype(q.dtype)
    qg, kg, vg = group_q(q, hk, acc), group_kv(k, acc), group_kv(v, acc)
    dog = group_q(dout, hk, acc)

    delta = (dog * group_q(out, hk, acc)).sum(dim=-1)                       # [B, Hk, G, Sq]
    if dlse is not None:
        delta = delta - group_rows(dlse, hk, acc)
    lse_g = group_rows(lse, hk, acc)
    # lse is -inf only for a row with no visible key; shifting that row by +inf makes its P exactly 0
    # (S - lse would be -inf - (-inf) = NaN).
    lse_g = lse_g.masked_fill(lse_g == NEG_INF, float("inf"))

    s, t = _modified_scores(qg, kg, scale, offset, causal, window, float(softcap), alibi_slopes, attn_bias,
                            attn_mask)
    p = s.sub_(lse_g.unsqueeze(-1)).exp_()                                   # P = exp(S - lse), in place
    dp = dog @ vg.mT                                                         # dP, [B, Hk, G, Sq, Sk]
    if dropout_mask is not None:
        kept = _group_heads(dropout_mask, hk).to(acc) / (1.0 - dropout_p)    # Z / (1 - p)
        dv = ((p * kept).mT @ dog).sum(dim=2, keepdim=True)                  # [B, Hk, 1, Sk, Dv]
        dp.mul_(kept)
    else:
        dv = (p.mT @ dog).sum(dim=2, keepdim=True)
    ds = dp.sub_(delta.unsqueeze(-1)).mul_(p)                                # dS = P * (dP - delta), in place
    del p
    dbias = dsinks = None
    if feature_grads and attn_bias is not None:
        dbias = ds.flatten(1, 2)                                             # [B, Hq, Sq, Sk]
        dims = tuple(i for i in range(4) if _as_4d(attn_bias).shape[i] == 1 and dbias.shape[i] != 1)
        dbias = (dbias.sum(dim=dims, keepdim=True) if dims else dbias).reshape(attn_bias.shape).to(attn_bias.dtype)
    if feature_grads and sinks is not None:
        p_sink = torch.exp(_group_heads(sinks.to(acc).reshape(1, -1, 1, 1), hk).squeeze(-1) - lse_g)
        dsinks = -(p_sink * delta).sum(dim=(0, 3)).reshape(-1).to(sinks.dtype)
    if t is not None:
        ds.mul_(1.0 - t * t)                                                 # through softcap: d tanh = 1 - tanh^2
    dq = scale * (ds @ kg)                                                   # [B, Hk, G, Sq, D]
    dk = scale * (ds.mT @ qg).sum(dim=2, keepdim=True)                       # [B, Hk, 1, Sk, D]
    grads = ungroup_q(dq, q.dtype), ungroup_kv(dk, k.dtype), ungroup_kv(dv, v.dtype)
    return grads + (dbias, dsinks) if feature_grads else grads

