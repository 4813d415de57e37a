"""flash_attn_with_kvcache against the float64 reference: split-KV decoding, paged caches, append in place, rotary.

On the CPU the kernels run in Triton's interpreter (conftest.py); `-m gpu` runs the large cases on a GPU. Judged by
flashtile.testing's rule: error against float64 at most K x plain PyTorch's error in the input dtype + rounding.

Every case builds a "logical" cache [batch, capacity, Hk, D] and then the storage the kernels see: a contiguous
cache (with cache_batch_idx: its rows scattered among spare ones) or a pool of pages in shuffled order. Rows that
are not valid keys (before cache_leftpad, past the length, spare rows and pages) hold NaN, so a kernel that reads
one, or misses a row it should append, produces NaN. The oracle runs on the logical cache, so the paged and
batch-index addressing of the kernels is checked against test code, not against the reference's own addressing.
After each call the storage outside the appended rows must be bit-for-bit what it was.
"""
import dataclasses
import json
import math
import os
import subprocess
import sys
import textwrap
import zlib
from pathlib import Path
from typing import Optional

import pytest
import torch

from flashtile import kvcache
from flashtile._settings import SETTINGS
from flashtile.kernels import configs, decode
from flashtile.kernels.configs import TileConfig
from flashtile.kvcache import flash_attn_with_kvcache
from flashtile.reference import kvcache as reference
from flashtile.reference import naive_attention
from flashtile.request import KVCacheRequest
from flashtile.testing import K, assert_close

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
REPO_ROOT = Path(__file__).resolve().parents[1]
DTYPE_IDS = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32", torch.float8_e4m3fn: "fp8"}
BITS = {2: torch.int16, 4: torch.int32, 1: torch.int8}


@dataclasses.dataclass
class Case:
    batch: int = 3
    seqlen_q: int = 1
    heads: int = 4
    kv_heads: int = 2
    head_dim: int = 32
    capacity: int = 96
    dtype: torch.dtype = torch.bfloat16
    lengths: Optional[tuple] = None  # cache_seqlens before the append; None: random
    seqlen_new: int = 0
    page_size: Optional[int] = None
    causal: bool = False
    window: tuple = (-1, -1)
    softcap: float = 0.0
    alibi: Optional[str] = None  # "heads": (Hq,) slopes, "batch": (B, Hq)
    rotary_dim: int = 0
    interleaved: bool = True
    batch_idx: bool = False
    leftpad: bool = False
    num_splits: int = 1
    scale: Optional[float] = None
    int_seqlens: bool = False  # cache_seqlens as a Python int (every sequence the same length)
    fp8: bool = False  # float8_e4m3fn cache with descales; q, k, v in `dtype`
    growing_keys: bool = False  # keys grow along the cache: later splits have the larger LSEs
    strided: bool = False  # q, k, v slices of one packed projection; a contiguous cache a view of a longer buffer
    index_dtype: torch.dtype = torch.int32  # of cache_seqlens, cache_batch_idx, cache_leftpad, block_table

    def id(self):
        parts = [f"B{self.batch}", f"Sq{self.seqlen_q}", f"H{self.heads}", f"Hk{self.kv_heads}", f"D{self.head_dim}",
                 f"S{self.capacity}", DTYPE_IDS[self.dtype]]
        if self.seqlen_new:
            parts.append(f"new{self.seqlen_new}")
        if self.page_size:
            parts.append(f"page{self.page_size}")
        if self.causal:
            parts.append("causal")
        if self.window != (-1, -1):
            parts.append(f"win{self.window[0]}_{self.window[1]}")
        if self.softcap:
            parts.append(f"softcap{self.softcap:g}")
        if self.alibi:
            parts.append(f"alibi-{self.alibi}")
        if self.rotary_dim:
            parts.append(f"rot{self.rotary_dim}{'i' if self.interleaved else 'h'}")
        if self.batch_idx:
            parts.append("batchidx")
        if self.leftpad:
            parts.append("leftpad")
        if self.int_seqlens:
            parts.append("intlen")
        if self.fp8:
            parts.append("fp8cache")
        if self.scale is not None:
            parts.append(f"scale{self.scale:g}")
        if self.growing_keys:
            parts.append("growing")
        if self.strided:
            parts.append("strided")
        if self.index_dtype != torch.int32:
            parts.append(str(self.index_dtype).replace("torch.", ""))
        parts.append(f"split{self.num_splits}")
        return "-".join(parts)


def _param(case, *marks):
    return pytest.param(case, id=case.id(), marks=marks)


# ----------------------------------------------------------------------------------------------------------------
# Building the inputs


