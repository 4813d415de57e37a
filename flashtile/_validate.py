"""Checks at the public boundary. Each error names the bad value and says how to fix it."""
import math

import torch

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
# The FP8 forward's inputs (q, k and v together, with their descale factors).
FP8_DTYPE = torch.float8_e4m3fn
# Head dims: multiples of 8 (16-byte rows in half precision, what TMA and vector loads need) up to 512 (past 256
# the tiles shrink to fit registers and shared memory: supported, not fast).
HEAD_DIM_MULTIPLE = 8
MAX_HEAD_DIM = 512


def _check_tensor(name, t):
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}.")


def _check_dtype(name, t, fp8):
    if fp8:
        if t.dtype != FP8_DTYPE:
            raise TypeError(f"{name} has dtype {t.dtype}; with q_descale, k_descale or v_descale (or float8 inputs) "
                            f"q, k and v must all be float8_e4m3fn: quantize all three, or pass 16-bit inputs "
                            f"without descale factors.")
        return
    if t.dtype in SUPPORTED_DTYPES:
        return
    if t.dtype.is_floating_point and t.element_size() == 1:
        raise TypeError(f"{name} has dtype {t.dtype}; 8-bit inputs are float8_e4m3fn q, k and v together (the FP8 "
                        f"forward of flash_attn_func and flash_attn_varlen_func, with q_descale, k_descale, "
                        f"v_descale): quantize all three with .to(torch.float8_e4m3fn).")
    raise TypeError(f"{name} has dtype {t.dtype}; flashtile supports float16, bfloat16 and float32: "
                    f"convert it with .to(torch.bfloat16) (or float16/float32).")


# Signatures of q, k, v that passed check_qkv: (layout, fp8, then per tensor its shape, dtype, device and
# strides; plain tensors only). The checks read nothing else, so a repeated call with a known signature skips them
# (a loop of small eager calls spends a good part of its host time on its Python). Past MAX_SIGNATURES the cache
# starts over.
MAX_SIGNATURES = 1024
_VALID: dict = {}


def check_qkv(q, k, v, layout="bshd", fp8=False):
    """Validate attention inputs. layout "bshd": (batch, seqlen, heads, headdim), flash-attn's;
    "bhsd": (batch, heads, seqlen, headdim), torch SDPA's; "thd": (total_seqlen, heads, headdim), the varlen
    packing (treated as one batch entry here). fp8: the FP8 forward's inputs, float8_e4m3fn. Returns nothing;
    raises TypeError/ValueError."""
    sig = None
    # (Not for tensor subclasses, nor while torch.compile traces: symbolic shapes make no key.)
    if type(q) is torch.Tensor and type(k) is torch.Tensor and type(v) is torch.Tensor \
            and not torch.compiler.is_compiling():
        sig = (layout, fp8, q.shape, k.shape, v.shape, q.dtype, k.dtype, v.dtype, q.device, k.device, v.device,
               q.stride(), k.stride(), v.stride())
        if sig in _VALID:
            return
    _check_qkv(q, k, v, layout, fp8)
    if sig is not None:
        if len(_VALID) >= MAX_SIGNATURES:
            _VALID.clear()
        _VALID[sig] = True


