"""Attention forward, FA2 loop order: one program per (query block, batch * head), streaming K/V blocks.

q: [B, Sq, Hq, D]; k: [B, Sk, Hk, D]; v: [B, Sk, Hk, Dv]; out: [B, Sq, Hq, Dv]; lse: [B, Hq, Sq] fp32, natural
log. Variable length (VARLEN): q, k, v, out are [total, H, D] packed sequences delimited by cu_seqlens and lse is
[Hq, total_q], flash-attn's layouts.
The math is docs/derivation.md#4-tiled-attention-fa1-and-fa2-loop-orders; the exp2 and causal-stage tricks are
docs/derivation.md#5-kernel-tricks-exp2-and-the-causal-stages; the masks, score modifications, sinks and dropout
are docs/derivation.md#8. Every feature is a constexpr (_common.Flags): a launch without it compiles none of its
code.
"""
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from . import _common, _launch, configs
from ._common import (BIAS_BOOL, BIAS_FLOAT, LN2, LOG2E, Config, Dropout, Heads, Scale, Seq, _attention_mask,
                      _block_list, _dropout_keep, _head_features, _key_range, _load_bias, _load_paged_tile,
                      _load_tile, _mma, _paged_seq, _query_block, _score_mod, _score_unit, _head_views, _store_tile,
                      _streamed_block, _tile_pages)
from ..request import AttentionRequest
from . import features
from .features import Features


class Strides(NamedTuple):
    """(batch, seqlen, head) strides of q, k, v and out (batch 0 for packed varlen tensors); (batch, head) of lse."""
    q: tuple
    k: tuple
    v: tuple
    out: tuple
    lse: tuple


class Program(NamedTuple):
    """What the key loop of one program (a query block of one head) reads: fixed for the program."""
    b_q: object  # [BLOCK_M, BLOCK_D] the query block
    start_m: int  # its first row
    k_view: object  # _common.View of the kv head's keys
    v_view: object
    seq: object  # _common.Seq of the batch entry
    band: object  # _common.Band
    scale: object  # _common.Scale
    slope: float  # ALiBi slope of the head (0 without)
    bias_view: object  # _common.BiasView of the head's attn_mask
    block_list: object  # BLOCK_SKIP: the list of key blocks to visit
    seed: object  # dropout's Philox key (0 without dropout)
    i_bh: int  # batch * heads + head: dropout's counter
    dropout: object  # _common.Dropout
    paged: object  # _common.Paged (PAGED)
    table_row: object  # the sequence's block-table row (PAGED; 0 otherwise)


