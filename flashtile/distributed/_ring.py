"""The ring engine shared by ring_flash_attn_func, zigzag_ring_flash_attn_func and ring_flash_attn_varlen_func.

W ranks; at step s rank r holds the key/value block of rank (r - s) mod W, computes its pieces (_plan) against its
own queries, and passes the block on to rank r + 1 while the next one arrives from rank r - 1.

Forward (docs/derivation.md, ch. 7): each piece returns (out_i, lse_i) over its keys, both float32; they are
merged in float32 (_merge.merge_),
    lse = log(exp(lse) + exp(lse_i)),   out = exp(lse_old - lse) * out + exp(lse_i - lse) * out_i,
and rounded to the inputs' dtype once at the end, so the error does not grow with W.

Backward: every piece runs the block backward with the FINAL out and lse of its query rows (P = exp(S - lse) is
then the global softmax, delta = rowsum(dO * O) the global one), so the pieces' gradients simply add up: dQ in a
local float32 accumulator, dK/dV in float32 accumulators that travel around the ring with their block and, after
W steps, end at the rank that owns it. The backward runs the forward's steps in reverse, the blocks going round
the other way: it starts with the block the forward held last and ends with the rank's own, so every transfer,
the accumulators' last one included, arrives while a step computes (ring_backward).

# internal layout: q, out [B, S_local, H, D]; k, v [B, S_local_k, Hk, D]; lse [B, H, S_local] (varlen: B = 1)
"""
import dataclasses
from typing import Callable, Optional

import torch

from . import _comm
from ._local import Block, block_backward, block_forward
from ._merge import add_rounded, merge_
from ._plan import Mask, Piece


@dataclasses.dataclass(frozen=True)
class Options:
    """The call's attention options, checked (softmax_scale > 0)."""
    softmax_scale: float
    causal: bool
    window: tuple
    softcap: float
    alibi_slopes: object  # fp32 (H,) or (B, H) tensor, or None
    deterministic: bool

    @property
    def mask(self):
        return Mask.of(self.causal, self.window)


@dataclasses.dataclass(frozen=True)
class RingPlan:
    """steps[s]: the pieces rank comm.rank computes at step s, against the key block of rank (rank - s) mod W.
    agree: the comparison of the ranks' arguments (_args.check_locally), which the forward runs once its first
    step's kernels are queued (None: already compared)."""
    comm: _comm.Comm
    options: Options
    steps: tuple
    agree: Optional[Callable] = None


def _block(options: Options, piece: Piece):
    """The local call of one piece."""
    slopes = options.alibi_slopes
    if slopes is not None and slopes.dim() == 2 and piece.seq_ids is not None:
        # Varlen ALiBi per sequence: the pieces' sequences are a subset of the batch's.
        slopes = slopes[list(piece.seq_ids)] if piece.varlen is not None else slopes[piece.seq_ids[0]]
    if piece.masked:
        return Block(options.softmax_scale, options.causal, piece.offset, options.window, options.softcap, slopes,
                     options.deterministic, piece.varlen)
    return Block(options.softmax_scale, False, piece.offset, (-1, -1), options.softcap, slopes,
                 options.deterministic, piece.varlen)


def _rows(t, piece: Piece, keys=False):
    """The piece's rows of a [B, S, H, D] tensor: a packed piece takes all of batch entry 0, as [S, H, D]."""
    if piece.varlen is not None:
        return t[0]
    return t[:, piece.k0:piece.k1] if keys else t[:, piece.q0:piece.q1]


def _lse_rows(lse, piece: Piece):
    return lse[0] if piece.varlen is not None else lse[:, :, piece.q0:piece.q1]


def _unpack(t, piece: Piece):
    return t.unsqueeze(0) if piece.varlen is not None else t


def _covers_all_rows(plan: RingPlan, n_rows):
    """Whether every local query row is in some piece (else the rows no piece reaches must start at 0)."""
    reached = 0
    for lo, hi in sorted((p.q0, p.q1) for pieces in plan.steps for p in pieces):
        if lo > reached:
            return False
        reached = max(reached, hi)
    return reached >= n_rows


def _fresh_result(q, head_dim_v, plan: RingPlan):
    """A float32 running output and its LSE (-inf: no key seen yet) for the local queries."""
    alloc = torch.empty if _covers_all_rows(plan, q.shape[1]) else torch.zeros
    out = alloc(q.shape[:-1] + (head_dim_v,), dtype=torch.float32, device=q.device)
    lse = torch.full((q.shape[0], q.shape[2], q.shape[1]), float("-inf"), dtype=torch.float32, device=q.device)
    return out, lse


