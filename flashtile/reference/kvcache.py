"""Attention over a KV cache in pure PyTorch: the oracle of flash_attn_with_kvcache and its CPU fallback.

The steps the kernels fuse, one sequence at a time (docs/kvcache.md): rotary embedding of the new keys, the append
into the cache, the gather of a paged cache, then naive_attention over the sequence's valid keys with its masks
aligned bottom-right on them.

# q: [B, Sq, Hq, D]   k_cache, v_cache: [B_cache, S_cache, Hk, D], or paged [num_pages, page_size, Hk, D]
# k, v (new): [B, S_new, Hk, D]   rotary_cos, rotary_sin: [seqlen_ro, rotary_dim / 2]
# out: [B, Sq, Hq, D]   lse: [B, Hq, Sq]
"""

import torch

from .. import _values
from .naive import naive_attention

# Largest finite float8 e4m3 value: an append into an fp8 cache saturates there.
FP8_E4M3_MAX = 448.0


def apply_rotary(x, cos, sin, positions, interleaved=True):
    """Rotary embedding of x [B, S, H, D] at positions [B, S] (rows of cos/sin), computed in x.dtype.

    The first rotary_dim = 2 * cos.shape[1] dims turn in pairs by angle t at the token's position:
    interleaved pairs dims (2t, 2t + 1) (GPT-J), otherwise (t, t + rotary_dim / 2) (GPT-NeoX); with (a, b) a pair,
        a' = a cos - b sin        b' = b cos + a sin
    The remaining dims pass through. Positions past the table (>= cos.shape[0]) turn by angle 0, as in the kernels.
    """
    rotary_dim = 2 * cos.shape[1]
    inside = (positions < cos.shape[0]).unsqueeze(-1)                       # [B, S, 1]
    rows = positions.clamp(max=cos.shape[0] - 1)
    c = torch.where(inside, cos.to(x.dtype)[rows], 1.0).unsqueeze(2)        # [B, S, 1, rotary_dim / 2]
    s = torch.where(inside, sin.to(x.dtype)[rows], 0.0).unsqueeze(2)
    rot, rest = x[..., :rotary_dim], x[..., rotary_dim:]
    if interleaved:
        a, b = rot[..., 0::2], rot[..., 1::2]
        rot = torch.stack((a * c - b * s, b * c + a * s), dim=-1).flatten(-2)
    else:
        a, b = rot.chunk(2, dim=-1)
        rot = torch.cat((a * c - b * s, b * c + a * s), dim=-1)
    return torch.cat((rot, rest), dim=-1)


