"""The attention suite of `python -m flashtile bench`: TFLOP/s of flashtile and its peers, measured in the same run
on the same GPU, every claim a ratio.

    python -m flashtile bench                      # the standard suite, every provider that can run here
    python -m flashtile bench --quick              # seqlen 16k, headdim 64 and 128
    python -m flashtile bench --seqlen 16k --headdim 128 --causal 1 --mode fwd --providers flashtile,sdpa-cudnn
    python -m flashtile bench --memory             # peak memory of fwd+bwd instead of speed
    python -m flashtile bench --list               # providers, and why each one can or cannot run here

Prints progress to stderr and the table last to stdout; writes <out>/<date>-<gpu>[-tag].json with every number and
the run's metadata, and a PNG plot with the same stem (with matplotlib). See docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import re
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path
from typing import Callable, Iterable, Sequence

import torch

from .._source import package_digest
from .registry import (HIDDEN, MODES, PROVIDERS, QUICK_HEADDIMS, QUICK_SEQLENS, STANDARD_HEADDIMS, STANDARD_SEQLENS,
                       Prepared, Provider, Shape, Unsupported, dist_version, standard_shapes)

# Results go to ./bench-results unless --out says otherwise (a checkout keeps the runs that back its README in
# benchmarks/results: pass --out benchmarks/results there).
DEFAULT_OUT = "bench-results"
BASELINE = "flashtile"
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
# Max abs error of a provider's forward against an fp32 reference; random N(0, 1) inputs keep |out| below ~1, so
# this is a few ulps of bf16 (2^-8) and of fp16 (2^-11) plus accumulation-order noise.
ATOL = {torch.bfloat16: 2e-2, torch.float16: 1e-2}
# The check compares this many query rows (evenly spaced, first and last included) of every batch and head: the
# reference then costs B·H·CHECK_ROWS·Sk dot products instead of B·H·Sq·Sk.
CHECK_ROWS = 64
BWD_FACTOR = 2.5       # backward = 2 matmuls of the forward's 2 recomputed + 3 new: 5 vs 2 -> 2.5x
FWD_BWD_FACTOR = 1.0 + BWD_FACTOR
MiB = 1024 * 1024


# ----------------------------------------------------------------------------------------------------------------
# FLOPs


def visible_pairs(seqlen_q: int, seqlen_k: int, causal: bool) -> int:
    """Number of (query i, key j) pairs attention computes; causal is aligned bottom-right: j <= i + Sk - Sq."""
    if not causal:
        return seqlen_q * seqlen_k
    # Query i sees clip(i + Sk - Sq + 1, 0, Sk) keys; sum t = lo..hi of clip(t, 0, Sk) in closed form.
    lo = seqlen_k - seqlen_q + 1
    hi = lo + seqlen_q - 1

    def prefix(x: int) -> int:  # sum over t = 0..x of min(t, Sk); 0 for x < 0
        if x < 0:
            return 0
        if x <= seqlen_k:
            return x * (x + 1) // 2
        return seqlen_k * (seqlen_k + 1) // 2 + (x - seqlen_k) * seqlen_k

    return prefix(hi) - prefix(lo - 1)


def flops(batch: int, heads: int, seqlen_q: int, seqlen_k: int, headdim: int, causal: bool, mode: str,
          headdim_v: int | None = None) -> float:
    """FLOPs counted for a TFLOP/s figure: fwd = 4·B·H·Sq·Sk·D (two matmuls, 2 FLOPs per multiply-add), halved for
    causal with Sq == Sk (the FlashAttention papers' convention); causal with Sq != Sk counts the exact visible
    (i, j) pairs instead of Sq·Sk. With v's head dim Dv apart from q's and k's D (headdim_v): 2·B·H·Sq·Sk·(D +
    Dv). bwd = 2.5 x fwd, fwd+bwd = 3.5 x fwd."""
    if causal and seqlen_q == seqlen_k:
        pairs = seqlen_q * seqlen_k / 2
    else:
        pairs = visible_pairs(seqlen_q, seqlen_k, causal)
    fwd = 2.0 * batch * heads * pairs * (headdim + (headdim if headdim_v is None else headdim_v))
    factors = {"fwd": 1.0, "bwd": BWD_FACTOR, "fwd+bwd": FWD_BWD_FACTOR}
    if mode not in factors:
        raise ValueError(f"mode {mode!r} is not one of {sorted(factors)}")
    return fwd * factors[mode]


# ----------------------------------------------------------------------------------------------------------------
# Shapes and arguments


def parse_size(text: str) -> int:
    """'16k' -> 16384, '4096' -> 4096."""
    text = text.strip().lower()
    m = re.fullmatch(r"(\d+)(k?)", text)
    if not m:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size; write e.g. 1024, 4k or 16k")
    return int(m.group(1)) * (1024 if m.group(2) else 1)


def parse_list(text: str) -> tuple[int, ...]:
    return tuple(parse_size(t) for t in text.split(",") if t.strip())


def select_shapes(seqlens: Sequence[int] | None = None, headdims: Sequence[int] | None = None,
                  causal: str = "both", quick: bool = False, hidden: int = HIDDEN,
                  headdim_v: int | None = None, heads: int | None = None) -> list[Shape]:
    """The standard suite, filtered. Explicit seqlens/headdims win over --quick's; hidden: heads x headdim (a head
    dim that does not divide 2048, such as 96, needs another: --hidden 1536 gives 16 heads); heads: that many heads
    at every head dim instead (--headdim 72,80,136 --heads 16); headdim_v: v's head dim in every shape (MLA's
    prefill: --headdim 192 --headdim-v 128)."""
    if headdim_v is not None and headdim_v < 1:
        raise ValueError(f"--headdim-v must be a positive head dim, got {headdim_v}")
    if seqlens is None:
        seqlens = QUICK_SEQLENS if quick else STANDARD_SEQLENS
    if headdims is None:
        headdims = QUICK_HEADDIMS if quick else STANDARD_HEADDIMS
    causals = {"0": (False,), "1": (True,), "both": (False, True)}[str(causal)]
    return standard_shapes(seqlens, headdims, causals, hidden=hidden, headdim_v=headdim_v, heads=heads)


def select_modes(mode: str) -> tuple[str, ...]:
    return MODES if mode == "both" else (mode,)


def select_providers(names: str | None, registry: dict[str, Provider] = PROVIDERS) -> list[str]:
    if not names:
        return list(registry)
    chosen = [n.strip() for n in names.split(",") if n.strip()]
    unknown = [n for n in chosen if n not in registry]
    if unknown:
        raise ValueError(f"unknown provider(s) {', '.join(unknown)}; known: {', '.join(registry)}")
    return chosen


# ----------------------------------------------------------------------------------------------------------------
# Correctness guard


def check_rows(seqlen_q: int, n: int = CHECK_ROWS) -> torch.Tensor:
    """Up to n query indices, evenly spaced, always including the first and the last."""
    if seqlen_q <= n:
        return torch.arange(seqlen_q)
    return torch.linspace(0, seqlen_q - 1, n).round().long().unique()


def reference_rows(q, k, v, causal: bool, softmax_scale: float, rows: torch.Tensor) -> torch.Tensor:
    """fp32 attention output of the given query rows, [B, len(rows), H, D], through SDPA's math backend with an
    explicit bottom-right causal mask; a query row that sees no key is 0 (the flash-attn convention)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    seqlen_q, seqlen_k = q.shape[1], k.shape[1]
    rows = rows.to(q.device)
    q_rows = q[:, rows].float().transpose(1, 2)                     # [B, H, r, D]
    k_f, v_f = k.float().transpose(1, 2), v.float().transpose(1, 2)  # [B, Hk, Sk, D]
    if k_f.shape[1] != q_rows.shape[1]:
        group = q_rows.shape[1] // k_f.shape[1]
        k_f, v_f = k_f.repeat_interleave(group, dim=1), v_f.repeat_interleave(group, dim=1)
    mask = None
    if causal:
        mask = torch.arange(seqlen_k, device=q.device)[None, :] <= rows[:, None] + (seqlen_k - seqlen_q)  # [r, Sk]
    with sdpa_kernel(SDPBackend.MATH):
        out = torch.nn.functional.scaled_dot_product_attention(q_rows, k_f, v_f, attn_mask=mask,
                                                               scale=softmax_scale)
    if mask is not None:
        out = torch.where(mask.any(dim=-1)[:, None], out, torch.zeros((), device=out.device))
    return out.transpose(1, 2)