def _forward_piece(q, kv, piece, plan, out, lse):
    """(out, lse) with one piece's partial result merged in (out None: none yet)."""
    out_i, lse_i = block_forward(_rows(q, piece), _rows(kv[0], piece, True), _rows(kv[1], piece, True),
                                 _block(plan.options, piece))
    out_i, lse_i = _unpack(out_i, piece), _unpack(lse_i, piece)
    if out is None and piece.q0 == 0 and piece.q1 == q.shape[1] and out_i.is_contiguous():
        # The first partial result, over every row: it is the running result as it stands (a merge into an empty
        # one would copy it). Causal rings start so, with the rank's own keys.
        return out_i, lse_i
    if out is None:
        out, lse = _fresh_result(q, kv[1].shape[-1], plan)
    merge_(out[:, piece.q0:piece.q1], lse[:, :, piece.q0:piece.q1], out_i, lse_i)
    return out, lse


def ring_forward(q, k, v, plan: RingPlan):
    """(out in q's dtype, lse fp32, the key/value block held last) of the local queries over the whole ring. The
    block held last is rank + 1's (the rank's own with one rank): the backward starts with it."""
    comm = plan.comm
    out = lse = None
    kv = (k, v)
    # The first step computes the rank's own block before the ranks compare their arguments (plan.agree), so that
    # the GPU works while the host compares them and posts the first exchange. That exchange then goes from a side
    # stream that waits only for what was queued before the first step (`ready`), so it still travels during it.
    ready = _comm.queued_event(q) if plan.agree is not None else None
    for step, pieces in enumerate(plan.steps):
        first = step == 0 and plan.agree is not None
        pending = _comm.RingExchange(comm, kv) if step + 1 < comm.world and not first else None
        try:
            for piece in pieces:
                out, lse = _forward_piece(q, kv, piece, plan, out, lse)
        except Exception as error:  # noqa: BLE001 - every rank hears of it before any transfer, then it is raised
            if first:
                plan.agree(error)
            raise
        if first:
            plan.agree()
            if step + 1 < comm.world:
                pending = _comm.RingExchange(comm, kv, after=ready)
        if pending is not None:
            kv = tuple(pending.wait())
    if out is None:
        out, lse = _fresh_result(q, v.shape[-1], plan)
    return out.to(q.dtype), lse, kv


def _add_rows(acc, grad, lo, hi, like):
    """acc[:, lo:hi] += grad; acc None: the first contribution, taken as it is when it covers every row (the block
    gradients are fresh float32 tensors), else copied into a float32 tensor shaped like `like` whose other rows are
    zeroed (one pass over the rows instead of zeros and an addition)."""
    if acc is None:
        if lo == 0 and hi == like.shape[1]:
            return grad
        acc = torch.empty(like.shape, dtype=torch.float32, device=like.device)
        acc[:, :lo].zero_()
        acc[:, hi:].zero_()
        acc[:, lo:hi].copy_(grad)
        return acc
    acc[:, lo:hi] += grad
    return acc


def _covers(parts, n):
    """The only part, when it spans all n rows (else None)."""
    return parts[0] if len(parts) == 1 and parts[0][0] == 0 and parts[0][1] == n else None


def _piece_backward(dout, dlse, q, kv, out, lse, piece, options):
    """(dq, dk, dv) of one piece, float32, in [B, rows, H, D] (a packed piece's with B = 1), and its key rows."""
    grads = block_backward(_rows(dout, piece), _rows(q, piece), _rows(kv[0], piece, True), _rows(kv[1], piece, True),
                           _rows(out, piece), _lse_rows(lse, piece), None if dlse is None else _lse_rows(dlse, piece),
                           _block(options, piece))
    k0, k1 = (0, kv[0].shape[1]) if piece.varlen is not None else (piece.k0, piece.k1)
    return tuple(_unpack(g, piece) for g in grads), (k0, k1)


