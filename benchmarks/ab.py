"""Time two revisions of flashtile in one process: the checkout's package ("new") against a git revision's ("base").

The design record's A/B ratios ("the tree before and after in one process") come from runs of this kind: both trees'
kernels alternate on the same GPU, in rotated order, so that clocks, temperature and the host move both alike. The
base revision's package is extracted with `git archive` into a temporary folder under another name
(`flashtile_base`), with its torch.library namespace renamed too, so that both register their ops side by side;
the package's own imports are relative, so each copy runs only its own code. `--base-dir DIR` takes the package in
DIR instead of a revision (on a machine whose copy of the checkout has no usable .git); the results record both
trees' sources digests (flashtile_sources, base_sources).

    python benchmarks/ab.py --base HEAD~1 --headdim 128 --seqlen 1k,2k,4k --causal both --mode both \\
        --rounds 5 --out benchmarks/results/2026-11-27-h100-some-change-ab.json

Per shape (bf16, batch x seqlen = --tokens, heads = --hidden / headdim, [B, S, H, D]; with --headdim-v, v and the
output at that head dim: MLA's 192/128 is --headdim 192 --headdim-v 128 --hidden 3072) and mode: the largest
difference between the two trees' outputs (and gradients), then --rounds rounds of `triton.testing.do_bench`
medians (new, base, and with --cudnn torch's SDPA on cuDNN), rotated; the table gives the medians' TFLOP/s and
new / base. FLOPs and metadata are `python -m flashtile bench`'s (flashtile.bench.runner.flops, collect_metadata;
on a machine whose copy of the tree has a stale .git, set FLASHTILE_COMMIT).
"""
import argparse
import contextlib
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile

import torch
from triton.testing import do_bench

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BASE_NAME = "flashtile_base"


def build_base(rev, dest, name=BASE_NAME, repo=REPO, base_dir=None):
    """Extract revision rev's flashtile package into dest/name, its op namespace renamed to name; returns the
    commit's hash. base_dir: copy the flashtile package in that folder instead (a tree carried to a machine whose
    copy of the checkout has no usable .git); returns "folder <path>" then. Files are rewritten only where they name
    the namespace ("flashtile::" and the torch.library.Library("flashtile", ...) definitions)."""
    if base_dir is not None:
        source = os.path.join(base_dir, "flashtile")
        if not os.path.isfile(os.path.join(source, "__init__.py")):
            raise SystemExit(f"--base-dir {base_dir}: no flashtile package there ({source}/__init__.py)")
        shutil.copytree(source, os.path.join(dest, "flashtile"), ignore=shutil.ignore_patterns("__pycache__"))
        commit = "folder " + os.path.abspath(base_dir)
    else:
        commit = subprocess.run(["git", "-C", repo, "rev-parse", "--verify", rev + "^{commit}"], check=True,
                                capture_output=True, text=True).stdout.strip()
        archive = os.path.join(dest, "base.tar")
        with open(archive, "wb") as f:
            subprocess.run(["git", "-C", repo, "archive", commit, "flashtile"], check=True, stdout=f)
        with tarfile.open(archive) as tar:
            try:
                tar.extractall(dest, filter="data")
            except TypeError:  # (Python < 3.11.4: no extraction filters)
                tar.extractall(dest)
        os.remove(archive)
    root = os.path.join(dest, name)
    os.rename(os.path.join(dest, "flashtile"), root)
    for folder, _, files in os.walk(root):
        for file in files:
            if not file.endswith(".py"):
                continue
            path = os.path.join(folder, file)
            with open(path, encoding="utf-8") as f:
                text = f.read()
            renamed = text.replace("flashtile::", name + "::").replace('Library("flashtile"', f'Library("{name}"')
            if renamed != text:
                with open(path, "w", encoding="utf-8") as f:
                    f.write(renamed)
    return commit


