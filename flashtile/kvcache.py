"""flash_attn_with_kvcache: attention over a KV cache for inference, flash-attn's API (docs/kvcache.md).

Two custom ops, so that torch.compile traces through without graph breaks and only an append mutates the cache:
- flashtile::kvcache_append (mutates k_cache, v_cache): the new keys (rotated) and values into the cache.
- flashtile::kvcache_attn: split-KV attention over the cache, (out, lse).
CUDA tensors run the Triton kernels (flashtile.kernels.decode); CPU tensors run them in Triton's interpreter when
TRITON_INTERPRET=1, else the pure-PyTorch reference (flashtile.reference.kvcache) with a one-time warning.
"""
import torch

from . import _values
from ._lazy import lazy_module
from ._ops import eager
from ._settings import SETTINGS
from .dispatch import _warn_cpu_fallback, uses_kernels as _use_kernels
from ._validate import (HEAD_DIM_MULTIPLE, MAX_HEAD_DIM, SUPPORTED_DTYPES, _check_tensor, check_alibi,
                        check_softcap, check_window, resolve_scale)
from .request import KVCacheRequest
from .reference import kvcache as _reference

# The decode kernels import Triton: imported by the first call that reads them, not with flashtile (_lazy.py).
_decode = lazy_module(".kernels.decode", globals())

# An fp8 cache holds float8 e4m3 values with one descale factor per (batch, kv head), as FlashAttention-3's.
FP8_CACHE_DTYPES = (torch.float8_e4m3fn,)
INDEX_DTYPES = (torch.int32, torch.int64)
# Most key splits a call may ask for (flash-attn's limit): each split is a row of the launch grid and of the partial
# results' buffer, so a huge count would exceed the grid's limits or memory, and splits past the key blocks are empty.
MAX_NUM_SPLITS = 128


# ----------------------------------------------------------------------------------------------------------------
# Custom ops. Declared with explicit schemas through torch.library.Library rather than torch.library.custom_op:
# custom_op's Python wrapper costs ~6 us more per call (measured on the CPU), as much as the GPU time of a small
# decode step. The fakes make them traceable by torch.compile; (a!) marks the cache as mutated in place.

_LIB = torch.library.Library("flashtile", "FRAGMENT")
# The trailing arguments of both ops are KVCacheRequest's fields (flashtile.request), in declaration order.
_LIB.define(f"kvcache_append(Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor k, Tensor v, {KVCacheRequest.schema()}) "
            f"-> ()")
_LIB.define(f"kvcache_attn(Tensor q, Tensor k_cache, Tensor v_cache, {KVCacheRequest.schema()}) -> (Tensor, Tensor)")


def append(k_cache, v_cache, k, v, req: KVCacheRequest):
    """k (rotated when req.rotary_cos is given) and v into cache rows cache_seqlens[b] + i (req.cache_seqlen for every
    b when req.cache_seqlens is None), in place."""
    if _use_kernels(k_cache):
        _decode.kvcache_append(k_cache, v_cache, k, v, req.cache_seqlens, req.cache_seqlen, req.cache_batch_idx,
                               req.block_table, req.rotary_cos, req.rotary_sin, req.rotary_interleaved,
                               req.k_descale, req.v_descale)
        return
    _warn_cpu_fallback()
    # Rotary in fp32, as the kernel computes it, then rounded to the cache's dtype.
    _reference.append_kv_(k_cache, v_cache, k.float(), v,
                          req.cache_seqlen if req.cache_seqlens is None else req.cache_seqlens,
                          cache_batch_idx=req.cache_batch_idx, block_table=req.block_table, rotary_cos=req.rotary_cos,
                          rotary_sin=req.rotary_sin, rotary_interleaved=req.rotary_interleaved,
                          k_descale=req.k_descale, v_descale=req.v_descale)


