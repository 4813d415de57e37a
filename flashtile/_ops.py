"""torch.library custom ops: the forward and backward kernels as opaque ops with fake (meta) implementations and
registered autograd, so torch.compile traces through them without graph breaks.

Where each op runs:
- CUDA tensors: the Triton kernels.
- CPU tensors with TRITON_INTERPRET=1 set before flashtile is imported: the same Triton kernels, interpreted (slow;
  this is how the CI tests the kernels).
- CPU tensors otherwise: the pure-PyTorch reference (flashtile.reference), with a one-time warning.
"""
import os
import sys
import warnings
from typing import Optional

import torch

from . import reference
from .kernels import backward as _bwd_kernels
from .kernels import configs as _configs
from .kernels import forward as _fwd_kernels

_warned_cpu_fallback = False


def _use_kernels(t):
    return t.is_cuda or _configs.INTERPRETING


_INTERNAL_DIRS = (os.path.dirname(os.path.abspath(torch.__file__)), os.path.dirname(os.path.abspath(__file__)))


def _user_stacklevel():
    """stacklevel of the first frame outside torch and flashtile: the op is reached through torch's dispatcher
    (forward) or its autograd engine (backward), so no fixed depth points at the caller."""
    level, frame = 1, sys._getframe(1)
    while frame is not None and os.path.abspath(frame.f_code.co_filename).startswith(_INTERNAL_DIRS):
        frame, level = frame.f_back, level + 1
    return level


def _warn_cpu_fallback():
    global _warned_cpu_fallback
    if not _warned_cpu_fallback:
        _warned_cpu_fallback = True
        warnings.warn("flashtile: CPU tensors run the pure-PyTorch reference implementation (O(seqlen^2) memory). "
                      "Set TRITON_INTERPRET=1 before importing flashtile to run the Triton kernels in Triton's "
                      "interpreter instead, or move the tensors to a CUDA GPU.", stacklevel=_user_stacklevel())


@torch.library.custom_op("flashtile::attn_fwd", mutates_args=(), device_types=("cuda", "cpu"))
def attn_fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, softmax_scale: float, causal: bool,
             diagonal_offset: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(out [B, Sq, Hq, D], lse [B, Hq, Sq] fp32). Query i sees key j iff j <= i + diagonal_offset when causal."""
    if _use_kernels(q):
        return _fwd_kernels.attention_forward(q, k, v, softmax_scale, causal, diagonal_offset)
    _warn_cpu_fallback()
    out, lse = reference.naive_attention(q.float(), k.float(), v.float(), softmax_scale=softmax_scale,
                                         causal=causal, diagonal_offset=diagonal_offset)
    return out.to(q.dtype), lse.float()


@attn_fwd.register_fake
def _attn_fwd_fake(q, k, v, softmax_scale, causal, diagonal_offset):
    batch, seqlen_q, num_heads, head_dim = q.shape
    out = q.new_empty((batch, seqlen_q, num_heads, head_dim))
    lse = q.new_empty((batch, num_heads, seqlen_q), dtype=torch.float32)
    return out, lse


@torch.library.custom_op("flashtile::attn_bwd", mutates_args=(), device_types=("cuda", "cpu"))
def attn_bwd(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
             lse: torch.Tensor, dlse: Optional[torch.Tensor], softmax_scale: float, causal: bool,
             diagonal_offset: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv) for attn_fwd; dlse is the gradient reaching the returned LSE (None when the LSE is unused)."""
    if _use_kernels(q):
        return _bwd_kernels.attention_backward(dout, q, k, v, out, lse, dlse, softmax_scale, causal,
                                               diagonal_offset)
    _warn_cpu_fallback()
    return reference.attention_backward(q, k, v, out, lse, dout, softmax_scale=softmax_scale, causal=causal,
                                        diagonal_offset=diagonal_offset, dlse=dlse)


@attn_bwd.register_fake
def _attn_bwd_fake(dout, q, k, v, out, lse, dlse, softmax_scale, causal, diagonal_offset):
    # The kernels allocate contiguous gradients whatever the input strides.
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _attn_fwd_setup_context(ctx, inputs, output):
    q, k, v, softmax_scale, causal, diagonal_offset = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse)
    ctx.softmax_scale = softmax_scale
    ctx.causal = causal
    ctx.diagonal_offset = diagonal_offset
    # Unused outputs get None rather than a materialised zero tensor (the LSE usually is unused).
    ctx.set_materialize_grads(False)


def _attn_fwd_backward(ctx, dout, dlse):
    q, k, v, out, lse = ctx.saved_tensors
    if dout is None:
        dout = torch.zeros_like(out)
    elif dout.stride(-1) != 1:  # the kernels need a unit stride along headdim (an expanded grad has 0)
        dout = dout.contiguous()
    dq, dk, dv = attn_bwd(dout, q, k, v, out, lse, dlse, ctx.softmax_scale, ctx.causal, ctx.diagonal_offset)
    return dq, dk, dv, None, None, None


attn_fwd.register_autograd(_attn_fwd_backward, setup_context=_attn_fwd_setup_context)
