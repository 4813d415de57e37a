"""Which backend runs an attention request, and why: the one place that decides.

Backends, tried in order; the first whose allow-list accepts the request runs it:

1. ``gluon-hopper``: the warp-specialized Gluon kernels (kernels/hopper_fwd.py, kernels/hopper_bwd.py).
2. ``triton``: the portable Triton kernels (kernels/forward.py, kernels/backward.py), on any CUDA GPU, and on CPU
   tensors inside Triton's interpreter (TRITON_INTERPRET=1, how CI tests them).
3. ``reference``: the pure-PyTorch reference (reference/fallback.py) for CPU tensors otherwise (warned once).

Each backend's ``decline_forward`` / ``decline_backward`` returns None when it takes the request, else the reason it
does not, in words a user can act on. `explain` (and ``python -m flashtile explain``) reports every backend's answer
for a call, forward and backward: "why did it fall back" is answered by reading the reasons.

Forward and backward are decided separately: a call whose forward runs on the Gluon kernel may take the portable
backward (deterministic=True, a float bias at head dim 64, ...) and the other way round.
"""
import dataclasses
import os
import sys
import warnings
from typing import Optional

import torch

from ._lazy import lazy_module
from ._settings import SETTINGS
from .request import AttentionRequest

# The kernel modules import Triton: imported by the first call that reads them, not with flashtile (_lazy.py).
_gluon = lazy_module(".kernels._gluon", globals())
configs = lazy_module(".kernels.configs", globals())
features = lazy_module(".kernels.features", globals())
hopper_bwd = lazy_module(".kernels.hopper_bwd", globals())
hopper_fwd = lazy_module(".kernels.hopper_fwd", globals())

# Head dims the Gluon kernels are written for (hopper_fwd.TILE_DIM's keys; that module imports Triton, this one does
# not): d96 on d128's tiles, d192 on d256's. Every other head dim that is a multiple of 8 from GLUON_MIN_HEAD_DIM to
# 256 runs the path of the next of them (hopper_fwd.kernel_dim: d80 d96's, d112 d128's, d160 d192's, d224 d256's),
# its tiles' columns past it zero-filled by TMA on the loads and masked on the stores: on an H200 at 4k the portable
# kernels had run d80, d112 and d160 at 0.61-0.85x cuDNN (docs/design-record.md, "Every head dim on the Hopper
# kernels"). Below GLUON_MIN_HEAD_DIM the portable kernels stay: their tiles are as wide as the head dim (d32 ran at
# 1.01-1.19x cuDNN on an H200 at 4k), where d64's would more than double the products; d32 on d64's tiles was not
# timed.
GLUON_KERNEL_DIMS = (64, 96, 128, 192, 256)
GLUON_MIN_HEAD_DIM = 40
# The backward's kernel dims without ALiBi, an attn_mask or dropout (hopper_bwd._bwd_step_wide's split of a 64-key
# block between the warpgroups has none of them, nor MLA's _bwd_step_halves; the portable backward takes those calls).
GLUON_BWD_PLAIN_HEAD_DIMS = (192, 256)
# (q/k head dim, v head dim) pairs whose forward runs on the Gluon kernel although they differ: MLA's 192/128
# (DeepSeek's prefill), on d256's tiles for Q and K and d128's for V; and its backward, on 128-key blocks in 32-query
# halves with Q and K in 64-column chunks (hopper_bwd._bwd_step_halves, HALVES_DIMS).
GLUON_FWD_SPLIT_DIMS = ((192, 128),)
GLUON_BWD_SPLIT_DIMS = ((192, 128),)
# The head dims whose float8_e4m3fn forward runs on the Gluon kernel (interface.flash_attn_func's q_descale, ...):
# d128's float8 rows are 128 bytes, the kernel's swizzle width; the others run the portable kernel.
GLUON_FP8_HEAD_DIMS = (128,)
# Head dims at which the Gluon backward's ring has room for a float attn_mask tile (a bool mask fits at both): at
# d128 a [64, 128] bf16 tile per slot brings shared memory to 226 KB of 227; at d64 the [128, 128] tiles would need
# 64 KB more than the 194 KB in use.
GLUON_BWD_FLOAT_BIAS_HEAD_DIMS = (128,)
# Calls whose longest sequence has up to hopper_bwd.PERSISTENT_MAX_SEQLEN_K keys run the Gluon backward's
# persistent grid, at any length (H100, d64: 1.24-1.26x the portable backward at 1k fixed-length, 1.17-1.42x on
# varlen batches of 64-1792 keys). Longer varlen batches take a grid of one program per key block, on which a
# short mean key length is slow: at 1k, d64 (B16 H32, H200) it ran at 0.92-0.95x the portable backward (every
# program has only 8 query tiles to spread its prologue over). Those whose mean key length is below this (by head
# dim) take the portable backward.
GLUON_BWD_MIN_SEQLEN_K = {64: 2048, 96: 0, 128: 0, 192: 0, 256: 0}  # (by hopper_fwd.kernel_dim)


