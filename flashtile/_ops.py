"""torch.library custom ops for attention, derived from the request's fields, with fakes and autograd.

    flashtile::attn_fwd(Tensor q, Tensor? k, Tensor? v, <AttentionRequest fields>) -> (Tensor out, Tensor lse)
    flashtile::attn_bwd(Tensor dout, Tensor q, Tensor? k, Tensor? v, Tensor out, Tensor lse, Tensor? dlse,
                        bool bias_requires_grad, <AttentionRequest fields>) -> Tensor[]

The trailing arguments are AttentionRequest's fields in declaration order (request.py): the schemas, the fakes,
the autograd context and the gradient slots of attn_bias and sinks all come from that list, never from positions
kept by hand. Which backend runs a call (Gluon, portable Triton, the reference) is dispatch.py's decision.

Eager calls (plain tensors, nothing tracing) reach the same implementations through _AttnFunction (`attention`),
without the dispatcher's host time; torch.compile, FakeTensor and other dispatch modes and functorch transforms see
the ops. Packed inputs: with k None, q is a packed qkv tensor (..., 3, H, D); with v None, k is a packed kv
(..., 2, Hk, D); the backward then returns one gradient for the packed tensor, written in place by the kernels.

Double backward is not supported: a second differentiation through the attention raises a RuntimeError that says
so (the gradients themselves are computed by kernels that have no derivative of their own). Under torch.func
transforms the call runs _TransformAttn: grad, vjp and jacrev differentiate it once, vmap batches it and vmap of grad
too (the ops run once per sample), and forward mode (jvp, jacfwd, hessian, torch.autograd.forward_ad) raises a
RuntimeError that says it is not supported, as does grad of grad.
"""
import functools

import torch
from torch.autograd import forward_ad as _forward_ad

from . import _ahead, _values, dispatch
from ._settings import SETTINGS
from .request import AttentionRequest

_FIELDS = AttentionRequest.field_names()
_NUM_TENSORS_FWD = 3  # q, k, v
# Op argument index of each input besides q, k, v that can take a gradient (attn_bias, sinks).
_GRAD_SLOTS = {name: _NUM_TENSORS_FWD + AttentionRequest.position(name) for name in AttentionRequest.GRAD_FIELDS}
_NUM_INPUTS = _NUM_TENSORS_FWD + len(_FIELDS)

_DOUBLE_BACKWARD = ("flashtile's attention backward is not differentiable: a second derivative through it (e.g. "
                    "torch.autograd.grad(..., create_graph=True) followed by a backward of the gradients) is not "
                    "supported. Compute gradient penalties with a double-differentiable attention (e.g. "
                    "flashtile.reference.naive_attention, or torch's math SDPA backend) for that term.")
_FORWARD_AD = ("flashtile's attention has no forward-mode derivative: torch.func.jvp, jacfwd, hessian and "
               "torch.autograd.forward_ad are not supported. Use reverse mode (torch.func.grad, vjp, jacrev, or "
               ".backward()), or a reference that autograd differentiates in every mode "
               "(flashtile.reference.naive_attention) where forward mode is needed.")


def unpack(q, k, v):
    """(q, k, v) views of possibly packed inputs (see the module docstring)."""
    if k is None:
        return q.unbind(-3)
    if v is None:
        return (q,) + tuple(k.unbind(-3))
    return q, k, v


def _device_offsets(req, q, k):
    """A varlen request on CUDA tensors whose offsets were not checked (their values are not read by default) gets
    offsets clamped on the device (_values.clamp_offsets): the kernels then never index past the packed tensors."""
    if not req.varlen or not req.cu_seqlens_q.is_cuda or SETTINGS.check_values:
        return req
    rows_q, rows_k = q.shape[0], k.shape[0]
    if req.paged:  # a paged batch's key counts index no rows of k (the kernel clamps them to the pages)
        cu_q, cu_k = _values.clamp_offsets(req.cu_seqlens_q, rows_q)[0], req.cu_seqlens_k
    elif req.cu_seqlens_k is req.cu_seqlens_q and rows_k == rows_q:  # self-attention: one tensor
        cu_q = cu_k = _values.clamp_offsets(req.cu_seqlens_q, rows_q)[0]
    else:
        cu_q, cu_k = _values.clamp_offsets(req.cu_seqlens_q, rows_q, req.cu_seqlens_k, rows_k)
    if cu_q is req.cu_seqlens_q and cu_k is req.cu_seqlens_k:
        return req
    return req.with_fields(cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)


