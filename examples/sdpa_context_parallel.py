"""torch's context_parallel with flashtile as the flash SDPA backend, on two (or more) GPUs of one host.

    NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 \
        torchrun --standalone --nproc_per_node=2 examples/sdpa_context_parallel.py

context_parallel shards the sequence over the GPUs and runs a ring: each block of keys and values visits every GPU,
each visit is one call of torch's flash attention op (flashtile here), and the partial results are merged through
their log-sum-exps; the backward hands each block the merged output and LSE. This script checks, as torch's own test
(test/distributed/tensor/test_attention.py, test_ring_attention_sdpa) does, that the output and the gradients of q, k,
v match attention on one GPU within torch's tolerances for its flash backend in bf16 (atol 1e-3 x world size for the
output, 8e-3 x world size for the gradients, rtol 1e-3 x world size but at least one bf16 rounding, 2^-7), and runs
the same comparison with torch's own flash kernel for scale. It prints each case's largest difference over its
tolerance (<= 1 passes) for both, the number of flashtile calls, and "context_parallel matches one GPU" when every
flashtile case passes.
"""
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.experimental._attention import _cp_options, context_parallel, context_parallel_unshard
from torch.nn.attention import SDPBackend, sdpa_kernel

import flashtile.integrations.sdpa as ft_sdpa

# (batch, heads, tokens per GPU, head dim): torch's test case, and a long-context one.
SHAPES = [(8, 8, 64, 32), (2, 16, 4096, 128)]


def _one_and_cp(mesh, q, k, v, is_causal):
    """(out, dq, dk, dv) of the whole sequence on this GPU, and the same gathered from context_parallel over mesh."""
    q, k, v = (t.detach().clone().requires_grad_() for t in (q, k, v))
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        out = F.scaled_dot_product_attention(q, k, v, is_causal=is_causal)
    out.sum().backward()
    cp_q, cp_k, cp_v = (t.detach().clone() for t in (q, k, v))
    with context_parallel(mesh, buffers=(cp_q, cp_k, cp_v), buffer_seq_dims=(2, 2, 2)):
        for t in (cp_q, cp_k, cp_v):
            t.requires_grad = True
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            cp_out = F.scaled_dot_product_attention(cp_q, cp_k, cp_v, is_causal=is_causal)
        cp_out.sum().backward()
        (cp_out,) = context_parallel_unshard(mesh, [cp_out], [2])
        grads = context_parallel_unshard(mesh, [cp_q.grad, cp_k.grad, cp_v.grad], [2, 2, 2])
        for t in (cp_q, cp_k, cp_v):
            t.requires_grad = False  # leaving the block restores the buffers' shapes, which a grad leaf refuses
    return (out, q.grad, k.grad, v.grad), (cp_out, *grads)


def _worst(one, cp, atol, rtol):
    """max |cp - one| / (atol + rtol |one|): <= 1 is within torch.testing.assert_close(cp, one, atol, rtol)."""
    return ((cp.float() - one.float()).abs() / (atol + rtol * one.float().abs())).max().item()


def run_case(mesh, world, rank, shape, is_causal, load_balance):
    """One shape: context_parallel against one GPU, with flashtile as the flash backend and with torch's own."""
    batch, heads, tokens, head_dim = shape
    torch.manual_seed(10)
    q, k, v = (torch.rand(batch, heads, world * tokens, head_dim, device="cuda", dtype=torch.bfloat16)
               for _ in range(3))
    for t in (q, k, v):
        dist.broadcast(t, src=0)
    _cp_options.enable_load_balance = load_balance
    # torch's test's tolerances for bf16: output atol 1e-3 x world, gradients 8e-3 x world, rtol 1e-3 x world --
    # but at least one bf16 rounding (2^-7 relative): below that, one-ulp differences between two roundings of the
    # same fp32 value (which torch's own kernel shows too) would fail.
    atols = [1e-3 * world] + [8e-3 * world] * 3
    rtol = max(1e-3 * world, 2.0 ** -7)
    ratios = {}
    for provider in ("flashtile", "torch"):
        if provider == "flashtile":
            ft_sdpa.activate()
        else:
            ft_sdpa.deactivate()
        before = ft_sdpa.call_counts()
        one, cp = _one_and_cp(mesh, q, k, v, is_causal)
        calls = {key: n - before[key] for key, n in ft_sdpa.call_counts().items()}
        ratios[provider] = [_worst(a, b, atol, rtol) for a, b, atol in zip(one, cp, atols)]
        if provider == "flashtile":
            flashtile_calls = calls
    ok = max(ratios["flashtile"]) <= 1 and flashtile_calls["forward"] > 0 and flashtile_calls["backward"] > 0
    if rank == 0:
        fmt = lambda r: " ".join(f"{n} {x:.2f}" for n, x in zip(("out", "dq", "dk", "dv"), r))  # noqa: E731
        print(f"B{batch} H{heads} {tokens} tokens/GPU d{head_dim} causal={is_causal} load_balance={load_balance}: "
              f"|cp - one GPU| / tolerance: flashtile {fmt(ratios['flashtile'])}; torch's flash "
              f"{fmt(ratios['torch'])}; flashtile calls on this GPU {flashtile_calls} -> {'ok' if ok else 'FAIL'}",
              flush=True)
    return ok


def main():
    for name in ("NCCL_NVLS_ENABLE", "TORCH_SYMM_MEM_DISABLE_MULTICAST", "NVSHMEM_DISABLE_NVLS"):
        os.environ.setdefault(name, "0" if name == "NCCL_NVLS_ENABLE" else "1")
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
    mesh = init_device_mesh("cuda", (world,))
    results = []
    for shape in SHAPES:
        for is_causal, load_balance in ((False, False), (True, False), (True, True)):
            results.append(run_case(mesh, world, rank, shape, is_causal, load_balance))
    ft_sdpa.deactivate()
    if rank == 0 and all(results):
        print("context_parallel matches one GPU", flush=True)
    dist.destroy_process_group()
    if not all(results):
        raise SystemExit(1)


if __name__ == "__main__":
    main()