def import_trees(base, dest, base_dir=None, name=BASE_NAME):
    """(new, base, commit): the checkout's flashtile and revision base's copy (or base_dir's package), imported
    as name (build_base into dest)."""
    import importlib
    commit = build_base(base, dest, name=name, base_dir=base_dir)
    sys.path.insert(0, dest)
    sys.path.insert(0, REPO)
    new_mod = importlib.import_module("flashtile")
    if os.path.dirname(os.path.dirname(os.path.abspath(new_mod.__file__))) != REPO:
        raise SystemExit(f"flashtile imports from {new_mod.__file__}, not from this checkout ({REPO}): run from a "
                         f"checkout whose package is the one to time")
    return new_mod, importlib.import_module(name), commit


def _sources(package):
    """The first 16 hex digits of package's sources digest (_source.package_digest, what flashtile_sources records
    for the checkout); None for a tree from before it."""
    import importlib
    try:
        return importlib.import_module(package + "._source").package_digest()[:16]
    except (ImportError, AttributeError):
        return None


def run(args):
    with tempfile.TemporaryDirectory() as dest:
        new_mod, base_mod, commit = import_trees(args.base, dest, args.base_dir)
        from flashtile.bench import runner
        providers = {"new": new_mod, "base": base_mod}
        rows = []
        for batch, heads, seqlen, d, dv, causal in shapes(args):
            q, k, v, dout = make_inputs(batch, seqlen, heads, d, dv, causal, "cuda")
            for mode in args.mode:
                flops = runner.flops(batch, heads, seqlen, seqlen, d, causal, mode, None if dv == d else dv)
                rows.append(_time_shape(providers, q, k, v, dout, causal, mode, flops, args))
                r = rows[-1]
                print(f"d{d}{'' if dv == d else f'/{dv}'} S{seqlen:6d} {'causal' if causal else 'full  '} {mode} "
                      + " ".join(f"{n} {t:6.1f}" for n, t in r["tflops"].items())
                      + f"  new/base {r['new_over_base']:.3f}  diff {r['max_diff']:.1e}", flush=True)
        meta = runner.collect_metadata(vars(args), "bf16")
        meta.update(
            base_commit=commit, base_sources=_sources(BASE_NAME),
            what="benchmarks/ab.py: new = the checkout (flashtile_commit, flashtile_sources), base = base_commit "
            "(base_sources), in one process; TFLOP/s medians of triton.testing.do_bench over rotated rounds",
            timing="per round the median of triton.testing.do_bench(fn, warmup, rep); fwd = flash_attn_func(q, k, v, "
            "causal) with inputs that require grad, bwd = torch.autograd.grad(out, (q, k, v), dout, "
            "retain_graph=True) on a graph built once per provider (cudnn: SDPA on [B, H, S, D] copies); round r "
            "starts at the r-th provider; each row's tflops are the medians of its rounds",
            check="max_diff: the largest absolute difference between the two trees' outputs (bwd: gradients) on the "
                  "same inputs")
        if args.out:
            with open(args.out, "w") as f:
                json.dump(dict(metadata=meta, rows=rows), f, indent=1)
            print("wrote", args.out)
    return rows


