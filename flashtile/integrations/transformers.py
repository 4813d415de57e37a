"""flashtile as a transformers attention implementation.

    import flashtile.integrations.transformers as ft
    model = AutoModelForCausalLM.from_pretrained(name, attn_implementation=ft.register())
    # or, on a loaded model: model.set_attn_implementation(ft.register())

`register()` adds `attention_forward` to transformers' `AttentionInterface` and `padding_mask` to its
`AttentionMaskInterface` under the name `ATTN_IMPLEMENTATION` ("tile_attention"), and returns that name. The name
avoids the substring "flash" on purpose: transformers 5 treats every implementation whose name contains "flash" as
one of its own flash-attn integrations (it then tries to import flash-attn or download a kernel from the Hub, and
changes how generate() and the masks behave), which flashtile is not.

What a call does (query/key/value arrive as (B, H, S, D), the output leaves as (B, S, H, D)):
- No padding: `flash_attn_func` on transposed views (no copy), causal aligned bottom-right, so a chunk of new
  tokens over a longer cache is handled.
- Padding: transformers hands `padding_mask`'s (B, S_k) bool mask of valid keys (never a (B, 1, S, S) mask). Each
  row's valid tokens are gathered to its front (a stable sort, so their order is kept), and
  `flash_attn_varlen_func` runs three segments per row: valid queries over valid keys, padded queries over no keys
  (output 0), no queries over padded keys (nothing). Shapes never depend on the mask's values: no host sync, and
  torch.compile(fullgraph=True) traces it. Left, right and both-sided padding (and gaps) work the same way.
  Encoders (is_causal False, no window) gather only the keys, so every query row, padded or not, matches eager.
- Packed sequences: the `cu_seq_lens_q/k` and `max_length_q/k` keyword arguments of
  `DataCollatorWithFlattening(return_flash_attn_kwargs=True)` go straight to `flash_attn_varlen_func`. Without them,
  `position_ids` that restart mark the sequences: read on the host once per forward (eager mode only; under
  torch.compile pass the keyword arguments, as for transformers' own flash-attn path).
- Decode steps (one query per sequence, no gradient): `flash_attn_with_kvcache` over transformers' cache tensors (the
  split-KV decode kernel), a padded row's valid keys given as `cache_leftpad` .. `cache_seqlens` (left padding, as
  generate() pads decoder-only models). Attention sinks (gpt-oss) join as a partial of zero value merged through the
  LSE: out * sigmoid(lse - sink) (docs/derivation.md, chapter 7).
- Grouped-query attention, `sliding_window` (transformers' inclusive size w: a causal query sees its w - 1
  predecessors), `softcap` (Gemma 2), `s_aux` sinks (gpt-oss), dropout while training, `scaling`, head dims
  that are not multiples of 8 (zero-padded) and a value head dim that differs.
- A 4-D mask a caller built itself goes through `flashtile.scaled_dot_product_attention(attn_mask=...)`.
"""
import collections
import warnings
import weakref

import torch
import torch.nn.functional as F

from .. import flash_attn_func, flash_attn_varlen_func, flash_attn_with_kvcache, scaled_dot_product_attention

ATTN_IMPLEMENTATION = "tile_attention"

# The head dims the kernels take are multiples of this; others are zero-padded up to it (scores are unchanged).
_HEAD_DIM_MULTIPLE = 8
# The decode kernel's largest head dim (flash_attn_with_kvcache); larger ones take the general path.
_DECODE_MAX_HEAD_DIM = 256


def register():
    """Register flashtile with transformers and return the name to pass as `attn_implementation`.

    Registers `attention_forward` in `transformers.AttentionInterface` and `padding_mask` in
    `transformers.AttentionMaskInterface` (so transformers builds the 2-D padding mask flashtile uses, never a
    (batch, 1, q_len, kv_len) one). Calling it again is harmless. Returns ATTN_IMPLEMENTATION ("tile_attention").
    """
    try:
        from transformers import AttentionInterface, AttentionMaskInterface
    except ImportError as err:
        raise ImportError("flashtile.integrations.transformers needs transformers >= 4.56 (AttentionInterface and "
                          "AttentionMaskInterface): pip install 'flashtile[integrations]'.") from err
    AttentionInterface.register(ATTN_IMPLEMENTATION, attention_forward)
    AttentionMaskInterface.register(ATTN_IMPLEMENTATION, padding_mask)
    return ATTN_IMPLEMENTATION


# ----------------------------------------------------------------------------------------------------------------
# The mask transformers builds for us

# The last masks padding_mask found to have gaps (a padded token between two valid ones), as weak references: the
# decode kernel reads one contiguous range of keys per row, so such masks take the general path. A forward makes
# one mask per attention type (full, sliding); a few suffice. Found in eager mode only (below).
_GAPPED = collections.deque(maxlen=8)


