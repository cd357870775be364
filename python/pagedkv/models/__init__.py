"""Forwards of the supported HF architectures on pagedkv ops and the paged KV cache."""

from pagedkv.models.llama import DecoderWeights, PagedDecoder

__all__ = ["DecoderWeights", "PagedDecoder"]
