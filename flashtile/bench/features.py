"""What each attention feature costs against the plain kernel, in one run on one GPU.

    python -m flashtile bench features [--out DIR] [--seqlen 16384 --heads 16 --head-dim 128] [--fwd-only]

bf16, head dim 128, 16 heads, seqlen 16k, batch 1 by default. For each feature: forward and forward + backward time
(median of triton.testing.do_bench) next to the plain kernel with the same causal setting, and the cost = time /
plain time - 1. A cost is measured in pairs: the row and its plain kernel are timed alternately, ROUNDS times each,
and the cost compares their medians, since the GPU's clock drifts as it warms (the first timing of a process can
read ~10% faster than the same kernel a minute later), and a plain time taken once at the start would charge that
drift to every row after it. Paged prefill (forward only) is paired with the same keys contiguous (both on the
default kernels: Gluon on Hopper). Sliding windows are reported as speedups over full attention. Varlen runs random
lengths summing to the seqlen and is compared by TFLOP/s (its work is sum(len^2), not seqlen^2) with the plain
kernel at the full length and at the mean length, also with both replayed from CUDA graphs (their calls are short
enough for do_bench to measure the host). A float bias is also timed on torch SDPA's cuDNN backend, against its
own plain call: the peer's cost. Writes <date>-<gpu>-features.json to --out (numbered rather than overwrite).
"""
from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
from pathlib import Path

import torch

import flashtile

from .runner import DEFAULT_OUT, commit, result_path

DEVICE = "cuda"
DTYPE = torch.bfloat16
ROUNDS = 3


def _time(fn, rep=100):
    import triton.testing
    return triton.testing.do_bench(fn, warmup=25, rep=rep, return_mode="median")


def _graph_time(fn):
    """Median time of fn replayed from a CUDA graph (no host time between calls)."""
    import triton.testing
    return triton.testing.do_bench_cudagraph(fn, rep=200, return_mode="median")


def _paired(fn, base_fn):
    """(median of fn's times, median of base_fn's) over ROUNDS alternations: adjacent in time, so both see the
    same clock. Each runs once first, and the compiles the first calls left in the background finish, before any
    timing (_ahead.wait_for_compiles)."""
    from .._ahead import wait_for_compiles
    base_fn(), fn()
    wait_for_compiles()
    times, base_times = [], []
    for _ in range(ROUNDS):
        base_times.append(_time(base_fn, rep=200))
        times.append(_time(fn, rep=200))
    return statistics.median(times), statistics.median(base_times)


def _fwd_bwd(fn, inputs):
    out = fn()
    grad = torch.randn_like(out)

    def run():
        o = fn()
        torch.autograd.grad(o, inputs, grad)
    return run


def _inputs(b, s, h, d, grad=True):
    gen = torch.Generator(DEVICE).manual_seed(0)
    return [torch.randn((b, s, h, d), generator=gen, device=DEVICE, dtype=DTYPE).requires_grad_(grad)
            for _ in range(3)]


def _flops(b, h, sq, sk, d, causal):
    return 4 * b * h * sq * sk * d * (0.5 if causal else 1.0)


