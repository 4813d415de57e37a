"""Several kernels compiling at once (flashtile/kernels/_compiling.py): front ends one at a time, the least rank
first, then the compile that started first, places held for the compile-ahead helper, a bounded wait, the wrap of a
compile's make_ir, and Triton's key computed once in a thread of its own that compiles wait for. CPU only: threads
and stand-ins for Triton's source object and key."""
import threading
import time

import pytest
import triton

from flashtile.kernels import _compiling, _index, _launch
from flashtile.kernels._compiling import FrontEnds, TritonKey


def _start(target, *args):
    thread = threading.Thread(target=target, args=args)
    thread.start()
    return thread


def _wait_until(predicate, timeout=5.0):
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.005)


def _running(turns):
    with turns._cond:
        return set(turns._running)


def _front_end(turns, number, log, inside, hold=None):
    with turns.turn(number):
        inside.append(number)
        assert len(inside) == 1, f"{inside} ran together"
        log.append(number)
        if hold is not None:
            hold.wait(5)
        time.sleep(0.01)
        inside.remove(number)


def test_front_ends_run_one_at_a_time_least_rank_then_first_started():
    """While one front end runs the others wait; then rank 0 goes before rank 1, and within a rank the compile that
    took its ticket first, whatever the order in which their front ends came."""
    turns = FrontEnds()
    log, inside = [], []
    gate = threading.Event()
    first = turns.ticket(1)
    threads = [_start(_front_end, turns, first, log, inside, gate)]
    _wait_until(lambda: log == [first])
    late_a, early_a, late_b, early_b = (turns.ticket(r) for r in (1, 0, 1, 0))
    for number in (late_b, early_b, late_a, early_a):  # front ends come in another order
        threads.append(_start(_front_end, turns, number, log, inside))
    time.sleep(0.05)
    assert log == [first], "a turn went in while another ran"
    gate.set()
    for thread in threads:
        thread.join()
    assert log == [first, early_a, early_b, late_a, late_b]
    assert not turns._running and not turns._tickets


def test_a_front_end_waits_for_compiles_before_it_to_reach_theirs():
    """A compile that took its ticket first (or at a lesser rank) goes first even while it has not reached its front
    end; dropping its ticket (a kernel found in the cache: no front end) lets the others go."""
    turns = FrontEnds()
    log, inside = [], []
    earlier = turns.ticket(0)
    later = turns.ticket(1)
    thread = _start(_front_end, turns, later, log, inside)
    time.sleep(0.1)
    assert log == [], "went before a compile that started first"
    turns.drop(earlier)
    thread.join()
    assert log == [later]


def test_a_held_place_keeps_greater_ranks_waiting():
    """A place held at rank 0 keeps a rank-1 front end waiting until a rank-0 compile takes its ticket (which then
    goes first) or the place is released; releasing twice is harmless."""
    turns = FrontEnds()
    log, inside = [], []
    place = turns.hold(0)
    late = turns.ticket(1)
    thread = _start(_front_end, turns, late, log, inside)
    time.sleep(0.1)
    assert log == [], "went before the place held for rank 0"
    early = turns.ticket(0)
    assert not turns._holds, "the rank-0 ticket took the place"
    other = _start(_front_end, turns, early, log, inside)
    thread.join()
    other.join()
    assert log == [early, late]
    turns.release(place)

    place = turns.hold(0)
    again = turns.ticket(1)
    thread = _start(_front_end, turns, again, log, inside)
    time.sleep(0.05)
    assert log[-1] == late
    turns.release(place)
    thread.join()
    turns.release(place)
    assert log[-1] == again


def test_a_turn_waits_at_most_max_wait():
    """Past max_wait_s a front end runs beside the one that keeps it waiting (a place never released cannot hold a
    compile up for good)."""
    turns = FrontEnds(max_wait_s=0.2)
    turns.hold(0)
    waited = []

    def front_end(number, start):
        with turns.turn(number):
            waited.append(time.monotonic() - start)

    front_end(turns.ticket(1), time.monotonic())
    with turns.turn(turns.ticket(0)):
        _start(front_end, turns.ticket(1), time.monotonic()).join()
    assert all(0.15 < w < 2.0 for w in waited) and len(waited) == 2
    assert not turns._running and not turns._tickets


def test_a_nested_turn_goes_straight_in():
    turns = FrontEnds(max_wait_s=5.0)
    start = time.monotonic()
    outer = turns.ticket(1)
    with turns.turn(outer):
        with turns.turn(turns.ticket(0)):
            pass
        assert _running(turns) == {threading.get_ident()}, "the inner turn's end ended the outer one"
    assert time.monotonic() - start < 1.0
    assert not turns._running


def test_a_turn_passes_on_after_an_error():
    turns = FrontEnds(max_wait_s=5.0)
    with pytest.raises(ZeroDivisionError):
        with turns.turn(turns.ticket()):
            1 / 0
    assert not turns._running and not turns._tickets


def test_ranked_is_per_thread_and_restores():
    seen = []
    assert _compiling.rank() == _compiling.DEFAULT_RANK
    with _compiling.ranked(0):
        assert _compiling.rank() == 0
        _start(lambda: seen.append(_compiling.rank())).join()
        assert FrontEnds().ticket() is not None
    assert _compiling.rank() == _compiling.DEFAULT_RANK
    assert seen == [_compiling.DEFAULT_RANK], "a new thread starts at the default rank"


