"""Preparing data once on the launching node: tokenize, split, pack and cache (content-keyed), for single-answer rows
and preference pairs alike."""
