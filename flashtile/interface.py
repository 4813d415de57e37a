"""Public attention functions: flash-attn's `flash_attn_func` family (fixed-length, variable-length, packed) and
torch's `scaled_dot_product_attention`.

Each validates its arguments, then calls the `flashtile::attn_fwd` custom op (flashtile._ops), which runs the
Triton kernels on CUDA tensors and is differentiable. Eager calls run the op's implementation and backward through an
autograd.Function instead (`_ops.attention`: the same code without the dispatcher's host time); torch.compile,
dispatch modes and functorch transforms see the op.
"""
import torch

from . import _ops, _values, dispatch
from . import reference
from .reference.dropout import dropout_mask
from .request import AttentionRequest, unbounded_window
from ._validate import (_check_tensor, check_alibi, check_attn_mask, check_descales, check_dropout, check_paged,
                        check_qkv, check_sinks, check_softcap, check_varlen, check_window, resolve_scale)

_ARGS_DOC = """
        dropout_p: float in [0, 1), default 0.0. Dropout on the attention probabilities (Philox in the kernel,
            seeded from torch's generator for q's device: torch.manual_seed reproduces a run; the backward
            regenerates the same mask). Pass 0.0 in evaluation.
        softmax_scale: float, default 1 / sqrt(headdim). Scores are softmax_scale * q @ k^T.
        causal: bool, default False. Query i sees key j iff j <= i + seqlen_k - seqlen_q: the mask is aligned to
            the bottom-right corner. With seqlen_q = 2, seqlen_k = 5:
                1 1 1 1 0
                1 1 1 1 1
            and with seqlen_q = 5, seqlen_k = 2 (rows 0-2 see no key: their output is 0, their LSE -inf):
                0 0
                0 0
                0 0
                1 0
                1 1
        window_size: (left, right), default (-1, -1). Sliding-window (local) attention: query i sees key j iff
            i + seqlen_k - seqlen_q - left <= j <= i + seqlen_k - seqlen_q + right (inclusive, aligned like
            causal); -1 leaves that side unbounded. causal=True sets right to 0. Key blocks outside the band are
            never loaded.
        softcap: float, default 0.0 (off). Scores s become softcap * tanh(s / softcap) before the softmax
            (Gemma 2, Grok), with its backward.
        alibi_slopes: float32 (nheads,) or (batch, nheads), default None. Adds -slope * |i + seqlen_k - seqlen_q
            - j| to the scores (after the softcap).
        deterministic: bool, default False. True guarantees bit-identical gradients from run to run, as does
            torch.use_deterministic_algorithms(True). Only the Hopper Gluon backward needs it: it adds dQ by bulk
            reductions whose order varies, so dQ's last bits vary; True takes the portable kernels there (no
            atomics, about 0.8x the speed). Every other backend is deterministic either way.
        return_attn_probs: bool, default False. If True, also return the log-sum-exp and S_dmask: None without
            dropout; with dropout, a debugging tensor (batch, nheads, seqlen_q, seqlen_k) of the attention
            probabilities with the dropped ones negated (computed densely, O(seqlen^2) memory).
        sinks: float32 (nheads,), default None. Learnable attention sinks (gpt-oss): one logit per head that
            joins every row's softmax denominator (its value is zero), with its gradient."""

_CHECKS_DOC = """
    Checks (docs/safety.md): shapes, dtypes, devices and the Python-number arguments are always checked (ValueError /
    TypeError naming the value and the fix). window_size sides may be any int up to 2**63 - 1: a side at or past the
    sequence lengths is unbounded. Inputs are not scanned for NaN/inf: they propagate as in torch's SDPA (except that
    a row that sees no key outputs 0). Backward: supported; double backward, forward mode (torch.func.jvp) and grad
    of grad raise a RuntimeError; torch.func.grad, vjp and vmap work."""

_VARLEN_CHECKS_DOC = """
    Offsets: CPU cu_seqlens are checked on every call (start at 0, never decrease, end at the number of rows;
    max_seqlen_q/_k at least every length). CUDA ones are not read (that would synchronise with the GPU on every
    call) unless FLASHTILE_CHECK_VALUES=1 (or within `with flashtile.check_values():`): the kernels keep every
    index inside the tensors, and a bad offset spoils only its own sequences' rows."""

