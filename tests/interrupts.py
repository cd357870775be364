"""A KeyboardInterrupt injected at any Python line of pagedkv's step path (tests/test_interrupts.py,
scripts/soak.py): a sys.settrace tracer counts the 'line' events of frames whose code lives in
python/pagedkv/engine, runtime or cache, and raises at the N-th one.

Tracing stops once it has raised (CPython unsets a trace function that raises), so a traced call
sees one interrupt at most. Only the calling thread is traced. Run an interrupted call with
in_thread: an interrupt at some lines leaves an exception "being handled" in its thread for good.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import pathlib
import random
import sys
import threading
from typing import Callable, TypeVar

import pagedkv

ROOT = pathlib.Path(pagedkv.__file__).resolve().parent
TRACED = tuple(str(ROOT / d) + os.sep for d in ("engine", "runtime", "cache"))
T = TypeVar("T")


class Interrupter:
    """Used as a context manager around the calls to interrupt. at=None only counts (and records
    the (file, line) of each event in `sites`); at=N raises KeyboardInterrupt at the N-th event,
    once, and records where in `where`."""

    def __init__(self, at: int | None = None, on: str = "line"):
        self.at = at
        self.on = on  # "line": any line; "call": the start of a traced function (see RandomInterrupts)
        self.count = 0
        self.sites: list[tuple[str, int]] = []
        self.where: tuple[str, str, int] | None = None  # (file, function, line) of the interrupt
        self.stack: list[str] = []  # the functions it interrupted, innermost first

    @property
    def fired(self) -> bool:
        return self.where is not None

    def _call(self, frame, event, arg):
        if not frame.f_code.co_filename.startswith(TRACED):
            return None
        if self.on == "call":
            self._line(frame, "line", arg)  # counts this function's start as the event
            return None
        return self._line

    def _line(self, frame, event, arg):
        if event == "line":
            self.count += 1
            if self.at is None:
                self.sites.append((frame.f_code.co_filename, frame.f_lineno))
            elif self.count == self.at:
                code = frame.f_code
                self.where = (pathlib.Path(code.co_filename).name, code.co_name, frame.f_lineno)
                while frame is not None:
                    self.stack.append(frame.f_code.co_name)
                    frame = frame.f_back
                raise KeyboardInterrupt(f"injected at {self.where}")
        return self._line

    def __enter__(self) -> Interrupter:
        if not self.fired:
            sys.settrace(self._call)
        return self

    def __exit__(self, *exc) -> None:
        sys.settrace(None)


class Stuck(Exception):
    """An in_thread run that did not end in time (an engine that never finishes its requests)."""


def in_thread(run: Callable[[], T], timeout: float) -> T:
    """run() in a thread of its own (enter the Interrupter inside run: settrace is per thread):
    its result, or its exception raised here; Stuck after `timeout` seconds.

    Why a thread: CPython (3.11 to 3.13) does not restore the handled-exception state when a trace
    function raises at a line that leaves an `except` block (`return` or `break` in it: the line
    starts at POP_EXCEPT, which no exception-table entry covers, e.g. scheduler._admit's
    `except CacheFull: return None`). That exception then stays in sys.exc_info() of the thread
    for good; every later exception chains to it through __context__ and keeps its frames alive,
    and the engines and KV caches they hold (on CUDA: out of memory in later tests). A real
    Ctrl-C never lands there (signals are checked at calls and backward jumps). The state is per
    thread, so it ends with this one. tests/test_exception_state.py shows it in plain Python."""
    result: list[T] = []
    error: list[BaseException] = []

    def target() -> None:
        try:
            result.append(run())
        except BaseException as caught:  # noqa: BLE001 - raised again in the caller
            error.append(caught)

    thread = threading.Thread(target=target, name="interrupted-run", daemon=True)
    thread.start()
    thread.join(timeout)
    if thread.is_alive():
        # As an alarm signal would: raised in the thread at its next check, so it stops spinning.
        ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(thread.ident), ctypes.py_object(Stuck))
        thread.join(5)
        raise Stuck(f"not done after {timeout} s")
    if error:
        raise error[0]
    return result[0]


def interrupt_points(sites: list[tuple[str, int]], sample: int = 40, seed: int = 0) -> list[int]:
    """Which events (1-based) to interrupt at, of a run whose events were `sites`: the first and the
    last event of every distinct line (so every line the run executes is interrupted, early and
    late in the run, e.g. in the step that hands over the last outputs), and `sample` more at
    random (a fixed seed). PAGEDKV_INTERRUPT_ALL=1: every event."""
    n = len(sites)
    if os.environ.get("PAGEDKV_INTERRUPT_ALL"):
        return list(range(1, n + 1))
    first: dict[tuple[str, int], int] = {}
    last: dict[tuple[str, int], int] = {}
    for i, site in enumerate(sites, 1):
        first.setdefault(site, i)
        last[site] = i
    chosen = set(first.values()) | set(last.values())
    chosen.update(random.Random(seed).sample(range(1, n + 1), min(sample, n)))
    return sorted(chosen)


class RandomInterrupts:
    """A share `rate` of the calls made under it get an interrupt at the start of a random pagedkv
    function call (scripts/soak.py): `with chaos():` around a call; the point is drawn up to the
    most events a call was seen to run (uninterrupted calls are counted). One per thread: settrace
    traces only the thread that sets it.

    At function starts, not at any line: a trace function raising at the line that leaves a `with`
    block (the exit call runs under the `with` line, outside the block's exception-table entry)
    skips __exit__, so the engine's lock stayed held and the soak's callers waited for it forever
    (seen once in CI). A real Ctrl-C cannot land there (CPython checks signals at function starts,
    calls and backward jumps); tests/test_interrupts.py interrupts every line, in a thread of its own."""

    def __init__(self, rate: float, seed: int):
        self.rate, self.rng = rate, random.Random(seed)
        self.span = 200
        self.fired = 0
        self.tracer: Interrupter | None = None

    def __call__(self) -> Interrupter | contextlib.nullcontext:
        self.tracer = Interrupter(self.rng.randint(1, self.span), on="call") if self.rng.random() < self.rate else None
        return self.tracer or contextlib.nullcontext()

    def done(self, interrupted: bool) -> None:
        """After the call: whether it raised the injected KeyboardInterrupt."""
        self.fired += interrupted
        if self.tracer is not None and not interrupted:
            self.span = max(self.span, self.tracer.count)