class _Table:
    """The rows measured so far; each row's calls are kept as a later row's base."""

    def __init__(self, backward):
        self.backward = backward
        self.rows = []
        self.calls = {}  # row name -> (forward, forward + backward or None)

    def measure(self, name, fn, inputs, base=None, flops=None, bwd=True):
        """Time fn (forward, and forward + backward over inputs), paired with base's calls when base is given."""
        bwd = bwd and self.backward
        fb = _fwd_bwd(fn, list(inputs)) if bwd else None
        self.calls[name] = (fn, fb)
        row = dict(name=name)
        if base is None:
            row["fwd_ms"] = _time(fn)
            row["fwd_bwd_ms"] = _time(fb) if bwd else None
        else:
            # Paired with the base's own calls (_paired); the base's times from these pairs are kept beside.
            base_fn, base_fb = self.calls[base["name"]]
            row["vs"] = base["name"]
            row["fwd_ms"], row["base_fwd_ms"] = _paired(fn, base_fn)
            row["fwd_cost"] = row["fwd_ms"] / row["base_fwd_ms"] - 1
            row["fwd_bwd_ms"] = None
            if bwd and base_fb is not None:
                row["fwd_bwd_ms"], row["base_fwd_bwd_ms"] = _paired(fb, base_fb)
                row["fwd_bwd_cost"] = row["fwd_bwd_ms"] / row["base_fwd_bwd_ms"] - 1
            elif bwd:
                row["fwd_bwd_ms"] = _time(fb)
        if flops is not None:
            row["fwd_tflops"] = flops / row["fwd_ms"] * 1e-9
            if row["fwd_bwd_ms"] is not None:
                row["fwd_bwd_tflops"] = 3.5 * flops / row["fwd_bwd_ms"] * 1e-9
        self.rows.append(row)
        print(_fmt(row), flush=True)
        return row


def _score_rows(table, q, k, v, full, causal):
    """Windows, softcap, ALiBi, sinks and dropout through flash_attn_func (q, k, v: [1, S, H, D])."""
    _, s, h, d = q.shape
    for w in (1024, 4096):
        row = table.measure(f"causal + window {w}", lambda: flashtile.flash_attn_func(
            q, k, v, causal=True, window_size=(w, 0)), (q, k, v))
        row["speedup_vs_full"] = full["fwd_ms"] / row["fwd_ms"]
        row["speedup_vs_causal"] = causal["fwd_ms"] / row["fwd_ms"]
        if table.backward:
            row["fwd_bwd_speedup_vs_full"] = full["fwd_bwd_ms"] / row["fwd_bwd_ms"]
    full_flops, causal_flops = _flops(1, h, s, s, d, False), _flops(1, h, s, s, d, True)
    table.measure("softcap 30", lambda: flashtile.flash_attn_func(q, k, v, softcap=30.0), (q, k, v), full, full_flops)
    table.measure("causal + softcap 30", lambda: flashtile.flash_attn_func(q, k, v, causal=True, softcap=30.0),
                  (q, k, v), causal, causal_flops)
    slopes = torch.rand(h, device=DEVICE) * 0.1
    table.measure("ALiBi", lambda: flashtile.flash_attn_func(q, k, v, alibi_slopes=slopes), (q, k, v), full,
                  full_flops)
    table.measure("causal + ALiBi", lambda: flashtile.flash_attn_func(q, k, v, causal=True, alibi_slopes=slopes),
                  (q, k, v), causal, causal_flops)
    sinks = torch.randn(h, device=DEVICE, requires_grad=True)
    table.measure("causal + sinks", lambda: flashtile.flash_attn_func(q, k, v, causal=True, sinks=sinks),
                  (q, k, v, sinks), causal, causal_flops)
    table.measure("causal + dropout 0.1", lambda: flashtile.flash_attn_func(q, k, v, causal=True, dropout_p=0.1),
                  (q, k, v), causal, causal_flops)


