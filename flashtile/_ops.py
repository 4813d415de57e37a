"""torch.library custom ops: the forward and backward kernels as opaque ops with fake (meta) implementations and
registered autograd, so torch.compile traces through them without graph breaks.

Where each op runs:
- CUDA tensors: the Triton kernels.
- CPU tensors with TRITON_INTERPRET=1 set before flashtile is imported: the same Triton kernels, interpreted (slow;
  this is how the CI tests the kernels).
- CPU tensors otherwise: the pure-PyTorch reference (flashtile.reference), with a one-time warning.

Eager calls (plain tensors, nothing tracing) reach the same implementations through _AttnFunction (`attention`),
without the dispatcher; whatever traces sees the ops.

Packed inputs: with k None, q is a packed qkv tensor (..., 3, H, D); with v None, k is a packed kv (..., 2, Hk, D).
The backward then returns one gradient for the packed tensor, written in place by the kernels (no concatenation).
"""
import os
import sys
import warnings
from typing import Optional

import torch

from . import reference
from .kernels import _common as _kernel_common
from .kernels import backward as _bwd_kernels
from .kernels import configs as _configs
from .kernels import forward as _fwd_kernels
from .kernels.features import Features
from .reference.dropout import dropout_mask

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


def _unpack(q, k, v):
    if k is None:
        return q.unbind(-3)
    if v is None:
        return (q,) + tuple(k.unbind(-3))
    return q, k, v


def _features(causal, window_left, window_right, softcap, alibi_slopes, attn_bias, sinks, dropout_p, seed,
              cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k):
    # Causal is the band's right edge at the diagonal (flash-attn: causal sets window_size[1] = 0).
    return Features(window_left=window_left, window_right=0 if causal else window_right, softcap=softcap,
                    alibi_slopes=alibi_slopes, attn_bias=attn_bias, sinks=sinks, dropout_p=dropout_p, seed=seed,
                    cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, max_seqlen_q=max_seqlen_q,
                    max_seqlen_k=max_seqlen_k)


def _reference_forward(q, k, v, scale, offset, feats: Features):
    """The CPU fallback's forward (float32 reference; differentiable, so the fallback backward is autograd)."""
    kw = dict(softmax_scale=scale, diagonal_offset=offset, window_size=(feats.window_left, feats.window_right),
              softcap=feats.softcap, sinks=feats.sinks, dropout_p=feats.dropout_p)
    seed = int(feats.seed.item()) if feats.dropout_p > 0 else 0

    def one(qb, kb, vb, slopes, b_index):
        mask_kw = {}
        if feats.attn_bias is not None:
            mask_kw["attn_mask" if feats.attn_bias.dtype == torch.bool else "attn_bias"] = feats.attn_bias
        if feats.dropout_p > 0:
            mask_kw["dropout_mask"] = dropout_mask(seed, qb.shape[0], qb.shape[2], qb.shape[1], kb.shape[1],
                                                   feats.dropout_p, batch_offset=b_index)
        out, lse = reference.naive_attention(qb.float(), kb.float(), vb.float(), alibi_slopes=slopes, **kw,
                                             **mask_kw)
        return out, lse

    if not feats.varlen:
        kw["diagonal_offset"] = offset
        out, lse = one(q, k, v, feats.alibi_slopes, 0)
        return out.to(q.dtype), lse.float()
    kw.pop("diagonal_offset")  # each sequence aligns to its own bottom-right
    cu_q, cu_k = feats.cu_seqlens_q.tolist(), feats.cu_seqlens_k.tolist()
    outs, lses = [], []
    for b in range(len(cu_q) - 1):
        slopes = feats.alibi_slopes
        if slopes is not None and slopes.dim() == 2:
            slopes = slopes[b]
        out, lse = one(q[None, cu_q[b]:cu_q[b + 1]], k[None, cu_k[b]:cu_k[b + 1]], v[None, cu_k[b]:cu_k[b + 1]],
                       slopes, b)
        outs.append(out[0])
        lses.append(lse[0])
    return torch.cat(outs).to(q.dtype), torch.cat(lses, dim=-1).float()


# The ops are defined through torch.library.Library with explicit schemas rather than torch.library.custom_op:
# custom_op wraps each implementation in torch._disable_dynamo, whose first call imports torch._dynamo (2-3 s per
# process on the GPU machine, benchmarks/NOTES.md). Fakes and autograd are registered the same way either way.
_LIB = torch.library.Library("flashtile", "DEF")  # noqa: TOR901 - the library lives as long as the module
_LIB.define("attn_fwd(Tensor q, Tensor? k, Tensor? v, float softmax_scale, bool causal, SymInt diagonal_offset, "
            "int window_left=-1, int window_right=-1, float softcap=0., Tensor? alibi_slopes=None, "
            "Tensor? attn_bias=None, Tensor? sinks=None, float dropout_p=0., Tensor? seed=None, "
            "Tensor? cu_seqlens_q=None, Tensor? cu_seqlens_k=None, int max_seqlen_q=0, int max_seqlen_k=0, "
            "bool deterministic=False) -> (Tensor, Tensor)")