def forward(q, k, v, req: AttentionRequest, on_new_plan=None):
    """(out, lse fp32) of one request, no autograd: unpack, then the backend dispatch chooses (on_new_plan: see
    dispatch.forward)."""
    q, k, v = unpack(q, k, v)
    return dispatch.forward(q, k, v, _device_offsets(req, q, k), out_dtype=out_dtype(q, req), on_new_plan=on_new_plan)


def out_dtype(q, req):
    """The output's dtype where it is not q's: bfloat16 for the FP8 forward (float8 q, k, v with req.descale);
    None otherwise (q's)."""
    return torch.bfloat16 if req.descale is not None else None


def _off_device(t):
    """Whether t is on a GPU that is not the current device. Triton launches on the current device and refuses
    another GPU's pointers ("cannot be accessed from Triton"), so the calls below switch to t's GPU first, as a model
    spread over GPUs in one process (device_map) calls each layer on its own GPU without switching."""
    index = t.get_device()
    return index >= 0 and torch._C._cuda_getDevice() != index


def backward(dout, q, k, v, out, lse, dlse, req: AttentionRequest, bias_requires_grad=False):
    """Gradients of forward: [dq, dk, dv] (packed inputs: [dqkv] or [dq, dkv]), then dbias if bias_requires_grad,
    then dsinks if req.sinks is set. dlse is the gradient reaching the returned LSE (None when it is unused)."""
    if _off_device(q):
        with torch.cuda.device(q.device):
            return backward(dout, q, k, v, out, lse, dlse, req, bias_requires_grad)
    _ahead.wait()
    qq, kk, _ = unpack(q, k, v)
    req = _device_offsets(req, qq, kk)
    grads, dbias, dsinks = dispatch.backward(dout, q, k, v, out, lse, dlse, req, bias_requires_grad)
    if bias_requires_grad:
        grads.append(dbias)
    if req.sinks is not None:
        grads.append(dsinks)
    return grads


# The ops are defined through torch.library.Library with explicit schemas rather than torch.library.custom_op:
# custom_op wraps each implementation in torch._disable_dynamo, whose first call imports torch._dynamo (2-3 s per
# process on the GPU machine, docs/design-record.md "host overhead"). Fakes and autograd are registered either way.
_LIB = torch.library.Library("flashtile", "DEF")  # noqa: TOR901 - the library lives as long as the module
_LIB.define(f"attn_fwd(Tensor q, Tensor? k, Tensor? v, {AttentionRequest.schema()}) -> (Tensor, Tensor)")
_LIB.define(f"attn_bwd(Tensor dout, Tensor q, Tensor? k, Tensor? v, Tensor out, Tensor lse, Tensor? dlse, "
            f"bool bias_requires_grad, {AttentionRequest.schema()}) -> Tensor[]")


def _attn_fwd_op(q, k, v, *fields, **named):
    if _off_device(q):
        with torch.cuda.device(q.device):
            return _attn_fwd_op(q, k, v, *fields, **named)
    req = AttentionRequest.unflatten(fields, named)
    if req.varlen:
        # The public functions checked the offsets where they could read them; an op reached otherwise (a compiled
        # graph, whose public function saw fake tensors) checks the real ones here.
        qq, kk, _ = unpack(q, k, v)
        if req.paged:
            _values.paged_lengths(req.cu_seqlens_q, req.cu_seqlens_k, req.seqused_k, req.block_table, qq.shape[0],
                                  kk.shape[0], kk.shape[1], req.max_seqlen_q, req.max_seqlen_k)
        else:
            _values.varlen_lengths(req.cu_seqlens_q, req.cu_seqlens_k, qq.shape[0], kk.shape[0], req.max_seqlen_q,
                                   req.max_seqlen_k)
    return forward(q, k, v, req)