def _mask_rows(table, q, k, v, causal):
    """Float biases (with and without their gradient, and on cuDNN) and a bool causal mask, through SDPA's
    (B, H, S, S) layout: views of the same q, k, v."""
    _, s, h, d = q.shape
    qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))
    flops = _flops(1, h, s, s, d, False)
    sdpa_full = table.measure("sdpa plain", lambda: flashtile.scaled_dot_product_attention(qt, kt, vt), (q, k, v),
                              flops=flops)
    bias_shared = torch.randn((1, 1, s, s), device=DEVICE, dtype=DTYPE)
    table.measure("bias (1,1,S,S)", lambda: flashtile.scaled_dot_product_attention(qt, kt, vt, attn_mask=bias_shared),
                  (q, k, v), sdpa_full, flops)
    bias_heads = torch.randn((1, h, s, s), device=DEVICE, dtype=DTYPE)
    table.measure("bias (1,H,S,S)", lambda: flashtile.scaled_dot_product_attention(qt, kt, vt, attn_mask=bias_heads),
                  (q, k, v), sdpa_full, flops)
    from torch.nn.attention import SDPBackend, sdpa_kernel
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def cudnn(mask=None):
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            return sdpa(qt, kt, vt, attn_mask=mask)
    try:
        cudnn_plain = table.measure("sdpa-cudnn plain", cudnn, (q, k, v), flops=flops)
        table.measure("sdpa-cudnn bias (1,H,S,S)", lambda: cudnn(bias_heads), (q, k, v), cudnn_plain, flops)
    except RuntimeError as err:  # no cuDNN attention in this torch build, or it rejects the mask: said, not hidden
        print(f"sdpa-cudnn rows skipped: {str(err)[:200]}")
    bias_heads = None  # free 8 GB at 16k before the next row (the closures above read the name when called)
    bias_grad = torch.randn((1, h, s, s), device=DEVICE, dtype=DTYPE, requires_grad=True)
    table.measure("bias (1,H,S,S) + dbias", lambda: flashtile.scaled_dot_product_attention(
        qt, kt, vt, attn_mask=bias_grad), (q, k, v, bias_grad), sdpa_full, flops)
    bias_grad = None
    causal_mask = torch.ones((s, s), device=DEVICE, dtype=torch.bool).tril()
    table.measure("bool causal mask (S,S)", lambda: flashtile.scaled_dot_product_attention(
        qt, kt, vt, attn_mask=causal_mask), (q, k, v), causal, _flops(1, h, s, s, d, True))


def _random_lens(s):
    """16 random lengths summing to s (the same every run)."""
    gen = torch.Generator().manual_seed(1)
    cuts = sorted(torch.randperm(s - 1, generator=gen)[:15].add(1).tolist())
    return [e - a for a, e in zip([0] + cuts, cuts + [s])]


def _varlen_rows(table, q, k, v, causal):
    """16 random lengths summing to S, causal, against the plain causal kernel at S and a batch at the mean length;
    both also replayed from CUDA graphs."""
    _, s, h, d = q.shape
    lens = _random_lens(s)
    cu = torch.tensor([0] + list(torch.tensor(lens).cumsum(0)), dtype=torch.int32, device=DEVICE)
    qv, kv, vv = (t.detach()[0].requires_grad_() for t in (q, k, v))
    work = sum(_flops(1, h, n, n, d, True) for n in lens)
    row = table.measure(f"varlen causal ({len(lens)} seqs)", lambda: flashtile.flash_attn_varlen_func(
        qv, kv, vv, cu, cu, max(lens), max(lens), causal=True), (qv, kv, vv), flops=work)
    row["lens"] = lens
    mean = s // len(lens)
    qm, km, vm = _inputs(len(lens), mean, h, d)
    padded_work = _flops(len(lens), h, mean, mean, d, True)
    padded = table.measure(f"plain causal batch {len(lens)} x {mean}", lambda: flashtile.flash_attn_func(
        qm, km, vm, causal=True), (qm, km, vm), flops=padded_work)
    row["tflops_vs_plain_16k"] = row["fwd_tflops"] / causal["fwd_tflops"]
    row["tflops_vs_plain_mean_len"] = row["fwd_tflops"] / padded["fwd_tflops"]
    # These two calls take ~0.2-1 ms of GPU time, about what a call takes on the host, so do_bench (one call at a
    # time, the GPU idle while the host prepares the next) measures the host as much as the kernels. Replayed from
    # a CUDA graph the host drops out: the kernels' own times, and the comparison the row is about.
    try:
        for r in (row, padded):
            r["graph_fwd_ms"] = _graph_time(table.calls[r["name"]][0])
            if table.backward:
                r["graph_fwd_bwd_ms"] = _graph_time(table.calls[r["name"]][1])
    except RuntimeError as err:  # a capture that fails says so rather than ending the run
        print(f"CUDA-graph timing of the varlen rows failed: {str(err)[:200]}")
        return
    row["graph_tflops_vs_plain_mean_len"] = (work / row["graph_fwd_ms"]) / (padded_work / padded["graph_fwd_ms"])
    if table.backward:
        row["graph_fwd_bwd_tflops_vs_plain_mean_len"] = (work / row["graph_fwd_bwd_ms"]) / (
            padded_work / padded["graph_fwd_bwd_ms"])
    print(f"varlen in a CUDA graph: fwd {row['graph_fwd_ms']:.3f} ms, {len(lens)} x {mean} batch "
          f"{padded['graph_fwd_ms']:.3f} ms; TFLOP/s {row['graph_tflops_vs_plain_mean_len']:.2f}x the batch's "
          f"(fwd+bwd {row.get('graph_fwd_bwd_tflops_vs_plain_mean_len', float('nan')):.2f}x)", flush=True)