def padding_mask(batch_size, q_length, kv_length, q_offset=0, kv_offset=0, mask_function=None, attention_mask=None,
                 **kwargs):
    """transformers' mask hook: a (batch, kv_length) bool mask of the keys that may be attended, or None.

    `attention_mask` is the user's 2-D padding mask over positions (1 = token); key slot j holds position
    kv_offset + j. A static cache (its query offset is a tensor) also hides the slots not written yet. Causality,
    windows and packing are not in the mask: the attention call applies them. Returns None when nothing is hidden
    (checked on the host in eager mode; while compiling the mask is always returned, which costs a gather).
    The pattern in `mask_function` is not read (as in transformers' flash-attn path): models whose pattern is not
    causal/bidirectional with padding (image-token overlays) need another implementation.
    """
    device = kwargs.get("device")
    mask = None
    if attention_mask is not None:
        mask = attention_mask.to(torch.bool)
        short = kv_offset + kv_length - mask.shape[-1]
        if short > 0:  # a static cache's slots past the mask: not written yet
            mask = torch.cat([mask, mask.new_zeros(mask.shape[0], short)], dim=-1)
        mask = mask[:, kv_offset:kv_offset + kv_length]
        device = mask.device
    if isinstance(q_offset, torch.Tensor):  # StaticCache: slots past the newest query hold nothing yet
        slots = torch.arange(kv_length, device=q_offset.device) + kv_offset
        written = (slots < q_offset + q_length).expand(batch_size, kv_length)
        mask = written if mask is None else mask & written.to(mask.device)
    if mask is None or torch.compiler.is_compiling():
        return mask
    idx = torch.arange(kv_length, device=device)
    span = torch.where(mask, idx + 1, 0).amax(-1) - torch.where(mask, idx, kv_length).amin(-1)
    full, gapped = torch.stack([mask.all(), (mask.sum(-1) < span).any()]).tolist()  # one host sync per forward
    if full:
        return None
    if gapped:
        _GAPPED.append(weakref.ref(mask))
    return mask


# ----------------------------------------------------------------------------------------------------------------
# The attention function


def attention_forward(module, query, key, value, attention_mask, dropout=0.0, scaling=None, sliding_window=None,
                      softcap=None, is_causal=None, s_aux=None, **kwargs):
    """transformers' attention hook: (out (batch, q_len, heads, head_dim_v), None).

    query: (batch, heads, q_len, head_dim); key/value: (batch, kv_heads, kv_len, head_dim(_v)), heads a multiple
    of kv_heads. attention_mask: padding_mask's (batch, kv_len) bool mask, None, or a 4-D mask (bool or additive)
    built by the caller. dropout: probability (transformers passes 0.0 in eval). scaling: default
    1 / sqrt(head_dim). sliding_window: transformers' window size w (a causal query sees keys i - w < j <= i; an
    encoder's query sees |i - j| <= w). softcap: Gemma 2's logit cap. is_causal: default module.is_causal.
    s_aux: attention sinks (heads,) (gpt-oss). Keyword arguments: cu_seq_lens_q/k and max_length_q/k for packed
    batches, position_ids (restarting ones mark packed sequences in eager mode). Attention weights are not
    returned (None), as with every flash implementation.
    """
    if kwargs.get("output_attentions"):
        _warn_once("flashtile does not return attention weights (output_attentions=True gives None); use "
                   "attn_implementation='eager' to see them.")
    if is_causal is None:
        is_causal = getattr(module, "is_causal", True)
    is_causal = bool(is_causal)
    head_dim, head_dim_v = query.shape[-1], value.shape[-1]
    scale = float(scaling) if scaling is not None else head_dim ** -0.5
    query, key, value = _pad_head_dims(query, key, value)
    q, k, v = (t.transpose(1, 2) for t in (query, key, value))  # (batch, seqlen, heads, head_dim): views
    opts = dict(softmax_scale=scale, causal=is_causal, window_size=_window(sliding_window, is_causal),
                softcap=float(softcap) if softcap else 0.0)
    sinks = None if s_aux is None else s_aux.float()
    dropout = float(dropout)
    if attention_mask is not None and attention_mask.dim() == 4:
        out = _with_dense_mask(query, key, value, attention_mask, dropout, opts, sinks)
    elif _is_packed(kwargs):
        out = _packed(q, k, v, kwargs, dropout, opts, sinks)
    elif _decodes(q, k, v, attention_mask, dropout, sinks):
        out = _decode(q, k, v, attention_mask, opts, sinks)
    elif attention_mask is not None:
        ordered = is_causal or opts["window_size"] != (-1, -1)
        out = _padded(q, k, v, attention_mask, dropout, opts, sinks, ordered)
    else:
        bounds = _packed_positions(kwargs.get("position_ids"), q.shape[0], q.shape[1], k.shape[1])
        if bounds is not None:
            out = _varlen(q, k, v, bounds, dropout, opts, sinks)
        else:
            out = flash_attn_func(q, k, v, dropout_p=dropout, sinks=sinks, **opts)
    return out[..., :head_dim_v], None


