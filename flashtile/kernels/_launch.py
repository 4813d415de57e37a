"""The one launcher of every kernel (portable and Gluon; forward, backward, decode) and its compile cache.

`kernel[grid](*args, **constexprs)` (JITFunction.run) re-derives on every call what the compiled kernel depends on:
each argument's specialization (a tensor's dtype and 16-byte alignment; an integer's width, whether it is 1, whether
it is divisible by 16; a tuple's fields one by one), the cache key string built from them, and the launch metadata.
For the Gluon kernels (~45 arguments, TMA descriptors among them) that is ~0.1 ms of host time per launch on the GPU
machines' hosts, as long as a 4k forward's kernel at batch 1 (docs/design-record.md, "Host overhead").

`launch` computes a cheaper key that is at least as fine as Triton's (see _arg_key) and, once the JIT path has
compiled and launched the kernel for that key, hands later calls' arguments straight to the compiled kernel's
launcher. `Bound` is the same launch with everything but the leading arguments fixed, for callers whose own key
already fixes every specialization (decode's plans): it keeps the compiled kernel and skips even the key. The first
call of each key, CPU tensors (the interpreter), launch hooks (profilers), SETTINGS.fast_launch off and a GPU that
is not the current device all take the JIT path, so behaviour there is Triton's own; except that a key's first
call on the fast path takes a kernel an earlier process compiled from flashtile's on-disk index (_index.py) without
the JIT, and indexes the one the JIT returns. `compile_only` makes a thread's launches compile and load without
running (_ahead.py).
"""
import contextlib
import threading

import torch
import triton

from .._settings import SETTINGS

# Compiled kernels kept; past this many keys the cache starts over.
MAX_KEYS = 4096

# The compile cache: launch key (kernel, every argument's _arg_key, constexprs, options) -> (compiled kernel, the
# values of the kernel's parameters after the call's arguments: its constexprs, which the launcher skips). Triton
# keeps its own cache of compiled kernels per JITFunction; this one only saves the work of finding the entry.
_COMPILED: dict = {}

# Per thread: whether launches only compile (compile_only).
_THREAD = threading.local()


@contextlib.contextmanager
def compile_only():
    """Within the block, this thread's launches compile their kernels, load them and build their launchers, and
    keep them in the compile cache as a launch would, but run nothing (flashtile/_ahead.py compiles a backward
    this way while the forward compiles). Other threads launch as usual. Bound launches made with background=True
    compile in threads of their own, side by side; the block's end waits for them."""
    saved = getattr(_THREAD, "dry", False), getattr(_THREAD, "pending", None)
    _THREAD.dry, _THREAD.pending = True, []
    try:
        yield
    finally:
        try:
            for thread in _THREAD.pending:
                thread.join()
        finally:
            _THREAD.dry, _THREAD.pending = saved


def dry():
    """Whether this thread's launches only compile (compile_only)."""
    return getattr(_THREAD, "dry", False)


def _hook_set(hook):
    # Triton >= 3.5 keeps launch hooks in a HookChain (never None; empty while nobody listens).
    return hook is not None and bool(getattr(hook, "calls", True))


def fast_stream(device_index):
    """The current stream's handle when launches may go straight to the compiled kernels: SETTINGS.fast_launch, a
    CUDA tensor on the current device, and no launch hooks (profilers get the full JITFunction path). Else None."""
    if not SETTINGS.fast_launch or device_index is None or device_index < 0 or not hasattr(triton, "knobs") or dry():
        return None
    runtime = triton.knobs.runtime
    if _hook_set(runtime.launch_enter_hook) or _hook_set(runtime.launch_exit_hook):
        return None
    return torch._C._cuda_getCurrentRawStream(device_index)


def off_device(device_index):
    """True when a tensor's GPU is not the current device: Triton launches on the current one, so switch first."""
    return device_index is not None and device_index >= 0 and torch.cuda.current_device() != device_index


def stream_for(device_index):
    """fast_stream's handle for a launch on this GPU (torch's get_device(): -1 for CPU tensors), or None for the JIT
    path: off the fast path, or a GPU that is not the current device (Triton's JIT launches on the current one)."""
    stream = fast_stream(device_index)
    if stream is None or off_device(device_index):
        return None
    return stream


def usable(compiled):
    """Whether a JIT launch's return value can be launched directly: the interpreter returns no compiled kernel,
    and an asynchronously compiling one (a future) is not used either."""
    return (SETTINGS.fast_launch and all(hasattr(compiled, a) for a in ("run", "function", "packed_metadata"))
            and not hasattr(compiled, "result"))


