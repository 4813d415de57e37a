"""DeepSpeed-Ulysses attention: an all-to-all turns sequence shards of every head into the whole sequence of
H / W heads, each rank runs ordinary attention on its heads, and a second all-to-all turns the output back.

    rank r before: tokens [r S/W, (r+1) S/W) of heads 0..H-1   ->   after: tokens 0..S-1 of heads [r H/W, (r+1) H/W)

Two all-to-alls of q, k, v and one of the output (and of the LSE when returned) per forward, the same in reverse
in the backward; the attention itself is one local call on the whole sequence, so every mask, ALiBi and
softcap works as on one device.
"""
import math

import torch

from . import _args, _comm, _local


def _seq_to_heads(comm, x):
    """[B, S/W, H, D] (this rank's tokens, all heads) -> [B, S, H/W, D] (all tokens, this rank's heads)."""
    b, n, h, d = x.shape
    w = comm.world
    parts = x.reshape(b, n, w, h // w, d).permute(2, 0, 1, 3, 4)  # [W (head group = destination), B, n, h/W, D]
    got = _comm.all_to_all(comm, parts.contiguous())               # [W (source = sequence shard), B, n, h/W, D]
    return got.permute(1, 0, 2, 3, 4).reshape(b, w * n, h // w, d)


def _heads_to_seq(comm, y):
    """[B, S, H/W, D] -> [B, S/W, H, D] (the inverse of _seq_to_heads)."""
    b, s, h, d = y.shape
    w = comm.world
    parts = y.reshape(b, w, s // w, h, d).permute(1, 0, 2, 3, 4)   # [W (sequence shard = destination), ...]
    got = _comm.all_to_all(comm, parts.contiguous())               # [W (source = head group), B, S/W, h, D]
    return got.permute(1, 2, 0, 3, 4).reshape(b, s // w, w * h, d)


def _lse_heads_to_seq(comm, lse):
    """[B, H/W, S] -> [B, H, S/W]."""
    b, h, s = lse.shape
    w = comm.world
    got = _comm.all_to_all(comm, lse.reshape(b, h, w, s // w).permute(2, 0, 1, 3).contiguous())
    return got.permute(1, 0, 2, 3).reshape(b, w * h, s // w)


def _lse_seq_to_heads(comm, lse):
    """[B, H, S/W] -> [B, H/W, S] (the inverse of _lse_heads_to_seq)."""
    b, h, n = lse.shape
    w = comm.world
    got = _comm.all_to_all(comm, lse.reshape(b, w, h // w, n).permute(1, 0, 2, 3).contiguous())
    return got.permute(1, 2, 0, 3).reshape(b, h // w, w * n)


class _ToHeads(torch.autograd.Function):
    """q, k, v from sequence shards to head groups; the backward sends dq, dk, dv back (all three together, so
    every rank posts the same all-to-alls in the same order)."""

    @staticmethod
    def forward(ctx, comm, q, k, v):
        ctx.comm = comm
        return tuple(_seq_to_heads(comm, t) for t in (q, k, v))

    @staticmethod
    def backward(ctx, dq, dk, dv):  # unused outputs come as zeros (materialized grads)
        return (None,) + tuple(_heads_to_seq(ctx.comm, g.contiguous()) for g in (dq, dk, dv))


class _ToSequence(torch.autograd.Function):
    """out and lse from head groups back to sequence shards; the backward sends dout and dlse together. The LSE
    travels even when the caller does not return it (detached then), so that every rank posts the same
    all-to-alls whatever its return_attn_probs."""

    @staticmethod
    def forward(ctx, comm, out, lse):
        ctx.comm = comm
        return _heads_to_seq(comm, out), _lse_heads_to_seq(comm, lse)

    @staticmethod
    def backward(ctx, dout, dlse):
        return None, _seq_to_heads(ctx.comm, dout.contiguous()), _lse_seq_to_heads(ctx.comm, dlse.contiguous())


def _replicate_kv(k, v, world):
    """k, v with each kv head repeated so that the heads split evenly over the ranks: Hk -> lcm(Hk, W), every
    query head keeping its kv head (query head h uses kv head h // (H / Hk) before and after)."""
    hk = k.shape[2]
    if hk % world == 0:
        return k, v
    repeat = math.lcm(hk, world) // hk
    return k.repeat_interleave(repeat, dim=2), v.repeat_interleave(repeat, dim=2)


def _check(comm, q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic):
    _local.check_qkv(q, k, v, layout="bshd")
    _args.check_device(comm, q)
    opts = _args.options(q, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic,
                         q.shape[0], q.shape[2])
    if q.shape[2] % comm.world:
        raise ValueError(f"q has {q.shape[2]} heads, not a multiple of the world size {comm.world}: Ulysses gives "
                         f"each rank nheads / world_size whole heads. Use ring_flash_attn_func or "
                         f"zigzag_ring_flash_attn_func (any number of heads), or a group whose size divides "
                         f"{q.shape[2]}.")
    return opts, _args.fields("ulysses", q, k, v, opts)


def ulysses_flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                            softcap=0.0, alibi_slopes=None, deterministic=False, return_attn_probs=False, group=None):
    """flash_attn_func over contiguous sequence shards (the layout of ring_flash_attn_func) by all-to-all.

    Arguments:
        q: (batch, seqlen_q / W, nheads, headdim), rank r holding query positions [r seqlen_q / W, (r + 1)
            seqlen_q / W). nheads must be a multiple of W. k, v: (batch, seqlen_k / W, nheads_k, headdim(_v));
            when nheads_k is not a multiple of W (e.g. fewer kv heads than ranks) each kv head is replicated to
            lcm(nheads_k, W) heads before the exchange (their gradients are summed back).
        Other arguments as ring_flash_attn_func (dropout_p must be 0.0); causal, window and ALiBi positions are
            global.

    Returns: out (batch, seqlen_q / W, nheads, headdim_v); with return_attn_probs, (out, lse, None), lse (batch,
    nheads, seqlen_q / W) float32.
    """
    comm = _comm.resolve(group)
    opts = _args.checked(comm, lambda: _check(comm, q, k, v, dropout_p, softmax_scale, causal, window_size, softcap,
                                              alibi_slopes, deterministic))
    heads = q.shape[2] // comm.world
    slopes = opts.alibi_slopes
    if slopes is not None:
        slopes = slopes[..., comm.rank * heads:(comm.rank + 1) * heads].contiguous()
    kk, vv = _replicate_kv(k, v, comm.world)
    qh, kh, vh = _ToHeads.apply(comm, q, kk, vv)
    out, lse, _ = _local.local_attention(qh, kh, vh, 0.0, opts.softmax_scale, opts.causal, opts.window, opts.softcap,
                                         slopes, opts.deterministic, return_attn_probs=True)
    out, lse = _ToSequence.apply(comm, out, lse if return_attn_probs else lse.detach())
    return (out, lse, None) if return_attn_probs else out
