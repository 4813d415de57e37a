"""Kernel launches that skip Triton's per-call specialization once a kernel has been compiled for a call's key.

`kernel[grid](*args, **constexprs)` (JITFunction.run) re-derives on every call what the compiled kernel depends on:
each argument's specialization (a tensor's dtype and 16-byte alignment; an integer's width, whether it is 1, whether
it is divisible by 16), the cache key string built from them, and the launch metadata. For the Gluon kernels (~45
arguments, TMA descriptors among them) that is ~0.1 ms of host time per launch on the GPU machines' hosts, as long
as a 4k forward's kernel at batch 1 (benchmarks/NOTES.md, "host overhead").

`launch` computes a cheaper key that is at least as fine as Triton's (see _arg_key) and, once the JIT path has
compiled and launched the kernel for that key, hands later calls' arguments straight to the compiled kernel's
launcher. The first call of each key, CPU tensors (the interpreter), launch hooks (profilers) and a GPU that is not
the current device all take the JIT path, so behaviour there is Triton's own.
"""
import torch
import triton

# False: every launch goes through JITFunction.run (for comparisons: benchmarks/NOTES.md).
FAST_LAUNCH = True
# Compiled kernels kept per key; past this many the cache starts over.
MAX_KEYS = 4096

_COMPILED: dict = {}


def _hook_set(hook):
    # Triton >= 3.5 keeps launch hooks in a HookChain (never None; empty while nobody listens).
    return hook is not None and bool(getattr(hook, "calls", True))


def fast_stream(device_index):
    """The current stream's handle when launches may go straight to the compiled kernels: FAST_LAUNCH, a CUDA
    tensor on the current device, and no launch hooks (profilers get the full JITFunction path). Else None."""
    if not FAST_LAUNCH or device_index is None or device_index < 0 or not hasattr(triton, "knobs"):
        return None
    runtime = triton.knobs.runtime
    if _hook_set(runtime.launch_enter_hook) or _hook_set(runtime.launch_exit_hook):
        return None
    return torch._C._cuda_getCurrentRawStream(device_index)


def off_device(device_index):
    """True when a tensor's GPU is not the current device: Triton launches on the current one, so switch first."""
    return device_index is not None and device_index >= 0 and torch.cuda.current_device() != device_index


def usable(compiled):
    """Whether a JIT launch's return value can be launched directly: the interpreter returns no compiled kernel,
    and an asynchronously compiling one (a future) is not used either."""
    return (FAST_LAUNCH and all(hasattr(compiled, a) for a in ("run", "function", "packed_metadata"))
            and not hasattr(compiled, "result"))


def _int_key(x):
    # Triton specializes an integer on its width (i32 / i64 / u64), on being 1 and on divisibility by 16.
    return (x == 1, x % 16 == 0, -2 ** 31 <= x < 2 ** 31, x < 2 ** 63)


def _arg_key(a):
    """What Triton's specialization of one argument can depend on, or finer: a tensor's dtype and 16-byte alignment;
    an integer's _int_key; a float's type only (Triton never specializes on float values); a TMA descriptor's
    dtype, block shape, layout, padding and its shape's and strides' _int_key; anything else (None, constexpr-like
    values) itself."""
    if isinstance(a, torch.Tensor):
        return (a.dtype, a.data_ptr() % 16 == 0)
    t = type(a)
    if t is bool:
        return (bool, a)
    if t is int:
        return _int_key(a)
    if t is float:
        return float
    if hasattr(a, "block_shape"):  # a host-side TMA descriptor
        return (a.base.dtype, tuple(a.block_shape), getattr(a, "layout", None), a.padding,
                tuple(map(_int_key, a.shape)), tuple(map(_int_key, a.strides)))
    return a


def launch(kernel, grid, args, constexprs, device_index, **options):
    """kernel[grid](*args, **constexprs, **options), through the compiled kernel's launcher when a launch with the
    same key (every argument's _arg_key, the constexprs and the options) has compiled it before. constexprs: the
    kernel's remaining parameters by name (those left out take their defaults). device_index: the tensors' GPU
    (torch.device.index: None for CPU tensors). Returns what the JIT launch returns (the compiled kernel), or the
    cached compiled kernel."""
    stream = fast_stream(device_index)
    if stream is None or off_device(device_index):
        return kernel[grid](*args, **constexprs, **options)
    key = (kernel, tuple(map(_arg_key, args)), tuple(constexprs.items()), tuple(options.items()))
    entry = _COMPILED.get(key)
    if entry is not None:
        compiled, tail = entry
        g1 = grid[1] if len(grid) > 1 else 1
        g2 = grid[2] if len(grid) > 2 else 1
        # The launcher takes every parameter in order, constexprs included (it skips them).
        compiled.run(grid[0], g1, g2, stream, compiled.function, compiled.packed_metadata, None, None, None, *args,
                     *tail)
        return compiled
    compiled = kernel[grid](*args, **constexprs, **options)
    if usable(compiled):
        params = kernel.params[len(args):]
        tail = tuple(constexprs[p.name] if p.name in constexprs else p.default for p in params)
        if len(_COMPILED) >= MAX_KEYS:
            _COMPILED.clear()
        _COMPILED[key] = (compiled, tail)
    return compiled
