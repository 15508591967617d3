"""`baton up --autoscale`: the controller loop over the local workers, on its own thread.

It measures by scraping the workers, decides with the sizing policy's defaults (fixed
fleet: convert roles, never add workers) and acts through the Ray actuator's drain/role
calls; the router follows each worker's state on its own.
"""

from __future__ import annotations

import asyncio
import logging
import threading

from baton.local.runtime import LocalStack

log = logging.getLogger(__name__)


class ControllerThread:
    def __init__(self, stack: LocalStack, period_s: float = 15.0):
        self.stack, self.period_s = stack, period_s
        self._loop = asyncio.new_event_loop()
        self._stopped: asyncio.Event | None = None
        self._thread = threading.Thread(target=self._run, name="baton-controller", daemon=True)

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        self._loop.run_until_complete(self._main())

    async def _main(self) -> None:
        from baton.autoscaler.inputs import PolicyConfig
        from baton.autoscaler.loop import Controller
        from baton.autoscaler.metrics_scrape import ScrapeSource
        from baton.autoscaler.policy import SizingPolicy
        from baton.autoscaler.ray_actuator import RayActuator

        urls = [w.url for w in self.stack.workers]
        self._stopped = asyncio.Event()
        controller = Controller("local", ScrapeSource(urls), SizingPolicy(PolicyConfig()),
                                RayActuator(workers=urls, token=self.stack.token), period_s=self.period_s)
        try:
            await controller.run(self._stopped)
        finally:
            await controller.aclose()

    def start(self) -> ControllerThread:
        self._thread.start()
        return self

    def stop(self) -> None:
        if self._stopped is not None:
            self._loop.call_soon_threadsafe(self._stopped.set)
        self._thread.join(10)


def start_controller(stack: LocalStack) -> ControllerThread:
    return ControllerThread(stack).start()
