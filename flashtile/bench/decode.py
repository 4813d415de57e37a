"""Decode benchmark: KV-cache attention at one query token, flashtile against its peers in the same run.

    python -m flashtile bench decode                       # the standard table
    python -m flashtile bench decode --sweep               # + tile and num_splits sweep for kernels/decode.py
    python -m flashtile bench decode --batch 8 --kv 16k    # one shape
    python -m flashtile bench decode --sweep-only --sweep-shapes 8x16k,8x16kp16,8x16kp256   # sweep some shapes
    TRITON_INTERPRET=1 python -m flashtile bench decode --host-cpu   # host overhead per call, no GPU

bf16, headdim 128, Hq = 32 query heads over Hkv = 8 kv heads (GQA 4), q_len 1, every sequence at the full cache
length, batch 1/8/64 x kv 4k/16k/64k (shapes that do not fit the GPU's free memory are skipped). Providers:
flashtile with a contiguous cache, with a paged cache (pages of 16 and 256 in shuffled order), torch SDPA with the
cuDNN and with the flash backend, and flash-attn 2's flash_attn_with_kvcache when it is importable. Time: median of
triton.testing.do_bench (which clears the L2 cache before each call). Bandwidth counts the K and V bytes a decode
step must read, B x kv x Hkv x D x 2 (K and V) x 2 bytes, whatever a provider actually moves (SDPA without native
GQA support reads 4x that from expanded heads, and is still credited with the real bytes only). The device's copy
bandwidth is the median time of a 1 GiB device-to-device copy_, counting read + write.

Prints a table (KV TB/s, fraction of copy bandwidth, speed relative to cuDNN, paged / contiguous, host time per
call) and the issue's bars, and writes <date>-<gpu>-decode.json to --out with every number and the run's metadata.

Host time: do_bench clears the L2 cache (a 256 MB memset, ~60-80 us of GPU time) before every call, so a call
whose host side (Python, checks, launches) takes longer than that plus its kernels shows its host time instead of
its GPU time. "host us" is the wall time per call of 200 back-to-back calls without synchronising, the host cost
alone. --host-cpu measures the same on a machine without a GPU: the launches are stubbed out (TRITON_INTERPRET=1
turns the kernels into Python objects that are never run), so it counts flashtile's Python only: no Triton
launcher, no CUDA allocations.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import json
import math
import platform
import sys
import time

import torch
import torch.nn.functional as F

from .registry import dist_version
from .runner import DEFAULT_OUT, commit, result_path

DEVICE = "cuda"
HEADS, KV_HEADS, HEAD_DIM = 32, 8, 128
DTYPE = torch.bfloat16
BATCHES = (1, 8, 64)
KV_LENS = (4096, 16384, 65536)
PAGE_SIZES = (16, 256)
COPY_BYTES = 1 << 30
# Outputs are compared with an fp32 reference on the first CHECK_BATCH sequences; bf16 outputs of softmax-weighted
# averages of N(0, 1) values are below ~1 in size, so 2e-2 is a few bf16 ulps plus accumulation order.
CHECK_BATCH = 2
ATOL = 2e-2
# Keep this fraction of the free memory unused when deciding whether a provider's tensors fit.
MEMORY_HEADROOM = 0.9
# The bars (docs/kvcache.md): KV bandwidth at kv >= 16k with batch 8, speed against cuDNN, paged overhead.
BAR_COPY_FRACTION = 0.90
BAR_VS_CUDNN = 1.0
BAR_PAGED_SLOWDOWN = 1.10


def log(msg):
    print(msg, file=sys.stderr, flush=True)


def kv_bytes(batch, kv_len):
    return batch * kv_len * KV_HEADS * HEAD_DIM * 2 * DTYPE.itemsize


def fits(nbytes):
    free, _ = torch.cuda.mem_get_info()
    return nbytes <= MEMORY_HEADROOM * free


def bench(fn):
    import triton.testing
    return triton.testing.do_bench(fn, return_mode="median")  # ms


HOST_CALLS = 200


def host_us(fn, calls=HOST_CALLS):
    """Host microseconds per call: `calls` back-to-back calls, no synchronisation in between (the GPU runs
    behind; a few hundred launches stay well inside the launch queue)."""
    fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    elapsed = time.perf_counter() - start
    torch.cuda.synchronize()
    return elapsed / calls * 1e6


def copy_bandwidth():
    """Bytes per second of a device-to-device copy_ of COPY_BYTES, counting read + write."""
    src = torch.empty(COPY_BYTES, dtype=torch.uint8, device=DEVICE)
    dst = torch.empty_like(src)
    ms = bench(lambda: dst.copy_(src))
    return 2 * COPY_BYTES / (ms * 1e-3), ms


# ----------------------------------------------------------------------------------------------------------------
# Providers: each takes (q [B, 1, Hq, D], k, v [B, S, Hkv, D]) and returns a zero-argument callable that runs one
# decode step and returns out [B, 1, Hq, D]; it may raise Unsupported.


class Unsupported(Exception):
    pass


def flashtile_contiguous(q, k, v, num_splits=0):
    from flashtile.kvcache import flash_attn_with_kvcache
    seqlens = torch.full((q.shape[0],), k.shape[1], dtype=torch.int32, device=q.device)
    return lambda: flash_attn_with_kvcache(q, k, v, cache_seqlens=seqlens, num_splits=num_splits)


def to_paged(k, page_size, gen):
    """The same keys in a pool of pages, shuffled: (pool [B*S/page, page, Hkv, D], block_table [B, S/page])."""
    batch, seqlen = k.shape[:2]
    if seqlen % page_size:
        raise Unsupported(f"kv {seqlen} is not a multiple of the page size {page_size}")
    n = batch * seqlen // page_size
    perm = torch.randperm(n, generator=gen, device="cpu").to(k.device)
    pool = torch.empty((n, page_size) + tuple(k.shape[2:]), dtype=k.dtype, device=k.device)
    pool[perm] = k.reshape((n, page_size) + tuple(k.shape[2:]))
    return pool, perm.view(batch, seqlen // page_size).to(torch.int32)


def flashtile_paged(page_size):
    def make(q, k, v, num_splits=0):
        from flashtile.kvcache import flash_attn_with_kvcache
        if not fits(2 * k.numel() * k.element_size()):
            raise Unsupported("the paged copy of the cache does not fit in memory")
        gen = torch.Generator().manual_seed(page_size)
        k_pool, table = to_paged(k, page_size, gen)
        v_pool, _ = to_paged(v, page_size, torch.Generator().manual_seed(page_size))
        seqlens = torch.full((q.shape[0],), k.shape[1], dtype=torch.int32, device=q.device)
        return lambda: flash_attn_with_kvcache(q, k_pool, v_pool, cache_seqlens=seqlens, block_table=table,
                                               num_splits=num_splits)
    return make


def sdpa(backend_name):
    def make(q, k, v, num_splits=0):
        from torch.nn.attention import SDPBackend, sdpa_kernel
        backend = getattr(SDPBackend, backend_name)
        qt = q.transpose(1, 2).contiguous()  # [B, Hq, 1, D]
        if not fits(2 * k.numel() * k.element_size()):
            raise Unsupported("SDPA's (B, H, S, D) copy of the cache does not fit in memory")
        kt, vt = k.transpose(1, 2).contiguous(), v.transpose(1, 2).contiguous()  # [B, Hkv, S, D], SDPA's layout

        def run_gqa():
            with sdpa_kernel(backend):
                return F.scaled_dot_product_attention(qt, kt, vt, enable_gqa=True).transpose(1, 2)
        try:
            run_gqa()
            torch.cuda.synchronize()
            return run_gqa
        except RuntimeError as exc:
            gqa_error = str(exc).splitlines()[0]
        # No native GQA on this backend: expand the kv heads (the benchmark still counts the real KV bytes only).
        group = HEADS // KV_HEADS
        if not fits(2 * group * kt.numel() * kt.element_size()):
            raise Unsupported(f"no native GQA ({gqa_error}) and the expanded heads do not fit in memory")
        return _sdpa_expanded(backend, backend_name, qt, kt.repeat_interleave(group, dim=1),
                              vt.repeat_interleave(group, dim=1))
    return make


def _sdpa_expanded(backend, backend_name, qt, ke, ve):
    from torch.nn.attention import sdpa_kernel

    def run_expanded():
        with sdpa_kernel(backend):
            return F.scaled_dot_product_attention(qt, ke, ve).transpose(1, 2)
    try:
        run_expanded()
    except RuntimeError as exc:
        raise Unsupported(f"{backend_name}: {str(exc).splitlines()[0]}") from None
    return run_expanded


def flash_attn_2(q, k, v, num_splits=0):
    try:
        from flash_attn import flash_attn_with_kvcache
    except ImportError as exc:
        raise Unsupported(f"flash_attn is not importable ({exc})") from None
    seqlens = torch.full((q.shape[0],), k.shape[1], dtype=torch.int32, device=q.device)
    return lambda: flash_attn_with_kvcache(q, k, v, cache_seqlens=seqlens, num_splits=num_splits)


PROVIDERS = {
    "flashtile": flashtile_contiguous,
    **{f"flashtile-paged{ps}": flashtile_paged(ps) for ps in PAGE_SIZES},
    "sdpa-cudnn": sdpa("CUDNN_ATTENTION"),
    "sdpa-flash": sdpa("FLASH_ATTENTION"),
    "fa2": flash_attn_2,
}


# ----------------------------------------------------------------------------------------------------------------
# Running


@dataclasses.dataclass
class Result:
    batch: int
    kv: int
    provider: str
    status: str  # "ok", "wrong", "unsupported", "error"
    ms: float | None = None
    kv_tbps: float | None = None
    copy_fraction: float | None = None
    max_err: float | None = None
    host_us: float | None = None
    note: str = ""


def reference_out(q, k, v):
    """fp32 attention of the first CHECK_BATCH sequences: [CHECK_BATCH, 1, Hq, D]."""
    n = min(CHECK_BATCH, q.shape[0])
    qf = q[:n].float().transpose(1, 2)  # [n, Hq, 1, D]
    kf = k[:n].float().transpose(1, 2).repeat_interleave(HEADS // KV_HEADS, dim=1)
    vf = v[:n].float().transpose(1, 2).repeat_interleave(HEADS // KV_HEADS, dim=1)
    p = torch.softmax(qf @ kf.mT / math.sqrt(HEAD_DIM), dim=-1)
    return (p @ vf).transpose(1, 2)


def run_shape(batch, kv_len, providers, copy_bps, progress=log):
    results = []
    need = 2 * kv_bytes(batch, kv_len)  # the cache itself, then each provider's copy of it
    if not fits(need):
        for name in providers:
            results.append(Result(batch, kv_len, name, "unsupported", note="the cache does not fit in memory"))
        return results
    gen = torch.Generator(device=DEVICE).manual_seed(batch * 100003 + kv_len)
    q = torch.randn((batch, 1, HEADS, HEAD_DIM), generator=gen, device=DEVICE).to(DTYPE)
    k = torch.randn((batch, kv_len, KV_HEADS, HEAD_DIM), generator=gen, device=DEVICE).to(DTYPE)
    v = torch.randn((batch, kv_len, KV_HEADS, HEAD_DIM), generator=gen, device=DEVICE).to(DTYPE)
    ref = reference_out(q, k, v)
    nbytes = kv_bytes(batch, kv_len)
    for name in providers:
        res = Result(batch, kv_len, name, "error")
        try:
            fn = PROVIDERS[name](q, k, v)
            out = fn()
            err = (out[:ref.shape[0]].float() - ref).abs().max().item()
            res.max_err = err
            res.ms = bench(fn)
            res.host_us = host_us(fn)
            res.kv_tbps = nbytes / (res.ms * 1e-3) / 1e12
            res.copy_fraction = nbytes / (res.ms * 1e-3) / copy_bps
            res.status = "ok" if err <= ATOL else "wrong"
            del fn, out
        except Unsupported as exc:
            res.status, res.note = "unsupported", str(exc)
        except (RuntimeError, ValueError, TypeError) as exc:
            res.note = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
        torch.cuda.empty_cache()
        progress(f"  B={batch:<3} kv={kv_len // 1024:>3}k {name:<20} {res.status:<11} "
                 + (f"{res.ms * 1e3:9.1f} us {res.kv_tbps:6.2f} TB/s ({res.copy_fraction:5.1%} of copy), host "
                    f"{res.host_us:.1f} us" if res.ms is not None else res.note))
        results.append(res)
    del q, k, v
    torch.cuda.empty_cache()
    return results


SWEEP_SPLITS = (1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 96, 128)


def sweep_tiles():
    from flashtile.kernels.configs import TileConfig
    return [TileConfig(64, bn, w, s) for bn in (64, 128, 256) for w in (4, 8) for s in (2, 3, 4)]


SWEEP_SHAPES = "1x4k,1x64k,8x16k,8x16kp16,8x16kp256,64x4k"


def parse_sweep_shapes(text):
    """"8x16kp16" -> (8, 16384, 16): batch x kv, optionally p<page size>."""
    shapes = []
    for item in text.split(","):
        batch, rest = item.strip().lower().split("x")
        kv, _, page = rest.partition("p")
        shapes.append((int(batch), parse_size(kv), int(page) if page else None))
    return shapes


@contextlib.contextmanager
def _decode_tiles(tile, page_slabs):
    """The split kernel limited to one tile, and the paged addressing chosen (SETTINGS.decode_tiles / page_slabs)."""
    from flashtile import _settings

    with _settings.override(decode_tiles=[tile], page_slabs=page_slabs):
        yield


def sweep(shapes, progress=log):
    """Split kernel tiles at num_splits=0, then num_splits for the best tile, per shape (batch, kv, page size or
    None), and for paged shapes the best tile with per-row addressing (page slabs off): what kernels/decode.py's
    tile table, split heuristic (SPLIT_TOLERANCE) and paged addressing should come from."""
    rows = []
    for batch, kv_len, page_size in shapes:
        if not fits(3 * kv_bytes(batch, kv_len)):
            progress(f"sweep: B={batch} kv={kv_len} does not fit; skipped")
            continue
        rows += _sweep_shape(batch, kv_len, page_size, progress)
        torch.cuda.empty_cache()
    return rows


def _sweep_shape(batch, kv_len, page_size, progress):
    from flashtile.kernels import configs
    from flashtile.kernels.configs import TileConfig
    gen = torch.Generator(device=DEVICE).manual_seed(batch + kv_len)
    q = torch.randn((batch, 1, HEADS, HEAD_DIM), generator=gen, device=DEVICE).to(DTYPE)
    k = torch.randn((batch, kv_len, KV_HEADS, HEAD_DIM), generator=gen, device=DEVICE).to(DTYPE)
    v = torch.randn((batch, kv_len, KV_HEADS, HEAD_DIM), generator=gen, device=DEVICE).to(DTYPE)
    make = flashtile_paged(page_size) if page_size else flashtile_contiguous
    nbytes = kv_bytes(batch, kv_len)
    label = f"B={batch} kv={kv_len} page={page_size}"

    def measure(tile, n_splits, slabs=True):
        row = dict(batch=batch, kv=kv_len, page_size=page_size, page_slabs=slabs, tile=dataclasses.asdict(tile),
                   num_splits=n_splits)
        try:
            with _decode_tiles(tile, slabs):
                ms = bench(make(q, k, v, num_splits=n_splits))
        except Exception as exc:  # noqa: BLE001 - a tile that does not fit is a result of the sweep (a row)
            row.update(status="error", note=f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}")
            return row
        compiled = [c for key, c in getattr(configs, "LAST_COMPILED", {}).items()
                    if key[0] == "decode" and key[-1] == (tile,) and c is not None]
        row.update(status="ok", ms=ms, kv_tbps=nbytes / (ms * 1e-3) / 1e12)
        if compiled:
            row.update(n_regs=getattr(compiled[-1], "n_regs", None), n_spills=getattr(compiled[-1], "n_spills", None))
        return row

    rows = [measure(t, 0) for t in sweep_tiles()]
    ok = [r for r in rows if r["status"] == "ok"]
    if not ok:
        return rows
    best = min(ok, key=lambda r: r["ms"])
    best_tile = TileConfig(**best["tile"])
    progress(f"sweep {label}: best tile {best_tile} {best['kv_tbps']:.2f} TB/s at auto splits")
    split_rows = [measure(best_tile, n) for n in SWEEP_SPLITS]
    ok = [r for r in split_rows if r["status"] == "ok"]
    if ok:
        b = min(ok, key=lambda r: r["ms"])
        progress(f"sweep {label}: best num_splits {b['num_splits']} {b['kv_tbps']:.2f} TB/s")
    if page_size:
        row = measure(best_tile, 0, slabs=False)
        split_rows.append(row)
        if row["status"] == "ok":
            progress(f"sweep {label}: per-row addressing {row['kv_tbps']:.2f} TB/s (slabs {best['kv_tbps']:.2f})")
    return rows + split_rows


# ----------------------------------------------------------------------------------------------------------------
# Host overhead without a GPU


def host_overhead_cpu(calls=3000, progress=log):
    """Microseconds of flashtile's Python per decode call on the CPU, kernel launches stubbed out (needs
    TRITON_INTERPRET=1). Returns {case: us}."""
    from flashtile.kernels import configs, decode
    from flashtile.kvcache import flash_attn_with_kvcache
    if not configs.INTERPRETING:
        raise SystemExit("--host-cpu needs TRITON_INTERPRET=1 (it stubs the interpreted kernels out)")

    class Stub:  # stands in for a kernel: same parameters, launching does nothing
        def __init__(self, kernel):
            self.arg_names = kernel.arg_names

        def __getitem__(self, grid):
            return lambda *args, **kwargs: None

    for name in ("_kvcache_split_kernel", "_kvcache_combine_kernel", "_kvcache_append_kernel"):
        setattr(decode, name, Stub(getattr(decode, name)))
    batch, kv_len = 1, 4096
    q = torch.randn(batch, 1, HEADS, HEAD_DIM, dtype=DTYPE)
    k = torch.randn(batch, kv_len, KV_HEADS, HEAD_DIM, dtype=DTYPE)
    v = torch.randn_like(k)
    seqlens = torch.full((batch,), kv_len, dtype=torch.int32)
    pool = k.view(batch * kv_len // 16, 16, KV_HEADS, HEAD_DIM)
    table = torch.arange(batch * kv_len // 16, dtype=torch.int32).view(batch, -1)
    k_new = torch.randn(batch, 1, KV_HEADS, HEAD_DIM, dtype=DTYPE)
    cos = torch.randn(kv_len, HEAD_DIM // 2, dtype=DTYPE)
    cases = {
        "decode, contiguous (2 launches)": lambda: flash_attn_with_kvcache(q, k, v, cache_seqlens=seqlens),
        "decode, paged 16": lambda: flash_attn_with_kvcache(q, pool, pool, cache_seqlens=seqlens, block_table=table),
        "decode, num_splits=1 (1 launch)": lambda: flash_attn_with_kvcache(q, k, v, cache_seqlens=seqlens,
                                                                           num_splits=1),
        "append + rotary + causal, int seqlens (3 launches)": lambda: flash_attn_with_kvcache(
            q, k, v, k_new, k_new, cos, cos, cache_seqlens=kv_len - 1, causal=True),
    }
    result = {}
    for name, fn in cases.items():
        for _ in range(200):
            fn()
        best = float("inf")
        for _ in range(5):
            start = time.perf_counter()
            for _ in range(calls):
                fn()
            best = min(best, (time.perf_counter() - start) / calls * 1e6)
        result[name] = best
        progress(f"  {name:<52} {best:6.1f} us per call")
    return result


# ----------------------------------------------------------------------------------------------------------------
# Report


def _index(results):
    return {(r.batch, r.kv, r.provider): r for r in results}


def format_table(results, providers, copy_bps):
    by = _index(results)
    lines = [f"device copy bandwidth {copy_bps / 1e12:.2f} TB/s (read + write); KV TB/s counts K and V bytes; "
             f"x cuDNN = cuDNN time / provider time; paged/contig = paged time / contiguous time; host us = host "
             f"time per call",
             f"{'batch':>5} {'kv':>5}  {'provider':<20} {'us':>9} {'KV TB/s':>8} {'x copy':>7} {'x cuDNN':>8} "
             f"{'paged/contig':>12} {'host us':>8}"]
    shapes = sorted({(r.batch, r.kv) for r in results})
    for batch, kv_len in shapes:
        cudnn = by.get((batch, kv_len, "sdpa-cudnn"))
        contig = by.get((batch, kv_len, "flashtile"))
        for name in providers:
            r = by.get((batch, kv_len, name))
            if r is None:
                continue
            if r.ms is None:
                lines.append(f"{batch:>5} {kv_len // 1024:>4}k  {name:<20} {r.status}: {r.note}")
                continue
            vs = f"{cudnn.ms / r.ms:8.2f}" if cudnn is not None and cudnn.ms is not None else f"{'-':>8}"
            pc = f"{r.ms / contig.ms:12.3f}" if name.startswith("flashtile-paged") and contig and contig.ms \
                else f"{'':>12}"
            flag = "" if r.status == "ok" else f"  ({r.status}: max err {r.max_err:.2e})"
            host = f"{r.host_us:8.1f}" if r.host_us is not None else f"{'-':>8}"
            lines.append(f"{batch:>5} {kv_len // 1024:>4}k  {name:<20} {r.ms * 1e3:9.1f} {r.kv_tbps:8.2f} "
                         f"{r.copy_fraction:7.1%} {vs} {pc} {host}{flag}")
    return "\n".join(lines)


def check_bars(results):
    """The issue's speed bars, each as (description, passed or None when not measured, detail)."""
    by = _index(results)
    bars = []
    shapes = sorted({(r.batch, r.kv) for r in results})

    def ok(r):
        return r is not None and r.status == "ok"

    for batch, kv_len in shapes:
        ft = by.get((batch, kv_len, "flashtile"))
        if batch == 8 and kv_len >= 16384:
            bars.append((f"B=8 kv={kv_len // 1024}k: KV bandwidth >= {BAR_COPY_FRACTION:.0%} of copy",
                         ok(ft) and ft.copy_fraction >= BAR_COPY_FRACTION if ok(ft) else None,
                         f"{ft.copy_fraction:.1%}" if ok(ft) else "not measured"))
        cudnn = by.get((batch, kv_len, "sdpa-cudnn"))
        if ok(ft) and ok(cudnn):
            bars.append((f"B={batch} kv={kv_len // 1024}k: >= {BAR_VS_CUDNN:.1f}x cuDNN",
                         cudnn.ms / ft.ms >= BAR_VS_CUDNN, f"{cudnn.ms / ft.ms:.2f}x"))
        for ps in PAGE_SIZES:
            paged = by.get((batch, kv_len, f"flashtile-paged{ps}"))
            if ok(ft) and ok(paged):
                bars.append((f"B={batch} kv={kv_len // 1024}k: paged {ps} within {BAR_PAGED_SLOWDOWN - 1:.0%} of "
                             f"contiguous", paged.ms <= BAR_PAGED_SLOWDOWN * ft.ms, f"{paged.ms / ft.ms:.3f}"))
    return bars