def attention(q, k_cache, v_cache, req: KVCacheRequest):
    """(out [B, Sq, Hq, D], lse [B, Hq, Sq] fp32) of q over each sequence's cache rows
    [cache_leftpad[b], cache_seqlens[b] + seqlen_new)."""
    if _use_kernels(q):
        return _decode.kvcache_attention(q, k_cache, v_cache, req.cache_seqlens, req.cache_seqlen, req.seqlen_new,
                                         req.cache_batch_idx, req.cache_leftpad, req.block_table, req.rotary_cos,
                                         req.rotary_sin, req.rotary_interleaved, req.alibi_slopes, req.softmax_scale,
                                         req.causal, req.window_left, req.window_right, req.softcap, req.num_splits,
                                         req.k_descale, req.v_descale)
    _warn_cpu_fallback()
    out, lse = _reference.kvcache_attention(
        q.float(), k_cache, v_cache, req.cache_seqlen if req.cache_seqlens is None else req.cache_seqlens,
        seqlen_new=req.seqlen_new, cache_batch_idx=req.cache_batch_idx, cache_leftpad=req.cache_leftpad,
        block_table=req.block_table, rotary_cos=req.rotary_cos, rotary_sin=req.rotary_sin,
        rotary_interleaved=req.rotary_interleaved, softmax_scale=req.softmax_scale, causal=req.causal,
        window_size=(req.window_left, req.window_right), softcap=req.softcap, alibi_slopes=req.alibi_slopes,
        k_descale=req.k_descale, v_descale=req.v_descale)
    return out.to(q.dtype), lse.float()


def _kvcache_append_op(k_cache, v_cache, k, v, *fields, **named):
    append(k_cache, v_cache, k, v, KVCacheRequest.unflatten(fields, named))


def _kvcache_attn_op(q, k_cache, v_cache, *fields, **named):
    return attention(q, k_cache, v_cache, KVCacheRequest.unflatten(fields, named))


for _device in ("CPU", "CUDA"):
    _LIB.impl("kvcache_append", _kvcache_append_op, _device)
    _LIB.impl("kvcache_attn", _kvcache_attn_op, _device)


@torch.library.register_fake("flashtile::kvcache_append")
def _kvcache_append_fake(k_cache, v_cache, k, v, *fields, **named):
    return None


@torch.library.register_fake("flashtile::kvcache_attn")
def _kvcache_attn_fake(q, k_cache, v_cache, *fields, **named):
    batch, seqlen_q, num_heads, head_dim = q.shape
    return q.new_empty((batch, seqlen_q, num_heads, head_dim)), q.new_empty((batch, num_heads, seqlen_q),
                                                                           dtype=torch.float32)


kvcache_append = torch.ops.flashtile.kvcache_append.default
kvcache_attn = torch.ops.flashtile.kvcache_attn.default

_NO_BACKWARD = ("flash_attn_with_kvcache has no backward (inference only): no gradient flows to q or the cache, "
                "under torch.func.grad / jvp either. Differentiate attention with flashtile.flash_attn_func, or "
                "through the reference flashtile.reference.kvcache.kvcache_forward.")


class _TransformAttention(torch.autograd.Function):
    """kvcache_attn under torch.func transforms: vmap batches the op (torch's per-sample fallback); grad and jvp
    raise instead of returning the zero gradient an op without a derivative would silently give."""
    generate_vmap_rule = True

    @staticmethod
    def forward(q, k_cache, v_cache, req):
        return tuple(kvcache_attn(q, k_cache, v_cache, *req.flatten()))

    @staticmethod
    def setup_context(ctx, inputs, output):
        pass

    @staticmethod
    def backward(ctx, dout, dlse):
        raise RuntimeError(_NO_BACKWARD)

    @staticmethod
    def jvp(ctx, *tangents):
        raise RuntimeError(_NO_BACKWARD)


# ----------------------------------------------------------------------------------------------------------------
# Repeated calls. A decode loop calls with the same shapes, strides, dtypes and options every step; the checks and
# the kernels' launch plans depend on nothing else, so a call whose arguments match a validated one in all of that
# (_call_key) skips straight to the plans it ran (_Call): a few microseconds of host time instead of ~15.

# call key -> _Call
_CALLS: dict = {}


def _meta(t):
    # What the checks and the plans read of a tensor argument (dtype, shape, strides, alignment) and its device.
    return None if t is None else (_decode._tensor_key(t), t.get_device(), t.is_cuda)