def _paged_cache(k, v, lens, page):
    """(k_cache, v_cache, block_table) holding packed k, v [total, H, D] in shuffled pages of `page` rows."""
    gen = torch.Generator().manual_seed(2)
    per_seq = [-(-n // page) for n in lens]
    order = torch.randperm(sum(per_seq), generator=gen)
    caches = [t.new_zeros((sum(per_seq), page) + tuple(t.shape[1:])) for t in (k, v)]
    block_table = torch.zeros((len(lens), max(per_seq)), dtype=torch.int32)
    start = first = 0
    for b, (n, pages) in enumerate(zip(lens, per_seq)):
        ids = order[first:first + pages]
        block_table[b, :pages] = ids.to(torch.int32)
        for cache, t in zip(caches, (k, v)):
            rows = t.new_zeros((pages * page,) + tuple(t.shape[1:]))
            rows[:n] = t[start:start + n]
            cache[ids.to(t.device)] = rows.view((pages, page) + tuple(t.shape[1:]))
        start, first = start + n, first + pages
    return caches[0], caches[1], block_table.to(k.device)


def _paged_rows(table, q, k, v):
    """Paged prefill (flash_attn_varlen_func with block_table, forward only): the varlen rows' 16 causal sequences
    with their keys in shuffled pages of 16 and 256 rows, each paired with the same keys contiguous, both on the
    default kernels (Gluon on Hopper): the cost is the paging alone (issue 28's bar: at most 10%)."""
    _, s, h, d = q.shape
    lens = _random_lens(s)
    cu = torch.tensor([0] + list(torch.tensor(lens).cumsum(0)), dtype=torch.int32, device=DEVICE)
    used = torch.tensor(lens, dtype=torch.int32, device=DEVICE)
    qv, kv, vv = (t.detach()[0] for t in (q, k, v))
    work = sum(_flops(1, h, n, n, d, True) for n in lens)

    def contiguous():
        return flashtile.flash_attn_varlen_func(qv, kv, vv, cu, cu, max(lens), max(lens), causal=True)

    default = table.measure("varlen causal fwd", contiguous, (), flops=work, bwd=False)
    for page in (16, 256):
        k_cache, v_cache, block_table = _paged_cache(kv, vv, lens, page)
        row = table.measure(f"paged {page} causal fwd", lambda k_cache=k_cache, v_cache=v_cache, bt=block_table: (
            flashtile.flash_attn_varlen_func(qv, k_cache, v_cache, cu, cu, max(lens), max(lens), causal=True,
                                             block_table=bt, seqused_k=used)), (), default, work, bwd=False)
        row["tflops_vs_varlen_default"] = row["fwd_tflops"] / default["fwd_tflops"]


def run(seqlen, heads, head_dim, out_dir, backward=True):
    """Every row at batch 1, [1, seqlen, heads, head_dim] bf16; writes the JSON to out_dir and returns the rows."""
    import triton

    b, s, h, d = 1, seqlen, heads, head_dim
    q, k, v = _inputs(b, s, h, d)
    table = _Table(backward)
    full = table.measure("plain", lambda: flashtile.flash_attn_func(q, k, v), (q, k, v),
                         flops=_flops(b, h, s, s, d, False))
    causal = table.measure("plain causal", lambda: flashtile.flash_attn_func(q, k, v, causal=True), (q, k, v),
                           flops=_flops(b, h, s, s, d, True))
    _score_rows(table, q, k, v, full, causal)
    _mask_rows(table, q, k, v, causal)
    _varlen_rows(table, q, k, v, causal)
    _paged_rows(table, q, k, v)

    meta = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
                date=datetime.date.today().isoformat(), dtype="bf16", batch=b, heads=h, head_dim=d, seqlen=s,
                flashtile=flashtile.__version__,
                flashtile_commit=commit(),
                cost_method=f"paired: row and base alternated {ROUNDS}x, medians of do_bench medians (rep 200 ms)")
    # The suite's naming: <date>-<gpu slug>-features[-fwd].json, numbered rather than overwrite an earlier run.
    Path(out_dir).mkdir(parents=True, exist_ok=True)
    path = result_path(out_dir, meta["gpu"], "features" if backward else "features-fwd", meta["date"])
    path.write_text(json.dumps(dict(meta=meta, rows=table.rows), indent=1))
    print(f"wrote {path}")
    return table.rows


def _fmt(row):
    parts = [f"{row['name']:<34}", f"fwd {row['fwd_ms']:8.3f} ms"]
    if row.get("fwd_bwd_ms") is not None:
        parts.append(f"fwd+bwd {row['fwd_bwd_ms']:8.3f} ms")
    if "fwd_tflops" in row:
        parts.append(f"{row['fwd_tflops']:6.1f} TF/s")
    if "fwd_cost" in row:
        parts.append(f"cost fwd {row['fwd_cost']:+6.1%}")
    if "fwd_bwd_cost" in row:
        parts.append(f"fwd+bwd {row['fwd_bwd_cost']:+6.1%}")
    return "  ".join(parts)


def build_parser(prog=None):
    parser = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0] + " Needs a CUDA GPU.",
                                     epilog=__doc__.split("\n\n", 2)[2],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=DEFAULT_OUT, metavar="DIR", help=f"results folder (default ./{DEFAULT_OUT})")
    parser.add_argument("--seqlen", type=int, default=16384)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--fwd-only", action="store_true", help="time the forward alone")
    return parser