def gluon_head_dim(head_dim):
    """Whether the Gluon kernels take this head dim (q's and k's; v's alike, or MLA's pair): a multiple of 8 from
    GLUON_MIN_HEAD_DIM to 256."""
    return head_dim % 8 == 0 and GLUON_MIN_HEAD_DIM <= head_dim <= GLUON_KERNEL_DIMS[-1]


@dataclasses.dataclass(frozen=True)
class Target:
    """Where a call runs: device type, GPU architecture (compute capability major * 10 + minor; 0 off a GPU) and
    whether Triton's interpreter runs the kernels. `explain` can pretend another (e.g. an H100 from a laptop)."""
    device: str
    arch: int
    interpreting: bool

    @classmethod
    def of(cls, t):
        if t.is_cuda and not configs.INTERPRETING:
            major, minor = torch.cuda.get_device_capability(t.device)
            return cls("cuda", major * 10 + minor, False)
        return cls(t.device.type, 0, configs.INTERPRETING)


def _seqlens(q, k, req):
    """(Sq, Sk) of the problem: the tensors' sequence dims, or the longest sequences of a varlen batch."""
    if req.varlen:
        return req.max_seqlen_q, req.max_seqlen_k
    return q.shape[1], k.shape[1]


# ---------------------------------------------------------------------------------------------------------------
# Backends


class _KernelBackend:
    """What the two kernel backends share: their launches come as plans (see "Plans" below), the forward's from a
    kernel module's plan_forward, the backward's from kernels/backward.plan_backward with or without the Gluon
    kernel; forward and backward build one for the call and run it."""
    GLUON = False

    @staticmethod
    def _forward_module():
        raise NotImplementedError

    def plan_forward(self, q, k, v, req, out_dtype=None):
        """(the plan, out, lse)."""
        return self._forward_module().plan_forward(q, k, v, req, out_dtype)

    def forward(self, q, k, v, req, out_dtype=None):
        return self.plan_forward(q, k, v, req, out_dtype)[1:]

    def plan_backward(self, dout, q, k, v, out, lse, dlse, req, bias_requires_grad, grads, dq_addend=None):
        """(the plan, what backward returns); dq_addend: the Gluon kernel's only (dispatch.backward)."""
        from .kernels import backward as bwd_kernels
        plan, dq, dk, dv, dbias, dsinks = bwd_kernels.plan_backward(
            dout, q, k, v, out, lse, dlse, req, gluon=self.GLUON, grads=(None, None, None) if grads is None
            else grads[1], bias_grad=bias_requires_grad, dq_addend=dq_addend)
        return plan, _backward_result(grads, dq, dk, dv, dbias, dsinks)

    def backward(self, dout, q, k, v, out, lse, dlse, req, bias_requires_grad, grads, dq_addend=None):
        return self.plan_backward(dout, q, k, v, out, lse, dlse, req, bias_requires_grad, grads, dq_addend)[1]