def _call_key(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_batch_idx, cache_leftpad,
              block_table, softmax_scale, causal, window_size, softcap, rotary_interleaved, alibi_slopes, num_splits,
              k_descale, v_descale):
    """Everything flash_attn_with_kvcache's checks and launch plans depend on, or None when the call cannot take
    the repeated-call path (tracing, tensor subclasses, arguments of unexpected types: those get the full checks).
    The values of int cache_seqlens are not part of it (they change every step); _Call.run checks their range."""
    if not eager(q, k_cache, v_cache):
        return None
    try:
        seqlens = _meta(cache_seqlens) if isinstance(cache_seqlens, torch.Tensor) else type(cache_seqlens)
        key = (_meta(q), _meta(k_cache), _meta(v_cache), _meta(k), _meta(v), _meta(rotary_cos), _meta(rotary_sin),
               seqlens, _meta(cache_batch_idx), _meta(cache_leftpad), _meta(block_table), _meta(alibi_slopes),
               _meta(k_descale), _meta(v_descale),
               # types too: True == 1 == 1.0 would otherwise let a bool through where the checks want an int
               softmax_scale, type(softmax_scale), causal, type(causal), window_size, type(window_size),
               tuple(map(type, window_size)), softcap, type(softcap), rotary_interleaved, type(rotary_interleaved),
               num_splits, type(num_splits), _decode._settings_key(q))
        hash(key)
    except (AttributeError, TypeError):  # a non-tensor where a tensor goes, an unhashable or non-iterable option
        return None
    return key


class _Call:
    """The plans a validated call ran, and what its checks derived that later calls with its key need."""
    __slots__ = ("append", "attn", "capacity", "seqlen_new", "int_seqlens", "device_index", "layout", "max_seqlen",
                 "batch", "host_values")

    def run(self, q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_batch_idx, cache_leftpad,
            block_table, alibi_slopes, k_descale, v_descale):
        """(out, lse), or None for the full path (an int cache_seqlens out of range, whose error it raises; q's GPU
        not the current device). The index tensors' values are checked as on the full path: on the CPU always, on a
        GPU only with SETTINGS.check_values (docs/safety.md)."""
        cache_seqlen = self.capacity
        if self.int_seqlens:
            if not 0 <= cache_seqlens <= self.max_seqlen:
                return None
            cache_seqlen, cache_seqlens = cache_seqlens, None
        if self.host_values or SETTINGS.check_values:
            _values.kvcache(self.layout, self.batch, cache_seqlens, cache_seqlen, cache_batch_idx, cache_leftpad,
                            block_table)
        if _decode.off_device(self.device_index):
            return None
        stream = _decode.fast_stream(self.device_index)
        if self.append is not None:
            self.append.run(stream, k_cache, v_cache, k, v, cache_seqlens, cache_seqlen, cache_batch_idx, block_table,
                            rotary_cos, rotary_sin, k_descale, v_descale)
        out, lse, _ = self.attn.run(stream, q, k_cache, v_cache, cache_seqlens, cache_seqlen, cache_batch_idx,
                                    cache_leftpad, block_table, rotary_cos, rotary_sin, alibi_slopes, k_descale,
                                    v_descale)
        return out, lse


def _remember(key, q, k_cache, v_cache, k, v, req: KVCacheRequest, int_seqlens, layout):
    """After a validated call that needed no copies: keep its plans under its key (not when the reference ran:
    no plans)."""
    call = _Call()
    call.attn = _decode.plan(_decode.attention_key(
        q, k_cache, v_cache, req.cache_seqlens, req.seqlen_new, req.cache_batch_idx, req.cache_leftpad,
        req.block_table, req.rotary_cos, req.rotary_sin, req.rotary_interleaved, req.alibi_slopes, req.softmax_scale,
        req.causal, req.window_left, req.window_right, req.softcap, req.num_splits, req.k_descale, req.v_descale))
    call.append = None
    if k is not None and req.seqlen_new > 0:
        call.append = _decode.plan(_decode.append_key(k_cache, v_cache, k, v, req.cache_seqlens, req.cache_batch_idx,
                                                      req.block_table, req.rotary_cos, req.rotary_sin,
                                                      req.rotary_interleaved, req.k_descale, req.v_descale))
        if call.append is None:
            return
    if call.attn is None:
        return
    call.capacity = _decode._capacity(k_cache, req.block_table)
    call.seqlen_new = req.seqlen_new
    call.int_seqlens = int_seqlens
    call.device_index = q.get_device()
    call.layout = layout
    call.max_seqlen = layout.max_int_seqlen()
    call.batch = q.shape[0]
    call.host_values = not q.is_cuda
    if len(_CALLS) >= _decode.MAX_PLANS:
        _CALLS.clear()
    _CALLS[key] = call


