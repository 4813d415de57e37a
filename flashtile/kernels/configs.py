"""Tile, warp and stage choices per GPU family, and how a launch picks its memory path.

Each choice names the measurement that made it. A launch tries its candidates in order and keeps the first that
compiles and fits (shared memory, registers, compiler crashes), so a table entry that is too big for a GPU costs one
failed compile, not a crash. SETTINGS.tiles (tests, the tile sweep) replaces the candidate lists and SETTINGS.tma
forces the memory path (flashtile/_settings.py); both are read at every launch.
"""
import dataclasses
import functools
import logging
from typing import Callable, NamedTuple, Sequence

import torch
import triton
from triton.compiler.errors import CompilationError
from triton.runtime.errors import OutOfResources

from .._settings import SETTINGS
from . import _common

log = logging.getLogger("flashtile")

# TMA descriptors need 16-byte aligned base addresses and strides.
TMA_ALIGN_BYTES = 16
# Smallest head-dim tile: tl.dot needs K >= 16.
MIN_BLOCK_D = 16


def tile_override(kind):
    """The candidate list SETTINGS.tiles puts in place of the table's for a kernel family ("fwd", "bwd_dkdv",
    "bwd_dq"): a list applies to every family, a dict {family: list} to those it names; None: the table's. The
    decode kernel has its own, SETTINGS.decode_tiles."""
    tiles = SETTINGS.tiles
    if isinstance(tiles, dict):
        tiles = tiles.get(kind)
    return None if tiles is None else list(tiles)


# Whether kernels run in Triton's interpreter (TRITON_INTERPRET=1, decided when they are decorated).
INTERPRETING = _common.INTERPRETING


@dataclasses.dataclass(frozen=True)
class TileConfig:
    block_m: int  # query rows per tile
    block_n: int  # key rows per tile
    num_warps: int
    num_stages: int


@dataclasses.dataclass(frozen=True)
class LaunchSpec:
    """What a launch's constexprs depend on besides the tiles."""
    use_tma: bool
    precision: str  # tl.dot input_precision for fp32 operands: "ieee" or "tf32"
    dot_upcast: bool  # interpreter 16-bit workaround, see _common._mma
    arch: int  # compute capability major (0 in the interpreter / on the CPU)

    @staticmethod
    def block_d(head_dim):
        return max(MIN_BLOCK_D, triton.next_power_of_2(head_dim))


def _tma_ok(tensors):
    for t in tensors:
        if t.data_ptr() % TMA_ALIGN_BYTES:
            return False
        # A zero stride (an expanded tensor, e.g. the gradient of out.sum()) is no valid TMA stride either.
        if any(s == 0 or (s * t.element_size()) % TMA_ALIGN_BYTES for s in t.stride()[:-1]):
            return False
    return True


@functools.lru_cache(maxsize=None)
def _arch(device_index):
    return torch.cuda.get_device_capability(device_index)[0]


def launch_spec(q, tensors, tma=True):
    """The LaunchSpec of a launch on q's device and dtype. tensors: those the kernel would read or write through
    TMA descriptors; tma=False for kernels that never use them (decode)."""
    arch = 0
    if q.is_cuda and not INTERPRETING:
        arch = _arch(q.get_device())
    if not tma:
        use_tma = False
    elif SETTINGS.tma is not None:
        use_tma = SETTINGS.tma
    else:
        use_tma = arch >= 9 and _tma_ok(tensors)
    if use_tma:
        _set_tma_allocator(q.device)
    # fp32 follows torch's matmul flag; 16-bit operands ignore the setting. The interpreter computes in fp32.
    if q.dtype == torch.float32 and (INTERPRETING or not torch.backends.cuda.matmul.allow_tf32):
        precision = "ieee"
    else:
        precision = "tf32"
    return LaunchSpec(use_tma=use_tma, precision=precision,
                      dot_upcast=INTERPRETING and q.dtype != torch.float32, arch=arch)


