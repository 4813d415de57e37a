"""End-to-end speed of a real model: a Llama-3.2-1B-shaped model (1.24B parameters, bf16, random weights) through
transformers, with attention from flashtile, from torch SDPA (cuDNN first) and from transformers' eager code, in one
run on one GPU.

    python benchmarks/e2e.py                       # seq 4k and 8k; ~4 minutes on an H100
    python benchmarks/e2e.py --seqlen 4k --providers flashtile,sdpa-cudnn --train-steps 10

Per provider and sequence length:
- training: one AdamW step on a batch of one sequence (forward, loss over the 128k vocabulary, backward, step),
  median of --train-steps timed steps after two warm-up steps: tokens/s and peak memory;
- generate(): --gen-batch prompts of the sequence length, greedy, --new-tokens tokens: the prefill's time
  (generate() with one new token) and the decode tokens/s ((new tokens - 1) x batch / (time of the full call - the
  prefill's)), and peak memory.
Every provider starts from the same weights (reloaded before each training run), and the first training step's loss
is recorded as a sanity check (the providers compute the same function). A provider that runs out of memory gets
the status "out of memory" and no numbers; any other exception stops the run.

Providers: `flashtile` (attn_implementation=flashtile.integrations.transformers.register()), `sdpa-cudnn`
(attn_implementation="sdpa" inside sdpa_kernel([CUDNN, FLASH, EFFICIENT], set_priority=True): cuDNN where it
applies, torch's flash kernel for the decode steps cuDNN does not take), `sdpa-flashtile` (the same SDPA code with
flashtile installed as torch's flash backend, flashtile.integrations.sdpa; torch >= 2.11), `eager` (transformers'
matmul-softmax-matmul, which materialises the (heads, seq, seq) scores).

Results: benchmarks/results/<date>-<gpu>-e2e.json (with GPU, versions, date, configuration) and a PNG of it.
"""
from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import statistics
import sys
import time
from pathlib import Path

# Llama-3.2-1B's shape: 16 layers, 2048 hidden, 32 query heads and 8 key/value heads of 64, 8192 MLP, 128256 vocab.
MODEL = dict(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
             num_attention_heads=32, num_key_value_heads=8, head_dim=64, max_position_embeddings=16384,
             tie_word_embeddings=True, rope_parameters={"rope_type": "default", "rope_theta": 500000.0})
PROVIDERS = ("flashtile", "sdpa-cudnn", "sdpa-flashtile", "eager")
COLORS = {"flashtile": "#d62728", "sdpa-cudnn": "#1f77b4", "sdpa-flashtile": "#ff7f0e", "eager": "#7f7f7f"}


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seqlen", default="4k,8k", help="sequence lengths, k = 1024 (default 4k,8k)")
    parser.add_argument("--providers", default=",".join(PROVIDERS), help=f"subset of {','.join(PROVIDERS)}")
    parser.add_argument("--train-steps", type=int, default=5, help="timed training steps (default 5)")
    parser.add_argument("--gen-batch", type=int, default=4, help="prompts per generate() call (default 4)")
    parser.add_argument("--new-tokens", type=int, default=64, help="tokens generate() makes (default 64)")
    parser.add_argument("--layers", type=int, default=MODEL["num_hidden_layers"], help="(default 16: the 1B model)")
    parser.add_argument("--out", default=str(Path(__file__).parent / "results"), help="results folder")
    parser.add_argument("--tag", default="", help="suffix of the results file name")
    args = parser.parse_args(argv)
    args.seqlen = [int(s[:-1]) * 1024 if s.endswith("k") else int(s) for s in args.seqlen.split(",")]
    args.providers = args.providers.split(",")
    unknown = set(args.providers) - set(PROVIDERS)
    if unknown:
        parser.error(f"unknown providers {sorted(unknown)}; choose from {', '.join(PROVIDERS)}")
    return args


# ----------------------------------------------------------------------------------------------------------------
# Providers: the attention implementation to set on the model, and the context the calls run in.