# ----------------------------------------------------------------------------------------------------------------
# Argument checks (flashtile._validate's style: name the bad value and the fix)


def _is_int(x):
    return isinstance(x, int) and not isinstance(x, bool)


def _check_device(name, t, q):
    # get_device() is -1 on the CPU; comparing ints avoids building two torch.device objects per check.
    if t.get_device() != q.get_device() or t.is_cuda != q.is_cuda:
        raise ValueError(f"{name} is on {t.device} but q is on {q.device}; move it with .to(q.device).")


def _check_index(name, t, q, batch):
    """A per-sequence integer vector (batch,) on q's device; returned contiguous."""
    if t is None:
        return None
    _check_tensor(name, t)
    if t.dtype not in INDEX_DTYPES:
        raise TypeError(f"{name} has dtype {t.dtype}; it must be torch.int32 (or int64): convert it with "
                        f".to(torch.int32).")
    _check_device(name, t, q)
    if t.shape != (batch,):
        raise ValueError(f"{name} has shape {tuple(t.shape)}; it must be (batch,) = ({batch},), one entry per "
                         f"sequence of q.")
    return t if t.is_contiguous() else t.contiguous()


def _check_cache(q, k_cache, v_cache, block_table):
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
        _check_tensor(name, t)
        if t.dim() != 4:
            layout = "(num_blocks, page_block_size, nheads_k, headdim)" if block_table is not None else \
                "(batch_size_cache, seqlen_cache, nheads_k, headdim)"
            raise ValueError(f"{name} must be 4-D {layout}, got shape {tuple(t.shape)}.")
        _check_device(name, t, q)
        if t.stride(-1) != 1:
            raise ValueError(f"{name}'s last dimension (headdim) must be contiguous, got stride {t.stride(-1)}; the "
                             f"cache is updated in place, so allocate it with a contiguous headdim.")
    if k_cache.shape != v_cache.shape:
        raise ValueError(f"k_cache has shape {tuple(k_cache.shape)} but v_cache has {tuple(v_cache.shape)}; they "
                         f"must be equal.")
    if k_cache.dtype != v_cache.dtype:
        raise TypeError(f"k_cache is {k_cache.dtype} but v_cache is {v_cache.dtype}; store both in one dtype.")
    if k_cache.dtype in FP8_CACHE_DTYPES:
        if q.dtype not in (torch.float16, torch.bfloat16):
            raise TypeError(f"an fp8 cache needs q in float16 or bfloat16 (the dequantised keys and values take "
                            f"q's dtype), got q {q.dtype}; convert q with .to(torch.bfloat16).")
    elif k_cache.dtype != q.dtype:
        raise TypeError(f"q is {q.dtype} but the cache is {k_cache.dtype}; they must share one dtype (or the cache "
                        f"is float8_e4m3fn with k_descale/v_descale): convert q with .to({k_cache.dtype}).")


def _check_block_table(block_table, q, k_cache, batch):
    if block_table is None:
        return None
    _check_tensor("block_table", block_table)
    if block_table.dtype not in INDEX_DTYPES:
        raise TypeError(f"block_table has dtype {block_table.dtype}; it must be torch.int32: convert it with "
                        f".to(torch.int32).")
    _check_device("block_table", block_table, q)
    if block_table.dim() != 2 or block_table.shape[0] != batch or block_table.shape[1] < 1:
        raise ValueError(f"block_table has shape {tuple(block_table.shape)}; it must be (batch, "
                         f"max_num_blocks_per_seq) = ({batch}, n >= 1): row b lists the pages of sequence b in "
                         f"order.")
    return block_table if block_table.is_contiguous() else block_table.contiguous()


def _check_new_kv(k, v, q, k_cache, batch, num_kv_heads, head_dim):
    if (k is None) != (v is None):
        raise ValueError("pass both k and v (the new keys and values to append) or neither.")
    if k is None:
        return None, None
    for name, t in (("k", k), ("v", v)):
        _check_tensor(name, t)
        _check_device(name, t, q)
        if t.dtype != q.dtype:
            raise TypeError(f"{name} is {t.dtype} but q is {q.dtype}; convert it with .to({q.dtype}).")
        if t.dim() != 4 or t.shape[0] != batch or t.shape[2] != num_kv_heads or t.shape[3] != head_dim:
            raise ValueError(f"{name} has shape {tuple(t.shape)}; it must be (batch, seqlen_new, nheads_k, headdim) "
                             f"= ({batch}, seqlen_new, {num_kv_heads}, {head_dim}), like the cache's heads.")
    if k.shape[1] != v.shape[1]:
        raise ValueError(f"k has {k.shape[1]} new tokens but v has {v.shape[1]}; append as many keys as values.")
    return (t if t.stride(-1) == 1 else t.contiguous() for t in (k, v))