class _Scratch:
    """Triton's allocator for one device's global scratch: descriptors made inside a kernel live in a small buffer
    that the launch asks the host for. One buffer per stream serves every launch on it (kernels on one stream run
    one after the other, and none of ours overlaps the next through programmatic dependent launch), grown when a
    launch asks for more: a launch then allocates nothing, where a new tensor per launch cost a torch.empty of host
    time on the backward's path. Under CUDA-graph capture each launch gets a buffer of its own from the graph's pool,
    which the graph keeps alive (a kept buffer could be replaced, and freed, after the capture)."""

    def __init__(self, device):
        self.device = device
        self.buffers = {}

    def __call__(self, size, alignment, stream):
        if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
            return torch.empty(size, dtype=torch.int8, device=self.device)
        buffer = self.buffers.get(stream)
        if buffer is None or buffer.numel() < size:
            buffer = torch.empty(size, dtype=torch.int8, device=self.device)
            self.buffers[stream] = buffer
        return buffer


_SCRATCH: dict = {}


def _set_tma_allocator(device):
    # Set on every TMA launch, not once: Triton keeps the allocator in a ContextVar, and autograd runs the backward
    # on a thread of its own.
    scratch = _SCRATCH.get(device)
    if scratch is None:
        scratch = _SCRATCH[device] = _Scratch(device)
    triton.set_allocator(scratch)


# Interpreter: the hardware limits don't apply; 64x64 tiles keep the number of interpreted programs small while
# still giving several blocks (ragged edges, causal stages) at the test sizes.
_INTERPRETER_TILES = [TileConfig(64, 64, 4, 1)]
# Last resorts, tried in order when a table entry does not fit; small enough for any head dim up to 256 in fp32.
_SAFE_TILES = [TileConfig(64, 64, 4, 2), TileConfig(64, 32, 4, 1), TileConfig(32, 32, 4, 1)]


# Feature variants whose best forward tiles differ from the plain kernel's: H200, bf16, d128, 16 heads, seqlen 16k
# (benchmarks/results/2026-11-21-h200-sweep-features-*.json; against the plain table entries in the same run).
# Keyed by (bias kind: 0 none / 1 float / 2 bool, softcap on, causal).
_H200_D128_FEATURE_TILES = {
    (1, False, False): TileConfig(128, 64, 8, 3),   # float bias: 5.62 ms (plain-table tiles 5.92)
    (2, False, False): TileConfig(128, 128, 8, 2),  # bool mask: 4.41 ms (4.85)
}
# Causal softcap measured 2.32 ms at 64x64 w4 s3 in the sweep but 2.68-2.72 when re-timed in a later run (the
# table tiles: 2.60-2.72); not reproducible, so not in the table (docs/design-record.md, "Features on the portable
# kernels").


# Paged K/V (pointer loads, no TMA) at sm90, 16-bit, 64 < d <= 128. Offline sm90 compiles (Triton 3.6, pages of 16
# and 256): the table's non-causal 128x64 w4 s2 spills 166-195 registers with pointer loads (the contiguous kernel's
# TMA loads do not), 128x64 w8 s2 none, 128x128 w8 s3 0-11. Chosen by spills, not yet timed.
_SM90_PAGED_TILES = [TileConfig(128, 64, 8, 2), TileConfig(128, 128, 8, 3)]