class GluonHopper(_KernelBackend):
    name = "gluon-hopper"
    summary = ("warp-specialized Gluon kernels for Hopper (H100/H200), fp16/bf16, head dims that are multiples of 8 "
               "from 40 to 256 (on the tiles of 64, 96, 128, 192 or 256), and MLA's 192/128 (the backward: without "
               "ALiBi, attn_mask or dropout above 128); float8_e4m3fn forward at head dim 128")

    @staticmethod
    def _decline_inputs(q, k, v, req, target, fp8=False, split=()):
        if not _gluon.AVAILABLE:
            return "this Triton has no Gluon dialect (triton.experimental.gluon); Triton >= 3.5 has it"
        if target.device != "cuda":
            return f"needs CUDA tensors; these are on {target.device}" + (
                " (Triton's interpreter cannot run Gluon kernels)" if target.interpreting else "")
        if target.arch // 10 != 9:
            return f"needs a Hopper GPU (sm_90); this one is sm_{target.arch}"
        if q.dtype not in (torch.float16, torch.bfloat16) and not (fp8 and q.dtype == torch.float8_e4m3fn):
            return f"needs float16 or bfloat16{' or float8_e4m3fn' if fp8 else ''} inputs, got {q.dtype}"
        dims = (q.shape[-1], v.shape[-1])
        if not gluon_head_dim(q.shape[-1]) or k.shape[-1] != q.shape[-1] or (v.shape[-1] != q.shape[-1]
                                                                             and dims not in split):
            pairs = "".join(f" (or {a} for q and k with {b} for v)" for a, b in split)
            below = (f"; below {GLUON_MIN_HEAD_DIM} the portable kernels take it on tiles as wide as the head dim"
                     if q.shape[-1] < GLUON_MIN_HEAD_DIM else "")
            return (f"needs a head dim that is a multiple of 8 from {GLUON_MIN_HEAD_DIM} to {GLUON_KERNEL_DIMS[-1]} "
                    f"for q, k and v alike{pairs}, got {q.shape[-1]} / {k.shape[-1]} / {v.shape[-1]}{below}")
        if not configs._tma_ok((q, k, v)):
            return ("needs 16-byte aligned data pointers and strides (TMA descriptors); call .contiguous() on "
                    "q, k, v")
        if req.varlen:
            if req.paged:
                # A page smaller than a key block is copied into a row slice of the block's shared-memory tile,
                # which must start where the tile's 128-byte swizzle pattern starts over: every 8 rows.
                page, block_n = k.shape[1], hopper_fwd.key_block_rows(q.shape[-1], v.shape[-1])
                if not (page % block_n == 0 or (block_n % page == 0 and page >= 8)):
                    return (f"pages of {page} rows: it reads whole pages or {block_n}-row blocks of one "
                            f"(page sizes that divide {block_n}, 8 or more, or its multiples)")
            if req.attn_bias is not None:
                return "an attn_mask with a varlen batch is not implemented here"
            if q.shape[0] == 0 or k.shape[0] == 0:
                return "an empty packed batch (no queries or no keys at all)"
        elif req.attn_bias is not None:
            sq, sk = _seqlens(q, k, req)
            if not features.Features(req).gluon_bias_ok(q.dtype, sq, sk):
                return ("its attn_mask must be bool or of the inputs' dtype, full along queries and keys (not "
                        "broadcast), with a unit key stride and 16-byte aligned rows")
        return None

    def decline_forward(self, q, k, v, req, target):
        if not SETTINGS.gluon_forward:
            return "turned off (FLASHTILE_GLUON=0 or SETTINGS.gluon_forward)"
        reason = self._decline_inputs(q, k, v, req, target, fp8=True, split=GLUON_FWD_SPLIT_DIMS)
        if reason is None and q.dtype == torch.float8_e4m3fn:
            return self._decline_fp8(q, req)
        if reason is None and (req.attn_bias is not None or req.dropout_p > 0):
            if hopper_fwd.tile_dim(q.shape[-1]) in hopper_fwd.NO_MASK_OR_DROPOUT_TILES:
                what = "an attn_mask" if req.attn_bias is not None else "dropout"
                return f"{what} at head dim {q.shape[-1]} is not implemented in this forward"
        return reason

    @staticmethod
    def _decline_fp8(q, req):
        """Why the forward does not take float8 inputs with these options (None: it does)."""
        if q.shape[-1] not in GLUON_FP8_HEAD_DIMS:
            return f"float8 inputs at head dim {q.shape[-1]} (it takes {GLUON_FP8_HEAD_DIMS})"
        unsupported = [name for name, on in (("softcap", req.softcap > 0),
                                             ("ALiBi", req.alibi_slopes is not None),
                                             ("an attn_mask", req.attn_bias is not None)) if on]
        if unsupported:
            return f"float8 inputs with {unsupported[0]} are not implemented in this forward"
        return None

    def decline_backward(self, dout, q, k, v, req, target):
        if not SETTINGS.gluon_backward:
            return "turned off (FLASHTILE_GLUON_BWD=0 or SETTINGS.gluon_backward)"
        if req.deterministic:
            return ("deterministic=True (or torch.use_deterministic_algorithms): this backward adds dQ by bulk "
                    "reductions in a varying order")
        reason = self._decline_inputs(q, k, v, req, target, split=GLUON_BWD_SPLIT_DIMS)
        if reason is not None:
            return reason
        if hopper_fwd.kernel_dim(q.shape[-1]) in GLUON_BWD_PLAIN_HEAD_DIMS:
            unsupported = [name for name, on in (("ALiBi", req.alibi_slopes is not None),
                                                 ("an attn_mask", req.attn_bias is not None),
                                                 ("dropout", req.dropout_p > 0)) if on]
            if unsupported:
                return f"{unsupported[0]} at head dim {q.shape[-1]} is not implemented in this backward"
        if req.attn_bias is not None:
            if req.dropout_p > 0:
                return "an attn_mask together with dropout is not implemented in this backward"
            if req.attn_bias.dtype != torch.bool and q.shape[-1] not in GLUON_BWD_FLOAT_BIAS_HEAD_DIMS:
                return (f"a float attn_mask's tiles do not fit its shared memory at head dim {q.shape[-1]} "
                        f"(only {GLUON_BWD_FLOAT_BIAS_HEAD_DIMS})")
        if req.varlen and req.max_seqlen_k > hopper_bwd.PERSISTENT_MAX_SEQLEN_K:
            # The one-item grid: the mean key length stands for Sk (the threshold was measured at fixed length).
            seqlen_k = k.shape[0] / max(req.cu_seqlens_k.numel() - 1, 1)
            minimum = GLUON_BWD_MIN_SEQLEN_K[hopper_fwd.kernel_dim(q.shape[-1])]
            if seqlen_k < minimum:
                return (f"varlen, {seqlen_k:g} keys per sequence: below {minimum} at head dim {q.shape[-1]} the "
                        f"portable backward is faster")
        if dout.dtype != q.dtype or not configs._tma_ok((dout,)):
            return "the output gradient must have q's dtype and 16-byte aligned strides"
        return None

    GLUON = True

    @staticmethod
    def _forward_module():
        from .kernels import hopper_fwd
        return hopper_fwd