_RETURNS_DOC = """
    Returns:
        out: {out_shape}, q's dtype.
        softmax_lse (only if return_attn_probs): {lse_shape} float32, natural-log logsumexp of each row's
            (modified) scores, the sink included (-inf for a row that sees no key and has no sink). It is
            differentiable.
        S_dmask (only if return_attn_probs): see return_attn_probs."""


def _with_docs(out_shape, lse_shape):
    def decorate(fn):
        fn.__doc__ = fn.__doc__.replace("{args}", _ARGS_DOC.strip("\n")).replace(
            "{returns}", _RETURNS_DOC.format(out_shape=out_shape, lse_shape=lse_shape).strip("\n")).replace(
            "{checks}", _CHECKS_DOC.strip("\n")).replace("{varlen_checks}", _VARLEN_CHECKS_DOC.strip("\n"))
        return fn
    return decorate


def _draw_seed(q, dropout_p):
    """The Philox key for one call, drawn from torch's generator for q's device (no host sync)."""
    if dropout_p == 0.0:
        return None
    return torch.randint(0, 2 ** 62, (1,), dtype=torch.int64, device=q.device)


def _positive_scale(q, k, v, scale):
    """(q, k, v, scale) with scale > 0, which the kernels need (they take the row max before scaling): a negative
    scale is the same function of -q with |scale| (negating is exact; autograd flips dq back), and a zero scale
    makes every score 0 (uniform attention over the visible keys), which zero scores under scale 1 give; q * 0 (not
    a fresh zeros tensor) keeps q in the graph, so q.grad is the exact 0. A packed qkv (k None) is split: the q
    slice becomes a new tensor, k and v stay views of the packed one."""
    if scale > 0:
        return q, k, v, scale
    if k is None:
        q, k, v = q.unbind(-3)
    if scale < 0:
        return -q, k, v, -scale
    return q * 0.0, k, v, 1.0


def _attention(q, k, v, scale, *, dropout_p=0.0, deterministic=False, **fields):
    """The call every API shares: the request (AttentionRequest's other fields in `fields`), then the op.
    -> (out, lse, request). q may be a packed qkv (k None) or k a packed kv (v None)."""
    q, k, v, scale = _positive_scale(q, k, v, scale)
    req = AttentionRequest(softmax_scale=scale, dropout_p=dropout_p, seed=_draw_seed(q, dropout_p),
                           deterministic=bool(deterministic) or torch.are_deterministic_algorithms_enabled(),
                           **fields)
    out, lse = _ops.attention(q, k, v, req)
    return out, lse, req


def _dropout_debug_mask(q, k, req, offset, alibi_slopes, batch_offset=0):
    """S_dmask for return_attn_probs with dropout: the probabilities, recomputed densely by the reference, with
    the elements the kernel dropped (same Philox bits) negated. (batch, nheads, seqlen_q, seqlen_k) float32."""
    q, k = q.detach().float(), k.detach().float()
    batch, seqlen_q, heads, _ = q.shape
    seqlen_k, kv_heads = k.shape[1], k.shape[2]
    # P itself: attention of q over k with identity values, so that out = P.
    eye = torch.eye(seqlen_k, device=q.device).view(1, seqlen_k, 1, seqlen_k).expand(batch, seqlen_k, kv_heads,
                                                                                      seqlen_k)
    probs, _ = reference.naive_attention(q, k, eye, softmax_scale=req.softmax_scale, diagonal_offset=offset,
                                         window_size=(req.window_left, req.window_right), softcap=req.softcap,
                                         alibi_slopes=alibi_slopes, sinks=req.sinks)
    probs = probs.permute(0, 2, 1, 3)  # (batch, heads, seqlen_q, seqlen_k)
    keep = dropout_mask(int(req.seed.item()), batch, heads, seqlen_q, seqlen_k, req.dropout_p, device=q.device,
                        batch_offset=batch_offset)
    return torch.where(keep, probs, -probs)