def max_abs_diff(out_bshd: torch.Tensor, ref_rows: torch.Tensor, rows: torch.Tensor, expected_shape) -> float:
    if tuple(out_bshd.shape) != tuple(expected_shape):
        raise ValueError(f"output shape {tuple(out_bshd.shape)}, expected {tuple(expected_shape)}")
    if not torch.isfinite(out_bshd).all():   # one cheap pass over the whole output, beyond the sampled rows
        return math.nan
    got = out_bshd[:, rows.to(out_bshd.device)].float()
    return (got - ref_rows).abs().max().item()   # NaN fails the `diff <= atol` test of the caller


# ----------------------------------------------------------------------------------------------------------------
# Measurement


@dataclass(frozen=True)
class Result(Shape):
    """One provider's row for one shape and mode: the shape's fields (and its label), then the measurement."""
    provider: str
    mode: str                          # fwd | bwd | fwd+bwd | memory
    dtype: str
    status: str                        # ok | wrong | error | skipped
    ms: float | None = None
    tflops: float | None = None
    peak_mib: float | None = None
    flops: float | None = None
    max_abs_diff: float | None = None
    detail: str = ""
    ms_rounds: list | None = None      # with rounds > 1: each round's time; ms is their median

    @property
    def value(self) -> float | None:
        return self.peak_mib if self.mode == "memory" else self.tflops


