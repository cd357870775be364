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


class FailingStreamer(RecordingStreamer):
    """A RecordingStreamer that raises `error` once it holds `after` chunks (a Ctrl-C, or a
    streamer's own failure, in the middle of a streamed call)."""

    def __init__(self, after: int, error: BaseException) -> None:
        super().__init__()
        self.after, self.error = after, error

    def put(self, value: torch.Tensor) -> None:
        super().put(value)
        if len(self.chunks) == self.after:
            raise self.error
