"""Draw the user guide's figures into docs/figures/ (the PNGs are committed; CI redraws them before building).

    python docs/figures.py [--results benchmarks/results]

- tiling.png: the blocks a causal forward visits (derivation ch. 4-5): each query block is one program, streaming
  the key/value blocks fully below the diagonal without a mask, then the diagonal blocks with it; blocks above are
  never read.
- memory.png: memory against sequence length for one attention layer's forward+backward: what naive attention keeps
  (the Sq x Sk scores and probabilities) against what flashtile keeps (q, k, v, out and the LSE), both counted from
  the tensors each stores, with the peaks measured on a GPU (`python -m flashtile bench --memory`) where a results
  file has them.
- tflops.png: TFLOP/s against peers from the newest `python -m flashtile bench` suite results file (same run, same
  GPU).
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
OUT = Path(__file__).resolve().parent / "figures"
COLORS = {"flashtile": "#d62728", "sdpa-cudnn": "#1f77b4", "sdpa-flash": "#2ca02c", "flex": "#9467bd",
          "fa2": "#8c564b", "fa4": "#ff7f0e", "naive": "#7f7f7f"}


def _pyplot():
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def tiling(path, seqlen=512, block_m=128, block_n=64):
    """Query blocks (rows) against key blocks (columns) of a causal square attention."""
    from matplotlib.patches import Patch, Rectangle
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(5.6, 4.6))
    kinds = {"full": "#9ecae1", "diagonal": "#fdae6b", "skipped": "#f0f0f0"}
    for i in range(0, seqlen, block_m):
        for j in range(0, seqlen, block_n):
            if j + block_n - 1 <= i:  # every key of the block is visible to every row: no mask needed
                kind = "full"
            elif j <= i + block_m - 1:  # the diagonal crosses the block: masked
                kind = "diagonal"
            else:
                kind = "skipped"
            ax.add_patch(Rectangle((j, i), block_n, block_m, facecolor=kinds[kind], edgecolor="white", lw=1.5))
    ax.plot([0, seqlen], [0, seqlen], color="black", lw=1)
    for i in range(0, seqlen, block_m):
        ax.annotate("", xy=(min(i + block_m, seqlen) - 4, i + block_m / 2), xytext=(4, i + block_m / 2),
                    arrowprops=dict(arrowstyle="->", color="#444444", lw=1))
    ax.set_xlim(0, seqlen)
    ax.set_ylim(seqlen, 0)
    ax.set_xlabel(f"keys (blocks of BLOCK_N = {block_n})")
    ax.set_ylabel(f"queries (blocks of BLOCK_M = {block_m})")
    ax.set_title("Causal forward: one program per query block, streaming key blocks", fontsize=10)
    ax.legend(handles=[Patch(color=kinds["full"], label="stage 1: below the diagonal, no mask"),
                       Patch(color=kinds["diagonal"], label="stage 2: on the diagonal, masked"),
                       Patch(facecolor=kinds["skipped"], edgecolor="#cccccc", label="never loaded")],
              loc="lower left", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=130)
    plt.close(fig)


def _measured_memory(results):
    """{provider: [(seqlen, MiB, batch, heads)]} of `python -m flashtile bench --memory` rows (causal, head dim 128),
    and the GPU's name."""
    points, gpu = {}, None
    for file in sorted(Path(results).glob("*memory*.json")):
        data = json.loads(file.read_text())
        for row in data.get("results", []):
            if row.get("status") == "ok" and row.get("peak_mib") and row.get("causal") and row["headdim"] == 128:
                points.setdefault(row["provider"], []).append((row["seqlen_q"], row["peak_mib"], row["batch"],
                                                               row["heads"]))
                gpu = data.get("metadata", {}).get("gpu", gpu)
    return points, gpu