def _flash_options(qq, kk, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, sinks, head_dim,
                   batch, heads, seqlen_q, seqlen_k):
    """Validate the options flash_attn_func and the varlen functions share -> (scale, dropout_p, request fields).
    Causal becomes the band's right edge at the diagonal; a window wider than the sequences, no window."""
    dropout_p = check_dropout(dropout_p)
    left, right = check_window(window_size)
    if not isinstance(causal, bool):
        causal = bool(causal)
    if causal:
        right = 0
    left, right = unbounded_window(left, right, seqlen_q, seqlen_k)
    fields = dict(window_left=left, window_right=right, softcap=check_softcap(softcap),
                  alibi_slopes=check_alibi(alibi_slopes, qq, batch, heads), sinks=check_sinks(sinks, qq, heads))
    return resolve_scale(softmax_scale, head_dim), dropout_p, fields


# Repeated calls. A request without tensors of its own (no ALiBi, sinks or dropout) follows from the Python-number
# options, the head dim and the sequence lengths alone, and a frozen request can serve every call with the same
# ones: _options_key -> the AttentionRequest an earlier call validated and built. Past MAX_REQUESTS keys the cache
# starts over.
MAX_REQUESTS = 1024
_REQUESTS: dict = {}
_PLAIN_TYPES = (bool, int, float, type(None))


def _options_key(dropout_p, softmax_scale, causal, window_size, softcap, deterministic, *sizes):
    """Everything _flash_options and _attention read besides the tensors, with each value's type (True, 1 and 1.0
    take different checks), or None where the request cannot be shared: dropout (a seed per call), or an option
    of another type (it gets the full checks every time)."""
    options = (dropout_p, softmax_scale, causal, softcap, deterministic)
    if (any(type(x) not in _PLAIN_TYPES for x in options) or type(window_size) not in (tuple, list)
            or len(window_size) != 2 or any(type(x) not in _PLAIN_TYPES for x in window_size) or dropout_p != 0):
        return None
    return (tuple((type(x), x) for x in options), type(window_size), tuple((type(x), x) for x in window_size),
            torch.are_deterministic_algorithms_enabled(), sizes)


def _remember_request(key, req):
    if len(_REQUESTS) >= MAX_REQUESTS:
        _REQUESTS.clear()
    _REQUESTS[key] = req


def _flash(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, return_attn_probs, sinks,
           head_dim, deterministic=False, checked=False):
    """Shared body of flash_attn_func and the fixed-length packed variants (q, k, v possibly packed; checked: the
    caller checked unpacked q, k, v already)."""
    qq, kk, vv = _ops.unpack(q, k, v)
    if not checked:
        check_qkv(qq, kk, vv, layout="bshd")
    key = None
    # (Not while torch.compile traces: a key of symbolic lengths would specialize them.)
    if alibi_slopes is None and sinks is None and not torch.compiler.is_compiling():
        key = _options_key(dropout_p, softmax_scale, causal, window_size, softcap, deterministic, head_dim,
                           qq.shape[1], kk.shape[1])
        req = _REQUESTS.get(key) if key is not None else None
        if req is not None:
            out, lse = _ops.attention(q, k, v, req)
            return (out, lse, None) if return_attn_probs else out
    scale, dropout_p, fields = _flash_options(qq, kk, dropout_p, softmax_scale, causal, window_size, softcap,
                                              alibi_slopes, sinks, head_dim, qq.shape[0], qq.shape[2], qq.shape[1],
                                              kk.shape[1])
    diagonal_offset = kk.shape[1] - qq.shape[1]  # bottom-right alignment
    out, lse, req = _attention(q, k, v, scale, dropout_p=dropout_p, deterministic=deterministic,
                               diagonal_offset=diagonal_offset, **fields)
    if key is not None and scale > 0:  # (a scale <= 0 is applied to q by _positive_scale, per call)
        _remember_request(key, req)
    if return_attn_probs:
        s_dmask = None
        if dropout_p > 0:
            s_dmask = _dropout_debug_mask(qq, kk, req, diagonal_offset, req.alibi_slopes)
        return out, lse, s_dmask
    return out


