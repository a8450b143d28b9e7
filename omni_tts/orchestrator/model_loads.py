"""When a model's talker stops and starts again: unloaded once its model has had no request for `idle_unload` seconds
(nothing in flight, nothing waiting), loaded again by the next request for it, which waits for the load (`ready`
says how long) while the other models' requests go on. One transition at a time per talker (a lock); a request and an
unload never cross: a request's `ready` and its registration run in one step of the event loop, and an unload marks
its talker unloaded before its first await."""
from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
from collections.abc import Iterator

from .stage_client import StageClient

logger = logging.getLogger(__name__)


class ModelLoads:
    def __init__(self, client: StageClient, idle_unload: float | None) -> None:
        """idle_unload: seconds a model may sit idle before its talker is unloaded; None: never."""
        self.client, self.supervisor = client, client.supervisor
        self.idle_unload = idle_unload
        talkers = client.layout.talkers
        self.last_used: dict[str, float] = {talker: 0.0 for talker in talkers}
        self.loads: collections.Counter[str] = collections.Counter()     # by talker: loads on demand so far
        self.unloads: collections.Counter[str] = collections.Counter()
        self._locks = {talker: asyncio.Lock() for talker in talkers}
        self._holds: collections.Counter[str] = collections.Counter()   # work on a talker outside a request
        self._watch: asyncio.Task | None = None

    def start(self) -> None:
        now = _now()
        self.last_used = dict.fromkeys(self.last_used, now)
        if self.idle_unload is not None:
            self._watch = asyncio.create_task(self._unload_idle())

    def close(self) -> None:
        if self._watch is not None:
            self._watch.cancel()

    def is_loaded(self, talker: str) -> bool:
        return talker not in self.supervisor.unloaded

    async def ready(self, talker: str) -> float:
        """Returns once `talker` runs (loading it if it was unloaded): the seconds this call waited for a load, 0.0
        when it ran already. StageDeadError when it cannot be loaded."""
        self.last_used[talker] = _now()
        if self.is_loaded(talker) and not self._locks[talker].locked():
            return 0.0
        started = _now()
        async with self._locks[talker]:
            if not self.is_loaded(talker):
                logger.info("stage %s was unloaded: loading it for a request", talker)
                await self.supervisor.load(talker)
                self.loads[talker] += 1
        self.last_used[talker] = _now()
        return self.last_used[talker] - started

    @contextlib.contextmanager
    def hold(self, talker: str) -> Iterator[None]:
        """`talker` counts as in use meanwhile (an x-vector asked of it, which is no request)."""
        self._holds[talker] += 1
        try:
            yield
        finally:
            self._holds[talker] -= 1
            self.last_used[talker] = _now()

    def in_use(self, talker: str) -> bool:
        return self._holds[talker] > 0 or any(state.talker == talker for state in self.client.requests.values())

    async def _unload_idle(self) -> None:
        while True:
            await asyncio.sleep(self.idle_unload / 4)
            for talker in self.last_used:
                if self.in_use(talker):
                    self.last_used[talker] = _now()   # idle counts from when it was last seen busy
                    continue
                if (not self.is_loaded(talker) or self._locks[talker].locked() or self.supervisor.down is not None
                        or _now() - self.last_used[talker] < self.idle_unload):
                    continue
                async with self._locks[talker]:
                    if self.in_use(talker) or not self.is_loaded(talker) or self.supervisor.down is not None:
                        continue
                    logger.info("stage %s idle for %.0f s: unloading it", talker, _now() - self.last_used[talker])
                    await self.supervisor.unload(talker)
                    self.unloads[talker] += 1


def _now() -> float:
    return asyncio.get_running_loop().time()