def memory(path, results, heads=16, head_dim=128):
    """Bytes one layer keeps between its forward and backward (batch 1, bf16), naive against flashtile."""
    plt = _pyplot()
    seqlens = [2 ** p for p in range(10, 18)]
    mib = 2 ** 20
    qkvo = [4 * s * heads * head_dim * 2 / mib for s in seqlens]
    naive = [q + heads * s * s * (4 + 2) / mib for q, s in zip(qkvo, seqlens)]  # fp32 scores + bf16 probabilities
    flash = [q + heads * s * 4 / mib for q, s in zip(qkvo, seqlens)]  # + fp32 LSE
    fig, ax = plt.subplots(figsize=(5.6, 4.2))
    ax.loglog(seqlens, naive, "-", color=COLORS["naive"], label="naive attention (counted): O(S²)")
    ax.loglog(seqlens, flash, "-", color=COLORS["flashtile"], label="flashtile (counted): O(S)")
    points, gpu = _measured_memory(results)
    for provider, pts in points.items():
        scale = [(s, m * heads / (b * h)) for s, m, b, h in pts]  # per the plotted batch 1 x 16 heads
        ax.loglog(*zip(*scale), "o", color=COLORS.get(provider, "black"),
                  label=f"{provider}, measured peak ({gpu})")
    ax.axhline(80 * 1024, color="black", lw=0.8, ls=":")
    ax.text(seqlens[-1], 80 * 1024 * 0.6, "80 GiB (one H100)", fontsize=8, ha="right", va="top")
    ax.set_xlabel("sequence length")
    ax.set_ylabel("MiB (batch 1, 16 heads of 128, bf16)")
    ax.set_title("Memory of one attention layer, forward + backward", fontsize=10)
    ax.legend(fontsize=7, loc="upper left")
    fig.tight_layout()
    fig.savefig(path, dpi=130)
    plt.close(fig)


def _newest_suite(results):
    """The suite (or matrix) results file with peers whose run is the newest (by the date it records), its data and
    rows."""
    found = []
    for file in [f for pattern in ("*suite*.json", "*matrix*.json") for f in Path(results).glob(pattern)]:
        data = json.loads(file.read_text())
        rows = [r for r in data.get("results", []) if r.get("status") == "ok" and r.get("tflops")]
        if len({r["provider"] for r in rows}) > 1:
            found.append((data.get("metadata", {}).get("date", ""), file.name, file, data, rows))
    if not found:
        return None, None, []
    return max(found, key=lambda f: f[:2])[2:]


def tflops(path, results):
    """Bars of TFLOP/s per provider for each (mode, head dim, causal) at the suite's longest sequence."""
    file, data, rows = _newest_suite(results)
    if not rows:
        print(f"tflops.png: no suite results with peers under {results}; kept the committed figure")
        return False
    plt = _pyplot()
    longest = max(r["seqlen_q"] for r in rows)
    rows = [r for r in rows if r["seqlen_q"] == longest]
    def group(r):  # (mode, q/k head dim, v's head dim, causal): MLA's 192/128 apart from d192
        return r["mode"], r["headdim"], r.get("headdim_v") or r["headdim"], r["causal"]

    groups = sorted({group(r) for r in rows}, key=lambda g: (g[0] != "fwd", g[3], g[1], g[2]))
    providers = list(dict.fromkeys(r["provider"] for r in rows))
    width = 0.8 / len(providers)
    fig, ax = plt.subplots(figsize=(max(9.0, 0.45 * len(groups)), 4.4))
    for i, provider in enumerate(providers):
        values = [next((r["tflops"] for r in rows if r["provider"] == provider and group(r) == g), 0) for g in groups]
        ax.bar([x + (i - (len(providers) - 1) / 2) * width for x in range(len(groups))], values, width,
               color=COLORS.get(provider), label=provider)
    labels = [f"{m} d{d}{f'/{dv}' if dv != d else ''}{' causal' if c else ''}" for m, d, dv, c in groups]
    ax.set_xticks(range(len(groups)), labels, fontsize=8, rotation=40, ha="right")
    ax.set_ylabel("TFLOP/s")
    meta = data.get("metadata", {})
    ax.set_title(f"seqlen {longest // 1024}k, bf16, {meta.get('gpu')}, torch {meta.get('torch')}, triton "
                 f"{meta.get('triton')} ({file.name})", fontsize=9)
    ax.legend(fontsize=8, ncol=len(providers))
    fig.tight_layout()
    fig.savefig(path, dpi=130)
    plt.close(fig)
    return True


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--results", default=str(ROOT / "benchmarks" / "results"),
                        help="folder of `python -m flashtile bench` results (default benchmarks/results)")
    args = parser.parse_args(argv)
    OUT.mkdir(exist_ok=True)
    tiling(OUT / "tiling.png")
    memory(OUT / "memory.png", args.results)
    tflops(OUT / "tflops.png", args.results)
    print(f"figures in {OUT}")


if __name__ == "__main__":
    main()
