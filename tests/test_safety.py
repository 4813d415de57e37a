"""Safety (docs/safety.md): bad and edge argument values.

1. The catalog (tests/safety_catalog.py, > 150 cases) in both CPU modes, the reference path and the kernels in
   Triton's interpreter, each mode in subprocesses (one per class of cases, restarted after a crash), so that a
   crash fails its case instead of killing pytest. Every case must pass: a clear error, or the float64 reference's
   result.
2. Property tests (hypothesis) over random shapes, dtypes, lengths including 0, windows including huge ones,
   masks and KV-cache layouts, against the float64 reference; and random corruptions of valid index tensors, which
   must raise before anything is written.
3. The checks' own behaviour: what is read where, the repeated-call path, and (GPU) that the default path never
   synchronises while FLASHTILE_CHECK_VALUES does.
"""
import fcntl
import json
import os
import subprocess
import sys

import pytest
import torch

import flashtile
from flashtile import _values, testing
from flashtile.reference import kvcache as ref_kv

sys.path.insert(0, os.path.dirname(__file__))
import safety_catalog  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CATALOG = os.path.join(REPO, "tests", "safety_catalog.py")
MODES = ("reference", "interpreter")
CASES = safety_catalog.CASES
# A subprocess per (mode, class); a restart after a crash costs one more import.
CLASS_TIMEOUT_S = 900


def _run_class(mode, cls):
    """{case: (status, detail)} of one class of the catalog in one mode, in subprocesses: a case that kills its
    process is reported as "crash" and the rest run in a fresh one."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([REPO] + [p for p in [os.environ.get("PYTHONPATH")] if p]))
    env.pop("TRITON_INTERPRET", None)
    if mode == "interpreter":
        env["TRITON_INTERPRET"] = "1"
    names = [n for n, (c, _) in CASES.items() if c == cls]
    results = {}
    while len(results) < len(names):
        todo = [n for n in names if n not in results]
        try:
            proc = subprocess.run([sys.executable, CATALOG, *todo], env=env, capture_output=True, text=True,
                                  timeout=CLASS_TIMEOUT_S)
            stdout, stderr, rc = proc.stdout, proc.stderr, proc.returncode
        except subprocess.TimeoutExpired as e:
            stdout, stderr, rc = (e.stdout or b"").decode(), (e.stderr or b"").decode(), "timeout"
        started = None
        for line in stdout.splitlines():
            try:
                record = json.loads(line)
            except ValueError:
                continue
            if "start" in record:
                started = record["start"]
            else:
                results[record["case"]] = (record["status"], record["detail"])
                started = None
        if started is not None:
            results[started] = ("crash", f"the process died (exit {rc}): {stderr[-600:]}")
        elif len(results) < len(names) or rc != 0:
            # Died before its first case (an import error) or after the last (teardown): blame every case left.
            for n in todo:
                if n not in results or rc != 0:
                    results[n] = ("crash", f"runner exit {rc} outside a case: {stderr[-600:]}")
            break
    return results


@pytest.fixture(scope="session")
def catalog_dir(tmp_path_factory):
    """A directory shared by the xdist workers of this session (each class runs once per mode, whichever worker
    asks first)."""
    base = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        base = base.parent
    path = base / "safety-catalog"
    path.mkdir(exist_ok=True)
    return path


_LOADED = {}


def _results(mode, cls, directory):
    if (mode, cls) not in _LOADED:
        done = directory / f"{mode}-{cls}.json"
        with open(directory / f"{mode}-{cls}.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            if not done.exists():
                done.write_text(json.dumps(_run_class(mode, cls)))
        _LOADED[(mode, cls)] = json.loads(done.read_text())
    return _LOADED[(mode, cls)]


# Cases only a kernel change fixes (flashtile/kernels/ is being restructured; the fix is listed for its owners).
# They must fail until it lands: one that passes fails here, so that it leaves this list.
# (mode, case) -> why it still fails: cases waiting on a kernel fix (the test fails once one passes).
KERNEL_PENDING = {}


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", list(CASES))
def test_catalog(name, mode, catalog_dir):
    status, detail = _results(mode, CASES[name][0], catalog_dir)[name]
    pending = KERNEL_PENDING.get((mode, name))
    if pending is not None:
        assert status != "pass", f"{name} ({mode} mode) passes now: remove it from KERNEL_PENDING"
        pytest.xfail(f"kernel fix pending: {pending} ({status}: {detail})")
    assert status == "pass", f"{name} ({mode} mode): {status}: {detail}"


def test_catalog_size():
    """The issue's bar: more than 100 cases, covering every class."""
    classes = {cls for cls, _ in CASES.values()}
    assert len(CASES) > 150 and classes == {"window", "varlen", "kvcache", "types", "empty", "nan", "transform"}