@dataclasses.dataclass
class Layout:
    """Where the logical cache [batch, capacity, Hk, D] lives in the storage the kernels see."""
    kind: str  # "contiguous" or "paged"
    rows: int  # contiguous: cache rows; paged: pages in the pool
    batch_idx: Optional[torch.Tensor] = None  # contiguous: cache row of each sequence
    block_table: Optional[torch.Tensor] = None  # paged: [batch, pages per sequence]
    page_size: int = 0

    def place(self, logical, fill):
        """Storage holding `logical`; everything else `fill`."""
        batch, capacity = logical.shape[:2]
        if self.kind == "contiguous":
            storage = logical.new_full((self.rows,) + tuple(logical.shape[1:]), fill)
            storage[self.batch_idx.long()] = logical
            return storage
        storage = logical.new_full((self.rows, self.page_size) + tuple(logical.shape[2:]), fill)
        pages = logical.unflatten(1, (capacity // self.page_size, self.page_size))  # [B, n, page, Hk, D]
        storage[self.block_table.long()] = pages
        return storage

    def gather(self, storage):
        """The logical cache [batch, capacity, Hk, D] from the storage."""
        if self.kind == "contiguous":
            return storage[self.batch_idx.long()]
        return storage[self.block_table.long()].flatten(1, 2)


@dataclasses.dataclass
class Inputs:
    q: torch.Tensor
    k_logical: torch.Tensor  # [B, capacity, Hk, D] before the append, NaN where not a valid or appended row
    v_logical: torch.Tensor
    k: Optional[torch.Tensor]
    v: Optional[torch.Tensor]
    cos: Optional[torch.Tensor]
    sin: Optional[torch.Tensor]
    lengths: list
    leftpad: Optional[torch.Tensor]
    alibi: Optional[torch.Tensor]
    k_descale: Optional[torch.Tensor]
    v_descale: Optional[torch.Tensor]
    layout: Layout
    index_dtype: torch.dtype = torch.int32

    @property
    def cache_seqlens(self):
        return torch.tensor(self.lengths, dtype=self.index_dtype, device=self.q.device)


def _randn(shape, gen, dtype):
    return torch.randn(shape, generator=gen, device=DEVICE).to(dtype)


def make_inputs(case, seed):
    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    cpu_gen = torch.Generator().manual_seed(seed)
    b, hk, d = case.batch, case.kv_heads, case.head_dim
    capacity = case.capacity
    if case.page_size:
        capacity = math.ceil(capacity / case.page_size) * case.page_size
    if case.lengths is not None:
        lengths = list(case.lengths)
    elif case.int_seqlens:
        lengths = [int(torch.randint(0, capacity - case.seqlen_new + 1, (1,), generator=cpu_gen))] * b
    else:
        lengths = torch.randint(0, capacity - case.seqlen_new + 1, (b,), generator=cpu_gen).tolist()
    ends = [n + case.seqlen_new for n in lengths]
    starts = [int(torch.randint(0, e + 1, (1,), generator=cpu_gen)) for e in ends] if case.leftpad else [0] * b

    cache_dtype = torch.float8_e4m3fn if case.fp8 else case.dtype
    k_logical = _randn((b, capacity, hk, d), gen, torch.float32)
    v_logical = _randn((b, capacity, hk, d), gen, torch.float32)
    k_descale = v_descale = None
    if case.fp8:
        # Stored values around +-16 (e4m3 has 3 mantissa bits at every scale), real values around +-1.
        k_logical, v_logical = k_logical * 16, v_logical * 16
        k_descale = torch.rand((b, hk), generator=gen, device=DEVICE) / 8 + 1 / 32
        v_descale = torch.rand((b, hk), generator=gen, device=DEVICE) / 8 + 1 / 32
    rows = torch.arange(capacity, device=DEVICE)
    if case.growing_keys:
        k_logical = k_logical * (1 + 3 * rows / capacity)[None, :, None, None]
    for i in range(b):
        invalid = (rows < starts[i]) | (rows >= lengths[i])
        k_logical[i, invalid] = float("nan")
        v_logical[i, invalid] = float("nan")
    k_logical, v_logical = k_logical.to(cache_dtype), v_logical.to(cache_dtype)

    if case.page_size:
        pages = capacity // case.page_size
        pool = b * pages + 3  # spare pages, all NaN
        perm = torch.randperm(pool, generator=cpu_gen)[:b * pages].to(DEVICE)
        layout = Layout("paged", pool, block_table=perm.view(b, pages).to(case.index_dtype),
                        page_size=case.page_size)
    else:
        rows_total = b + 2 if case.batch_idx else b
        batch_idx = torch.randperm(rows_total, generator=cpu_gen)[:b] if case.batch_idx else torch.arange(b)
        layout = Layout("contiguous", rows_total, batch_idx=batch_idx.to(case.index_dtype).to(DEVICE))

    q = _randn((b, case.seqlen_q, case.heads, d), gen, case.dtype)
    k = v = None
    if case.seqlen_new:
        k = _randn((b, case.seqlen_new, hk, d), gen, case.dtype)
        v = _randn((b, case.seqlen_new, hk, d), gen, case.dtype)
    cos = sin = None
    if case.rotary_dim:
        seqlen_ro = capacity + case.seqlen_q
        angle = torch.rand((seqlen_ro, case.rotary_dim // 2), generator=gen, device=DEVICE) * 2 * math.pi
        cos, sin = torch.cos(angle).to(case.dtype), torch.sin(angle).to(case.dtype)
    leftpad = torch.tensor(starts, dtype=case.index_dtype, device=DEVICE) if case.leftpad else None
    alibi = None
    if case.alibi == "heads":
        alibi = torch.rand((case.heads,), generator=gen, device=DEVICE) * 0.3
    elif case.alibi == "batch":
        alibi = torch.rand((b, case.heads), generator=gen, device=DEVICE) * 0.3
    return Inputs(q, k_logical, v_logical, k, v, cos, sin, lengths, leftpad, alibi, k_descale, v_descale, layout,
                  case.index_dtype)


def _bits(t):
    return t.view(BITS[t.element_size()])


def _reference(case, inp, dtype):
    """(out, lse, k_logical_after, v_logical_after) from the reference on the logical cache, computing in dtype
    (float64: the oracle)."""
    def cast(t):
        return None if t is None else t.to(dtype)

    cache_dtype = dtype if not case.fp8 else torch.float8_e4m3fn
    k_cache, v_cache = inp.k_logical, inp.v_logical
    if not case.fp8:
        k_cache, v_cache = k_cache.to(dtype), v_cache.to(dtype)
    assert k_cache.dtype == cache_dtype
    return reference.kvcache_forward(
        cast(inp.q), k_cache, v_cache, cast(inp.k), cast(inp.v), cast(inp.cos), cast(inp.sin),
        cache_seqlens=inp.lengths[0] if case.int_seqlens else inp.cache_seqlens, cache_leftpad=inp.leftpad,
        softmax_scale=case.scale, causal=case.causal, window_size=case.window, softcap=case.softcap,
        rotary_interleaved=case.interleaved, alibi_slopes=inp.alibi, k_descale=inp.k_descale,
        v_descale=inp.v_descale)


def run_case(case, seed, **call_kwargs):
    """Run flash_attn_with_kvcache on the case and judge out, lse and the cache. Returns (out, lse)."""
    inp = make_inputs(case, seed)
    layout = inp.layout
    k_store = layout.place(inp.k_logical, float("nan"))
    v_store = layout.place(inp.v_logical, float("nan"))
    q, k, v = inp.q, inp.k, inp.v
    if case.strided:
        assert layout.kind == "contiguous", "a view of a longer buffer would change a paged cache's page size"
        q, k, v, k_store, v_store, spare = _strided(q, k, v, k_store, v_store)
    k_before, v_before = k_store.clone(), v_store.clone()
    out, lse = flash_attn_with_kvcache(
        q, k_store, v_store, k, v, inp.cos, inp.sin,
        cache_seqlens=inp.lengths[0] if case.int_seqlens else inp.cache_seqlens,
        cache_batch_idx=layout.batch_idx if case.batch_idx else None, cache_leftpad=inp.leftpad,
        block_table=layout.block_table, softmax_scale=case.scale, causal=case.causal, window_size=case.window,
        softcap=case.softcap, rotary_interleaved=case.interleaved, alibi_slopes=inp.alibi,
        num_splits=case.num_splits, return_softmax_lse=True, k_descale=inp.k_descale, v_descale=inp.v_descale,
        **call_kwargs)

    out64, lse64, k64, v64 = _reference(case, inp, torch.float64)
    out_pt, lse_pt, k_pt, v_pt = _reference(case, inp, case.dtype)
    assert_close("out", out, out64, out_pt, case.dtype)
    assert_close("lse", lse, lse64, lse_pt.float(), torch.float32)

    # The cache: appended rows hold the (rotated) new keys and the new values; every other element is untouched.
    rows = torch.arange(k_store.shape[1] if layout.kind == "contiguous" else inp.k_logical.shape[1], device=DEVICE)
    lengths = torch.tensor(inp.lengths, device=DEVICE)[:, None]
    written = (rows[None, :] >= lengths) & (rows[None, :] < lengths + case.seqlen_new)  # [B, capacity]
    written = written[:, :, None, None].expand(inp.k_logical.shape)
    written_store = layout.place(written, False)
    assert torch.equal(_bits(k_store[~written_store]), _bits(k_before[~written_store])), "k_cache changed outside " \
        "the appended rows"
    assert torch.equal(_bits(v_store[~written_store]), _bits(v_before[~written_store])), "v_cache changed outside " \
        "the appended rows"
    if case.strided:
        assert all(torch.isnan(t.float()).all() for t in spare), "written past the cache view"
    if case.seqlen_new:
        k_after, v_after = layout.gather(k_store), layout.gather(v_store)
        if case.fp8:
            # value / descale in fp32, rounded to nearest even e4m3: the bits torch stores for the same fp32 values.
            exact = [("v", v_after, v_pt)] + ([] if case.rotary_dim else [("k", k_after, k_pt)])
            for name, got, want in exact:
                assert torch.equal(_bits(got[written]), _bits(want[written])), f"{name}_cache appended rows"
            if case.rotary_dim:
                # The kernel rotates in fp32; the reference in the input dtype rounds the rotated key first, which
                # can flip the sign of a value near 0. Against float64: where the two roundings to e4m3 disagree,
                # at most one e4m3 step (2^-3 relative, 2^-9 among the subnormals) apart.
                got, want = k_after[written].float(), k64[written].float()
                assert ((got - want).abs() <= want.abs() / 8 + 2.0 ** -9).all(), "k_cache appended rows"
        else:
            assert_close("k_cache appended rows", k_after[written], k64[written], k_pt[written], case.dtype)
            assert torch.equal(_bits(v_after[written]), _bits(v_pt[written])), "v_cache appended rows"
    return out, lse


def _strided(q, k, v, k_store, v_store):
    """q, k, v as slices of one packed (B, S, Hq + 2 Hk, D) tensor (a fused QKV projection; k, v need S_new = Sq);
    the caches as the first rows of buffers 5 rows longer. Returns them and the spare rows (which must stay NaN)."""
    b, s, hq, d = q.shape
    if k is not None:
        hk = k.shape[2]
        packed = torch.cat((q, k, v), dim=2)
        q, k, v = packed[:, :, :hq], packed[:, :, hq:hq + hk], packed[:, :, hq + hk:]
        assert not k.is_contiguous()
    else:
        q = torch.stack((q, torch.full_like(q, float("nan"))), dim=3)[:, :, :, 0]  # heads 2 * D apart
    stores = []
    for t in (k_store, v_store):
        long = t.new_full((t.shape[0], t.shape[1] + 5) + tuple(t.shape[2:]), float("nan"))
        long[:, :t.shape[1]] = t
        stores.append(long)
    k_store, v_store = (t[:, :k_store.shape[1]] for t in stores)
    assert not k_store.is_contiguous() and not q.is_contiguous()
    return q, k, v, k_store, v_store, [t[:, k_store.shape[1]:] for t in stores]


def _seed(request):
    return zlib.crc32(request.node.nodeid.encode())


# ----------------------------------------------------------------------------------------------------------------
# Decoding over a cache without append


DECODE_CASES = [
    # Ragged lengths with 0 and 1: an empty sequence outputs 0 / -inf, a one-key sequence copies its value row.
    Case(lengths=(0, 1, 77), num_splits=1),
    Case(lengths=(0, 1, 77), num_splits=3),
    Case(lengths=(5, 96, 40), num_splits=0),
    Case(batch=2, heads=8, kv_heads=2, head_dim=64, capacity=130, dtype=torch.float16, num_splits=4),
    Case(batch=2, heads=6, kv_heads=1, head_dim=40, capacity=71, dtype=torch.float32, num_splits=2),
    Case(batch=1, heads=2, kv_heads=2, head_dim=16, capacity=200, dtype=torch.bfloat16, num_splits=7),
    # More splits than key blocks: empty splits must get weight 0.
    Case(batch=2, heads=4, kv_heads=4, head_dim=32, capacity=40, lengths=(33, 9), num_splits=6),
    Case(int_seqlens=True, num_splits=2),
    Case(head_dim=24, dtype=torch.float16, num_splits=2),
    Case(head_dim=128, batch=1, heads=4, kv_heads=1, capacity=80, num_splits=2),
    Case(head_dim=256, batch=1, heads=2, kv_heads=1, capacity=50, num_splits=2, dtype=torch.float16),
    # q_len > 1 (speculative decoding, chunked prefill) with the bottom-right causal mask; Sq > length leaves the
    # first rows with no key.
    Case(seqlen_q=5, lengths=(0, 3, 90), causal=True, num_splits=2),
    Case(seqlen_q=5, causal=False, num_splits=1, dtype=torch.float16),
    Case(seqlen_q=33, batch=2, heads=8, kv_heads=2, capacity=120, causal=True, num_splits=3),
    Case(seqlen_q=17, batch=1, heads=3, kv_heads=1, capacity=64, causal=True, dtype=torch.float32, num_splits=1),
]


@pytest.mark.parametrize("case", [_param(c) for c in DECODE_CASES])
def test_decode(poison, request, case):
    run_case(case, _seed(request))


PAGED_CASES = [
    Case(page_size=16, lengths=(0, 1, 96), num_splits=1),
    Case(page_size=16, num_splits=3, capacity=150, heads=8, kv_heads=2),
    Case(page_size=32, num_splits=2, capacity=130),
    Case(page_size=32, seqlen_q=6, causal=True, num_splits=0, dtype=torch.float16),
    # A page size that is no power of two, and pages smaller than the key block.
    Case(page_size=24, num_splits=2, capacity=100),
    Case(page_size=8, num_splits=1, capacity=60, dtype=torch.float32),
    Case(page_size=16, leftpad=True, num_splits=2, capacity=90),
    # Pages holding whole key blocks (32 keys in the interpreter): one table entry per block. Leftpad and a window
    # start the keys inside a block; splits end inside pages.
    Case(page_size=64, leftpad=True, num_splits=3, capacity=300, lengths=(0, 37, 300)),
    Case(page_size=96, window=(40, 0), seqlen_q=3, causal=True, num_splits=2, capacity=290, seqlen_new=3),
]


@pytest.mark.parametrize("page_size, block_n, nest", [
    pytest.param(16, 64, True, id="page16-block64"),  # a block is 4 whole pages
    pytest.param(32, 32, True, id="page32-block32"),
    pytest.param(64, 32, True, id="page64-block32"),  # a block is half a page
    pytest.param(24, 32, False, id="page24-block32"),  # no nesting: per-row addressing either way
])
def test_page_slabs_match_rows(request, monkeypatch, page_size, block_n, nest):
    """Page-granular addressing (PAGE_SLAB: blocks inside one page or covering whole pages) gives the same bits as
    per-row addressing. The tile is forced: whether pages and blocks nest depends on BLOCK_N, which differs between
    the interpreter and a GPU."""
    case = Case(page_size=page_size, leftpad=True, num_splits=2, capacity=200, heads=8, kv_heads=2)
    inp = make_inputs(case, _seed(request))
    k_store = inp.layout.place(inp.k_logical, float("nan"))
    v_store = inp.layout.place(inp.v_logical, float("nan"))
    monkeypatch.setattr(SETTINGS, "decode_tiles", [TileConfig(64, block_n, 4, 2)])
    results = []
    for slabs in (True, False):
        monkeypatch.setattr(SETTINGS, "page_slabs", slabs)
        monkeypatch.setattr(decode, "_PLANS", {})
        results.append(flash_attn_with_kvcache(inp.q, k_store, v_store, cache_seqlens=inp.cache_seqlens,
                                               cache_leftpad=inp.leftpad, block_table=inp.layout.block_table,
                                               num_splits=2, return_softmax_lse=True))
        (plan,) = decode._PLANS.values()
        assert plan.split.constexprs["CFG"].BLOCK_N == block_n
        assert plan.split.constexprs["FEAT"].PAGE_SLAB == (slabs and nest)
    for got, want in zip(*results):
        assert torch.equal(got, want)


@pytest.mark.parametrize("case", [_param(c) for c in PAGED_CASES])
def test_paged(poison, request, case):
    run_case(case, _seed(request))


# ----------------------------------------------------------------------------------------------------------------
# Append in place, rotary, cache_batch_idx, cache_leftpad


APPEND_CASES = [
    Case(seqlen_new=1, num_splits=1),
    Case(seqlen_new=1, num_splits=3, lengths=(0, 1, 94)),
    Case(seqlen_new=7, seqlen_q=7, causal=True, num_splits=2),
    Case(seqlen_new=3, seqlen_q=5, causal=True, num_splits=1, dtype=torch.float16),
    Case(seqlen_new=20, seqlen_q=4, causal=False, num_splits=2, dtype=torch.float32),
    Case(seqlen_new=1, page_size=16, num_splits=2),
    Case(seqlen_new=5, seqlen_q=5, page_size=32, causal=True, num_splits=2, heads=8, kv_heads=2),
    Case(seqlen_new=18, page_size=16, num_splits=1, lengths=(15, 0, 60)),  # crosses page boundaries
    Case(seqlen_new=2, batch_idx=True, num_splits=2),
    Case(seqlen_new=2, seqlen_q=2, batch_idx=True, leftpad=True, causal=True, num_splits=1),
    Case(seqlen_new=1, leftpad=True, num_splits=3),
    Case(seqlen_new=3, page_size=16, leftpad=True, num_splits=2),
    Case(seqlen_new=1, int_seqlens=True, num_splits=2),
    Case(seqlen_new=4, seqlen_q=4, causal=True, rotary_dim=16, strided=True, num_splits=2),
    Case(strided=True, seqlen_q=2, num_splits=1),
    Case(seqlen_new=2, batch_idx=True, leftpad=True, index_dtype=torch.int64, num_splits=2),
    Case(seqlen_new=2, page_size=16, leftpad=True, index_dtype=torch.int64, num_splits=2),
]

ROTARY_CASES = [
    Case(seqlen_new=1, rotary_dim=32, interleaved=True, num_splits=2),
    Case(seqlen_new=1, rotary_dim=32, interleaved=False, num_splits=2),
    Case(seqlen_new=4, seqlen_q=4, rotary_dim=16, interleaved=True, causal=True, num_splits=1),
    Case(seqlen_new=4, seqlen_q=4, rotary_dim=16, interleaved=False, causal=True, num_splits=1),
    # Not causal, not local: every query is rotated at position cache_seqlens.
    Case(seqlen_new=3, seqlen_q=3, rotary_dim=32, interleaved=False, num_splits=2, dtype=torch.float16),
    Case(seqlen_new=3, seqlen_q=3, rotary_dim=32, interleaved=True, window=(10, 0), num_splits=2),
    Case(seqlen_new=2, seqlen_q=2, rotary_dim=24, interleaved=False, head_dim=40, page_size=16, causal=True,
         dtype=torch.float32, num_splits=2),
    Case(seqlen_new=1, rotary_dim=64, head_dim=64, interleaved=True, batch_idx=True, leftpad=True, num_splits=2,
         heads=8, kv_heads=2),
]


@pytest.mark.parametrize("case", [_param(c) for c in APPEND_CASES + ROTARY_CASES])
def test_append(poison, request, case):
    run_case(case, _seed(request))


# ----------------------------------------------------------------------------------------------------------------
# Window, softcap, ALiBi, softmax_scale


FEATURE_CASES = [
    Case(window=(20, -1), num_splits=3),
    Case(window=(8, 0), seqlen_q=6, num_splits=2, heads=8, kv_heads=2),
    Case(window=(5, 3), seqlen_q=9, num_splits=1, dtype=torch.float16),
    Case(window=(-1, 2), seqlen_q=4, causal=False, num_splits=2),
    Case(window=(12, 4), seqlen_q=4, causal=True, num_splits=2, page_size=16),
    Case(softcap=2.0, num_splits=2),
    Case(softcap=0.5, seqlen_q=3, causal=True, num_splits=1, dtype=torch.float32),
    Case(alibi="heads", num_splits=2),
    Case(alibi="batch", seqlen_q=4, causal=True, num_splits=3, leftpad=True),
    Case(alibi="heads", softcap=3.0, window=(30, 0), seqlen_q=2, num_splits=2, dtype=torch.float16),
    Case(scale=-0.2, num_splits=2),
    Case(scale=0.0, seqlen_q=3, causal=True, num_splits=2),
]


@pytest.mark.parametrize("case", [_param(c) for c in FEATURE_CASES])
def test_features(poison, request, case):
    run_case(case, _seed(request))


# ----------------------------------------------------------------------------------------------------------------
# The split machinery


def _split_counts(poison, batch, seqlen_q, heads, head_dim):
    """Split counts of the partial buffers the launcher allocated: one fp32 buffer holding o_part
    [B, Sq, Hq, S, D] and lse_part [B, Sq, Hq, S]."""
    rows = batch * seqlen_q * heads * (head_dim + 1)
    return [shape[0] // rows for shape in poison if len(shape) == 1 and shape[0] % rows == 0]


def test_auto_splits_fill_the_programs(poison, request):
    """num_splits=0 splits when batch x kv heads leaves programs idle (one program here): the combine's partial
    buffers appear. The cache holds 2 x MIN_BLOCKS_PER_SPLIT key blocks of the tile the launch uses (32 keys in the
    interpreter, 128 on Hopper), so at least 2 splits are allowed; a shorter cache is rightly not split (each split
    must have MIN_BLOCKS_PER_SPLIT blocks: 200 keys are two 128-key blocks, one split's worth)."""
    spec = decode._spec(torch.empty(1, dtype=torch.bfloat16, device=DEVICE))
    block_n = decode.split_candidates(32, torch.bfloat16, spec)[0].block_n
    capacity = 2 * decode.MIN_BLOCKS_PER_SPLIT * block_n
    case = Case(batch=1, heads=4, kv_heads=1, capacity=capacity, lengths=(capacity - 9,), num_splits=0)
    run_case(case, _seed(request))
    splits = _split_counts(poison, 1, 1, 4, 32)
    assert splits and splits[0] > 1, poison


def test_many_splits_combine_in_chunks(poison, request, monkeypatch):
    """More splits than one step of the combine holds: the online merge across its chunks. The keys grow along the
    cache, so the running max rises in the last chunk and the earlier chunks must be rescaled."""
    monkeypatch.setattr(SETTINGS, "decode_tiles", [TileConfig(16, 16, 4, 1)])
    splits = decode.COMBINE_BLOCK_S + 9
    # One 16-key block per split, so that every split of the second chunk has keys.
    case = Case(batch=1, heads=2, kv_heads=1, capacity=16 * splits, lengths=(16 * splits - 7,), num_splits=splits,
                growing_keys=True)
    run_case(case, _seed(request))
    assert _split_counts(poison, 1, 1, 2, 32) == [splits]


def test_splits_agree(request):
    """1, 2 and 5 splits give the same result up to fp32 rounding (merge of partials, derivation ch. 7)."""
    case = Case(batch=2, heads=8, kv_heads=2, capacity=160, dtype=torch.float32, lengths=(150, 77))
    inp = make_inputs(case, _seed(request))
    k_store = inp.layout.place(inp.k_logical, float("nan"))
    v_store = inp.layout.place(inp.v_logical, float("nan"))
    results = [flash_attn_with_kvcache(inp.q, k_store, v_store, cache_seqlens=inp.cache_seqlens, num_splits=n,
                                       return_softmax_lse=True) for n in (1, 2, 5)]
    for out, lse in results[1:]:
        torch.testing.assert_close(out, results[0][0], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(lse, results[0][1], rtol=1e-5, atol=1e-6)


def test_small_tiles_many_row_blocks(poison, request, monkeypatch):
    """Tiles of 16 rows x 16 keys: a GQA group spans row blocks, and the causal key range differs per block."""
    monkeypatch.setattr(SETTINGS, "decode_tiles", [TileConfig(16, 16, 4, 1)])
    run_case(Case(seqlen_q=9, heads=6, kv_heads=2, capacity=70, causal=True, num_splits=2, seqlen_new=3),
             _seed(request))


def test_choose_num_splits():
    # An explicit request is honoured; whole waves already: no split. 1000 programs are 7.6 waves: the last one
    # 58% full, 5.6% of the time lost; 3 splits lose 1.2%.
    assert decode.choose_num_splits(5, 1000, 10, 64, 132) == 5
    assert decode.choose_num_splits(0, 8 * 132, 10 ** 6, 64, 132) == 1
    assert decode.choose_num_splits(0, 1000, 10 ** 6, 64, 132) == 3
    # Short cache: at least MIN_BLOCKS_PER_SPLIT blocks per split.
    assert decode.choose_num_splits(0, 1, 64 * decode.MIN_BLOCKS_PER_SPLIT, 64, 132) == 1
    # Waves on 132 slots (Hk = 8): batch 8 fills one wave with 2 splits (128 programs) where 5 splits would run
    # 2.4 waves; batch 1 takes 16; 256 programs are 2 waves already.
    assert decode.choose_num_splits(0, 64, 10 ** 6, 64, 132) == 2
    assert decode.choose_num_splits(0, 8, 10 ** 6, 64, 132) == 16
    assert decode.choose_num_splits(0, 256, 10 ** 6, 64, 132) == 1
    assert decode.choose_num_splits(0, 64, 10 ** 6, 64, 264) == 4


def test_split_slots_from_shared_memory(monkeypatch):
    """Resident programs per SM from the K/V buffers' shared memory: 3 stages of 128 x 128 bf16 K and V (192 KB) fit
    once in 228 KB, 64-key blocks (96 KB) twice."""
    monkeypatch.setattr(configs, "INTERPRETING", False)
    monkeypatch.setattr(decode, "_device_limits", lambda index: (132, 228 * 1024))
    cuda = torch.device("cuda", 0)
    assert decode.split_slots(cuda, TileConfig(64, 128, 4, 3), 128, 2) == 132
    assert decode.split_slots(cuda, TileConfig(64, 64, 4, 3), 128, 2) == 264
    assert decode.split_slots(cuda, TileConfig(64, 64, 4, 3), 128, 1) == 4 * 132  # fp8: half the bytes


# ----------------------------------------------------------------------------------------------------------------
# fp8 cache (stretch): e4m3 values with per-(batch, kv head) descale factors


FP8_CASES = [
    Case(fp8=True, num_splits=2),
    Case(fp8=True, seqlen_q=3, causal=True, page_size=16, num_splits=1, dtype=torch.float16),
    Case(fp8=True, heads=8, kv_heads=2, alibi="heads", softcap=5.0, num_splits=3),
    # Appends: rounded in the kernel, so the interpreter stores torch's bits too.
    Case(fp8=True, seqlen_new=3, seqlen_q=3, causal=True, num_splits=2),
    Case(fp8=True, seqlen_new=5, seqlen_q=5, causal=True, page_size=32, rotary_dim=32, num_splits=1),
    Case(fp8=True, seqlen_new=2, rotary_dim=16, interleaved=False, batch_idx=True, num_splits=2,
         dtype=torch.float16),
]


@pytest.mark.parametrize("case", [_param(c) for c in FP8_CASES])
def test_fp8_cache(poison, request, case):
    run_case(case, _seed(request))


def _e4m3_probe_values():
    """Values that exercise every case of rounding to e4m3: each finite e4m3 value, the midpoints between
    neighbours (ties go to the even one), values just above and below those, the carries into the next binade
    (1.9375 -> 2), the subnormals and the gap under the smallest one, -0, and values past 448 (saturate). All are
    exact in float16 (5 significant bits, nudged by 2^-6)."""
    grid = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn).float()
    grid = grid[torch.isfinite(grid) & (grid >= 0)].unique()  # 0, 2^-9, ..., 448
    mid = (grid[1:] + grid[:-1]) / 2
    nudged = torch.cat((mid * (1 + 2.0 ** -6), mid * (1 - 2.0 ** -6), grid * (1 + 2.0 ** -6)))
    values = torch.cat((grid, mid, nudged, torch.tensor([2.0 ** -11, 3 * 2.0 ** -11, 449.0, 464.0, 1e4])))
    return torch.cat((values, -values, torch.tensor([-0.0])))


def test_fp8_append_rounds_like_torch():
    """Appending into an fp8 cache stores exactly torch's .to(float8_e4m3fn) of value / descale (nearest even,
    saturated at 448). Triton's interpreter casts fp32 -> fp8 rounding ties away from zero and dropping the carry
    into the next binade (1.97 -> 1.0 instead of 2.0), so the kernel rounds before it casts."""
    values = _e4m3_probe_values()
    hk, d = 2, 64
    rows = math.ceil(values.numel() / (hk * d))
    k = torch.zeros(rows * hk * d)
    k[:values.numel()] = values
    k = k.view(1, rows, hk, d).to(torch.float16).to(DEVICE)
    v = torch.flip(k, dims=(1,)).contiguous()
    descale = torch.tensor([[1.0, 0.5]], device=DEVICE)  # kv head 1 doubles every value first
    k_cache = torch.zeros(1, rows + 3, hk, d, device=DEVICE).to(torch.float8_e4m3fn)
    v_cache = torch.zeros_like(k_cache)
    q = torch.zeros(1, 1, 4, d, dtype=torch.float16, device=DEVICE)
    flash_attn_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=2, k_descale=descale, v_descale=descale)
    for name, new, cache in (("k", k, k_cache), ("v", v, v_cache)):
        want = (new.float() / descale[:, None, :, None]).clamp(-448, 448).to(torch.float8_e4m3fn)
        assert torch.equal(_bits(cache[:, 2:2 + rows]), _bits(want)), f"{name}_cache"


# ----------------------------------------------------------------------------------------------------------------
# The reference's own addressing, and that it agrees with naive attention


def test_reference_addressing(request):
    """The reference on the storage (block table / cache_batch_idx) equals the reference on the logical cache."""
    for case in (Case(page_size=16, seqlen_new=3, leftpad=True), Case(batch_idx=True, seqlen_new=2)):
        inp = make_inputs(case, _seed(request))
        layout = inp.layout
        args = dict(cache_seqlens=inp.cache_seqlens, cache_leftpad=inp.leftpad, causal=True)
        logical = reference.kvcache_forward(inp.q.double(), inp.k_logical.double(), inp.v_logical.double(),
                                            inp.k.double(), inp.v.double(), **args)
        stored = reference.kvcache_forward(
            inp.q.double(), layout.place(inp.k_logical.double(), float("nan")),
            layout.place(inp.v_logical.double(), float("nan")), inp.k.double(), inp.v.double(),
            block_table=layout.block_table, cache_batch_idx=layout.batch_idx if case.batch_idx else None, **args)
        torch.testing.assert_close(stored[0], logical[0], rtol=0, atol=0)
        torch.testing.assert_close(stored[1], logical[1], rtol=0, atol=0)
        torch.testing.assert_close(layout.gather(stored[2]), logical[2], rtol=0, atol=0, equal_nan=True)


def test_reference_rotary_matches_complex_rotation():
    """Rotary as multiplication by e^{i theta} of complex pairs: interleaved (2t, 2t + 1), NeoX (t, t + d/2)."""
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(2, 3, 2, 12, generator=gen, dtype=torch.float64)
    angle = torch.rand(9, 4, generator=gen, dtype=torch.float64)
    pos = torch.tensor([[0, 4, 8], [1, 1, 2]])
    rot = torch.polar(torch.ones_like(angle), angle)[pos].unsqueeze(2)  # [2, 3, 1, 4]
    inter = reference.apply_rotary(x, angle.cos(), angle.sin(), pos, interleaved=True)
    z = torch.view_as_complex(x[..., :8].reshape(2, 3, 2, 4, 2).contiguous()) * rot
    torch.testing.assert_close(inter[..., :8], torch.view_as_real(z).flatten(-2))
    neox = reference.apply_rotary(x, angle.cos(), angle.sin(), pos, interleaved=False)
    z = torch.complex(x[..., :4], x[..., 4:8]) * rot
    torch.testing.assert_close(neox[..., :8], torch.cat((z.real, z.imag), dim=-1))
    torch.testing.assert_close(inter[..., 8:], x[..., 8:])
    torch.testing.assert_close(neox[..., 8:], x[..., 8:])


def test_reference_matches_naive_attention(request):
    """Without append or cache options, the reference is naive_attention over each sequence's first n rows."""
    gen = torch.Generator().manual_seed(_seed(request))
    q = torch.randn(2, 3, 4, 16, generator=gen, dtype=torch.float64)
    kc = torch.randn(2, 20, 2, 16, generator=gen, dtype=torch.float64)
    vc = torch.randn(2, 20, 2, 16, generator=gen, dtype=torch.float64)
    out, lse = reference.kvcache_attention(q, kc, vc, torch.tensor([20, 7]), causal=True)
    for b, n in enumerate((20, 7)):
        o, l = naive_attention(q[b:b + 1], kc[b:b + 1, :n], vc[b:b + 1, :n], causal=True)
        torch.testing.assert_close(out[b:b + 1], o, rtol=0, atol=0)
        torch.testing.assert_close(lse[b:b + 1], l, rtol=0, atol=0)


# ----------------------------------------------------------------------------------------------------------------
# Argument checks: each names the bad value and the fix


def _valid_args():
    q = torch.randn(2, 1, 4, 16, device=DEVICE)
    kc = torch.randn(2, 32, 2, 16, device=DEVICE)
    vc = torch.randn(2, 32, 2, 16, device=DEVICE)
    return dict(q=q, k_cache=kc, v_cache=vc, cache_seqlens=torch.tensor([3, 5], dtype=torch.int32, device=DEVICE))


def _new_kv(b=2, s=1, h=2, d=16, dtype=torch.float32):
    return dict(k=torch.randn(b, s, h, d, device=DEVICE, dtype=dtype), v=torch.randn(b, s, h, d, device=DEVICE,
                                                                                     dtype=dtype))


def _rotary(rows=64, half=4):
    return dict(rotary_cos=torch.ones(rows, half, device=DEVICE), rotary_sin=torch.zeros(rows, half, device=DEVICE))


def _paged():
    return dict(k_cache=torch.randn(6, 16, 2, 16, device=DEVICE), v_cache=torch.randn(6, 16, 2, 16, device=DEVICE),
                block_table=torch.tensor([[0, 1], [2, 3]], dtype=torch.int32, device=DEVICE))


BAD_ARGS = [
    ("q-3d", lambda a: dict(q=a["q"][0]), ValueError, "q must be 4-D"),
    ("q-int", lambda a: dict(q=a["q"].to(torch.int32)), TypeError, "q has dtype torch.int32"),
    ("cache-dtype", lambda a: dict(k_cache=a["k_cache"].half(), v_cache=a["v_cache"].half()), TypeError,
     "q is torch.float32 but the cache is torch.float16"),
    ("kv-cache-shapes", lambda a: dict(v_cache=a["v_cache"][:, :16]), ValueError, "must be equal"),
    ("cache-strided-headdim", lambda a: dict(k_cache=a["k_cache"].transpose(1, 3).contiguous().transpose(1, 3)),
     ValueError, "k_cache's last dimension"),
    ("headdim-mismatch", lambda a: dict(q=torch.randn(2, 1, 4, 24, device=DEVICE)), ValueError,
     "q has headdim 24 but the cache has 16"),
    ("heads-not-multiple", lambda a: dict(q=torch.randn(2, 1, 3, 16, device=DEVICE)), ValueError,
     "multiple of the number of key/value heads"),
    ("cache-batch", lambda a: dict(k_cache=a["k_cache"][:1], v_cache=a["v_cache"][:1]), ValueError,
     "pass cache_batch_idx"),
    ("k-without-v", lambda a: dict(k=torch.randn(2, 1, 2, 16, device=DEVICE)), ValueError, "both k and v"),
    ("k-heads", lambda a: _new_kv(h=4), ValueError, "k has shape"),
    ("k-dtype", lambda a: _new_kv(dtype=torch.float16), TypeError, "k is torch.float16"),
    ("append-without-seqlens", lambda a: dict(_new_kv(), cache_seqlens=None), ValueError, "needs cache_seqlens"),
    ("int-seqlens-overflow", lambda a: dict(_new_kv(s=3), cache_seqlens=30), ValueError,
     "does not fit a cache of 32 rows"),
    ("seqlens-dtype", lambda a: dict(cache_seqlens=a["cache_seqlens"].float()), TypeError,
     "cache_seqlens has dtype torch.float32"),
    ("seqlens-shape", lambda a: dict(cache_seqlens=a["cache_seqlens"][:1]), ValueError,
     r"cache_seqlens has shape \(1,\)"),
    ("rotary-without-k", lambda a: _rotary(), ValueError, "need k and v"),
    ("rotary-only-cos", lambda a: dict(_new_kv(), rotary_cos=torch.ones(64, 4, device=DEVICE)), ValueError,
     "both rotary_cos and rotary_sin"),
    ("rotary-too-wide", lambda a: dict(_new_kv(), **_rotary(half=9)), ValueError, "rotary_dim <= headdim"),
    ("batch-idx-with-block-table", lambda a: dict(_paged(), cache_batch_idx=torch.tensor([0, 1], dtype=torch.int32,
                                                                                          device=DEVICE)),
     ValueError, "cannot be combined with block_table"),
    ("block-table-dtype", lambda a: dict(_paged(), block_table=_paged()["block_table"].float()), TypeError,
     "block_table has dtype"),
    ("block-table-shape", lambda a: dict(_paged(), block_table=_paged()["block_table"][:1]), ValueError,
     "block_table has shape"),
    ("leftpad-shape", lambda a: dict(cache_leftpad=torch.zeros(3, dtype=torch.int32, device=DEVICE)), ValueError,
     "cache_leftpad has shape"),
    ("window-type", lambda a: dict(window_size=5), TypeError, "window_size must be a pair"),
    ("window-value", lambda a: dict(window_size=(-2, 0)), ValueError, "window_size entries must be >= -1"),
    ("softcap-negative", lambda a: dict(softcap=-1.0), ValueError, "softcap must be finite and >= 0"),
    ("alibi-dtype", lambda a: dict(alibi_slopes=torch.ones(4, dtype=torch.float64, device=DEVICE)), TypeError,
     "alibi_slopes must be float32"),
    ("alibi-shape", lambda a: dict(alibi_slopes=torch.ones(2, device=DEVICE)), ValueError,
     "alibi_slopes must have shape"),
    ("num-splits", lambda a: dict(num_splits=-1), ValueError, r"num_splits must be an int in \[0, 128\]"),
    ("num-splits-huge", lambda a: dict(num_splits=129), ValueError, r"num_splits must be an int in \[0, 128\]"),
    ("scale-type", lambda a: dict(softmax_scale="0.1"), TypeError, "softmax_scale must be a float"),
    ("causal-type", lambda a: dict(causal=1), TypeError, "causal must be a bool"),
    ("fp8-without-descale", lambda a: dict(q=a["q"].bfloat16(), k_cache=a["k_cache"].to(torch.float8_e4m3fn),
                                           v_cache=a["v_cache"].to(torch.float8_e4m3fn)), ValueError,
     "pass k_descale and v_descale"),
    ("descale-without-fp8", lambda a: dict(k_descale=torch.ones(2, 2, device=DEVICE),
                                           v_descale=torch.ones(2, 2, device=DEVICE)), ValueError,
     "apply to an fp8"),
    ("fp8-fp32-q", lambda a: dict(k_cache=a["k_cache"].to(torch.float8_e4m3fn),
                                  v_cache=a["v_cache"].to(torch.float8_e4m3fn), k_descale=torch.ones(2, 2),
                                  v_descale=torch.ones(2, 2)), TypeError, "an fp8 cache needs q in float16"),
]


@pytest.mark.parametrize("name,change,exc,message", BAD_ARGS, ids=[b[0] for b in BAD_ARGS])
def test_invalid_arguments(name, change, exc, message):
    """Each bad argument raises, also right after a valid call with the same tensors: the repeated-call path
    (flashtile.kvcache._CALLS) must not skip a check."""
    args = _valid_args()
    flash_attn_with_kvcache(**args)
    args.update(change(args))
    with pytest.raises(exc, match=message):
        flash_attn_with_kvcache(**args)


# ----------------------------------------------------------------------------------------------------------------
# torch.compile, opcheck, return conventions, the CPU fallback


def test_return_conventions():
    args = _valid_args()
    out = flash_attn_with_kvcache(**args)
    assert isinstance(out, torch.Tensor) and out.shape == (2, 1, 4, 16)
    out2, lse = flash_attn_with_kvcache(**args, return_softmax_lse=True)
    assert torch.equal(out, out2) and lse.shape == (2, 4, 1) and lse.dtype == torch.float32


@pytest.fixture
def dynamo_counters():
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    yield torch._dynamo.utils.counters
    torch._dynamo.reset()


def test_torch_compile_fullgraph(request, dynamo_counters):
    """A decode step (append with rotary, then attention) compiles into one graph; the compiled step mutates the
    cache in place exactly as the eager one does."""
    case = Case(seqlen_new=1, rotary_dim=16, causal=True, page_size=16, dtype=torch.float32, num_splits=2)
    inp = make_inputs(case, _seed(request))
    layout = inp.layout

    def step(q, k_cache, v_cache, k, v, cos, sin, seqlens, block_table):
        return flash_attn_with_kvcache(q, k_cache, v_cache, k, v, cos, sin, cache_seqlens=seqlens,
                                       block_table=block_table, causal=True, num_splits=2, return_softmax_lse=True)

    caches = [(layout.place(inp.k_logical, float("nan")), layout.place(inp.v_logical, float("nan")))
              for _ in range(2)]
    args = (inp.q, inp.k, inp.v, inp.cos, inp.sin, inp.cache_seqlens, layout.block_table)
    eager = step(args[0], *caches[0], *args[1:])
    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")(args[0], *caches[1], *args[1:])
    assert not dynamo_counters["graph_break"], dict(dynamo_counters["graph_break"])
    assert dynamo_counters["stats"]["unique_graphs"] == 1
    for got, want in zip(compiled, eager):
        assert torch.equal(got, want)
    for got, want in zip(caches[1], caches[0]):
        assert torch.equal(_bits(got), _bits(want))


def _opcheck_inputs(seed):
    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    q = torch.randn(2, 2, 4, 16, generator=gen, device=DEVICE)
    k_cache = torch.randn(5, 16, 2, 16, generator=gen, device=DEVICE)
    v_cache = torch.randn(5, 16, 2, 16, generator=gen, device=DEVICE)
    k = torch.randn(2, 2, 2, 16, generator=gen, device=DEVICE)
    v = torch.randn(2, 2, 2, 16, generator=gen, device=DEVICE)
    seqlens = torch.tensor([3, 12], dtype=torch.int32, device=DEVICE)
    table = torch.tensor([[4, 1], [0, 2]], dtype=torch.int32, device=DEVICE)
    cos, sin = torch.rand(40, 4, generator=gen, device=DEVICE), torch.rand(40, 4, generator=gen, device=DEVICE)
    return q, k_cache, v_cache, k, v, seqlens, table, cos, sin


def test_opcheck_append(request):
    q, k_cache, v_cache, k, v, seqlens, table, cos, sin = _opcheck_inputs(_seed(request))
    req = KVCacheRequest(cache_seqlens=seqlens, seqlen_new=k.shape[1], block_table=table, rotary_cos=cos,
                         rotary_sin=sin, rotary_interleaved=True)
    torch.library.opcheck(torch.ops.flashtile.kvcache_append.default, (k_cache, v_cache, k, v, *req.flatten()))


@pytest.mark.parametrize("num_splits", (1, 2))
def test_opcheck_attn(request, num_splits):
    q, k_cache, v_cache, k, v, seqlens, table, cos, sin = _opcheck_inputs(_seed(request))
    req = KVCacheRequest(cache_seqlens=seqlens, seqlen_new=2, block_table=table, rotary_cos=cos, rotary_sin=sin,
                         rotary_interleaved=False, softmax_scale=0.25, causal=True, num_splits=num_splits)
    torch.library.opcheck(torch.ops.flashtile.kvcache_attn.default, (q, k_cache, v_cache, *req.flatten()))


_FALLBACK_SCRIPT = textwrap.dedent("""
    import json, warnings
    import torch
    from flashtile.kernels import configs
    from flashtile.kvcache import flash_attn_with_kvcache
    from flashtile.reference import kvcache as reference

    gen = torch.Generator().manual_seed({seed})
    q = torch.randn(2, 3, 4, 16, generator=gen)
    pool_k, pool_v = torch.randn(7, 16, 2, 16, generator=gen), torch.randn(7, 16, 2, 16, generator=gen)
    table = torch.tensor([[5, 0], [2, 6]], dtype=torch.int32)
    k, v = torch.randn(2, 3, 2, 16, generator=gen), torch.randn(2, 3, 2, 16, generator=gen)
    cos, sin = torch.rand(40, 4, generator=gen), torch.rand(40, 4, generator=gen)
    seqlens = torch.tensor([4, 20], dtype=torch.int32)
    args = dict(cache_seqlens=seqlens, block_table=table, causal=True, rotary_interleaved=False)

    def err(a, b):
        return (a.double() - b.double()).abs().max().item()

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        results = {{}}
        for step in range(2):
            ref = reference.kvcache_forward(q.double(), pool_k.double(), pool_v.double(), k.double(), v.double(),
                                            cos.double(), sin.double(), **args)
            plain = reference.kvcache_forward(q, pool_k, pool_v, k, v, cos, sin, **args)
            out, lse = flash_attn_with_kvcache(q, pool_k, pool_v, k, v, cos, sin, return_softmax_lse=True, **args)
            for name, a, r, p in zip(("out", "lse", "k_cache", "v_cache"), (out, lse, pool_k, pool_v), ref, plain):
                results[f"{{name}}-{{step}}"] = (err(a, r), err(p, r), bool(torch.isfinite(a).all()))
            seqlens += 3
    print(json.dumps(dict(
        interpreting=configs.INTERPRETING,
        warnings=[(w.category.__name__, str(w.message)) for w in caught if "flashtile" in str(w.message)],
        results=results,
    )))
""")


def test_cpu_fallback_without_interpreter(request):
    """Without TRITON_INTERPRET, CPU tensors run the reference (two appends and attentions), warning once."""
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO_ROOT)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    proc = subprocess.run([sys.executable, "-c", _FALLBACK_SCRIPT.format(seed=_seed(request))], env=env,
                          cwd=REPO_ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report["interpreting"] is False
    assert len(report["warnings"]) == 1, report["warnings"]
    assert "pure-PyTorch reference" in report["warnings"][0][1]
    for name, (err, base, finite) in report["results"].items():
        assert finite, f"{name} has non-finite entries"
        assert err <= K * base + 1e-5, f"{name}: max error {err:.3e} > {K} x PyTorch's {base:.3e} + atol"


def test_cpu_tensors_run_the_kernels(poison):
    """In-process CPU tests exercise the interpreted kernels, not the fallback."""
    assert configs.INTERPRETING or torch.cuda.is_available()
    args = _valid_args()
    flash_attn_with_kvcache(**args, num_splits=2)
    assert _split_counts(poison, 2, 1, 4, 16) == [2]  # the split kernel's partial outputs


# ----------------------------------------------------------------------------------------------------------------
# GPU: the sizes decoding runs at


GPU_CASES = [
    *(Case(batch=8, heads=32, kv_heads=8, head_dim=128, capacity=16384, page_size=ps, num_splits=0)
      for ps in (16, 32, 64, 128, 256)),
    Case(batch=8, heads=32, kv_heads=8, head_dim=128, capacity=16384, num_splits=0),
    Case(batch=1, heads=32, kv_heads=8, head_dim=128, capacity=65536, num_splits=0),
    Case(batch=64, heads=32, kv_heads=8, head_dim=128, capacity=4096, num_splits=0, page_size=16),
    Case(batch=4, heads=32, kv_heads=8, head_dim=128, capacity=8192, num_splits=0, seqlen_new=1, rotary_dim=128,
         interleaved=False, page_size=16),
    Case(batch=2, seqlen_q=256, heads=32, kv_heads=8, head_dim=128, capacity=8192, seqlen_new=256, causal=True,
         num_splits=0, rotary_dim=64),
    Case(batch=4, seqlen_q=4, heads=16, kv_heads=2, head_dim=64, capacity=5000, seqlen_new=4, causal=True,
         num_splits=0, page_size=32, leftpad=True),
    Case(batch=3, heads=16, kv_heads=16, head_dim=256, capacity=3000, dtype=torch.float16, num_splits=0),
    Case(batch=2, heads=8, kv_heads=2, head_dim=96, capacity=3001, dtype=torch.float32, num_splits=0, softcap=20.0,
         alibi="heads", window=(1000, 0)),
    Case(batch=8, heads=32, kv_heads=8, head_dim=128, capacity=16384, num_splits=0, fp8=True, page_size=16),
    Case(batch=4, heads=32, kv_heads=8, head_dim=128, capacity=4096, num_splits=0, fp8=True, seqlen_new=3,
         seqlen_q=3, causal=True),
    Case(batch=4, heads=8, kv_heads=8, head_dim=64, capacity=2048, seqlen_new=2, batch_idx=True, num_splits=0,
         dtype=torch.float16, rotary_dim=32),
]


@pytest.mark.gpu
@pytest.mark.parametrize("case", [_param(c) for c in GPU_CASES])
def test_gpu_cases(request, case):
    run_case(case, _seed(request))


@pytest.mark.gpu
@pytest.mark.parametrize("page_size", (16, 32, 64, 128, 256))
def test_gpu_paged_equals_contiguous(request, page_size):
    """The same keys through a shuffled block table and through a contiguous cache agree to a bf16 rounding step
    (same tiles, same splits: only the addressing differs), and the tuned tile compiled (no fallback)."""
    case = Case(batch=8, heads=32, kv_heads=8, head_dim=128, capacity=16384, num_splits=0)
    inp = make_inputs(dataclasses.replace(case, page_size=page_size), _seed(request))
    contiguous = Layout("contiguous", case.batch, batch_idx=torch.arange(case.batch, dtype=torch.int32,
                                                                        device=DEVICE))
    results = []
    for layout in (inp.layout, contiguous):
        k_store, v_store = layout.place(inp.k_logical, float("nan")), layout.place(inp.v_logical, float("nan"))
        results.append(flash_attn_with_kvcache(inp.q, k_store, v_store, cache_seqlens=inp.cache_seqlens,
                                               block_table=layout.block_table, return_softmax_lse=True))
    torch.testing.assert_close(results[0][0], results[1][0], rtol=0, atol=2 ** -7)
    torch.testing.assert_close(results[0][1], results[1][1], rtol=0, atol=1e-5)
    for tile, index in configs.chosen("decode", 128, False, torch.bfloat16):
        assert index == 0, f"the tuned decode tile did not compile; fell back to {tile}"


@pytest.mark.gpu
def test_gpu_fp8_append_rounding(request):
    """Appending into an fp8 cache with rotary on the compiled path: v bit-exact with torch's rounding, the rotated
    k within one e4m3 step of the float64 oracle (run_case)."""
    run_case(Case(batch=4, heads=8, kv_heads=2, head_dim=64, capacity=512, seqlen_new=16, seqlen_q=16, causal=True,
                  fp8=True, num_splits=0, rotary_dim=64), _seed(request))


@pytest.fixture
def fresh_plans(monkeypatch):
    """Empty plan and validated-call caches for the test, so that its first call builds them."""
    monkeypatch.setattr(decode, "_PLANS", {})
    monkeypatch.setattr(kvcache, "_CALLS", {})


def _decode_step(inp, layout, k_store, v_store, **kw):
    return flash_attn_with_kvcache(inp.q, k_store, v_store, inp.k, inp.v, inp.cos, inp.sin,
                                   cache_seqlens=inp.cache_seqlens, block_table=layout.block_table, causal=True,
                                   return_softmax_lse=True, **kw)


@pytest.mark.gpu
def test_gpu_fast_launch(request, fresh_plans):
    """From the second call of a shape on, the launches go straight to the compiled kernels (_launch.Bound) and
    give the same bits as the first call's launches through Triton's JITFunction; a misaligned q gets a plan of its
    own (Triton specializes on 16-byte alignment) and the same bits again."""
    case = Case(batch=2, heads=32, kv_heads=8, head_dim=128, capacity=4096, page_size=16, seqlen_new=1,
                rotary_dim=128, causal=True, num_splits=0)
    inp = make_inputs(case, _seed(request))
    layout = inp.layout
    results = []
    for step in range(3):
        if step == 2:
            buffer = torch.empty(inp.q.numel() + 1, dtype=inp.q.dtype, device=DEVICE)
            inp.q = buffer[1:].view(inp.q.shape).copy_(inp.q)
            assert inp.q.data_ptr() % 16
        k_store, v_store = layout.place(inp.k_logical, float("nan")), layout.place(inp.v_logical, float("nan"))
        out, lse = _decode_step(inp, layout, k_store, v_store)
        results.append((out, lse, k_store, v_store))
    calls = list(kvcache._CALLS.values())
    assert len(calls) == 2  # aligned q, misaligned q
    assert all(c.attn.split.compiled is not None and c.append.launch.compiled is not None for c in calls)
    # One compile cache for every launch (kernels/_launch.py): the plans' kernels are in it (a key names its kernel
    # by the kernel's Python function).
    from flashtile.kernels import _launch
    cached = {key[0] for _, key in _launch._COMPILED}
    assert {decode._kvcache_split_kernel.fn, decode._kvcache_append_kernel.fn} <= cached
    assert decode.fast_stream(torch.cuda.current_device()) is not None
    for got in results[1:]:
        for a, b in zip(got, results[0]):
            assert torch.equal(_bits(a), _bits(b))


@pytest.mark.gpu
def test_gpu_launch_hooks_see_every_launch(request, fresh_plans):
    """With a Triton launch hook registered (a profiler), launches take the JITFunction path, which calls it."""
    runtime = getattr(getattr(__import__("triton"), "knobs", None), "runtime", None)
    if runtime is None or not hasattr(runtime.launch_enter_hook, "add"):
        pytest.skip("this Triton has no launch hook chain")
    names = []
    hook = lambda metadata: names.append(metadata.get()["name"])  # noqa: E731
    inp = make_inputs(Case(batch=2, heads=8, kv_heads=2, head_dim=64, capacity=512, num_splits=2), _seed(request))
    k_store, v_store = inp.layout.place(inp.k_logical, 0.0), inp.layout.place(inp.v_logical, 0.0)
    call = lambda: flash_attn_with_kvcache(inp.q, k_store, v_store, cache_seqlens=inp.cache_seqlens,  # noqa: E731
                                           num_splits=2)
    call()
    runtime.launch_enter_hook.add(hook)
    try:
        call()
    finally:
        runtime.launch_enter_hook.remove(hook)
    assert names == ["_kvcache_split_kernel", "_kvcache_combine_kernel"], names


# ----------------------------------------------------------------------------------------------------------------
# Repeated calls (CPU too): flashtile.kvcache._CALLS and the launch plans of flashtile.kernels.decode


def test_decode_loop_skips_the_checks(request, monkeypatch, fresh_plans):
    """Steps with the same shapes, strides and options as a validated one skip the checks (made to fail here) and
    still compute the right result and cache; an int cache_seqlens may change between them."""
    case = Case(seqlen_new=1, rotary_dim=16, causal=True, page_size=16, num_splits=2, int_seqlens=True)
    seed = _seed(request)
    run_case(case, seed)
    assert len(kvcache._CALLS) == 1

    def fail(*args, **kwargs):
        raise AssertionError("validated again")

    monkeypatch.setattr(kvcache, "_validate", fail)
    for step in (1, 2):
        run_case(case, seed + step)
    assert len(kvcache._CALLS) == 1


def test_repeated_call_checks_int_seqlens(fresh_plans):
    args = _valid_args()
    flash_attn_with_kvcache(**dict(args, cache_seqlens=3))
    with pytest.raises(ValueError, match="does not fit a cache of 32 rows"):
        flash_attn_with_kvcache(**dict(args, cache_seqlens=33))


def test_copied_arguments_are_not_remembered(request, fresh_plans):
    """A q whose headdim is strided is copied before the kernels run; such calls are not remembered (the copy
    would be skipped) and stay right when repeated."""
    args = _valid_args()
    wide = torch.randn(2, 1, 16, 4, device=DEVICE).transpose(2, 3)  # (2, 1, 4, 16), headdim stride 4
    want = flash_attn_with_kvcache(**dict(args, q=wide.contiguous()))
    for _ in range(2):
        got = flash_attn_with_kvcache(**dict(args, q=wide))
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert len(kvcache._CALLS) == 1  # the contiguous call only