def _step_backward(dout, dlse, q, kv, out, lse, dq, pieces, options, dq_dtype=None):
    """One step's pieces: returns dq with their query gradients added (dq None: none yet) and this step's key
    gradients as a list of (first key row, last + 1, dk, dv) parts of the key block. dq_dtype: the last step's,
    where dq comes back in that dtype (dq plus one piece over every row: added and rounded in one pass)."""
    parts = []
    for piece in pieces:
        (dq_i, dk_i, dv_i), (k0, k1) = _piece_backward(dout, dlse, q, kv, out, lse, piece, options)
        parts.append((k0, k1, dk_i, dv_i))
        q0, q1 = (0, q.shape[1]) if piece.varlen is not None else (piece.q0, piece.q1)
        if dq_dtype is not None and dq is not None and len(pieces) == 1 and (q0, q1) == (0, q.shape[1]):
            return add_rounded(dq, dq_i, dq_dtype), parts
        dq = _add_rows(dq, dq_i, q0, q1, q)
    if dq_dtype is not None and dq is not None:
        dq = dq.to(dq_dtype)
    return dq, parts


def _fold(acc, parts, kv, dtypes=None):
    """The key block's (dk, dv): acc (the float32 accumulators that travelled here, or None) with this step's parts
    added in their rows, in float32; dtypes: the last step's (k's and v's), where they come back rounded to them
    (acc plus one part over every row: added and rounded in one pass)."""
    whole = _covers(parts, kv[0].shape[1])
    if dtypes is not None and acc is not None and whole is not None:
        return add_rounded(acc[0], whole[2], dtypes[0]), add_rounded(acc[1], whole[3], dtypes[1])
    dk, dv = acc if acc is not None else (None, None)
    for k0, k1, dk_i, dv_i in parts:
        dk = _add_rows(dk, dk_i, k0, k1, kv[0])
        dv = _add_rows(dv, dv_i, k0, k1, kv[1])
    if dk is None:
        dk = torch.zeros(kv[0].shape, dtype=torch.float32, device=kv[0].device)
        dv = torch.zeros(kv[1].shape, dtype=torch.float32, device=kv[1].device)
    return (dk, dv) if dtypes is None else (dk.to(dtypes[0]), dv.to(dtypes[1]))


def ring_backward(dout, dlse, q, k, v, out, lse, last_kv, plan: RingPlan):
    """(dq, dk, dv) in the inputs' dtypes for the local shards (dlse: None or the gradient reaching lse; last_kv:
    the block ring_forward held last, rank + 1's). They are summed in float32 and rounded once, by the last
    addition.

    The blocks go round the other way, and in the forward's steps reversed: rank r starts with the block it holds
    already (rank r + 1's) and ends with its own, so that each float32 dK/dV accumulator, which travels with its
    block from the rank before, ends where its block lives: the last step adds the accumulator that arrived while it
    computed, and no transfer is left after the compute. The last step's block is the rank's own k, v, so it is not
    sent either (W ranks: W - 2 block exchanges, W - 1 accumulator exchanges, each hidden behind a step)."""
    comm = plan.comm
    world = comm.world
    dq = None
    kv = last_kv
    travelling = None  # the accumulators of the block held now, from the rank that held it before
    for turn, step in enumerate(reversed(range(world))):  # plan.steps[step]: against rank - step's block
        pending = _comm.RingExchange(comm, kv, reverse=True) if turn + 2 < world else None
        last = turn + 1 == world
        dq, parts = _step_backward(dout, dlse, q, kv, out, lse, dq, plan.steps[step], plan.options,
                                   q.dtype if last else None)
        dk, dv = _fold(None if travelling is None else travelling.wait(), parts, kv,
                       (k.dtype, v.dtype) if last else None)
        if turn + 1 < world:
            travelling = _comm.RingExchange(comm, (dk, dv), reverse=True)
            kv = tuple(pending.wait()) if pending is not None else (k, v)
    if dq is None:
        dq = torch.zeros(q.shape, dtype=q.dtype, device=q.device)
    return dq, dk, dv


class RingAttention(torch.autograd.Function):
    """(out, lse) of ring_forward, with ring_backward as its gradient. Every rank of the group must run the
    backward (it exchanges blocks): backpropagate through the output on all of them."""

    @staticmethod
    def forward(ctx, q, k, v, plan):
        out, lse, last_kv = ring_forward(q, k, v, plan)
        # The block held last is kept for the backward's first step (one more key/value block per call until the
        # backward: it saves the transfer that would otherwise start the backward or end it).
        ctx.save_for_backward(q, k, v, out, lse, *last_kv)
        ctx.plan = plan
        ctx.set_materialize_grads(False)
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        q, k, v, out, lse, last_k, last_v = ctx.saved_tensors
        if dout is None:
            dout = torch.zeros_like(out)
        dq, dk, dv = ring_backward(dout, dlse, q, k, v, out, lse, (last_k, last_v), ctx.plan)
        return dq, dk, dv, None  # already in the inputs' dtypes