class _Source:
    """Stand-in for Triton's ASTSource: compile calls its make_ir once."""

    def __init__(self, turns):
        self.turns = turns
        self.calls = []

    def make_ir(self, *args, **kwargs):
        self.calls.append((args, kwargs, set(self.turns._running)))
        return "module"


def test_wrap_makes_make_ir_take_its_turn():
    turns = FrontEnds()
    src = _Source(turns)
    number = turns.ticket()
    turns.wrap(src, number)
    assert src.make_ir("target", options=1) == "module"
    assert src.calls == [(("target", ), {"options": 1}, {threading.get_ident()})]
    assert not turns._running and not turns._tickets, "the front end's end dropped its ticket"
    turns.wrap(object(), turns.ticket())  # nothing to wrap: left alone


def test_triton_key_is_computed_once_in_a_thread_that_compiles_wait_for():
    calls = []

    def compute():
        calls.append(threading.current_thread().name)
        time.sleep(0.2)
    key = TritonKey(compute)
    key.join()  # nothing started: returns at once
    start = time.monotonic()
    key.start()
    key.start()
    assert time.monotonic() - start < 0.15, "start waited for the key"
    key.join()
    assert time.monotonic() - start >= 0.2
    assert calls == ["flashtile-triton-key"]

    failing = TritonKey(lambda: 1 / 0)
    failing.start()
    failing.join()  # an error is dropped: the compile computes the key itself


def test_the_real_key_is_tritons():
    from triton.runtime.cache import triton_key
    triton_key.cache_clear()
    key = TritonKey()
    key.start()
    key.join()
    assert triton_key.cache_info().currsize == 1, "the thread left Triton's key in its cache"


def test_index_empty(tmp_path, monkeypatch):
    monkeypatch.setattr(triton.knobs.cache, "dir", str(tmp_path))
    assert _index.empty(), "no index folder"
    (tmp_path / _index._DIR).mkdir()
    assert _index.empty(), "an empty index folder"
    (tmp_path / _index._DIR / "0123.json").write_text("{}")
    assert not _index.empty()


def test_the_launcher_wrapper_waits_for_the_key(monkeypatch):
    """_LauncherAhead's compile joins the key's thread before it compiles, and wraps the source's make_ir."""
    order = []
    key = TritonKey(lambda: time.sleep(0.2) or order.append("key"))
    monkeypatch.setattr(_compiling, "TRITON_KEY", key)
    monkeypatch.setattr(_launch._LauncherAhead, "start", staticmethod(lambda src: None))
    src = _Source(_compiling.FRONT_ENDS)
    wrapper = _launch._LauncherAhead(lambda src, **kw: order.append(("compile", src.make_ir())) or "kernel")
    key.start()
    assert wrapper(src, target="sm90") == "kernel"
    assert order == ["key", ("compile", "module")]
    assert src.calls[0][2] == {threading.get_ident()}, "make_ir ran in its turn"
    assert not _compiling.FRONT_ENDS._tickets, "the compile's end dropped its ticket"
    assert wrapper(_Source(_compiling.FRONT_ENDS), target="sm90") == "kernel"  # (no make_ir called: a cache hit)
    assert not _compiling.FRONT_ENDS._tickets


@pytest.mark.parametrize("fails", (False, True), ids=("prepared", "raised"))
def test_the_helper_compiles_at_rank_0_and_releases_its_place(monkeypatch, fails):
    from flashtile import _ahead
    seen = []

    def prepare(*args):
        seen.append(_compiling.rank())
        if fails:
            raise RuntimeError("no kernel")
    monkeypatch.setattr(_ahead, "prepare", prepare)
    place = _compiling.FRONT_ENDS.hold(0)
    _ahead._helper(None, None, None, None, False, None, place)
    assert seen == [0] and _compiling.rank() == _compiling.DEFAULT_RANK
    assert place not in _compiling.FRONT_ENDS._holds


def test_start_key_where_a_process_will_compile(monkeypatch, tmp_path):
    """_ahead.start_key starts the key's thread only where flashtile wraps Triton's compiles and this Triton cache
    holds no file of flashtile's index."""
    from flashtile import _ahead
    started = []
    monkeypatch.setattr(_compiling, "TRITON_KEY", type("Key", (), {"start": lambda self: started.append(1)})())
    monkeypatch.setattr(triton.knobs.cache, "dir", str(tmp_path))
    for builds, want in ((False, []), (True, [1])):
        monkeypatch.setattr(_launch, "_builds_launchers", lambda: builds)
        _ahead.start_key()
        assert started == want
    (tmp_path / _index._DIR).mkdir()
    (tmp_path / _index._DIR / "0123.json").write_text("{}")
    _ahead.start_key()
    assert started == [1], "a warm cache: no key"


def test_a_forward_without_grad_starts_the_key_on_a_plan_miss(monkeypatch):
    import torch

    import flashtile
    from flashtile import _ahead, dispatch
    calls = []
    monkeypatch.setattr(_ahead, "start_key", lambda: calls.append(1))
    q, k, v = (torch.randn(1, 33, 2, 16, generator=torch.Generator().manual_seed(i)) for i in range(3))
    dispatch._PLANS.clear()
    flashtile.flash_attn_func(q, k, v, causal=True)
    assert calls == [1]
    flashtile.flash_attn_func(q, k, v, causal=True)
    assert calls == [1], "the plan was found: nothing new to compile"
