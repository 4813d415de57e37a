"""flashtile as torch's flash SDPA backend.

    import flashtile.integrations.sdpa as ft_sdpa
    ft_sdpa.activate()          # torch.nn.functional.scaled_dot_product_attention's flash backend now runs flashtile
    ...
    ft_sdpa.deactivate()        # back to torch's own kernel
    with ft_sdpa.enabled():     # the same, for a block
        ...

torch (2.11 and later) lets a library replace the kernels behind its flash SDPA backend: the library registers a
function with `torch.nn.attention.register_flash_attention_impl`, and `torch.nn.attention.activate_flash_attention_impl`
calls it to install the kernels in torch's dispatcher (torch ships FA3 and FA4 this way). flashtile registers itself
under the name "flashtile" and installs CUDA kernels for
- `aten::_scaled_dot_product_flash_attention` and its backward: what `scaled_dot_product_attention` calls when it
  picks the flash backend, and what torch's `context_parallel` calls for each block of its ring (the backward then
  gets the merged output and LSE, which flashtile's backward takes as given);
- `aten::_flash_attention_forward` / `_flash_attention_backward`: the same kernels with cumulative sequence lengths
  (`torch.nn.attention.varlen`, nested tensors) and windows.
They return what torch's own kernels return: the output with the query's strides, the LSE (float32, (batch, heads,
seqlen_q), or (heads, total_q) for varlen), no cumulative lengths, the seqlens, a (2,) uint64 rng state (holding
flashtile's dropout seed) and a () uint64 offset, and an empty debug mask.

Which calls take the flash backend is still torch's choice (CUDA, fp16/bf16, no attn_mask, head dim <= 256, ...):
`torch.nn.attention.sdpa_kernel(SDPBackend.FLASH_ATTENTION)` forces it, `enabled(force=True)` does both.
`call_counts()` says how many forward and backward calls flashtile ran since activation.
"""
import contextlib
import warnings

import torch

from . import _local

NAME = "flashtile"
# The dispatch key the kernels are installed under. torch's flash backend runs on CUDA only; tests set "CPU" to run
# the same registration on CPU tensors through torch.ops.aten.
_DISPATCH_KEY = "CUDA"
_OPS = ("_scaled_dot_product_flash_attention", "_scaled_dot_product_flash_attention_backward",
        "_flash_attention_forward", "_flash_attention_backward")

_state = {"handle": None, "counts": {"forward": 0, "backward": 0}}


def available():
    """None when this torch can take flashtile as its flash SDPA backend, else the reason it cannot."""
    attention = torch.nn.attention
    if not hasattr(attention, "register_flash_attention_impl") or not hasattr(attention,
                                                                            "activate_flash_attention_impl"):
        return (f"torch {torch.__version__} has no torch.nn.attention.register_flash_attention_impl / "
                f"activate_flash_attention_impl (torch 2.11 and later have them); upgrade torch, or call "
                f"flashtile.scaled_dot_product_attention directly.")
    return None


def _check_available():
    reason = available()
    if reason is not None:
        raise RuntimeError(reason)


def activate():
    """Make torch's flash SDPA backend run flashtile (until deactivate()). Activating twice is harmless; an impl
    activated before (FA3, FA4) is replaced, as torch's activate_flash_attention_impl does."""
    _check_available()
    torch.nn.attention.register_flash_attention_impl(NAME, register_fn=_install)
    torch.nn.attention.activate_flash_attention_impl(NAME)
    if _state["handle"] is None:  # a registry that still took flashtile for active (see _forget) did not call us
        _install()
    _state["counts"] = {"forward": 0, "backward": 0}


def deactivate():
    """Give torch's flash SDPA backend its own kernels back (no-op when flashtile is not active)."""
    attention = torch.nn.attention
    restore = getattr(attention, "restore_flash_attention_impl", None)
    if restore is not None and attention.current_flash_attention_impl() == NAME:
        restore()  # calls our handle's remove()
    if _state["handle"] is not None:
        _state["handle"].remove()
    _forget()