def _attn_bwd_op(dout, q, k, v, out, lse, dlse, bias_requires_grad, *fields, **named):
    return backward(dout, q, k, v, out, lse, dlse, AttentionRequest.unflatten(fields, named), bias_requires_grad)


@torch.library.register_fake("flashtile::attn_fwd")
def _attn_fwd_fake(q, k, v, *fields, **named):
    req = AttentionRequest.unflatten(fields, named)
    q, k, v = unpack(q, k, v)
    out = q.new_empty(q.shape[:-1] + v.shape[-1:], dtype=out_dtype(q, req) or q.dtype)
    if req.varlen:
        lse = q.new_empty((q.shape[1], q.shape[0]), dtype=torch.float32)
    else:
        lse = q.new_empty((q.shape[0], q.shape[2], q.shape[1]), dtype=torch.float32)
    return out, lse


@torch.library.register_fake("flashtile::attn_bwd")
def _attn_bwd_fake(dout, q, k, v, out, lse, dlse, bias_requires_grad, *fields, **named):
    req = AttentionRequest.unflatten(fields, named)
    # The kernels allocate contiguous gradients whatever the input strides.
    grads = [t.new_empty(t.shape) for t in (q, k, v) if t is not None]
    if bias_requires_grad:
        grads.append(req.attn_bias.new_empty(req.attn_bias.shape))
    if req.sinks is not None:
        grads.append(req.sinks.new_empty(req.sinks.shape))
    return grads


def _save(ctx, q, k, v, out, lse, req):
    """What the backward needs: the tensors (saved for autograd's version checks) and the request's scalars. A
    request without tensors of its own (the common call) is kept as it is: nothing in it to save or unwrap."""
    # Unused outputs get None rather than a materialised zero tensor (the LSE usually is unused).
    ctx.set_materialize_grads(False)
    tensors = req.tensors()
    if not tensors:
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.req = req
        return
    ctx.req = None
    tensor_names = [name for name, _ in tensors]
    ctx.save_for_backward(q, k, v, out, lse, *(t for _, t in tensors))
    ctx.tensor_names = tensor_names
    ctx.scalars = {name: value for name, value in zip(_FIELDS, req.flatten()) if name not in tensor_names
                   and not isinstance(value, torch.Tensor)}


def _saved(ctx):
    q, k, v, out, lse, *tensors = ctx.saved_tensors
    req = ctx.req
    if req is None:
        req = AttentionRequest(**ctx.scalars, **dict(zip(ctx.tensor_names, tensors)))
    return q, k, v, out, lse, req


def _prepare_dout(dout, out):
    if dout is None:
        return torch.zeros_like(out)
    if dout.stride(-1) != 1:  # the kernels need a unit stride along headdim (an expanded grad has 0)
        return dout.contiguous()
    return dout


def _once_differentiable(grads):
    """Under create_graph (grad mode on in the backward) the gradients would carry no graph of their own: route them
    through a node that raises _DOUBLE_BACKWARD when differentiated (what torch.autograd.function.once_differentiable
    does), instead of letting a second-order term silently come out as zero."""
    present = [i for i, g in enumerate(grads) if g is not None]
    if not torch.is_grad_enabled() or not present:
        return grads
    error = torch._C._functions.DelayedError(_DOUBLE_BACKWARD.encode(), len(present))
    marked = error(*[grads[i].detach().requires_grad_() for i in present])
    if isinstance(marked, torch.Tensor):
        marked = (marked,)
    grads = list(grads)
    for i, g in zip(present, marked):
        grads[i] = g
    return grads


def _attn_fwd_setup_context(ctx, inputs, output):
    q, k, v = inputs[:_NUM_TENSORS_FWD]
    req = AttentionRequest.unflatten(inputs[_NUM_TENSORS_FWD:])
    _save(ctx, q, k, v, output[0], output[1], req)
    ctx.bias_slot = _GRAD_SLOTS["attn_bias"]


