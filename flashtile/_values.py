"""Checks of the values held in index tensors: varlen offsets and the KV cache's lengths, rows and pages
(docs/safety.md).

A tensor's values are read only where that costs no host-device synchronisation: CPU tensors always, CUDA tensors
only with the full check on (SETTINGS.check_values, FLASHTILE_CHECK_VALUES=1), which reads them with one copy each.
Nothing is read while torch.compile or another tracer is at work (fake tensors have no values); the ops' own
implementations check again when they run on real tensors. Every error names the entry, its value, the bound it
breaks and the fix.
"""
import contextlib

import torch

from ._lazy import lazy_module
from ._settings import SETTINGS, override

# Imports Triton: on first use (flashtile/_lazy.py).
_common = lazy_module(".kernels._common", globals())


@contextlib.contextmanager
def check_values(enabled=True):
    """Within the block, check the values of CUDA index tensors too (one device-to-host copy, a sync, per index
    tensor per call), as FLASHTILE_CHECK_VALUES=1 does for the whole process:

        with flashtile.check_values():
            out = flashtile.flash_attn_varlen_func(q, k, v, cu_seqlens, cu_seqlens, max_len, max_len)

    enabled=False turns the check off within the block (CPU tensors are checked either way)."""
    with override(check_values=bool(enabled)):
        yield


def readable(t):
    """Whether t's values may be read here: a plain tensor with storage, on the CPU (no sync) or with the full check
    on (a sync). Fake, meta and functorch-wrapped tensors are not."""
    if torch.compiler.is_compiling():  # first: torch.compile cannot trace the functorch query below
        return False
    if type(t) is not torch.Tensor or t.is_meta or torch._C._functorch.is_functorch_wrapped_tensor(t):
        return False
    return not t.is_cuda or SETTINGS.check_values


# -----------------------------------------------------------------------------------------------------------------
# Varlen offsets


def _check_offsets(name, bounds, rows, what):
    """bounds: cu_seqlens as a list -> the sequence lengths. rows None: the last offset is not checked."""
    for i, b in enumerate(bounds):
        if b < 0:
            raise ValueError(f"{name}[{i}] = {b} is negative; {name} holds the offsets 0, len_0, len_0 + len_1, "
                             f"... of the sequences in the packed {what} (every one >= 0).")
    if bounds[0] != 0:
        raise ValueError(f"{name}[0] = {bounds[0]}; the offsets must start at 0 (sequence 0 begins at row 0 of the "
                         f"packed {what}): build them as torch.cumsum of the lengths with a 0 in front.")
    lengths = [b - a for a, b in zip(bounds[:-1], bounds[1:])]
    for i, n in enumerate(lengths):
        if n < 0:
            raise ValueError(f"{name} decreases at entry {i + 1}: {name}[{i}] = {bounds[i]} > {name}[{i + 1}] = "
                             f"{bounds[i + 1]}; offsets are cumulative lengths and never decrease (a sequence of "
                             f"length 0 repeats the previous offset).")
    if rows is not None and bounds[-1] != rows:
        raise ValueError(f"{name} ends at {bounds[-1]} but the packed {what} has {rows} rows; the last offset must "
                         f"be the number of rows (the sum of the lengths): pass offsets for exactly these rows.")
    return lengths


def varlen_lengths(cu_seqlens_q, cu_seqlens_k, rows_q, rows_k, max_seqlen_q, max_seqlen_k):
    """Check the offsets of a varlen call against the packed tensors' rows and the max_seqlen arguments ->
    (longest query sequence, longest key sequence), or None when the values are not readable here (see readable).

    Offsets must start at 0, never decrease, and end at the number of rows; max_seqlen_q/_k must be at least every
    length (the launch grid covers max_seqlen_q rows per sequence: rows past it would never be computed)."""
    if not (readable(cu_seqlens_q) and readable(cu_seqlens_k)):
        return None
    longest = []
    for which, cu, rows, given, what in (("q", cu_seqlens_q, rows_q, max_seqlen_q, "queries q"),
                                         ("k", cu_seqlens_k, rows_k, max_seqlen_k, "keys k and values v")):
        name = f"cu_seqlens_{which}"
        lengths = _check_offsets(name, cu.tolist(), rows, what)
        longest.append(_check_longest(which, lengths, given, lambda i, n=name: f"{n}[{i + 1}] - {n}[{i}]",
                                      f", e.g. int(({name}[1:] - {name}[:-1]).max())"))
    return tuple(longest)