# ---------------------------------------------------------------------------------------------------------------
# Property tests

import hypothesis  # noqa: E402
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

# CI budget: a few dozen examples per property in the interpreter (~1-3 s each), derandomised so CI is stable;
# FLASHTILE_HYPOTHESIS_EXAMPLES raises the count for a longer local search.
EXAMPLES = int(os.environ.get("FLASHTILE_HYPOTHESIS_EXAMPLES", "0"))
PROPERTY = dict(deadline=None, derandomize=not EXAMPLES, print_blob=True,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                       HealthCheck.function_scoped_fixture])
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
HUGE = [2 ** 31 - 1, 2 ** 31, 2 ** 32 + 1, 2 ** 62, 2 ** 63 - 1]
windows = st.one_of(st.just(-1), st.integers(0, 24), st.sampled_from(HUGE))


def _gen(seed):
    return torch.Generator().manual_seed(seed)


@settings(max_examples=EXAMPLES or 8, **PROPERTY)
@given(b=st.integers(1, 2), sq=st.integers(1, 33), sk=st.integers(1, 33), hk=st.integers(1, 2),
       group=st.integers(1, 2), d=st.sampled_from([8, 16, 24]), dtype=st.sampled_from(DTYPES),
       causal=st.booleans(), left=windows, right=windows, softcap=st.sampled_from([0.0, 0.0, 5.0]),
       seed=st.integers(0, 2 ** 16))
def test_property_attention(b, sq, sk, hk, group, d, dtype, causal, left, right, softcap, seed):
    """flash_attn_func forward and backward against the float64 reference, any window (huge ones included)."""
    q, k, v = testing.make_qkv(b, sq, sk, hk * group, hk, d, dtype, seed=seed)
    out, lse, _ = flashtile.flash_attn_func(q, k, v, causal=causal, window_size=(left, right), softcap=softcap,
                                            return_attn_probs=True)
    dout = torch.randn(out.shape, generator=_gen(seed)).to(dtype)
    grads = torch.autograd.grad((out * dout).sum(), (q, k, v))
    # The oracle gets the window as an explicit mask built with Python ints (no int64 in sight).
    mask = safety_catalog.band(sq, sk, sk - sq, left, 0 if causal else right)
    testing.check_against_reference((out, lse, *grads), q.detach(), k.detach(), v.detach(), dout, d ** -0.5, False,
                                    None, attn_mask=mask, softcap=softcap)


@settings(max_examples=EXAMPLES or 8, **PROPERTY)
@given(lens=st.lists(st.tuples(st.integers(0, 20), st.integers(0, 20)), min_size=1, max_size=4),
       d=st.sampled_from([8, 16]), dtype=st.sampled_from(DTYPES), causal=st.booleans(), left=windows,
       right=windows, extra=st.integers(0, 3), seed=st.integers(0, 2 ** 16))