def shapes(args):
    """(batch, heads, seqlen, d, dv, causal) of every shape the A/B times, in order: heads = hidden / d, batch =
    tokens / seqlen, dv = --headdim-v (v's and the output's head dim, e.g. MLA's 128 beside q's and k's 192) or d."""
    return [(max(args.tokens // seqlen, 1), args.hidden // d, seqlen, d, args.headdim_v or d, causal)
            for d in args.headdim for seqlen in args.seqlen for causal in args.causal]


def make_inputs(batch, seqlen, heads, d, dv, causal, device):
    """q, k (d columns) and v, dout (dv columns), bfloat16 [B, S, H, *], seeded by the shape; q, k, v require grad."""
    gen = torch.Generator(device).manual_seed(seqlen + d + dv + causal)
    q, k, v, dout = (torch.randn(batch, seqlen, heads, cols, device=device, generator=gen, dtype=torch.bfloat16)
                     for cols in (d, d, dv, dv))
    for t in (q, k, v):
        t.requires_grad_()
    return q, k, v, dout


def _cudnn_scope(name):
    """SDPA's cuDNN backend around the cuDNN provider's calls (its forward picks the backend per call)."""
    if name != "cudnn":
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel
    return sdpa_kernel(SDPBackend.CUDNN_ATTENTION)


def _time_shape(providers, q, k, v, dout, causal, mode, flops, args):
    """One row: the trees' largest difference, then the providers' TFLOP/s over rotated rounds."""
    batch, seqlen, heads, d = q.shape
    dv = v.shape[-1]
    fns, results = {}, {}
    for name, mod in providers.items():
        if mode == "fwd":
            fns[name] = (lambda mod=mod: mod.flash_attn_func(q, k, v, causal=causal))
            results[name] = [fns[name]().detach()]
        else:
            out = mod.flash_attn_func(q, k, v, causal=causal)
            fns[name] = (lambda out=out: torch.autograd.grad(out, (q, k, v), dout, retain_graph=True))
            results[name] = list(fns[name]())
    diff = max((a.float() - b.float()).abs().max().item() for a, b in zip(results["new"], results["base"]))
    if args.cudnn:
        qt, kt, vt = (t.detach().transpose(1, 2).contiguous().requires_grad_() for t in (q, k, v))
        if mode == "fwd":
            fns["cudnn"] = lambda: torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, is_causal=causal)
        else:
            with _cudnn_scope("cudnn"):
                out_t = torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, is_causal=causal)
            dout_t = dout.transpose(1, 2).contiguous()
            fns["cudnn"] = lambda: torch.autograd.grad(out_t, (qt, kt, vt), dout_t, retain_graph=True)

    names = list(fns)
    times = {n: [] for n in names}
    for r in range(args.rounds):
        for i in range(len(names)):
            name = names[(r + i) % len(names)]
            with _cudnn_scope(name):
                ms = do_bench(fns[name], warmup=args.warmup, rep=args.rep, return_mode="median")
            times[name].append(flops / ms / 1e9)
    medians = {n: sorted(x)[len(x) // 2] for n, x in times.items()}
    return dict(headdim=d, headdim_v=dv, seqlen=seqlen, batch=batch, heads=heads, causal=causal, mode=mode,
                tflops=medians, rounds=times, new_over_base=medians["new"] / medians["base"], max_diff=diff)


def build_parser():
    p = argparse.ArgumentParser(prog="python benchmarks/ab.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--base", default="HEAD", help="the git revision to time against (default HEAD)")
    p.add_argument("--base-dir", metavar="DIR", help="time the flashtile package in DIR instead of a revision (e.g. a "
                   "`git archive` of one, carried to a GPU machine whose copy of the checkout has no usable .git)")
    p.add_argument("--headdim", default="128", help="e.g. 64,128")
    p.add_argument("--seqlen", default="1k,4k,16k", help="e.g. 1k,2k,4k")
    p.add_argument("--causal", choices=("0", "1", "both"), default="both")
    p.add_argument("--mode", choices=("fwd", "bwd", "both"), default="both")
    p.add_argument("--headdim-v", type=int, help="v's head dim when it differs from q's and k's, e.g. --headdim 192 "
                   "--headdim-v 128 --hidden 3072 for MLA's 16 heads (default: --headdim's)")
    p.add_argument("--hidden", type=int, default=2048, help="heads = hidden / headdim (default 2048)")
    p.add_argument("--tokens", type=int, default=16384, help="batch = tokens / seqlen (default 16384)")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--warmup", type=int, default=25)
    p.add_argument("--rep", type=int, default=100)
    p.add_argument("--cudnn", action="store_true", help="time torch's SDPA on cuDNN in the same rounds")
    p.add_argument("--out", help="write the rows and metadata as JSON here")
    return p


def parse_args(argv=None):
    """The command line as run() takes it: head dims and lengths as lists of ints, causal and mode as lists."""
    args = build_parser().parse_args(argv)
    from flashtile.bench.runner import parse_list  # (the checkout's: import_trees checks where it comes from)
    args.headdim, args.seqlen = parse_list(args.headdim), parse_list(args.seqlen)
    args.causal = {"0": [False], "1": [True], "both": [False, True]}[args.causal]
    args.mode = ["fwd", "bwd"] if args.mode == "both" else [args.mode]
    return args


def main(argv=None):
    sys.path.insert(0, REPO)
    args = parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("benchmarks/ab.py times kernels on a CUDA GPU")
    run(args)


if __name__ == "__main__":
    main()
