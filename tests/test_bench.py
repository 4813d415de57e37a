"""CPU tests of the benchmark's pure parts (flashtile/bench/): FLOP counting, the shape suite and its filters, the
correctness guard, error reporting through run_suite (with a fake timer), the table, the results files, and the
command line without a GPU."""

import json
import os
import subprocess
import sys
from dataclasses import asdict, replace
from pathlib import Path

import pytest
import torch

import flashtile
from flashtile.bench import runner as bench
from flashtile.bench.registry import PROVIDERS, Prepared, Provider, Shape, Unsupported, _sdpa_prepare

REPO = Path(__file__).resolve().parents[1]


# ---------------------------------------------------------------------------------------------------------------
# flops


def _brute_force_pairs(sq, sk, causal):
    return sum(1 for i in range(sq) for j in range(sk) if not causal or j <= i + sk - sq)


@pytest.mark.parametrize("sq,sk", [(1, 1), (1, 7), (7, 1), (5, 5), (7, 63), (63, 7), (129, 257), (257, 129),
                                   (3, 300), (300, 3), (64, 65)], ids=lambda x: str(x))
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_visible_pairs_matches_brute_force(sq, sk, causal):
    assert bench.visible_pairs(sq, sk, causal) == _brute_force_pairs(sq, sk, causal)


def test_flops_forward_and_causal_halving():
    b, h, s, d = 2, 16, 4096, 128
    full = bench.flops(b, h, s, s, d, False, "fwd")
    assert full == 4 * b * h * s * s * d
    assert bench.flops(b, h, s, s, d, True, "fwd") == full / 2


def test_flops_causal_unequal_lengths_counts_visible_pairs():
    b, h, sq, sk, d = 3, 5, 129, 257, 64
    assert bench.flops(b, h, sq, sk, d, True, "fwd") == 4 * b * h * d * _brute_force_pairs(sq, sk, True)
    # More queries than keys: the first sq - sk rows see nothing.
    assert bench.flops(b, h, sk, sq, d, True, "fwd") == 4 * b * h * d * _brute_force_pairs(sk, sq, True)


@pytest.mark.parametrize("causal", [False, True])
def test_flops_backward_factors(causal):
    args = (4, 8, 1024, 1024, 64, causal)
    fwd = bench.flops(*args, "fwd")
    assert bench.flops(*args, "bwd") == pytest.approx(2.5 * fwd)
    assert bench.flops(*args, "fwd+bwd") == pytest.approx(3.5 * fwd)
    with pytest.raises(ValueError, match="mode"):
        bench.flops(*args, "backward")


# ---------------------------------------------------------------------------------------------------------------
# shapes and filters


def test_standard_suite():
    shapes = bench.select_shapes()
    assert len(shapes) == 3 * 3 * 2
    for s in shapes:
        assert s.batch * s.seqlen_q == 16 * 1024
        assert s.heads * s.headdim == 2048
        assert s.seqlen_q == s.seqlen_k and s.heads == s.heads_k
    assert {s.seqlen_q for s in shapes} == {1024, 4096, 16384}
    assert {s.headdim for s in shapes} == {64, 128, 256}
    assert {s.causal for s in shapes} == {False, True}


def test_quick_and_filters():
    quick = bench.select_shapes(quick=True)
    assert {(s.seqlen_q, s.headdim) for s in quick} == {(16384, 64), (16384, 128)}
    assert len(quick) == 4
    only = bench.select_shapes(seqlens=(4096,), headdims=(256,), causal="1")
    assert only == [Shape(4, 4096, 4096, 8, 8, 256, True)]
    assert [s.causal for s in bench.select_shapes(causal="0")] == [False] * 9
    # explicit lists override --quick's
    assert {s.headdim for s in bench.select_shapes(headdims=(256,), quick=True)} == {256}
    with pytest.raises(ValueError, match="headdim 96 does not divide.*--hidden 1536"):
        bench.select_shapes(headdims=(96,))
    # --hidden: 16 heads at headdim 96, batch still 16k / seqlen
    assert bench.select_shapes(seqlens=(1024,), headdims=(96,), causal="1", hidden=1536) == [
        Shape(16, 1024, 1024, 16, 16, 96, True)]
    assert bench.build_parser().parse_args(["--hidden", "1536"]).hidden == 1536
    assert bench.build_parser().parse_args([]).hidden == 2048
    # --heads: that many heads at every head dim (head dims that divide no common hidden size in one run)
    args = bench.build_parser().parse_args(["--headdim", "72,136", "--heads", "16"])
    assert bench.select_shapes((4096,), args.headdim, "1", hidden=args.hidden, heads=args.heads) == [
        Shape(4, 4096, 4096, 16, 16, 72, True), Shape(4, 4096, 4096, 16, 16, 136, True)]
    assert bench.build_parser().parse_args([]).heads is None
    with pytest.raises(SystemExit):  # (argparse: not allowed with --hidden)
        bench.build_parser().parse_args(["--hidden", "1536", "--heads", "16"])
    with pytest.raises(ValueError, match="--heads must be at least 1, got 0"):
        bench.select_shapes(headdims=(64,), heads=0)


def test_cli_parsing():
    args = bench.build_parser().parse_args(["--seqlen", "1k,16k", "--headdim", "64", "--causal", "1", "--mode", "bwd",
                                            "--providers", "flashtile,fa4", "--dtype", "fp16", "--tag", "x"])
    assert args.seqlen == (1024, 16384) and args.headdim == (64,)
    assert bench.select_modes(args.mode) == ("bwd",)
    assert bench.select_modes("both") == ("fwd", "bwd")
    assert bench.select_providers(args.providers) == ["flashtile", "fa4"]
    assert bench.select_providers(None) == list(PROVIDERS)
    assert bench.parse_size("4096") == 4096 and bench.parse_size("16K") == 16384
    with pytest.raises(ValueError, match="unknown provider.*nope"):
        bench.select_providers("flashtile,nope")
    with pytest.raises(SystemExit):
        bench.build_parser().parse_args(["--seqlen", "1m"])