def test_property_varlen(lens, d, dtype, causal, left, right, extra, seed):
    """flash_attn_varlen_func with lengths including 0 (max_seqlen possibly larger than needed) against the float64
    reference per sequence."""
    lens_q, lens_k = [a for a, _ in lens], [c for _, c in lens]
    if sum(lens_q) == 0 or sum(lens_k) == 0:
        lens_q[0], lens_k[0] = lens_q[0] + 1, lens_k[0] + 1
    gen = _gen(seed)
    q = torch.randn((sum(lens_q), 2, d), generator=gen).to(dtype).requires_grad_()
    k = torch.randn((sum(lens_k), 1, d), generator=gen).to(dtype).requires_grad_()
    v = torch.randn((sum(lens_k), 1, d), generator=gen).to(dtype).requires_grad_()
    cu_q, cu_k = testing.cu_seqlens(lens_q), testing.cu_seqlens(lens_k)
    window = (left, right)
    out, lse, _ = flashtile.flash_attn_varlen_func(q, k, v, cu_q, cu_k, max(lens_q) + extra, max(lens_k) + extra,
                                                   causal=causal, window_size=window, return_attn_probs=True)
    dout = torch.randn(out.shape, generator=gen).to(dtype)
    grads = torch.autograd.grad((out * dout).sum(), (q, k, v))
    # Per sequence: the window as an explicit mask, aligned to the sequence's own bottom-right corner.
    bq, bk = cu_q.tolist(), cu_k.tolist()
    for i in range(len(lens)):
        rq, rk = slice(bq[i], bq[i + 1]), slice(bk[i], bk[i + 1])
        nq, nk = lens_q[i], lens_k[i]
        if nq == 0:
            assert not grads[1][rk].any() and not grads[2][rk].any()
            continue
        if nk == 0:
            assert not out[rq].any() and not grads[0][rq].any() and torch.isneginf(lse[:, rq]).all()
            continue
        mask = safety_catalog.band(nq, nk, nk - nq, left, 0 if causal else right)
        seq = lambda t, r: t.detach()[r].unsqueeze(0)  # noqa: E731
        testing.check_against_reference(
            (seq(out, rq), lse[:, rq].unsqueeze(0), seq(grads[0], rq), seq(grads[1], rk), seq(grads[2], rk)),
            seq(q, rq), seq(k, rk), seq(v, rk), dout[rq].unsqueeze(0), d ** -0.5, False, None, attn_mask=mask)


@st.composite
def cache_layouts(draw):
    """A valid flash_attn_with_kvcache call's index arguments: lengths (0 allowed), an append, leftpad, a paged
    or contiguous cache with cache_batch_idx, and a window."""
    batch = draw(st.integers(1, 3))
    page = draw(st.sampled_from([None, 4, 8, 16]))
    capacity = draw(st.integers(1, 5)) * (page or 8)
    new = draw(st.integers(0, min(3, capacity)))
    lengths = draw(st.lists(st.integers(0, capacity - new), min_size=batch, max_size=batch))
    leftpad = None
    if draw(st.booleans()):
        leftpad = [draw(st.integers(0, n + new)) for n in lengths]
    batch_idx = None
    if page is None and draw(st.booleans()):
        batch_idx = draw(st.permutations(list(range(batch + 1))))[:batch]
    return dict(batch=batch, page=page, capacity=capacity, new=new, lengths=lengths, leftpad=leftpad,
                batch_idx=batch_idx, sq=draw(st.integers(1, 4)), causal=draw(st.booleans()),
                window=(draw(windows), draw(windows)), int_seqlens=draw(st.booleans()) and len(set(lengths)) == 1,
                seed=draw(st.integers(0, 2 ** 16)))


def _cache_call(layout, dtype=torch.float32):
    """(q, k_cache, v_cache, kwargs) of a layout from cache_layouts."""
    batch, page, capacity = layout["batch"], layout["page"], layout["capacity"]
    gen = _gen(layout["seed"])
    q = torch.randn((batch, layout["sq"], 2, 16), generator=gen).to(dtype)
    kw = dict(causal=layout["causal"], window_size=layout["window"])
    if page is None:
        rows = batch + (1 if layout["batch_idx"] is not None else 0)
        k_cache = torch.randn((rows, capacity, 1, 16), generator=gen).to(dtype)
        if layout["batch_idx"] is not None:
            kw["cache_batch_idx"] = torch.tensor(layout["batch_idx"], dtype=torch.int32)
    else:
        per_seq = capacity // page
        pages = batch * per_seq + 1
        k_cache = torch.randn((pages, page, 1, 16), generator=gen).to(dtype)
        kw["block_table"] = torch.randperm(pages, generator=gen)[:batch * per_seq].view(batch, per_seq).int()
    v_cache = torch.randn(k_cache.shape, generator=gen).to(dtype)
    lengths = layout["lengths"]
    kw["cache_seqlens"] = lengths[0] if layout["int_seqlens"] else torch.tensor(lengths, dtype=torch.int32)
    if layout["leftpad"] is not None:
        kw["cache_leftpad"] = torch.tensor(layout["leftpad"], dtype=torch.int32)
    if layout["new"]:
        kw["k"] = torch.randn((batch, layout["new"], 1, 16), generator=gen).to(dtype)
        kw["v"] = torch.randn((batch, layout["new"], 1, 16), generator=gen).to(dtype)
    return q, k_cache, v_cache, kw