def provider_setup(name):
    """(attn_implementation, context manager factory, flashtile SDPA call totals or None) of a provider, or raise
    RuntimeError why it cannot run. The SDPA providers list the math backend last: a call no fused backend takes
    (torch's checks differ by version) still runs, and sdpa-flashtile's totals say how many calls reached flashtile."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    if name == "flashtile":
        import flashtile.integrations.transformers as ft
        return ft.register(), contextlib.nullcontext, None
    if name == "eager":
        return "eager", contextlib.nullcontext, None
    if name == "sdpa-cudnn":
        order = [SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION,
                 SDPBackend.MATH]
        return "sdpa", lambda: sdpa_kernel(order, set_priority=True), None
    import flashtile.integrations.sdpa as ft_sdpa
    reason = ft_sdpa.available()
    if reason:
        raise RuntimeError(reason)
    totals = {"forward": 0, "backward": 0}
    order = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]

    @contextlib.contextmanager
    def flashtile_backend():
        with ft_sdpa.enabled(), sdpa_kernel(order, set_priority=True):
            try:
                yield
            finally:
                for key, count in ft_sdpa.call_counts().items():
                    totals[key] += count
    return "sdpa", flashtile_backend, totals


# ----------------------------------------------------------------------------------------------------------------
# Measurements


def _sync_time():
    import torch
    torch.cuda.synchronize()
    return time.perf_counter()


def measure_training(model, start_state, context, seqlen, steps):
    """-> dict(tokens_per_s, step_ms, peak_gib, first_loss) of AdamW steps on one sequence of seqlen tokens."""
    import torch
    model.load_state_dict(start_state)
    model.train()
    gen = torch.Generator(device="cuda").manual_seed(0)
    ids = torch.randint(0, MODEL["vocab_size"], (1, seqlen), device="cuda", generator=gen)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=True)
    torch.cuda.reset_peak_memory_stats()
    times, first_loss = [], None
    try:
        with context():
            for step in range(steps + 2):
                begin = _sync_time()
                loss = model(input_ids=ids, labels=ids, use_cache=False).loss
                loss.backward()
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
                end = _sync_time()
                if first_loss is None:
                    first_loss = loss.item()
                if step >= 2:
                    times.append(end - begin)
    finally:
        del optimizer
        model.zero_grad(set_to_none=True)
    step_s = statistics.median(times)
    return dict(tokens_per_s=seqlen / step_s, step_ms=step_s * 1e3, peak_gib=torch.cuda.max_memory_allocated() / 2**30,
                first_loss=first_loss)


def measure_generate(model, context, seqlen, batch, new_tokens):
    """-> dict(prefill_ms, decode_tokens_per_s, peak_gib) of greedy generate() on `batch` prompts of seqlen tokens."""
    import torch
    model.eval()
    gen = torch.Generator(device="cuda").manual_seed(1)
    ids = torch.randint(1, MODEL["vocab_size"], (batch, seqlen), device="cuda", generator=gen)
    torch.cuda.reset_peak_memory_stats()

    def run(n):
        begin = _sync_time()
        with context(), torch.no_grad():
            out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=n,
                                 min_new_tokens=n, do_sample=False, pad_token_id=0)
        end = _sync_time()
        assert out.shape[1] == seqlen + n
        return end - begin

    run(2)  # warm-up: kernels compiled, caches allocated once
    prefill = min(run(1), run(1))
    full = run(new_tokens)
    return dict(prefill_ms=prefill * 1e3, decode_tokens_per_s=(new_tokens - 1) * batch / (full - prefill),
                peak_gib=torch.cuda.max_memory_allocated() / 2**30)


def run_case(model, start_state, provider, seqlen, args):
    import torch
    implementation, context, totals = provider_setup(provider)
    model.set_attn_implementation(implementation)
    row = dict(provider=provider, seqlen=seqlen)
    for kind, measure in (("train", lambda: measure_training(model, start_state, context, seqlen, args.train_steps)),
                          ("generate", lambda: measure_generate(model, context, seqlen, args.gen_batch,
                                                                args.new_tokens))):
        try:
            row[kind] = dict(status="ok", **measure())
        except torch.OutOfMemoryError:
            row[kind] = dict(status="out of memory")
        torch.cuda.empty_cache()
    if totals is not None:
        row["flashtile_sdpa_calls"] = dict(totals)
    return row


# ----------------------------------------------------------------------------------------------------------------
# Output


def _short(seqlen):
    return f"{seqlen // 1024}k" if seqlen % 1024 == 0 else str(seqlen)


def table(rows):
    lines = ["| provider | seq | train tokens/s | train step ms | train peak GiB | first loss | prefill ms | "
             "decode tokens/s | generate peak GiB |", "|---|---|---|---|---|---|---|---|---|"]

    def cell(part, key, fmt):
        return fmt.format(part[key]) if part.get("status") == "ok" else part.get("status", "-")
    for r in rows:
        t, g = r["train"], r["generate"]
        lines.append(f"| {r['provider']} | {_short(r['seqlen'])} | {cell(t, 'tokens_per_s', '{:,.0f}')} | "
                     f"{cell(t, 'step_ms', '{:.1f}')} | {cell(t, 'peak_gib', '{:.1f}')} | "
                     f"{cell(t, 'first_loss', '{:.4f}')} | {cell(g, 'prefill_ms', '{:.1f}')} | "
                     f"{cell(g, 'decode_tokens_per_s', '{:,.0f}')} | {cell(g, 'peak_gib', '{:.1f}')} |")
    return "\n".join(lines)


def plot(data, png_path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = data["results"]
    providers = list(dict.fromkeys(r["provider"] for r in rows))
    seqlens = sorted({r["seqlen"] for r in rows})
    panels = [("train", "tokens_per_s", "training tokens/s"), ("train", "peak_gib", "training peak memory (GiB)"),
              ("generate", "decode_tokens_per_s", "decode tokens/s"), ("generate", "peak_gib",
                                                                       "generate() peak memory (GiB)")]
    fig, axes = plt.subplots(1, len(panels), figsize=(4.6 * len(panels), 3.8))
    width = 0.8 / len(providers)
    for ax, (kind, key, title) in zip(axes, panels):
        for i, provider in enumerate(providers):
            for j, seqlen in enumerate(seqlens):
                part = next((r[kind] for r in rows if r["provider"] == provider and r["seqlen"] == seqlen), None)
                x = j + (i - (len(providers) - 1) / 2) * width
                if part and part.get("status") == "ok":
                    ax.bar(x, part[key], width, color=COLORS.get(provider), label=provider if j == 0 else None)
                elif part:
                    ax.text(x, 0, "OOM" if part["status"] == "out of memory" else "n/a", rotation=90, ha="center",
                            va="bottom", fontsize=8)
        ax.set_xticks(range(len(seqlens)), [f"seq {_short(s)}" for s in seqlens])
        ax.set_title(title, fontsize=10)
    meta = data["meta"]
    fig.suptitle(f"Llama-3.2-1B shape, bf16, {meta['gpu']}, torch {meta['torch']}, {meta['date']}", fontsize=10)
    fig.tight_layout(rect=(0, 0.08, 1, 1))
    fig.legend(*axes[0].get_legend_handles_labels(), loc="lower center", ncol=len(providers), fontsize=9)
    fig.savefig(png_path, dpi=120)
    plt.close(fig)


def main(argv=None):
    args = parse_args(argv)
    import torch
    import transformers

    import flashtile
    if not torch.cuda.is_available():
        print("benchmarks/e2e.py needs a CUDA GPU.", file=sys.stderr)
        return 2
    try:
        from tqdm import tqdm
    except ImportError:
        def tqdm(items, **kwargs):
            return items
    config = transformers.LlamaConfig(**dict(MODEL, num_hidden_layers=args.layers))
    with torch.device("cuda"):
        model = transformers.LlamaForCausalLM(config).to(torch.bfloat16)
    start_state = {k: v.clone() for k, v in model.state_dict().items()}
    cases = [(p, s) for s in args.seqlen for p in args.providers]
    rows, skipped = [], {}
    for provider, seqlen in tqdm(cases, desc="e2e", unit="case"):
        try:
            provider_setup(provider)
        except RuntimeError as err:
            skipped[provider] = str(err)
            continue
        rows.append(run_case(model, start_state, provider, seqlen, args))
        print(table(rows[-1:]).splitlines()[-1], file=sys.stderr, flush=True)
    import triton
    meta = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
                transformers=transformers.__version__, flashtile=flashtile.__version__,
                date=datetime.date.today().isoformat(), parameters=sum(p.numel() for p in model.parameters()),
                model=dict(MODEL, num_hidden_layers=args.layers), train_steps=args.train_steps,
                gen_batch=args.gen_batch, new_tokens=args.new_tokens, skipped=skipped)
    data = dict(meta=meta, results=rows)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    gpu = next((w for w in meta["gpu"].split() if any(c.isdigit() for c in w)), "gpu").lower()  # "h100"
    stem = out / f"{meta['date']}-{gpu}-e2e{'-' + args.tag if args.tag else ''}"
    stem.with_suffix(".json").write_text(json.dumps(data, indent=1) + "\n")
    try:
        plot(data, stem.with_suffix(".png"))
    except ModuleNotFoundError:
        print("matplotlib is not installed: no plot (pip install 'flashtile[bench]').", file=sys.stderr)
    for provider, reason in skipped.items():
        print(f"skipped {provider}: {reason}", file=sys.stderr)
    print(table(rows))
    print(f"\nresults: {stem.with_suffix('.json')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
