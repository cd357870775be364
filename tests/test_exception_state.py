"""No test leaves an exception "being handled" (conftest._no_exception_left_handled), and why
tests/interrupts.py runs interrupted calls with in_thread: in CPython 3.11 to 3.13 a trace
function that raises at a `return` inside an `except` block leaves that block's exception in
sys.exc_info() of the thread for good (found when test_interrupts.py kept every later pagedkv.LLM
alive through __context__ chains and later CUDA tests ran out of GPU memory).
"""

from __future__ import annotations

import sys

import pytest

from conftest import exception_left_handled
from interrupts import in_thread


def handled_then_returns() -> None:
    try:
        raise ValueError("handled")
    except ValueError:
        return None  # the line event of this line comes before POP_EXCEPT, which nothing protects


def interrupt_at_the_return() -> BaseException | None:
    """handled_then_returns with a KeyboardInterrupt raised by the tracer at its `return` line:
    what sys.exc_info() holds afterwards in this thread."""
    line = handled_then_returns.__code__.co_firstlineno + 4

    def tracer(frame, event, arg):
        if event == "line" and frame.f_lineno == line:
            raise KeyboardInterrupt("injected")
        return tracer

    sys.settrace(lambda frame, event, arg: tracer if frame.f_code is handled_then_returns.__code__ else None)
    try:
        handled_then_returns()
    except KeyboardInterrupt:
        pass
    finally:
        sys.settrace(None)
    return sys.exc_info()[1]


def test_an_interrupted_return_in_except_stays_in_its_thread():
    left = in_thread(interrupt_at_the_return, timeout=30)
    assert isinstance(left, ValueError), f"CPython restored the state ({left!r}): in_thread may no longer be needed"
    assert sys.exc_info() == (None, None, None)  # this thread's state is untouched


def check_inside_except() -> tuple[str | None, str | None]:
    try:
        raise ValueError("still handled")
    except ValueError as error:
        return exception_left_handled(None), exception_left_handled(error)


def leave_one_then_check() -> str | None:
    interrupt_at_the_return()
    return exception_left_handled(None)


def test_the_check_names_an_exception_left_handled():
    # Each in a thread of its own: nothing is left handled in the test's own thread.
    new, same = in_thread(check_inside_except, timeout=30)
    assert new is not None and "ValueError('still handled')" in new
    assert same is None  # one already handled before the test is not the test's doing
    left = in_thread(leave_one_then_check, timeout=30)
    assert left is not None and "ValueError('handled')" in left


def test_pytest_raises_leaves_nothing_handled():
    with pytest.raises(ValueError, match="expected"):
        raise ValueError("expected")
    assert exception_left_handled(None) is None
