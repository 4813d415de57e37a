"""compute-sanitizer over flashtile's kernels (docs/safety.md): memcheck, racecheck and initcheck, one process per
(tool, case), logs and a summary in one folder.

    python benchmarks/sanitize.py                                   # every tool x case, after a warm-up pass
    python benchmarks/sanitize.py --tools memcheck --cases decode,bad-kv-block-table
    python benchmarks/sanitize.py --jobs 8                          # 8 runs at once over the visible GPUs
    python benchmarks/sanitize.py --list
    python benchmarks/sanitize.py --case fwd-portable               # one case without the sanitizer (debugging)

Cases (small shapes: the sanitizer slows kernels 10-100x):
- attn-portable-*/attn-gluon-*: forward and backward of the portable Triton kernels (Gluon off) and of the Hopper
  Gluon ones (skipped off sm_90): plain,
  causal, sliding window with softcap and ALiBi, sinks, dropout, GQA, a float attn_mask with its gradient, a bool
  mask, varlen with zero-length sequences.
- decode-*: flash_attn_with_kvcache: contiguous and paged caches, split-KV with the combine, append with rotary,
  leftpad, cache_batch_idx, an fp8 cache.
- attn-portable-*-notma: the portable cases with plain loads and stores in place of TMA (SETTINGS.tma off).
- control-tma-store / control-plain-store (Hopper): a tile written by a TMA store or by plain stores, then read
  back; every byte read was written, so initcheck reports on the first and not the second mean it does not see
  TMA's writes (reads of TMA-written outputs, and of device-made TMA descriptors, are then not the kernels' fault).
- bad-*: bad index values on CUDA tensors with the full check off (the default): varlen offsets that decrease, go
  negative or end past the rows; cache lengths past the capacity or negative; leftpad negative; cache_batch_idx
  and block_table entries out of range. The kernels must clamp: no access outside the tensors, and (checked by the
  case itself, exit 3) the sequences without a bad value keep their exact results and cache rows. These need the
  kernel-side clamps of docs/safety.md section 3.

PYTORCH_NO_CUDA_MEMORY_CACHING=1 gives every tensor its own allocation, so memcheck sees an access past a tensor's
end (inside the caching allocator's pool it would not). The warm-up pass fills Triton's cache without the sanitizer,
so the sanitized runs do not compile. Output: benchmarks/results/<date>-<gpu>-sanitizer/<tool>-<case>.log and
summary.json / summary.txt (errors per tool and case, exit codes). Exit status 1 when any run reports an error.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TOOLS = ("memcheck", "racecheck", "initcheck")
# The cases' device: "cuda"; SANITIZE_DEVICE=cpu runs them in Triton's interpreter (a smoke test of the script).
DEVICE = os.environ.get("SANITIZE_DEVICE", "cuda")
# Extra options per tool: racecheck reports hazards in shared memory; initcheck flags reads of global memory no one
# wrote (an output row a kernel leaves unwritten and a later kernel reads).
TOOL_OPTIONS = {"memcheck": ["--leak-check", "no"], "racecheck": ["--racecheck-report", "all"], "initcheck": []}


# ----------------------------------------------------------------------------------------------------------------
# Cases (run inside the sanitized process)


def _sync():
    import torch
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def _qkv(b, sq, sk, h, hk, d, dtype, grad=True, seed=0):
    import torch
    gen = torch.Generator(DEVICE).manual_seed(seed)
    return [torch.randn(shape, device=DEVICE, generator=gen).to(dtype).requires_grad_(grad)
            for shape in ((b, sq, h, d), (b, sk, hk, d), (b, sk, hk, d))]


def _fwd_bwd(fn):
    import torch
    out = fn()
    out = out[0] if isinstance(out, tuple) else out
    out.backward(torch.randn_like(out))
    return out


def _attention_cases(gluon):
    import torch
    import flashtile
    dtype = torch.bfloat16
    d = 128 if gluon else 64

    def plain():
        q, k, v = _qkv(2, 300, 300, 4, 2, d, dtype)
        _fwd_bwd(lambda: flashtile.flash_attn_func(q, k, v))

    def causal_features():
        q, k, v = _qkv(1, 257, 384, 4, 1, d, dtype)
        slopes = torch.rand(4, device=DEVICE)
        _fwd_bwd(lambda: flashtile.flash_attn_func(q, k, v, causal=True, window_size=(100, 0), softcap=20.0,
                                                   alibi_slopes=slopes))

    def sinks_dropout():
        q, k, v = _qkv(1, 200, 333, 4, 4, d, dtype)
        sinks = torch.randn(4, device=DEVICE, requires_grad=True)
        _fwd_bwd(lambda: flashtile.flash_attn_func(q, k, v, causal=True, dropout_p=0.1, sinks=sinks))

    def masks():
        q, k, v = (t.transpose(1, 2) for t in _qkv(1, 256, 320, 4, 4, d, dtype))
        bias = torch.randn(1, 4, 256, 320, device=DEVICE, dtype=dtype, requires_grad=True)
        _fwd_bwd(lambda: flashtile.scaled_dot_product_attention(q, k, v, attn_mask=bias))
        keep = torch.rand(1, 1, 256, 320, device=DEVICE) > 0.3
        _fwd_bwd(lambda: flashtile.scaled_dot_product_attention(q, k, v, attn_mask=keep))

    def varlen():
        lens = [100, 0, 257, 3, 0, 64]
        total = sum(lens)
        q, k, v = (x[0] for x in _qkv(1, total, total, 4, 2, d, dtype, grad=False))
        q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
        cu = torch.tensor([0] + [sum(lens[:i + 1]) for i in range(len(lens))], device=DEVICE, dtype=torch.int32)
        _fwd_bwd(lambda: flashtile.flash_attn_varlen_func(q, k, v, cu, cu, max(lens), max(lens), causal=True))

    kind = "gluon" if gluon else "portable"
    table = {f"attn-{kind}-plain": plain, f"attn-{kind}-causal-window-softcap-alibi": causal_features,
             f"attn-{kind}-sinks-dropout": sinks_dropout, f"attn-{kind}-masks": masks, f"attn-{kind}-varlen": varlen}
    if not gluon:
        # The portable kernels with plain loads and stores instead of TMA (run_case sets SETTINGS.tma from the
        # name): what initcheck reports there, it reports about the kernels' own accesses.
        table.update({f"{name}-notma": fn for name, fn in table.items()})
    return table


def _control_cases():
    """initcheck's view of TMA: one Triton kernel writes a tile through a tensor descriptor (a TMA store on
    Hopper) or through plain stores, a second reads it with plain loads. Every byte read was written, so any
    report on control-tma-store and none on control-plain-store says the tool does not see TMA's writes."""
    import torch
    import triton
    import triton.language as tl

    @triton.jit
    def write(Src, Dst, TMA: tl.constexpr, BLOCK: tl.constexpr):
        o = tl.arange(0, BLOCK)
        tile = tl.load(Src + o[:, None] * BLOCK + o[None, :])
        if TMA:
            desc = tl.make_tensor_descriptor(Dst, [BLOCK, BLOCK], [BLOCK, 1], [BLOCK, BLOCK])
            desc.store([0, 0], tile)
        else:
            tl.store(Dst + o[:, None] * BLOCK + o[None, :], tile)

    @triton.jit
    def read(Src, Out, BLOCK: tl.constexpr):
        o = tl.arange(0, BLOCK)
        tl.store(Out + o, tl.sum(tl.load(Src + o[:, None] * BLOCK + o[None, :]).to(tl.float32), 1))

    def run(tma):
        triton.set_allocator(lambda size, align, stream: torch.empty(size, dtype=torch.int8, device=DEVICE))
        src = torch.randn(64, 64, device=DEVICE, dtype=torch.bfloat16)
        dst = torch.empty_like(src)
        out = torch.empty(64, device=DEVICE)
        write[(1,)](src, dst, TMA=tma, BLOCK=64)
        read[(1,)](dst, out, BLOCK=64)
        torch.testing.assert_close(out, src.float().sum(1), rtol=1e-2, atol=1e-2)

    return {"control-tma-store": lambda: run(True), "control-plain-store": lambda: run(False)}