def _check_qkv(q, k, v, layout, fp8):
    names = ("query", "key", "value") if layout == "bhsd" else ("q", "k", "v")
    dims = {"bshd": "(batch, seqlen, heads, headdim)", "bhsd": "(batch, heads, seqlen, headdim)",
            "thd": "(total_seqlen, heads, headdim)"}[layout]
    rank = 3 if layout == "thd" else 4
    for name, t in zip(names, (q, k, v)):
        _check_tensor(name, t)
        if t.dim() != rank:
            hint = ("concatenate the sequences along the first dimension (cu_seqlens marks where each starts)"
                    if layout == "thd" else "add the missing batch or head dimension with unsqueeze, or reshape")
            raise ValueError(f"{name} must be {rank}-D {dims}, got shape {tuple(t.shape)} ({t.dim()}-D); {hint}.")
    if layout == "thd":
        q, k, v = (t.unsqueeze(0) for t in (q, k, v))
        layout = "bshd"
    for name, t in zip(names, (q, k, v)):
        _check_dtype(name, t, fp8)
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"{names[0]}, {names[1]}, {names[2]} must share one dtype, got {q.dtype}, {k.dtype}, "
                        f"{v.dtype}; convert them to one dtype with .to(...).")
    if not (q.device == k.device == v.device):
        raise ValueError(f"{names[0]}, {names[1]}, {names[2]} must be on one device, got {q.device}, {k.device}, "
                         f"{v.device}; move them with .to(device).")
    if q.device.type not in ("cuda", "cpu"):
        raise ValueError(f"flashtile runs on CUDA GPUs (and on the CPU for testing), got device {q.device}.")

    def bshd(t):  # (batch, seqlen, heads, headdim) view of the shape
        return tuple(t.shape) if layout == "bshd" else (t.shape[0], t.shape[2], t.shape[1], t.shape[3])

    (b, _, hq, d), (bk, sk, hk, dk), (bv, sv, hv, dv) = bshd(q), bshd(k), bshd(v)
    for name, t in zip(names, (q, k, v)):
        if t.numel() == 0:
            raise ValueError(f"{name} is empty (shape {tuple(t.shape)}); every dimension of {dims} must be at "
                             f"least 1.")
    if not (b == bk == bv):
        raise ValueError(f"batch sizes differ: {names[0]} {b}, {names[1]} {bk}, {names[2]} {bv}; "
                         f"they must be equal.")
    if sk != sv:
        raise ValueError(f"{names[1]} has seqlen {sk} but {names[2]} has {sv}; keys and values must have the "
                         f"same sequence length.")
    if hk != hv:
        raise ValueError(f"{names[1]} has {hk} heads but {names[2]} has {hv}; keys and values must have the "
                         f"same number of heads.")
    if d != dk:
        raise ValueError(f"head dims differ: {names[0]} {d}, {names[1]} {dk}; queries and keys need one head dim "
                         f"(values may have another).")
    for name, size in ((names[0], d), (names[2], dv)):
        if size % HEAD_DIM_MULTIPLE or size > MAX_HEAD_DIM:
            raise ValueError(f"{name} head dim {size} is not supported: it must be a multiple of "
                             f"{HEAD_DIM_MULTIPLE} and at most {MAX_HEAD_DIM}; pad the head dim with zeros to the "
                             f"next multiple of {HEAD_DIM_MULTIPLE}.")
    if hq % hk:
        raise ValueError(f"{names[0]} has {hq} heads but {names[1]}/{names[2]} have {hk}; the number of query heads "
                         f"must be a multiple of the number of key/value heads (grouped-query attention).")
    for name, t in zip(names, (q, k, v)):
        if t.stride(-1) != 1:
            raise ValueError(f"{name}'s last dimension (headdim) must be contiguous, got stride {t.stride(-1)}; "
                             f"call {name}.contiguous() first.")


def resolve_scale(softmax_scale, head_dim, name="softmax_scale"):
    if softmax_scale is None:
        return 1.0 / math.sqrt(head_dim)
    if isinstance(softmax_scale, bool) or not isinstance(softmax_scale, (int, float)):
        raise TypeError(f"{name} must be a float or None (meaning 1/sqrt(headdim)), got "
                        f"{type(softmax_scale).__name__}.")
    if not math.isfinite(softmax_scale):
        raise ValueError(f"{name} must be finite, got {softmax_scale}.")
    return float(softmax_scale)


def not_built(feature, issue_hint):
    """Options whose feature is not built yet raise instead of being ignored."""
    return NotImplementedError(f"{feature} is not implemented in flashtile yet ({issue_hint}); call without it.")


def _is_int(x):
    return isinstance(x, int) and not isinstance(x, bool)


def _is_float(x):
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def check_window(window_size):
    """-> (left, right) ints, -1 meaning unbounded."""
    if not isinstance(window_size, (tuple, list)) or len(window_size) != 2 or not all(map(_is_int, window_size)):
        raise TypeError(f"window_size must be a pair (left, right) of ints, -1 meaning unbounded; got "
                        f"{window_size!r}. Use (-1, -1) for full attention.")
    left, right = window_size
    if left < -1 or right < -1:
        raise ValueError(f"window_size entries must be >= -1 (-1 = unbounded), got {tuple(window_size)}.")
    return left, right


