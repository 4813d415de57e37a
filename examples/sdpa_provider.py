"""flashtile behind torch.nn.functional.scaled_dot_product_attention: any model on SDPA runs flashtile's kernels.

    python examples/sdpa_provider.py          # needs a CUDA GPU and torch >= 2.11

flashtile.integrations.sdpa.activate() installs flashtile as the kernels of torch's flash SDPA backend (through
torch.nn.attention.register_flash_attention_impl / activate_flash_attention_impl); deactivate() gives torch its own
back, and enabled() does both around a block. The script runs a transformers Llama on attn_implementation="sdpa"
with torch's kernel and with flashtile's, forward and backward, and prints the calls flashtile took and the
largest differences.
"""
import torch
import transformers
from torch.nn.attention import SDPBackend, sdpa_kernel

import flashtile.integrations.sdpa as ft_sdpa


def step(model, ids):
    model.zero_grad(set_to_none=True)
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):  # torch still chooses the backend: ask for the flash one
        loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    return loss.detach(), model.model.layers[0].self_attn.q_proj.weight.grad.clone()


def main():
    if not torch.cuda.is_available():
        raise SystemExit("torch's flash SDPA backend runs on CUDA only; run this on a GPU machine.")
    reason = ft_sdpa.available()
    if reason:
        raise SystemExit(reason)
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=32000, hidden_size=1024, intermediate_size=2816,
                                      num_hidden_layers=4, num_attention_heads=16, num_key_value_heads=4)
    model = transformers.LlamaForCausalLM(config).cuda().to(torch.bfloat16)
    model.set_attn_implementation("sdpa")
    ids = torch.randint(0, config.vocab_size, (2, 2048), device="cuda")
    torch_loss, torch_grad = step(model, ids)
    with ft_sdpa.enabled():
        ours_loss, ours_grad = step(model, ids)
        print(f"flashtile calls: {ft_sdpa.call_counts()} (one forward and one backward per layer)")
    print(f"loss: torch's flash {torch_loss.item():.5f}, flashtile {ours_loss.item():.5f}")
    print(f"max |grad difference| (layer 0 q_proj): {(ours_grad - torch_grad).abs().max().item():.2e} "
          f"(grad scale {torch_grad.abs().max().item():.2e})")


if __name__ == "__main__":
    main()
