"""The ring engine shared by ring_flash_attn_func, zigzag_ring_flash_attn_func and ring_flash_attn_varlen_func.

W ranks; at step s rank r holds the key/value block of rank (r - s) mod W, computes its pieces (_plan) against its
own queries, and passes the block on to rank r + 1 while the next one arrives from rank r - 1.

Forward (docs/derivation.md, ch. 7): each piece returns (out_i, lse_i) over its keys, both float32; they are
merged in float32 (_merge.merge_into),
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
from ._merge import add_rounded, merge_into
from ._plan import FULL, MASKED, SKIP, Mask, Piece


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


# The first step's first piece is cut in two (split_lead) when its part has at least LEAD[0] query rows, at a
# multiple of LEAD[1]: the exchange of the step's block is posted after the first part, and NCCL's transfer kernel
# gets SMs when that part's persistent programs retire, instead of waiting for the whole step (docs/distributed.md,
# "The first exchange").
LEAD = (1024, 128)


def split_lead(pieces, mask: Mask, lead=None):
    """pieces with the first one cut at a query row into two pieces (the part above it: a quarter of the first's
    work under a causal mask, a quarter of its rows without one), or unchanged when it is packed (varlen) or the
    part would be smaller than lead[0] (default LEAD) rows."""
    min_rows, granule = lead or LEAD
    if not pieces or pieces[0].varlen is not None:
        return list(pieces)
    first = pieces[0]
    n_q, n_k = first.q1 - first.q0, first.k1 - first.k0
    rows = (n_q // 2 if first.masked else n_q // 4) // granule * granule
    if rows < min_rows:
        return list(pieces)
    parts = []
    for q0, q1, offset in ((first.q0, first.q0 + rows, first.offset), (first.q0 + rows, first.q1, first.offset + rows)):
        kind = mask.classify(q1 - q0, n_k, offset) if first.masked else FULL
        if kind != SKIP:
            parts.append(Piece(q0, q1, first.k0, first.k1, offset, kind == MASKED, None, first.seq_ids))
    return parts + list(pieces[1:])


def _disjoint_from(piece: Piece, others):
    return all(p.q1 <= piece.q0 or p.q0 >= piece.q1 for p in others)


class _Running:
    """The running (out, lse) of the local query rows, in float32, as disjoint row segments (lo, hi, out, lse):
    a piece's result becomes the segment of the rows no earlier piece reached (a view of the block's output: no
    copy) and is merged into the segments of the rows reached before. finish() assembles the call's output in q's
    dtype and its LSE; a merge marked `final` (the last one of its rows) writes into them directly, so that the
    rounding costs no pass of its own. A row a block saw no key of comes as out 0 and LSE -inf (block_forward's
    contract), so a segment taken as it is needs no fix-up."""

    def __init__(self, q, head_dim_v):
        self.segments = []
        self.shape = q.shape[:-1] + (head_dim_v,)
        self.dtype, self.device = q.dtype, q.device
        self.out = self.lse = None  # the call's result, allocated by the first final merge (or finish)
        self.done = []  # row ranges already in it

    def _result(self):
        if self.out is None:
            batch, n_rows, heads = self.shape[:3]
            self.out = torch.empty(self.shape, dtype=self.dtype, device=self.device)
            self.lse = torch.empty((batch, heads, n_rows), dtype=torch.float32, device=self.device)
        return self.out, self.lse

    def add(self, q0, q1, out_i, lse_i, final=False):
        """Fold a piece's (out_i, lse_i) over local query rows [q0, q1) in."""
        fresh, cursor = [], q0
        for lo, hi, out, lse in sorted(self.segments, key=lambda seg: seg[0]):
            a, b = max(lo, q0), min(hi, q1)
            if a >= b:
                continue
            if cursor < a:
                fresh.append((cursor, a, out_i[:, cursor - q0:a - q0], lse_i[:, :, cursor - q0:a - q0]))
            acc, acc_lse = out[:, a - lo:b - lo], lse[:, :, a - lo:b - lo]
            dst, dst_lse = acc, acc_lse
            if final:
                result, result_lse = self._result()
                dst, dst_lse = result[:, a:b], result_lse[:, :, a:b]
                self.done.append((a, b))
            merge_into(dst, dst_lse, acc, acc_lse, out_i[:, a - q0:b - q0], lse_i[:, :, a - q0:b - q0])
            cursor = b
        if cursor < q1:
            fresh.append((cursor, q1, out_i[:, cursor - q0:], lse_i[:, :, cursor - q0:]))
        self.segments += fresh

    def finish(self):
        """(out in q's dtype, lse float32) of every local row; rows no piece reached get 0 and -inf."""
        n_rows = self.shape[1]
        if self.out is None and len(self.segments) == 1 and self.segments[0][:2] == (0, n_rows):
            _, _, out, lse = self.segments[0]
            return out.to(self.dtype), lse
        result, result_lse = self._result()
        reached = 0
        for lo, hi, out, lse in sorted(self.segments, key=lambda seg: seg[0]):
            if lo > reached:
                result[:, reached:lo].zero_()
                result_lse[:, :, reached:lo].fill_(float("-inf"))
            for a, b in _subtract((lo, hi), self.done):
                result[:, a:b].copy_(out[:, a - lo:b - lo])
                result_lse[:, :, a:b].copy_(lse[:, :, a - lo:b - lo])
            reached = hi
        if reached < n_rows:
            result[:, reached:].zero_()
            result_lse[:, :, reached:].fill_(float("-inf"))
        return result, result_lse