def main(argv=None, prog=None):
    """Run the features table; returns the exit status (2 without a CUDA GPU)."""
    args = build_parser(prog).parse_args(argv)
    if not torch.cuda.is_available():
        print("error: no CUDA device; the features benchmark runs on a GPU", file=sys.stderr)
        return 2
    rows = run(args.seqlen, args.heads, args.head_dim, args.out, backward=not args.fwd_only)
    print("\nsummary")
    for row in rows:
        extra = ""
        if "speedup_vs_full" in row:
            extra = f"  {row['speedup_vs_full']:.1f}x faster than full (fwd)"
            if "fwd_bwd_speedup_vs_full" in row:
                extra += f", {row['fwd_bwd_speedup_vs_full']:.1f}x fwd+bwd"
        if "tflops_vs_plain_16k" in row:
            extra = (f"  TFLOP/s {row['tflops_vs_plain_16k']:.2f}x plain causal 16k, "
                     f"{row['tflops_vs_plain_mean_len']:.2f}x plain causal at the mean length")
            if "graph_tflops_vs_plain_mean_len" in row:
                extra += f" ({row['graph_tflops_vs_plain_mean_len']:.2f}x both in CUDA graphs)"
        if "tflops_vs_varlen_default" in row:
            extra = f"  TFLOP/s {row['tflops_vs_varlen_default']:.2f}x contiguous varlen on the default kernel"
        print(_fmt(row) + extra)
    return 0


if __name__ == "__main__":
    sys.exit(main())
