"""flashtile benchmarks: `python -m benchmarks.bench --help` (or `python -m flashtile bench`)."""