def test_registry_has_every_provider():
    assert list(PROVIDERS) == ["flashtile", "flashtile-triton", "sdpa-cudnn", "sdpa-flash", "flex", "fa2", "fa4"]
    for p in PROVIDERS.values():
        reason = p.available()
        assert reason is None or isinstance(reason, str) and reason


# ---------------------------------------------------------------------------------------------------------------
# correctness guard


def test_check_rows_cover_ends():
    rows = bench.check_rows(16384)
    assert rows[0] == 0 and rows[-1] == 16383 and len(rows) <= bench.CHECK_ROWS
    assert torch.equal(bench.check_rows(7), torch.arange(7))


@pytest.mark.parametrize("sq,sk,hk", [(33, 33, 4), (17, 40, 2), (40, 17, 4)], ids=["eq", "sq<sk-gqa", "sq>sk"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_reference_rows_match_naive(sq, sk, hk, causal):
    torch.manual_seed(0)
    b, h, d = 2, 4, 16
    q, k, v = torch.randn(b, sq, h, d), torch.randn(b, sk, hk, d), torch.randn(b, sk, hk, d)
    scale = d ** -0.5
    rows = bench.check_rows(sq, n=8)
    got = bench.reference_rows(q, k, v, causal, scale, rows)
    # naive float64, bottom-right causal, fully masked rows -> 0
    kk = k.double().repeat_interleave(h // hk, dim=2)
    vv = v.double().repeat_interleave(h // hk, dim=2)
    s = torch.einsum("bqhd,bkhd->bhqk", q.double(), kk) * scale
    visible = torch.ones(sq, sk, dtype=torch.bool)
    if causal:
        visible = torch.arange(sk)[None, :] <= torch.arange(sq)[:, None] + (sk - sq)
    p = torch.softmax(s.masked_fill(~visible, float("-inf")), dim=-1).nan_to_num(0.0)
    want = torch.einsum("bhqk,bkhd->bqhd", p, vv)[:, rows]
    assert got.shape == (b, len(rows), h, d)
    torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-5)


def test_sdpa_provider_layout_roundtrip_on_cpu():
    """sdpa-flash's prepare (layout conversion, leaves, causal) checked on CPU, where SDPA has a flash kernel."""
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 64, 4, 32, dtype=torch.bfloat16) for _ in range(3))
    prepared = _sdpa_prepare("FLASH_ATTENTION")(q, k, v, True, 32 ** -0.5)
    assert all(t.requires_grad and t.is_leaf and t.shape == (2, 4, 64, 32) for t in prepared.inputs)
    with prepared.context():
        out = prepared.to_bshd(prepared.fwd())
    rows = bench.check_rows(64)
    ref = bench.reference_rows(q, k, v, True, 32 ** -0.5, rows)
    assert bench.max_abs_diff(out, ref, rows, q.shape) < bench.ATOL[torch.bfloat16]
    with pytest.raises(Unsupported, match="top-left"):
        _sdpa_prepare("FLASH_ATTENTION")(q, k[:, :32], v[:, :32], True, 32 ** -0.5)


def test_fa4_import_adds_the_cutlass_dsl_path(tmp_path, monkeypatch):
    """`pip install --target` skips the DSL's .pth file; the fa4 provider adds dsl_packages to sys.path itself.
    Mirrors the installed layout: flash_attn/cute and nvidia_cutlass_dsl are namespace packages."""
    from flashtile.bench import registry
    (tmp_path / "flash_attn" / "cute").mkdir(parents=True)
    (tmp_path / "flash_attn" / "cute" / "__init__.py").write_text(
        "import cutlass\n\ndef flash_attn_func(q, k, v, qv=None, softmax_scale=None, causal=False):\n"
        "    return q, None\n")
    dsl = tmp_path / "nvidia_cutlass_dsl" / "dsl_packages"
    (dsl / "cutlass").mkdir(parents=True)
    (dsl / "cutlass" / "__init__.py").write_text("")
    monkeypatch.setattr(sys, "path", [str(tmp_path)] + sys.path)
    names = ("flash_attn", "cutlass", "nvidia_cutlass_dsl")
    assert not any(m.split(".")[0] in names for m in sys.modules)
    try:
        fn = registry._fa4_import()
        assert str(dsl) in sys.path
        assert registry._fa4_available() in (None, "no CUDA device")
        q = torch.randn(1, 4, 1, 8)
        prepared = registry._fa4_prepare(q, q, q, False, 1.0)
        assert torch.equal(prepared.fwd(), q)        # (out, lse) -> out
        assert fn(q, q, q)[0] is q
    finally:
        for m in [m for m in sys.modules if m.split(".")[0] in names]:
            del sys.modules[m]


# ---------------------------------------------------------------------------------------------------------------
# run_suite on CPU with fake providers and a fake timer


def _bshd_provider(name, fn, available=lambda: None):
    def prepare(q, k, v, causal, scale):
        q, k, v = (t.detach().requires_grad_(True) for t in (q, k, v))
        return Prepared(lambda: fn(q, k, v, causal, scale), (q, k, v))
    return Provider(name, name, available, prepare)


def _good(q, k, v, causal, scale):
    o = torch.nn.functional.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                                         is_causal=causal, scale=scale)
    return o.transpose(1, 2)


def _wrong(q, k, v, causal, scale):
    return _good(q, k, v, causal, scale) + 0.5


def _raises(q, k, v, causal, scale):
    raise RuntimeError("kernel exploded at headdim 32")


def _nocausal_prepare(q, k, v, causal, scale):
    if causal:
        raise Unsupported("no causal here")
    return _bshd_provider("nocausal", _good).prepare(q, k, v, causal, scale)


def _fake_registry():
    return {
        "flashtile": _bshd_provider("flashtile", _good),
        "peer": _bshd_provider("peer", _good),
        "wrongpeer": _bshd_provider("wrongpeer", _wrong),
        "crash": _bshd_provider("crash", _raises),
        "absent": _bshd_provider("absent", _good, available=lambda: "not installed"),
        "nocausal": Provider("nocausal", "", lambda: None, _nocausal_prepare),
    }