def _cache(batch=3, capacity=256, page=None, dtype=None, seed=1):
    import torch
    dtype = dtype or torch.bfloat16
    gen = torch.Generator(DEVICE).manual_seed(seed)
    q = torch.randn(batch, 2, 8, 128, device=DEVICE, generator=gen).to(dtype)
    if page is None:
        shape = (batch + 1, capacity, 2, 128)
        table = None
    else:
        shape = (batch * capacity // page + 2, page, 2, 128)
        table = torch.randperm(shape[0], device=DEVICE, generator=gen)[:batch * capacity // page].view(batch, -1)
        table = table.to(torch.int32)
    k_cache = torch.randn(shape, device=DEVICE, generator=gen).to(dtype)
    v_cache = torch.randn(shape, device=DEVICE, generator=gen).to(dtype)
    k, v = (torch.randn(batch, 2, 2, 128, device=DEVICE, generator=gen).to(dtype) for _ in range(2))
    seqlens = torch.tensor([0, 100, 254][:batch], device=DEVICE, dtype=torch.int32)
    return q, k_cache, v_cache, k, v, seqlens, table


def _decode_cases():
    import torch
    import flashtile

    def contiguous():
        q, kc, vc, k, v, seqlens, _ = _cache()
        for splits in (0, 1, 3):
            flashtile.flash_attn_with_kvcache(q, kc, vc, k, v, cache_seqlens=seqlens, num_splits=splits,
                                              cache_batch_idx=torch.tensor([3, 0, 1], device=DEVICE,
                                                                           dtype=torch.int32))

    def paged_rotary():
        q, kc, vc, k, v, seqlens, table = _cache(page=16)
        cos, sin = torch.rand(258, 32, device=DEVICE), torch.rand(258, 32, device=DEVICE)
        flashtile.flash_attn_with_kvcache(q, kc, vc, k, v, cos, sin, cache_seqlens=seqlens, block_table=table,
                                          causal=True)

    def leftpad_window():
        q, kc, vc, k, v, seqlens, _ = _cache()
        pad = torch.tensor([0, 50, 200], device=DEVICE, dtype=torch.int32)
        flashtile.flash_attn_with_kvcache(q, kc[:3], vc[:3], k, v, cache_seqlens=seqlens, cache_leftpad=pad,
                                          window_size=(30, 0), causal=True, softcap=10.0)

    def fp8():
        q, kc, vc, k, v, seqlens, table = _cache(page=64)
        descale = torch.rand(3, 2, device=DEVICE) + 0.5
        flashtile.flash_attn_with_kvcache(q, kc.to(torch.float8_e4m3fn), vc.to(torch.float8_e4m3fn), k, v,
                                          cache_seqlens=seqlens, block_table=table, k_descale=descale,
                                          v_descale=descale)

    return {"decode-contiguous-splits-batch-idx": contiguous, "decode-paged-rotary": paged_rotary,
            "decode-leftpad-window": leftpad_window, "decode-fp8-paged": fp8}


def _isolated(good, bad, keep):
    """bad() must leave the entries `keep` selects of its results (out, caches) equal to good()'s."""
    import torch
    for name, g, b in zip(("out", "k_cache", "v_cache"), good(), bad()):
        if not torch.equal(keep(name, g), keep(name, b)):
            print(f"ISOLATION FAIL: {name} of a sequence without a bad value changed", flush=True)
            sys.exit(3)


def _bad_kv(change, sequence=1):
    """A decode call where sequence `sequence` gets a bad index value: the others' outputs and cache rows must match
    the valid call's."""
    import flashtile

    def run(bad):
        q, kc, vc, k, v, seqlens, table = _cache(page=16 if "block_table" in change else None)
        kw = dict(cache_seqlens=seqlens, block_table=table)
        if table is None:
            kc, vc = kc[:3], vc[:3]
        if bad:
            for name, fn in change.items():
                kw[name] = fn(kw.get(name), kc)
        out = flashtile.flash_attn_with_kvcache(q, kc, vc, k, v, **{n: t for n, t in kw.items() if t is not None})
        _sync()
        return out, kc, vc, table

    good, bad = run(False), run(True)
    others = [b for b in range(3) if b != sequence]
    _isolated(lambda: good[:3], lambda: bad[:3],
              lambda name, t: t[others] if name == "out" or good[3] is None else t[good[3][others].flatten().long()])


def _bad_varlen(make_cu):
    """Varlen with bad offsets from make_cu(good offsets): no access outside the tensors; with end-after-rows, the
    sequences before the last keep their rows."""
    import torch
    import flashtile
    lens = [100, 37, 64]
    total = sum(lens)
    q, k, v = (torch.randn(total, 4, 64, device=DEVICE, dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    cu = torch.tensor([0, 100, 137, 201], device=DEVICE, dtype=torch.int32)
    # max_seqlen = all the rows: every row a clamped sequence holds is computed, so initcheck sees no output row
    # left unwritten (a max_seqlen below a sequence's length leaves its last rows uncomputed by design).
    good = flashtile.flash_attn_varlen_func(q, k, v, cu, cu, total, total, causal=True)
    bad_cu = make_cu(cu.clone())
    out = flashtile.flash_attn_varlen_func(q, k, v, bad_cu, bad_cu, total, total, causal=True)
    out.backward(torch.randn_like(out))
    _sync()
    return good, out


def _bad_cases():
    import torch

    def varlen_end_after():
        good, out = _bad_varlen(lambda cu: cu.index_fill_(0, torch.tensor([3], device=DEVICE), 10 ** 6))
        if not torch.equal(good[:137], out[:137]):
            print("ISOLATION FAIL: sequences before the bad last offset changed", flush=True)
            sys.exit(3)

    def at(index, value):
        return lambda t, cache: t.index_fill(0, torch.tensor([index], device=DEVICE), value)

    return {
        "bad-varlen-decreasing": lambda: _bad_varlen(lambda cu: cu.index_fill_(0, torch.tensor([1], device=DEVICE),
                                                                               180)),
        "bad-varlen-negative": lambda: _bad_varlen(lambda cu: cu.index_fill_(0, torch.tensor([2], device=DEVICE),
                                                                             -50)),
        "bad-varlen-end-after-rows": varlen_end_after,
        "bad-kv-seqlens-past-capacity": lambda: _bad_kv({"cache_seqlens": at(1, 10 ** 6)}),
        "bad-kv-seqlens-negative": lambda: _bad_kv({"cache_seqlens": at(1, -1000)}),
        "bad-kv-leftpad-negative": lambda: _bad_kv({"cache_leftpad": lambda t, cache: torch.tensor(
            [0, -500, 0], device=DEVICE, dtype=torch.int32)}),
        "bad-kv-batch-idx-out-of-range": lambda: _bad_kv({"cache_batch_idx": lambda t, cache: torch.tensor(
            [0, 10 ** 6, 2], device=DEVICE, dtype=torch.int32)}),
        "bad-kv-batch-idx-negative": lambda: _bad_kv({"cache_batch_idx": lambda t, cache: torch.tensor(
            [0, -3, 2], device=DEVICE, dtype=torch.int32)}),
        "bad-kv-block-table-out-of-range": lambda: _bad_kv({"block_table": lambda t, cache: torch.where(
            torch.arange(t.numel(), device=DEVICE).view(t.shape) == t.shape[1] + 3, 10 ** 6, t).to(torch.int32)}),
        "bad-kv-block-table-negative": lambda: _bad_kv({"block_table": lambda t, cache: torch.where(
            torch.arange(t.numel(), device=DEVICE).view(t.shape) == t.shape[1] + 1, -7, t).to(torch.int32)}),
    }


def cases():
    """name -> (function, needs Hopper)."""
    table = {name: (fn, False) for name, fn in _attention_cases(gluon=False).items()}
    table.update({name: (fn, True) for name, fn in _attention_cases(gluon=True).items()})
    table.update({name: (fn, False) for name, fn in _decode_cases().items()})
    table.update({name: (fn, False) for name, fn in _bad_cases().items()})
    table.update({name: (fn, True) for name, fn in _control_cases().items()})
    return table


def run_case(name):
    import torch
    from flashtile._settings import SETTINGS
    fn, hopper = cases()[name]
    SETTINGS.gluon_forward = SETTINGS.gluon_backward = "-gluon-" in name
    SETTINGS.check_values = False
    if name.endswith("-notma"):
        SETTINGS.tma = False
    if hopper and (DEVICE != "cuda" or torch.cuda.get_device_capability()[0] != 9):
        print(f"SKIP {name}: needs a Hopper GPU", flush=True)
        return
    fn()
    _sync()
    print(f"OK {name}", flush=True)


# ----------------------------------------------------------------------------------------------------------------
# Driver


def _errors(log_text):
    """The error count of a sanitizer log: memcheck and initcheck's ERROR SUMMARY, racecheck's RACECHECK SUMMARY
    (errors and warnings both count as hazards). None when the log has no summary (a run that died)."""
    found = re.findall(r"ERROR SUMMARY: (\d+) error", log_text)
    if found:
        return int(found[-1])
    found = re.findall(r"RACECHECK SUMMARY: \d+ hazards? displayed \((\d+) errors?, (\d+) warnings?\)", log_text)
    return sum(map(int, found[-1])) if found else None


def _sites(log_text, top=5):
    """Where a log's reports point: [(count, "kernel+offset in file:line")], most frequent first (the first five)."""
    counts = {}
    for site in re.findall(r"=========\s+at (\S+ in \S+)", log_text):
        counts[site] = counts.get(site, 0) + 1
    return sorted(((n, site) for site, n in counts.items()), reverse=True)[:top]


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tools", default=",".join(TOOLS))
    p.add_argument("--cases", default="all", help="comma-separated names or prefixes (default all)")
    p.add_argument("--out", type=Path)
    p.add_argument("--sanitizer", default="compute-sanitizer")
    p.add_argument("--timeout", type=int, default=1800, help="seconds per sanitized run")
    p.add_argument("--jobs", type=int, default=1, help="runs at once, spread over the visible GPUs")
    p.add_argument("--list", action="store_true")
    p.add_argument("--case", help="run one case in this process, without the sanitizer")
    args = p.parse_args(argv)
    if args.case:
        run_case(args.case)
        return 0
    names = list(cases())
    if args.cases != "all":
        wanted = args.cases.split(",")
        names = [n for n in names if any(n == w or n.startswith(w) for w in wanted)]
    if args.list:
        print("\n".join(names))
        return 0
    import torch
    gpu = torch.cuda.get_device_name()
    slug = "".join(c if c.isalnum() else "-" for c in gpu.lower().replace("nvidia", "")).strip("-")
    out = args.out or REPO / "benchmarks" / "results" / f"{datetime.date.today().isoformat()}-{slug}-sanitizer"
    out.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, PYTORCH_NO_CUDA_MEMORY_CACHING="1",
               PYTHONPATH=os.pathsep.join([str(REPO)] + [os.environ["PYTHONPATH"]] * ("PYTHONPATH" in os.environ)))
    me = [sys.executable, str(Path(__file__).resolve())]
    summary = dict(gpu=gpu, torch=torch.__version__, date=datetime.datetime.now().isoformat(), runs=[])
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    gpu_ids = visible.split(",") if visible else [str(i) for i in range(torch.cuda.device_count())]

    def launch(job):
        """One run: (tool, case), tool "none" = the warm-up without the sanitizer. Jobs spread over the GPUs."""
        index, (tool, name) = job
        run_env = dict(env, CUDA_VISIBLE_DEVICES=gpu_ids[index % len(gpu_ids)]) if args.jobs > 1 else env
        log = out / f"{tool}-{name}.log"
        cmd = me + ["--case", name]
        if tool != "none":
            cmd = [args.sanitizer, "--tool", tool, *TOOL_OPTIONS[tool], "--log-file", str(log), *cmd]
        start = time.time()
        try:
            proc = subprocess.run(cmd, env=run_env, capture_output=True, text=True, timeout=args.timeout)
            code, tail = proc.returncode, (proc.stdout + proc.stderr)[-400:].strip()
        except subprocess.TimeoutExpired:
            code, tail = "timeout", ""
        text = log.read_text() if tool != "none" and log.exists() else ""
        errors, sites = (_errors(text), _sites(text)) if text else (None, [])
        print(f"{tool:<10} {name:<45} exit {code} errors {errors}", file=sys.stderr)
        return dict(tool=tool, case=name, exit=code, errors=errors, sites=sites, seconds=round(time.time() - start, 1),
                    note=tail)

    from concurrent.futures import ThreadPoolExecutor
    with ThreadPoolExecutor(max(1, args.jobs)) as pool:
        # The warm-up compiles every kernel once outside the sanitizer (Triton's cache then serves the runs).
        summary["runs"] += list(pool.map(launch, enumerate(("none", n) for n in names)))
        summary["runs"] += list(pool.map(launch, enumerate((t, n) for t in args.tools.split(",") for n in names)))
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    lines = [f"{r['tool']:<10} {r['case']:<45} exit {r['exit']!s:<8} errors {r['errors']}"
             + "".join(f"\n    {n:>6} at {site}" for n, site in r.get("sites", [])) for r in summary["runs"]]
    (out / "summary.txt").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    bad = [r for r in summary["runs"] if r["tool"] != "none" and (r["errors"] or r["exit"] not in (0,))]
    print(f"{len(bad)} of {len([r for r in summary['runs'] if r['tool'] != 'none'])} sanitized runs with errors or "
          f"a nonzero exit; logs in {out}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