@triton.jit
def _attn_fwd_inner(acc, l_i, m_i, prog, lo, hi, MASKED: tl.constexpr, FEAT: tl.constexpr, CFG: tl.constexpr):
    """Online softmax of prog's query block over the key blocks [lo, hi); m_i and the exponents are in log2 units.

    Without score modifications the max is taken on the raw scores and scaled after (scale.qk_scale = scale *
    log2(e) > 0, the launcher's contract), so that s * qk_scale - m is one fused multiply-add per score: at head
    dim 64 the softmax's elementwise work is a large share of the loop. With softcap, ALiBi or a float bias the
    scores are built by _score_mod, in the units of _score_unit."""
    b_q, start_m, seq, band, scale = prog.b_q, prog.start_m, prog.seq, prog.band, prog.scale
    o_m = start_m + tl.arange(0, CFG.BLOCK_M)
    r_m = o_m[:, None]
    unit = _score_unit(scale, FEAT)  # log2 units per unit of score
    if FEAT.PAGED:
        # A block's table entries are loaded one iteration ahead and carried through the loop: loaded where they
        # are used, they make the K/V loads indirect, and Triton's pipeliner then gives those one shared-memory
        # buffer and no overlap (docs/kvcache.md, "Paged caches"). One table read serves the K and the V tile.
        page, page_ok = _tile_pages(prog.table_row, lo, seq.seqlen_k, prog.paged.num_pages, CFG.BLOCK_N,
                                    FEAT.PAGE_SIZE)
    # BLOCK_SKIP: [lo, hi) indexes the list of key blocks a bool attn_mask lets this query block see
    # (Features.block_lists); fully masked tiles are not in it.
    for it in tl.range(lo, hi, 1 if FEAT.BLOCK_SKIP else CFG.BLOCK_N):
        start_n = _streamed_block(prog.block_list, it, CFG.BLOCK_N, FEAT.BLOCK_SKIP)
        r_n = (start_n + tl.arange(0, CFG.BLOCK_N))[None, :]
        if FEAT.PAGED:
            b_k = _load_paged_tile(prog.k_view, page, page_ok, prog.paged.page_stride_k, start_n, CFG.HEAD_DIM,
                                   CFG.BLOCK_N, CFG.BLOCK_D, FEAT.PAGE_SIZE)
        else:
            b_k = _load_tile(prog.k_view, start_n, CFG.HEAD_DIM, CFG.BLOCK_N, CFG.BLOCK_D, CFG.USE_TMA)
        if FEAT.FP8:
            b_k = b_k.to(tl.bfloat16)  # float8 values are exact in bfloat16
        b_s = _mma(b_q, tl.trans(b_k), None, CFG.PRECISION, CFG.DOT_UPCAST)  # [BLOCK_M, BLOCK_N], unscaled
        bias = 0.0
        if FEAT.BIAS:
            bias = _load_bias(prog.bias_view, start_m, start_n, FEAT.BIAS_TMA, CFG.BLOCK_M, CFG.BLOCK_N, False)
        if FEAT.SOFTCAP or FEAT.HAS_ALIBI or FEAT.BIAS == BIAS_FLOAT:
            b_s, _ = _score_mod(b_s, r_m, r_n, scale, prog.slope, bias, seq.diag, FEAT)  # units of `unit`
        if MASKED or FEAT.BIAS == BIAS_BOOL:
            b_s = tl.where(_attention_mask(r_m, r_n, seq, band, bias, MASKED, FEAT.MASK_LEFT, FEAT.MASK_RIGHT,
                                           FEAT.BIAS, True), b_s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(b_s, 1) * unit)
        if MASKED or FEAT.BIAS:
            # A mask can hide all of a row's keys so far (m = -inf); subtracting it would give
            # -inf - (-inf) = NaN, so such rows subtract 0 instead (their p and alpha are then exp2(-inf) = 0,
            # and l stays 0).
            m_sub = tl.where(m_new == float("-inf"), 0.0, m_new)
        else:
            m_sub = m_new
        b_p = tl.exp2(b_s * unit - m_sub[:, None])  # [BLOCK_M, BLOCK_N], one fused multiply-add per score
        alpha = tl.exp2(m_i - m_sub)  # [BLOCK_M], rescales what was accumulated under the old max
        l_i = l_i * alpha + tl.sum(b_p, 1)
        if FEAT.DROPOUT:
            # l sums every probability; only the kept ones reach the output (1 / (1 - p) is applied at the end).
            keep = _dropout_keep(prog.seed, prog.i_bh, start_m, start_n, prog.dropout.threshold, CFG.BLOCK_M,
                                 CFG.BLOCK_N, False)
            b_p = tl.where(keep, b_p, 0.0)
        if FEAT.PAGED:
            b_v = _load_paged_tile(prog.v_view, page, page_ok, prog.paged.page_stride_v, start_n, CFG.HEAD_DIM_V,
                                   CFG.BLOCK_N, CFG.BLOCK_DV, FEAT.PAGE_SIZE)
            page, page_ok = _tile_pages(prog.table_row, start_n + CFG.BLOCK_N, seq.seqlen_k, prog.paged.num_pages,
                                        CFG.BLOCK_N, FEAT.PAGE_SIZE)
        else:
            b_v = _load_tile(prog.v_view, start_n, CFG.HEAD_DIM_V, CFG.BLOCK_N, CFG.BLOCK_DV, CFG.USE_TMA)
        if FEAT.FP8:
            b_v = b_v.to(tl.bfloat16)  # P is rounded to bfloat16 below, as for 16-bit inputs
        acc = _mma(b_p.to(b_v.dtype), b_v, acc * alpha[:, None], CFG.PRECISION, CFG.DOT_UPCAST)  # [BLOCK_M, BLOCK_DV]
        m_i = m_new
    return acc, l_i, m_i