@settings(max_examples=EXAMPLES or 12, **PROPERTY)
@given(layout=cache_layouts())
def test_property_kvcache(layout):
    """flash_attn_with_kvcache (append and attention) against the float64 reference, caches included."""
    q, k_cache, v_cache, kw = _cache_call(layout)
    ref64 = ref_kv.kvcache_forward(q.double(), k_cache.double(), v_cache.double(), **{
        name: t.double() if isinstance(t, torch.Tensor) and t.is_floating_point() else t for name, t in kw.items()})
    plain = ref_kv.kvcache_forward(q, k_cache, v_cache, **kw)
    out, lse = flashtile.flash_attn_with_kvcache(q, k_cache, v_cache, return_softmax_lse=True, **kw)
    testing.assert_close("out", out, ref64[0], plain[0], q.dtype)
    testing.assert_close("lse", lse, ref64[1], plain[1], torch.float32)
    assert torch.equal(k_cache, plain[2]) and torch.equal(v_cache, plain[3])


CORRUPTIONS = ["seqlens-low", "seqlens-high", "leftpad-low", "leftpad-high", "batch_idx", "block_table",
               "cu_q", "cu_k", "max_seqlen"]


@settings(max_examples=EXAMPLES or 80, **PROPERTY)
@given(layout=cache_layouts(), which=st.sampled_from(CORRUPTIONS), entry=st.integers(0, 2 ** 16),
       amount=st.sampled_from([1, 2, 7, 2 ** 20, 2 ** 30]))
def test_property_bad_values_raise(layout, which, entry, amount):
    """A valid call with one index value pushed out of its range raises a ValueError naming the argument, and
    leaves the cache as it was."""
    hypothesis.event(which)
    if which in ("cu_q", "cu_k", "max_seqlen"):
        lens = [n + 1 for n in layout["lengths"]]
        q, k, v = (torch.randn(sum(lens), 2, 16) for _ in range(3))
        cu = testing.cu_seqlens(lens)
        cu_q, cu_k, max_len = cu.clone(), cu.clone(), max(lens)
        if which == "max_seqlen":
            max_len -= min(amount, max_len)
            name = "max_seqlen_q"
        else:
            bad = cu_q if which == "cu_q" else cu_k
            # Negative, or past the last row: either is out of order wherever it lands.
            bad[entry % bad.numel()] = -amount if entry % 2 else sum(lens) + amount
            name = f"cu_seqlens_{which[-1]}"
        with pytest.raises(ValueError, match=name):
            flashtile.flash_attn_varlen_func(q, k, v, cu_q, cu_k, max_len, max_len)
        return
    q, k_cache, v_cache, kw = _cache_call(dict(layout, int_seqlens=False))
    b = entry % layout["batch"]
    capacity, new = layout["capacity"], layout["new"]
    if which.startswith("seqlens"):
        name = "cache_seqlens"
        kw[name][b] = -amount if which == "seqlens-low" else capacity - new + amount
    elif which.startswith("leftpad"):
        name = "cache_leftpad"
        pad = kw.setdefault(name, torch.zeros(layout["batch"], dtype=torch.int32))
        pad[b] = -amount if which == "leftpad-low" else int(kw["cache_seqlens"][b]) + new + amount
    elif which == "batch_idx" and "cache_batch_idx" in kw:
        name = "cache_batch_idx"
        kw[name][b] = k_cache.shape[0] - 1 + amount if entry % 2 else -amount
    elif which == "block_table" and "block_table" in kw:
        name = "block_table"
        n = int(kw["cache_seqlens"][b])
        pad = int(kw["cache_leftpad"][b]) if "cache_leftpad" in kw else 0
        first, end = min(pad, n) // layout["page"], (n + new + layout["page"] - 1) // layout["page"]
        if end == first:
            return  # sequence b uses no page: nothing to corrupt
        kw[name][b, first + entry % (end - first)] = k_cache.shape[0] - 1 + amount if entry % 2 else -amount
    else:
        return
    before = k_cache.clone(), v_cache.clone()
    hypothesis.event(f"{which}: corrupted")
    with pytest.raises(ValueError, match=name):
        flashtile.flash_attn_with_kvcache(q, k_cache, v_cache, **kw)
    assert torch.equal(k_cache, before[0]) and torch.equal(v_cache, before[1])


