"""The one place flashtile.distributed reaches into flashtile's internals: the local attention of one block.

Every context-parallel scheme here runs the same two calls on the tokens one rank holds:
- block_forward(q, k, v, block) -> (out, lse): attention of some query rows over some key rows, with the mask
  placed by an explicit diagonal offset (the block's position in the global sequence);
- block_backward(dout, q, k, v, out, lse, dlse, block) -> (dq, dk, dv) in float32, where out and lse are the
  FINAL (merged) output and LSE of those query rows, so that P = exp(S - lse) and delta = rowsum(dO * O) are the
  global ones (docs/derivation.md, ch. 6 and 7).
plus the argument checks of the public API and, for Ulysses, the public flash_attn_func.

A Block becomes an AttentionRequest (flashtile/request.py) and flashtile.dispatch picks the backend, as for any
call. Block outputs and block gradients are float32 whatever the inputs' dtype, so that merging and summing them
over the ring adds no rounding per step (docs/distributed.md, "Precision"): the backward hands the chosen backend
float32 gradient buffers, and the forward asks the chosen backend for a float32 output (out_dtype), or runs the
reference on float32 copies of the inputs.

# q, out: [B, Sq, Hq, D(v)]   k, v: [B, Sk, Hk, D(v)]   lse: [B, Hq, Sq] fp32
# varlen blocks: q [total_q, Hq, D], k, v [total_k, Hk, D], lse [Hq, total_q]
"""
import dataclasses
from typing import Optional

import torch

from .. import _validate, dispatch
from ..interface import flash_attn_func
from ..request import AttentionRequest

# The public API's argument checks (each raises TypeError/ValueError naming the value and the fix).
check_qkv = _validate.check_qkv
check_window = _validate.check_window
check_softcap = _validate.check_softcap
check_dropout = _validate.check_dropout
check_alibi = _validate.check_alibi
resolve_scale = _validate.resolve_scale
local_attention = flash_attn_func  # Ulysses: the whole sequence of some heads is an ordinary local call
use_kernels = dispatch.uses_kernels  # whether tensors like t run Triton kernels (the merge kernel follows suit)


@dataclasses.dataclass(frozen=True)
class Varlen:
    """A packed batch for one block call: the same sequences on the query and key side (self-attention pieces).
    cu_seqlens: int32 (n + 1,) on the inputs' device; max_seqlen: the longest."""
    cu_seqlens: torch.Tensor
    max_seqlen: int


@dataclasses.dataclass(frozen=True)
class Block:
    """How one block call masks and modifies its scores.

    softmax_scale > 0 (the kernels take the row max before scaling). causal / window = (left, right) (-1 unbounded)
    are placed by diagonal_offset: query row i sees key row j iff i + offset - left <= j <= i + offset + right
    (right = 0 when causal). ALiBi adds -slope * |i + offset - j|. With varlen, each sequence aligns to its own
    bottom-right corner instead and diagonal_offset is unused. alibi_slopes: fp32 (H,) or (B, H)."""
    softmax_scale: float
    causal: bool = False
    diagonal_offset: int = 0
    window: tuple = (-1, -1)
    softcap: float = 0.0
    alibi_slopes: Optional[torch.Tensor] = None
    deterministic: bool = False
    varlen: Optional[Varlen] = None

    def request(self):
        """The block as an AttentionRequest (causal is the band's right edge at the diagonal)."""
        cu = None if self.varlen is None else self.varlen.cu_seqlens
        longest = 0 if self.varlen is None else self.varlen.max_seqlen
        return AttentionRequest(softmax_scale=self.softmax_scale, diagonal_offset=self.diagonal_offset,
                                window_left=self.window[0], window_right=0 if self.causal else self.window[1],
                                softcap=self.softcap, alibi_slopes=self.alibi_slopes, cu_seqlens_q=cu,
                                cu_seqlens_k=cu, max_seqlen_q=longest, max_seqlen_k=longest,
                                deterministic=self.deterministic)


def block_forward(q, k, v, block: Block):
    """(out, lse), both float32 (lse natural log), of q's rows over k/v's rows under `block`. Shapes: module
    docstring. A row that sees no key gets out 0 and lse -inf."""
    req = block.request()
    with torch.no_grad():
        if not use_kernels(q):  # the reference, on float32 copies: it computes in the inputs' dtype's rounding
            return dispatch.choose_forward(q, k, v, req).forward(q.float(), k.float(), v.float(), req)
        return dispatch.forward(q, k, v, req, out_dtype=torch.float32)  # a plan after the first call


def block_backward(dout, q, k, v, out, lse, dlse, block: Block, buffers=(None, None, None), dq_addend=None):
    """(dq, dk, dv): the block's share of the gradients, given the final out and lse of q's rows (and dlse, the
    gradient reaching lse, or None), in float32. dk and dv sum over the query heads of each kv head. buffers:
    tensors shaped like q, k, v (any strides, e.g. rows of an accumulator) to write them into, None: fresh float32
    ones. dq_addend: None, or a float32 tensor shaped like q: dq is then dq_addend plus the block's share, added in
    float32 and rounded once into buffers[0] (of any float dtype; the Gluon backward adds it in its dQ pass)."""
    req = block.request()
    dout = dout if dout.stride(-1) == 1 else dout.contiguous()
    grads = tuple(torch.empty(t.shape, dtype=torch.float32, device=t.device) if b is None else b
                  for t, b in zip((q, k, v), buffers))
    if not use_kernels(q):  # the reference, on float32 copies: its gradients come in the inputs' dtype
        dout, q, k, v, out = (t.float() for t in (dout, q, k, v, out))
    dispatch.backward(dout, q, k, v, out, lse, dlse, req, False, buffers=grads,  # a plan after the first call
                      dq_addend=dq_addend)
    return grads
