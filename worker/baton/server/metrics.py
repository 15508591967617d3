"""The worker's Prometheus metrics (names and meanings: docs/contracts.md).

Every metric carries the worker's current `role`. Engine counters are cumulative numbers in
the engine; they are turned into Prometheus counters by adding what changed since the last
look, on the engine thread after each step.
"""

from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from baton.engine.config import ROLES
from baton.engine.outputs import RequestOutput
from baton.engine.stats import STEP_KINDS

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
# fine around the time-per-token objectives a step is held to (tens of ms)
STEP_BUCKETS = (0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.035, 0.04, 0.045, 0.05, 0.06, 0.075, 0.1, 0.15,
                0.25, 0.5, 1, 2.5, 5)
STEP_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)
# a few ms lost to a neighbour, up to a throttled CPU quota's 100 ms period
OFF_CPU_BUCKETS = (0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5)
# tokens one finished request held: prompt lengths up to the longest contexts, outputs alike
REQUEST_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768, 65536, 131072)
TRANSFER_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10)


class WorkerMetrics:
    def __init__(self, role: str):
        self.role = role
        self.registry = r = CollectorRegistry()
        L = ["role"]
        self.ttft = Histogram("baton_time_to_first_token_seconds", "TTFT", L, registry=r, buckets=LATENCY_BUCKETS)
        self.itl = Histogram("baton_inter_token_latency_seconds", "gap between tokens of one stream", L, registry=r, buckets=LATENCY_BUCKETS)
        self.e2e = Histogram("baton_e2e_request_latency_seconds", "arrival to last token", L, registry=r, buckets=LATENCY_BUCKETS)
        # counted where a request finishes, with its e2e latency: the mean lengths of the same
        # requests the e2e count counts, even while the traffic's shape changes
        self.request_prompt_tokens = Histogram("baton_request_prompt_tokens", "prompt tokens of a finished request",
                                               L, registry=r, buckets=REQUEST_TOKEN_BUCKETS)
        self.request_generation_tokens = Histogram("baton_request_generation_tokens",
                                                   "tokens generated for a finished request", L, registry=r,
                                                   buckets=REQUEST_TOKEN_BUCKETS)
        self.running = Gauge("baton_num_requests_running", "sequences in the running batch", L, registry=r)
        self.waiting = Gauge("baton_num_requests_waiting", "sequences waiting", L, registry=r)
        self.kv_usage = Gauge("baton_kv_cache_usage_ratio", "used KV blocks / all KV blocks", L, registry=r)
        self.kv_capacity = Gauge("baton_kv_cache_capacity_tokens", "tokens the KV pool holds (blocks x block size)", L, registry=r)
        self.prefix_queries = Counter("baton_prefix_cache_queries", "prompt tokens looked up in the prefix cache", L, registry=r)
        self.prefix_hits = Counter("baton_prefix_cache_hits", "prompt tokens found in the prefix cache", L, registry=r)
        self.prompt_tokens = Counter("baton_prompt_tokens", "prompt tokens prefilled", L, registry=r)
        self.generation_tokens = Counter("baton_generation_tokens", "tokens generated", L, registry=r)
        self.kv_bytes = Counter("baton_kv_transfer_bytes", "KV bytes sent or received", L, registry=r)
        self.kv_seconds = Histogram("baton_kv_transfer_seconds", "first layer sent to last layer received", L, registry=r, buckets=TRANSFER_BUCKETS)
        self.kv_exposed = Histogram("baton_kv_exposed_transfer_seconds", "decode-ready minus prefill-end", L, registry=r, buckets=TRANSFER_BUCKETS)
        self.prefill_busy = Counter("baton_prefill_busy_seconds", "time spent running prefill steps", L, registry=r)
        self.step_seconds = Histogram("baton_step_seconds", "one engine step's forward pass and sampling",
                                      ["role", "kind"], registry=r, buckets=STEP_BUCKETS)
        self.step_off_cpu = Histogram("baton_step_off_cpu_seconds",
                                      "time within one engine step when no thread of the worker ran",
                                      ["role", "kind"], registry=r, buckets=OFF_CPU_BUCKETS)
        self.step_prompt_tokens = Histogram("baton_step_prompt_tokens", "prompt tokens one step computed",
                                            ["role", "kind"], registry=r, buckets=STEP_TOKEN_BUCKETS)
        self.commit_hold = Counter("baton_commit_hold_seconds", "time decode steps waited for a prompt's KV due", L, registry=r)
        self.migrations = Counter("baton_migrations", "sequences migrated", ["role", "direction"], registry=r)
        self.worker_role = Gauge("baton_worker_role", "1 for the worker's current role", L, registry=r)
        self.conversions = Counter("baton_role_conversions", "role switches done", L, registry=r)
        self._seen: dict[str, float] = {}  # engine counters already exported
        self._last_token_at: dict[str, float] = {}
        self.set_role(role)

    def set_role(self, role: str) -> None:
        self.role = role
        # create every series of the new role now, so dashboards see zeros, not gaps
        for metric in (self.ttft, self.itl, self.e2e, self.request_prompt_tokens, self.request_generation_tokens,
                       self.running, self.waiting, self.kv_usage, self.kv_capacity,
                       self.prefix_queries, self.prefix_hits, self.prompt_tokens,
                       self.generation_tokens, self.kv_bytes, self.kv_seconds, self.kv_exposed,
                       self.prefill_busy, self.commit_hold, self.conversions):
            metric.labels(role=role)
        for direction in ("in", "out"):
            self.migrations.labels(role=role, direction=direction)
        for kind in STEP_KINDS:
            self.step_seconds.labels(role=role, kind=kind)
            self.step_off_cpu.labels(role=role, kind=kind)
            if kind != "decode":
                self.step_prompt_tokens.labels(role=role, kind=kind)
        for name in ROLES:
            self.worker_role.labels(role=name).set(1.0 if name == role else 0.0)

    # -- engine thread ------------------------------------------------------------------
    def observe_outputs(self, outputs: list[RequestOutput]) -> None:
        """Latencies and generated tokens of the outputs of one step (or of a commit)."""
        now = time.monotonic()
        role = self.role
        for out in outputs:
            rid = out.request_id
            if out.new_token_ids:
                last = self._last_token_at.get(rid)
                if last is None:
                    if out.first_token_time is not None and len(out.token_ids) == len(out.new_token_ids):
                        self.ttft.labels(role=role).observe(max(0.0, out.first_token_time - out.arrival_time))
                else:
                    self.itl.labels(role=role).observe(now - last)
                self._last_token_at[rid] = now
                if out.finish_reason != "prefill":
                    self.generation_tokens.labels(role=role).inc(len(out.new_token_ids))
            if out.finished:
                self._last_token_at.pop(rid, None)
                if out.finish_reason not in ("prefill", "abort"):
                    self.e2e.labels(role=role).observe(max(0.0, now - out.arrival_time))
                    self.request_prompt_tokens.labels(role=role).observe(out.num_prompt_tokens)
                    self.request_generation_tokens.labels(role=role).observe(len(out.token_ids))

    def sync_engine(self, engine, held_s: float = 0.0) -> None:
        """Add what the engine's cumulative counters gained since the last call (`held_s`:
        AsyncEngine's time holding steps for commits)."""
        role = self.role
        stats, blocks = engine.stats, engine.blocks
        current = {
            "prompt": stats.prompt_tokens,
            "busy": stats.prefill_seconds,
            "hold": held_s,
            # the block manager is replaced on a pool resize: key its counters by identity
            f"queries-{id(blocks)}": blocks.prefix_queries,
            f"hits-{id(blocks)}": blocks.prefix_hits,
        }
        targets = {"prompt": self.prompt_tokens, "busy": self.prefill_busy, "hold": self.commit_hold,
                   "queries": self.prefix_queries, "hits": self.prefix_hits}
        for key, value in current.items():
            gained = value - self._seen.get(key, 0)
            if gained > 0:
                targets[key.split("-")[0]].labels(role=role).inc(gained)
            self._seen[key] = value
        for step in stats.take_steps():
            self.step_seconds.labels(role=role, kind=step.kind).observe(step.seconds)
            self.step_off_cpu.labels(role=role, kind=step.kind).observe(step.off_cpu_seconds)
            if step.prompt_tokens:
                self.step_prompt_tokens.labels(role=role, kind=step.kind).observe(step.prompt_tokens)

    # -- transfers ----------------------------------------------------------------------
    def observe_transfer(self, nbytes: int, seconds: float, exposed: float | None = None) -> None:
        self.kv_bytes.labels(role=self.role).inc(nbytes)
        self.kv_seconds.labels(role=self.role).observe(max(0.0, seconds))
        if exposed is not None:
            self.kv_exposed.labels(role=self.role).observe(max(0.0, exposed))

    def observe_migration(self, direction: str) -> None:
        self.migrations.labels(role=self.role, direction=direction).inc()

    # -- scrape ---------------------------------------------------------------------------
    def render(self, engine) -> bytes:
        if engine is not None:
            role = self.role
            # plain reads of sizes: a scrape must not wait for a long prefill step
            self.running.labels(role=role).set(len(engine.scheduler.running))
            self.waiting.labels(role=role).set(len(engine.scheduler.waiting))
            self.kv_usage.labels(role=role).set(engine.blocks.usage)
            self.kv_capacity.labels(role=role).set(engine.blocks.num_blocks * engine.blocks.block_size)
        return generate_latest(self.registry)