Timer = Callable[..., float]          # timer(fn, grad_to_none=[...]) -> milliseconds


def do_bench_timer(warmup: int = 25, rep: int = 100) -> Timer:
    """Median of triton.testing.do_bench (which flushes L2 between runs); triton is imported on first use."""
    def timer(fn, grad_to_none=None) -> float:
        from triton.testing import do_bench
        return do_bench(fn, warmup=warmup, rep=rep, grad_to_none=grad_to_none, return_mode="median")
    return timer


def time_mode(prepared: Prepared, mode: str, timer: Timer) -> float:
    """Milliseconds of one call. bwd times out.backward(dout, retain_graph=True) on a graph built once here."""
    if mode == "fwd":
        return timer(prepared.fwd)
    out = prepared.fwd()
    dout = torch.randn_like(out)
    grads = list(prepared.inputs)
    if mode == "bwd":
        return timer(lambda: out.backward(dout, retain_graph=True), grad_to_none=grads)
    if mode == "fwd+bwd":
        return timer(lambda: prepared.fwd().backward(dout), grad_to_none=grads)
    raise ValueError(f"mode {mode!r} is not fwd, bwd or fwd+bwd")


def peak_memory_mib(prepared: Prepared) -> float:
    """Peak CUDA memory one fwd+bwd allocates beyond the inputs and dout (after one warm-up run, so compilation
    and autotuning buffers are not counted)."""
    out = prepared.fwd()
    dout = torch.randn_like(out)
    out.backward(dout)
    del out
    for t in prepared.inputs:
        t.grad = None
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    prepared.fwd().backward(dout)
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    for t in prepared.inputs:
        t.grad = None
    return peak / MiB


def _error_text(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}".strip()


def make_inputs(shape: Shape, dtype, device, seed: int = 0):
    gen = torch.Generator(device=device).manual_seed(seed)
    q_shape = (shape.batch, shape.seqlen_q, shape.heads, shape.headdim)
    k_shape = (shape.batch, shape.seqlen_k, shape.heads_k, shape.headdim)
    v_shape = (shape.batch, shape.seqlen_k, shape.heads_k, shape.dv)
    return tuple(torch.randn(s, dtype=dtype, device=device, generator=gen) for s in (q_shape, k_shape, v_shape))


