"""Ring attention over torch.distributed: contiguous shards, zig-zag shards, and packed (varlen) batches.

Each function takes flash-attn's arguments plus `group` and returns what flashtile.flash_attn_func (or
flash_attn_varlen_func) returns for this rank's queries, as if the whole sequence were on one device; gradients
flow to this rank's shards. The engine is flashtile.distributed._ring; docs/distributed.md has the layouts.
"""
import numbers

import torch
import torch.distributed as dist

from . import _args, _comm, _local
from ._plan import VarlenLayout, chunk_pieces, ring_chunks, zigzag_chunks
from ._ring import RingAttention, RingPlan

_ARGS_DOC = """dropout_p: must be 0.0 (dropout is not supported across ranks: NotImplementedError).
        softmax_scale: float, default 1 / sqrt(headdim).
        causal: bool, default False. Aligned to the bottom-right corner of the WHOLE sequence, as
            flash_attn_func on the gathered tensors: query i sees key j iff j <= i + S_k - S_q (global positions).
        window_size: (left, right), default (-1, -1): sliding window in global positions, aligned like causal.
        softcap: float, default 0.0 (off).
        alibi_slopes: fp32 (nheads,) or (batch, nheads), default None; distances in global positions.
        deterministic: bool, default False: bit-identical gradients from run to run.
        return_attn_probs: bool, default False: also return (lse, None).
        group: torch.distributed process group, default None (the world). Every rank of the group must make the
            same call with tensors of the same shapes; the ranks' arguments are compared before any transfer and
            all ranks raise ValueError if they disagree."""


def _fixed_length(kind, q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic,
                  return_attn_probs, group):
    comm = _comm.resolve(group)

    def check():
        _local.check_qkv(q, k, v, layout="bshd")
        _args.check_device(comm, q)
        opts = _args.options(q, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic,
                             q.shape[0], q.shape[2])
        if kind == "zigzag":
            for name, t in (("q", q), ("k", k)):
                if t.shape[1] % 2:
                    raise ValueError(f"{name} holds {t.shape[1]} tokens per rank, an odd number; the zig-zag layout "
                                     f"holds two equal chunks per rank (the sequence cut into 2 x world_size "
                                     f"chunks): pad the sequence to a multiple of {2 * comm.world}, or use "
                                     f"ring_flash_attn_func.")
        return opts, _args.fields(kind, q, k, v, opts)

    opts, agree = _args.check_locally(comm, check)  # compared over the group by the ring's forward
    qq, opts = _args.positive_scale(q, opts)
    chunks = zigzag_chunks if kind == "zigzag" else ring_chunks
    world, rank = comm.world, comm.rank
    q_chunks = chunks(rank, world, q.shape[1])
    seq_offset = world * (k.shape[1] - q.shape[1])  # D = Sk - Sq of the whole sequence
    steps = tuple(chunk_pieces(q_chunks, chunks((rank - s) % world, world, k.shape[1]), seq_offset, opts.mask,
                               opts.alibi_slopes is not None) for s in range(world))
    out, lse = RingAttention.apply(qq, k.contiguous(), v.contiguous(), RingPlan(comm, opts, steps, agree))
    return (out, lse, None) if return_attn_probs else out


def ring_flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                         alibi_slopes=None, deterministic=False, return_attn_probs=False, group=None):
    """flash_attn_func over a sequence split in W contiguous shards, one per rank of `group` (ring attention).

    Arguments:
        q: (batch, seqlen_q / W, nheads, headdim): rank r holds query positions [r * seqlen_q / W, (r + 1) *
            seqlen_q / W) (ranks in group order). k, v: (batch, seqlen_k / W, nheads_k, headdim(_v)), likewise.
            nheads must be a multiple of nheads_k (GQA). The key/value shards travel around the ring; a causal ring
            skips every block in the future, so its ranks have unequal work (zigzag_ring_flash_attn_func balances
            it).
        {args}

    Returns: out (batch, seqlen_q / W, nheads, headdim_v) in q's dtype; with return_attn_probs, (out, lse, None),
    lse (batch, nheads, seqlen_q / W) float32 natural log (differentiable).
    """
    return _fixed_length("ring", q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
                         deterministic, return_attn_probs, group)