def forward_candidates(head_dim, causal, dtype, spec, bias_kind=0, softcap=False, paged=False) -> list[TileConfig]:
    """Tiles to try, best first. bias_kind (features.BIAS_*: 0 none, 1 float, 2 bool) and softcap select the
    feature variants measured separately; paged: keys and values read through a block table."""
    if tile_override("fwd") is not None:
        return tile_override("fwd")
    if spec.arch == 0:
        return _INTERPRETER_TILES
    if paged and spec.arch == 9 and dtype != torch.float32 and 64 < head_dim <= 128:
        return _SM90_PAGED_TILES + _SAFE_TILES
    feature_tiles = _H200_D128_FEATURE_TILES.get((bias_kind, softcap, causal))
    if spec.arch == 9 and dtype != torch.float32 and 64 < head_dim <= 128 and feature_tiles is not None:
        return [feature_tiles] + _SAFE_TILES
    if head_dim > 256:
        return _WIDE_HEAD_TILES
    wide = dtype == torch.float32  # fp32 tiles take twice the shared memory and registers
    if spec.arch == 9 and not wide:
        # H200, bf16, seqlen 16k, hidden 2048 (benchmarks/results/2026-11-21-h200-tune-fwd.json).
        if head_dim <= 64:
            # 128x64 w4 s3: 425 TFLOP/s non-causal, 408 causal (w8 s3: 422 / 401; w4 s2: 412 / 369).
            first = [TileConfig(128, 64, 4, 3)]
        elif head_dim <= 128:
            # Causal 128x128 w8 s3: 498-512 (128x64 w4 s2: 463-499 with 14 spills). Non-causal 128x64 w4 s2:
            # 518-546. (tl.range warp specialization reached 526-564 but returned a wrong LSE on Triton 3.6:
            # docs/design-record.md, "Warp specialization returned a wrong LSE"; the kernels no longer have that
            # path.)
            first = [TileConfig(128, 128, 8, 3)] if causal else [TileConfig(128, 64, 4, 2)]
        else:
            first = [TileConfig(128, 64, 8, 2)]  # 512-530; 4 warps spill (105)
    elif not wide:
        # Other GPUs: Ampere-sized tiles (no TMA, ~100-164 KB shared memory); not measured here.
        first = [TileConfig(128, 64, 4, 2)] if head_dim <= 64 else [TileConfig(64, 64, 4, 2)]
    elif head_dim <= 128:
        first = [TileConfig(64, 64, 4, 2)]  # fp32: measured only for correctness (tests/test_gpu.py)
    else:
        # fp32 past 128: a 64x256 fp32 accumulator is 128 registers a thread at 4 warps and spilled for minutes
        # of compile on an H200; 8 warps halve it. Sized by register count, not tuned.
        first = [TileConfig(64, 32, 8, 1), TileConfig(32, 32, 8, 1)]
    return first + _fallbacks(head_dim, dtype)


# Head dims past 256 (to 512, and MLA's 192/128 pair is sized by its larger dim): accumulators of 512 columns;
# 8 warps and short tiles keep them in registers. Chosen by register count, not tuned.
_WIDE_HEAD_TILES = [TileConfig(64, 32, 8, 1), TileConfig(32, 32, 8, 1), TileConfig(16, 16, 4, 1)]


def _fallbacks(head_dim, dtype):
    """What to try after the table's entries. Not the 4-warp _SAFE_TILES for fp32 past head dim 128: those spill
    so badly that compiling them takes minutes, worse than failing."""
    return [] if dtype == torch.float32 and head_dim > 128 else _SAFE_TILES


def backward_candidates(head_dim, causal, dtype, spec):
    """-> (dK/dV kernel tiles, dQ kernel tiles). For dK/dV, block_n is the resident key block and block_m the
    streamed query block; for dQ, block_m is the resident query block."""
    wide = dtype == torch.float32
    if spec.arch == 0:
        dkdv, dq = _INTERPRETER_TILES, _INTERPRETER_TILES
    elif head_dim > 256:
        dkdv, dq = _WIDE_HEAD_TILES[1:], _WIDE_HEAD_TILES[1:]
    elif spec.arch == 9 and not wide:
        # H200, bf16, seqlen 16k (benchmarks/results/2026-11-21-h200-tune-bwd_*.json; whole backward timed while
        # one kernel's tiles vary). dQ 128x64 w8 s3 at d64 and d128. dK/dV non-causal 64x64 w4 s2 (389 d64, 441
        # d128); causal 32x64 w4 s2 at d64 (359), 64x128 w8 s2 at d128 (409). d256: dK/dV 64x64 w8 s2 (183;
        # 4 warps spill), dQ 64x32 w4 s3 (230): register-bound, needs restructuring.
        if head_dim <= 64:
            dkdv, dq = [TileConfig(32, 64, 4, 2) if causal else TileConfig(64, 64, 4, 2)], [TileConfig(128, 64, 8, 3)]
        elif head_dim <= 128:
            dkdv, dq = [TileConfig(64, 128, 8, 2) if causal else TileConfig(64, 64, 4, 2)], [TileConfig(128, 64, 8, 3)]
        else:
            dkdv, dq = [TileConfig(64, 64, 8, 2)], [TileConfig(64, 32, 4, 3)]
    elif not wide:
        dkdv, dq = [TileConfig(64, 64, 4, 2)], [TileConfig(64, 64, 4, 2)]
    elif head_dim <= 128:
        dkdv, dq = [TileConfig(32, 64, 4, 1)], [TileConfig(64, 32, 4, 1)]
    else:
        # fp32 past 128: dK and dV accumulators of 32x256 fp32 over 8 warps (32 registers each). Not tuned.
        dkdv, dq = [TileConfig(32, 32, 8, 1)], [TileConfig(32, 32, 8, 1)]
    if spec.arch != 0 and head_dim <= 256:
        dkdv, dq = dkdv + _fallbacks(head_dim, dtype), dq + _fallbacks(head_dim, dtype)
    if tile_override("bwd_dkdv") is not None:
        dkdv = tile_override("bwd_dkdv")
    if tile_override("bwd_dq") is not None:
        dq = tile_override("bwd_dq")
    return dkdv, dq


