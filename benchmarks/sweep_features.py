"""Tile sweep for the feature variants of the forward and backward kernels (the measurement behind the feature
rows of kernels/configs.py). bf16, d128, 16 heads, seqlen 16k, batch 1; median of triton.testing.do_bench.

    python benchmarks/sweep_features.py --out DIR [--bwd]

Prints one line per (feature, kernel, tiles) as it goes and writes <date>-<gpu>-sweep-features.json.
"""
from __future__ import annotations

import argparse
import datetime
import json
import sys
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
import triton

import flashtile
from flashtile._settings import override
from flashtile.kernels.configs import TileConfig

DEVICE = "cuda"
FWD_TILES = [None, TileConfig(128, 64, 8, 2), TileConfig(128, 128, 8, 2), TileConfig(128, 64, 8, 3),
             TileConfig(128, 64, 4, 3), TileConfig(64, 64, 4, 3), TileConfig(64, 128, 4, 2)]
DKDV_TILES = [None, TileConfig(64, 64, 8, 2), TileConfig(64, 128, 8, 2), TileConfig(32, 64, 4, 2)]
DQ_TILES = [None, TileConfig(128, 64, 8, 2), TileConfig(64, 64, 4, 2), TileConfig(64, 64, 8, 3)]


def _features(q, k, v, s, h):
    qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))
    bias = torch.randn((1, h, s, s), device=DEVICE, dtype=q.dtype)
    tril = torch.ones((s, s), device=DEVICE, dtype=torch.bool).tril()
    return {
        "plain": lambda: flashtile.flash_attn_func(q, k, v),
        "bias (1,H,S,S)": lambda: flashtile.scaled_dot_product_attention(qt, kt, vt, attn_mask=bias),
        "bool causal mask": lambda: flashtile.scaled_dot_product_attention(qt, kt, vt, attn_mask=tril),
        "softcap": lambda: flashtile.flash_attn_func(q, k, v, softcap=30.0),
        "causal softcap": lambda: flashtile.flash_attn_func(q, k, v, causal=True, softcap=30.0),
        "causal dropout": lambda: flashtile.flash_attn_func(q, k, v, causal=True, dropout_p=0.1),
    }


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=".")
    parser.add_argument("--bwd", action="store_true", help="also sweep the backward kernels' tiles")
    parser.add_argument("--only", default=None, help="feature names separated by semicolons")
    parser.add_argument("--tag", default="", help="suffix of the JSON file's name")
    args = parser.parse_args(argv)
    s, h, d = 16384, 16, 128
    gen = torch.Generator(DEVICE).manual_seed(0)
    q, k, v = (torch.randn((1, s, h, d), generator=gen, device=DEVICE, dtype=torch.bfloat16).requires_grad_()
               for _ in range(3))
    feats = _features(q, k, v, s, h)
    if args.only:
        feats = {name: fn for name, fn in feats.items() if name in args.only.split(";")}
    rows = []

    def record(name, kind, tiles, fn):
        try:
            ms = triton.testing.do_bench(fn, warmup=10, rep=50, return_mode="median")
        except Exception as err:  # noqa: BLE001 - a tile that does not fit is a result of the sweep
            ms = None
            print(f"{name:<18} {kind:<5} {tiles}  failed: {type(err).__name__}", flush=True)
        rows.append(dict(feature=name, kernel=kind, tiles=str(tiles), ms=ms))
        if ms is not None:
            print(f"{name:<18} {kind:<5} {tiles}  {ms:8.3f} ms", flush=True)

    for name, fn in feats.items():
        for tiles in FWD_TILES:
            with override(tiles=None if tiles is None else {"fwd": [tiles]}):
                record(name, "fwd", tiles, fn)
        if not args.bwd:
            continue
        out = fn()
        grad = torch.randn_like(out)
        for kind, table in (("bwd_dkdv", DKDV_TILES), ("bwd_dq", DQ_TILES)):
            for tiles in table:
                with override(tiles=None if tiles is None else {kind: [tiles]}):
                    record(name, kind, tiles, lambda: torch.autograd.grad(fn(), (q, k, v), grad))
    meta = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
                date=datetime.date.today().isoformat(), shape=dict(batch=1, heads=h, seqlen=s, head_dim=d))
    path = Path(args.out) / f"{meta['date']}-{meta['gpu'].split()[-1].lower()}-sweep-features{'-' + args.tag if args.tag else ''}.json"
    path.write_text(json.dumps(dict(meta=meta, rows=rows), indent=1))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