def _subtract(span, ranges):
    """The parts of row range span outside every range of `ranges`."""
    parts = [span]
    for a, b in ranges:
        parts = [piece for lo, hi in parts for piece in ((lo, min(hi, a)), (max(lo, b), hi)) if piece[0] < piece[1]]
    return parts


def _forward_piece(q, kv, piece, plan, running, final):
    """Compute one piece and fold its partial result into `running` (final: its merges are the rows' last)."""
    out_i, lse_i = block_forward(_rows(q, piece), _rows(kv[0], piece, True), _rows(kv[1], piece, True),
                                 _block(plan.options, piece))
    q0, q1 = (0, q.shape[1]) if piece.varlen is not None else (piece.q0, piece.q1)
    running.add(q0, q1, _unpack(out_i, piece), _unpack(lse_i, piece), final)


def ring_forward(q, k, v, plan: RingPlan):
    """(out in q's dtype, lse fp32, the key/value block held last) of the local queries over the whole ring. The
    block held last is rank + 1's (the rank's own with one rank): the backward starts with it."""
    comm = plan.comm
    running = _Running(q, v.shape[-1])
    kv = (k, v)
    # The first step computes the rank's own block before the ranks compare their arguments (plan.agree), so that
    # the GPU works while the host compares them and posts the first exchange. That exchange then goes from a side
    # stream that waits only for what was queued before the first step (`ready`), so it still travels during it;
    # it is posted after the step's first piece, which split_lead cuts short, so that NCCL's kernel finds SMs
    # free early in the step.
    agree = plan.agree
    ready = _comm.queued_event(q) if agree is not None else None
    for step, pieces in enumerate(plan.steps):
        more = step + 1 < comm.world
        pending = _comm.RingExchange(comm, kv) if more and agree is None else None
        last = step + 1 == len(plan.steps)
        if step == 0 and more:
            pieces = split_lead(pieces, plan.options.mask)
        for i, piece in enumerate(pieces):
            try:
                _forward_piece(q, kv, piece, plan, running, last and _disjoint_from(piece, pieces[i + 1:]))
            except Exception as error:  # noqa: BLE001 - every rank hears of it before any transfer, then it is raised
                if agree is not None:
                    agree(error)
                raise
            if agree is not None:  # after the first piece
                agree, pending = None, _agree_and_post(plan, kv, ready, more)
        if agree is not None:  # a first step with no piece
            agree, pending = None, _agree_and_post(plan, kv, ready, more)
        if pending is not None:
            kv = tuple(pending.wait())
    out, lse = running.finish()
    return out, lse, kv


def _agree_and_post(plan: RingPlan, kv, ready, more):
    """Compare the ranks' arguments, then post the first exchange (None if there is none)."""
    plan.agree()
    return _comm.RingExchange(plan.comm, kv, after=ready) if more else None


def _zeroed_outside(like, lo, hi):
    """A float32 tensor shaped like `like` whose rows outside [lo, hi) are zero: an accumulator whose first
    contribution, over rows [lo, hi), a kernel writes straight into it (no copy)."""
    acc = torch.empty(like.shape, dtype=torch.float32, device=like.device)
    acc[:, :lo].zero_()
    acc[:, hi:].zero_()
    return acc


def _add_rows(acc, grad, lo, hi):
    """acc[:, lo:hi] += grad; acc None: grad is the first contribution and the accumulator (a first contribution
    over only some rows never comes here: _step_backward has the kernel write it into a _zeroed_outside one)."""
    if acc is None:
        return grad
    acc[:, lo:hi] += grad
    return acc