def _run_provider(provider: Provider, shape: Shape, q, k, v, ref, rows, modes, measure, memory: bool,
                  dtype_name: str, atol: float) -> list[Result]:
    """All rows of one provider on one shape; a failure at any stage becomes an error row with its text."""
    softmax_scale = shape.headdim ** -0.5

    def row(mode, status, **kw) -> Result:
        return Result(**asdict(shape), provider=provider.name, mode=mode, dtype=dtype_name, status=status, **kw)

    try:
        prepared = provider.prepare(q, k, v, shape.causal, softmax_scale)
    except Unsupported as exc:
        return [row(m, "skipped", detail=str(exc)) for m in modes]
    except Exception as exc:
        return [row(m, "error", detail=f"prepare: {_error_text(exc)}") for m in modes]

    results = []
    try:
        with prepared.context():
            try:
                out = prepared.fwd()
                diff = max_abs_diff(prepared.to_bshd(out), ref, rows, (*q.shape[:-1], v.shape[-1]))
                del out
                prepared.settle()  # (flashtile: the compiles its first call left running in threads)
            except Exception as exc:
                return [row(m, "error", detail=f"forward: {_error_text(exc)}") for m in modes]
            status = "ok" if diff <= atol else "wrong"
            detail = "" if status == "ok" else (
                "non-finite values in the output" if math.isnan(diff)
                else f"max abs diff {diff:.3g} > {atol:g} vs fp32 SDPA math")
            for mode in modes:
                try:
                    value = measure(prepared, mode)
                except Exception as exc:
                    results.append(row(mode, "error", detail=_error_text(exc), max_abs_diff=diff))
                    continue
                if memory:
                    results.append(row(mode, status, peak_mib=value, max_abs_diff=diff, detail=detail))
                else:
                    n = flops(shape.batch, shape.heads, shape.seqlen_q, shape.seqlen_k, shape.headdim, shape.causal,
                              mode, shape.dv)
                    results.append(row(mode, status, ms=value, flops=n, tflops=n / (value * 1e-3) / 1e12,
                                       max_abs_diff=diff, detail=detail))
    except Exception as exc:  # entering/leaving the provider's context failed
        done = {r.mode for r in results}
        results += [row(m, "error", detail=f"context: {_error_text(exc)}") for m in modes if m not in done]
    finally:
        for t in prepared.inputs:
            t.grad = None
    return results


def _merge_rounds(rounds: list[Result], flop_count: float | None) -> Result:
    """One provider's rows of one (shape, mode) over the rounds: the median time of the rounds that measured it
    (all rounds' times kept in ms_rounds); a round that failed or came out wrong makes the row so."""
    bad = [r for r in rounds if r.status != "ok"]
    if bad or rounds[0].ms is None:
        return bad[0] if bad else rounds[0]
    times = [r.ms for r in rounds]
    ms = statistics.median(times)
    return replace(rounds[0], ms=ms, tflops=flop_count / (ms * 1e-3) / 1e12 if flop_count else None,
                   max_abs_diff=max(r.max_abs_diff for r in rounds), ms_rounds=times)


def run_suite(shapes: Iterable[Shape], modes: Sequence[str] = MODES, providers: Sequence[str] | None = None,
              dtype=torch.bfloat16, device: str = "cuda", timer: Timer | None = None, memory: bool = False,
              registry: dict[str, Provider] = PROVIDERS, on_shape_done: Callable[[dict], None] | None = None,
              progress: Callable[[str], None] | None = None, rounds: int = 1) -> dict:
    """Check and measure every (shape, provider, mode). Returns {"results": [Result...], "skipped": {name: why},
    "providers": [names that were available]}. With memory=True the one mode is "memory": peak MiB of fwd+bwd.

    rounds > 1 measures every provider of a shape that many times, the providers alternating within each round,
    and reports each row's median: a GPU's clock drifts as it warms, and with one timing per provider whoever is
    timed at a cooler moment gains a few percent over the others in the ratio columns. Round r starts at the r-th
    provider (the order rotates): on an H100, timing the same trees in the same order every round cost the first
    one several percent against the others (docs/design-record.md, "The FP8 forward").

    on_shape_done(partial) is called after each shape (the CLI rewrites its JSON there, so a run cut short keeps
    what it measured)."""
    names = list(providers) if providers is not None else list(registry)
    skipped, runnable = {}, []
    for name in names:
        reason = registry[name].available()
        if reason is None:
            runnable.append(name)
        else:
            skipped[name] = reason
    if progress:
        for name, reason in skipped.items():
            progress(f"skipping {name}: {reason}")
    timer = timer or do_bench_timer()
    if memory:
        modes, measure = ("memory",), (lambda prepared, mode: peak_memory_mib(prepared))
    else:
        measure = lambda prepared, mode: time_mode(prepared, mode, timer)  # noqa: E731
    dtype_name = {v: k for k, v in DTYPES.items()}.get(dtype, str(dtype).replace("torch.", ""))
    atol = ATOL.get(dtype, 2e-2)

    shapes = list(shapes)
    results: list[Result] = []
    for i, shape in enumerate(shapes, 1):
        q, k, v = make_inputs(shape, dtype, device)
        rows = check_rows(shape.seqlen_q)
        ref = reference_rows(q, k, v, shape.causal, shape.headdim ** -0.5, rows)
        per_round = {name: [] for name in runnable}
        for rnd in range(1 if memory else max(1, rounds)):  # (a peak is not a timing: one round)
            first = rnd % len(runnable) if runnable else 0
            for name in runnable[first:] + runnable[:first]:
                start = time.perf_counter()
                rows_out = _run_provider(registry[name], shape, q, k, v, ref, rows, modes, measure, memory,
                                         dtype_name, atol)
                per_round[name].append(rows_out)
                if progress:
                    where = f" round {rnd + 1}" if rounds > 1 and not memory else ""
                    for r in rows_out:
                        progress(f"[{i}/{len(shapes)}] {shape.label:<24} {name:<10} {r.mode:<6} "
                                 f"{_progress_value(r)}  ({time.perf_counter() - start:.1f}s{where})")
                if device != "cpu" and torch.cuda.is_available():
                    torch.cuda.empty_cache()
        for name in runnable:
            for j, row0 in enumerate(per_round[name][0]):
                n = None if memory else flops(shape.batch, shape.heads, shape.seqlen_q, shape.seqlen_k,
                                              shape.headdim, shape.causal, row0.mode, shape.dv)
                results.append(_merge_rounds([rows_out[j] for rows_out in per_round[name]], n)
                               if len(per_round[name]) > 1 else row0)
        del q, k, v, ref
        if on_shape_done:
            on_shape_done({"results": results, "skipped": skipped, "providers": runnable})
    return {"results": results, "skipped": skipped, "providers": runnable}


