"""Greedy generate() on flashtile: a left-padded batch, prefill through the variable-length kernels, every decode
step through the split-KV decode kernel (flash_attn_with_kvcache) over transformers' own cache.

    python examples/transformers_generate.py                 # a small random Llama (GQA)
    python examples/transformers_generate.py --model NAME    # a causal LM you have locally (HF_HUB_OFFLINE=1)

It prints the tokens of flashtile, of torch's SDPA and of transformers' eager attention, how long each row's tokens
stay equal to eager's (all of them in float32, on the CPU; in bfloat16 near-ties part sequences for SDPA as for
flashtile), how many decode-kernel calls ran, and the tokens/s of each after a warm-up call.
"""
import argparse
import time

import torch
import transformers

import flashtile.integrations.transformers as ft


def load(name, device, dtype):
    if name:
        return transformers.AutoModelForCausalLM.from_pretrained(name, dtype=dtype).to(device).eval()
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=1000, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                                      num_attention_heads=8, num_key_value_heads=2, pad_token_id=0)
    model = transformers.LlamaForCausalLM(config).to(device=device, dtype=dtype).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(30.0)  # sharper logits than a random init's, so greedy tokens are well defined
    return model


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="a causal LM name or path (default: a small random Llama)")
    parser.add_argument("--new-tokens", type=int, default=32)
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    model = load(args.model, device, dtype)
    vocab = model.config.vocab_size
    lengths = [5, 12, 9]  # prompts of different lengths, left-padded to the longest
    ids = torch.zeros(len(lengths), max(lengths), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, n in enumerate(lengths):
        ids[row, -n:] = torch.randint(1, vocab, (n,))
        mask[row, -n:] = 1

    decode_calls = []
    decode = ft.flash_attn_with_kvcache

    def counted(q, *rest, **kwargs):
        decode_calls.append(q.shape[1])
        return decode(q, *rest, **kwargs)

    ft.flash_attn_with_kvcache = counted
    results = {}
    for impl in (ft.register(), "sdpa", "eager"):
        model.set_attn_implementation(impl)

        def generate(new_tokens):
            with torch.no_grad():
                return model.generate(input_ids=ids.to(device), attention_mask=mask.to(device),
                                      max_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
        generate(2)  # compiles flashtile's kernels for these shapes (Triton caches them on disk for the next run)
        calls_before = len(decode_calls)
        start = time.perf_counter()
        out = generate(args.new_tokens)
        if device == "cuda":
            torch.cuda.synchronize()
        seconds = time.perf_counter() - start
        results[impl] = out[:, ids.shape[1]:].cpu()
        print(f"{impl:>14}: {results[impl].numel() / seconds:8.1f} tokens/s; first row {results[impl][0].tolist()}")
        if impl == ft.ATTN_IMPLEMENTATION:
            print(f"{'':>14}  decode-kernel calls in the timed generate(): {len(decode_calls) - calls_before}")
    ft.flash_attn_with_kvcache = decode
    # In float32 greedy tokens match eager's exactly. In bfloat16 any two attention implementations round
    # differently, and once two candidate tokens' logits are within that rounding the sequences part: compare how
    # long each row stays with eager's, for flashtile and for torch's SDPA.
    for impl in (ft.ATTN_IMPLEMENTATION, "sdpa"):
        same = [_common_prefix(a, b) for a, b in zip(results[impl], results["eager"])]
        print(f"{impl:>14}: tokens equal to eager's before the first difference, per row: {same} "
              f"(of {args.new_tokens})")


def _common_prefix(a, b):
    differ = (a != b).nonzero()
    return int(differ[0]) if len(differ) else len(a)

if __name__ == "__main__":
    main()