def _check_longest(which, lengths, given, source, hint=""):
    """max_seqlen_{which} against the lengths (source(i): how length i is named) -> the longest length."""
    top = max(lengths)
    if top > given:
        i = lengths.index(top)
        raise ValueError(f"max_seqlen_{which}={given} but sequence {i} has {top} rows ({source(i)}); "
                         f"max_seqlen_{which} must be at least the longest sequence (rows past it would not be "
                         f"computed): pass {top}{hint}.")
    return top


def paged_lengths(cu_seqlens_q, cu_seqlens_k, seqused_k, block_table, rows_q, num_pages, page_size, max_seqlen_q,
                  max_seqlen_k):
    """Check a paged varlen call's index values (flash_attn_varlen_func with block_table) -> (longest query
    sequence, longest key sequence), or None when they are not readable here (see readable).

    cu_seqlens_q as in varlen_lengths. Sequence b's keys are its first n_b cache slots, n_b = seqused_k[b] or, without
    seqused_k, cu_seqlens_k[b + 1] - cu_seqlens_k[b] (offsets from 0, never decreasing; not tied to any rows);
    0 <= n_b <= capacity = max_num_blocks_per_seq * page_size, n_b <= max_seqlen_k, and block_table[b, j] in
    [0, num_pages) for the pages j < ceil(n_b / page_size) it reads (entries past them are never read)."""
    index = [cu_seqlens_q, block_table, cu_seqlens_k if seqused_k is None else seqused_k]
    if not all(readable(t) for t in index):
        return None
    lengths_q = _check_offsets("cu_seqlens_q", cu_seqlens_q.tolist(), rows_q, "queries q")
    longest_q = _check_longest("q", lengths_q, max_seqlen_q,
                               lambda i: f"cu_seqlens_q[{i + 1}] - cu_seqlens_q[{i}]")
    capacity = block_table.shape[1] * page_size
    if seqused_k is None:
        lengths = _check_offsets("cu_seqlens_k", cu_seqlens_k.tolist(), None, "keys")
        source = lambda i: f"cu_seqlens_k[{i + 1}] - cu_seqlens_k[{i}]"  # noqa: E731
    else:
        lengths = seqused_k.tolist()
        source = lambda i: f"seqused_k[{i}]"  # noqa: E731
    if min(lengths) < 0 or max(lengths) > capacity:
        b, n = next((b, n) for b, n in enumerate(lengths) if not 0 <= n <= capacity)
        raise ValueError(f"sequence {b} has {n} keys ({source(b)}), outside [0, {capacity}]: block_table has "
                         f"{block_table.shape[1]} pages of {page_size} rows per sequence; pass key counts within "
                         f"them (or a wider block_table).")
    longest_k = _check_longest("k", lengths, max_seqlen_k, source)
    layout = CacheLayout(capacity, num_pages, page_size, 0, 0, 0)
    _check_block_table(block_table, lengths, None, layout)
    return longest_q, longest_k


def clamp_offsets(cu_seqlens_q, rows_q, cu_seqlens_k=None, rows_k=0):
    """Offsets that are safe to index with, made on the device without reading them (no sync): cu_seqlens_q
    clamped into [0, rows_q] and made non-decreasing (a running maximum), and cu_seqlens_k, when given, into
    [0, rows_k]; both in one launch (kernels._common.safe_offsets). Valid offsets come back equal; bad ones then
    address only rows of the packed tensors (docs/safety.md: a bad value spoils its own sequence's rows at worst).
    -> (safe_q, safe_k or None). A tensor this function made for the same rows comes back as it is (the backward
    reuses the forward's)."""
    done_q = getattr(cu_seqlens_q, "_flashtile_safe_rows", None) == rows_q
    if cu_seqlens_k is None:
        return (cu_seqlens_q, None) if done_q else _made(*_common.safe_offsets(cu_seqlens_q, rows_q), rows_q, rows_k)
    done_k = getattr(cu_seqlens_k, "_flashtile_safe_rows", None) == rows_k
    if done_q or done_k:  # made here before, one or both: the other alone
        return (cu_seqlens_q if done_q else clamp_offsets(cu_seqlens_q, rows_q)[0],
                cu_seqlens_k if done_k else clamp_offsets(cu_seqlens_k, rows_k)[0])
    return _made(*_common.safe_offsets(cu_seqlens_q, rows_q, cu_seqlens_k, rows_k), rows_q, rows_k)