class PortableTriton(_KernelBackend):
    name = "triton"
    summary = "portable Triton kernels: any CUDA GPU, every dtype and option; CPU tensors in Triton's interpreter"

    @staticmethod
    def _decline(target):
        if target.device == "cuda" or target.interpreting:
            return None
        return (f"{target.device} tensors run the kernels only inside Triton's interpreter: set TRITON_INTERPRET=1 "
                f"before importing flashtile (slow; for tests), or move the tensors to a CUDA GPU")

    def decline_forward(self, q, k, v, req, target):
        return self._decline(target)

    def decline_backward(self, dout, q, k, v, req, target):
        return self._decline(target)

    @staticmethod
    def _forward_module():
        from .kernels import forward as fwd_kernels
        return fwd_kernels


class Reference:
    name = "reference"
    summary = "pure-PyTorch reference (float32, O(seqlen^2) memory): the CPU fallback"

    def decline_forward(self, q, k, v, req, target):
        return None

    def decline_backward(self, dout, q, k, v, req, target):
        return None

    def forward(self, q, k, v, req, out_dtype=None):
        from .reference import fallback
        _warn_cpu_fallback()
        with torch.no_grad():
            out, lse = fallback.forward(q, k, v, req)
        return out if out_dtype is None else out.to(out_dtype), lse

    def backward(self, dout, q, k, v, out, lse, dlse, req, bias_requires_grad, grads):
        from .reference import fallback
        _warn_cpu_fallback()
        dq, dk, dv, dbias, dsinks = fallback.backward(dout, q, k, v, out, lse, dlse, req, bias_requires_grad)
        if grads is None:
            return [dq, dk, dv], dbias, dsinks
        for buffer, value in zip(grads[1], (dq, dk, dv)):
            buffer.copy_(value)
        return grads[0], dbias, dsinks


