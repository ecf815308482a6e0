"""server._unless_disconnected: a request whose client went away stops its work (the engine's
rows), one whose client waits gets the result, and a cancellation from outside (the server
stopping) is not swallowed."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from kubellm.serve.server import _unless_disconnected


class Channel:
    """A Starlette Request's `receive` as uvicorn feeds it after the body: nothing until the
    client disconnects (after `gone_after` seconds; None: never)."""

    def __init__(self, gone_after: float | None) -> None:
        self.gone_after = gone_after

    async def receive(self) -> dict[str, Any]:
        if self.gone_after is None:
            await asyncio.Event().wait()
        await asyncio.sleep(self.gone_after or 0)
        return {"type": "http.disconnect"}


async def _work(seconds: float, log: list[str]) -> str:
    try:
        await asyncio.sleep(seconds)
        log.append("finished")
        return "result"
    except asyncio.CancelledError:
        log.append("cancelled")  # what BatchEngine.generate does: its rows are cancelled
        raise


def test_the_result_when_the_client_waits() -> None:
    async def main() -> tuple[Any, list[str], int]:
        log: list[str] = []
        result = await _unless_disconnected(Channel(None), _work(0.01, log))  # type: ignore[arg-type]
        await asyncio.sleep(0)  # let the cancelled watch end
        leftover = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        return result, log, len(leftover)

    assert asyncio.run(main()) == ("result", ["finished"], 0)


def test_a_client_that_goes_away_cancels_the_work_and_gets_none() -> None:
    async def main() -> tuple[Any, list[str], float, bool]:
        log: list[str] = []
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        result = await _unless_disconnected(Channel(0.02), _work(30, log))  # type: ignore[arg-type]
        took = loop.time() - t0
        await asyncio.sleep(0.01)  # the task goes on: the cancellation was taken back
        current = asyncio.current_task()
        return result, log, took, current is not None and current.cancelling() == 0

    result, log, took, not_cancelling = asyncio.run(main())
    assert result is None and log == ["cancelled"]
    assert took < 5 and not_cancelling


def test_a_cancellation_from_outside_goes_through() -> None:
    async def main() -> list[str]:
        log: list[str] = []
        task = asyncio.ensure_future(_unless_disconnected(Channel(None), _work(30, log)))  # type: ignore[arg-type]
        await asyncio.sleep(0.01)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        return log

    assert asyncio.run(main()) == ["cancelled"]