def _forget():
    """The first torch releases with the registry have no restore_flash_attention_impl: their registry keeps the
    active name (a str) and its handle for good, and its activate returns early for the active name. Clear both
    when flashtile was the one active, so that current_flash_attention_impl() tells the truth and a later
    activate() installs again."""
    registry = getattr(torch.nn.attention, "_registry", None)
    if registry is not None and getattr(registry, "_FLASH_ATTENTION_ACTIVE", None) == NAME:
        registry._FLASH_ATTENTION_ACTIVE = None
        getattr(registry, "_FLASH_ATTENTION_HANDLES", {}).pop(NAME, None)


def is_active():
    return _state["handle"] is not None


@contextlib.contextmanager
def enabled(force=False):
    """activate() for the duration of a with block, then back to what was active before. force=True also restricts
    SDPA to the flash backend (torch.nn.attention.sdpa_kernel), so calls it cannot take raise instead of falling
    back to another backend."""
    previous = getattr(torch.nn.attention, "current_flash_attention_impl", lambda: None)()
    was_active = is_active()
    activate()
    try:
        if force:
            with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.FLASH_ATTENTION):
                yield
        else:
            yield
    finally:
        if not was_active:
            deactivate()
            if previous not in (None, NAME):
                torch.nn.attention.activate_flash_attention_impl(previous)


def call_counts():
    """{"forward": n, "backward": n}: the calls flashtile's kernels took through torch since activate()."""
    return dict(_state["counts"])


class _Handle:
    """What torch's registry keeps while flashtile is active; remove() uninstalls the kernels."""

    def __init__(self, library):
        self.library = library

    def remove(self):
        if self.library is not None:
            self.library._destroy()
            self.library = None
        if _state["handle"] is self:
            _state["handle"] = None


def _install():
    """register_fn for torch's registry: install the kernels under _DISPATCH_KEY, return the handle."""
    if _state["handle"] is not None:
        _state["handle"].remove()
    library = torch.library.Library("aten", "IMPL", _DISPATCH_KEY)  # noqa: TOR901 - lives as long as the handle
    kernels = (_sdpa_forward, _sdpa_backward, _flash_forward, _flash_backward)
    with warnings.catch_warnings():  # "overriding a previously registered kernel": that is the point
        warnings.simplefilter("ignore")
        for op, kernel in zip(_OPS, kernels):
            library.impl(op, kernel, _DISPATCH_KEY)
    _state["handle"] = _Handle(library)
    return _state["handle"]


# ----------------------------------------------------------------------------------------------------------------
# The kernels. Dense tensors arrive as torch's (batch, heads, seqlen, d); flashtile takes (batch, seqlen, heads, d)
# views of them (any strides), so nothing is copied on the way in.


def _like(result, template):
    """result with template's strides (what torch's meta functions promise: empty_like), copying only if needed."""
    if result.stride() == template.stride():
        return result
    return torch.empty_like(template).copy_(result)


def _rng_state(seed, device):
    """torch's (2,) uint64 rng state and () uint64 offset, the first word holding flashtile's int64 Philox seed."""
    state = torch.zeros(2, dtype=torch.int64, device=device)
    if seed is not None:
        state[:1] = seed
    return state.view(torch.uint64), torch.zeros((), dtype=torch.uint64, device=device)


def _seed_from(rng_state, dropout_p):
    return rng_state.view(torch.int64)[:1] if dropout_p > 0 else None


def _check_debug_mask(return_debug_mask):
    if return_debug_mask:
        raise NotImplementedError("flashtile's SDPA backend does not return the debug attention mask "
                                  "(return_debug_mask=True); deactivate flashtile (flashtile.integrations.sdpa."
                                  "deactivate()) for that call.")


def _window(left, right):
    return (-1 if left is None else int(left), -1 if right is None else int(right))


