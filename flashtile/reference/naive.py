"""Naive attention and its dense backward: the oracle every test compares against (docs/derivation.md, ch. 1 and 6).

# q: [B, Sq, Hq, D]   k: [B, Sk, Hk, D]   v: [B, Sk, Hk, Dv]   out: [B, Sq, Hq, Dv]   lse: [B, Hq, Sq]
"""

import torch

from ._common import (NEG_INF, accum_dtype, causal_mask, check_backward_rows, check_qkv, finite_or_zero, group_kv, group_q,
                      group_rows, resolve_offset, resolve_scale, ungroup_kv, ungroup_q, ungroup_rows)


def naive_attention(q, k, v, *, softmax_scale=None, causal=False, diagonal_offset=None):
    """Attention with the full score matrix materialised: S = scale * q k^T, mask, P = softmax(S), out = P v.

    Args:
        q: [B, Sq, Hq, D]. k: [B, Sk, Hk, D]. v: [B, Sk, Hk, Dv]. Hq must be a multiple of Hk (grouped-query
            attention: query head h uses kv head h // (Hq // Hk)).
        softmax_scale: multiplies q k^T; default None means 1 / sqrt(D).
        causal: default False. When True, query i sees key j iff j <= i + diagonal_offset.
        diagonal_offset: default None means Sk - Sq, the bottom-right alignment of flash-attn; 0 is top-left
            (torch SDPA). Ignored when causal is False. With Sq = 2, Sk = 5 and the default:
                1 1 1 1 0
                1 1 1 1 1

    Returns:
        out [B, Sq, Hq, Dv] in q.dtype, and lse [B, Hq, Sq] = logsumexp_j S_ij (natural log), float64 for float64
        inputs and float32 otherwise. A row that sees no key gets out 0 and lse -inf, and gradients through out of 0.

    Everything up to the final log runs in q.dtype: float64 inputs give the oracle, bf16/fp16 inputs give "plain
    PyTorch in that dtype", the baseline error the kernels are judged against.
    """
    sq, sk, hk = check_qkv(q, k, v)
    scale = resolve_scale(softmax_scale, q.shape[-1])
    offset = resolve_offset(causal, diagonal_offset, sq, sk)
    lse_dtype = accum_dtype(q.dtype)
    qg, kg, vg = group_q(q, hk, q.dtype), group_kv(k, q.dtype), group_kv(v, q.dtype)

    s = scale * (qg @ kg.mT)                                                 # [B, Hk, G, Sq, Sk]
    if offset is not None:
        s = s.masked_fill(~causal_mask(sq, sk, offset, device=q.device), NEG_INF)

    # Safe softmax (ch. 2). The max only shifts S and cancels in P and in lse, so it carries no gradient: detaching
    # it keeps autograd out of amax, whose backward would see the ties of an all -inf row.
    if sk > 0:
        m = s.detach().amax(dim=-1, keepdim=True)                            # [B, Hk, G, Sq, 1]
    else:
        m = s.new_full(s.shape[:-1] + (1,), NEG_INF)
    m = finite_or_zero(m)
    p = torch.exp(s - m)                                                     # unnormalised P, masked keys -> 0
    l = p.sum(dim=-1, keepdim=True)
    # A row with no visible key has l == 0: divide and take the log of 1 instead, so neither the value nor the
    # gradient (1/l) can become NaN, and write 0 / -inf explicitly.
    seen = l > 0
    l_safe = torch.where(seen, l, torch.ones_like(l))
    out = (p / l_safe) @ vg                                                  # [B, Hk, G, Sq, Dv]
    lse = torch.where(seen, m.to(lse_dtype) + torch.log(l_safe.to(lse_dtype)), NEG_INF).squeeze(-1)
    return ungroup_q(out, q.dtype), ungroup_rows(lse, lse_dtype)


def attention_backward(q, k, v, out, lse, dout, *, softmax_scale=None, causal=False, diagonal_offset=None,
                       dlse=None):
    """Dense delta-based backward of attention (docs/derivation.md, ch. 6); not autograd.

        delta = rowsum(dout * out) - dlse     P = exp(S - lse)      dV = P^T dO      dP = dO V^T
        dS = P * (dP - delta)                 dQ = scale dS K       dK = scale dS^T Q

    Args:
        q, k, v, softmax_scale, causal, diagonal_offset: as for naive_attention.
        out: [B, Sq, Hq, Dv], the forward output. lse: [B, Hq, Sq], the forward's natural-log LSE.
        dout: [B, Sq, Hq, Dv], the gradient of the loss with respect to out.
        dlse: optional [B, Hq, Sq], the gradient of the loss with respect to lse, for losses that use the returned
            LSE (d lse_i / d S_ij = P_ij, so it enters as dS = P * (dP - delta + dlse)). Default None means 0.

    Returns:
        dq [B, Sq, Hq, D], dk [B, Sk, Hk, D], dv [B, Sk, Hk, Dv] in the dtypes of q, k, v. dk and dv sum over the
        query heads that share each kv head. Rows with lse = -inf (no visible key) contribute nothing.

    Computes in float32 (float64 for float64 inputs). This is the CPU fallback backward: it holds two
    [B, Hq, Sq, Sk] matrices (P and dP, which becomes dS in place) and never the autograd graph.
    """
    sq, sk, hk = check_qkv(q, k, v)
    check_backward_rows(q, v, out, dout, lse, dlse)
    scale = resolve_scale(softmax_scale, q.shape[-1])
    offset = resolve_offset(causal, diagonal_offset, sq, sk)
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

    p = scale * (qg @ kg.mT)                                                 # S, [B, Hk, G, Sq, Sk]
    if offset is not None:
        p.masked_fill_(~causal_mask(sq, sk, offset, device=q.device), NEG_INF)
    p.sub_(lse_g.unsqueeze(-1)).exp_()                                       # P = exp(S - lse), in place
    dv = (p.mT @ dog).sum(dim=2, keepdim=True)                               # [B, Hk, 1, Sk, Dv]
    ds = dog @ vg.mT                                                         # dP, [B, Hk, G, Sq, Sk]
    ds.sub_(delta.unsqueeze(-1)).mul_(p)                                     # dS = P * (dP - delta), in place
    del p
    dq = scale * (ds @ kg)                                                   # [B, Hk, G, Sq, D]
    dk = scale * (ds.mT @ qg).sum(dim=2, keepdim=True)                       # [B, Hk, 1, Sk, D]
    return ungroup_q(dq, q.dtype), ungroup_kv(dk, k.dtype), ungroup_kv(dv, v.dtype)
