"""The one way a test waits for something another thread or process does: poll a condition until it holds, and
fail saying what did not happen once a deadline passes (never hang, never sleep a guessed time instead)."""
import asyncio
import inspect
import time
from typing import Awaitable, Callable, TypeVar

T = TypeVar("T")
POLL_SECONDS = 0.02
# generous: a deadline only turns a hang into a failure; beside a busy neighbour a step can take 10x its idle time
TIMEOUT = 60.0
# a restart loads a model again (both stages, or the aligner): seconds on an idle machine, a minute on a busy one
RESTART_TIMEOUT = 120.0


def _timed_out(timeout: float, what: str | Callable[[], str]) -> AssertionError:
    return AssertionError(f"not within {timeout:g} s: {what() if callable(what) else what}")


def eventually(condition: Callable[[], T], timeout: float = TIMEOUT, what: str | Callable[[], str] = "",
               interval: float = POLL_SECONDS) -> T:
    """Poll `condition` every `interval` s until it returns something true, and return that. `what` (or a function
    giving it, called only on failure) says what was waited for. An exception from `condition` ends the wait."""
    deadline = time.monotonic() + timeout
    while not (value := condition()):
        if time.monotonic() > deadline:
            raise _timed_out(timeout, what)
        time.sleep(interval)
    return value


async def eventually_async(condition: Callable[[], T | Awaitable[T]], timeout: float = TIMEOUT,
                           what: str | Callable[[], str] = "", interval: float = POLL_SECONDS) -> T:
    """`eventually` for a test's event loop: the loop runs while it waits; `condition` may be a coroutine function."""
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if inspect.isawaitable(value):
            value = await value
        if value:
            return value
        if time.monotonic() > deadline:
            raise _timed_out(timeout, what)
        await asyncio.sleep(interval)
