"""Compiling the backward while the forward compiles.

A fresh process's first training step calls the forward, then the backward: with an empty Triton cache the forward's
kernel compiles (~4 s for the Hopper forward on the GPU machines' hosts), runs, and only then does the backward's
compile start (~3 s more, its launchers included). Much of a compile runs outside Python's lock (LLVM, ptxas and
the C compiler of Triton's launchers are native code or other processes), so the two can overlap.

When a forward that autograd will differentiate meets a call it has no plan for (dispatch.forward's plan miss),
`start` runs the backward once in a helper thread, on stand-in tensors shaped like the call's out, LSE and output
gradient, with launches compile-only (kernels/_launch.compile_only): every kernel of that backward compiles, loads
and gets its launcher, and the backward's plan is kept, while the main thread compiles and runs the forward. The
Gluon backward's three kernels (preprocess, main kernel, dQ pass) compile side by side, each in a thread of its own
(`_launch.Bound`'s background), so the helper takes about as long as its main kernel (docs/design-record.md, "Cold
start"); their front ends, which hold Python's lock, go before the forward's (kernels/_compiling.py): the main
kernel's compile is the longest. The real backward (`wait`) joins the helper first and finds the plan and the
compiled kernels ready. Stand-ins are fresh contiguous allocations, like the gradient autograd passes for a plain
loss; a real call that differs (an output gradient with other strides, a used LSE) builds its own plan as it would
have.

Each kind of call (device, dtypes, head dims, layout, which options are on: `_kind`) is prepared once per process,
so calls whose shapes change do not start a helper every time. The helper allocates the stand-ins and the
backward's buffers (and fills any the backward zeroes, on the caller's stream); nothing else of it runs on the GPU,
and all of it is freed when it ends. It starts only when that memory is under a quarter of the GPU's free memory
(MAX_FREE_SHARE), so that it does not crowd the forward. Not while a CUDA graph is being captured (a second
thread's work would break the capture), not on CPU tensors, and never with SETTINGS.compile_ahead off
(FLASHTILE_COMPILE_AHEAD=0). An error in the helper is dropped: the real backward then compiles, or raises, itself.
"""
import atexit
import threading

import torch

from ._settings import SETTINGS

# Kinds of call whose backward was prepared (or is being prepared) in this process.
_PREPARED = set()
# Helpers not joined yet.
_PENDING = []
_LOCK = threading.Lock()
_EXIT_HOOK = []


# The helper holds its stand-ins and the backward's buffers while the forward runs: at most this share of the free
# GPU memory (an estimate, _transient_bytes), else the call's backward compiles when it runs, as without the helper.
MAX_FREE_SHARE = 0.25


def _transient_bytes(q, k, v):
    """An upper estimate of what the helper allocates: the stand-ins (out, its gradient, the LSE) and the backward's
    buffers (gradients and float32 accumulators), about eight times the inputs."""
    return 8 * sum(t.numel() * t.element_size() for t in (q, k, v) if t is not None)


def _kind(q, k, v, req, bias_requires_grad):
    """What the backward's kernels depend on besides sizes: device, dtypes, ranks and head dims of the inputs, the
    options that change kernels, which optional tensors are set, and the settings."""
    from . import dispatch

    def t(x):
        return None if x is None else (x.dtype, x.dim(), x.shape[-1])
    return (q.get_device(), t(q), t(k), t(v), req.causal, req.mask_left, req.mask_right, req.softcap > 0,
            req.dropout_p > 0, req.deterministic, req.varlen, req.paged,
            tuple(getattr(req, name) is not None for name in req._tensor_fields), bias_requires_grad,
            dispatch._settings_key(q))


def _stand_ins(q, k, v, req):
    """(dout, out, lse): fresh tensors shaped like what the forward returns and autograd passes back."""
    from ._ops import unpack
    qq, _, vv = unpack(q, k, v)
    out = qq.new_empty(qq.shape[:-1] + vv.shape[-1:])
    lse_shape = (qq.shape[1], qq.shape[0]) if req.varlen else (qq.shape[0], qq.shape[2], qq.shape[1])
    return torch.empty_like(out), out, qq.new_empty(lse_shape, dtype=torch.float32)


