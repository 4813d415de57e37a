"""The one place flashtile.distributed reaches into flashtile's internals: the local attention of one block.

Every context-parallel scheme here runs the same two calls on the tokens one rank holds:
- block_forward(q, k, v, block) -> (out, lse): attention of some query rows over some key rows, with the mask
  placed by an explicit diagonal offset (the block's position in the global sequence);
- block_backward(dout, q, k, v, out, lse, dlse, block) -> (dq, dk, dv) in float32, where out and lse are the
  FINAL (merged) output and LSE of those query rows, so that P = exp(S - lse) and delta = rowsum(dO * O) are the
  global ones (docs/derivation.md, ch. 6 and 7).
plus the argument checks of the public API and, for Ulysses, the public flash_attn_func.

Today they sit on the kernels' launchers (kernels.forward.attention_forward with out_dtype, and
kernels.backward.attention_backward with output buffers) and, for CPU tensors without TRITON_INTERPRET, on
flashtile._ops' reference fallbacks. Block outputs and block gradients are float32 whatever the inputs' dtype, so
that merging and summing them over the ring adds no rounding per step: the error of a W-rank result is the error
of one device's (docs/distributed.md, "Precision").

# q, out: [B, Sq, Hq, D(v)]   k, v: [B, Sk, Hk, D(v)]   lse: [B, Hq, Sq] fp32
# varlen blocks: q [total_q, Hq, D], k, v [total_k, Hk, D], lse [Hq, total_q]
"""
import dataclasses
from typing import Optional

import torch

from .. import _ops, _validate
from ..interface import flash_attn_func
from ..kernels import backward as _bwd_kernels
from ..kernels import forward as _fwd_kernels

# The public API's argument checks (each raises TypeError/ValueError naming the value and the fix).
check_qkv = _validate.check_qkv
check_window = _validate.check_window
check_softcap = _validate.check_softcap
check_dropout = _validate.check_dropout
check_alibi = _validate.check_alibi
resolve_scale = _validate.resolve_scale
local_attention = flash_attn_func  # Ulysses: the whole sequence of some heads is an ordinary local call


def use_kernels(t):
    """Whether flashtile runs Triton kernels for tensors like t (CUDA, or the CPU under TRITON_INTERPRET=1): the
    distributed merge kernel follows the same rule."""
    return _ops._use_kernels(t)


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

    def _varlen_args(self):
        if self.varlen is None:
            return None, None, 0, 0
        cu, n = self.varlen.cu_seqlens, self.varlen.max_seqlen
        return cu, cu, n, n


def block_forward(q, k, v, block: Block):
    """(out, lse), both float32 (lse natural log), of q's rows over k/v's rows under `block`. Shapes: module
    docstring. A row that sees no key gets out 0 and lse -inf."""
    cu_q, cu_k, max_q, max_k = block._varlen_args()
    window_left, window_right = block.window
    with torch.no_grad():
        if not _ops._use_kernels(q):
            # The float32 reference (CPU without the interpreter): float32 inputs give a float32 output.
            return _ops._attn_fwd_impl(q.float(), k.float(), v.float(), block.softmax_scale, block.causal,
                                       block.diagonal_offset, window_left, window_right, block.softcap,
                                       block.alibi_slopes, None, None, 0.0, None, cu_q, cu_k, max_q, max_k,
                                       block.deterministic)
        feats = _ops._features(block.causal, window_left, window_right, block.softcap, block.alibi_slopes, None,
                               None, 0.0, None, cu_q, cu_k, max_q, max_k)
        return _fwd_kernels.attention_forward(q, k, v, block.softmax_scale, block.diagonal_offset, feats,
                                              out_dtype=torch.float32)


def block_backward(dout, q, k, v, out, lse, dlse, block: Block):
    """(dq, dk, dv) in float32: the block's share of the gradients, given the final out and lse of q's rows (and
    dlse, the gradient reaching lse, or None). dk and dv sum over the query heads of each kv head."""
    dout = dout if dout.stride(-1) == 1 else dout.contiguous()
    cu_q, cu_k, max_q, max_k = block._varlen_args()
    window_left, window_right = block.window
    if not _ops._use_kernels(q):
        # The float32 reference (CPU without the interpreter): float32 inputs give float32 gradients.
        grads = _ops._attn_bwd_impl(dout.float(), q.float(), k.float(), v.float(), out.float(), lse, dlse,
                                    block.softmax_scale, block.causal, block.diagonal_offset, window_left,
                                    window_right, block.softcap, block.alibi_slopes, None, False, None, 0.0, None,
                                    cu_q, cu_k, max_q, max_k, block.deterministic)
        return tuple(grads[:3])
    feats = _ops._features(block.causal, window_left, window_right, block.softcap, block.alibi_slopes, None, None,
                           0.0, None, cu_q, cu_k, max_q, max_k)
    dq, dk, dv = (torch.empty(t.shape, dtype=torch.float32, device=t.device) for t in (q, k, v))
    dq, dk, dv, _, _ = _bwd_kernels.attention_backward(dout, q, k, v, out, lse, dlse, block.softmax_scale,
                                                       block.diagonal_offset, feats, dq=dq, dk=dk, dv=dv,
                                                       deterministic=block.deterministic)
    return dq, dk, dv
