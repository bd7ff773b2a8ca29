"""Conversations -> text -> tokens: templates (one definition for training and the exported Jinja), tokenization with labels, packing, collation."""