class _FakeTimer:
    """Runs fn for real (so the backward path executes) and reports fixed milliseconds."""
    def __init__(self):
        self.calls = []

    def __call__(self, fn, grad_to_none=None):
        fn()
        fn()  # a second backward must work: the graph is retained
        self.calls.append(grad_to_none)
        return 2.0


def test_run_suite_reports_every_outcome():
    shapes = [Shape(1, 48, 48, 2, 2, 32, False), Shape(1, 48, 48, 2, 2, 32, True)]
    timer = _FakeTimer()
    partials = []
    suite = bench.run_suite(shapes, ("fwd", "bwd"), device="cpu", timer=timer, registry=_fake_registry(),
                            on_shape_done=lambda p: partials.append(len(p["results"])))
    assert suite["skipped"] == {"absent": "not installed"}
    assert suite["providers"] == ["flashtile", "peer", "wrongpeer", "crash", "nocausal"]
    by = {(r.provider, r.causal, r.mode): r for r in suite["results"]}
    assert len(by) == len(suite["results"]) == 5 * 2 * 2
    assert partials == [10, 20]
    for mode in ("fwd", "bwd"):
        ok = by[("flashtile", True, mode)]
        assert ok.status == "ok" and ok.ms == 2.0 and ok.max_abs_diff < 2e-2
        assert ok.tflops == pytest.approx(bench.flops(1, 2, 48, 48, 32, True, mode) / 2e-3 / 1e12)
        wrong = by[("wrongpeer", False, mode)]
        assert wrong.status == "wrong" and wrong.tflops is not None and "max abs diff" in wrong.detail
        crash = by[("crash", False, mode)]
        assert crash.status == "error" and "RuntimeError: kernel exploded at headdim 32" in crash.detail
        assert crash.tflops is None
        assert by[("nocausal", True, mode)].status == "skipped"
        assert by[("nocausal", False, mode)].status == "ok"
    # bwd timings reset the provider's own leaves
    assert any(g is not None and len(g) == 3 and all(t.requires_grad for t in g) for g in timer.calls)


class _DriftingTimer(_FakeTimer):
    """Each call 1 ms slower than the one before: a GPU warming up."""

    def __call__(self, fn, grad_to_none=None):
        super().__call__(fn, grad_to_none)
        return 1.0 + len(self.calls)


def test_run_suite_rounds_alternate_and_report_medians():
    shape = Shape(1, 48, 48, 2, 2, 32, False)
    reg = {name: p for name, p in _fake_registry().items() if name in ("flashtile", "peer", "crash")}
    timer = _DriftingTimer()
    suite = bench.run_suite([shape], ("fwd",), device="cpu", timer=timer, registry=reg, rounds=3)
    by = {r.provider: r for r in suite["results"]}
    assert len(suite["results"]) == 3
    # Calls alternate and round r starts at the r-th provider (crash fails before timing): flashtile, peer /
    # peer, crash, flashtile / crash, flashtile, peer -> flashtile 2, 5, 6 ms and peer 3, 4, 7 ms.
    assert by["flashtile"].ms_rounds == [2.0, 5.0, 6.0] and by["flashtile"].ms == 5.0
    assert by["peer"].ms_rounds == [3.0, 4.0, 7.0] and by["peer"].ms == 4.0
    assert by["peer"].tflops == pytest.approx(bench.flops(1, 2, 48, 48, 32, False, "fwd") / 4e-3 / 1e12)
    assert by["crash"].status == "error" and by["crash"].ms_rounds is None
    assert bench.main(["--rounds", "0"]) == 2


def test_run_suite_settles_each_provider_before_timing_it():
    """A provider's settle (flashtile's: _ahead.wait_for_compiles, the compiles its first call left in threads)
    runs after its first call (the check) and before any timing of it, each round."""
    events = []

    def prepare(q, k, v, causal, scale):
        q, k, v = (t.detach().requires_grad_(True) for t in (q, k, v))

        def fwd():
            events.append("call")
            return _good(q, k, v, causal, scale)
        return Prepared(fwd, (q, k, v), settle=lambda: events.append("settle"))

    class Timer(_FakeTimer):
        def __call__(self, fn, grad_to_none=None):
            events.append("time")
            return super().__call__(fn, grad_to_none)

    reg = {"flashtile": Provider("flashtile", "", lambda: None, prepare)}
    bench.run_suite([Shape(1, 48, 48, 2, 2, 32, False)], ("fwd",), device="cpu", timer=Timer(), registry=reg,
                    rounds=2)
    assert events == ["call", "settle", "time", "call", "call"] * 2
    from flashtile._ahead import wait_for_compiles
    q = torch.zeros(1, 8, 1, 16)
    for name in ("flashtile", "flashtile-triton"):
        assert PROVIDERS[name].prepare(q, q, q, False, 0.25).settle is wait_for_compiles


def _nan_in_unsampled_row(q, k, v, causal, scale):
    out = _good(q, k, v, causal, scale).clone()
    out[:, 1] = float("nan")      # row 1 of 200 is not among the 64 sampled rows
    return out


def test_run_suite_nan_output_is_wrong_not_ok():
    assert 1 not in bench.check_rows(200).tolist()
    reg = {"flashtile": _bshd_provider("flashtile", lambda q, k, v, c, s: _good(q, k, v, c, s) * float("nan")),
           "holey": _bshd_provider("holey", _nan_in_unsampled_row)}
    suite = bench.run_suite([Shape(1, 200, 200, 1, 1, 16, False)], ("fwd",), device="cpu", timer=_FakeTimer(),
                            registry=reg)
    assert [(r.provider, r.status, r.detail) for r in suite["results"]] == [
        ("flashtile", "wrong", "non-finite values in the output"), ("holey", "wrong", "non-finite values in the output")]