@triton.jit
def _attn_fwd_epilogue(acc, l_i, m_i, Sinks, i_h, dropout, FEAT: tl.constexpr):
    """(out, lse natural log) of a query block from its online-softmax state, the head's sink joining the
    denominator (docs/derivation.md#8): one more term exp(sink - m). A row that sees no key (and has no sink) has
    l = 0: it outputs 0 and its LSE is -inf."""
    if FEAT.HAS_SINKS:
        sink = tl.load(Sinks + i_h) * LOG2E
        m_fin = tl.maximum(m_i, sink)
        # A row that saw no key with a sink of -inf keeps m = -inf: subtract 0 there (-inf - -inf is NaN).
        m_sub = tl.where(m_fin == float("-inf"), 0.0, m_fin)
        alpha = tl.exp2(m_i - m_sub)
        l_i = l_i * alpha + tl.exp2(sink - m_sub)
        acc = acc * alpha[:, None]
        m_i = m_fin
    m_empty = l_i == 0.0
    l_safe = tl.where(m_empty, 1.0, l_i)
    if FEAT.DROPOUT:
        l_safe = l_safe * dropout.scale  # dropout.scale = 1 - p: kept probabilities are scaled by 1 / (1 - p)
    acc = acc / l_safe[:, None]
    if FEAT.DROPOUT:
        l_safe = l_safe / dropout.scale
    lse = tl.where(m_empty, float("-inf"), (m_i + tl.log2(l_safe)) * LN2)
    return acc, lse