@_with_docs("(batch, seqlen_q, nheads, headdim_v)", "(batch, nheads, seqlen_q)")
def flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                    alibi_slopes=None, deterministic=False, return_attn_probs=False, *, sinks=None, q_descale=None,
                    k_descale=None, v_descale=None):
    """Exact attention, flash-attn compatible.

    Arguments:
        q: (batch, seqlen_q, nheads, headdim), float16 / bfloat16 / float32 (or float8_e4m3fn: q_descale below),
            CUDA (or CPU, see the README). k: (batch, seqlen_k, nheads_k, headdim). v: (batch, seqlen_k,
            nheads_k, headdim_v). nheads must be a multiple of nheads_k: grouped-query attention, query head h uses
            key/value head h // (nheads // nheads_k) (nheads_k = 1 is MQA). Head dims: multiples of 8 up to 512;
            headdim_v may differ from headdim (MLA: 192 and 128). The last dimension must be contiguous; any other
            strides work.
{args}
        q_descale, k_descale, v_descale: float32 (batch, nheads_k), keyword-only, default None (1). FP8 forward
            (FA3's arguments), for inference: q, k, v are then float8_e4m3fn, all three, and each holds its values
            divided by its factor (per batch entry and kv head; a query head takes its kv head's q factor). Scores
            are softmax_scale * q_descale * k_descale * (q @ k^T) and the output is v_descale times the weighted
            sum, accumulated in float32; out is bfloat16. Forward only: with inputs that require grad under grad
            mode it raises NotImplementedError, and dropout_p must be 0. On Hopper at headdim 128 without softcap,
            ALiBi or attn_mask it runs the Gluon kernel: float8 tensor-core products, P rounded to float8 before
            P @ V, V copied transposed once per call. Elsewhere the portable Triton kernel: the float8 values are
            multiplied in bfloat16 without rounding, and P is rounded to bfloat16 before P @ V.

{returns}

{checks}
    """
    descales = (q_descale, k_descale, v_descale)
    if _fp8_call(q, descales):
        return _flash_fp8(q, k, v, descales, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
                          return_attn_probs, sinks)
    check_qkv(q, k, v, layout="bshd")  # before _flash, which would read k = None as packed inputs
    return _flash(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, return_attn_probs,
                  sinks, q.shape[-1], deterministic, checked=True)


def _fp8_call(q, descales):
    """Whether a call takes the FP8 forward: float8 q, or any descale factor given (check_qkv then insists on
    float8_e4m3fn q, k and v)."""
    return (isinstance(q, torch.Tensor) and q.dtype == torch.float8_e4m3fn) or any(d is not None for d in descales)


def _check_fp8_options(dropout_p, q, k, v, sinks):
    _check_inference_only(dropout_p, (q, k, v, sinks), "float8 inputs: the FP8 forward is for inference",
                          "the FP8 forward (float8_e4m3fn q, k, v) has no backward: run it under torch.no_grad() / "
                          "torch.inference_mode(), or detach q, k, v (and sinks); train with 16-bit inputs.")


def _fp8_request_scale(descale, scale):
    """(descale, scale > 0): the kernels take a positive scale, so a negative one moves its sign into q's factors
    and a zero one zeroes them (scores 0 under scale 1), the float8 tensors being left as they are."""
    if scale > 0:
        return descale, scale
    if scale < 0:
        descale[..., 0].neg_()
        return descale, -scale
    descale[..., 0].zero_()
    return descale, 1.0


def _flash_fp8(q, k, v, descales, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
               return_attn_probs, sinks):
    """flash_attn_func's FP8 forward: float8_e4m3fn q, k, v with their descale factors (AttentionRequest.descale).
    As _flash, a call with the options, head dim and lengths of an earlier one takes that call's request, here with
    its own (checked) factors swapped in."""
    check_qkv(q, k, v, layout="bshd", fp8=True)
    batch, seqlen_q, heads, head_dim = q.shape
    seqlen_k, kv_heads = k.shape[1], k.shape[2]
    key = None
    if alibi_slopes is None and sinks is None and not torch.compiler.is_compiling():
        key = _options_key(dropout_p, softmax_scale, causal, window_size, softcap, False, "fp8", head_dim, seqlen_q,
                           seqlen_k)
        req = _REQUESTS.get(key) if key is not None else None
        if req is not None:
            _check_fp8_options(dropout_p, q, k, v, None)
            req = req.with_fields(descale=check_descales(descales, q, batch, kv_heads))
            out, lse = _ops.attention(q, k, v, req)
            return (out, lse, None) if return_attn_probs else out
    scale, dropout_p, fields = _flash_options(q, k, dropout_p, softmax_scale, causal, window_size, softcap,
                                              alibi_slopes, sinks, head_dim, batch, heads, seqlen_q, seqlen_k)
    _check_fp8_options(dropout_p, q, k, v, fields["sinks"])
    descale, request_scale = _fp8_request_scale(check_descales(descales, q, batch, kv_heads), scale)
    out, lse, req = _attention(q, k, v, request_scale, diagonal_offset=seqlen_k - seqlen_q, descale=descale,
                               **fields)
    if key is not None and scale > 0:  # (a scale <= 0 is folded into each call's factors: _fp8_request_scale)
        _remember_request(key, req)
    return (out, lse, None) if return_attn_probs else out