def _sdpa_forward(query, key, value, dropout_p=0.0, is_causal=False, return_debug_mask=False, *, scale=None):
    """aten::_scaled_dot_product_flash_attention."""
    _check_debug_mask(return_debug_mask)
    _state["counts"]["forward"] += 1
    q, k, v = (t.transpose(1, 2) for t in (query, key, value))
    scale = query.shape[-1] ** -0.5 if scale is None else scale
    seed = _local.draw_seed(query, dropout_p)
    out, lse = _local.attention_forward(q, k, v, scale, is_causal, dropout_p=dropout_p, seed=seed)
    rng_state, offset = _rng_state(seed, query.device)
    debug_mask = torch.empty(0, dtype=query.dtype, device=query.device)
    return (_like(out.transpose(1, 2), query), lse.contiguous(), None, None, query.shape[2], key.shape[2], rng_state,
            offset, debug_mask)


def _sdpa_backward(grad_out, query, key, value, out, logsumexp, cum_seq_q, cum_seq_k, max_q, max_k, dropout_p,
                   is_causal, philox_seed, philox_offset, *, scale=None):
    """aten::_scaled_dot_product_flash_attention_backward: gradients for the given out and logsumexp."""
    _state["counts"]["backward"] += 1
    q, k, v, o, dout = (t.transpose(1, 2) for t in (query, key, value, out, grad_out))
    if dout.stride(-1) != 1:
        dout = dout.contiguous()
    scale = query.shape[-1] ** -0.5 if scale is None else scale
    grads = _local.attention_backward(dout, q, k, v, o, logsumexp.contiguous(), scale, is_causal,
                                      dropout_p=dropout_p, seed=_seed_from(philox_seed, dropout_p))
    return tuple(_like(g.transpose(1, 2), t) for g, t in zip(grads, (query, key, value)))


def _flash_forward(query, key, value, cum_seq_q, cum_seq_k, max_q, max_k, dropout_p, is_causal, return_debug_mask,
                   *, scale=None, window_size_left=None, window_size_right=None, seqused_k=None, alibi_slopes=None,
                   block_table=None, num_splits=None, **unused):
    """aten::_flash_attention_forward: (batch, seqlen, heads, d) tensors, or (total, heads, d) with cum_seq_q/k."""
    _check_debug_mask(return_debug_mask)
    if seqused_k is not None or block_table is not None or alibi_slopes is not None:
        # ALiBi too: torch's backward op takes no slopes, so its gradients could not include them.
        raise NotImplementedError("flashtile's flash backend does not take seqused_k, block_table (paged keys) or "
                                  "alibi_slopes through torch; call flashtile.flash_attn_varlen_func directly, or "
                                  "deactivate flashtile (flashtile.integrations.sdpa.deactivate()) for that call.")
    _state["counts"]["forward"] += 1
    varlen = None if cum_seq_q is None else (cum_seq_q.to(torch.int32), cum_seq_k.to(torch.int32), int(max_q),
                                               int(max_k))
    scale = query.shape[-1] ** -0.5 if scale is None else scale
    seed = _local.draw_seed(query, dropout_p)
    out, lse = _local.attention_forward(query, key, value, scale, is_causal,
                                        window=_window(window_size_left, window_size_right), dropout_p=dropout_p,
                                        seed=seed, varlen=varlen)
    rng_state, offset = _rng_state(seed, query.device)
    return (_like(out, query), lse.contiguous(), rng_state, offset,
            torch.empty(0, dtype=query.dtype, device=query.device))


def _flash_backward(grad_out, query, key, value, out, logsumexp, cum_seq_q, cum_seq_k, max_q, max_k, dropout_p,
                    is_causal, rng_state, unused, *, scale=None, window_size_left=None, window_size_right=None,
                    **rest):
    """aten::_flash_attention_backward."""
    _state["counts"]["backward"] += 1
    varlen = None if cum_seq_q is None or not cum_seq_q.numel() else (
        cum_seq_q.to(torch.int32), cum_seq_k.to(torch.int32), int(max_q), int(max_k))
    if grad_out.stride(-1) != 1:
        grad_out = grad_out.contiguous()
    scale = query.shape[-1] ** -0.5 if scale is None else scale
    grads = _local.attention_backward(grad_out, query, key, value, out, logsumexp.contiguous(), scale, is_causal,
                                      window=_window(window_size_left, window_size_right), dropout_p=dropout_p,
                                      seed=_seed_from(rng_state, dropout_p), varlen=varlen)
    return tuple(_like(g, t) for g, t in zip(grads, (query, key, value)))
