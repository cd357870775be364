"""The error every refusal of a model raises (a leaf module: the families' weight extraction
raises it too, and registry.py, which imports them, re-exports it)."""

from __future__ import annotations


class UnsupportedModel(ValueError):
    """The model (architecture, attention variant, dtype, placement) is not one pagedkv runs."""