def _int_key(x):
    # Triton specializes an integer on its width (i32 / i64 / u64), on being 1 and on divisibility by 16.
    return (x == 1, x % 16 == 0, -2 ** 31 <= x < 2 ** 31, x < 2 ** 63)


def _arg_key(a):
    """What Triton's specialization of one argument can depend on, or finer: a tensor's dtype and 16-byte alignment;
    an integer's _int_key; a float's type only (Triton never specializes on float values); a tuple (NamedTuple
    groups) field by field, with its type; a TMA descriptor's dtype, block shape, layout, padding and its shape's and
    strides' _int_key; anything else (None, constexpr-like values) itself."""
    t = type(a)
    if t is torch.Tensor:
        return (a.dtype, a.data_ptr() % 16 == 0)
    key = _SCALAR_KEYS.get(t)
    if key is not None:
        return key(a)
    if isinstance(a, tuple):
        return (t, *map(_arg_key, a))
    if isinstance(a, torch.Tensor):  # a subclass (Parameter)
        return (a.dtype, a.data_ptr() % 16 == 0)
    if hasattr(a, "block_shape"):  # a host-side TMA descriptor
        return (a.base.dtype, tuple(a.block_shape), getattr(a, "layout", None), a.padding,
                tuple(map(_int_key, a.shape)), tuple(map(_int_key, a.strides)))
    return a


# _arg_key of the scalar types, by exact type (a bool is an int to isinstance, not to Triton).
_SCALAR_KEYS = {bool: lambda a: (bool, a), int: _int_key, float: lambda a: float, type(None): lambda a: (None,)}


def _run(compiled, grid, stream, args, tail):
    """Launch a compiled kernel through its launcher: grid, stream, then every parameter in order (the launcher
    skips the constexprs among them)."""
    g1 = grid[1] if len(grid) > 1 else 1
    g2 = grid[2] if len(grid) > 2 else 1
    compiled.run(grid[0], g1, g2, stream, compiled.function, compiled.packed_metadata, None, None, None, *args, *tail)


def _key(kernel, args, constexprs, options):
    # constexprs made by _common.constexpr_groups carry their plain values as `key`: hashing and comparing
    # tl.constexpr objects costs several Python calls each. The kernel stands in the key as its Python function
    # (hashed by identity): hashing a JITFunction computes Triton's cache key, which walks the source of the kernel
    # and of every function it calls (~0.1 s for the attention kernels, once per process), and a warm process's
    # first launch goes through the on-disk index without ever needing it (_index.py).
    plain = getattr(constexprs, "key", None)
    return (getattr(kernel, "fn", kernel), tuple(map(_arg_key, args)),
            tuple(constexprs.items()) if plain is None else plain, tuple(options.items()))


def _compile(kernel, grid, args, constexprs, options):
    """The kernel compiled for these arguments, loaded on the current device with its launcher built, not run."""
    compiled = kernel.warmup(*args, grid=grid, **constexprs, **options)
    if hasattr(compiled, "result"):  # compiled under Triton's AsyncCompileMode
        compiled = compiled.result()
    init = getattr(compiled, "_init_handles", None)
    if init is not None:
        init()
    return compiled


def _tail(kernel, args, constexprs):
    """The values of the kernel's parameters after args (its constexprs, given or default), which the launcher
    takes and skips."""
    return tuple(constexprs[p.name] if p.name in constexprs else p.default for p in kernel.params[len(args):])


def _index_device(stream):
    """The device whose on-disk index (_index.py) a first launch may use: the current GPU on the fast path (a stream)
    or in compile-only mode; None otherwise."""
    if not SETTINGS.fast_launch or not (stream is not None or dry()) or not torch.cuda.is_available():
        return None
    return torch.cuda.current_device()


def _jit_launch(kernel, grid, args, constexprs, options, key=None, stream=None):
    """kernel[grid](...) through Triton's JIT (compile_only: compiled and loaded, not run); keeps the compiled
    kernel under key (computed here when None) when it can be launched directly. On the fast path (stream: the
    launch's) and in compile-only mode a kernel an earlier process compiled is taken from the on-disk index first
    (_index.py), and one the JIT returns is indexed. Returns (the launch's compiled kernel, the cache entry or
    None)."""
    from . import _index
    device = _index_device(stream)
    compiled = None
    if device is not None:
        key = _key(kernel, args, constexprs, options) if key is None else key
        compiled = _index.load(key, device)
        if compiled is not None and not dry():
            _run(compiled, grid, stream, args, _tail(kernel, args, constexprs))
    if compiled is None:
        if dry():
            compiled = _compile(kernel, grid, args, constexprs, options)
        else:
            compiled = kernel[grid](*args, **constexprs, **options)
        if not usable(compiled):
            return compiled, None
        key = _key(kernel, args, constexprs, options) if key is None else key
        if device is not None:
            _index.save(key, device, compiled)
    entry = (compiled, _tail(kernel, args, constexprs))
    if len(_COMPILED) >= MAX_KEYS:
        _COMPILED.clear()
    _COMPILED[key] = entry
    return compiled, entry