def _check_rotary(rotary_cos, rotary_sin, q, k, head_dim):
    if (rotary_cos is None) != (rotary_sin is None):
        raise ValueError("pass both rotary_cos and rotary_sin, or neither.")
    if rotary_cos is None:
        return None, None
    if k is None:
        raise ValueError("rotary_cos/rotary_sin rotate the new keys as they are appended, so they need k and v; "
                         "pass the new keys, or apply the rotary embedding to q yourself.")
    for name, t in (("rotary_cos", rotary_cos), ("rotary_sin", rotary_sin)):
        _check_tensor(name, t)
        _check_device(name, t, q)
        if not t.is_floating_point():
            raise TypeError(f"{name} has dtype {t.dtype}; it must be a floating-point tensor.")
        if t.dim() != 2 or t.shape[1] < 1 or 2 * t.shape[1] > head_dim:
            raise ValueError(f"{name} has shape {tuple(t.shape)}; it must be (seqlen_ro, rotary_dim / 2) with "
                             f"rotary_dim <= headdim = {head_dim}.")
    if rotary_cos.shape != rotary_sin.shape:
        raise ValueError(f"rotary_cos has shape {tuple(rotary_cos.shape)} but rotary_sin has "
                         f"{tuple(rotary_sin.shape)}; they must be equal.")
    return (t if t.stride(-1) == 1 else t.contiguous() for t in (rotary_cos, rotary_sin))


def _check_fp32(name, t, q, shapes, what):
    if t is None:
        return None
    _check_tensor(name, t)
    if t.dtype != torch.float32:
        raise TypeError(f"{name} must be float32, got {t.dtype}; convert it with .float().")
    _check_device(name, t, q)
    if t.shape not in shapes:
        raise ValueError(f"{name} has shape {tuple(t.shape)}; it must be {' or '.join(map(str, shapes))} ({what}).")
    return t if t.is_contiguous() else t.contiguous()


def _check_descale(k_descale, v_descale, q, k_cache, batch, num_kv_heads):
    fp8 = k_cache.dtype in FP8_CACHE_DTYPES
    if (k_descale is None) != (v_descale is None):
        raise ValueError("pass both k_descale and v_descale, or neither.")
    if fp8 and k_descale is None:
        raise ValueError(f"the cache is {k_cache.dtype}: pass k_descale and v_descale, float32 (batch, nheads_k) "
                         f"factors that turn stored values into real ones (torch.ones for none).")
    if not fp8 and k_descale is not None:
        raise ValueError(f"k_descale/v_descale apply to an fp8 (float8_e4m3fn) cache; this cache is "
                         f"{k_cache.dtype}, so drop them.")
    shape = [(batch, num_kv_heads)]
    what = "one factor per sequence and kv head"
    return _check_fp32("k_descale", k_descale, q, shape, what), _check_fp32("v_descale", v_descale, q, shape, what)


# ----------------------------------------------------------------------------------------------------------------
# Public function