def prepare(q, k, v, req, bias_requires_grad, stream=None):
    """Run the backward of a call on stand-ins with launches compile-only (the helper's work; called directly by
    tests). stream: the CUDA stream for any work the backward queues (None: the current one)."""
    from . import _ops
    from .kernels import _launch
    dout, out, lse = _stand_ins(q, k, v, req)
    with _launch.compile_only(), torch.no_grad():
        if stream is None:
            _ops.backward(dout, q, k, v, out, lse, None, req, bias_requires_grad)
        else:
            with torch.cuda.device(q.device), torch.cuda.stream(stream):
                _ops.backward(dout, q, k, v, out, lse, None, req, bias_requires_grad)


def _helper(q, k, v, req, bias_requires_grad, stream, place):
    from .kernels import _compiling
    try:
        with _compiling.ranked(0):
            prepare(q, k, v, req, bias_requires_grad, stream)
    except Exception:  # noqa: BLE001 - the real backward compiles (or raises) itself
        pass
    finally:
        _compiling.FRONT_ENDS.release(place)


def start(q, k, v, req, bias_requires_grad):
    """Prepare the backward of this call in a helper thread, unless its kind was prepared before (module
    docstring). Called by the forward on a plan miss, before it builds its own plan."""
    if not SETTINGS.compile_ahead or not q.is_cuda or torch.cuda.is_current_stream_capturing():
        return
    from .kernels import _launch
    if _launch.dry():
        return
    kind = _kind(q, k, v, req, bias_requires_grad)
    with _LOCK:
        if kind in _PREPARED:
            return
        _PREPARED.add(kind)
    if _transient_bytes(q, k, v) > torch.cuda.mem_get_info(q.device)[0] * MAX_FREE_SHARE:
        return  # the helper's buffers would crowd the forward's: the backward compiles when it runs
    # Triton's driver is made once per process, by this thread, before the helper compiles anything; where this
    # process is going to compile, Triton's key is computed meanwhile (start_key).
    import triton
    from .kernels import _compiling
    start_key()
    triton.runtime.driver.active.get_current_target()
    # The helper's compiles take their turns at Triton's front end before the forward's, which starts first: its
    # place is held until its first compile starts (kernels/_compiling.py).
    place = _compiling.FRONT_ENDS.hold(0)
    helper = threading.Thread(target=_helper, name="flashtile-compile-ahead", daemon=True,
                              args=(q.detach(), None if k is None else k.detach(), None if v is None else v.detach(),
                                    req, bias_requires_grad, torch.cuda.current_stream(q.device), place))
    with _LOCK:
        if not _PENDING and not _EXIT_HOOK:
            # A process that ends before its backward waits for the helper (a daemon thread compiling in native code
            # while the interpreter shuts down can crash it).
            atexit.register(wait)
            _EXIT_HOOK.append(True)
        _PENDING.append(helper)
    try:
        helper.start()
    except BaseException:
        _compiling.FRONT_ENDS.release(place)
        raise


def start_key():
    """Start computing Triton's key in a thread of its own (kernels/_compiling.py) where this process is likely to
    compile: on a GPU, with Triton's compiles wrapped by flashtile (Triton 3.6), and no file of flashtile's index in
    Triton's cache. Called on a plan miss (a forward without a backward passes it as dispatch.forward's
    on_new_plan), before the plan's kernels, and Triton's driver with them, are made."""
    from .kernels import _compiling, _index, _launch
    if _launch._builds_launchers() and _index.empty():
        _compiling.TRITON_KEY.start()


def pending():
    """The helpers started and not joined yet (a snapshot)."""
    with _LOCK:
        return list(_PENDING)


def wait():
    """Join the helpers started so far (the backward calls it first; a helper's own backward does not)."""
    if not _PENDING:
        return
    from .kernels import _launch
    if _launch.dry():
        return
    with _LOCK:
        helpers = list(_PENDING)
        _PENDING.clear()
    for helper in helpers:
        helper.join()


def wait_for_compiles():
    """Wait for the kernels flashtile compiles in background threads.

    A process's first call of a new kind of call can leave compiles running after it returns: the backward's
    kernels, compiled ahead while the forward compiles (`FLASHTILE_COMPILE_AHEAD=0` turns that off), and the redo
    pass of a bfloat16 forward that checks its range at each item's end (`FLASHTILE_DEFER_CHECK=0`), which compiles
    after the first call's launch, once those backward kernels have compiled. Until the redo kernel is ready, each
    such forward waits for the GPU once, and the compile's threads take host time from the calls: time a model's
    steps after this returns (the benchmarks call it after each provider's first call). CUDA-graph capture waits for
    the compile by itself."""
    from .kernels import _launch
    wait()
    _launch.join_aside()