def _window(sliding_window, is_causal):
    """transformers' window size -> flashtile's (left, right), matching transformers' eager masks."""
    if not sliding_window:
        return (-1, -1)
    if is_causal:
        return (int(sliding_window) - 1, 0)
    return (int(sliding_window), int(sliding_window))


def _pad_head_dims(query, key, value):
    """Zero-pad head dims up to a multiple of 8 (query/key together, value alone): q.k and the output's first
    head_dim_v columns are unchanged."""
    def up(n):
        return -n % _HEAD_DIM_MULTIPLE
    if up(query.shape[-1]):
        query, key = F.pad(query, (0, up(query.shape[-1]))), F.pad(key, (0, up(key.shape[-1])))
    if up(value.shape[-1]):
        value = F.pad(value, (0, up(value.shape[-1])))
    return query, key, value


_WARNED = set()


def _warn_once(message):
    if message not in _WARNED:
        _WARNED.add(message)
        warnings.warn(message, stacklevel=3)


def _with_dense_mask(query, key, value, mask, dropout, opts, sinks):
    """A 4-D mask the caller built (bool, True = attend, or additive float) through flashtile's SDPA, which applies
    it as given (top-left alignment; the mask already holds any causal pattern)."""
    if sinks is not None or opts["softcap"] or opts["window_size"] != (-1, -1):
        raise ValueError("a 4-D attention_mask cannot be combined with sinks, softcap or a sliding window in "
                         "flashtile; pass the 2-D padding mask (transformers builds it when attn_implementation is "
                         "flashtile's) instead of a 4-D one.")
    if mask.dtype != torch.bool and mask.dtype != query.dtype:
        mask = mask.to(query.dtype)
    out = scaled_dot_product_attention(query, key, value, attn_mask=mask, dropout_p=dropout,
                                       scale=opts["softmax_scale"], enable_gqa=True)
    return out.transpose(1, 2)


# ----------------------------------------------------------------------------------------------------------------
# Packed sequences


def _is_packed(kwargs):
    return all(kwargs.get(name) is not None for name in ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q",
                                                         "max_length_k"))


def _packed(q, k, v, kwargs, dropout, opts, sinks):
    """A batch flattened into one row (DataCollatorWithFlattening): cu_seq_lens_q/k mark the sequences."""
    bounds = (kwargs["cu_seq_lens_q"].to(torch.int32), kwargs["cu_seq_lens_k"].to(torch.int32),
              int(kwargs["max_length_q"]), int(kwargs["max_length_k"]))
    return _varlen(q, k, v, bounds, dropout, opts, sinks)


def _varlen(q, k, v, bounds, dropout, opts, sinks):
    cu_q, cu_k, max_q, max_k = bounds
    batch = q.shape[0]
    out = flash_attn_varlen_func(q.reshape(-1, *q.shape[2:]), k.reshape(-1, *k.shape[2:]),
                                 v.reshape(-1, *v.shape[2:]), cu_q, cu_k, max_q, max_k, dropout_p=dropout,
                                 sinks=sinks, **opts)
    return out.view(batch, -1, *out.shape[1:])


# position_ids -> (cu_seqlens, max_seqlen) or None, for the position_ids tensor of the running forward: every layer
# of a model receives the same tensor, so the host reads it once per forward.
_POSITIONS = (None, None, None)


def _packed_positions(position_ids, batch, seqlen_q, seqlen_k):
    """Sequences packed in rows: position_ids that do not step by 1 start a new sequence (transformers' own rule).
    -> (cu_q, cu_k, max_q, max_k) over the flattened batch, or None (one sequence per row, or not readable)."""
    global _POSITIONS
    if (position_ids is None or seqlen_q != seqlen_k or seqlen_q == 1 or position_ids.dim() != 2
            or position_ids.shape[-1] != seqlen_q or torch.compiler.is_compiling()):
        return None
    ref, version, found = _POSITIONS
    if ref is not None and ref() is position_ids and version == position_ids._version:
        return found
    pos = position_ids.expand(batch, seqlen_q)
    starts = torch.ones_like(pos, dtype=torch.bool)
    starts[:, 1:] = pos[:, 1:] != pos[:, :-1] + 1
    first = starts.flatten().nonzero().flatten().to(torch.int32)  # host sync
    found = None
    if first.numel() > batch:
        cu = torch.cat([first, first.new_full((1,), batch * seqlen_q)])
        longest = int(cu.diff().max())
        found = (cu, cu, longest, longest)
    _POSITIONS = (weakref.ref(position_ids), position_ids._version, found)
    return found


