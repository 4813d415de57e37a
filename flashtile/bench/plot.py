"""Plot a results JSON written by the suite (runner.py): one panel per (mode, headdim, causal), bars per provider
over seqlen. WRONG results are hatched; errors and skips have no bar. Needs matplotlib (`pip install
flashtile[bench]`); without it the command says so and exits with status 2.

    python -m flashtile bench plot benchmarks/results/2026-11-21-h200.json [--out file.png]
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

# Fixed colours per provider so that plots of different runs compare at a glance.
COLORS = {"flashtile": "#d62728", "flashtile-triton": "#e377c2", "sdpa-cudnn": "#1f77b4", "sdpa-flash": "#2ca02c",
          "flex": "#9467bd", "fa2": "#8c564b", "fa4": "#ff7f0e"}
_MODE_ORDER = {"fwd": 0, "bwd": 1, "fwd+bwd": 2}


def _short(n: int) -> str:
    return f"{n // 1024}k" if n % 1024 == 0 else str(n)


def _dims(row: dict) -> str:
    """A row's head dims for its panel: "128", or "192/128" when v's (headdim_v) differs."""
    dv = row.get("headdim_v")
    return str(row["headdim"]) if dv in (None, row["headdim"]) else f"{row['headdim']}/{dv}"


def plot_results(data: dict, png_path) -> Path:
    """Draw data (the JSON's content) to png_path. Needs matplotlib (raises ModuleNotFoundError without it)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in data["results"] if r.get("mode") in _MODE_ORDER]
    providers = list(dict.fromkeys(r["provider"] for r in rows))
    panels = sorted({(r["mode"], _dims(r), bool(r["causal"])) for r in rows},
                    key=lambda p: (_MODE_ORDER[p[0]], p[2], tuple(int(d) for d in p[1].split("/"))))
    if not panels:
        raise ValueError("no fwd/bwd results to plot")
    ncols = min(3, len(panels))
    nrows = math.ceil(len(panels) / ncols)
    fig, axes = plt.subplots(nrows, ncols, figsize=(5.2 * ncols, 3.6 * nrows), squeeze=False)
    width = 0.8 / max(1, len(providers))
    for ax, (mode, dims, causal) in zip(axes.flat, panels):
        sel = [r for r in rows if (r["mode"], _dims(r), bool(r["causal"])) == (mode, dims, causal)]
        seqlens = sorted({r["seqlen_q"] for r in sel})
        for j, provider in enumerate(providers):
            for x, seqlen in enumerate(seqlens):
                r = next((r for r in sel if r["provider"] == provider and r["seqlen_q"] == seqlen), None)
                if r is None:
                    continue
                pos = x - 0.4 + width * (j + 0.5)
                value = r.get("tflops")
                if not isinstance(value, (int, float)):
                    # no bar, but say why there is none
                    ax.text(pos, 0, f" {r['status']}", rotation=90, ha="center", va="bottom", fontsize=6,
                            color=COLORS.get(provider, "#7f7f7f"))
                    continue
                wrong = r["status"] == "wrong"
                ax.bar(pos, value, width, color=COLORS.get(provider, "#7f7f7f"),
                       hatch="xx" if wrong else None, edgecolor="black" if wrong else "none", linewidth=0.5)
        ax.set_xticks(range(len(seqlens)), [_short(s) for s in seqlens])
        ax.set_xlabel("seqlen (batch = 16k / seqlen)")
        ax.set_ylabel("TFLOP/s")
        ax.set_title(f"{mode} d{dims}{' causal' if causal else ''}")
        ax.grid(axis="y", alpha=0.3)
    for ax in list(axes.flat)[len(panels):]:
        ax.set_visible(False)
    handles = [plt.Rectangle((0, 0), 1, 1, color=COLORS.get(p, "#7f7f7f")) for p in providers]
    labels = list(providers)
    if any(r["status"] == "wrong" for r in rows):
        handles.append(plt.Rectangle((0, 0), 1, 1, facecolor="white", hatch="xx", edgecolor="black"))
        labels.append("WRONG output")
    height = fig.get_figheight()
    header_in = 0.7   # room above the panels for the legend and the run's description
    fig.legend(handles, labels, loc="upper center", ncol=len(labels), frameon=False, bbox_to_anchor=(0.5, 1.0))
    meta = data.get("metadata", {})
    commit = (meta.get("flashtile_commit") or "unknown")[:10]
    fig.text(0.5, 1 - 0.42 / height, f"{meta.get('gpu', '?')}, {meta.get('dtype', '?')}, torch "
             f"{meta.get('torch', '?')}, triton {meta.get('triton', '?')}, flashtile {commit}, "
             f"{str(meta.get('date', ''))[:10]}", ha="center", va="top", fontsize=9)
    fig.tight_layout(rect=(0, 0, 1, 1 - header_in / height))
    png_path = Path(png_path)
    png_path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png_path, dpi=110)
    plt.close(fig)
    return png_path


def plot_file(json_path, png_path=None) -> Path:
    """Plot a results JSON; the PNG goes next to it with the same stem unless png_path is given."""
    json_path = Path(json_path)
    data = json.loads(json_path.read_text())
    return plot_results(data, png_path or json_path.with_suffix(".png"))


def main(argv=None, prog: str = "python -m flashtile bench plot") -> int:
    p = argparse.ArgumentParser(prog=prog, description="Plot a results JSON of `python -m flashtile bench` "
                                "(needs matplotlib).")
    p.add_argument("json", help="results JSON")
    p.add_argument("--out", default=None, help="PNG path (default: next to the JSON, same stem)")
    args = p.parse_args(argv)
    if not Path(args.json).is_file():
        print(f"error: no results file {args.json}", file=sys.stderr)
        return 2
    try:
        path = plot_file(args.json, args.out)
    except ModuleNotFoundError as exc:
        if not (exc.name or "").startswith("matplotlib"):
            raise
        print(f"error: plotting needs matplotlib ({exc}); pip install matplotlib (or flashtile[bench])",
              file=sys.stderr)
        return 2
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