def _progress_value(r: Result) -> str:
    if r.status in ("error", "skipped"):
        return f"{r.status.upper()}: {r.detail}"
    text = f"{r.peak_mib:.0f} MiB" if r.mode == "memory" else f"{r.tflops:.1f} TFLOP/s ({r.ms:.3f} ms)"
    return text + (f"  WRONG: {r.detail}" if r.status == "wrong" else "")


# ----------------------------------------------------------------------------------------------------------------
# Table

_MODE_ORDER = {m: i for i, m in enumerate(("fwd", "bwd", "fwd+bwd", "memory"))}
_RESULT_FIELDS = {f.name for f in fields(Result)}


def _as_result(r) -> Result:
    if isinstance(r, Result):
        return r
    return Result(**{k: v for k, v in r.items() if k in _RESULT_FIELDS})  # a JSON row also holds the label


def format_table(results: Sequence, skipped: dict[str, str] | None = None, baseline: str = BASELINE,
                 title: str | None = None) -> str:
    """A markdown table: one row per (shape, mode), one column per provider (TFLOP/s, or peak MiB for memory rows),
    then `baseline/<peer>` ratio columns for every peer with a number. WRONG keeps the number and flags it; errors
    and per-shape skips show a note number, and the notes below the table give the text."""
    results = [_as_result(r) for r in results]
    providers = list(dict.fromkeys(r.provider for r in results))
    table: dict[tuple, dict[str, Result]] = {}
    for r in results:
        key = (_MODE_ORDER.get(r.mode, 99), r.headdim, r.dv, r.causal, r.seqlen_q, r.seqlen_k, r.batch, r.heads,
               r.heads_k, r.dtype, r.mode, r.label)
        table.setdefault(key, {})[r.provider] = r

    def has_number(p: str) -> bool:
        return any(r.provider == p and r.value is not None for r in results)

    ratio_peers = [p for p in providers if p != baseline and has_number(p)] if has_number(baseline) else []
    notes: dict[str, int] = {}

    def note(r: Result) -> str:
        text = f"{r.provider}: {r.detail}"
        if text not in notes:
            notes[text] = len(notes) + 1
        return f"[{notes[text]}]"

    def cell(r: Result | None) -> str:
        if r is None:
            return "-"
        if r.status == "error":
            return "error" + note(r)
        if r.status == "skipped":
            return "n/a" + note(r)
        text = f"{r.value:.0f}" if r.mode == "memory" else f"{r.value:.1f}"
        return text + (" WRONG" + note(r) if r.status == "wrong" else "")

    header = ["shape", "mode"] + providers + [f"{baseline}/{p}" for p in ratio_peers]
    body = []
    for key in sorted(table):
        cells = table[key]
        line = [key[-1], key[-2]] + [cell(cells.get(p)) for p in providers]
        base = cells.get(baseline)
        for p in ratio_peers:
            peer = cells.get(p)
            if base is not None and peer is not None and base.value is not None and peer.value:
                line.append(f"{base.value / peer.value:.2f}x")
            else:
                line.append("-")
        body.append(line)

    widths = [max(len(str(row[i])) for row in [header] + body) for i in range(len(header))]
    fmt = lambda row: "| " + " | ".join(str(c).ljust(w) for c, w in zip(row, widths)) + " |"  # noqa: E731
    lines = []
    if title:
        lines += [title, ""]
    for name, reason in (skipped or {}).items():
        lines.append(f"skipped {name}: {reason}")
    if skipped:
        lines.append("")
    lines += [fmt(header), "|" + "|".join("-" * (w + 2) for w in widths) + "|"] + [fmt(row) for row in body]
    if notes:
        lines.append("")
        lines += [f"[{n}] {text}" for text, n in notes.items()]
    return "\n".join(lines)