def _made(safe_q, safe_k, rows_q, rows_k):
    """clamp_offsets's results, marked with the rows they were clamped to."""
    safe_q._flashtile_safe_rows = rows_q
    if safe_k is not None:
        safe_k._flashtile_safe_rows = rows_k
    return safe_q, safe_k


# -----------------------------------------------------------------------------------------------------------------
# KV cache


class CacheLayout:
    """What the KV-cache value checks need to know of one call besides the index tensors (all Python ints, fixed
    for a given set of shapes and options, so a repeated call keeps it): rows per sequence (capacity), the cache's
    first dim (cache_rows: sequences, or pages of page_size rows), seqlen_new, and the rotary table's positions
    (seqlen_ro, 0 without rotary) with the span of positions each sequence rotates past its length."""
    __slots__ = ("capacity", "cache_rows", "page_size", "seqlen_new", "seqlen_ro", "rotary_span")

    def __init__(self, capacity, cache_rows, page_size, seqlen_new, seqlen_ro, rotary_span):
        self.capacity = capacity
        self.cache_rows = cache_rows
        self.page_size = page_size
        self.seqlen_new = seqlen_new
        self.seqlen_ro = seqlen_ro
        self.rotary_span = rotary_span

    @classmethod
    def of(cls, k_cache, block_table, seqlen_q, seqlen_new, rotary_cos, rotary_per_row):
        page_size = k_cache.shape[1] if block_table is not None else 0
        capacity = block_table.shape[1] * page_size if block_table is not None else k_cache.shape[1]
        seqlen_ro = 0 if rotary_cos is None else rotary_cos.shape[0]
        # Positions rotated past a sequence's length: the new keys' [0, seqlen_new), the queries' [0, seqlen_q)
        # with a causal or local mask (else every query sits at the length itself).
        span = max(seqlen_new, seqlen_q if rotary_per_row else 1)
        return cls(capacity, k_cache.shape[0], page_size, seqlen_new, seqlen_ro, span)

    def max_int_seqlen(self):
        """The largest int cache_seqlens a call may pass (the appended rows, and the rotary positions, must fit)."""
        limit = self.capacity - self.seqlen_new
        if self.seqlen_ro:
            limit = min(limit, self.seqlen_ro - self.rotary_span)
        return limit


def check_int_seqlen(cache_seqlen, layout: CacheLayout):
    """An int cache_seqlens (every sequence's length before the append)."""
    if not 0 <= cache_seqlen <= layout.capacity - layout.seqlen_new:
        raise ValueError(f"cache_seqlens={cache_seqlen} with {layout.seqlen_new} new tokens does not fit a cache of "
                         f"{layout.capacity} rows per sequence; it must be in [0, "
                         f"{layout.capacity - layout.seqlen_new}].")
    _check_rotary([cache_seqlen], layout, False)


def _check_rotary(lengths, layout, indexed):
    if not layout.seqlen_ro:
        return
    for b, n in enumerate(lengths):
        last = n + layout.rotary_span - 1
        if last >= layout.seqlen_ro:
            where = f"cache_seqlens[{b}] = {n}" if indexed else f"cache_seqlens = {n}"
            raise ValueError(f"rotary_cos/rotary_sin have {layout.seqlen_ro} positions but sequence {b} rotates "
                             f"position {last} ({where}, then {layout.rotary_span} positions); pass cos/sin for at "
                             f"least {last + 1} positions (flash-attn sizes them to the cache's capacity, "
                             f"{layout.capacity} rows, plus the new queries).")