def test_headdim_v_shapes_flops_and_suite():
    # --headdim-v: v's head dim apart from q's and k's (MLA's prefill), in every shape of the suite
    args = bench.build_parser().parse_args(["--headdim", "192", "--headdim-v", "128", "--hidden", "3072"])
    shapes = bench.select_shapes((1024,), args.headdim, "0", hidden=args.hidden, headdim_v=args.headdim_v)
    assert shapes == [Shape(16, 1024, 1024, 16, 16, 192, False, headdim_v=128)]
    assert shapes[0].label == "B16 H16 S1k D192/128" and shapes[0].dv == 128
    assert bench.select_shapes((1024,), (128,), "0", headdim_v=128) == bench.select_shapes((1024,), (128,), "0")
    assert bench.build_parser().parse_args([]).headdim_v is None
    with pytest.raises(ValueError, match="--headdim-v must be a positive head dim, got 0"):
        bench.select_shapes(headdims=(64,), headdim_v=0)
    # FLOPs: 2 B H Sq Sk (D + Dv), the same as 4 B H Sq Sk D when Dv = D
    assert bench.flops(1, 2, 8, 8, 192, False, "fwd", 128) == 2 * 2 * 64 * (192 + 128)
    assert bench.flops(1, 2, 8, 8, 64, True, "bwd", 64) == bench.flops(1, 2, 8, 8, 64, True, "bwd")
    # the suite makes v, the reference and the output check at v's width; the rows keep it
    shape = Shape(1, 48, 48, 2, 2, 32, True, headdim_v=16)
    widths = []

    def recording(q, k, v, causal, scale):
        widths.append((q.shape[-1], k.shape[-1], v.shape[-1]))
        return _good(q, k, v, causal, scale)
    reg = {"flashtile": _bshd_provider("flashtile", recording), "wrongpeer": _bshd_provider("wrongpeer", _wrong)}
    suite = bench.run_suite([shape], ("fwd", "bwd"), device="cpu", timer=_FakeTimer(), registry=reg)
    assert widths and set(widths) == {(32, 32, 16)}
    by = {(r.provider, r.mode): r for r in suite["results"]}
    assert by[("flashtile", "fwd")].status == "ok" and by[("flashtile", "fwd")].headdim_v == 16
    n = bench.flops(1, 2, 48, 48, 32, True, "bwd", 16)
    assert by[("flashtile", "bwd")].tflops == pytest.approx(n / 2e-3 / 1e12)
    assert by[("wrongpeer", "fwd")].status == "wrong"
    assert "B1 H2 S48 D32/16 causal" in bench.format_table(suite["results"])
    # peers that need one head dim say so (skipped, not an error)
    q, v = torch.randn(1, 8, 2, 32), torch.randn(1, 8, 2, 16)
    with pytest.raises(Unsupported, match="one head dim"):
        _sdpa_prepare("FLASH_ATTENTION")(q, q, v, False, 1.0)


# ---------------------------------------------------------------------------------------------------------------
# table