def _attn_fwd_backward(ctx, dout, dlse):
    """attn_fwd's registered backward: attn_bwd through the dispatcher, so that tracers see it."""
    q, k, v, out, lse, req = _saved(ctx)
    bias_requires_grad = req.attn_bias is not None and ctx.needs_input_grad[ctx.bias_slot]
    with torch.no_grad():
        grads = attn_bwd(_prepare_dout(dout, out), q, k, v, out, lse, dlse, bias_requires_grad, *req.flatten())
    result = [None] * _NUM_INPUTS
    n_main = sum(t is not None for t in (q, k, v))
    result[:n_main] = grads[:n_main]
    rest = list(grads[n_main:])
    if bias_requires_grad:
        result[_GRAD_SLOTS["attn_bias"]] = rest.pop(0)
    if req.sinks is not None:
        result[_GRAD_SLOTS["sinks"]] = rest.pop(0)
    return tuple(_once_differentiable(result))


def _function_backward(ctx, dout, dlse, run_backward):
    """The backward of _AttnFunction and _TransformAttn (inputs q, k, v, req, attn_bias, sinks): run_backward is
    `backward` (the kernels directly) or the attn_bwd op."""
    q, k, v, out, lse, req = _saved(ctx)
    bias_requires_grad = req.attn_bias is not None and ctx.needs_input_grad[4]
    with torch.no_grad():
        grads = run_backward(_prepare_dout(dout, out), q, k, v, out, lse, dlse, req, bias_requires_grad)
    n_main = sum(t is not None for t in (q, k, v))
    result = list(grads[:n_main]) + [None] * (3 - n_main) + [None, None, None]
    rest = list(grads[n_main:])
    if bias_requires_grad:
        result[4] = rest.pop(0)
    if req.sinks is not None:
        result[5] = rest.pop(0)
    if torch._C._are_functorch_transforms_active():
        # torch.func always differentiates with create_graph, and its tensors take no DelayedError node: refuse a
        # second differentiating level (grad of grad, vjp of grad) here instead.
        stack = torch._C._functorch.get_interpreter_stack() or []
        differentiating = (torch._C._functorch.TransformType.Grad, torch._C._functorch.TransformType.Jvp)
        if sum(level.key() in differentiating for level in stack) > 1:
            raise RuntimeError(_DOUBLE_BACKWARD)
        return tuple(result)
    return tuple(_once_differentiable(result))


def _op_backward(dout, q, k, v, out, lse, dlse, req, bias_requires_grad):
    return attn_bwd(dout, q, k, v, out, lse, dlse, bias_requires_grad, *req.flatten())


class _ReverseOnly(torch.autograd.Function):
    """Reverse mode only: forward-mode AD (jvp) raises _FORWARD_AD."""

    @staticmethod
    def jvp(ctx, *tangents):
        raise RuntimeError(_FORWARD_AD)


class _AttnFunction(_ReverseOnly):
    """attn_fwd with its autograd, without the dispatcher: what eager calls run (see eager). The op's schema
    handling in torch's register_autograd and the dispatcher cost ~0.2 ms of host time per call on the GPU machines'
    hosts, as long as a small call's kernel (docs/design-record.md, "host overhead"). attn_bias and sinks are passed
    beside the request so that autograd sees them as inputs."""

    @staticmethod
    def forward(ctx, q, k, v, req, attn_bias, sinks):
        qq, kk, _ = unpack(q, k, v)
        req = _device_offsets(req, qq, kk)  # clamped once: the backward gets the same offsets
        grad = ctx.needs_input_grad
        ahead = None
        if grad[0] or grad[1] or grad[2] or grad[4] or grad[5]:
            # A new plan: the backward compiles meanwhile (_ahead.py).
            ahead = functools.partial(_ahead.start, q, k, v, req, attn_bias is not None and grad[4])
        out, lse = forward(q, k, v, req, ahead)
        _save(ctx, q, k, v, out, lse, req)
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        return _function_backward(ctx, dout, dlse, backward)


