"""dsrecipes: config-first supervised fine-tuning of causal LMs on ShareGPT conversations with DeepSpeed."""

from dsrecipes.rank import transformers_import

__version__ = "0.1.0"

# Every dsrecipes process (launching side, ranks, helpers) imports this package before transformers: from here on,
# transformers' table of its models is read from a checked cache file instead of being rebuilt twice per process
# (1.3 s of CPU each; transformers_import.py says how, and why it is safe).
transformers_import.install()