# ----------------------------------------------------------------------------------------------------------------
# Results files


def gpu_slug(name: str) -> str:
    """'NVIDIA H100 80GB HBM3' -> 'h100-80gb-hbm3'."""
    name = re.sub(r"^nvidia\s+", "", name.strip().lower())
    return re.sub(r"[^a-z0-9]+", "-", name).strip("-") or "unknown"


def result_path(out_dir, gpu_name: str, tag: str | None = None, date: str | None = None) -> Path:
    """<out>/<YYYY-MM-DD>-<gpu-slug>[-tag].json; -2, -3, ... appended rather than overwrite an earlier run."""
    date = date or datetime.date.today().isoformat()
    stem = f"{date}-{gpu_slug(gpu_name)}" + (f"-{re.sub(r'[^A-Za-z0-9_.-]+', '-', tag)}" if tag else "")
    out_dir = Path(out_dir)
    path, n = out_dir / f"{stem}.json", 2
    while path.exists():
        path, n = out_dir / f"{stem}-{n}.json", n + 1
    return path


def _jsonable(x):
    if isinstance(x, float) and not math.isfinite(x):
        return str(x)          # strict JSON has no NaN/inf; keep the value readable rather than drop it
    if isinstance(x, dict):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    if isinstance(x, Result):
        return _jsonable(dict(label=x.label, **asdict(x)))
    if isinstance(x, Path):
        return str(x)
    return x


def write_json(payload: dict, path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(_jsonable(payload), indent=1, allow_nan=False) + "\n")
    tmp.replace(path)
    return path


def report_bars(checks, out_dir, gpu_name, tag, date, payload):
    """Print a benchmark's bars (description, passed: True / False / None for not measured, value) and write
    payload with them to result_path(out_dir, gpu_name, tag, date); returns the path."""
    for bar, passed, value in checks:
        print(f"  {'PASS' if passed else 'FAIL' if passed is False else 'n/a '}  {bar}: {value}")
    bars = [dict(bar=b, passed=ok, value=v) for b, ok, v in checks]
    return write_json(dict(payload, bars=bars), result_path(out_dir, gpu_name, tag, date))


def _flashtile_version():
    from .. import __version__
    return __version__


def checkout_root() -> Path | None:
    """The flashtile checkout this package runs from (an editable install or PYTHONPATH), or None for an installed
    wheel: only a checkout's git commit describes the code measured."""
    root = Path(__file__).resolve().parents[2]
    return root if (root / "pyproject.toml").is_file() and (root / ".git").exists() else None


def commit() -> str | None:
    """The commit measured: FLASHTILE_COMMIT when set (a copy of the working tree may have no .git, or a stale one),
    else the checkout's HEAD."""
    return os.environ.get("FLASHTILE_COMMIT") or git("rev-parse", "HEAD")