# ----------------------------------------------------------------------------------------------------------------
# Decode steps


def _decodes(q, k, v, mask, dropout, sinks):
    """One query per row, nothing to differentiate: the split-KV decode kernel (flash_attn_with_kvcache)."""
    if q.shape[1] != 1 or dropout > 0 or k.shape != v.shape or q.shape[-1] > _DECODE_MAX_HEAD_DIM:
        return False
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (q, k, v, sinks)):
        return False
    return mask is None or not any(ref() is mask for ref in _GAPPED)


def _decode(q, k, v, mask, opts, sinks):
    """q (batch, 1, heads, d) over transformers' cache tensors k, v (batch, kv_len, kv_heads, d), read in place."""
    extra = {}
    if mask is not None:  # each row's keys: one contiguous range [first, end) of slots (left padding)
        slots = torch.arange(mask.shape[-1], device=mask.device, dtype=torch.int32)
        end = torch.where(mask, slots + 1, 0).amax(-1).to(torch.int32)
        first = torch.minimum(torch.where(mask, slots, mask.shape[-1]).amin(-1).to(torch.int32), end)
        extra = dict(cache_seqlens=end, cache_leftpad=first)
    out, lse = flash_attn_with_kvcache(q, k, v, return_softmax_lse=True, **extra, **opts)
    if sinks is not None:
        # A sink is a key of value 0 and logit s: merged with the keys' partial (out, lse), the output scales by
        # exp(lse) / (exp(lse) + exp(s)) (docs/derivation.md, chapter 7); a row with no key (lse -inf) stays 0.
        weight = torch.sigmoid(lse - sinks[None, :, None])  # (batch, heads, 1)
        out = (out.float() * weight.transpose(1, 2)[..., None]).to(out.dtype)
    return out


# ----------------------------------------------------------------------------------------------------------------
# Padded batches


def _valid_first(mask):
    """(permutation (batch, n) putting each row's valid slots first in their order, number valid (batch,) int32)."""
    order = torch.argsort((~mask).to(torch.int8), dim=-1, stable=True)
    return order, mask.sum(-1, dtype=torch.int32)


def _gather_rows(x, order):
    """x (batch, n, ...) with row b's slots reordered by order[b]: a new contiguous tensor."""
    rows = torch.arange(x.shape[0], device=x.device)[:, None]
    return x[rows, order]


def _query_mask(mask, seqlen_q):
    """The queries' validity: the last seqlen_q slots up to the last valid key (generate's left padding, a chunk of
    new tokens over a cache, and a static cache whose later slots are empty)."""
    if mask.shape[-1] == seqlen_q:
        return mask
    slots = torch.arange(mask.shape[-1], device=mask.device)
    end = torch.where(mask, slots + 1, seqlen_q).amax(-1, keepdim=True).clamp(min=seqlen_q)
    return mask.gather(-1, end - seqlen_q + torch.arange(seqlen_q, device=mask.device))


def _padded(q, k, v, mask, dropout, opts, sinks, ordered):
    """A padded batch through the varlen kernels without a host sync: three segments per row (see the module
    docstring). ordered: the queries' positions matter (causal, windows), so valid queries are gathered to the
    front too and their outputs scattered back; padded query rows come out 0. Otherwise (encoders) every query
    row attends the row's valid keys, as in eager."""
    batch, seqlen_q, heads = q.shape[:3]
    seqlen_k = k.shape[1]
    mask = mask.to(q.device)
    key_order, n_k = _valid_first(mask)
    k, v = _gather_rows(k, key_order), _gather_rows(v, key_order)
    if ordered:
        query_order, n_q = _valid_first(_query_mask(mask, seqlen_q))
        q = _gather_rows(q, query_order)
    else:
        n_q = torch.full_like(n_k, seqlen_q)
    none = torch.zeros_like(n_k)
    lens_q = torch.stack([n_q, seqlen_q - n_q, none], dim=1).flatten()
    lens_k = torch.stack([n_k, none, seqlen_k - n_k], dim=1).flatten()
    cu_q, cu_k = (F.pad(torch.cumsum(lens, 0, dtype=torch.int32), (1, 0)) for lens in (lens_q, lens_k))
    out = _varlen(q, k, v, (cu_q, cu_k, seqlen_q, seqlen_k), dropout, opts, sinks)
    if ordered:
        out = _gather_rows(out, torch.argsort(query_order, dim=-1))
    return out
