"""The architectures pagedkv runs natively, one file per family on pagedkv's layers, and the
registry that says which HF models map to which family (and why others do not)."""

from pagedkv.models.registry import UnsupportedModel, check_supported, support_path, supports, unsupported_reason

__all__ = ["UnsupportedModel", "check_supported", "support_path", "supports", "unsupported_reason"]
