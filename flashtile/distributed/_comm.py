"""Process-group plumbing: which ranks, which device, the argument check every rank runs together, the ring's
point-to-point exchange and the all-to-all.

Collectives with inconsistent arguments hang (NCCL) or fail obscurely: every public call first all-gathers a small
table of its arguments (shapes, dtype, flags, an error code) over the group, on a device the group serves, and
every rank compares the table before any other collective is posted. A rank whose own checks failed still takes
part in that exchange, so all ranks raise together instead of the others waiting forever.
"""
import dataclasses
import struct

import torch
import torch.distributed as dist


@dataclasses.dataclass(frozen=True)
class Comm:
    group: object
    rank: int
    world: int
    next_peer: int  # global ranks of the ring's neighbours (P2POp wants global ranks)
    prev_peer: int
    meta_device: torch.device

    @property
    def device_types(self):
        return _device_types(self.group)


def _device_types(group):
    """{device type: backend name} this group serves, e.g. {"cpu": "gloo", "cuda": "nccl"}."""
    config = dist.get_backend_config(group) if hasattr(dist, "get_backend_config") else dist.get_backend(group)
    types = {}
    for entry in str(config).split(","):
        if ":" in entry:
            device, backend = entry.split(":", 1)
            types[device.strip()] = backend.strip()
        else:  # an old torch's plain backend name
            types["cuda" if entry == "nccl" else "cpu"] = entry
    return types


def resolve(group):
    """The Comm of `group` (None: the default group). Raises RuntimeError when torch.distributed is not set up or
    this process is not in the group: nothing can be exchanged then, so these are the only errors raised before
    the exchange."""
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("flashtile.distributed needs an initialized process group: call "
                           "torch.distributed.init_process_group(...) first (torchrun sets up the environment), "
                           "or use flashtile.flash_attn_func on one device.")
    group = group if group is not None else dist.group.WORLD
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    if rank < 0:
        raise RuntimeError(f"this process (global rank {dist.get_rank()}) is not a member of the group passed as "
                           f"`group`; call the function only on the group's ranks, or pass a group that contains "
                           f"this rank.")
    types = _device_types(group)
    if "cuda" in types and types["cuda"] != "gloo" and torch.cuda.is_available():
        meta_device = torch.device("cuda", torch.cuda.current_device())
    else:
        meta_device = torch.device("cpu")
    return Comm(group, rank, world, dist.get_global_rank(group, (rank + 1) % world),
                dist.get_global_rank(group, (rank - 1) % world), meta_device)


def device_error(comm: Comm, device: torch.device):
    """A message when this group cannot move tensors of `device` between ranks (None when it can)."""
    backend = comm.device_types.get(device.type)
    if backend is None or (device.type == "cuda" and backend == "gloo"):
        return (f"the tensors are on {device} but the process group's backend serves {comm.device_types} (gloo has "
                f"no point-to-point transfers of CUDA tensors); use an NCCL group for CUDA tensors "
                f"(init_process_group('nccl')) and a gloo group for CPU tensors.")
    if device.type == "cuda" and device.index != torch.cuda.current_device():
        return (f"the tensors are on {device} but this rank's current CUDA device is "
                f"cuda:{torch.cuda.current_device()}, the one its NCCL communicator uses; call "
                f"torch.cuda.set_device({device.index}) (usually the local rank) before the first collective.")
    return None


def float_bits(x):
    """A float as an int64 (exact comparison across ranks)."""
    return struct.unpack("<q", struct.pack("<d", float(x)))[0]


class ArgumentError(ValueError):
    """Raised on every rank when the ranks' arguments disagree or one rank's arguments are invalid."""


# What every call's argument table holds, in this order (0 where a field does not apply): the same length on every
# rank whatever it called, so the all-gather itself always matches.
FIELDS = ("function", "device", "dtype", "batch", "seqlen_q", "seqlen_k", "heads", "kv_heads", "head_dim",
          "head_dim_v", "causal", "window_left", "window_right", "softcap", "softmax_scale", "alibi", "deterministic",
          "total_tokens", "cu_seqlens", "max_seqlen", "shape")


# The argument table's group for each group whose backend serves CUDA tensors only: a gloo group over the same
# ranks, made by those ranks at their first call together, or False where none could be made.
_TABLE_GROUPS = {}


