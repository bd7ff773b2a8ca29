"""dsrecipes: config-first supervised fine-tuning of causal LMs on ShareGPT conversations with DeepSpeed.

Importing the package changes nothing outside it: no import hook, no patch of another library
(tests/test_no_import_patching.py)."""

__version__ = "0.1.0"