# ---------------------------------------------------------------------------------------------------------------
# What is read where


# The device clamp's kernel runs where the kernels do: compiled on a GPU, in the interpreter on the CPU.
KERNEL_DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _clamped(cu, rows):
    # What the device clamp must give: into [0, rows], then a running maximum.
    return torch.cummax(cu.clamp(0, rows), dim=0).values


def test_clamp_offsets():
    # The device-side clamp of unchecked varlen offsets (CUDA tensors by default; here the kernel in the
    # interpreter): into [0, rows], non-decreasing, valid offsets unchanged; its own result comes back as it is for
    # the same rows (the backward reuses the forward's), and is clamped again for other rows.
    bad = torch.tensor([0, 7, 3, -2, 40], dtype=torch.int32, device=KERNEL_DEVICE)
    safe, none = _values.clamp_offsets(bad, 20)
    assert none is None and safe.dtype == torch.int32
    assert safe.tolist() == [0, 7, 7, 7, 20]
    assert _values.clamp_offsets(safe, 20)[0] is safe
    assert _values.clamp_offsets(safe, 10)[0].tolist() == [0, 7, 7, 7, 10]
    good = torch.tensor([0, 3, 3, 9], dtype=torch.int32, device=KERNEL_DEVICE)
    assert torch.equal(_values.clamp_offsets(good, 9)[0], good)


@pytest.mark.parametrize("n", [2, 37, 1024, 2500])
def test_clamp_offsets_both_in_one_launch(n):
    # Queries' and keys' offsets in one launch, each against its own rows; past 1024 offsets the kernel works in
    # blocks and carries the maximum from one to the next (a drop right after a block's end must not be lost).
    gen = torch.Generator().manual_seed(n)
    cu_q = torch.randint(-50, 3000, (n,), generator=gen, dtype=torch.int32)
    cu_k = torch.randint(-50, 5000, (n,), generator=gen, dtype=torch.int32)
    if n > 1024:
        cu_q[1023], cu_q[1024:1030] = 2999, 5  # the first block's maximum must carry into the second
    cu_q, cu_k = cu_q.to(KERNEL_DEVICE), cu_k.to(KERNEL_DEVICE)
    safe_q, safe_k = _values.clamp_offsets(cu_q, 2000, cu_k, 4100)
    assert torch.equal(safe_q, _clamped(cu_q, 2000)) and torch.equal(safe_k, _clamped(cu_k, 4100))
    # One of them made here before: the other is clamped alone, the first kept.
    again_q, again_k = _values.clamp_offsets(safe_q, 2000, cu_k, 3000)
    assert again_q is safe_q and torch.equal(again_k, _clamped(cu_k, 3000))


def test_readable():
    """CPU tensors are read; meta tensors and subclasses (FakeTensor under torch.compile, ...) are not."""
    cpu = torch.zeros(3, dtype=torch.int32)

    class Subclass(torch.Tensor):
        pass

    assert _values.readable(cpu)
    assert not _values.readable(torch.zeros(3, dtype=torch.int32, device="meta"))
    assert not _values.readable(cpu.as_subclass(Subclass))