def flash_attn_with_kvcache(q, k_cache, v_cache, k=None, v=None, rotary_cos=None, rotary_sin=None, cache_seqlens=None,
                            cache_batch_idx=None, cache_leftpad=None, block_table=None, softmax_scale=None,
                            causal=False, window_size=(-1, -1), softcap=0.0, rotary_interleaved=True,
                            alibi_slopes=None, num_splits=0, return_softmax_lse=False, *, k_descale=None,
                            v_descale=None):
    """Attention of new query tokens over a KV cache, appending their keys and values first; flash-attn compatible.

    If k and v are given they are written into k_cache and v_cache *in place* at rows cache_seqlens[b] ..
    cache_seqlens[b] + seqlen_new - 1 of each sequence (rotated first when rotary_cos/rotary_sin are given), and
    attention then covers the updated cache. Sequence b attends to its cache rows
    [cache_leftpad[b], cache_seqlens[b] + seqlen_new); the rest of the cache is neither read nor written.

    Grouped-query attention: nheads must be a multiple of nheads_k; query head h uses kv head h // (nheads //
    nheads_k). The query heads that share a kv head are computed together, so each key is read once per kv head.

    causal=True aligns the mask to the bottom-right corner of (seqlen_q, seqlen_k), seqlen_k being the sequence's
    number of keys: query i sees key j iff j <= i + seqlen_k - seqlen_q. With seqlen_q = 2, seqlen_k = 5:
        1 1 1 1 0
        1 1 1 1 1
    A row that sees no key outputs 0 and has LSE -inf.

    Arguments:
        q: (batch, seqlen_q, nheads, headdim), float16 / bfloat16 / float32. headdim: a multiple of 8, at most 512.
        k_cache, v_cache: (batch_size_cache, seqlen_cache, nheads_k, headdim) without block_table, or
            (num_blocks, page_block_size, nheads_k, headdim) with one (a paged cache; any page size: 16, 32, ...,
            256). q's dtype, or float8_e4m3fn with k_descale/v_descale. The headdim must be contiguous.
        k, v: optional (batch, seqlen_new, nheads_k, headdim), q's dtype: new keys/values to append.
        rotary_cos, rotary_sin: optional (seqlen_ro, rotary_dim / 2), rotary_dim <= headdim; needs k and v. The new
            keys are rotated at positions cache_seqlens[b] + i. With causal or a window, query i is rotated at
            position cache_seqlens[b] + i; otherwise every query at cache_seqlens[b] (flash-attn's convention).
            seqlen_ro must cover every position used: positions past it are rotated by angle 0.
        cache_seqlens: int, or (batch,) int32 tensor: each sequence's length before the append. Default None: the
            whole cache (seqlen_cache, or max_num_blocks_per_seq * page_block_size); required with k and v.
            cache_seqlens + seqlen_new must fit the cache.
        cache_batch_idx: optional (batch,) int32: the cache row of each sequence (default b). Not with block_table,
            whose rows already name each sequence's pages.
        cache_leftpad: optional (batch,) int32: the first valid cache row of each sequence (default 0). Keys before
            it are ignored and the mask alignment counts keys from it.
        block_table: optional (batch, max_num_blocks_per_seq) int32: the pages of each sequence, in order.
        softmax_scale: float, default 1 / sqrt(headdim).
        causal: bool, default False.
        window_size: (left, right), default (-1, -1). Query i sees keys i + seqlen_k - seqlen_q - left ..
            i + seqlen_k - seqlen_q + right, inclusive; -1 leaves a side unbounded. causal sets right to 0.
        softcap: float, default 0.0 (off). Scores become softcap * tanh(scores / softcap).
        rotary_interleaved: bool, default True: rotate dims (0, 1), (2, 3), ... (GPT-J); False: dims
            (i, i + rotary_dim / 2) (GPT-NeoX).
        alibi_slopes: optional (nheads,) or (batch, nheads) float32. Adds -slope * |i + seqlen_k - seqlen_q - j|
            to the score of query i and key j (after softcap).
        num_splits: int in [0, 128], default 0. The keys of each sequence are split into this many chunks computed
            in parallel and merged; 0 picks the number so one launch fills the GPU, 1 does not split.
        return_softmax_lse: bool, default False: also return the LSE.
        k_descale, v_descale: keyword-only, (batch, nheads_k) float32, for a float8_e4m3fn cache only: real
            key = stored key * k_descale (likewise v). Appended keys/values are stored as value / descale,
            saturated to +-448.

    Returns:
        out: (batch, seqlen_q, nheads, headdim) in q's dtype.
        softmax_lse (only if return_softmax_lse): (batch, nheads, seqlen_q) float32, natural-log logsumexp of each
            row's scores (-inf for a row that sees no key).

    No backward (inference only).

    Checks (docs/safety.md): shapes, dtypes, devices and Python numbers (an int cache_seqlens included) always raise
    ValueError/TypeError on a mistake, before anything is appended. The index tensors' values (cache_seqlens in
    [0, capacity - seqlen_new], cache_leftpad in [0, cache_seqlens + seqlen_new], cache_batch_idx and the
    block_table entries a sequence uses in range, no two sequences appending to one cache row or page row, the
    rotary table long enough) are checked on every call when they are CPU tensors. CUDA ones are not read (that
    would synchronise with the GPU on every step) unless FLASHTILE_CHECK_VALUES=1 (or within
    `with flashtile.check_values():`): the kernels keep every index inside the cache, and a bad value spoils only
    its own sequence's output.
    """
    key = _call_key(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_batch_idx,
                    cache_leftpad, block_table, softmax_scale, causal, window_size, softcap, rotary_interleaved,
                    alibi_slopes, num_splits, k_descale, v_descale)
    call = _CALLS.get(key) if key is not None else None
    if call is not None:
        result = call.run(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_batch_idx,
                          cache_leftpad, block_table, alibi_slopes, k_descale, v_descale)
        if result is not None:
            return result if return_softmax_lse else result[0]

    given = (q, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_batch_idx, cache_leftpad, block_table,
             alibi_slopes, k_descale, v_descale)
    q, k, v, req, layout = _validate(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens,
                                     cache_batch_idx, cache_leftpad, block_table, softmax_scale, causal, window_size,
                                     softcap, rotary_interleaved, alibi_slopes, num_splits, k_descale, v_descale)
    # Eager calls skip the dispatcher: going through torch.ops costs ~4 us of host time per op (measured on the CPU),
    # as much as a small decode step takes on the GPU.
    if eager(q, k_cache, v_cache):
        if k is not None and req.seqlen_new > 0:
            append(k_cache, v_cache, k, v, req)
        out, lse = attention(q, k_cache, v_cache, req)
    else:
        if k is not None and req.seqlen_new > 0:
            kvcache_append(k_cache, v_cache, k, v, *req.flatten())
        if torch._C._are_functorch_transforms_active() and not torch.compiler.is_compiling():
            out, lse = _TransformAttention.apply(q, k_cache, v_cache, req)
        else:
            out, lse = kvcache_attn(q, k_cache, v_cache, *req.flatten())
    normalized = (q, k, v, req.rotary_cos, req.rotary_sin,
                  req.cache_seqlens if req.cache_seqlens is not None else given[5], req.cache_batch_idx,
                  req.cache_leftpad, req.block_table, req.alibi_slopes, req.k_descale, req.v_descale)
    if key is not None and all(a is b for a, b in zip(normalized, given)):
        _remember(key, q, k_cache, v_cache, k, v, req, _is_int(given[5]), layout)
    return (out, lse) if return_softmax_lse else out


