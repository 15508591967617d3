"""`baton up --autoscale`: the controller loop over the local workers, on its own thread.

It measures by scraping the workers, decides with the sizing policy (fixed fleet: convert
roles, never add workers) and acts through the Ray actuator's drain/role calls; the router
follows each worker's state on its own. Every decision is printed and kept for the
controller's small HTTP server (`/decisions`, `/metrics`).
"""

from __future__ import annotations

import asyncio
import logging
import threading
from dataclasses import dataclass, field, replace

from prometheus_client import CollectorRegistry

from baton.autoscaler.inputs import PolicyConfig
from baton.local.controller_http import ControllerServer, DecisionLog, decision_line
from baton.local.runtime import LocalStack

log = logging.getLogger(__name__)


def pool_sizes(spec) -> dict[str, int]:
    """Ranks per worker of each pool, for conversions between pools of different sizes
    (equal sizes: none, and a converted worker keeps its group)."""
    if spec.prefill_tp == spec.decode_tp:
        return {}
    return {"prefill": spec.prefill_tp, "decode": spec.decode_tp}


def stack_policy(policy: PolicyConfig, spec) -> PolicyConfig:
    """The policy with the stack's pool sizes (`--prefill-tp/--decode-tp`): the controller
    counts each worker at the larger one, as a worker may convert and regroup in place."""
    return replace(policy, prefill_tensor_parallel=spec.prefill_tp, decode_tensor_parallel=spec.decode_tp)


@dataclass
class AutoscaleSettings:
    """period_s: seconds between decisions; window_s: seconds of traffic each decision
    measures (None: two periods); policy: SLOs and guard rails; host, port: where the
    controller's HTTP server listens (port 0: any free one)."""

    period_s: float = 15.0
    window_s: float | None = None
    policy: PolicyConfig = field(default_factory=PolicyConfig)
    host: str = "127.0.0.1"
    port: int = 0


class ControllerThread:
    def __init__(self, stack: LocalStack, settings: AutoscaleSettings | None = None):
        self.stack = stack
        self.settings = settings or AutoscaleSettings()
        self.registry = CollectorRegistry()  # this controller's baton_autoscaler_* series
        self.decisions = DecisionLog(self.settings.period_s)
        self.server = ControllerServer(self.decisions, self.registry, self.settings.host, self.settings.port)
        self._loop = asyncio.new_event_loop()
        self._stopped: asyncio.Event | None = None
        self._thread = threading.Thread(target=self._run, name="baton-controller", daemon=True)

    @property
    def url(self) -> str:
        return self.server.url

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        self._loop.run_until_complete(self._main())

    async def _main(self) -> None:
        from baton.autoscaler.loop import Controller
        from baton.autoscaler.metrics_scrape import ScrapeSource
        from baton.autoscaler.policy import SizingPolicy
        from baton.autoscaler.ray_actuator import RayActuator

        urls = [w.url for w in self.stack.workers]
        self._stopped = asyncio.Event()
        actuator = RayActuator(workers=urls, token=self.stack.token, on_event=self._event,
                               tensor_parallel_sizes=pool_sizes(self.stack.spec))
        controller: Controller | None = None

        def on_decision(decision, status) -> None:
            record = self.decisions.add(decision, status, controller.last_applied, controller.last_error)
            print(decision_line(record), flush=True)

        window = self.settings.window_s or 2 * self.settings.period_s
        controller = Controller("local", ScrapeSource(urls, window_s=window), SizingPolicy(stack_policy(self.settings.policy, self.stack.spec)), actuator,
                                period_s=self.settings.period_s, registry=self.registry,
                                on_decision=on_decision)
        try:
            await controller.run(self._stopped)
        finally:
            await controller.aclose()

    @staticmethod
    def _event(reason: str, message: str) -> None:
        print(f"autoscaler {reason}: {message}", flush=True)

    def start(self) -> ControllerThread:
        self.server.start()
        self._thread.start()
        return self

    def stop(self) -> None:
        if self._stopped is not None:
            self._loop.call_soon_threadsafe(self._stopped.set)
        self._thread.join(10)
        self.server.stop()


def start_controller(stack: LocalStack, settings: AutoscaleSettings | None = None) -> ControllerThread:
    return ControllerThread(stack, settings).start()