def test_varlen_message_names_the_entry():
    q, k, v = (torch.randn(12, 2, 16) for _ in range(3))
    cu = torch.tensor([0, 7, 5, 12], dtype=torch.int32)
    with pytest.raises(ValueError, match=r"cu_seqlens_q decreases at entry 2: cu_seqlens_q\[1\] = 7 > "
                                         r"cu_seqlens_q\[2\] = 5"):
        flashtile.flash_attn_varlen_func(q, k, v, cu, testing.cu_seqlens([5, 4, 3]), 12, 12)
    good = testing.cu_seqlens([5, 4, 3])
    with pytest.raises(ValueError, match=r"max_seqlen_k=4 but sequence 0 has 5 rows"):
        flashtile.flash_attn_varlen_func(q, k, v, good, good, 5, 4)


def test_varlen_grid_covers_the_longest_sequence(monkeypatch):
    """With host-visible offsets the launch covers the longest sequence, not a larger max_seqlen (a huge one would
    launch a huge grid)."""
    from flashtile import dispatch
    seen = []
    real = dispatch.forward

    def spy(q, k, v, req, **kw):
        seen.append((req.max_seqlen_q, req.max_seqlen_k))
        return real(q, k, v, req, **kw)

    monkeypatch.setattr(dispatch, "forward", spy)
    q, k, v = (torch.randn(12, 2, 16) for _ in range(3))
    cu = testing.cu_seqlens([5, 4, 3])
    flashtile.flash_attn_varlen_func(q, k, v, cu, cu, 2 ** 31 - 1, 2 ** 40)
    assert seen == [(5, 5)]


def test_kvcache_repeated_call_checks_values():
    """The repeated-call path (kvcache._CALLS) checks CPU index values like the first call."""
    from flashtile import kvcache
    q = torch.randn(2, 1, 2, 16)
    k_cache, v_cache = torch.randn(2, 16, 1, 16), torch.randn(2, 16, 1, 16)
    seqlens = torch.tensor([3, 4], dtype=torch.int32)
    flashtile.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=seqlens)
    flashtile.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=seqlens)
    if any(call.host_values for call in kvcache._CALLS.values()):  # the interpreter keeps plans; the reference not
        seqlens[1] = 17
        with pytest.raises(ValueError, match=r"cache_seqlens\[1\] = 17"):
            flashtile.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=seqlens)


def test_check_values_setting_reads_cpu_either_way():
    """CPU values are checked whatever the setting (it only adds CUDA tensors); flashtile.check_values sets it for a
    block and restores it."""
    from flashtile._settings import SETTINGS
    q, k, v = (torch.randn(12, 2, 16) for _ in range(3))
    cu = torch.tensor([0, 5, 9, 13], dtype=torch.int32)
    before = SETTINGS.check_values
    for on in (False, True):
        with flashtile.check_values(on), pytest.raises(ValueError, match="cu_seqlens_q ends at 13"):
            assert SETTINGS.check_values is on
            flashtile.flash_attn_varlen_func(q, k, v, cu, testing.cu_seqlens([5, 4, 3]), 5, 5)
    assert SETTINGS.check_values is before


# ---------------------------------------------------------------------------------------------------------------
# GPU: the default path never synchronises; the full check does, and raises