def kvcache(layout: CacheLayout, batch, cache_seqlens, cache_seqlen, cache_batch_idx, cache_leftpad, block_table):
    """Check the values of flash_attn_with_kvcache's index tensors (the caller has checked readable(q)):

    cache_seqlens[b] in [0, capacity - seqlen_new] (cache_seqlens None: every length is the int cache_seqlen,
        checked on its own); the rotary table covers every position rotated.
    cache_leftpad[b] in [0, cache_seqlens[b] + seqlen_new]: sequence b's keys are rows [leftpad, length + new).
    cache_batch_idx[b] in [0, cache batch); with an append, no two sequences share a cache row (both would write
        it).
    block_table[b, j] in [0, num_pages) for every page j that sequence b reads or writes (entries past its length
        are not read and may hold anything); with an append, no two new tokens land in one (page, row).

    Each check is a min/max over a list first (C speed: a decode step's check costs microseconds); the loop that
    finds the offending entry for the message runs only when one fails.
    """
    lengths = [cache_seqlen] * batch if cache_seqlens is None else cache_seqlens.tolist()
    new = layout.seqlen_new
    if cache_seqlens is not None:
        top = layout.capacity - new
        if min(lengths) < 0 or max(lengths) > top:
            b, n = next((b, n) for b, n in enumerate(lengths) if not 0 <= n <= top)
            raise ValueError(f"cache_seqlens[{b}] = {n} with {new} new tokens does not fit a cache of "
                             f"{layout.capacity} rows per sequence; every length must be in [0, {top}] (the "
                             f"rows before the append; the new tokens go to rows cache_seqlens[b] ...).")
        _check_rotary(lengths, layout, True)
    starts = None
    if cache_leftpad is not None:
        starts = cache_leftpad.tolist()
        for b, (s, n) in enumerate(zip(starts, lengths)):
            if not 0 <= s <= n + new:
                raise ValueError(f"cache_leftpad[{b}] = {s} is outside [0, cache_seqlens[{b}] + seqlen_new] = "
                                 f"[0, {n + new}]: sequence {b}'s keys are its cache rows [cache_leftpad, "
                                 f"cache_seqlens + seqlen_new), so the pad must end within them.")
    if cache_batch_idx is not None:
        _check_batch_idx(cache_batch_idx.tolist(), layout.cache_rows, new)
    if block_table is not None:
        _check_block_table(block_table, lengths, starts, layout)


def _check_batch_idx(rows, cache_rows, new):
    if min(rows) < 0 or max(rows) >= cache_rows:
        b, r = next((b, r) for b, r in enumerate(rows) if not 0 <= r < cache_rows)
        raise ValueError(f"cache_batch_idx[{b}] = {r} is outside [0, {cache_rows}): k_cache holds {cache_rows} "
                         f"sequences (its first dim); each entry names the cache row of one sequence of q.")
    if new and len(set(rows)) < len(rows):
        first = {}
        for b, r in enumerate(rows):
            if r in first:
                raise ValueError(f"cache_batch_idx[{first[r]}] and cache_batch_idx[{b}] are both {r} and k, v are "
                                 f"appended: two sequences would write the same cache rows. Give every sequence "
                                 f"that appends its own cache row (sharing one is fine without k and v).")
            first[r] = b


def _check_block_table(block_table, lengths, starts, layout):
    page, pages, new = layout.page_size, layout.cache_rows, layout.seqlen_new
    low, high = torch.aminmax(block_table)
    if low.item() >= 0 and high.item() < pages and not new:
        return  # every entry in range (one reduction: 2 us for 256 entries, against 10 for the lists below)
    table = block_table.tolist()
    for b, (row, n) in enumerate(zip(table, lengths)):
        first = 0 if starts is None else min(starts[b], n) // page
        used = row[first:-(-(n + new) // page)]
        if used and (min(used) < 0 or max(used) >= pages):
            j, entry = next((first + i, e) for i, e in enumerate(used) if not 0 <= e < pages)
            raise ValueError(f"block_table[{b}, {j}] = {entry} is outside [0, {pages}): the paged cache has {pages} "
                             f"pages (k_cache's first dim), and sequence {b} uses page slot {j} (its rows "
                             f"{j * page}..{(j + 1) * page - 1}).")
    if new:
        _check_page_writes(table, lengths, page, new)


def _check_page_writes(table, lengths, page, new):
    """With an append, no two new tokens may land in one (page, row)."""
    written = {}
    for b, (row, n) in enumerate(zip(table, lengths)):
        for pos in range(n, n + new):
            slot = (row[pos // page], pos % page)
            if slot in written:
                other, other_pos = written[slot]
                raise ValueError(f"block_table[{other}, {other_pos // page}] = block_table[{b}, {pos // page}] = "
                                 f"{slot[0]}: the new tokens at position {other_pos} of sequence {other} and {pos} "
                                 f"of sequence {b} would both be written to row {slot[1]} of page {slot[0]}. A page "
                                 f"that receives new tokens must not be shared (shared pages are fine to read).")
            written[slot] = (b, pos)
