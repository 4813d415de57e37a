"""The CPU fallback backend: an AttentionRequest computed by the naive reference in float32 (O(S^2) memory).

What runs for CPU tensors when Triton's interpreter is off (flashtile.dispatch). Varlen batches run one sequence at a
time, each aligned to its own bottom-right corner; dropout regenerates the kernels' Philox mask
(reference.dropout), so the fallback drops the same elements the kernels do.
"""
import dataclasses

import torch

from .dropout import dropout_mask
from .kvcache import gather_pages
from .naive import attention_backward, naive_attention


def _seed(req):
    return int(req.seed.item()) if req.dropout_p > 0 else 0


def _mask_kwargs(req):
    if req.attn_bias is None:
        return {}
    return {"attn_mask" if req.attn_bias.dtype == torch.bool else "attn_bias": req.attn_bias}


def _slopes(req, b):
    slopes = req.alibi_slopes
    if slopes is not None and slopes.dim() == 2:
        return slopes[b]
    return slopes


def _sequences(req):
    """(b, query rows, key rows) of each sequence of a varlen request."""
    cu_q, cu_k = req.cu_seqlens_q.tolist(), req.cu_seqlens_k.tolist()
    return [(b, slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1])) for b in range(len(cu_q) - 1)]


def _dequantized(q, k, v, req):
    """An FP8 request's q, k, v as float32 values: the stored float8 ones times their factors (req.descale, per batch
    entry or sequence and kv head; a query head takes its kv head's factor). Other requests' inputs as they are."""
    if req.descale is None:
        return q, k, v
    group = q.shape[-2] // k.shape[-2]

    def scaled(t, index, cu):
        factor = req.descale[..., index]  # (B, Hk)
        if t is q:
            factor = factor.repeat_interleave(group, dim=1)
        if req.varlen:  # rows of sequence b take row b's factors
            return t.float() * factor.repeat_interleave(cu[1:] - cu[:-1], dim=0)[:, :, None]
        return t.float() * factor[:, None, :, None]

    return (scaled(q, 0, req.cu_seqlens_q), scaled(k, 1, req.cu_seqlens_k), scaled(v, 2, req.cu_seqlens_k))


def forward(q, k, v, req):
    """(out in q's dtype (bfloat16 for float8 inputs), lse fp32) of the request; differentiable by autograd (not
    used: backward below). A paged request's pages are gathered into contiguous keys first
    (reference.kvcache.gather_pages); an FP8 request's inputs are dequantized first (_dequantized)."""
    out_dtype = torch.bfloat16 if req.descale is not None else q.dtype
    q, k, v = _dequantized(q, k, v, req)
    if req.paged:
        k, v, cu_k = gather_pages(k, v, req.block_table, req.cu_seqlens_k, req.seqused_k)
        req = dataclasses.replace(req, cu_seqlens_k=cu_k, block_table=None, seqused_k=None)
    kw = dict(softmax_scale=req.softmax_scale, window_size=(req.window_left, req.window_right), softcap=req.softcap,
              sinks=req.sinks, dropout_p=req.dropout_p, **_mask_kwargs(req))
    seed = _seed(req)

    def one(qb, kb, vb, slopes, b_index, offset):
        extra = {}
        if req.dropout_p > 0:
            extra["dropout_mask"] = dropout_mask(seed, qb.shape[0], qb.shape[2], qb.shape[1], kb.shape[1],
                                                 req.dropout_p, batch_offset=b_index)
        return naive_attention(qb.float(), kb.float(), vb.float(), alibi_slopes=slopes, diagonal_offset=offset,
                               **kw, **extra)

    if not req.varlen:
        out, lse = one(q, k, v, req.alibi_slopes, 0, req.diagonal_offset)
        return out.to(out_dtype), lse.float()
    outs, lses = [], []
    for b, rq, rk in _sequences(req):
        offset = (rk.stop - rk.start) - (rq.stop - rq.start)
        out, lse = one(q[None, rq], k[None, rk], v[None, rk], _slopes(req, b), b, offset)
        outs.append(out[0])
        lses.append(lse[0])
    return torch.cat(outs).to(out_dtype), torch.cat(lses, dim=-1).float()


def backward(dout, q, k, v, out, lse, dlse, req, bias_requires_grad):
    """(dq, dk, dv in the inputs' dtypes, dbias or None, dsinks or None): the dense delta formula with the
    features (reference.attention_backward) in float32, per sequence for varlen batches."""
    kw = dict(softmax_scale=req.softmax_scale, window_size=(req.window_left, req.window_right), softcap=req.softcap,
              sinks=req.sinks, dropout_p=req.dropout_p, feature_grads=True, **_mask_kwargs(req))
    seed = _seed(req)

    def one(qb, kb, vb, ob, lb, dob, dlb, slopes, b_index, offset):
        extra = {}
        if req.dropout_p > 0:
            extra["dropout_mask"] = dropout_mask(seed, qb.shape[0], qb.shape[2], qb.shape[1], kb.shape[1],
                                                 req.dropout_p, batch_offset=b_index)
        return attention_backward(qb.float(), kb.float(), vb.float(), ob.float(), lb, dob.float(), dlse=dlb,
                                  diagonal_offset=offset, alibi_slopes=slopes, **kw, **extra)

    if not req.varlen:
        dq, dk, dv, dbias, dsinks = one(q, k, v, out, lse, dout, dlse, req.alibi_slopes, 0, req.diagonal_offset)
    else:
        parts, dsinks = [], None
        for b, rq, rk in _sequences(req):
            part = one(q[None, rq], k[None, rk], v[None, rk], out[None, rq], lse[None, :, rq], dout[None, rq],
                       None if dlse is None else dlse[None, :, rq], _slopes(req, b), b,
                       (rk.stop - rk.start) - (rq.stop - rq.start))
            parts.append(part[:3])
            if part[4] is not None:
                dsinks = part[4] if dsinks is None else dsinks + part[4]
        dq, dk, dv = (torch.cat([p[i][0] for p in parts]) for i in range(3))
        dbias = None
    if not bias_requires_grad:
        dbias = None
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), dbias, dsinks
