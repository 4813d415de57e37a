"""The benchmark `python -m flashtile bench` runs: flashtile against its peers, in the same run on the same GPU.

    python -m flashtile bench [options]              the attention suite: TFLOP/s and ratios (runner.py)
    python -m flashtile bench features [options]     each feature's cost against the plain kernel (features.py)
    python -m flashtile bench decode [options]       KV-cache decoding against SDPA and flash-attn (decode.py)
    python -m flashtile bench host [options]         host time of small eager calls against SDPA (host.py)
    python -m flashtile bench cold [options]         import and first-call time of fresh processes (cold.py)
    python -m flashtile bench fp8 [options]          the FP8 forward against bf16 and SDPA cuDNN (fp8.py)
    python -m flashtile bench plot FILE [--out PNG]  re-plot a suite's results JSON (plot.py; needs matplotlib)

Each takes --help. The benchmarks need a CUDA GPU (their --help does not); results are JSON (the suite adds a PNG
when matplotlib is installed: `pip install flashtile[bench]`) written to --out, ./bench-results by default, with
the GPU, torch, triton and the date. Modules: registry (providers and shapes), runner (flops, the correctness
check, timing, the table, results files), plot, features, decode, host, cold, fp8. `import flashtile` never imports
this package.
"""
import importlib
import sys

PROG = "python -m flashtile bench"

# sub-command -> (module of this package whose main(argv, prog) runs it, one line for the usage text)
SUBCOMMANDS = {
    "features": ("features", "each feature's cost against the plain kernel (16k, d128, bf16)"),
    "decode": ("decode", "KV-cache decoding against torch SDPA and flash-attn"),
    "host": ("host", "host time of small eager calls against torch SDPA (--cpu: flashtile's Python alone)"),
    "cold": ("cold", "import and first-call time in fresh processes, empty and filled Triton cache"),
    "fp8": ("fp8", "the FP8 forward (d128) against the bf16 forward and torch SDPA cuDNN"),
    "plot": ("plot", "re-plot a suite's results JSON (needs matplotlib)"),
}


def main(argv=None, prog=PROG):
    """Run the suite, or the sub-command named by argv[0]; returns the exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in SUBCOMMANDS:
        module = importlib.import_module(f"{__name__}.{SUBCOMMANDS[argv[0]][0]}")
        return module.main(argv[1:], prog=f"{prog} {argv[0]}")
    from . import runner

    return runner.main(argv, prog=prog)