def _result(provider, mode, tflops, status="ok", seqlen=16384, headdim=128, causal=False, detail=""):
    shape = Shape(16384 // seqlen, seqlen, seqlen, 2048 // headdim, 2048 // headdim, headdim, causal)
    return bench.Result(**asdict(shape), provider=provider, mode=mode, dtype="bf16", status=status,
                        ms=1.0 if tflops else None, tflops=tflops, detail=detail)


def test_format_table_columns_and_ratios():
    results = [
        _result("flashtile", "fwd", 500.0), _result("sdpa-cudnn", "fwd", 400.0), _result("fa4", "fwd", 625.0),
        _result("flashtile", "bwd", 300.0), _result("sdpa-cudnn", "bwd", None, "error", detail="RuntimeError: boom"),
        _result("fa4", "bwd", 600.0, "wrong", detail="max abs diff 0.5"),
        _result("flex", "fwd", None, "error", detail="RuntimeError: boom"),
        _result("flex", "bwd", None, "skipped", detail="no"),
    ]
    text = bench.format_table(results, skipped={"fa2": "flash_attn not importable"}, title="T")
    lines = text.splitlines()
    assert lines[0] == "T"
    assert "skipped fa2: flash_attn not importable" in text
    header = next(line for line in lines if line.startswith("| shape"))
    cols = [c.strip() for c in header.strip("|").split("|")]
    # flex never produced a number: no ratio column for it
    assert cols == ["shape", "mode", "flashtile", "sdpa-cudnn", "fa4", "flex", "flashtile/sdpa-cudnn",
                    "flashtile/fa4"]
    rows = {tuple(c.strip() for c in line.strip("|").split("|"))[1]: [c.strip() for c in line.strip("|").split("|")]
            for line in lines if line.startswith("| B1")}
    fwd, bwd = rows["fwd"], rows["bwd"]
    assert fwd[2:5] == ["500.0", "400.0", "625.0"]
    assert fwd[6:] == ["1.25x", "0.80x"]
    assert fwd[5].startswith("error[")
    assert bwd[3].startswith("error[") and bwd[4].startswith("600.0 WRONG[") and bwd[5].startswith("n/a[")
    assert bwd[6:] == ["-", "0.50x"]
    # each note names its provider and gives the full text
    notes = {line.split("]", 1)[0] + "]": line.split("] ", 1)[1] for line in lines if line.startswith("[")}
    assert notes[fwd[5][len("error"):]] == "flex: RuntimeError: boom"
    assert notes[bwd[3][len("error"):]] == "sdpa-cudnn: RuntimeError: boom"
    assert notes[bwd[4][len("600.0 WRONG"):]] == "fa4: max abs diff 0.5"
    assert notes[bwd[5][len("n/a"):]] == "flex: no"
    # rows: fwd before bwd
    assert [r[1] for r in (c for c in [[x.strip() for x in line.strip("|").split("|")]
                                       for line in lines if line.startswith("| B1")])] == ["fwd", "bwd"]


def test_format_table_same_error_shares_one_note():
    results = [_result("flex", "fwd", None, "error", seqlen=s, detail="OutOfMemoryError: x") for s in (4096, 16384)]
    results += [_result("flashtile", "fwd", 1.0, seqlen=s) for s in (4096, 16384)]
    text = bench.format_table(results)
    assert text.count("error[1]") == 2 and "[2]" not in text


def test_format_table_without_baseline_has_no_ratios():
    text = bench.format_table([_result("sdpa-cudnn", "fwd", 400.0), _result("fa4", "fwd", 600.0)])
    assert "/" not in text.splitlines()[0]


def test_format_table_accepts_json_dicts():
    # rows as the results file holds them: the Result's fields and its shape's label
    results = [bench._jsonable(_result("flashtile", "fwd", 500.0)), bench._jsonable(_result("fa4", "fwd", 250.0))]
    assert results[0]["label"] == "B1 H16 S16k D128"
    text = bench.format_table(json.loads(json.dumps(results)))
    assert "2.00x" in text and "| B1 H16 S16k D128 | fwd" in text


# ---------------------------------------------------------------------------------------------------------------
# results files


def test_gpu_slug():
    assert bench.gpu_slug("NVIDIA H100 80GB HBM3") == "h100-80gb-hbm3"
    assert bench.gpu_slug("NVIDIA H200") == "h200"
    assert bench.gpu_slug("  ") == "unknown"


def test_result_path_naming_and_no_clobber(tmp_path):
    p = bench.result_path(tmp_path, "NVIDIA H200", date="2026-11-21")
    assert p == tmp_path / "2026-11-21-h200.json"
    assert bench.result_path(tmp_path, "NVIDIA H200", tag="ws d128", date="2026-11-21").name == \
        "2026-11-21-h200-ws-d128.json"
    bench.write_json({"results": []}, p)
    assert bench.result_path(tmp_path, "NVIDIA H200", date="2026-11-21").name == "2026-11-21-h200-2.json"
    assert bench.result_path(tmp_path, "cpu").name.endswith("-cpu.json")


def test_write_json_roundtrip_strict(tmp_path):
    results = [replace(_result("flashtile", "fwd", 500.0), max_abs_diff=float("nan"))]
    meta = bench.collect_metadata({"quick": True}, "bf16", providers=["flashtile", "fa4"])
    for key in ("date", "gpu", "torch", "triton", "cuda", "flashtile_commit", "args", "provider_versions"):
        assert key in meta
    # Which copy of the package ran (an A/B of two trees tells them apart by these).
    from flashtile._source import package_digest
    assert meta["flashtile_path"] == os.path.dirname(os.path.abspath(flashtile.__file__))
    assert meta["flashtile_sources"] == package_digest()[:16] and len(meta["flashtile_sources"]) == 16
    path = bench.write_json({"metadata": meta, "results": results}, tmp_path / "sub" / "r.json")
    data = json.loads(path.read_text())     # strict JSON: NaN is written as a string, not dropped
    assert data["results"][0]["max_abs_diff"] == "nan"
    assert data["results"][0]["tflops"] == 500.0
    assert data["results"][0]["label"] == "B1 H16 S16k D128" and data["results"][0]["headdim"] == 128
    assert data["metadata"]["args"] == {"quick": True}
    assert not (tmp_path / "sub" / "r.json.tmp").exists()


def test_plot_writes_png_next_to_json(tmp_path):
    pytest.importorskip("matplotlib")
    from flashtile.bench import plot
    results = [_result(p, m, t, seqlen=s, headdim=d, causal=c, status=st)
               for p, t, st in [("flashtile", 500.0, "ok"), ("sdpa-cudnn", 400.0, "wrong"), ("flex", None, "error")]
               for m in ("fwd", "bwd") for s in (1024, 16384) for d in (64, 128) for c in (False, True)]
    path = bench.write_json({"metadata": {"gpu": "NVIDIA H200"}, "results": results},
                            tmp_path / "2026-11-21-h200.json")
    png = plot.plot_file(path)
    assert png == tmp_path / "2026-11-21-h200.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert plot._dims({"headdim": 192, "headdim_v": 128}) == "192/128"
    assert plot._dims({"headdim": 128, "headdim_v": None}) == plot._dims({"headdim": 128}) == "128"


def test_main_without_gpu_exits_cleanly(capsys):
    if torch.cuda.is_available():
        pytest.skip("has a GPU")
    assert bench.main(["--quick"]) == 2
    assert "no CUDA device" in capsys.readouterr().err
    assert bench.main(["--providers", "nope"]) == 2


# ---------------------------------------------------------------------------------------------------------------
# command line


def test_package_never_imports_the_benchmarks_folder():
    """The top-level benchmarks/ folder (tile sweeps, results) is not in the wheel: nothing in flashtile/ imports it."""
    import ast
    for path in (REPO / "flashtile").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else []
            assert not [n for n in names if n.split(".")[0] == "benchmarks"], f"{path} imports {names}"


def test_bench_help_from_another_directory_without_a_gpu(tmp_path):
    """`python -m flashtile bench --help` is the user's entry point: it must not need a GPU or a checkout's cwd."""
    env = dict(os.environ, PYTHONPATH=str(REPO))
    out = subprocess.run([sys.executable, "-m", "flashtile", "bench", "--help"], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert "usage: python -m flashtile bench" in out.stdout and "--quick" in out.stdout
    for name in ("features", "decode", "plot"):
        assert f"\n  {name} " in out.stdout


@pytest.mark.parametrize("name", ["features", "decode", "plot", "fp8"])
def test_subcommand_help(name, capsys):
    from flashtile import bench as bench_pkg
    with pytest.raises(SystemExit) as exc:
        bench_pkg.main([name, "--help"])
    assert exc.value.code == 0
    assert f"usage: python -m flashtile bench {name}" in capsys.readouterr().out


def test_subcommands_without_gpu_exit_cleanly(capsys):
    if torch.cuda.is_available():
        pytest.skip("has a GPU")
    from flashtile import bench as bench_pkg
    assert bench_pkg.main(["features"]) == 2
    assert bench_pkg.main(["decode", "--batch", "1", "--kv", "4k"]) == 2
    assert bench_pkg.main(["fp8", "--seqlen", "1k"]) == 2
    err = capsys.readouterr().err
    assert err.count("no CUDA device") == 3


def test_fp8_bench_quantizes_per_kv_head():
    """bench fp8's inputs: each kv head's group of heads scaled so that its largest magnitude is 448 in float8,
    the factor amax / 448, and the dequantized values within float8 e4m3's rounding (2^-4 relative) of the inputs."""
    from flashtile.bench import fp8
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(2, 37, 8, 16, generator=gen) * torch.tensor([1.0, 3.0, 0.5, 2.0]).repeat_interleave(2)[:, None]
    x[1, :, 6:] = 0.0  # an all-zero group keeps a factor of 1
    x8, factor = fp8.quantize(x, 4)
    assert x8.dtype == torch.float8_e4m3fn and factor.shape == (2, 4) and factor[1, 3] == 1.0
    amax = x.unflatten(2, (4, 2)).abs().amax(dim=(1, 3, 4))
    torch.testing.assert_close(factor[amax > 0], amax[amax > 0] / 448.0)
    grouped = x8.float().unflatten(2, (4, 2)).abs().amax(dim=(1, 3, 4))
    assert (grouped[amax > 0] == 448.0).all()
    back = fp8.dequantize(x8, factor)
    assert ((back - x).abs() <= x.abs() * 2 ** -4 + factor.max() * 2 ** -9).all()


@pytest.mark.parametrize("causal", [False, True])
def test_fp8_bench_check_on_cpu(causal):
    """bench fp8's correctness check runs its flashtile calls on a small CPU shape: both pass (the FP8 one against
    the dequantized inputs' attention), and a corrupted FP8 output is reported wrong."""
    from flashtile.bench import fp8
    fns, to_bshd, inputs = fp8.calls(200, causal, device="cpu", total_tokens=200)
    fns.pop("sdpa-cudnn")
    diffs, status = fp8.check(fns, to_bshd, inputs, 200, causal)
    assert status == {"flashtile-fp8": "ok", "flashtile": "ok"}, diffs
    good = fns["flashtile-fp8"]
    fns["flashtile-fp8"] = lambda: good() + 0.5
    assert fp8.check(fns, to_bshd, inputs, 200, causal)[1]["flashtile-fp8"] == "wrong"
    fns["flashtile-fp8"] = lambda: good() * float("nan")
    assert fp8.check(fns, to_bshd, inputs, 200, causal)[1]["flashtile-fp8"] == "wrong"


def test_fp8_bench_bars_and_table():
    """bench fp8's bar (FP8 over bf16 at 16k without a causal mask) and table, from made-up rows."""
    from flashtile.bench import fp8

    def row(provider, tflops, seqlen=16384, causal=False, status="ok"):
        return dict(seqlen=seqlen, batch=1, heads=16, headdim=128, causal=causal, provider=provider, tflops=tflops,
                    status=status)
    rows = [row("flashtile-fp8", 900.0), row("flashtile", 600.0), row("sdpa-cudnn", 580.0),
            row("flashtile-fp8", 800.0, causal=True), row("flashtile", 620.0, causal=True),
            row("sdpa-cudnn", 0.0, causal=True, status="wrong")]
    assert fp8.ratios(rows) == {(16384, False): 1.5, (16384, True): 800.0 / 620.0}
    [(bar, passed, value)] = fp8.bars(rows)
    assert passed is True and value == "1.50x" and "1.4x" in bar
    assert fp8.bars([row("flashtile-fp8", 800.0), row("flashtile", 600.0)])[0][1] is False
    assert fp8.bars([row("flashtile-fp8", 900.0, status="wrong"), row("flashtile", 600.0)])[0][1] is None
    table = fp8.format_table(rows)
    lines = table.splitlines()
    assert "fp8/bf16" in lines[0] and len(lines) == 3
    assert "1.50x" in lines[1] and "1.55x" in lines[1]
    assert "wrong" in lines[2] and "1.29x" in lines[2]


def test_host_bench_floor_row_and_bars():
    """bench host's "python-function" row runs on CPU tensors (its backward hands autograd three gradients shaped
    like the inputs), and the bar's detail names the context rows that were measured."""
    from flashtile.bench import host
    calls = host.python_function_calls(1, 16, 2, 8, "cpu")
    out, lse = calls["fwd"]()
    assert out.shape == (1, 16, 2, 8) and lse.shape == (1, 2, 16) and lse.dtype == torch.float32
    calls["fwd+bwd"]()
    q = torch.randn(1, 16, 2, 8, requires_grad=True)
    k, v = torch.randn(1, 16, 2, 8, requires_grad=True), torch.randn(1, 16, 2, 8, requires_grad=True)
    grads = torch.autograd.grad(host._NoAttention.apply(q, k, v)[0], (q, k, v), torch.ones(1, 16, 2, 8))
    assert [g.shape for g in grads] == [q.shape] * 3
    assert "python-function" in host.providers()

    def row(provider, us, call="fwd+bwd"):
        return dict(shape="s", provider=provider, call=call, status="ok", host_us=us)
    [(_, passed, detail)] = host.bars([row("flashtile", 300.0), row("sdpa-cudnn", 200.0),
                                       row("python-function", 150.0), row("flashtile", 50.0, "fwd")])
    assert passed is False and detail == "300.0 us vs 200.0 us (1.50x); python-function 150.0 us"
    [(_, passed, detail)] = host.bars([row("flashtile", 100.0), row("sdpa-cudnn", 200.0), row("fa4", 400.0)])
    assert passed is True and detail.endswith("(0.50x); fa4 400.0 us")
    assert host.bars([row("flashtile", 100.0)])[0][1] is None


def test_host_bench_varlen_row_is_the_fixed_call_packed():
    """bench host's "flashtile-varlen" row runs the fixed-length row's rows as one sequence per batch entry: the
    same attention, the gradients included, so the two rows differ only in the call's path."""
    from flashtile.bench import host
    fixed = host.make_inputs(2, 16, 2, 16, "cpu", grad=False)
    want = flashtile.flash_attn_func(*fixed[:3], causal=True)
    calls = host.flashtile_varlen_calls(2, 16, 2, 16, "cpu")
    got = calls["fwd"]()
    assert got.shape == (32, 2, 16)
    torch.testing.assert_close(got.view(want.shape), want, atol=0, rtol=0)
    calls["fwd+bwd"]()
    assert "flashtile-varlen" in host.providers()


def test_results_go_to_the_current_directory_by_default():
    assert bench.build_parser().parse_args([]).out == "bench-results"
    assert not Path(bench.DEFAULT_OUT).is_absolute()


def test_plot_without_matplotlib_says_so(tmp_path, monkeypatch, capsys):
    from flashtile.bench import plot
    path = bench.write_json({"metadata": {}, "results": [_result("flashtile", "fwd", 500.0)]}, tmp_path / "r.json")
    monkeypatch.setitem(sys.modules, "matplotlib", None)   # `import matplotlib` now raises ModuleNotFoundError
    assert plot.main([str(path)]) == 2
    assert "plotting needs matplotlib" in capsys.readouterr().err
    assert not path.with_suffix(".png").exists()
    assert plot.main([str(tmp_path / "missing.json")]) == 2
    assert "no results file" in capsys.readouterr().err


def test_verbs(capsys):
    from flashtile.__main__ import VERBS, main
    assert list(VERBS) == ["check", "bench", "explain"]
    assert main([]) == 2 and "verbs:" in capsys.readouterr().err
    assert main(["--help"]) == 0 and "bench" in capsys.readouterr().out
    assert main(["nope"]) == 2 and "unknown verb 'nope'" in capsys.readouterr().err
    assert main(["check", "--help"]) == 0 and "float64 reference" in capsys.readouterr().out
    assert main(["check", "extra"]) == 2 and "takes no arguments" in capsys.readouterr().err


def test_cold_children_get_the_bytecode_an_installation_has(monkeypatch):
    """bench cold's children: with a pycache folder they read and write bytecode there (PYTHONPYCACHEPREFIX), even
    where the environment says not to write it; without one they get the environment as it is."""
    from types import SimpleNamespace

    from flashtile.bench import cold
    envs = []

    def fake_run(cmd, env, **kwargs):
        envs.append(env)
        return SimpleNamespace(returncode=0, stdout='noise\n{"first_call_s": 1.5}\n', stderr="")

    monkeypatch.setattr(cold.subprocess, "run", fake_run)
    monkeypatch.setenv("PYTHONDONTWRITEBYTECODE", "1")
    monkeypatch.delenv("PYTHONPYCACHEPREFIX", raising=False)
    assert cold.run_child("/tmp/triton-a", 10, "/tmp/pyc", FLASHTILE_COMPILE_AHEAD="0") == {"first_call_s": 1.5}
    assert envs[0]["PYTHONPYCACHEPREFIX"] == "/tmp/pyc" and "PYTHONDONTWRITEBYTECODE" not in envs[0]
    assert envs[0]["TRITON_CACHE_DIR"] == "/tmp/triton-a" and envs[0]["FLASHTILE_COMPILE_AHEAD"] == "0"
    cold.run_child("/tmp/triton-b", 10)
    assert envs[1]["PYTHONDONTWRITEBYTECODE"] == "1" and "PYTHONPYCACHEPREFIX" not in envs[1]
    assert cold.build_parser().parse_args([]).bytecode == "installed"
    with pytest.raises(SystemExit):
        cold.build_parser().parse_args(["--bytecode", "compiled"])


def test_cold_bar_takes_the_median_of_the_cold_runs(monkeypatch):
    """bench cold --cold-runs: each cold run gets an empty Triton cache of its own, the warm runs the first one's, and
    the bar judges the median cold run's first call (the slowest import of every run)."""
    from flashtile.bench import cold
    assert cold.build_parser().parse_args([]).cold_runs == 3
    seen, firsts = [], iter([9.0, 6.0, 4.0, 5.5, 0.1, 0.2])

    def fake_child(cache_dir, timeout, pycache=None, **env):
        seen.append((cache_dir, env))
        return dict(first_call_s=next(firsts), import_torch_s=1.0, import_flashtile_s=0.02, torch_first_grad_s=0.3,
                    second_call_s=0.1, compiled=[], launcher_builds_s=[], timeline=[])
    monkeypatch.setattr(cold, "run_child", fake_child)
    got = cold.measure("/tmp/c", 2, 10, cold_runs=3)
    assert [d for d, _ in seen] == ["/tmp/c/ahead-off", "/tmp/c/default", "/tmp/c/cold-1", "/tmp/c/cold-2",
                                    "/tmp/c/default", "/tmp/c/default"]
    assert seen[0][1] == {"FLASHTILE_COMPILE_AHEAD": "0"} and seen[1][1] == {}
    assert [r["first_call_s"] for r in got["cold_runs"]] == [6.0, 4.0, 5.5] and got["cold"]["first_call_s"] == 5.5
    (_, passed, detail), warm, imported = cold.bars(got["cold_runs"], got["warm"])
    assert passed is False and detail == "5.50 s (median of 3: 6.00, 4.00, 5.50)"
    assert warm[1] is True and imported[1] is True
    assert cold.bars(got["cold_runs"][1:2], got["warm"])[0][1:] == (True, "4.00 s")


def _load_ab(name):
    """benchmarks/ab.py loaded as a module under name (it is a script, not part of the package)."""
    import importlib.util
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    spec = importlib.util.spec_from_file_location(name, os.path.join(repo, "benchmarks", "ab.py"))
    ab = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ab)
    return ab


@pytest.mark.skipif(not os.path.isdir(os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                                   ".git")), reason="needs the git checkout")
def test_ab_base_copy_runs_beside_the_checkout(tmp_path):
    """benchmarks/ab.py's base tree: HEAD's package extracted as flashtile_base, its ops in a namespace of their own,
    importable beside the checkout's flashtile without sharing a module with it, and computing what it computes."""
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    ab = _load_ab("_ab")
    head = subprocess.run(["git", "-C", repo, "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    import flashtile
    path = list(sys.path)
    try:
        new, base, commit = ab.import_trees("HEAD", str(tmp_path))
        assert commit == head and new is flashtile and base.__name__ == ab.BASE_NAME
        assert hasattr(torch.ops, ab.BASE_NAME) and hasattr(getattr(torch.ops, ab.BASE_NAME), "attn_fwd")
        copies = [m for name, m in sys.modules.items() if name.startswith(ab.BASE_NAME + ".")]
        assert copies and all(m.__file__.startswith(str(tmp_path)) for m in copies if getattr(m, "__file__", None))
        assert base.dispatch is not flashtile.dispatch and base.dispatch._PLANS is not flashtile.dispatch._PLANS
        q, k, v = (torch.randn(1, 40, 2, 16, generator=torch.Generator().manual_seed(i)) for i in range(3))
        for causal in (False, True):
            assert torch.equal(base.flash_attn_func(q, k, v, causal=causal), new.flash_attn_func(q, k, v,
                                                                                                 causal=causal))
    finally:
        for name in [n for n in sys.modules if n == ab.BASE_NAME or n.startswith(ab.BASE_NAME + ".")]:
            del sys.modules[name]
        sys.path[:] = path


def test_ab_base_from_a_folder(tmp_path):
    """benchmarks/ab.py --base-dir: the package in a folder (here a copy of the checkout's, one file changed) runs as
    flashtile_base beside the checkout's, its sources digest told apart from the checkout's."""
    import shutil
    from flashtile._source import package_digest
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    ab = _load_ab("_ab_dir")
    folder = tmp_path / "tree"
    shutil.copytree(os.path.join(repo, "flashtile"), folder / "flashtile", ignore=shutil.ignore_patterns("__pycache__"))
    note = folder / "flashtile" / "kernels" / "forward.py"
    note.write_text(note.read_text() + "\n# the base tree\n")
    with pytest.raises(SystemExit, match="no flashtile package"):
        ab.build_base(None, str(tmp_path / "empty"), base_dir=str(tmp_path))
    import flashtile
    path = list(sys.path)
    dest = tmp_path / "dest"
    dest.mkdir()
    try:
        # (Another name than the revision test's copy: a process registers an op namespace once.)
        new, base, commit = ab.import_trees(None, str(dest), base_dir=str(folder), name="flashtile_base_dir")
        assert commit == f"folder {folder}" and new is flashtile and base.__name__ == "flashtile_base_dir"
        assert base.__file__.startswith(str(dest))
        assert ab._sources("flashtile_base_dir") not in (None, package_digest()[:16])
        q, k, v = (torch.randn(1, 40, 2, 16, generator=torch.Generator().manual_seed(i)) for i in range(3))
        assert torch.equal(base.flash_attn_func(q, k, v, causal=True), new.flash_attn_func(q, k, v, causal=True))
    finally:
        for name in [n for n in sys.modules if n == "flashtile_base_dir" or n.startswith("flashtile_base_dir.")]:
            del sys.modules[name]
        sys.path[:] = path


def test_ab_shapes_with_v_head_dim():
    """benchmarks/ab.py --headdim-v: each shape's q and k take --headdim columns and v and dout --headdim-v (MLA's
    192/128 at 16 heads), FLOPs count both head dims, and without it v takes q's head dim."""
    from flashtile.bench import runner
    ab = _load_ab("_ab_shapes")
    args = ab.parse_args(["--headdim", "192", "--headdim-v", "128", "--hidden", "3072", "--seqlen", "1k,4k",
                          "--causal", "1", "--mode", "bwd"])
    assert ab.shapes(args) == [(16, 16, 1024, 192, 128, True), (4, 16, 4096, 192, 128, True)]
    q, k, v, dout = ab.make_inputs(2, 40, 3, 192, 128, True, "cpu")
    assert q.shape == k.shape == (2, 40, 3, 192) and v.shape == dout.shape == (2, 40, 3, 128)
    assert q.requires_grad and k.requires_grad and v.requires_grad and not dout.requires_grad
    assert torch.equal(ab.make_inputs(2, 40, 3, 192, 128, True, "cpu")[2], v)  # seeded by the shape
    assert runner.flops(16, 16, 1024, 1024, 192, True, "bwd", 128) == 2.5 * 2 * 16 * 16 * 1024 * 1024 / 2 * 320
    plain = ab.parse_args(["--headdim", "64,128", "--seqlen", "2k", "--causal", "0"])
    assert ab.shapes(plain) == [(8, 32, 2048, 64, 64, False), (8, 16, 2048, 128, 128, False)]
    assert plain.mode == ["fwd", "bwd"]


def test_cold_child_times_the_key_and_front_ends(monkeypatch):
    """bench cold's child wraps Triton's key and the sources' make_ir so that the first call's timeline shows them
    (spans of 1 ms or more, named by the kernel); run here, its wrappers restored afterwards."""
    import threading
    import time

    import triton
    import triton.runtime.cache as triton_cache
    from triton.compiler.compiler import ASTSource
    from triton.runtime import build

    from flashtile.bench import cold
    import triton.backends.nvidia.driver as driver
    for owner, name in ((triton_cache, "triton_key"), (ASTSource, "make_ir"), (build, "compile_module_from_src"),
                        (driver, "compile_module_from_src"), (triton.knobs.compilation, "listener")):
        monkeypatch.setattr(owner, name, getattr(owner, name, None), raising=False)
    try:
        from triton.experimental.gluon._runtime import GluonASTSource
        monkeypatch.setattr(GluonASTSource, "make_ir", GluonASTSource.make_ir)
    except ImportError:
        pass
    setup = "events, builds, timeline" + cold.CHILD.split("events, builds, timeline", 1)[1].split("b, s, h, d =")[0]
    env = dict(time=time, threading=threading, triton=triton, build=build)
    key = triton_cache.triton_key
    exec(setup, env)
    assert ASTSource.make_ir.__qualname__ == triton_cache.triton_key.__qualname__ == "spanned.<locals>.timed"
    # (the real make_ir needs a compile's arguments: a stand-in, wrapped the same way)
    monkeypatch.setattr(ASTSource, "make_ir", env["spanned"](env["front_end"], lambda src: time.sleep(0.002)))
    env["started"][0] = time.perf_counter()

    def _fill_like_kernel():
        pass
    key.cache_clear()  # (so that the key is computed, not found: a span of well over 1 ms)
    triton_cache.triton_key()
    ASTSource.make_ir(type("Src", (), {"fn": _fill_like_kernel})())
    ASTSource.make_ir(type("Src", (), {})())
    whats = [e["what"] for e in env["timeline"]]
    assert whats == ["triton key", "front end _fill_like_kernel", "front end ?"], whats
    assert all(e["thread"] == threading.current_thread().name and e["end_s"] >= e["start_s"] for e in env["timeline"])