def _covers(parts, n):
    """The only part, when it spans all n rows (else None)."""
    return parts[0] if len(parts) == 1 and parts[0][0] == 0 and parts[0][1] == n else None


def _piece_backward(dout, dlse, q, kv, out, lse, piece, options, buffers, dq_addend=None):
    """(dq, dk, dv) of one piece, float32, in [B, rows, H, D] (a packed piece's with B = 1), written into
    `buffers` where given (views of accumulators; None: fresh tensors). dq_addend: None, or the running float32
    dq of the piece's rows, which dq then adds, rounded once into buffers[0]'s dtype (block_backward)."""
    grads = block_backward(_rows(dout, piece), _rows(q, piece), _rows(kv[0], piece, True), _rows(kv[1], piece, True),
                           _rows(out, piece), _lse_rows(lse, piece), None if dlse is None else _lse_rows(dlse, piece),
                           _block(options, piece), buffers, dq_addend)
    return tuple(_unpack(g, piece) for g in grads)


def _step_backward(dout, dlse, q, kv, out, lse, dq, pieces, options, dq_dtype=None, fresh_keys=False):
    """One step's pieces: returns dq with their query gradients added (dq None: none yet), the key accumulators
    (dk, dv) the step's first piece wrote into (fresh_keys: the step starts them, no accumulator travelled here;
    None where it did not) and this step's other key gradients as a list of (first key row, last + 1, dk, dv)
    parts of the key block. An accumulator's first contribution that covers only some rows is written by the
    kernel straight into its rows, the others zeroed. dq_dtype: the last step's, where dq comes back in that dtype
    (dq plus one piece over every row: the piece's dQ pass adds dq and rounds, block_backward's dq_addend)."""
    parts, keys = [], None
    n_q, n_k = q.shape[1], kv[0].shape[1]
    for piece in pieces:
        q0, q1, k0, k1 = (0, n_q, 0, n_k) if piece.varlen is not None else (piece.q0, piece.q1, piece.k0, piece.k1)
        buffers, addend = [None, None, None], None
        if dq is None and (q0, q1) != (0, n_q):
            dq = _zeroed_outside(q, q0, q1)
            buffers[0] = dq[:, q0:q1]
        elif dq_dtype is not None and dq is not None and len(pieces) == 1 and (q0, q1) == (0, n_q):
            addend, buffers[0] = _rows(dq, piece), _rows(torch.empty(q.shape, dtype=dq_dtype, device=q.device), piece)
        if fresh_keys and keys is None and not parts and (k0, k1) != (0, n_k):
            keys = tuple(_zeroed_outside(t, k0, k1) for t in kv)
            buffers[1:] = keys[0][:, k0:k1], keys[1][:, k0:k1]
        dq_i, dk_i, dv_i = _piece_backward(dout, dlse, q, kv, out, lse, piece, options, buffers, addend)
        if buffers[1] is None:
            parts.append((k0, k1, dk_i, dv_i))
        if addend is not None:
            return dq_i, keys, parts
        if buffers[0] is not None:
            continue
        dq = _add_rows(dq, dq_i, q0, q1)
    if dq_dtype is not None and dq is not None:
        dq = dq.to(dq_dtype)
    return dq, keys, parts


def _fold(acc, parts, kv, dtypes=None):
    """The key block's (dk, dv): acc (the float32 accumulators that travelled here or the step started, or None)
    with this step's parts added in their rows, in float32; dtypes: the last step's (k's and v's), where they come
    back rounded to them (acc plus one part over every row: added and rounded in one pass)."""
    whole = _covers(parts, kv[0].shape[1])
    if dtypes is not None and acc is not None and whole is not None:
        return add_rounded(acc[0], whole[2], dtypes[0]), add_rounded(acc[1], whole[3], dtypes[1])
    dk, dv = acc if acc is not None else (None, None)
    for k0, k1, dk_i, dv_i in parts:
        dk = _add_rows(dk, dk_i, k0, k1)
        dv = _add_rows(dv, dv_i, k0, k1)
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
        dq, keys, parts = _step_backward(dout, dlse, q, kv, out, lse, dq, plan.steps[step], plan.options,
                                         q.dtype if last else None, fresh_keys=travelling is None)
        dk, dv = _fold(keys if travelling is None else travelling.wait(), parts, kv,
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
