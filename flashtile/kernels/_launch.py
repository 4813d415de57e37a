"""The one launcher of every kernel (portable and Gluon; forward, backward, decode) and its compile cache.

`kernel[grid](*args, **constexprs)` (JITFunction.run) re-derives on every call what the compiled kernel depends on:
each argument's specialization (a tensor's dtype and 16-byte alignment; an integer's width, whether it is 1, whether
it is divisible by 16; a tuple's fields one by one), the cache key string built from them, and the launch metadata.
For the Gluon kernels (~45 arguments, TMA descriptors among them) that is ~0.1 ms of host time per launch on the GPU
machines' hosts, as long as a 4k forward's kernel at batch 1 (docs/design-record.md, "Host overhead").

`launch` computes a cheaper key that is at least as fine as Triton's (see _arg_key) and, once the JIT path has
compiled and launched the kernel for that key, hands later calls' arguments straight to the compiled kernel's
launcher. `Bound` is the same launch with everything but the leading arguments fixed, for callers whose own key
already fixes every specialization (decode's plans): it keeps the compiled kernel and skips even the key, and with
Triton 3.6 calls the C launch function under the compiled kernel's launcher directly (_Direct). The first
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
from . import _compiling

# Compiled kernels kept; past this many keys the cache starts over.
MAX_KEYS = 4096

# The compile cache: (device, launch key: kernel, every argument's _arg_key, constexprs, options) -> (compiled
# kernel, the values of the kernel's parameters after the call's arguments: its constexprs, which the launcher
# skips). Triton keeps its own cache of compiled kernels per JITFunction and device; this one only saves the work of
# finding the entry. A compiled kernel is loaded on the GPU that was current when it was first launched, and its
# function handle belongs to that GPU's context, so the entries are per device (_device) as Triton's are.
_COMPILED: dict = {}

# Per thread: whether launches only compile (compile_only).
_THREAD = threading.local()
# Threads Bound.compile_aside started that no one has joined through join_aside yet.
_ASIDE = []
_ASIDE_LOCK = threading.Lock()
# Held while a kernel's compile is wrapped (_LauncherAhead.wrap), so that two threads never wrap it twice.
_WRAP_LOCK = threading.Lock()


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


def join_aside():
    """Wait for the compiles Bound.compile_aside started (flashtile/_ahead.wait_for_compiles)."""
    while True:
        with _ASIDE_LOCK:
            threads, _ASIDE[:] = list(_ASIDE), []
        if not threads:
            return
        for thread in threads:
            thread.join()


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


def _device():
    """The GPU a launch runs on, the current one (launches on another take the JIT path); -1 without CUDA (offline
    compiles, the CPU tests' stand-in launches)."""
    return torch.cuda.current_device() if torch.cuda.is_available() else -1


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


class _LauncherAhead:
    """A JITFunction's `compile` (Triton calls kernel.compile(src, ...) on a cache miss) that first starts building
    the compiled kernel's launcher in a thread of its own, then compiles.

    Triton 3.6 builds each kernel's launcher, a C module made for its signature, with the C compiler (0.3-0.5 s on
    the GPU machines' hosts) after the kernel has compiled, on the thread that waits for the kernel: a cold process's
    first call paid it after the forward's compile and again after the backward's (docs/design-record.md, "Cold
    start"). The launcher's source depends on the signature and constants alone, known before the compile, plus
    whether each tensor descriptor is a TMA descriptor (the Hopper kernels' are), so it is built while the kernel
    compiles; Triton then finds it in its cache. A guess that turns out wrong costs a build nobody uses. The compile
    then waits for Triton's key if a thread is computing it, and its front end takes its turn with the other
    compiles' (_compiling.py). Newer Triton launches every kernel through one launcher (nothing to build): `wrap`
    leaves kernels alone there."""
    __slots__ = ("compile", )

    def __init__(self, compile_fn):
        self.compile = compile_fn

    @staticmethod
    def wrap(kernel):
        """Make kernel's compile a _LauncherAhead where Triton builds a launcher per kernel (once per kernel)."""
        if not _builds_launchers():
            return
        caches = getattr(kernel, "device_caches", None)
        if caches is not None:
            # Triton sets kernel.compile when it makes a device's caches (JITFunction.create_binder, on the kernel's
            # first launch on that device): made first, so that the wrapper is not overwritten.
            caches[_device()]
        current = getattr(kernel, "compile", None)
        if current is None or isinstance(current, _LauncherAhead):
            return
        with _WRAP_LOCK:
            if not isinstance(kernel.compile, _LauncherAhead):
                kernel.compile = _LauncherAhead(kernel.compile)

    def __call__(self, src, *args, **kwargs):
        try:
            _LauncherAhead.start(src)
        except Exception:  # noqa: BLE001 - Triton builds the launcher itself, as without this
            pass
        front_ends = _compiling.FRONT_ENDS
        number = front_ends.ticket()
        try:
            front_ends.wrap(src, number)
            _compiling.TRITON_KEY.join()
            return self.compile(src, *args, **kwargs)
        finally:
            front_ends.drop(number)

    @staticmethod
    def start(src):
        """Start the thread that builds src's launcher (as Triton 3.6's CudaLauncher would); returns it."""
        from triton.backends.nvidia import driver
        constants = getattr(src, "constants", None) or {}
        constants = {(src.fn.arg_names.index(i), ) if isinstance(i, str) else i: value
                     for i, value in constants.items()}
        signature = dict(src.signature)
        descriptors = sum(isinstance(t, str) and t.startswith("tensordesc") for t in signature.values())
        # make_launcher reads only whether each descriptor has metadata (a TMA descriptor) or not.
        text = driver.make_launcher(constants, signature, [{}] * descriptors or None)

        def build():
            try:
                driver.compile_module_from_src(src=text, name="__triton_launcher", library_dirs=driver.library_dirs(),
                                               include_dirs=driver.include_dirs, libraries=driver.libraries)
            except Exception:  # noqa: BLE001 - Triton builds it itself
                pass

        thread = threading.Thread(target=build, name=f"{threading.current_thread().name}/launcher", daemon=False)
        thread.start()
        return thread


def _builds_launchers():
    """Whether this Triton builds a C launcher per compiled kernel (3.6 does) for CUDA (not ROCm's torch.cuda)."""
    if not torch.cuda.is_available() or getattr(torch.version, "hip", None):
        return False
    try:
        from triton.backends.nvidia import driver
        names = driver.CudaLauncher.__init__.__code__.co_names
    except (ImportError, AttributeError):
        return False
    return "make_launcher" in names and "compile_module_from_src" in names


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
        _LauncherAhead.wrap(kernel)
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
    _COMPILED[(_device(), key)] = entry
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
    entry = _COMPILED.get((_device(), key))
    if entry is None:
        return _jit_launch(kernel, grid, args, constexprs, options, key, stream)[0]
    _run(entry[0], grid, stream, args, entry[1])
    return entry[0]


def copy_descriptor(template, base):
    """A host TMA descriptor like template (same shape, strides, block and layout) over base's memory. For plans,
    whose templates were validated when built over storage-less stand-ins, and whose key fixes base's shape,
    strides, dtype and alignment: the copy skips the descriptor's checks. The launcher reads base.data_ptr() on
    every launch; each call gets descriptor objects of its own, never a shared one changed in place."""
    desc = object.__new__(type(template))
    desc.__dict__.update(template.__dict__)
    desc.base = base
    return desc


class _Direct:
    """A compiled kernel's launch without the Python of Triton's CudaLauncher (Triton 3.6's): its __call__ builds
    scratch closures per launch, and for a kernel with host TMA descriptors its wrapper walks every parameter (the
    Gluon forward's 39, constexprs included) to expand the descriptors. Here the fixed parts are laid out once per
    Bound and a call fills only the descriptors' CUtensorMaps (the same driver call Triton makes) before calling the
    C launch function. `of` returns None for a launcher laid out otherwise (other Triton versions, a proton
    profile scratch, descriptors among the fixed arguments): Bound then calls compiled.run as before."""
    __slots__ = ("launch", "head", "descs", "fill", "scratch", "metadata", "n_dynamic", "tail")

    @staticmethod
    def of(compiled, grid, n_dynamic, tail, templates=None):
        """The direct launch of compiled (launched before: its handles are loaded) with n_dynamic leading arguments
        and the fixed tail after them, or None. templates: Bound's (a call passes those arguments' bases)."""
        run = compiled.run
        try:
            from triton.backends.nvidia import driver
            from triton.runtime import _allocation
            # Triton 3.6: the C function takes grid (3 ints), stream, function, the two launch flags, then six
            # objects (global and profile scratch, packed metadata, launch metadata, the enter and exit hooks)
            # before the parameters; CudaLauncher.__call__(self, gridX, gridY, gridZ, stream, function, *args).
            if (type(run).__name__ != "CudaLauncher" or driver._BASE_ARGS_FORMAT != "iiiKKppOOOOOO"
                    or type(run).__call__.__code__.co_argcount != 6 or run.profile_scratch_size
                    or run.num_ctas != 1):
                return None
            launch, descs = run.launch, {}
            if type(launch).__name__ == "function":  # wrap_handle_tensordesc's wrapper: kernels with descriptors
                cells = dict(zip(launch.__code__.co_freevars, (c.cell_contents for c in launch.__closure__ or ())))
                launch, indices, metas = (cells.get(name) for name in ("launcher", "tensordesc_indices",
                                                                         "tensordesc_meta"))
                if not callable(launch) or not indices or not metas or len(metas) != len(indices):
                    return None
                for i, meta in zip(sorted(indices), metas):
                    if i >= n_dynamic or meta is None or meta["fp4_padded"]:
                        return None
                    descs[i] = (meta["swizzle"], meta["elem_size"], driver.TMA_DTYPE_DEVICE_TO_HOST[meta["elem_type"]],
                                meta["block_size"], None)
                    template = (templates or {}).get(i)
                    if template is not None:  # fixed by the plan: the call passes the base alone
                        descs[i] = descs[i][:4] + ((list(template.shape), list(template.strides),
                                                    1 if template.padding == "nan" else 0), )
            if set(templates or ()) - set(descs):
                return None
            descs = tuple((i, *descs[i]) for i in sorted(descs))  # (position, fill's arguments, fixed parts)
            fill = triton.runtime.driver.active.utils.fill_tma_descriptor
            head = (*grid, compiled.function, run.launch_cooperative_grid, run.launch_pdl)
            scratch = None
            if run.global_scratch_size > 0:
                scratch = (_allocation._allocator, grid[0] * grid[1] * grid[2] * run.global_scratch_size,
                           run.global_scratch_align)
        except (AttributeError, ImportError, KeyError, RuntimeError, TypeError):
            return None
        self = _Direct()
        self.launch, self.head, self.descs, self.fill, self.scratch = launch, head, descs, fill, scratch
        self.metadata, self.n_dynamic, self.tail = compiled.packed_metadata, n_dynamic, tuple(tail)
        return self

    def __call__(self, stream, dynamic):
        """Launch on stream with the leading arguments dynamic (as many as `of` was told: the Bound's call site)."""
        scratch = None
        if self.scratch is not None:
            allocator, size, align = self.scratch
            scratch = allocator.get()(size, align, stream)
        g0, g1, g2, function, coop, pdl = self.head
        if not self.descs:
            self.launch(g0, g1, g2, stream, function, coop, pdl, scratch, None, self.metadata, None, None, None,
                        *dynamic, *self.tail)
            return
        # (No profile scratch, launch metadata or hooks: `of` declines a profile scratch, and Bound's fast path runs
        # only without launch hooks.)
        args = [g0, g1, g2, stream, function, coop, pdl, scratch, None, self.metadata, None, None, None]
        fill = self.fill
        done = 0
        for i, swizzle, elem_size, elem_type, block, fixed in self.descs:
            args.extend(dynamic[done:i])
            a = dynamic[i]
            # What Triton's wrapper passes for a descriptor: the CUtensorMap, then its shape and strides.
            if fixed is None:
                shape, strides = a.shape, a.strides
                args.append(fill(a.base.data_ptr(), swizzle, elem_size, elem_type, block, shape, strides,
                                 1 if a.padding == "nan" else 0))
            else:
                shape, strides, padding = fixed
                args.append(fill(a.data_ptr(), swizzle, elem_size, elem_type, block, shape, strides, padding))
            args.extend(shape)
            args.extend(strides)
            done = i + 1
        args.extend(dynamic[done:])
        args.extend(self.tail)
        self.launch(*args)


class Bound:
    """A launch whose grid, trailing arguments (`static`), constexprs and options are fixed; a call passes the
    stream (fast_stream's, or None for the JIT path) and the leading arguments.

    For callers whose own key fixes everything Triton specializes on (decode's plans: dtypes, alignment, the value
    of every integer argument but do_not_specialize ones): the first call with a stream goes through `launch`'s
    compile cache (the JIT path the first time the key is seen), and the bound launch keeps the compiled kernel, so
    later calls are one call of its launcher -- no key, no dictionary, no per-argument work.

    templates: {position: TMA descriptor} of leading arguments that a call passes as the tensor the descriptor is
    over (its base): the launch takes copies of the templates over them (copy_descriptor), or with _Direct fills
    the descriptors itself from the templates, no descriptor object made.

    background: under compile_only, this launch compiles in a thread of its own and the call returns at once (None),
    so that the kernels of one plan compile side by side; for launches whose caller needs nothing of the compiled
    kernel (not a tile search, which learns from a compile's failure)."""
    __slots__ = ("kernel", "grid", "static", "constexprs", "options", "tail", "compiled", "background", "direct",
                 "templates")

    def __init__(self, kernel, grid, static, constexprs, options, background=False, templates=None):
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
        self.direct = None  # _Direct of the compiled kernel, False where it has none (built on the second call)
        self.templates = templates or {}

    def __call__(self, stream, *dynamic):
        compiled = self.compiled
        if compiled is not None and stream is not None:
            direct = self.direct
            if direct is None:
                direct = self.direct = _Direct.of(compiled, self.grid, len(dynamic), self.tail, self.templates) or False
            if direct and SETTINGS.direct_launch and len(dynamic) == direct.n_dynamic:
                direct(stream, dynamic)
                return compiled
        dynamic = self._described(dynamic)
        if self.background and compiled is None and dry():  # (dry: inside compile_only, which keeps _THREAD.pending)
            _THREAD.pending.append(self._compile_aside(dynamic + self.static))
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
            entry = _COMPILED.get((_device(), key))
        if entry is None:
            # The JIT path: the first call, or one that must not skip it (stream None); a kernel it compiled is
            # kept all the same (as the first call off the current device or under a profiler still compiles).
            compiled, entry = _jit_launch(self.kernel, self.grid, args, self.constexprs, self.options, key, stream)
        else:
            compiled = entry[0]
            _run(compiled, self.grid, stream, args, entry[1])
        if entry is not None:
            self._keep(entry[0])
        return compiled

    def _described(self, dynamic):
        """The leading arguments with copies of the templates over the bases a call passes (the arguments the kernel
        takes)."""
        if not self.templates:
            return dynamic
        dynamic = list(dynamic)
        for i, template in self.templates.items():
            dynamic[i] = copy_descriptor(template, dynamic[i])
        return tuple(dynamic)

    def find(self, *dynamic):
        """Whether this launch's kernel is at hand without compiling: kept already, or in the compile cache under
        the key of these leading arguments (an earlier launch with the same key compiled it), then kept as a first
        call keeps it. Launches nothing."""
        if self.compiled is None:
            entry = _COMPILED.get((_device(), _key(self.kernel, self._described(dynamic) + self.static,
                                                   self.constexprs, self.options)))
            if entry is not None:
                self._keep(entry[0])
        return self.compiled is not None

    def _keep(self, compiled):
        if compiled is not self.compiled:
            self.compiled, self.direct = compiled, None

    def compile_aside(self, *dynamic, after=()):
        """Start compiling this launch's kernel for these leading arguments without launching it: the thread
        _compile_aside returns (a caller that needs the kernel joins it, or calls the launch, which then compiles
        itself if the thread has not kept a kernel). after: threads it waits for before it compiles."""
        thread = self._compile_aside(self._described(dynamic) + self.static, after)
        with _ASIDE_LOCK:
            _ASIDE[:] = [t for t in _ASIDE if t.is_alive()] + [thread]
        return thread

    def _compile_aside(self, args, after=()):
        """A started thread (named after this one, with "/compile") that compiles, loads and keeps the kernel as the
        JIT path would, compile-only, on the current GPU (none: the CPU tests' stand-in launches); a failure is
        dropped (the real launch then compiles, or raises, itself). Used by compile_only's background launches (class
        docstring) and compile_aside. Not a daemon: a process that ends while it compiles waits for it (a daemon
        thread killed inside the compiler's C++ aborts the process)."""
        device = torch.cuda.current_device() if torch.cuda.is_available() else None
        rank = _compiling.rank()

        def work():
            for other in after:
                other.join()
            try:
                with compile_only(), _compiling.ranked(rank):
                    if device is not None:
                        torch.cuda.set_device(device)
                    _, entry = _jit_launch(self.kernel, self.grid, args, self.constexprs, self.options)
                if entry is not None:
                    self._keep(entry[0])
            except Exception:  # noqa: BLE001 - see the docstring
                pass

        thread = threading.Thread(target=work, name=f"{threading.current_thread().name}/compile", daemon=False)
        thread.start()
        return thread