BACKENDS = (GluonHopper(), PortableTriton(), Reference())


def _backward_result(grads, dq, dk, dv, dbias, dsinks):
    # ([dq, dk, dv] or the packed gradients, dbias, dsinks)
    return (grads[0] if grads is not None else [dq, dk, dv]), dbias, dsinks


# ---------------------------------------------------------------------------------------------------------------
# Choosing


def choose_forward(q, k, v, req, target=None):
    """The backend that runs the forward of (q, k, v, req): unpacked inputs; target defaults to q's."""
    target = target or Target.of(q)
    for backend in BACKENDS:
        if backend.decline_forward(q, k, v, req, target) is None:
            return backend
    raise AssertionError("unreachable: the reference takes every request")


def choose_backward(dout, q, k, v, req, target=None):
    target = target or Target.of(q)
    for backend in BACKENDS:
        if backend.decline_backward(dout, q, k, v, req, target) is None:
            return backend
    raise AssertionError("unreachable: the reference takes every request")


def forward(q, k, v, req, out_dtype=None, on_new_plan=None):
    """(out, lse) of unpacked q, k, v on the chosen backend: the plan of an earlier call with the same plan key when
    there is one (see "Plans" below). out_dtype: out's dtype, default q's (flashtile.distributed's float32 blocks).
    on_new_plan: called without arguments when there is none, before the choice (the compile-ahead of _ahead.py)."""
    key = plan_key(q, (q, k, v), req, out_dtype) if SETTINGS.fast_launch else None
    if key is not None:
        plan = _PLANS.get(key)
        if plan is not None:
            return plan.run(q, k, v, req)
    if on_new_plan is not None:
        on_new_plan()
    backend = choose_forward(q, k, v, req)
    if key is None or not hasattr(backend, "plan_forward"):
        return backend.forward(q, k, v, req, out_dtype)
    plan, out, lse = backend.plan_forward(q, k, v, req, out_dtype)
    _store_plan(key, plan)
    return out, lse


def _packed_grad_buffers(q, k, v, packed_q, packed_k, v_in):
    """For packed inputs, one gradient buffer per packed tensor and (dq, dk, dv) views of it the backends write;
    None for separate inputs."""
    from .kernels import _common
    if packed_k is None:
        grads = [_common.empty(packed_q.shape, q.dtype, q.device)]
        return grads, tuple(grads[0].unbind(-3))
    if v_in is None:
        grads = [_common.empty(q.shape, q.dtype, q.device), _common.empty(packed_k.shape, k.dtype, k.device)]
        return grads, (grads[0],) + tuple(grads[1].unbind(-3))
    return None


def _backward_unfused_addend(dout, q, k, v, out, lse, dlse, req, bias_requires_grad, buffers, dq_addend):
    """backward's result with dq_addend on a backend that stores dQ as it computes it (all but the Gluon one): the
    query gradient into a float32 buffer, then added to dq_addend and rounded into buffers[0], one pass; None when
    the Gluon backend takes the call (it adds dq_addend itself)."""
    if buffers is None or dq_addend.dtype != torch.float32 or dq_addend.shape != q.shape:
        raise ValueError(f"dq_addend must be a float32 tensor shaped like q {tuple(q.shape)}, given with the "
                         f"gradient buffers; got {dq_addend.dtype} {tuple(dq_addend.shape)}")
    if getattr(choose_backward(dout, q, k, v, req), "GLUON", False):
        return None
    dq = buffers[0]
    grad = torch.empty(q.shape, dtype=torch.float32, device=q.device)
    grads, dbias, dsinks = backward(dout, q, k, v, out, lse, dlse, req, bias_requires_grad,
                                    (grad,) + tuple(buffers[1:]))
    torch.add(dq_addend, grad, out=dq)
    return [dq] + list(grads[1:]), dbias, dsinks