@triton.jit
def _fp8_factors(Descale, b_q, scale, i_b, i_hk, heads):
    """FP8: the query tile in bfloat16 (float8 values are exact there), the scale times q's and k's factors of
    (batch entry, kv head) i_b, i_hk (Descale: fp32 [B, Hk, 3]), and v's factor, which the output takes. The
    kernel takes the row max before scaling, so its scale must be positive: a negative product of the factors
    moves its sign into the query tile (exact), a zero one zeroes the tile under a unit factor (every score 0)."""
    p_factor = Descale + (i_b.to(tl.int64) * (heads.num_heads // heads.group_size) + i_hk) * 3
    factor = tl.load(p_factor) * tl.load(p_factor + 1)
    sign = tl.where(factor > 0, 1.0, tl.where(factor < 0, -1.0, 0.0))
    b_q = (b_q.to(tl.float32) * sign).to(tl.bfloat16)
    factor = tl.where(factor == 0, 1.0, tl.abs(factor))
    return b_q, Scale(scale.sm_scale * factor, scale.qk_scale * factor, scale.softcap), tl.load(p_factor + 2)


@triton.jit
def _attn_fwd_kernel(Q, K, V, Out, Lse, strides, seq, cu_seqlens, heads, band, scale, alibi, bias, blocks, Sinks,
                     Descale, dropout, paged, FEAT: tl.constexpr, CFG: tl.constexpr):
    """One program per (query block, batch * head). Argument groups: Strides above; the others are _common's
    (CuSeqlens, Seq, Heads, Band, Scale, Alibi, Bias, Blocks, Dropout, Paged; constexprs Flags and Config).
    Descale: FP8's factors (_fp8_factors)."""
    i_m, i_bh, i_b, i_h, i_hk, starts, seq = _query_block(heads, cu_seqlens, seq, FEAT, CFG.BLOCK_M)
    table_row = 0
    if FEAT.PAGED:  # keys are the sequence's first cache slots, read through its block-table row
        seq = _paged_seq(paged, i_b, seq)
        starts = (starts[0], 0)
        table_row = paged.table + i_b.to(tl.int64) * paged.table_stride
    start_m = i_m * CFG.BLOCK_M
    if start_m < seq.seqlen_q:  # a varlen grid covers the longest sequence; shorter ones have nothing here
        q_view, o_view = _head_views(Q, Out, strides.q, strides.out, i_b, starts[0], i_h, seq.seqlen_q, CFG.BLOCK_M,
                                     CFG)
        k_view, v_view = _head_views(K, V, strides.k, strides.v, i_b, starts[1], i_hk, seq.seqlen_k, CFG.BLOCK_N,
                                     CFG)
        slope, bias_view = _head_features(alibi, bias, i_b, i_h, seq, FEAT, CFG.BLOCK_M, CFG.BLOCK_N)
        seed = 0
        if FEAT.DROPOUT:
            seed = tl.load(dropout.seed)

        b_q = _load_tile(q_view, start_m, CFG.HEAD_DIM, CFG.BLOCK_M, CFG.BLOCK_D, CFG.USE_TMA)
        v_factor = 1.0
        if FEAT.FP8:
            b_q, scale, v_factor = _fp8_factors(Descale, b_q, scale, i_b, i_hk, heads)
        m_i = tl.full([CFG.BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([CFG.BLOCK_M], tl.float32)
        acc = tl.zeros([CFG.BLOCK_M, CFG.BLOCK_DV], tl.float32)

        if FEAT.BLOCK_SKIP:
            block_list, n_listed = _block_list(blocks, i_b, i_h, i_m)
        else:
            block_list = blocks.indices
        prog = Program(b_q, start_m, k_view, v_view, seq, band, scale, slope, bias_view, block_list, seed, i_bh,
                       dropout, paged, table_row)
        if FEAT.BLOCK_SKIP:
            # One masked loop over the listed key blocks (a bool attn_mask comes without a band).
            acc, l_i, m_i = _attn_fwd_inner(acc, l_i, m_i, prog, 0, n_listed, True, FEAT, CFG)
        else:
            lo, full_lo, full_hi, hi = _key_range(start_m, seq, band, FEAT.MASK_LEFT, FEAT.MASK_RIGHT, CFG.BLOCK_M,
                                                  CFG.BLOCK_N)
            if FEAT.MASK_LEFT:  # stage 0: the band's left edge, masked
                acc, l_i, m_i = _attn_fwd_inner(acc, l_i, m_i, prog, lo, tl.minimum(full_lo, hi), True, FEAT, CFG)
            # Stage 1: key blocks every row sees, no mask.
            acc, l_i, m_i = _attn_fwd_inner(acc, l_i, m_i, prog, full_lo, full_hi, False, FEAT, CFG)
            # Stage 2: the diagonal (or the band's right edge) and the ragged last block, masked. EVEN_N (no band,
            # Sk a multiple of BLOCK_N) compiles it out.
            if not CFG.EVEN_N:
                acc, l_i, m_i = _attn_fwd_inner(acc, l_i, m_i, prog, tl.maximum(full_lo, full_hi), hi, True, FEAT,
                                                CFG)

        acc, lse = _attn_fwd_epilogue(acc, l_i, m_i, Sinks, i_h, dropout, FEAT)
        if FEAT.FP8:
            acc = acc * v_factor
        _store_tile(o_view, acc.to(Out.dtype.element_ty), start_m, CFG.HEAD_DIM_V, CFG.BLOCK_M, CFG.BLOCK_DV,
                    CFG.USE_TMA)
        o_m = start_m + tl.arange(0, CFG.BLOCK_M)
        p_lse = Lse + i_b.to(tl.int64) * strides.lse[0] + i_h.to(tl.int64) * strides.lse[1] + starts[0]
        tl.store(p_lse + o_m, lse, mask=o_m < seq.seqlen_q)


def attention_forward(q, k, v, req: AttentionRequest, out_dtype=None):
    """Launch the forward kernel for one request (flashtile/request.py). Returns (out, lse fp32 natural log); shapes
    in the module docstring. out_dtype: out's dtype, default q's (float32 for context parallelism's block outputs,
    which are merged across ranks: flashtile/distributed).

    Inputs are assumed validated (flashtile._validate) and the backend chosen (flashtile.dispatch).
    req.softmax_scale must be > 0 (the public API turns a negative scale into a positive one on -q). Query i sees
    key j iff j <= i + offset + right and j >= i + offset - left, where the window bounds (req.window_left /
    window_right; causal is right = 0) that are < 0 do not apply. Varlen computes each sequence's offset as
    Sk - Sq itself.
    """
    return plan_forward(q, k, v, req, out_dtype)[1:]


class FwdPlan:
    """The forward launch of one plan key (flashtile/dispatch.py: shapes, strides, dtypes, alignment, the request's
    scalars and which of its tensors are set), everything but the call's tensors fixed: the tiles that compiled,
    the grid, the scalar groups, the constexprs and the compiled kernel (a _launch.Bound). run allocates out and
    lse, takes the feature tensors from the request (fixed placeholders when it has none) and launches."""
    __slots__ = ("launch", "out_shape", "lse_shape", "out_dtype", "device", "groups", "fargs", "feature_lengths",
                 "use_tma", "tiles", "dropout_scalars")

    def run(self, q, k, v, req):
        """(out, lse) of a call with this plan's key."""
        return self.start(_launch.stream_for(q.get_device()), q, k, v, req)[1:]

    def start(self, stream, q, k, v, req):
        """(the compiled kernel or the JIT launch's return value, out, lse); stream: _launch.stream_for's."""
        out = _common.empty(self.out_shape, self.out_dtype, self.device)
        lse = _common.empty(self.lse_shape, torch.float32, self.device)
        fargs, blocks = self.fargs, None
        if fargs is None:  # the request has tensors of its own (offsets, slopes, mask, sinks, seed)
            feats = Features(req)
            fargs = feats.kernel_args(q, self.use_tma, *self.feature_lengths, kv=(k, v))
            blocks = feats.block_lists(*self.tiles, False, *self.feature_lengths[:2])
        if self.use_tma:
            configs._set_tma_allocator(self.device)
        strides, seq, heads, band, scale = self.groups
        return self.launch(stream, q, k, v, out, lse, strides, seq, fargs.cu_seqlens, heads, band, scale, fargs.alibi,
                           fargs.bias, blocks or fargs.no_blocks, fargs.sinks, fargs.descale,
                           Dropout(fargs.seed, *self.dropout_scalars), fargs.paged), out, lse


def _fwd_plan(cfg, spec, q, k, v, req, out_dtype):
    """The FwdPlan of (q, k, v, req) with tiles cfg."""
    feats = Features(req)
    seqlen_q, num_heads, head_dim = q.shape[-3], q.shape[-2], q.shape[-1]
    seqlen_k, num_kv_heads, head_dim_v = k.shape[-3], k.shape[-2], v.shape[-1]
    plan = FwdPlan()
    plan.out_dtype, plan.device, plan.use_tma, plan.tiles = out_dtype, q.device, spec.use_tma, (cfg.block_m,
                                                                                                   cfg.block_n)
    if req.varlen:
        batch = req.cu_seqlens_q.numel() - 1
        plan.out_shape, plan.lse_shape = (q.shape[0], num_heads, head_dim_v), (num_heads, q.shape[0])
        seqlen_q, seqlen_k = req.max_seqlen_q, req.max_seqlen_k
        lse_strides = (0, q.shape[0])
    else:
        batch = q.shape[0]
        plan.out_shape, plan.lse_shape = (batch, seqlen_q, num_heads, head_dim_v), (batch, num_heads, seqlen_q)
        lse_strides = (num_heads * seqlen_q, seqlen_q)
    # out is allocated contiguous: its strides follow from its shape.
    out_strides = _common.contiguous_strides(plan.out_shape)
    out_strides = (0,) + out_strides[:2] if req.varlen else out_strides[:3]
    if req.paged:  # the views start at page 0 (batch stride 0, as varlen's); the page strides travel in Paged
        kv_strides = [(0,) + tuple(t.stride()[1:3]) for t in (k, v)]
    else:
        kv_strides = [_common.batch_strides(t, req.varlen) for t in (k, v)]
    strides = Strides(_common.batch_strides(q, req.varlen), *kv_strides, out_strides, lse_strides)
    plan.feature_lengths = (seqlen_q, seqlen_k, k.shape[0])
    fargs = feats.kernel_args(q, spec.use_tma, *plan.feature_lengths, kv=(k, v))
    plan.fargs = None if req.tensors() else fargs
    plan.dropout_scalars = (fargs.dropout_threshold, 1.0 - req.dropout_p)
    plan.groups = (strides, Seq(seqlen_q, seqlen_k, req.diagonal_offset), Heads(num_heads, num_heads // num_kv_heads),
                   feats.band, Scale(req.softmax_scale, req.softmax_scale * LOG2E.value, req.softcap))
    # The single-loop form, except for fp32 under tf32: there the operand rounding (_common._round_tf32) gave
    # wrong results inside it on Triton 3.6 while the two-stage form is right (tests/test_gpu.py).
    even_n = (not req.banded and not req.varlen and seqlen_k % cfg.block_n == 0
              and not (q.dtype == torch.float32 and spec.precision == "tf32"))
    config = Config(head_dim, head_dim_v, cfg.block_m, cfg.block_n, spec.block_d(head_dim), spec.block_d(head_dim_v),
                    even_n, spec.use_tma, spec.precision, spec.dot_upcast)
    flags = fargs.flags._replace(BLOCK_SKIP=feats.bias_kind == features.BIAS_BOOL)
    plan.launch = _launch.Bound(_attn_fwd_kernel, (triton.cdiv(seqlen_q, cfg.block_m), batch * num_heads), (),
                                _common.constexpr_groups(FEAT=flags, CFG=config),
                                dict(num_warps=cfg.num_warps, num_stages=cfg.num_stages))
    return plan


def plan_forward(q, k, v, req: AttentionRequest, out_dtype=None):
    """(FwdPlan, out, lse): the plan of this call's key built with the first candidate tiles that compile, and the
    call launched with it (flashtile/dispatch.py keeps the plan for later calls with the same key)."""
    assert req.softmax_scale > 0, "the kernel takes the row max before scaling: the scale must be positive"
    out_dtype = out_dtype or q.dtype
    head_dim = max(q.shape[-1], v.shape[-1])
    out_shape = (q.shape[0], q.shape[1], v.shape[-1]) if req.varlen else q.shape[:3] + v.shape[-1:]
    # The output, allocated contiguous by the plan, joins the TMA check as a tensor without storage.
    spec = configs.launch_spec(q, (q, k, v, torch.empty(out_shape, dtype=out_dtype, device="meta")),
                               tma=not req.paged and req.descale is None)  # paged K/V, float8: pointer loads
    bias_kind = Features(req).bias_kind
    candidates = configs.forward_candidates(head_dim, req.mask_right, q.dtype, spec, bias_kind, req.softcap > 0,
                                            req.paged)
    stream = _launch.stream_for(q.get_device())
    result = {}

    def launch(cfg):
        plan = _fwd_plan(cfg, spec, q, k, v, req, out_dtype)
        compiled, out, lse = plan.start(stream, q, k, v, req)
        result.update(plan=plan, out=out, lse=lse)
        return compiled

    configs.launch_first_that_compiles(("fwd", head_dim, req.mask_right, q.dtype, spec, Features(req).variant(),
                                        bias_kind), candidates, launch)
    return result["plan"], result["out"], result["lse"]