def gather_pages(k_cache, v_cache, block_table, cu_seqlens_k, seqused_k=None):
    """The keys and values of a paged varlen batch (flash_attn_varlen_func with block_table), packed contiguously:
    sequence b's keys are its first n_b cache slots, n_b = seqused_k[b] or cu_seqlens_k[b + 1] - cu_seqlens_k[b];
    slot j is row j % page_size of page block_table[b, j // page_size]. Returns (k [total_k, Hk, D], v
    [total_k, Hk, Dv], cu_seqlens_k int32 (B + 1,) of the packed keys). Index values must be valid (checked by
    flashtile._values.paged_lengths)."""
    page = k_cache.shape[1]
    if seqused_k is None:
        lengths = (cu_seqlens_k[1:] - cu_seqlens_k[:-1]).tolist()
    else:
        lengths = seqused_k.tolist()
    table = block_table.tolist()
    rows = [table[b][j // page] * page + j % page for b, n in enumerate(lengths) for j in range(n)]
    rows = torch.tensor(rows, dtype=torch.int64, device=k_cache.device)
    k = k_cache.flatten(0, 1)[rows]
    v = v_cache.flatten(0, 1)[rows]
    cu = torch.tensor([0] + lengths, dtype=torch.int64).cumsum(0).to(torch.int32).to(k_cache.device)
    return k, v, cu


def _lengths(cache_seqlens, batch, capacity):
    """cache_seqlens (int, (B,) tensor or None = the whole cache) as a list of Python ints."""
    if cache_seqlens is None:
        return [capacity] * batch
    if isinstance(cache_seqlens, int):
        return [cache_seqlens] * batch
    return [int(n) for n in cache_seqlens.tolist()]


def _capacity(k_cache, block_table):
    return block_table.shape[1] * k_cache.shape[1] if block_table is not None else k_cache.shape[1]


def _check_indices(k_cache, block_table, batch, cache_seqlens, seqlen_new, cache_batch_idx, cache_leftpad=None):
    """The index values flash_attn_with_kvcache checks (flashtile._values.kvcache), here too: a bad one raises a
    ValueError instead of reading or writing rows of another sequence (a negative index would wrap around)."""
    layout = _values.CacheLayout.of(k_cache, block_table, 1, seqlen_new, None, False)
    length = layout.capacity
    if isinstance(cache_seqlens, int):
        length, cache_seqlens = cache_seqlens, None
    if cache_seqlens is None:
        _values.check_int_seqlen(length, layout)
    _values.kvcache(layout, batch, cache_seqlens, length, cache_batch_idx, cache_leftpad, block_table)


def _slots(b, rows, k_cache, block_table, cache_batch_idx):
    """Index of sequence b's cache rows `rows` (LongTensor) into the cache's first two dims."""
    if block_table is not None:
        page_size = k_cache.shape[1]
        return block_table[b].long()[rows // page_size], rows % page_size
    cache_b = b if cache_batch_idx is None else int(cache_batch_idx[b])
    return torch.full_like(rows, cache_b), rows


def append_kv_(k_cache, v_cache, k, v, cache_seqlens, *, cache_batch_idx=None, block_table=None, rotary_cos=None,
               rotary_sin=None, rotary_interleaved=True, k_descale=None, v_descale=None):
    """Write k (rotated when rotary_cos is given, at positions cache_seqlens[b] + i) and v into the cache rows
    cache_seqlens[b] + i of each sequence, in place. An fp8 cache (descales [B, Hk]) stores value / descale,
    saturated to the largest finite e4m3 value. Index values out of range raise a ValueError (_check_indices)."""
    batch, seqlen_new = k.shape[:2]
    _check_indices(k_cache, block_table, batch, cache_seqlens, seqlen_new, cache_batch_idx)
    capacity = _capacity(k_cache, block_table)
    lengths = _lengths(cache_seqlens, batch, capacity)
    steps = torch.arange(seqlen_new, device=k.device)
    if rotary_cos is not None:
        positions = torch.tensor(lengths, device=k.device)[:, None] + steps
        k = apply_rotary(k, rotary_cos, rotary_sin, positions, rotary_interleaved)
    for b in range(batch):
        keep = lengths[b] + steps < capacity
        rows = (lengths[b] + steps)[keep]
        kb, vb = k[b][keep], v[b][keep]                                       # [n, Hk, D]
        if k_descale is not None:
            kb = (kb.float() / k_descale[b].float()[:, None]).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX)
            vb = (vb.float() / v_descale[b].float()[:, None]).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX)
        index = _slots(b, rows, k_cache, block_table, cache_batch_idx)
        k_cache[index] = kb.to(k_cache.dtype)
        v_cache[index] = vb.to(v_cache.dtype)


def kvcache_attention(q, k_cache, v_cache, cache_seqlens=None, *, seqlen_new=0, cache_batch_idx=None,
                      cache_leftpad=None, block_table=None, rotary_cos=None, rotary_sin=None, rotary_interleaved=True,
                      softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                      k_descale=None, v_descale=None):
    """Attention of q over the cache as it stands (after any append): sequence b sees its cache rows
    [cache_leftpad[b], cache_seqlens[b] + seqlen_new), and causal, window and ALiBi are aligned bottom-right on
    those keys. With rotary_cos, q is rotated at positions cache_seqlens[b] + i when causal or windowed, else at
    cache_seqlens[b] for every i (flash-attn's convention). Computes in q.dtype; an fp8 cache is dequantised to it
    (value * descale). Returns (out [B, Sq, Hq, D], lse [B, Hq, Sq]) as naive_attention does.
    """
    batch, seqlen_q = q.shape[:2]
    _check_indices(k_cache, block_table, batch, cache_seqlens, seqlen_new, cache_batch_idx, cache_leftpad)
    capacity = _capacity(k_cache, block_table)
    lengths = _lengths(cache_seqlens, batch, capacity)
    starts = [0] * batch if cache_leftpad is None else [int(n) for n in cache_leftpad.tolist()]
    if rotary_cos is not None:
        local = causal or tuple(window_size) != (-1, -1)
        steps = torch.arange(seqlen_q, device=q.device) if local else torch.zeros(seqlen_q, dtype=torch.long,
                                                                                   device=q.device)
        q = apply_rotary(q, rotary_cos, rotary_sin, torch.tensor(lengths, device=q.device)[:, None] + steps,
                         rotary_interleaved)
    outs, lses = [], []
    for b in range(batch):
        end = min(lengths[b] + seqlen_new, capacity)
        rows = torch.arange(starts[b], max(end, starts[b]), device=q.device)
        index = _slots(b, rows, k_cache, block_table, cache_batch_idx)
        kb, vb = k_cache[index].to(q.dtype), v_cache[index].to(q.dtype)        # [n, Hk, D]
        if k_descale is not None:
            kb = kb * k_descale[b].to(q.dtype)[:, None]
            vb = vb * v_descale[b].to(q.dtype)[:, None]
        slopes = None
        if alibi_slopes is not None:
            slopes = alibi_slopes[b] if alibi_slopes.dim() == 2 else alibi_slopes
        out, lse = naive_attention(q[b:b + 1], kb[None], vb[None], softmax_scale=softmax_scale, causal=causal,
                                   window_size=window_size, softcap=softcap, alibi_slopes=slopes)
        outs.append(out)
        lses.append(lse)
    return torch.cat(outs), torch.cat(lses)


def kvcache_forward(q, k_cache, v_cache, k=None, v=None, rotary_cos=None, rotary_sin=None, cache_seqlens=None,
                    cache_batch_idx=None, cache_leftpad=None, block_table=None, softmax_scale=None, causal=False,
                    window_size=(-1, -1), softcap=0.0, rotary_interleaved=True, alibi_slopes=None, k_descale=None,
                    v_descale=None):
    """flashtile.flash_attn_with_kvcache in plain PyTorch, without touching its inputs: appends into copies of the
    caches. Returns (out, lse, k_cache_updated, v_cache_updated)."""
    k_cache, v_cache = k_cache.clone(), v_cache.clone()
    seqlen_new = 0
    if k is not None:
        seqlen_new = k.shape[1]
        append_kv_(k_cache, v_cache, k, v, cache_seqlens, cache_batch_idx=cache_batch_idx, block_table=block_table,
                   rotary_cos=rotary_cos, rotary_sin=rotary_sin, rotary_interleaved=rotary_interleaved,
                   k_descale=k_descale, v_descale=v_descale)
    out, lse = kvcache_attention(q, k_cache, v_cache, cache_seqlens, seqlen_new=seqlen_new,
                                 cache_batch_idx=cache_batch_idx, cache_leftpad=cache_leftpad,
                                 block_table=block_table, rotary_cos=rotary_cos, rotary_sin=rotary_sin,
                                 rotary_interleaved=rotary_interleaved, softmax_scale=softmax_scale, causal=causal,
                                 window_size=window_size, softcap=softcap, alibi_slopes=alibi_slopes,
                                 k_descale=k_descale, v_descale=v_descale)
    return out, lse, k_cache, v_cache