class _TransformAttn(_ReverseOnly):
    """The attention under torch.func transforms (the op's own autograd, from register_autograd, is not
    functorch-compatible). Forward and backward call the ops, so that vmap batches them with torch's per-sample
    fallback (generate_vmap_rule); grad, vjp and jacrev differentiate once; jvp raises."""
    generate_vmap_rule = True

    @staticmethod
    def forward(q, k, v, req, attn_bias, sinks):
        return tuple(attn_fwd(q, k, v, *req.flatten()))

    @staticmethod
    def setup_context(ctx, inputs, output):
        q, k, v, req = inputs[:4]
        _save(ctx, q, k, v, output[0], output[1], req)

    @staticmethod
    def backward(ctx, dout, dlse):
        return _function_backward(ctx, dout, dlse, _op_backward)


def eager(*tensors):
    """True when a call may run _AttnFunction instead of the op: plain tensors (None allowed) and nothing tracing
    (torch.compile, FakeTensor and other dispatch modes, functorch transforms), all of which still see the op.
    Torch-function modes are not consulted: torch.set_default_device installs one, and no tracer relies on one to
    see a custom op."""
    return (SETTINGS.eager_direct and all(t is None or type(t) is torch.Tensor for t in tensors)
            and not torch.compiler.is_compiling() and not torch._C._len_torch_dispatch_stack()
            and not torch._C._are_functorch_transforms_active())


def _needs_grad(*tensors):
    """Whether autograd records a call with these inputs (None allowed): grad mode on and one of them requires grad,
    or one of them is a forward-mode dual tensor (whose call must reach _AttnFunction, which refuses it)."""
    present = [t for t in tensors if t is not None]
    if torch.is_grad_enabled() and any(t.requires_grad for t in present):
        return True
    if _forward_ad._current_level < 0:
        return False  # no dual level entered: leaving one deletes its tangents, so no tensor carries any
    return any(_forward_ad.unpack_dual(t).tangent is not None for t in present)


def attention(q, k, v, req: AttentionRequest):
    """(out, lse) of the request with its autograd: when eager, the forward alone if there is nothing to
    differentiate, else through _AttnFunction; otherwise through the op."""
    if eager(q, k, v, req.attn_bias, req.sinks):
        if _off_device(q):
            with torch.cuda.device(q.device):
                return attention(q, k, v, req)
        if not _needs_grad(q, k, v, req.attn_bias, req.sinks):
            # Inference, or no input that requires grad: without autograd.Function's apply and saved tensors (7-12 us
            # of Python a call on the CPU, more with the FP8 factors; docs/design-record.md, "Host overhead"). A new
            # plan starts Triton's key first (_ahead.start_key).
            return forward(q, k, v, req, _ahead.start_key)
        return _AttnFunction.apply(q, k, v, req, req.attn_bias, req.sinks)
    if torch._C._are_functorch_transforms_active() and not torch.compiler.is_compiling():
        return _TransformAttn.apply(q, k, v, req, req.attn_bias, req.sinks)
    return attn_fwd(q, k, v, *req.flatten())


for _device in ("CPU", "CUDA"):
    _LIB.impl("attn_fwd", _attn_fwd_op, _device)
    _LIB.impl("attn_bwd", _attn_bwd_op, _device)
attn_fwd = torch.ops.flashtile.attn_fwd.default
attn_bwd = torch.ops.flashtile.attn_bwd.default
torch.library.register_autograd("flashtile::attn_fwd", _attn_fwd_backward, setup_context=_attn_fwd_setup_context)


def _per_sample(op):
    """A vmap rule that runs `op` once per sample and stacks the results: what torch's fallback does for ops with a
    fixed number of outputs, which it cannot do for attn_bwd's Tensor[] (vmap of grad, jacrev)."""
    def rule(info, in_dims, *args):
        results = [op(*(a.select(d, i) if d is not None else a for a, d in zip(args, in_dims)))
                   for i in range(info.batch_size)]
        stacked = [torch.stack(parts) for parts in zip(*results)]
        return stacked, [0] * len(stacked)
    return rule


torch.library.register_vmap("flashtile::attn_bwd", _per_sample(attn_bwd))