def _check_packed(name, t, count, rank):
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}.")
    if t.dim() != rank or t.shape[-3] != count:
        parts, members = ("q, k and v", "q, k, v") if count == 3 else ("k and v", "k, v")
        raise ValueError(f"{name} must be {rank}-D with {count} at dimension -3 ({parts} stacked there), got shape "
                         f"{tuple(t.shape)}; build it with torch.stack(({members}), dim=-3).")


@_with_docs("(batch, seqlen, nheads, headdim)", "(batch, nheads, seqlen)")
def flash_attn_qkvpacked_func(qkv, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                              softcap=0.0, alibi_slopes=None, deterministic=False, return_attn_probs=False, *,
                              sinks=None):
    """flash_attn_func on one packed tensor; its gradient is one tensor too, written in place by the kernels.

    Arguments:
        qkv: (batch, seqlen, 3, nheads, headdim).
{args}

{returns}

{checks}
    """
    _check_packed("qkv", qkv, 3, 5)
    return _flash(qkv, None, None, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
                  return_attn_probs, sinks, qkv.shape[-1], deterministic)


@_with_docs("(batch, seqlen_q, nheads, headdim)", "(batch, nheads, seqlen_q)")
def flash_attn_kvpacked_func(q, kv, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                             softcap=0.0, alibi_slopes=None, deterministic=False, return_attn_probs=False, *,
                             sinks=None):
    """flash_attn_func with keys and values packed in one tensor (one gradient tensor for it).

    Arguments:
        q: (batch, seqlen_q, nheads, headdim). kv: (batch, seqlen_k, 2, nheads_k, headdim).
{args}

{returns}

{checks}
    """
    _check_packed("kv", kv, 2, 5)
    return _flash(q, kv, None, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
                  return_attn_probs, sinks, kv.shape[-1], deterministic)


def _varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale, causal,
            window_size, softcap, alibi_slopes, return_attn_probs, sinks, head_dim, deterministic, block_table=None,
            seqused_k=None, descales=None):
    qq, kk, vv = _ops.unpack(q, k, v)
    paged = block_table is not None
    fp8 = descales is not None
    if fp8 and paged:
        raise ValueError("float8 inputs with block_table (a paged cache) are not supported: pass contiguous "
                         "float8_e4m3fn k and v without block_table, or a 16-bit paged cache.")
    if not paged:
        check_qkv(qq, kk, vv, layout="thd", fp8=fp8)
    cu_q, cu_k = check_varlen(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, qq)
    batch = cu_q.numel() - 1
    if paged:
        block_table, seqused_k = check_paged(qq, kk, vv, block_table, seqused_k, batch)
    # Offsets visible on the host are checked here (docs/safety.md), and the launch then covers the longest
    # sequence itself rather than a larger max_seqlen.
    if paged:
        longest = _values.paged_lengths(cu_q, cu_k, seqused_k, block_table, qq.shape[0], kk.shape[0], kk.shape[1],
                                        max_seqlen_q, max_seqlen_k)
    else:
        longest = _values.varlen_lengths(cu_q, cu_k, qq.shape[0], kk.shape[0], max_seqlen_q, max_seqlen_k)
    longest_q, longest_k = longest or (max_seqlen_q, max_seqlen_k)
    scale, dropout_p, fields = _flash_options(qq, kk, dropout_p, softmax_scale, causal, window_size, softcap,
                                              alibi_slopes, sinks, head_dim, batch, qq.shape[1], longest_q, longest_k)
    if paged:
        _check_paged_options(dropout_p, q, k, v, fields["sinks"])
        fields.update(block_table=block_table, seqused_k=seqused_k)
    if fp8:
        _check_fp8_options(dropout_p, q, k, v, fields["sinks"])
        descale, scale = _fp8_request_scale(check_descales(descales, qq, batch, kk.shape[1]), scale)
        fields.update(descale=descale)
    out, lse, req = _attention(q, k, v, scale, dropout_p=dropout_p, deterministic=deterministic, cu_seqlens_q=cu_q,
                               cu_seqlens_k=cu_k, max_seqlen_q=longest_q, max_seqlen_k=longest_k, **fields)
    if return_attn_probs:
        s_dmask = None
        if dropout_p > 0:
            s_dmask = qq.new_zeros((batch, qq.shape[1], max_seqlen_q, max_seqlen_k), dtype=torch.float32)
            bounds_q, bounds_k = cu_q.tolist(), cu_k.tolist()
            for b in range(batch):
                sq, sk = bounds_q[b + 1] - bounds_q[b], bounds_k[b + 1] - bounds_k[b]
                if sq == 0 or sk == 0:
                    continue
                slopes = req.alibi_slopes
                if slopes is not None and slopes.dim() == 2:
                    slopes = slopes[b]
                s_dmask[b, :, :sq, :sk] = _dropout_debug_mask(
                    qq[None, bounds_q[b]:bounds_q[b + 1]], kk[None, bounds_k[b]:bounds_k[b + 1]], req, sk - sq,
                    slopes, batch_offset=b)[0]
        return out, lse, s_dmask
    return out


