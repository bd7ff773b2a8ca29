"""The label of a token that is not trained: PyTorch cross-entropy's `ignore_index`."""

IGNORE_INDEX = -100