def zigzag_ring_flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                                softcap=0.0, alibi_slopes=None, deterministic=False, return_attn_probs=False,
                                group=None):
    """flash_attn_func over a sequence in the zig-zag layout: cut into 2W chunks, rank r holds chunks r and
    2W - 1 - r, concatenated. Under a causal mask every rank then has the same work at every ring step:

        W = 2, chunks 0 1 2 3:   rank 0 holds [0 | 3], rank 1 holds [1 | 2]

    Arguments:
        q: (batch, seqlen_q / W, nheads, headdim), this rank's two chunks (zigzag_shard(q_full, 1, group) makes
            them; zigzag_unshard puts a result back in order). k, v: (batch, seqlen_k / W, nheads_k, headdim(_v)).
            seqlen / W must be even.
        {args}

    Returns: as ring_flash_attn_func, in this rank's zig-zag order.
    """
    return _fixed_length("zigzag", q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
                         deterministic, return_attn_probs, group)


def zigzag_shard(x, dim=1, group=None):
    """This rank's part of the full tensor x in the zig-zag layout: x cut into 2W equal chunks along `dim`, chunks
    r and 2W - 1 - r concatenated (a view-free copy). No communication: every rank passes the same x."""
    comm = _comm.resolve(group)
    n, world = x.shape[dim], comm.world
    if n % (2 * world):
        raise ValueError(f"x has {n} positions along dim {dim}, not a multiple of 2 x world_size = {2 * world}; the "
                         f"zig-zag layout cuts the sequence into {2 * world} equal chunks: pad it to a multiple.")
    chunks = x.chunk(2 * world, dim=dim)
    return torch.cat((chunks[comm.rank], chunks[2 * world - 1 - comm.rank]), dim=dim)


def zigzag_unshard(x, dim=1, group=None):
    """The full tensor from every rank's zig-zag part x (the inverse of zigzag_shard): an all-gather over the group,
    so every rank must call it with the same shape. The result carries no autograd history."""
    comm = _comm.resolve(group)

    def check():
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}.")
        _args.check_device(comm, x)
        if x.shape[dim] % 2:
            raise ValueError(f"x has {x.shape[dim]} positions along dim {dim}; a zig-zag part holds two equal "
                             f"chunks, so the count must be even.")
        return None, dict(function=_args.FUNCTION_IDS["unshard"], device=int(x.is_cuda),
                          dtype=_args.dtype_id(x.dtype), shape=_args.digest(tuple(x.shape) + (dim % x.dim(),)))

    _args.checked(comm, check)
    parts = [torch.empty_like(x, memory_format=torch.contiguous_format) for _ in range(comm.world)]
    dist.all_gather(parts, x.detach().contiguous(), group=comm.group)
    world = comm.world
    ordered = [None] * (2 * world)
    for r, part in enumerate(parts):
        first, second = part.chunk(2, dim=dim)
        ordered[r], ordered[2 * world - 1 - r] = first, second
    return torch.cat(ordered, dim=dim)