def _check_paged_options(dropout_p, q, k, v, sinks):
    _check_inference_only(dropout_p, (q, k, v, sinks), "block_table: paged keys/values are for inference",
                          "backward through a paged cache (flash_attn_varlen_func with block_table) is not "
                          "supported: run it under torch.no_grad() / torch.inference_mode(), or detach q, k, v (and "
                          "sinks); for training, gather the pages into contiguous k, v and call "
                          "flash_attn_varlen_func without block_table.")


def _check_inference_only(dropout_p, tensors, dropout_reason, grad_message):
    """Calls that are inference (a paged cache, float8 inputs): no dropout, nothing that asks for a gradient."""
    if dropout_p > 0:
        raise ValueError(f"dropout_p={dropout_p} with {dropout_reason}; pass dropout_p=0.0.")
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors):
        raise NotImplementedError(grad_message)


@_with_docs("(total_q, nheads, headdim_v)", "(nheads, total_q)")
def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
                           softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                           deterministic=False, return_attn_probs=False, block_table=None, *, sinks=None,
                           seqused_k=None, q_descale=None, k_descale=None, v_descale=None):
    """Attention over a batch of sequences of different lengths, concatenated (no padding), flash-attn compatible.

    Arguments:
        q: (total_q, nheads, headdim), the batch's queries one sequence after another. k: (total_k, nheads_k,
            headdim), v: (total_k, nheads_k, headdim_v).
        cu_seqlens_q, cu_seqlens_k: int32 (batch + 1,): sequence b is rows [cu[b], cu[b + 1]). Lengths may be 0.
        max_seqlen_q, max_seqlen_k: int, the longest sequence (sizes the launch grid; must not be smaller; a larger
            value is fine). Masks (causal, window, ALiBi) align to each sequence's own bottom-right corner;
            alibi_slopes may be (batch, nheads).
{args}
        block_table: int32 (batch, max_num_blocks_per_seq), default None. Paged keys/values (chunked prefill, mixed
            prefill/decode batches of a serving engine): k and v are then caches (num_blocks, page_block_size,
            nheads_k, headdim[_v]) of any page size, and key j of sequence b is row j % page_block_size of page
            block_table[b, j // page_block_size]; sequence b has cu_seqlens_k[b + 1] - cu_seqlens_k[b] keys (or
            seqused_k[b]), its first cache slots, and its queries align bottom-right on them (causal: the new
            queries see the cached prefix and themselves). Entries past a sequence's pages are never read (-1
            padding is fine); pages may be shared. Forward only (inference): with requires_grad inputs under
            grad mode it raises NotImplementedError, and dropout_p must be 0. Runs the portable Triton kernel on
            CUDA (pointer loads).
        seqused_k: int32 (batch,), keyword-only, default None; with block_table only. Sequence b's number of keys,
            overriding cu_seqlens_k (whose values are then not used), as in flash-attn.
        q_descale, k_descale, v_descale: float32 (batch, nheads_k), keyword-only, default None (1): the FP8
            forward, as flash_attn_func's (the same kernels, Hopper's at headdim 128), one factor per sequence
            and kv head (not with block_table).

{returns}

{checks}
{varlen_checks}
    """
    if seqused_k is not None and block_table is None:
        raise ValueError("seqused_k is supported together with block_table (paged keys/values); for contiguous k, v "
                         "pass cu_seqlens_k with the lengths to use (and only those rows), or add block_table.")
    descales = (q_descale, k_descale, v_descale)
    fp8 = _fp8_call(q, descales)
    if block_table is None:
        check_qkv(q, k, v, layout="thd", fp8=fp8)  # before _varlen, which would read k = None as packed inputs
    else:
        _check_tensor("k", k)
        _check_tensor("v", v)
    return _varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale,
                   causal, window_size, softcap, alibi_slopes, return_attn_probs, sinks, q.shape[-1], deterministic,
                   block_table, seqused_k, descales if fp8 else None)