def _validate(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_batch_idx, cache_leftpad,
              block_table, softmax_scale, causal, window_size, softcap, rotary_interleaved, alibi_slopes, num_splits,
              k_descale, v_descale):
    """Check flash_attn_with_kvcache's arguments -> (q, k, v, KVCacheRequest, CacheLayout), normalised: tensors the
    kernels need contiguous come back contiguous (a copy where they were not); an int cache_seqlens becomes
    cache_seqlen; window sides past the cache are clamped to it. The index tensors' values are checked where that
    needs no sync (flashtile._values.readable)."""
    _check_tensor("q", q)
    if q.dim() != 4:
        raise ValueError(f"q must be 4-D (batch, seqlen_q, nheads, headdim), got shape {tuple(q.shape)}; for one "
                         f"decode step use seqlen_q = 1 (q.unsqueeze(1)).")
    if q.dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"q has dtype {q.dtype}; flashtile supports float16, bfloat16 and float32: convert it with "
                        f".to(torch.bfloat16).")
    if not (q.is_cuda or q.is_cpu):
        raise ValueError(f"flashtile runs on CUDA GPUs (and on the CPU for testing), got device {q.device}.")
    if q.numel() == 0:
        raise ValueError(f"q is empty (shape {tuple(q.shape)}); batch, seqlen_q, nheads and headdim must be >= 1.")
    batch, seqlen_q, num_heads, head_dim = q.shape
    if q.stride(-1) != 1:
        q = q.contiguous()
    block_table = _check_block_table(block_table, q, k_cache, batch)
    _check_cache(q, k_cache, v_cache, block_table)
    num_kv_heads = k_cache.shape[2]
    if k_cache.shape[3] != head_dim:
        raise ValueError(f"q has headdim {head_dim} but the cache has {k_cache.shape[3]}; they must be equal.")
    if head_dim % HEAD_DIM_MULTIPLE or head_dim > MAX_HEAD_DIM:
        raise ValueError(f"headdim {head_dim} is not supported: it must be a multiple of {HEAD_DIM_MULTIPLE} and at "
                         f"most {MAX_HEAD_DIM}; pad it with zeros to the next multiple of {HEAD_DIM_MULTIPLE}.")
    if num_kv_heads == 0 or num_heads % num_kv_heads:
        raise ValueError(f"q has {num_heads} heads but the cache has {num_kv_heads}; the number of query heads must "
                         f"be a multiple of the number of key/value heads (grouped-query attention).")
    if k_cache.numel() == 0:
        raise ValueError(f"the cache is empty (shape {tuple(k_cache.shape)}); allocate at least one row per "
                         f"sequence.")
    cache_batch_idx = _check_index("cache_batch_idx", cache_batch_idx, q, batch)
    cache_leftpad = _check_index("cache_leftpad", cache_leftpad, q, batch)
    if block_table is not None and cache_batch_idx is not None:
        raise ValueError("cache_batch_idx cannot be combined with block_table: block_table's row b already names the "
                         "pages of sequence b; reorder its rows instead.")
    if block_table is None and cache_batch_idx is None and k_cache.shape[0] != batch:
        raise ValueError(f"the cache holds {k_cache.shape[0]} sequences but q has batch {batch}; pass "
                         f"cache_batch_idx (batch,) to say which cache row each sequence uses.")
    capacity = _decode._capacity(k_cache, block_table)
    k, v = _check_new_kv(k, v, q, k_cache, batch, num_kv_heads, head_dim)
    seqlen_new = 0 if k is None else k.shape[1]
    rotary_cos, rotary_sin = _check_rotary(rotary_cos, rotary_sin, q, k, head_dim)

    cache_seqlen = capacity
    if cache_seqlens is None:
        if k is not None:
            raise ValueError("appending k and v needs cache_seqlens, each sequence's current length (where the new "
                             "tokens go): pass an int or a (batch,) int32 tensor.")
    elif _is_int(cache_seqlens):
        cache_seqlen, cache_seqlens = cache_seqlens, None
    else:
        cache_seqlens = _check_index("cache_seqlens", cache_seqlens, q, batch)

    scale = resolve_scale(softmax_scale, head_dim)
    if not isinstance(causal, bool):
        raise TypeError(f"causal must be a bool, got {type(causal).__name__}.")
    window_left, window_right = check_window(window_size)
    softcap = check_softcap(softcap)
    if not isinstance(rotary_interleaved, bool):
        raise TypeError(f"rotary_interleaved must be a bool, got {type(rotary_interleaved).__name__}.")
    alibi_slopes = check_alibi(alibi_slopes, q, batch, num_heads)
    if not _is_int(num_splits) or not 0 <= num_splits <= MAX_NUM_SPLITS:
        raise ValueError(f"num_splits must be an int in [0, {MAX_NUM_SPLITS}] (0 = choose automatically, 1 = no "
                         f"split; flash-attn's limit), got {num_splits!r}.")
    k_descale, v_descale = _check_descale(k_descale, v_descale, q, k_cache, batch, num_kv_heads)
    # Rotary positions follow the mask as given (causal or a window: one position per query), before the clamp.
    layout = _values.CacheLayout.of(k_cache, block_table, seqlen_q, seqlen_new, rotary_cos,
                                    causal or (window_left, window_right) != (-1, -1))
    if cache_seqlens is None:
        _values.check_int_seqlen(cache_seqlen, layout)
    if _values.readable(q):
        _values.kvcache(layout, batch, cache_seqlens, cache_seqlen, cache_batch_idx, cache_leftpad, block_table)
    # A side at least as wide as every sequence reaches is unbounded; clamping it there (not to -1, which would
    # change the rotary rule above) keeps every index the kernels compute small, whatever int was passed.
    if window_left > capacity:
        window_left = capacity
    if window_right > seqlen_q:
        window_right = seqlen_q
    return q, k, v, KVCacheRequest(
        cache_seqlens=cache_seqlens, cache_seqlen=cache_seqlen, seqlen_new=seqlen_new, cache_batch_idx=cache_batch_idx,
        cache_leftpad=cache_leftpad, block_table=block_table, rotary_cos=rotary_cos, rotary_sin=rotary_sin,
        rotary_interleaved=rotary_interleaved, alibi_slopes=alibi_slopes, softmax_scale=scale, causal=causal,
        window_left=window_left, window_right=window_right, softcap=softcap, num_splits=num_splits,
        k_descale=k_descale, v_descale=v_descale), layout
