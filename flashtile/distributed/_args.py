"""Argument checks shared by the public functions, and the table of arguments the ranks compare (_comm.agree)."""
import torch

from . import _comm, _local
from ._ring import Options

FUNCTION_IDS = {"ring": 1, "zigzag": 2, "varlen": 3, "ulysses": 4, "unshard": 5}
_DTYPE_IDS = {torch.float16: 1, torch.bfloat16: 2, torch.float32: 3}
_UNBOUNDED = 2 ** 30


def _check_no_dropout(dropout_p):
    dropout_p = _local.check_dropout(dropout_p)
    if dropout_p > 0:
        raise NotImplementedError(
            f"dropout_p={dropout_p}: context-parallel attention does not support dropout (its Philox mask is drawn "
            f"per (batch x head, query tile, key tile) of one device's launch, which a sharded computation cannot "
            f"reproduce); pass dropout_p=0.0, or apply dropout outside attention.")


def options(q, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic, batch, heads):
    """Checked Options (softmax_scale resolved, possibly <= 0: see positive_scale)."""
    _check_no_dropout(dropout_p)
    if not isinstance(causal, bool) and not (isinstance(causal, int) and causal in (0, 1)):
        raise TypeError(f"causal must be a bool, got {causal!r}.")
    # A side past any sequence length is no bound (the kernels take int32 offsets).
    window = tuple(-1 if side >= _UNBOUNDED else side for side in _local.check_window(window_size))
    softcap = _local.check_softcap(softcap)
    alibi_slopes = _local.check_alibi(alibi_slopes, q, batch, heads)
    scale = _local.resolve_scale(softmax_scale, q.shape[-1])
    deterministic = bool(deterministic) or torch.are_deterministic_algorithms_enabled()
    return Options(scale, bool(causal), window, softcap, alibi_slopes, deterministic)


def positive_scale(q, opts: Options):
    """(q, opts) with softmax_scale > 0, which the kernels need: a negative scale is the same function of -q with
    |scale|; a zero scale makes every score 0, as q * 0 with scale 1 does (q stays in the graph: its gradient is
    the exact 0)."""
    if opts.softmax_scale > 0:
        return q, opts
    if opts.softmax_scale < 0:
        q, scale = -q, -opts.softmax_scale
    else:
        q, scale = q * 0.0, 1.0
    return q, Options(scale, opts.causal, opts.window, opts.softcap, opts.alibi_slopes, opts.deterministic)


def fields(function, q, k, v, opts: Options):
    """The argument table one rank contributes (see _comm.FIELDS)."""
    return dict(function=FUNCTION_IDS[function], device=1 if q.is_cuda else 0, dtype=dtype_id(q.dtype),
                batch=q.shape[0] if q.dim() == 4 else 1, seqlen_q=q.shape[-3], seqlen_k=k.shape[-3],
                heads=q.shape[-2], kv_heads=k.shape[-2], head_dim=q.shape[-1], head_dim_v=v.shape[-1],
                causal=int(opts.causal), window_left=opts.window[0], window_right=opts.window[1],
                softcap=_comm.float_bits(opts.softcap), softmax_scale=_comm.float_bits(opts.softmax_scale),
                alibi=0 if opts.alibi_slopes is None else opts.alibi_slopes.dim(),
                deterministic=int(opts.deterministic))


def check_locally(comm, check):
    """Run check() -> (result, fields) on this rank. Returns (result, agree), where agree(error=None) compares the
    fields over the group (_comm.agree) and raises on every rank if any rank's check failed, any rank passes an
    error, or the ranks disagree: it must run before the call's first transfer, and may run after local work (the
    ring computes its own block first). If check() fails here, the comparison runs at once (and raises)."""
    try:
        result, table = check()
    except Exception as e:  # noqa: BLE001 - re-raised by agree after the other ranks have heard of it
        _comm.agree(comm, {}, e)
        raise AssertionError("unreachable: agree raises the local error") from e

    def agree(error=None):
        _comm.agree(comm, table if error is None else {}, error)
    return result, agree


def checked(comm, check):
    """Run check() -> (result, fields) on this rank, then compare the fields over the group (_comm.agree), so that
    every rank raises if any rank's check failed or the ranks disagree. Returns check's result."""
    result, agree = check_locally(comm, check)
    agree()
    return result


def check_device(comm, q):
    message = _comm.device_error(comm, q.device)
    if message is not None:
        raise ValueError(message)


def digest(values):
    """An int64 digest of a tuple of ints, the same in every process (Python's hash of a str is not)."""
    result = 0
    for x in values:
        result = (result * 1000003 + int(x) + 1) % (2 ** 61 - 1)
    return result


def dtype_id(dtype):
    return _DTYPE_IDS.get(dtype) or digest(str(dtype).encode())
