"""The shared floor, torch-free: what both the launching process and the ranks stand on - the typed schema and its
conversion, errors, file I/O (one atomic write, one publish), run plan and run directory, topology, locks, manifests,
checkpoint and export names, loading a tokenizer, signals and heartbeats. Nothing here imports torch, deepspeed or
transformers' model code at module level, and nothing here imports another folder of the package.
"""