def backward(dout, q, k, v, out, lse, dlse, req, bias_requires_grad, buffers=None, dq_addend=None):
    """([dq, dk, dv] or the packed gradients, dbias, dsinks) for possibly packed q, k, v (k None: packed qkv;
    v None: packed kv), on the chosen backend. buffers: (dq, dk, dv) to write (unpacked inputs only; e.g.
    flashtile.distributed's float32 block gradients), else allocated in the inputs' dtypes. dq_addend (with
    buffers): None, or a float32 tensor shaped like q that the query gradient is added to, in float32, before it
    is rounded into buffers[0] (flashtile.distributed's last step: its running dQ plus the step's, rounded once).
    The Gluon backward adds it in its dQ pass; after the other backends it takes one more pass."""
    if dq_addend is not None:
        unfused = _backward_unfused_addend(dout, q, k, v, out, lse, dlse, req, bias_requires_grad, buffers, dq_addend)
        if unfused is not None:
            return unfused
    packed_q, packed_k, v_in = q, k, v
    if k is None:
        q, k, v = q.unbind(-3)
    elif v is None:
        k, v = k.unbind(-3)
    grads = _packed_grad_buffers(q, k, v, packed_q, packed_k, v_in) if buffers is None else (list(buffers),
                                                                                             tuple(buffers))
    key = None
    if SETTINGS.fast_launch:
        key = plan_key(q, (dout, q, k, v, out, lse, dlse) + (grads[1] if grads is not None else ()), req,
                       bias_requires_grad)
    if key is not None:
        plan = _PLANS.get(key)
        if plan is not None:
            return _backward_result(grads, *plan.run(dout, q, k, v, out, lse, dlse, req,
                                                     (None, None, None) if grads is None else grads[1], dq_addend))
    backend = choose_backward(dout, q, k, v, req)
    extra = () if dq_addend is None else (dq_addend,)  # only the Gluon backend comes here with one
    if key is None or not hasattr(backend, "plan_backward"):
        return backend.backward(dout, q, k, v, out, lse, dlse, req, bias_requires_grad, grads, *extra)
    plan, result = backend.plan_backward(dout, q, k, v, out, lse, dlse, req, bias_requires_grad, grads, *extra)
    _store_plan(key, plan)
    return result


# ---------------------------------------------------------------------------------------------------------------
# Plans
#
# What a kernel launch depends on besides the call's tensors -- the backend's decision, the tiles that compiled,
# the grid, the scalar arguments, the constexprs, the compiled kernels -- follows from the tensors' shapes, strides,
# dtypes, 16-byte alignment and device, the request's scalars, which of its optional tensors are set, and SETTINGS.
# The kernels build it once per such plan key (kernels/forward.FwdPlan, backward.BwdPlan, hopper_fwd.GluonFwdPlan,
# hopper_bwd.GluonBwdPlan; decode's plans are the model) and keep it here: a later call with the key allocates its
# outputs and hands its tensors to the compiled kernels, with no choice, no tile search, no argument
# specialization (docs/design-record.md, "Host overhead"). Everything that reads tensor values or changes per
# call (a bool mask's block lists, varlen offsets, the dropout seed, descriptors over the call's tensors) stays in
# the plan's run. A plan keeps no tensor of a call. SETTINGS.fast_launch off: no plans (each call chooses and
# builds anew, as every call did before plans).

# Plans kept; past this many the cache starts over.
MAX_PLANS = 1024
_PLANS: dict = {}


def _store_plan(key, plan):
    if len(_PLANS) >= MAX_PLANS:
        _PLANS.clear()
    _PLANS[key] = plan


def _tensor_key(t):
    # What a plan reads of a tensor: dtype, shape, strides, whether its address is 16-byte aligned (Triton
    # specializes pointers on it; TMA needs it).
    return None if t is None else (t.dtype, t.shape, t.stride(), t.data_ptr() % 16 == 0)


