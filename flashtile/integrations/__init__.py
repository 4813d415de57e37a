"""flashtile inside the frameworks people already use.

- `flashtile.integrations.transformers`: `register()` makes flashtile a transformers attention implementation
  (`attn_implementation=register()`), padded batches, packed sequences and generate() included.
- `flashtile.integrations.sdpa`: `activate()` / `deactivate()` / `enabled()` make torch's flash SDPA backend run
  flashtile, so any model on `torch.nn.functional.scaled_dot_product_attention` (and torch's `context_parallel`)
  runs on it.

Neither submodule is imported here: each imports its framework when it is used, never when flashtile is.
"""
