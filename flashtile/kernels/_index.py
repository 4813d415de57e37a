"""Kernels an earlier process compiled, found again without Triton's cache key (a warm process's first call).

A process's first launch of a kernel goes through Triton's JIT, which looks the compiled kernel up in its disk cache
by a key that hashes Triton's own installation (`triton_key`: ~0.4 s once per process on the GPU machines' hosts)
and the kernel's source with every function it calls (~0.1 s for the Gluon kernels), before loading it. With a warm
cache that was most of a process's first attention call (docs/design-record.md, "Cold start").

So flashtile keeps, next to Triton's cache (<cache dir>/flashtile-index/), one small JSON file per launch key
(_launch's key, made stable across processes: the kernel's module and name stand for the kernel object) naming the
compiled kernel's files in Triton's cache, its signature and the parameter names. A later process's first launch
with that key (`load`) makes the compiled kernel from those files and builds its launcher (whose library Triton
caches too), skipping the JIT.

The file's name hashes the key with a salt of everything else the kernel depends on: flashtile's and Triton's
versions, the digest of flashtile's sources, the size and time of Triton's library, Triton's cache-invalidating
environment variables, the GPU's compute capability, and Triton's debug and instrumentation knobs. A change of any
gives new names, and the old files are no longer read. The index stands aside where Triton is told to compile anew
or to dump or override IR, and for a key whose text would not repeat in another process (an object shown by its
address). Any failure (a missing file, an API this Triton lacks) falls back to the JIT. SETTINGS.fast_launch off or
TRITON_INTERPRET: not used (the JIT takes every launch there anyway).
"""
import functools
import hashlib
import json
import os
import pathlib
import types

import torch
import triton

_DIR = "flashtile-index"


@functools.lru_cache(maxsize=None)
def _salt(capability):
    """Everything a compiled kernel depends on besides its launch key (module docstring), hashed."""
    from triton._C import libtriton
    from triton._C.libtriton import get_cache_invalidating_env_vars
    from .._source import package_digest
    lib = os.stat(libtriton.__file__)
    parts = (triton.__version__, package_digest(), lib.st_size, lib.st_mtime_ns,
             sorted(get_cache_invalidating_env_vars().items()), capability)
    return hashlib.sha256(repr(parts).encode()).hexdigest()


def _stable_text(key):
    """The launch key as text another process would write the same, or None (an object shown by its address)."""
    kernel, *rest = key
    fn = getattr(kernel, "fn", kernel)
    text = repr((f"{fn.__module__}.{fn.__qualname__}", *rest))
    return None if " at 0x" in text else text


def _path(key, device_index):
    """The index file of a launch key, or None where the index stands aside: a key that would not repeat, or Triton
    told to compile anew or to dump or override IR (triton.knobs.compilation)."""
    compilation = triton.knobs.compilation
    if compilation.always_compile or compilation.override or compilation.dump_ir:
        return None
    text = _stable_text(key)
    if text is None:
        return None
    # Run-time knobs that enter Triton's options, hence its kernels: debug (TRITON_DEBUG) and instrumentation.
    text += repr((triton.knobs.runtime.debug, compilation.instrumentation_mode))
    name = hashlib.sha256((_salt(torch.cuda.get_device_capability(device_index)) + text).encode()).hexdigest()
    return pathlib.Path(triton.knobs.cache.dir) / _DIR / f"{name[:40]}.json"


def empty():
    """Whether this Triton cache holds no file of flashtile's index (of any salt): a process that is going to compile
    its kernels (kernels/_compiling.py starts Triton's key for it)."""
    try:
        with os.scandir(pathlib.Path(triton.knobs.cache.dir) / _DIR) as entries:
            return next(entries, None) is None
    except OSError:
        return True


def _tuples(x):
    return tuple(map(_tuples, x)) if isinstance(x, list) else x


def load(key, device_index):
    """The compiled kernel an earlier process indexed under this launch key, loaded on the current device with its
    launcher built, or None."""
    try:
        path = _path(key, device_index)
        if path is None or not path.is_file():
            return None
        record = json.loads(path.read_text())
        group = record["group"]
        if not all(os.path.isfile(p) for p in group.values()):
            return None
        src = types.SimpleNamespace(constants={}, signature={k: _tuples(v) for k, v in record["signature"].items()},
                                    fn=types.SimpleNamespace(arg_names=record["arg_names"]))
        from triton.compiler import CompiledKernel
        compiled = CompiledKernel(src, group, record["hash"])
        compiled._init_handles()
        return compiled
    except Exception:  # noqa: BLE001 - the JIT finds (or compiles) the kernel instead
        return None


def save(key, device_index, compiled):
    """Index a kernel the JIT compiled or found for this launch key (see load). Best effort."""
    try:
        path = _path(key, device_index)
        src = getattr(compiled, "src", None)
        if path is None or path.is_file() or src is None:
            return
        record = dict(hash=compiled.hash, group=dict(compiled.metadata_group), signature=dict(src.signature),
                      arg_names=list(src.fn.arg_names))
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".tmp{os.getpid()}")
        tmp.write_text(json.dumps(record))
        os.replace(tmp, path)
    except Exception:  # noqa: BLE001 - an unindexed kernel is found by the JIT next time
        return