def git(*args: str) -> str | None:
    """`git args` in the checkout (None without one, or when git fails)."""
    root = checkout_root()
    if root is None:
        return None
    try:
        out = subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def collect_metadata(args: dict, dtype_name: str, registry: dict[str, Provider] = PROVIDERS,
                     providers: Sequence[str] = ()) -> dict:
    cuda = torch.cuda.is_available()
    status = git("status", "--porcelain", "--untracked-files=no")
    versions = {}
    for name in providers:
        try:
            versions[name] = registry[name].version()
        except Exception as exc:
            versions[name] = f"unknown ({_error_text(exc)})"
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "gpu": torch.cuda.get_device_name() if cuda else "cpu",
        "gpu_capability": ".".join(map(str, torch.cuda.get_device_capability())) if cuda else None,
        "torch": torch.__version__,
        "triton": dist_version("triton"),
        "cuda": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version() if cuda and torch.backends.cudnn.is_available() else None,
        "python": platform.python_version(),
        # The GPU machines get a copy of the working tree without .git: pass FLASHTILE_COMMIT there.
        "flashtile_commit": commit(),
        "flashtile_version": _flashtile_version(),
        "flashtile_dirty": None if status is None else bool(status),
        # Which copy of the package ran, and its sources' digest: two trees timed against each other differ here
        # (`python -m` puts the working directory first on sys.path, ahead of PYTHONPATH).
        "flashtile_path": os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
        "flashtile_sources": package_digest()[:16],
        "dtype": dtype_name,
        "provider_versions": versions,
        "timing": "median of triton.testing.do_bench(fn, warmup, rep, grad_to_none=[q, k, v]); bwd = "
                  "out.backward(dout, retain_graph=True) on a graph built once; inputs require grad in every mode; "
                  "with rounds > 1 the providers of a shape alternate, round r starting at the r-th, and each row is "
                  "the median of the rounds (ms_rounds)",
        "flops": "fwd 4*B*H*Sq*Sk*D (halved for causal with Sq == Sk, exact visible pairs when Sq != Sk; "
                 "2*B*H*Sq*Sk*(D + Dv) with v's head dim Dv apart); bwd 2.5x fwd; fwd+bwd 3.5x fwd",
        "check": f"forward vs fp32 SDPA math on {CHECK_ROWS} query rows per batch and head, max abs diff <= "
                 f"{ATOL.get(DTYPES.get(dtype_name), 2e-2):g}",
        "args": args,
    }


# ----------------------------------------------------------------------------------------------------------------
# CLI


def _epilog() -> str:
    from . import SUBCOMMANDS

    lines = ["other benchmarks (each takes --help):"]
    lines += [f"  {name:<9} {text}" for name, (_, text) in SUBCOMMANDS.items()]
    lines += ["", "Needs a CUDA GPU (--help and --list do not). Results: JSON with every number and the GPU, torch, "
              "triton\nand date, plus a PNG with matplotlib (pip install flashtile[bench])."]
    return "\n".join(lines)


def build_parser(prog: str | None = None) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description="Benchmark flashtile against torch SDPA (cuDNN, flash), "
                                "FlexAttention, FA2 and FA4, in the same run on the same GPU.\nThe standard suite: "
                                "batch*seqlen = 16k, hidden 2048 (heads = 2048 / headdim), seqlen 1k/4k/16k, headdim "
                                "64/128/256,\ncausal and not, fwd and bwd, bf16.", epilog=_epilog(),
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seqlen", type=parse_list, default=None, metavar="LIST",
                   help="comma-separated sequence lengths, e.g. 1k,4k,16k (default: 1k,4k,16k)")
    p.add_argument("--headdim", type=parse_list, default=None, metavar="LIST",
                   help="comma-separated head dims, e.g. 64,128 (default: 64,128,256)")
    p.add_argument("--headdim-v", type=int, default=None, metavar="N",
                   help="v's head dim in every shape when it differs from q's and k's, e.g. --headdim 192 "
                        "--headdim-v 128 --hidden 3072 for MLA's prefill at 16 heads (default: the same)")
    p.add_argument("--causal", choices=["0", "1", "both"], default="both")
    p.add_argument("--mode", choices=["fwd", "bwd", "both"], default="both")
    p.add_argument("--providers", default=None, metavar="A,B",
                   help=f"comma-separated subset of: {', '.join(PROVIDERS)} (default: all)")
    p.add_argument("--quick", action="store_true", help="only seqlen 16k with headdim 64 and 128")
    sizes = p.add_mutually_exclusive_group()
    sizes.add_argument("--hidden", type=int, default=HIDDEN, metavar="N",
                       help=f"heads x headdim of every shape (default {HIDDEN}; e.g. 1536 for 16 heads at headdim 96)")
    sizes.add_argument("--heads", type=int, default=None, metavar="N",
                       help="heads of every shape whatever its headdim, instead of --hidden: e.g. --headdim "
                            "48,72,80,136,160 --heads 16")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    p.add_argument("--memory", action="store_true",
                   help="measure the peak memory of fwd+bwd per provider instead of speed "
                        "(default shape: seqlen 16k, headdim 128)")
    p.add_argument("--warmup", type=int, default=25, metavar="MS", help="do_bench warmup in ms (default 25)")
    p.add_argument("--rep", type=int, default=100, metavar="MS", help="do_bench repetition time in ms (default 100)")
    p.add_argument("--rounds", type=int, default=1, metavar="N",
                   help="time every provider of a shape N times, alternating, and report medians (default 1)")
    p.add_argument("--out", default=str(DEFAULT_OUT), metavar="DIR", help=f"results folder (default ./{DEFAULT_OUT})")
    p.add_argument("--tag", default=None, help="suffix of the results file name")
    p.add_argument("--no-plot", action="store_true", help="write only the JSON")
    p.add_argument("--list", action="store_true", help="list the providers, whether each can run here, and exit")
    return p