@_with_docs("(total, nheads, headdim)", "(nheads, total)")
def flash_attn_varlen_qkvpacked_func(qkv, cu_seqlens, max_seqlen, dropout_p=0.0, softmax_scale=None, causal=False,
                                     window_size=(-1, -1), softcap=0.0, alibi_slopes=None, deterministic=False,
                                     return_attn_probs=False, *, sinks=None):
    """flash_attn_varlen_func on one packed tensor (one gradient tensor for it).

    Arguments:
        qkv: (total, 3, nheads, headdim). cu_seqlens: int32 (batch + 1,). max_seqlen: int.
{args}

{returns}

{checks}
{varlen_checks}
    """
    _check_packed("qkv", qkv, 3, 4)
    return _varlen(qkv, None, None, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, dropout_p, softmax_scale,
                   causal, window_size, softcap, alibi_slopes, return_attn_probs, sinks, qkv.shape[-1], deterministic)


@_with_docs("(total_q, nheads, headdim)", "(nheads, total_q)")
def flash_attn_varlen_kvpacked_func(q, kv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
                                    softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                                    alibi_slopes=None, deterministic=False, return_attn_probs=False, *,
                                    sinks=None):
    """flash_attn_varlen_func with keys and values packed in one tensor (one gradient tensor for it).

    Arguments:
        q: (total_q, nheads, headdim). kv: (total_k, 2, nheads_k, headdim). cu_seqlens_q, cu_seqlens_k: int32
            (batch + 1,). max_seqlen_q, max_seqlen_k: int.
{args}

{returns}

{checks}
{varlen_checks}
    """
    _check_packed("kv", kv, 2, 4)
    return _varlen(q, kv, None, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale,
                   causal, window_size, softcap, alibi_slopes, return_attn_probs, sinks, kv.shape[-1], deterministic)


