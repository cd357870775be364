"""A streamer for tests: keeps every chunk generate() puts (cloned) and whether it ended."""

from __future__ import annotations

import torch


class RecordingStreamer:
    def __init__(self) -> None:
        self.chunks: list[torch.Tensor] = []
        self.ended = False

    def put(self, value: torch.Tensor) -> None:
        self.chunks.append(value.clone())

    def end(self) -> None:
        self.ended = True