def _table_group(comm: Comm):
    """(group, device) the argument table travels on. On an NCCL-only group the table would go through the GPU,
    and reading it back would make the host wait for every kernel queued before the call (the GPU then idles
    while the host launches the call's first kernels): where the group's backend serves CPU tensors the table
    stays on the CPU, else it goes through a gloo group over the same ranks, made once (only the group's ranks
    take part, all of them in this call)."""
    if comm.meta_device.type == "cpu" or "cpu" in comm.device_types:
        return comm.group, torch.device("cpu")
    host = _TABLE_GROUPS.get(comm.group)
    if host is None:
        try:
            host = dist.new_group(dist.get_process_group_ranks(comm.group), backend="gloo",
                                  use_local_synchronization=True)
        except (RuntimeError, ValueError, TypeError):  # no gloo here: the table goes through the GPU
            host = False
        _TABLE_GROUPS[comm.group] = host
    return (host, torch.device("cpu")) if host else (comm.group, comm.meta_device)


def agree(comm: Comm, fields: dict, local_error):
    """All-gather this rank's `fields` (a subset of FIELDS, name -> int) with an error flag, then raise on every
    rank if any rank's own checks failed (local_error: that exception, re-raised here; other ranks raise
    ArgumentError) or the ranks disagree on a field."""
    unknown = set(fields) - set(FIELDS)
    assert not unknown, unknown
    row = [1 if local_error is not None else 0] + [int(fields.get(n, 0)) for n in FIELDS]
    group, device = _table_group(comm)
    mine = torch.tensor(row, dtype=torch.int64, device=device)
    table = [torch.empty_like(mine) for _ in range(comm.world)]
    dist.all_gather(table, mine, group=group)
    rows = [t.tolist() for t in table]
    if local_error is not None:
        raise local_error
    bad = [r for r, row_r in enumerate(rows) if row_r[0]]
    if bad:
        raise ArgumentError(f"rank(s) {bad} of the group rejected their arguments (see the error raised there); "
                            f"every rank stopped before posting any transfer.")
    for i, name in enumerate(FIELDS, start=1):
        values = [r[i] for r in rows]
        if len(set(values)) > 1:
            shown = ", ".join(f"rank {r}: {v}" for r, v in enumerate(values))
            raise ArgumentError(f"the ranks disagree on {name} ({shown}); every rank of the group must make the same "
                                f"call, with tensors of the same shapes and dtype (each its own shard of the "
                                f"sequence) and the same options.")


_SIDE_STREAMS = {}


def _side_stream(device):
    """The stream, one per device, that RingExchange posts a transfer from when it must not wait for the current
    stream's queue."""
    stream = _SIDE_STREAMS.get(device.index)
    if stream is None:
        stream = _SIDE_STREAMS[device.index] = torch.cuda.Stream(device)
    return stream


def queued_event(t):
    """A CUDA event marking the work queued so far on t's current stream (None for CPU tensors: gloo's transfers
    are not ordered by streams)."""
    if not t.is_cuda:
        return None
    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream(t.device))
    return event


class RingExchange:
    """Send tensors to the next rank and receive the same shapes from the previous one (reverse: to the previous,
    from the next), asynchronously.

    batch_isend_irecv posts the sends and receives together; NCCL runs them on its own stream, ordered after the
    work already queued on the current stream, so the next block travels while the current one is computed; wait()
    makes the current stream wait for the arrival (and, on gloo, blocks until it)."""

    def __init__(self, comm: Comm, tensors, reverse=False, after=None):
        self.recv = [torch.empty_like(t, memory_format=torch.contiguous_format) for t in tensors]
        to, source = (comm.prev_peer, comm.next_peer) if reverse else (comm.next_peer, comm.prev_peer)
        ops = [dist.P2POp(dist.isend, t, to, comm.group) for t in tensors]
        ops += [dist.P2POp(dist.irecv, t, source, comm.group) for t in self.recv]
        if after is None:
            self.works = dist.batch_isend_irecv(ops)
            return
        # Posted from a side stream that waits for `after` alone (queued_event): the transfer does not wait for
        # the kernels queued on the current stream since.
        side = _side_stream(tensors[0].device)
        side.wait_event(after)
        with torch.cuda.stream(side):
            self.works = dist.batch_isend_irecv(ops)

    def wait(self):
        for w in self.works:
            w.wait()
        return self.recv


def all_to_all(comm: Comm, x):
    """x: [W, ...] contiguous; part i goes to rank i. Returns [W, ...], part i from rank i."""
    out = torch.empty_like(x)
    dist.all_to_all_single(out, x.contiguous(), group=comm.group)
    return out