# The tile choices: launch key (kernel family, what the compiled kernel depends on besides the tiles, the candidate
# list) -> Choice, so that later calls go straight to the candidate that compiled instead of failing again on those
# before it. It also keeps the compiled kernel of the family's last launch with that key, for the sweep's register
# and spill counts (None in the interpreter). The compiled kernels themselves are _launch's (_COMPILED).
_CHOSEN: dict = {}


class Choice(NamedTuple):
    index: int  # into the candidate list: 0 the tuned entry, more a fallback
    compiled: object  # what the last launch returned


def chosen(kind, head_dim, causal, dtype, variant=None):
    """The TileConfigs that launches of a kernel family settled on so far, with their candidate index (0: the
    tuned entry, more: a fallback); the GPU tests read it. variant: a Features.variant() tuple to keep only the
    launches with those feature flags (the launch keys hold it at index 5, the backward's with more flags after
    it); None keeps every variant."""
    return [(cands[choice.index], choice.index) for key, choice in _CHOSEN.items() for cands in (key[-1],)
            if key[:4] == (kind, head_dim, causal, dtype)
            and (variant is None or tuple(key[5][:len(variant)]) == tuple(variant))]


def compiled_kernels(kind, head_dim=None):
    """[(key, TileConfig, compiled kernel)] of the launches of a kernel family (of head_dim, if given) so far: the
    tile sweep reads registers and spills from them."""
    return [(key, key[-1][choice.index], choice.compiled) for key, choice in _CHOSEN.items()
            if key[0] == kind and (head_dim is None or key[1] == head_dim)]


def _is_fit_failure(err):
    # What a candidate that is too big or too clever for this GPU looks like: out of shared memory or registers,
    # or a compiler pass failing on it.
    if isinstance(err, (OutOfResources, CompilationError)):
        return True
    return isinstance(err, RuntimeError) and "PassManager" in str(err)


def launch_first_that_compiles(key, candidates: Sequence[TileConfig], launch: Callable[[TileConfig], object]):
    """Launch with the first candidate that compiles and fits; remember it for the key. Returns the TileConfig.

    The key is what the compiled kernel depends on besides the tiles (kernel family, head dim, causal, dtype,
    LaunchSpec); the candidate list itself joins it, so that an index remembered under one list (a test's or the
    sweep's SETTINGS.tiles) is never applied to another."""
    key = key + (tuple(candidates),)
    choice = _CHOSEN.get(key)
    for i in range(choice.index if choice is not None else 0, len(candidates)):
        try:
            compiled = launch(candidates[i])
        except Exception as err:  # noqa: BLE001 - narrowed by _is_fit_failure, anything else re-raised
            if not _is_fit_failure(err) or i == len(candidates) - 1:
                raise
            log.info("flashtile: %s does not fit %s (%s: %s); trying the next tiles", candidates[i], key,
                     type(err).__name__, str(err).splitlines()[0] if str(err) else "")
            continue
        _CHOSEN[key] = Choice(i, compiled)
        return candidates[i]
    raise AssertionError("unreachable: the last candidate either returns or raises")
