"""Training steps on flashtile through transformers: packed sequences (no padding) and a padded batch.

    python examples/transformers_training.py                 # a small random Llama (GQA)
    python examples/transformers_training.py --model NAME    # a causal LM you have locally
    python examples/transformers_training.py --compile       # torch.compile(model, fullgraph=True)

Packed: DataCollatorWithFlattening(return_flash_attn_kwargs=True) concatenates the examples into one row and
passes their boundaries (cu_seq_lens_q/k, max_length_q/k), which flashtile hands to its variable-length kernels:
no token is padding and no sequence sees another. Padded: the 2-D padding mask goes the same way. Each step is
AdamW on the model's loss; the script prints the losses of flashtile and of eager attention from the same weights.
"""
import argparse
import copy

import torch
import transformers

import flashtile.integrations.transformers as ft


def model_for(name, device, dtype):
    if name:
        return transformers.AutoModelForCausalLM.from_pretrained(name, dtype=dtype).to(device)
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=1000, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                                      num_attention_heads=8, num_key_value_heads=2, pad_token_id=0)
    return transformers.LlamaForCausalLM(config).to(device=device, dtype=dtype)


def batches(vocab, device):
    gen = torch.Generator().manual_seed(1)
    examples = [{"input_ids": torch.randint(1, vocab, (n,), generator=gen).tolist()} for n in (37, 120, 64, 9)]
    packed = transformers.DataCollatorWithFlattening(return_flash_attn_kwargs=True)(examples)
    padded = transformers.DataCollatorForLanguageModeling(_Pad(), mlm=False)(examples)
    move = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in packed.items()}
    return {"packed": move, "padded": {k: v.to(device) for k, v in padded.items()}}


class _Pad:
    """The two things DataCollatorForLanguageModeling asks of a tokenizer, for token ids that are already ids."""
    pad_token_id = 0
    padding_side = "right"

    def pad(self, examples, return_tensors="pt", **kwargs):
        longest = max(len(e["input_ids"]) for e in examples)
        ids = torch.zeros(len(examples), longest, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for row, e in enumerate(examples):
            ids[row, :len(e["input_ids"])] = torch.tensor(e["input_ids"])
            mask[row, :len(e["input_ids"])] = 1
        return {"input_ids": ids, "attention_mask": mask}


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--compile", action="store_true")
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    start = model_for(args.model, device, dtype)
    data = batches(start.config.vocab_size, device)
    for impl in (ft.register(), "eager"):
        model = copy.deepcopy(start).train()
        model.set_attn_implementation(impl)
        step_fn = torch.compile(model, fullgraph=True) if args.compile and impl != "eager" else model
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        for kind, batch in data.items():
            losses = []
            for _ in range(args.steps):
                loss = step_fn(**batch, use_cache=False).loss  # no cache in training (eager reads packing only then)
                loss.backward()
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
                losses.append(round(loss.item(), 4))
            print(f"{impl:>14} {kind:>6}: losses {losses}")


if __name__ == "__main__":
    main()