def _gpu_varlen(bad=False):
    lens = [37, 0, 64, 5]
    q, k, v = (torch.randn(sum(lens), 4, 64, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    cu = testing.cu_seqlens(lens, device="cuda")
    if bad:
        cu[2] = 1000
    return q, k, v, cu, max(lens)


def _gpu_kvcache(bad=False):
    q = torch.randn(3, 1, 8, 128, device="cuda", dtype=torch.bfloat16)
    k_cache, v_cache = (torch.randn(12, 64, 2, 128, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    table = torch.arange(12, device="cuda", dtype=torch.int32).view(3, 4)
    seqlens = torch.tensor([10, 300 if bad else 100, 0], device="cuda", dtype=torch.int32)
    k, v = (torch.randn(3, 1, 2, 128, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    return q, k_cache, v_cache, dict(k=k, v=v, cache_seqlens=seqlens, block_table=table)


@pytest.mark.gpu
def test_gpu_default_path_never_synchronises():
    q, k, v, cu, m = _gpu_varlen()
    qc, k_cache, v_cache, kw = _gpu_kvcache()
    flashtile.flash_attn_varlen_func(q, k, v, cu, cu, m, m)  # compile outside the sync check
    flashtile.flash_attn_with_kvcache(qc, k_cache, v_cache, **kw)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        flashtile.flash_attn_varlen_func(q, k, v, cu, cu, m, m)
        for _ in range(2):  # the first call and the repeated-call path
            flashtile.flash_attn_with_kvcache(qc, k_cache, v_cache, **kw)
    finally:
        torch.cuda.set_sync_debug_mode("default")


@pytest.mark.gpu
def test_gpu_check_values_raises():
    q, k, v, cu, m = _gpu_varlen(bad=True)
    qc, k_cache, v_cache, kw = _gpu_kvcache(bad=True)
    with flashtile.check_values():
        with pytest.raises(ValueError, match="cu_seqlens_q"):
            flashtile.flash_attn_varlen_func(q, k, v, cu, cu, m, m)
        before = k_cache.clone()
        with pytest.raises(ValueError, match=r"cache_seqlens\[1\] = 300"):
            flashtile.flash_attn_with_kvcache(qc, k_cache, v_cache, **kw)
        assert torch.equal(k_cache, before)


@pytest.mark.gpu
@pytest.mark.parametrize("bad", [1000, -5, 20], ids=["past-the-rows", "negative", "decreasing"])
def test_gpu_bad_offsets_are_clamped_on_the_device(bad):
    """Unchecked CUDA offsets (the default) are clamped on the device before any kernel reads them: with the offset
    between sequences 2 and 3 bad, sequence 0 (rows [0, 37)) still gets its own attention, forward and backward,
    with queries and keys clamped in one launch (separate offsets tensors), and nothing faults."""
    lens = [37, 0, 64, 5]
    gen = torch.Generator(device="cuda").manual_seed(7)
    q, k, v = (torch.randn(sum(lens), 4, 64, device="cuda", dtype=torch.bfloat16, generator=gen).requires_grad_()
               for _ in range(3))
    cu_q, cu_k = testing.cu_seqlens(lens, device="cuda"), testing.cu_seqlens(lens, device="cuda")
    cu_q[3] = cu_k[3] = bad
    safe_q, safe_k = _values.clamp_offsets(cu_q, q.shape[0], cu_k, k.shape[0])
    assert torch.equal(safe_q, _clamped(cu_q, q.shape[0])) and torch.equal(safe_k, _clamped(cu_k, k.shape[0]))
    out = flashtile.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 64, 64, causal=True)
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), torch.ones_like(out))
    torch.cuda.synchronize()
    ref = flashtile.reference.naive_attention(q[None, :37].double(), k[None, :37].double(), v[None, :37].double(),
                                              causal=True)[0]
    torch.testing.assert_close(out[:37].double(), ref[0], atol=2e-2, rtol=2e-2)
    assert all(torch.isfinite(g[:37]).all() for g in (dq, dk, dv))


def test_compiled_varlen_checks_the_real_offsets():
    """Under torch.compile the public function sees fake tensors; the op checks the real offsets when it runs."""
    q, k, v = (torch.randn(12, 2, 16) for _ in range(3))
    fn = torch.compile(lambda q, k, v, cu: flashtile.flash_attn_varlen_func(q, k, v, cu, cu, 5, 5), fullgraph=True)
    good = testing.cu_seqlens([5, 4, 3])
    torch.testing.assert_close(fn(q, k, v, good), flashtile.flash_attn_varlen_func(q, k, v, good, good, 5, 5))
    with pytest.raises(ValueError, match=r"cu_seqlens_q decreases at entry 2"):
        fn(q, k, v, torch.tensor([0, 7, 5, 12], dtype=torch.int32))