def launch(kernel, grid, args, constexprs, device_index, **options):
    """kernel[grid](*args, **constexprs, **options), through the compiled kernel's launcher when a launch with the
    same key (every argument's _arg_key, the constexprs and the options) has compiled it before. constexprs: the
    kernel's remaining parameters by name (those left out take their defaults). device_index: the tensors' GPU
    (torch.device.index: None for CPU tensors). Returns what the JIT launch returns (the compiled kernel), or the
    cached compiled kernel."""
    stream = fast_stream(device_index)
    if stream is None or off_device(device_index):
        if dry():
            return _jit_launch(kernel, grid, args, constexprs, options)[0]
        return kernel[grid](*args, **constexprs, **options)
    key = _key(kernel, args, constexprs, options)
    entry = _COMPILED.get(key)
    if entry is None:
        return _jit_launch(kernel, grid, args, constexprs, options, key, stream)[0]
    _run(entry[0], grid, stream, args, entry[1])
    return entry[0]


class Bound:
    """A launch whose grid, trailing arguments (`static`), constexprs and options are fixed; a call passes the
    stream (fast_stream's, or None for the JIT path) and the leading arguments.

    For callers whose own key fixes everything Triton specializes on (decode's plans: dtypes, alignment, the value
    of every integer argument but do_not_specialize ones): the first call with a stream goes through `launch`'s
    compile cache (the JIT path the first time the key is seen), and the bound launch keeps the compiled kernel, so
    later calls are one call of its launcher -- no key, no dictionary, no per-argument work.

    background: under compile_only, this launch compiles in a thread of its own and the call returns at once (None),
    so that the kernels of one plan compile side by side; for launches whose caller needs nothing of the compiled
    kernel (not a tile search, which learns from a compile's failure)."""
    __slots__ = ("kernel", "grid", "static", "constexprs", "options", "tail", "compiled", "background")

    def __init__(self, kernel, grid, static, constexprs, options, background=False):
        names = list(kernel.arg_names)
        # The launcher takes every parameter in order, constexprs included (it skips them).
        assert names[len(names) - len(constexprs):] == list(constexprs), "constexprs must be the last parameters"
        self.kernel = kernel
        self.grid = tuple(grid) + (1,) * (3 - len(grid))
        self.static = tuple(static)
        self.constexprs = constexprs
        self.options = options
        self.tail = self.static + tuple(constexprs.values())
        self.compiled = None
        self.background = background

    def __call__(self, stream, *dynamic):
        compiled = self.compiled
        if self.background and compiled is None and dry():  # (dry: inside compile_only, which keeps _THREAD.pending)
            self._compile_aside(dynamic + self.static)
            return None
        if compiled is not None and stream is not None:
            grid = self.grid
            compiled.run(grid[0], grid[1], grid[2], stream, compiled.function, compiled.packed_metadata, None, None,
                         None, *dynamic, *self.tail)
            return compiled
        args = dynamic + self.static
        key = entry = None
        if stream is not None:
            key = _key(self.kernel, args, self.constexprs, self.options)
            entry = _COMPILED.get(key)
        if entry is None:
            # The JIT path: the first call, or one that must not skip it (stream None); a kernel it compiled is
            # kept all the same (as the first call off the current device or under a profiler still compiles).
            compiled, entry = _jit_launch(self.kernel, self.grid, args, self.constexprs, self.options, key, stream)
        else:
            compiled = entry[0]
            _run(compiled, self.grid, stream, args, entry[1])
        if entry is not None:
            self.compiled = entry[0]
        return compiled

    def _compile_aside(self, args):
        """compile_only's background compile of this launch (class docstring): a thread (named after this one, with
        "/compile") that compiles, loads and keeps the kernel as the JIT path would, on the current GPU; a failure is
        dropped (the real launch then compiles, or raises, itself)."""
        device = torch.cuda.current_device() if torch.cuda.is_available() else None

        def work():
            try:
                with compile_only():
                    if device is not None:
                        torch.cuda.set_device(device)
                    _, entry = _jit_launch(self.kernel, self.grid, args, self.constexprs, self.options)
                if entry is not None:
                    self.compiled = entry[0]
            except Exception:  # noqa: BLE001 - see the docstring
                pass

        thread = threading.Thread(target=work, name=f"{threading.current_thread().name}/compile", daemon=True)
        _THREAD.pending.append(thread)
        thread.start()