def metadata(argv):
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "gpu": torch.cuda.get_device_name(),
        "gpu_capability": ".".join(map(str, torch.cuda.get_device_capability())),
        "sm_count": torch.cuda.get_device_properties(0).multi_processor_count,
        "torch": torch.__version__,
        "triton": dist_version("triton"),
        "flash_attn": dist_version("flash_attn", "flash-attn"),
        "cuda": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None,
        "python": platform.python_version(),
        # The GPU machines get the working tree without .git: pass FLASHTILE_COMMIT there.
        "flashtile_commit": commit(),
        "shape": f"bf16, headdim {HEAD_DIM}, Hq {HEADS}, Hkv {KV_HEADS}, q_len 1, every sequence at the full length",
        "timing": "median of triton.testing.do_bench (L2 cleared before each call)",
        "bytes": "KV bytes = B * kv * Hkv * D * 2 (K and V) * 2 bytes; copy = 2 * 1 GiB per copy_ (read + write)",
        "check": f"out of the first {CHECK_BATCH} sequences vs fp32 attention, max abs diff <= {ATOL:g}",
        "argv": argv,
    }


def parse_size(text):
    text = text.strip().lower()
    return int(text[:-1]) * 1024 if text.endswith("k") else int(text)


def build_parser(prog=None):
    p = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 1)[1],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=DEFAULT_OUT, metavar="DIR", help=f"results folder (default ./{DEFAULT_OUT})")
    p.add_argument("--batch", default=",".join(map(str, BATCHES)), help="comma-separated batch sizes")
    p.add_argument("--kv", default="4k,16k,64k", help="comma-separated cache lengths, e.g. 4k,16k")
    p.add_argument("--providers", default=",".join(PROVIDERS), help=f"subset of {','.join(PROVIDERS)}")
    p.add_argument("--sweep", action="store_true", help="also sweep the split kernel's tiles and num_splits")
    p.add_argument("--sweep-only", action="store_true", help="only the sweep (no table)")
    p.add_argument("--sweep-shapes", default=SWEEP_SHAPES, help="batch x kv [p page size], comma-separated")
    p.add_argument("--host-cpu", action="store_true", help="host microseconds per call on the CPU (see above)")
    return p