def _settings_key(q):
    """The settings a plan depends on: the Gluon switches, the lazy maximum and its deferred check, forced TMA, tile
    overrides, torch's tf32 flag for fp32 inputs, and whether Triton interprets (tests switch it; a process never
    does)."""
    tiles = SETTINGS.tiles
    if tiles is not None:
        tiles = (tuple((kind, tuple(v)) for kind, v in sorted(tiles.items())) if isinstance(tiles, dict)
                 else tuple(tiles))
    tf32 = q.dtype == torch.float32 and torch.backends.cuda.matmul.allow_tf32
    return (SETTINGS.gluon_forward, SETTINGS.gluon_backward, SETTINGS.lazy_max, SETTINGS.defer_check, SETTINGS.tma,
            tiles, tf32, configs.INTERPRETING)


def plan_key(q, tensors, req, extra=None):
    """The plan key of a call with these tensors (None for absent ones) and request, on q's device; extra: what
    else the call's launches depend on (the backward's bias_requires_grad)."""
    return (len(tensors), q.get_device(), *map(_tensor_key, tensors), _request_key(req), extra, _settings_key(q))


def _request_key(req):
    """The request's part of a plan key: its scalars and its tensors' _tensor_key. A request without tensors keeps
    it (requests are frozen, and flashtile.interface hands one request to every call with the same options)."""
    key = req.__dict__.get("_plan_key")
    if key is not None:
        return key
    tensors = [getattr(req, name) for name in req._tensor_fields]
    key = (req.softmax_scale, req.diagonal_offset, req.window_left, req.window_right, req.softcap, req.dropout_p,
           req.max_seqlen_q, req.max_seqlen_k, req.deterministic, *map(_tensor_key, tensors))
    if all(t is None for t in tensors):
        object.__setattr__(req, "_plan_key", key)  # (a cache beside the fields: not one of them)
    return key


# ---------------------------------------------------------------------------------------------------------------
# The CPU fallback's one-time warning

_warned_cpu_fallback = False
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


def uses_kernels(t):
    """Whether tensors like t run Triton kernels at all (a CUDA GPU, or the interpreter): flashtile.kvcache's rule."""
    return t.is_cuda or configs.INTERPRETING


# ---------------------------------------------------------------------------------------------------------------
# Explaining


@dataclasses.dataclass
class Explanation:
    """Every backend's answer for one call, forward and backward (None = takes it)."""
    request: AttentionRequest
    shapes: str
    target: Target
    forward: list
    backward: list

    @property
    def forward_backend(self):
        return next(name for name, reason in self.forward if reason is None)

    @property
    def backward_backend(self):
        return next(name for name, reason in self.backward if reason is None)

    def __str__(self):
        where = (f"{self.target.device}" + (f", sm_{self.target.arch}" if self.target.arch else "")
                 + (", Triton interpreter" if self.target.interpreting else ""))
        lines = [f"call: {self.shapes}; {self.request.describe()}; on {where}"]
        for stage, answers in (("forward", self.forward), ("backward", self.backward)):
            chosen = next(name for name, reason in answers if reason is None)
            lines.append(f"{stage}: {chosen}")
            for name, reason in answers:
                if name == chosen:
                    break
                lines.append(f"  not {name}: {reason}")
        return "\n".join(lines)


def explain_request(q, k, v, req, dout=None, target: Optional[Target] = None):
    """The Explanation for unpacked q, k, v and a request (dout defaults to a tensor like the output)."""
    target = target or Target.of(q)
    if dout is None:
        dout = q.new_empty(q.shape[:-1] + v.shape[-1:])
    fwd = []
    for backend in BACKENDS:
        reason = backend.decline_forward(q, k, v, req, target)
        fwd.append((backend.name, reason))
        if reason is None:
            break
    bwd = []
    for backend in BACKENDS:
        reason = backend.decline_backward(dout, q, k, v, req, target)
        bwd.append((backend.name, reason))
        if reason is None:
            break
    shapes = f"q {tuple(q.shape)} k {tuple(k.shape)} v {tuple(v.shape)} {str(q.dtype).replace('torch.', '')}"
    return Explanation(req, shapes, target, fwd, bwd)