def main(argv: Sequence[str] | None = None, prog: str | None = None) -> int:
    """Run the benchmark; returns the exit status: 1 when a flashtile row is WRONG or an error, else 0."""
    args = build_parser(prog).parse_args(argv)
    log = lambda msg: print(msg, file=sys.stderr, flush=True)  # noqa: E731
    try:
        providers = select_providers(args.providers)
    except ValueError as exc:
        log(f"error: {exc}")
        return 2
    if args.rounds < 1:
        log(f"error: --rounds must be at least 1, got {args.rounds}")
        return 2
    if args.list:
        for name in providers:
            reason = PROVIDERS[name].available()
            print(f"{name:<17} {'available' if reason is None else 'unavailable: ' + reason}\n"
                  f"{'':<17} {PROVIDERS[name].description}")
        return 0
    if not torch.cuda.is_available():
        log("error: no CUDA device; the benchmark runs on a GPU (--help and --list work without one)")
        return 2

    seqlens, headdims = args.seqlen, args.headdim
    if args.memory:
        seqlens = seqlens or (16 * 1024,)
        headdims = headdims or (128,)
    try:
        shapes = select_shapes(seqlens, headdims, args.causal, args.quick, args.hidden, args.headdim_v, args.heads)
    except ValueError as exc:
        log(f"error: {exc}")
        return 2
    modes = select_modes(args.mode)
    dtype = DTYPES[args.dtype]
    gpu = torch.cuda.get_device_name()
    tag = "-".join(t for t in (args.tag, "memory" if args.memory else None) if t)
    json_path = result_path(args.out, gpu, tag or None)
    meta = collect_metadata(vars(args), args.dtype, providers=providers)
    meta["args"]["argv"] = list(argv) if argv is not None else sys.argv[1:]

    def save(partial: dict) -> None:
        write_json({"metadata": meta, "skipped_providers": partial["skipped"], "results": partial["results"]},
                   json_path)

    log(f"{gpu}, torch {meta['torch']}, triton {meta['triton']}, {args.dtype}; {len(shapes)} shapes x "
        f"{'memory' if args.memory else '/'.join(modes)}; results -> {json_path}")
    log(f"flashtile {meta['flashtile_commit'] or '(no commit)'} from {meta['flashtile_path']} (sources "
        f"{meta['flashtile_sources']})")
    suite = run_suite(shapes, modes, providers, dtype=dtype, timer=do_bench_timer(args.warmup, args.rep),
                      memory=args.memory, on_shape_done=save, progress=log, rounds=args.rounds)
    save(suite)

    if not args.no_plot and not args.memory and suite["results"]:
        from .plot import plot_file

        try:
            log(f"plot -> {plot_file(json_path)}")
        except ModuleNotFoundError as exc:
            if not (exc.name or "").startswith("matplotlib"):
                raise
            log(f"no plot: matplotlib is not installed ({exc}); wrote only the JSON. pip install matplotlib "
                f"(or flashtile[bench]), then: python -m flashtile bench plot {json_path}")

    what = "peak memory of fwd+bwd (MiB, lower is better)" if args.memory else \
        "TFLOP/s (median of triton.testing.do_bench)"
    title = f"{what}; {gpu}, {args.dtype}, torch {meta['torch']}, triton {meta['triton']}, " \
            f"flashtile {(meta['flashtile_commit'] or 'unknown')[:10]}"
    print(format_table(suite["results"], suite["skipped"], title=title), flush=True)
    bad = [r for r in suite["results"] if r.provider == BASELINE and r.status in ("wrong", "error")]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
