"""dsrecipes: config-first supervised fine-tuning of causal LMs on ShareGPT conversations with DeepSpeed."""

__version__ = "0.1.0"