def main(argv=None, prog=None):
    """Run the decode benchmark; returns the exit status: 1 when a flashtile row is wrong or an error, 2 without a
    GPU or for bad arguments."""
    args = build_parser(prog).parse_args(argv)
    if args.host_cpu:
        host_overhead_cpu()
        return 0
    if not torch.cuda.is_available():
        log("error: no CUDA device; the decode benchmark runs on a GPU (--host-cpu does not)")
        return 2
    providers = [n.strip() for n in args.providers.split(",") if n.strip()]
    unknown = [n for n in providers if n not in PROVIDERS]
    if unknown:
        log(f"unknown providers {unknown}; known: {list(PROVIDERS)}")
        return 2
    batches = [int(b) for b in args.batch.split(",")]
    kvs = [parse_size(s) for s in args.kv.split(",")]
    meta = metadata(sys.argv[1:] if argv is None else list(argv))
    suffix = "decode-sweep" if args.sweep_only else "decode"
    out_path = result_path(args.out, meta["gpu"], suffix, meta["date"][:10])

    copy_bps, copy_ms = copy_bandwidth()
    log(f"{meta['gpu']}: device copy {copy_bps / 1e12:.2f} TB/s ({copy_ms * 1e3:.0f} us per 1 GiB copy_)")
    results = []
    if not args.sweep_only:
        for batch in batches:
            for kv_len in kvs:
                results += run_shape(batch, kv_len, providers, copy_bps)
    sweep_rows = []
    if args.sweep or args.sweep_only:
        sweep_rows = sweep(parse_sweep_shapes(args.sweep_shapes))
    bars = check_bars(results)
    payload = {"metadata": meta, "copy_bandwidth_bytes_per_s": copy_bps,
               "results": [dataclasses.asdict(r) for r in results],
               "bars": [dict(bar=b, passed=ok, value=v) for b, ok, v in bars], "sweep": sweep_rows}
    out_path.parent.mkdir(parents=True, exist_ok=True)
    out_path.write_text(json.dumps(payload, indent=1) + "\n")
    print(format_table(results, providers, copy_bps))
    print("\nbars:")
    for bar, passed, value in bars:
        print(f"  {'PASS' if passed else 'FAIL' if passed is False else 'n/a '}  {bar}: {value}")
    log(f"wrote {out_path}")
    wrong = [r for r in results if r.provider.startswith("flashtile") and r.status in ("wrong", "error")]
    return 1 if wrong else 0


if __name__ == "__main__":
    sys.exit(main())
