"""The model: the embedded tiny Llama or a local Hugging Face directory, dtype, activation checkpointing, LoRA -
shared by the ranks, the objectives (a reference model) and serving.
"""