def _check_cu_seqlens(cu_seqlens, max_seqlen, q, world):
    """The host copy of cu_seqlens, checked against this rank's shard."""
    if not isinstance(cu_seqlens, torch.Tensor) or cu_seqlens.dtype != torch.int32 or cu_seqlens.dim() != 1 \
            or cu_seqlens.numel() < 2:
        raise ValueError(f"cu_seqlens must be a 1-D int32 tensor of batch + 1 offsets (0, len_0, len_0 + len_1, ..., "
                         f"total), the same on every rank; got {cu_seqlens!r:.80}.")
    bounds = tuple(cu_seqlens.tolist())
    total = q.shape[0] * world
    if bounds[0] != 0 or any(a > b for a, b in zip(bounds, bounds[1:])) or bounds[-1] != total:
        raise ValueError(f"cu_seqlens={list(bounds)[:8]}{'...' if len(bounds) > 8 else ''} must start at 0, never "
                         f"decrease and end at the batch's total token count {total} (= {q.shape[0]} tokens per "
                         f"rank x {world} ranks): each rank holds rows [r * T / W, (r + 1) * T / W) of the packed "
                         f"batch; pad the batch to a multiple of the world size.")
    longest = max(b - a for a, b in zip(bounds, bounds[1:]))
    if isinstance(max_seqlen, bool) or not isinstance(max_seqlen, numbers.Integral) or max_seqlen < longest:
        raise ValueError(f"max_seqlen={max_seqlen!r} must be an int at least the longest sequence ({longest}).")
    return bounds


def ring_flash_attn_varlen_func(q, k, v, cu_seqlens, max_seqlen, dropout_p=0.0, softmax_scale=None, causal=False,
                                window_size=(-1, -1), softcap=0.0, alibi_slopes=None, deterministic=False,
                                return_attn_probs=False, group=None):
    """flash_attn_varlen_func (self-attention: the same cu_seqlens for queries and keys) over a packed batch split
    in W equal shards of rows; sequences may cross shard boundaries.

        cu_seqlens = [0, 5, 6, 12], W = 3, T = 12:   rank 0 rows 0-3, rank 1 rows 4-7, rank 2 rows 8-11
        sequence 0 = rows 0-4 spans ranks 0 and 1; sequence 2 = rows 6-11 spans ranks 1 and 2

    Arguments:
        q: (T / W, nheads, headdim): this rank's rows [r * T / W, (r + 1) * T / W) of the packed batch. k, v:
            (T / W, nheads_k, headdim(_v)), the same rows.
        cu_seqlens: int32 (batch + 1,), the whole batch's offsets, identical on every rank. max_seqlen: int, at
            least the longest sequence.
        Masks (causal, window, ALiBi) align to each sequence's own bottom-right corner (global positions within
            the sequence); alibi_slopes may be (batch, nheads).
        {args}

    Returns: out (T / W, nheads, headdim_v); with return_attn_probs, (out, lse, None), lse (nheads, T / W) float32.
    """
    comm = _comm.resolve(group)

    def check():
        _local.check_qkv(q, k, v, layout="thd")
        _args.check_device(comm, q)
        if k.shape[0] != q.shape[0]:
            raise ValueError(f"q holds {q.shape[0]} rows but k/v hold {k.shape[0]}; the varlen ring is "
                             f"self-attention over one packed batch: q, k and v hold the same rows.")
        bounds = _check_cu_seqlens(cu_seqlens, max_seqlen, q, comm.world)
        opts = _args.options(q, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic,
                             len(bounds) - 1, q.shape[1])
        table = _args.fields("varlen", q, k, v, opts)
        table.update(total_tokens=bounds[-1], cu_seqlens=_args.digest(bounds), max_seqlen=int(max_seqlen))
        return (bounds, opts), table

    (bounds, opts), agree = _args.check_locally(comm, check)  # compared over the group by the ring's forward
    qq, opts = _args.positive_scale(q, opts)
    layout = VarlenLayout(bounds, comm.world)
    steps = tuple(tuple(layout.pieces(comm.rank, (comm.rank - s) % comm.world, opts.mask, q.device))
                  for s in range(comm.world))
    out, lse = RingAttention.apply(qq.unsqueeze(0), k.contiguous().unsqueeze(0), v.contiguous().unsqueeze(0),
                                   RingPlan(comm, opts, steps, agree))
    out, lse = out[0], lse[0]
    return (out, lse, None) if return_attn_probs else out


for _fn in (ring_flash_attn_func, zigzag_ring_flash_attn_func, ring_flash_attn_varlen_func):
    _fn.__doc__ = _fn.__doc__.replace("{args}", _ARGS_DOC)
