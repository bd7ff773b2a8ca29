"""The label of a token that is not trained (defined with the loss that ignores it: objectives/base.py)."""

from dsrecipes.objectives.base import IGNORE_INDEX

__all__ = ["IGNORE_INDEX"]
