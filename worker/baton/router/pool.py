"""The router's view of its workers: membership from discovery, load from state polls,
router-side in-flight counts (fresher than any poll), and failures seen on requests."""

from __future__ import annotations

import asyncio
import logging
import math
from dataclasses import dataclass, replace

from baton.router.policy import WorkerSnapshot
from baton.router.threshold import ThresholdEstimator
from baton.router.worker_client import WorkerClient, WorkerRejected, WorkerUnavailable
from baton.router.worker_metrics import counter_deltas, parse_worker_counters

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Membership:
    """One worker as discovery sees it; role/state None = ask the worker."""

    url: str
    role: str | None = None
    state: str | None = None


class WorkerPool:
    def __init__(self, client: WorkerClient, estimator: ThresholdEstimator | None = None,
                 poll_interval_s: float = 0.5, metrics_interval_s: float = 5.0):
        self.client = client
        self.estimator = estimator
        self.poll_interval_s = poll_interval_s
        self.metrics_interval_s = metrics_interval_s
        self._members: dict[str, Membership] = {}
        self._snapshots: dict[str, WorkerSnapshot] = {}
        self._inflight: dict[str, int] = {}
        self._inflight_prompts: dict[str, list[int]] = {}  # prompt tokens to prefill, prompt by prompt
        self._awaiting_remote: dict[str, int] = {}  # reservations here whose prompts prefill elsewhere still
        self._counters: dict[str, dict[str, float]] = {}
        self.changed = asyncio.Event()  # set whenever a worker may have become usable

    # -- membership ---------------------------------------------------------------------
    def set_members(self, members: list[Membership]) -> None:
        self._members = {m.url: m for m in members}
        for url in list(self._snapshots):
            if url not in self._members:
                del self._snapshots[url]
                self._counters.pop(url, None)
        for m in members:
            snap = self._snapshots.get(m.url)
            if snap is None:  # unknown until its first successful poll
                snap = WorkerSnapshot(url=m.url, role=m.role or "unknown", healthy=False)
            self._snapshots[m.url] = self._apply_labels(snap, m)
        self.changed.set()

    @staticmethod
    def _apply_labels(snap: WorkerSnapshot, m: Membership) -> WorkerSnapshot:
        if m.role:
            snap = replace(snap, role=m.role)
        if m.state and m.state != "active":  # a draining label wins over a stale poll
            snap = replace(snap, state=m.state)
        return snap

    # -- views used by the dispatcher ------------------------------------------------------
    def snapshots(self) -> list[WorkerSnapshot]:
        out = []
        for url, s in self._snapshots.items():
            prompts = tuple(self._inflight_prompts.get(url, ()))
            out.append(replace(s, inflight=self._inflight.get(url, 0), inflight_prompts=prompts,
                               awaiting_remote=self._awaiting_remote.get(url, 0)))
        return out

    def begin(self, url: str, tokens: int = 0) -> None:
        """A request (of `tokens` prompt tokens to prefill) is outstanding at `url`."""
        self._inflight[url] = self._inflight.get(url, 0) + 1
        if tokens > 0:
            self._inflight_prompts.setdefault(url, []).append(tokens)

    def prefilled(self, url: str, tokens: int) -> None:
        """A prompt of `tokens` begun at `url` has its first token: nothing of it is left to
        prefill there, though the request stays outstanding."""
        prompts = self._inflight_prompts.get(url, [])
        if tokens > 0 and tokens in prompts:
            prompts.remove(tokens)

    def end(self, url: str, tokens: int = 0) -> None:
        """A request begun at `url` is over; `tokens`: its prompt tokens, if still counted
        there as waiting to prefill."""
        self._inflight[url] = max(0, self._inflight.get(url, 0) - 1)
        self.prefilled(url, tokens)

    def begin_remote_prefill(self, url: str) -> None:
        """A request reserves (or has reserved) at decode worker `url` for a prompt that
        prefills on a prefill worker: counted from the choice on, so that a burst's next
        prompts see it as awaiting that prompt, not as a stream there."""
        self._awaiting_remote[url] = self._awaiting_remote.get(url, 0) + 1

    def end_remote_prefill(self, url: str) -> None:
        """Its prefill answered (or failed): it streams at `url` now, or not at all."""
        self._awaiting_remote[url] = max(0, self._awaiting_remote.get(url, 0) - 1)

    def mark_failed(self, url: str) -> None:
        """A request failed to reach the worker: no new work until a poll succeeds."""
        snap = self._snapshots.get(url)
        if snap is not None:
            self._snapshots[url] = replace(snap, healthy=False)

    # -- polling ---------------------------------------------------------------------------
    async def poll_once(self) -> None:
        await asyncio.gather(*(self._poll(url) for url in list(self._members)))

    async def _poll(self, url: str) -> None:
        member = self._members.get(url)
        outstanding = self._inflight.get(url, 0)  # those the state below counts, as far as known
        try:
            state = await self.client.state(url)
        except (WorkerUnavailable, WorkerRejected, ValueError) as e:
            log.debug("worker %s: state poll failed: %s", url, e)
            if url in self._snapshots:
                self._snapshots[url] = replace(self._snapshots[url], healthy=False)
            return
        if member is None or url not in self._members:
            return  # removed while polling
        snap = WorkerSnapshot(
            url=url, role=str(state.get("role") or member.role or "unknown"),
            state=str(state.get("state") or "active"), healthy=True,
            running=int(state.get("running") or 0), waiting=int(state.get("waiting") or 0),
            reserved=int(state.get("reservations") or 0),
            kv_usage=float(state.get("kv_usage") or 0.0),
            chunk_size=max(int(state.get("chunk_size") or 0), 0),
            prefill_s_per_token=positive_or_none(state.get("prefill_seconds_per_token")),
            decodes_past_objective=state.get("decodes_past_objective") is True,
            tpot_objective_s=positive_or_none(state.get("tpot_objective_s")),
            decode_step_line=step_line_or_none(state.get("decode_step_line")),
            inflight_at_poll=outstanding)
        was_usable = url in self._snapshots and self._snapshots[url].accepts_work
        self._snapshots[url] = self._apply_labels(snap, member)
        if self._snapshots[url].accepts_work and not was_usable:
            self.changed.set()

    async def _scrape_metrics(self) -> None:
        for url in list(self._members):
            try:
                current = parse_worker_counters(await self.client.metrics_text(url))
            except (WorkerUnavailable, WorkerRejected, ValueError):
                continue
            delta = counter_deltas(self._counters.get(url), current)
            self._counters[url] = current
            # Only prefill speed: the workers' transfer histograms span the layer-wise stream,
            # which compute paces, so they say nothing about the link (the router learns that
            # from each prefill's wire time instead).
            self.estimator.observe_prefill(int(delta["prompt_tokens"]), delta["prefill_busy_s"])

    async def run(self) -> None:
        """Poll states forever (and worker counters when the threshold is measured)."""
        since_metrics = self.metrics_interval_s
        while True:
            try:
                await self.poll_once()
                if self.estimator is not None and self.estimator.is_auto and since_metrics >= self.metrics_interval_s:
                    since_metrics = 0.0
                    await self._scrape_metrics()
            except Exception:  # a poller that dies silently would freeze routing
                log.exception("worker poll failed")
            await asyncio.sleep(self.poll_interval_s)
            since_metrics += self.poll_interval_s

    async def wait_changed(self, timeout_s: float) -> None:
        self.changed.clear()
        try:
            await asyncio.wait_for(self.changed.wait(), timeout_s)
        except TimeoutError:
            pass


def _finite_number(value) -> bool:
    """A JSON number that is finite (a bool is not one)."""
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def positive_or_none(value) -> float | None:
    """A measured rate from a worker's state: a positive finite number, else None (not yet
    measured, or nonsense that must not move the threshold)."""
    return float(value) if _finite_number(value) and value > 0 else None


def step_line_or_none(value) -> tuple[float, float] | None:
    """A decode step line from a worker's state, [seconds at 0 decodes, per decode]: two
    finite numbers >= 0, else None."""
    if not isinstance(value, list | tuple) or len(value) != 2:
        return None
    if not all(_finite_number(v) and v >= 0 for v in value):
        return None
    return float(value[0]), float(value[1])