def check_softcap(softcap):
    if not _is_float(softcap):
        raise TypeError(f"softcap must be a float (0.0 = off), got {type(softcap).__name__}.")
    # Comparisons only (no math.isfinite): torch.compile traces this with the value as a constant.
    if not 0.0 <= softcap < float("inf"):
        raise ValueError(f"softcap must be finite and >= 0 (0.0 = off), got {softcap}.")
    return float(softcap)


def check_dropout(dropout_p):
    if not _is_float(dropout_p):
        raise TypeError(f"dropout_p must be a float, got {type(dropout_p).__name__}.")
    if not 0.0 <= dropout_p < 1.0:
        raise ValueError(f"dropout_p must be in [0, 1), got {dropout_p}; pass 0.0 for no dropout (e.g. in eval).")
    return float(dropout_p)


def _check_fp32_vector(name, t, q, shapes, what):
    _check_tensor(name, t)
    if t.dtype != torch.float32:
        raise TypeError(f"{name} must be float32, got {t.dtype}; convert it with .float().")
    if t.device != q.device:
        raise ValueError(f"{name} is on {t.device} but q is on {q.device}; move it with .to(q.device).")
    if tuple(t.shape) not in shapes:
        raise ValueError(f"{name} must have shape {' or '.join(str(s) for s in shapes)} ({what}), got "
                         f"{tuple(t.shape)}.")


def check_alibi(alibi_slopes, q, batch, heads):
    if alibi_slopes is not None:
        _check_fp32_vector("alibi_slopes", alibi_slopes, q, [(heads,), (batch, heads)],
                           "one slope per query head, optionally per batch entry")
        if alibi_slopes.stride(-1) != 1:
            alibi_slopes = alibi_slopes.contiguous()
    return alibi_slopes


def check_descales(descales, q, batch, kv_heads):
    """The FP8 forward's factors: (q_descale, k_descale, v_descale), each None (1) or fp32 (batch, kv_heads).
    Returns them as one fp32 (batch, kv_heads, 3) tensor (AttentionRequest.descale)."""
    parts = []
    for name, t in zip(("q_descale", "k_descale", "v_descale"), descales):
        if t is None:
            parts.append(torch.ones((batch, kv_heads), dtype=torch.float32, device=q.device))
            continue
        _check_fp32_vector(name, t, q, [(batch, kv_heads)], "one factor per batch entry and kv head, FA3's layout")
        parts.append(t)
    return torch.stack(parts, dim=-1)


def check_sinks(sinks, q, heads):
    if sinks is not None:
        _check_fp32_vector("sinks", sinks, q, [(heads,)], "one sink logit per query head")
        sinks = sinks.contiguous()
    return sinks


def check_attn_mask(attn_mask, query, batch, heads, seqlen_q, seqlen_k):
    """torch SDPA's attn_mask: bool (True = attend) or a float bias, broadcastable to (batch, heads, seqlen_q,
    seqlen_k). Returns a 4-D view of it (size-1 dims broadcast)."""
    _check_tensor("attn_mask", attn_mask)
    if attn_mask.dtype != torch.bool and not attn_mask.is_floating_point():
        raise TypeError(f"attn_mask must be bool (True = attend) or a float bias, got {attn_mask.dtype}; convert "
                        f"an integer mask with .bool().")
    if attn_mask.device != query.device:
        raise ValueError(f"attn_mask is on {attn_mask.device} but query is on {query.device}; move it with "
                         f".to(query.device).")
    full = (batch, heads, seqlen_q, seqlen_k)
    if attn_mask.dim() > 4 or any(n not in (1, f) for n, f in zip(attn_mask.shape[::-1], full[::-1])):
        raise ValueError(f"attn_mask of shape {tuple(attn_mask.shape)} does not broadcast to (batch, heads, "
                         f"seqlen_q, seqlen_k) = {full}; each dimension must match or be 1.")
    return attn_mask.reshape((1,) * (4 - attn_mask.dim()) + tuple(attn_mask.shape))