_LIB.define("attn_bwd(Tensor dout, Tensor q, Tensor? k, Tensor? v, Tensor out, Tensor lse, Tensor? dlse, "
            "float softmax_scale, bool causal, SymInt diagonal_offset, int window_left=-1, int window_right=-1, "
            "float softcap=0., Tensor? alibi_slopes=None, Tensor? attn_bias=None, bool bias_requires_grad=False, "
            "Tensor? sinks=None, float dropout_p=0., Tensor? seed=None, Tensor? cu_seqlens_q=None, "
            "Tensor? cu_seqlens_k=None, int max_seqlen_q=0, int max_seqlen_k=0, bool deterministic=False) -> Tensor[]")


def _attn_fwd_impl(q: torch.Tensor, k: Optional[torch.Tensor], v: Optional[torch.Tensor], softmax_scale: float,
             causal: bool, diagonal_offset: int, window_left: int = -1, window_right: int = -1, softcap: float = 0.0,
             alibi_slopes: Optional[torch.Tensor] = None, attn_bias: Optional[torch.Tensor] = None,
             sinks: Optional[torch.Tensor] = None, dropout_p: float = 0.0, seed: Optional[torch.Tensor] = None,
             cu_seqlens_q: Optional[torch.Tensor] = None, cu_seqlens_k: Optional[torch.Tensor] = None,
             max_seqlen_q: int = 0, max_seqlen_k: int = 0,
             deterministic: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, lse fp32). deterministic only matters to the backward (saved for it). Query i sees key j iff j <= i + diagonal_offset when causal, and inside the window
    (left/right bounds relative to the same diagonal, -1 unbounded). Shapes: flashtile.kernels.forward."""
    q, k, v = _unpack(q, k, v)
    feats = _features(causal, window_left, window_right, softcap, alibi_slopes, attn_bias, sinks, dropout_p, seed,
                      cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    if _use_kernels(q):
        return _fwd_kernels.attention_forward(q, k, v, softmax_scale, diagonal_offset, feats)
    _warn_cpu_fallback()
    with torch.no_grad():
        return _reference_forward(q, k, v, softmax_scale, diagonal_offset, feats)


@torch.library.register_fake("flashtile::attn_fwd")
def _attn_fwd_fake(q, k, v, softmax_scale, causal, diagonal_offset, window_left=-1, window_right=-1, softcap=0.0,
                   alibi_slopes=None, attn_bias=None, sinks=None, dropout_p=0.0, seed=None, cu_seqlens_q=None,
                   cu_seqlens_k=None, max_seqlen_q=0, max_seqlen_k=0, deterministic=False):
    q, k, v = _unpack(q, k, v)
    out = q.new_empty(q.shape[:-1] + v.shape[-1:])
    if cu_seqlens_q is not None:
        lse = q.new_empty((q.shape[1], q.shape[0]), dtype=torch.float32)
    else:
        lse = q.new_empty((q.shape[0], q.shape[2], q.shape[1]), dtype=torch.float32)
    return out, lse


def _attn_bwd_impl(dout: torch.Tensor, q: torch.Tensor, k: Optional[torch.Tensor], v: Optional[torch.Tensor],
             out: torch.Tensor, lse: torch.Tensor, dlse: Optional[torch.Tensor], softmax_scale: float, causal: bool,
             diagonal_offset: int, window_left: int = -1, window_right: int = -1, softcap: float = 0.0,
             alibi_slopes: Optional[torch.Tensor] = None, attn_bias: Optional[torch.Tensor] = None,
             bias_requires_grad: bool = False, sinks: Optional[torch.Tensor] = None, dropout_p: float = 0.0,
             seed: Optional[torch.Tensor] = None, cu_seqlens_q: Optional[torch.Tensor] = None,
             cu_seqlens_k: Optional[torch.Tensor] = None, max_seqlen_q: int = 0,
             max_seqlen_k: int = 0, deterministic: bool = False) -> list[torch.Tensor]:
    """Gradients for attn_fwd: [dq, dk, dv] (packed inputs: [dqkv] or [dq, dkv]), then dbias if
    bias_requires_grad, then dsinks if sinks are given. dlse is the gradient reaching the returned LSE (None
    when the LSE is unused)."""
    packed_q, packed_k, v_in = q, k, v
    q, k, v = _unpack(q, k, v)
    feats = _features(causal, window_left, window_right, softcap, alibi_slopes, attn_bias, sinks, dropout_p, seed,
                      cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    if _use_kernels(q):
        # Packed inputs get one gradient buffer; the kernels write its q/k/v slices directly.
        dq = dk = dv = None
        if packed_k is None:
            grads = [_kernel_common.empty(packed_q.shape, q.dtype, q.device)]
            dq, dk, dv = grads[0].unbind(-3)
        elif v_in is None:
            grads = [_kernel_common.empty(q.shape, q.dtype, q.device),
                     _kernel_common.empty(packed_k.shape, k.dtype, k.device)]
            dq, (dk, dv) = grads[0], grads[1].unbind(-3)
        dq, dk, dv, dbias, dsinks = _bwd_kernels.attention_backward(
            dout, q, k, v, out, lse, dlse, softmax_scale, diagonal_offset, feats, dq=dq, dk=dk, dv=dv,
            bias_grad=bias_requires_grad, deterministic=deterministic)
        if packed_k is not None and v_in is not None:
            grads = [dq, dk, dv]
    else:
        _warn_cpu_fallback()
        grads, dbias, dsinks = _reference_backward(dout, packed_q, packed_k, v_in, out, lse, dlse, softmax_scale,
                                                   diagonal_offset, feats, bias_requires_grad)
    if bias_requires_grad:
        grads.append(dbias)
    if sinks is not None:
        grads.append(dsinks)
    return grads


def _reference_backward(dout, packed_q, packed_k, v_in, out, lse, dlse, scale, offset, feats, bias_requires_grad):
    """The CPU fallback's backward: the dense delta formula with the features (reference.attention_backward),
    in float32, per sequence for varlen batches."""
    q, k, v = _unpack(packed_q, packed_k, v_in)
    kw = dict(softmax_scale=scale, window_size=(feats.window_left, feats.window_right), softcap=feats.softcap,
              sinks=feats.sinks, dropout_p=feats.dropout_p, feature_grads=True)
    if feats.attn_bias is not None:
        kw["attn_mask" if feats.attn_bias.dtype == torch.bool else "attn_bias"] = feats.attn_bias
    seed = int(feats.seed.item()) if feats.dropout_p > 0 else 0

    def one(qb, kb, vb, ob, lb, dob, dlb, slopes, b_index, offset):
        if feats.dropout_p > 0:
            kw["dropout_mask"] = dropout_mask(seed, qb.shape[0], qb.shape[2], qb.shape[1], kb.shape[1],
                                              feats.dropout_p, batch_offset=b_index)
        return reference.attention_backward(qb.float(), kb.float(), vb.float(), ob.float(), lb, dob.float(),
                                            dlse=dlb, diagonal_offset=offset, alibi_slopes=slopes, **kw)

    if not feats.varlen:
        dq, dk, dv, dbias, dsinks = one(q, k, v, out, lse, dout, dlse, feats.alibi_slopes, 0, offset)
    else:
        cu_q, cu_k = feats.cu_seqlens_q.tolist(), feats.cu_seqlens_k.tolist()
        parts, dsinks = [], None
        for b in range(len(cu_q) - 1):
            rq, rk = slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1])
            slopes = feats.alibi_slopes
            if slopes is not None and slopes.dim() == 2:
                slopes = slopes[b]
            part = one(q[None, rq], k[None, rk], v[None, rk], out[None, rq], lse[None, :, rq], dout[None, rq],
                       None if dlse is None else dlse[None, :, rq], slopes, b,
                       (cu_k[b + 1] - cu_k[b]) - (cu_q[b + 1] - cu_q[b]))
            parts.append(part[:3])
            if part[4] is not None:
                dsinks = part[4] if dsinks is None else dsinks + part[4]
        dq, dk, dv = (torch.cat([p_[i][0] for p_ in parts]) for i in range(3))
        dbias = None
    dq, dk, dv = dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)
    if packed_k is None:
        grads = [torch.stack((dq, dk, dv), dim=-3)]
    elif v_in is None:
        grads = [dq, torch.stack((dk, dv), dim=-3)]
    else:
        grads = [dq, dk, dv]
    return grads, dbias, dsinks


@torch.library.register_fake("flashtile::attn_bwd")
def _attn_bwd_fake(dout, q, k, v, out, lse, dlse, softmax_scale, causal, diagonal_offset, window_left=-1,
                   window_right=-1, softcap=0.0, alibi_slopes=None, attn_bias=None, bias_requires_grad=False,
                   sinks=None, dropout_p=0.0, seed=None, cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=0,
                   max_seqlen_k=0, deterministic=False):
    # The kernels allocate contiguous gradients whatever the input strides.
    grads = [t.new_empty(t.shape) for t in (q, k, v) if t is not None]
    if bias_requires_grad:
        grads.append(attn_bias.new_empty(attn_bias.shape))
    if sinks is not None:
        grads.append(sinks.new_empty(sinks.shape))
    return grads


# Positions of attn_fwd's tensor inputs that can take a gradient.
_BIAS_INPUT, _SINKS_INPUT = 10, 11
_NUM_INPUTS = 19


def _attn_fwd_setup_context(ctx, inputs, output):
    (q, k, v, softmax_scale, causal, diagonal_offset, window_left, window_right, softcap, alibi_slopes, attn_bias,
     sinks, dropout_p, seed, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, deterministic) = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, alibi_slopes, attn_bias, sinks, seed, cu_seqlens_q, cu_seqlens_k)
    ctx.scalars = (softmax_scale, causal, diagonal_offset, window_left, window_right, softcap)
    ctx.dropout_p = dropout_p
    ctx.max_seqlens = (max_seqlen_q, max_seqlen_k)
    ctx.deterministic = deterministic
    # Unused outputs get None rather than a materialised zero tensor (the LSE usually is unused).
    ctx.set_materialize_grads(False)


def _attn_fwd_backward(ctx, dout, dlse, backward=None):
    """attn_fwd's backward: attn_bwd through the dispatcher (so that tracers see it), or the given implementation
    (_AttnFunction: eager calls)."""
    q, k, v, out, lse, alibi_slopes, attn_bias, sinks, seed, cu_q, cu_k = ctx.saved_tensors
    if dout is None:
        dout = torch.zeros_like(out)
    elif dout.stride(-1) != 1:  # the kernels need a unit stride along headdim (an expanded grad has 0)
        dout = dout.contiguous()
    softmax_scale, causal, diagonal_offset, window_left, window_right, softcap = ctx.scalars
    bias_requires_grad = attn_bias is not None and ctx.needs_input_grad[_BIAS_INPUT]
    grads = (backward or attn_bwd)(dout, q, k, v, out, lse, dlse, softmax_scale, causal, diagonal_offset,
                                   window_left, window_right, softcap, alibi_slopes, attn_bias, bias_requires_grad,
                                   sinks, ctx.dropout_p, seed, cu_q, cu_k, *ctx.max_seqlens, ctx.deterministic)
    result = [None] * _NUM_INPUTS
    n_main = sum(t is not None for t in (q, k, v))
    result[:n_main] = grads[:n_main]
    rest = list(grads[n_main:])
    if bias_requires_grad:
        result[_BIAS_INPUT] = rest.pop(0)
    if sinks is not None:
        result[_SINKS_INPUT] = rest.pop(0)
    return tuple(result)


class _AttnFunction(torch.autograd.Function):
    """attn_fwd with its autograd, without the dispatcher: what eager calls run (see eager). The op's schema
    handling in torch's register_autograd (fill_defaults re-reads the schema once per argument) and the dispatcher
    cost ~0.2 ms of host time per call on the GPU machines' hosts, as long as a small call's kernel
    (benchmarks/NOTES.md, "host overhead")."""

    @staticmethod
    def forward(ctx, *inputs):
        output = _attn_fwd_impl(*inputs)
        _attn_fwd_setup_context(ctx, inputs, output)
        return output

    @staticmethod
    def backward(ctx, dout, dlse):
        return _attn_fwd_backward(ctx, dout, dlse, _attn_bwd_impl)


# False: every call goes through the dispatcher (for comparisons: benchmarks/NOTES.md).
EAGER_DIRECT = True


def eager(*tensors):
    """True when a call may run _AttnFunction instead of the op: plain tensors (None allowed) and nothing tracing
    (torch.compile, FakeTensor and other dispatch modes, functorch transforms), all of which still see the op.
    Torch-function modes are not consulted: torch.set_default_device installs one, and no tracer relies on one to
    see a custom op."""
    return (EAGER_DIRECT and all(t is None or type(t) is torch.Tensor for t in tensors)
            and not torch.compiler.is_compiling() and not torch._C._len_torch_dispatch_stack()
            and not torch._C._are_functorch_transforms_active())


def attention(*inputs):
    """attn_fwd(*inputs) with its autograd: through _AttnFunction when eager(q, k, v), else through the op."""
    if eager(*inputs[:3]):
        return _AttnFunction.apply(*inputs)
    return attn_fwd(*inputs)


for _device in ("CPU", "CUDA"):
    _LIB.impl("attn_fwd", _attn_fwd_impl, _device)
    _LIB.impl("attn_bwd", _attn_bwd_impl, _device)
attn_fwd = torch.ops.flashtile.attn_fwd.default
attn_bwd = torch.ops.flashtile.attn_bwd.default
torch.library.register_autograd("flashtile::attn_fwd", _attn_fwd_backward, setup_context=_attn_fwd_setup_context)