def scaled_dot_product_attention(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                                 enable_gqa=False):
    """torch.nn.functional.scaled_dot_product_attention with flashtile's kernels.

    Arguments (torch's names, layout and semantics):
        query: (batch, heads, seqlen_q, headdim); key: (batch, heads_kv, seqlen_k, headdim); value: (batch,
            heads_kv, seqlen_k, headdim_v).
        attn_mask: None, a bool mask (True = attend) or a float bias added to the scores, broadcastable to
            (batch, heads, seqlen_q, seqlen_k). A float bias that requires grad gets its gradient (summed over the
            broadcast dimensions). Tiles of the mask that attend nothing are skipped. Unlike torch, a row that
            attends no key outputs 0 (not NaN).
        dropout_p: float in [0, 1), applied whenever > 0 (as in torch: pass 0.0 in evaluation). Philox in the
            kernel, seeded from torch's generator.
        is_causal: bool. As in torch, the mask is aligned to the top-left corner: query i sees key j iff j <= i.
            With seqlen_q = 2, seqlen_k = 5:
                1 0 0 0 0
                1 1 0 0 0
            It cannot be combined with attn_mask (as in torch).
        scale: float, default 1 / sqrt(headdim).
        enable_gqa: bool. If False, query and key/value must have the same number of heads; if True, heads must be
            a multiple of heads_kv (query head h uses key/value head h // (heads // heads_kv)).

    Returns: (batch, heads, seqlen_q, headdim_v) in query's dtype (a transposed view of a (batch, seqlen, heads,
    headdim) buffer, as torch's flash backend returns).

    Checks (docs/safety.md): shapes, dtypes, devices and the Python-number arguments raise ValueError/TypeError on
    a mistake. attn_mask's values are not scanned: a NaN in a float bias propagates as in torch. Backward: supported;
    double backward, forward mode and grad of grad raise a RuntimeError.
    """
    check_qkv(query, key, value, layout="bhsd")
    dropout_p = check_dropout(dropout_p)
    if query.shape[1] != key.shape[1] and not enable_gqa:
        raise ValueError(f"query has {query.shape[1]} heads but key/value have {key.shape[1]}; pass "
                         f"enable_gqa=True for grouped-query attention, or repeat the key/value heads.")
    if attn_mask is not None:
        if is_causal:
            raise ValueError("attn_mask and is_causal=True cannot both be given (as in torch); fold the causal "
                             "mask into attn_mask, or drop attn_mask.")
        attn_mask = check_attn_mask(attn_mask, query, query.shape[0], query.shape[1], query.shape[2], key.shape[2])
    scale = resolve_scale(scale, query.shape[-1], name="scale")
    q, k, v = (t.transpose(1, 2) for t in (query, key, value))  # views: the kernels take any strides
    out, _, _ = _attention(q, k, v, scale, dropout_p=dropout_p, window_right=0 if is_causal else -1,
                           attn_bias=attn_mask)
    return out.transpose(1, 2)  # diagonal offset 0 above: top-left alignment


def explain(q, k, v, *, causal=False, window_size=(-1, -1), softcap=0.0, alibi_slopes=None, sinks=None,
            dropout_p=0.0, softmax_scale=None, deterministic=False, cu_seqlens_q=None, cu_seqlens_k=None,
            max_seqlen_q=None, max_seqlen_k=None, block_table=None, seqused_k=None, target=None):
    """Which backend would run flash_attn_func(q, k, v, ...) (or flash_attn_varlen_func, when cu_seqlens_q/_k are
    given; paged with block_table and seqused_k), forward and backward, and why each backend before it declines.
    Nothing runs; the arguments are validated as the call would validate them (and raise the same errors).

    target: a flashtile.dispatch.Target to ask about another machine (e.g. Target("cuda", 90, False), an H100)
    instead of the tensors' own device. Returns a flashtile.dispatch.Explanation; print it for a report:

        call: q (2, 4096, 16, 128) k (2, 4096, 4, 128) v (2, 4096, 4, 128) bfloat16; causal; on cuda, sm_90
        forward: gluon-hopper
        backward: triton
          not gluon-hopper: deterministic=True (or torch.use_deterministic_algorithms): ...
    """
    varlen = cu_seqlens_q is not None or cu_seqlens_k is not None or block_table is not None
    if block_table is None:
        check_qkv(q, k, v, layout="thd" if varlen else "bshd")
    if varlen:
        cu_q, cu_k = check_varlen(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, q)
        batch, heads = cu_q.numel() - 1, q.shape[1]
        seqlens = (max_seqlen_q, max_seqlen_k)
        extra = dict(cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k)
        if block_table is not None:
            extra["block_table"], extra["seqused_k"] = check_paged(q, k, v, block_table, seqused_k, batch)
    else:
        batch, heads = q.shape[0], q.shape[2]
        seqlens = (q.shape[1], k.shape[1])
        extra = dict(diagonal_offset=k.shape[1] - q.shape[1])
    scale, dropout_p, fields = _flash_options(q, k, dropout_p, softmax_scale, causal, window_size, softcap,
                                              alibi_slopes, sinks, q.shape[-1], batch, heads, *seqlens)
    seed = torch.zeros((1,), dtype=torch.int64, device=q.device) if dropout_p > 0 else None  # not drawn: no call
    req = AttentionRequest(softmax_scale=abs(scale) or 1.0, dropout_p=dropout_p, seed=seed,
                           deterministic=bool(deterministic) or torch.are_deterministic_algorithms_enabled(),
                           **fields, **extra)
    return dispatch.explain_request(q, k, v, req, target=target)