def check_varlen(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, q):
    """The varlen arguments' types, shapes and devices -> contiguous (cu_seqlens_q, cu_seqlens_k). Their values
    (offsets against the rows, max_seqlen against the lengths) are flashtile._values.varlen_lengths's."""
    for name, cu in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)):
        _check_tensor(name, cu)
        if cu.dtype != torch.int32:  # ValueError, as flashtile has always raised here
            raise ValueError(f"{name} has dtype {cu.dtype}; it must be torch.int32 (flash-attn's varlen offsets): "
                             f"convert it with .to(torch.int32).")
        if cu.dim() != 1 or cu.numel() < 2:
            raise ValueError(f"{name} must be a 1-D tensor of batch + 1 offsets (0, len_0, len_0 + len_1, ...), "
                             f"batch >= 1, got shape {tuple(cu.shape)}.")
        if cu.device != q.device:
            raise ValueError(f"{name} is on {cu.device} but q is on {q.device}; move it with .to(q.device).")
    if cu_seqlens_q.numel() != cu_seqlens_k.numel():
        raise ValueError(f"cu_seqlens_q has {cu_seqlens_q.numel()} entries but cu_seqlens_k has "
                         f"{cu_seqlens_k.numel()}; both hold batch + 1 offsets.")
    for name, m in (("max_seqlen_q", max_seqlen_q), ("max_seqlen_k", max_seqlen_k)):
        if not _is_int(m):
            raise TypeError(f"{name} must be an int (the longest sequence's length), got {type(m).__name__} "
                            f"{m!r}" + ("; pass int(...) of it." if isinstance(m, (torch.Tensor, float)) else "."))
        if m < 0:
            raise ValueError(f"{name} must be >= 0 (the longest sequence's length), got {m}.")
    return cu_seqlens_q.contiguous(), cu_seqlens_k.contiguous()


PAGED_INDEX_DTYPES = (torch.int32, torch.int64)


def _check_index(name, t, q, shape, what):
    _check_tensor(name, t)
    if t.dtype not in PAGED_INDEX_DTYPES:
        raise TypeError(f"{name} has dtype {t.dtype}; it must be torch.int32 (or int64): convert it with "
                        f".to(torch.int32).")
    if t.device != q.device:
        raise ValueError(f"{name} is on {t.device} but q is on {q.device}; move it with .to(q.device).")
    if tuple(t.shape) != shape:
        raise ValueError(f"{name} has shape {tuple(t.shape)}; it must be {what}.")
    return t.contiguous()


def check_paged(q, k_cache, v_cache, block_table, seqused_k, batch):
    """A paged varlen call's caches and index tensors (values: flashtile._values.paged_lengths) -> contiguous
    (block_table, seqused_k or None). k_cache, v_cache: (num_pages, page_size, nheads_k, headdim[_v])."""
    for name, t in (("k", k_cache), ("v", v_cache)):
        _check_tensor(name, t)
        if t.dim() != 4:
            raise ValueError(f"with block_table, {name} must be a 4-D paged cache (num_blocks, page_block_size, "
                             f"nheads_k, headdim), got shape {tuple(t.shape)}.")
    if k_cache.shape[:3] != v_cache.shape[:3]:
        raise ValueError(f"k has shape {tuple(k_cache.shape)} but v has {tuple(v_cache.shape)}; the paged caches "
                         f"must agree in (num_blocks, page_block_size, nheads_k).")
    check_qkv(q, k_cache[0], v_cache[0], layout="thd")  # dtypes, devices, heads, head dims, unit strides
    pages = block_table.shape[-1] if isinstance(block_table, torch.Tensor) and block_table.dim() == 2 else 0
    block_table = _check_index("block_table", block_table, q, (batch, pages) if pages else (batch, 1),
                               f"(batch, max_num_blocks_per_seq) = ({batch}, n >= 1): row b lists the pages of "
                               f"sequence b in order")
    if seqused_k is not None:
        seqused_k = _check_index("seqused_k", seqused_k, q, (batch,), f"(batch,) = ({batch},): the number of keys "
                                 f"of each sequence")
    return block_table, seqused_k
