"""What a cold process does while several kernels compile at once: their front ends take turns, and Triton's key is
computed while Triton's driver builds.

A cold process's first training call compiles four kernels at once: the forward on the calling thread and the
backward's three (preprocess, main kernel, dQ pass) in the compile-ahead helper's threads (flashtile/_ahead.py).
Timed on an H200 host (docs/design-record.md, "Cold start"), each compile first spent ~0.45 s in Triton's cache
key, then its front end (`make_ir`: Python walking the kernel's syntax tree into MLIR; 0.5 s for the forward, 0.8 s
for the backward's main kernel), and only then its native stages (MLIR's passes, LLVM, ptxas: ~2.5 s each for the
two large kernels), which run mostly outside Python's lock.

Front ends (`FRONT_ENDS`). A front end holds Python's lock throughout. Left to the lock, two of them interleave,
another thread every 5 ms, so both end about when the second would have ended alone, and both compiles' native
stages start late. `FrontEnds.turn` lets one run at a time: the first ends when it would have alone and its native
stages start then. Which goes first matters: the compile whose native stages take longest should. That is the
backward's main kernel (beside the forward's, its native stages took 3.3-4 s against 2.4-2.8 s there), so the
compile-ahead helper's compiles take rank 0 (its threads run under `ranked(0)`, and a thread compiling for them
takes its rank on), everything else rank 1, and a front end goes after every compile of a lesser rank, then after
every compile of its own rank that started before it. The forward's compile starts a few milliseconds before the
helper's, so flashtile/_ahead.py holds rank 0's place (`hold`) from before it starts the helper until the helper's
first compile starts (or the helper ends). A turn never waits longer than MAX_WAIT_S: past that it runs beside
whatever is running, as without turns, so nothing here can hold a compile up for good.

Triton's key (`TRITON_KEY`). Triton's disk cache key starts with `triton_key()`, a hash of Triton's installation
(its compiler's and language's modules and its ~400 MB library), computed once per process: 0.4-0.5 s on those
hosts, on the first compile's path, and by every thread that compiles before one of them has stored it (four at once
in that call, one of them taking up to 2.3 s). `start` computes it in a thread of its own while Triton's driver
builds its utilities (the C compiler, ~0.3 s in a process whose Triton cache is empty), and `join` makes a compile
wait for that thread rather than compute the key again. flashtile/_ahead.py starts it (`start_key`) at a forward's
plan miss, before the plan makes Triton's driver, where a process is likely to compile: when this Triton cache holds
no file of flashtile's index (kernels/_index.py), as a fresh cache does. A warm process finds its kernels through the
index without the key, so it does not start it.

Both are used by `_launch._LauncherAhead`, which wraps the compiles of kernels flashtile launches (Triton 3.6).
"""
import contextlib
import itertools
import threading
import time

# The longest a front end waits for its turn; past it, it runs beside the others.
MAX_WAIT_S = 10.0
# The rank of a thread that has not said otherwise (ranked).
DEFAULT_RANK = 1

_THREAD = threading.local()


def rank():
    """This thread's rank at the front end (ranked)."""
    return getattr(_THREAD, "rank", DEFAULT_RANK)


@contextlib.contextmanager
def ranked(value):
    """Within the block, the compiles this thread starts take their turns at this rank (a thread that compiles for
    it takes the rank on: `rank()` when it is made)."""
    saved = rank()
    _THREAD.rank = value
    try:
        yield
    finally:
        _THREAD.rank = saved


class FrontEnds:
    """One front end at a time, the least rank first, then the compile that started first (module docstring).

    A compile takes a ticket when it starts (`ticket`, before Triton's cache key, so that the order is the compiles'
    and not their keys'), its front end waits for its turn (`turn`), and the ticket is dropped when the front end
    ends or the compile does (`drop`: a kernel found in Triton's cache has no front end). A place held for a
    compile that has not started (`hold`) keeps greater ranks waiting until a ticket of its rank comes."""

    def __init__(self, max_wait_s=None):
        self.max_wait_s = MAX_WAIT_S if max_wait_s is None else max_wait_s
        self._cond = threading.Condition()
        self._running = set()   # threads in a front end now
        self._tickets = {}      # number -> rank, of the compiles whose front end has not ended
        self._holds = {}        # token -> rank, of the places held
        self._numbers = itertools.count()

    def ticket(self, value=None):
        """A compile starts (at rank `value`, else this thread's): its ticket's number."""
        value = rank() if value is None else value
        with self._cond:
            number = next(self._numbers)
            self._tickets[number] = value
            for token, held in self._holds.items():  # it takes the oldest place held at its rank
                if held == value:
                    del self._holds[token]
                    break
            return number

    def drop(self, number):
        """The compile's front end, or the compile, has ended (again: nothing)."""
        self._remove(self._tickets, number)

    def _remove(self, entries, key):
        with self._cond:
            if entries.pop(key, None) is not None:
                self._cond.notify_all()

    def hold(self, value):
        """Hold a place at rank `value` for a compile that is coming: front ends of greater ranks wait until a
        ticket of this rank comes, or `release(token)`. Returns the token."""
        token = object()
        with self._cond:
            self._holds[token] = value
        return token

    def release(self, token):
        """Give up a place held (nothing if a ticket has taken it)."""
        self._remove(self._holds, token)

    def _first(self, number):
        """Whether ticket `number` may start its front end now (the caller holds the condition's lock)."""
        mine = (self._tickets.get(number, DEFAULT_RANK), number)
        if self._running or any(held < mine[0] for held in self._holds.values()):
            return False
        return all((value, other) >= mine for other, value in self._tickets.items())

    @contextlib.contextmanager
    def turn(self, number):
        """Wait for ticket `number`'s turn at the front end (at most max_wait_s), run the block, drop the ticket. A
        thread already inside a front end goes straight in."""
        me = threading.get_ident()
        with self._cond:
            nested = me in self._running
            if not nested:
                deadline = time.monotonic() + self.max_wait_s
                while not self._first(number):
                    left = deadline - time.monotonic()
                    if left <= 0:
                        break
                    self._cond.wait(left)
                self._running.add(me)
        try:
            yield
        finally:
            if not nested:
                with self._cond:
                    self._running.discard(me)
                    self._tickets.pop(number, None)
                    self._cond.notify_all()

    def wrap(self, src, number):
        """Make src's front end (a Triton ASTSource's make_ir, which Triton's compile calls once) take ticket
        `number`'s turn."""
        make_ir = getattr(src, "make_ir", None)
        if make_ir is None:
            return

        def make_ir_in_turn(*args, **kwargs):
            with self.turn(number):
                return make_ir(*args, **kwargs)
        src.make_ir = make_ir_in_turn


class TritonKey:
    """Triton's key (triton.runtime.cache.triton_key) computed in a thread of its own (module docstring)."""

    def __init__(self, compute=None):
        self._compute = compute
        self._lock = threading.Lock()
        self._thread = None

    def start(self):
        """Start computing the key in a thread, once per process (a later call does nothing)."""
        with self._lock:
            if self._thread is not None:
                return
            compute = self._compute
            if compute is None:
                from triton.runtime.cache import triton_key as compute

            def work():
                try:
                    compute()
                except Exception:  # noqa: BLE001 - the compile computes it (or raises) itself
                    pass
            self._thread = threading.Thread(target=work, name="flashtile-triton-key", daemon=True)
            self._thread.start()

    def join(self):
        """Wait for the thread start began, if any (a compile about to need the key)."""
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join()


# The process's front-end turns and Triton's key.
FRONT_ENDS = FrontEnds()
TRITON_KEY = TritonKey()
