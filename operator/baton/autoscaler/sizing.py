"""Closed-form sizing of a disaggregated prefill/decode fleet.

Units everywhere: seconds (s), bytes (B), tokens, requests per second (req/s), bytes per
second (B/s), tokens per second (tok/s). Lengths are mean tokens per request. Every
function is pure and returns floats or ints; "cannot be served" is `math.inf`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from baton.autoscaler.devices import WorkerDevices
from baton.router.threshold import threshold_tokens


def kv_bytes_per_token(n_layers: int, n_kv_heads: int, head_dim: int, dtype_bytes: float) -> int:
    """KV cache bytes one token occupies across the whole model.

    kv = 2 * n_layers * n_kv_heads * head_dim * dtype_bytes   (the 2 counts K and V)

    n_layers: decoder layers; n_kv_heads: key/value heads per layer (GQA groups);
    head_dim: elements per head; dtype_bytes: bytes per stored element (bf16 = 2).
    """
    return int(2 * n_layers * n_kv_heads * head_dim * dtype_bytes)


def kv_bytes(tokens: float, kv_per_token: float) -> float:
    """Bytes of KV for `tokens` tokens at `kv_per_token` B/token."""
    return tokens * kv_per_token


def transfer_seconds(tokens: float, kv_per_token: float, link_bytes_per_s: float) -> float:
    """Serialized handoff time T = L * kv / BW.

    tokens (L): prompt tokens whose KV moves; kv_per_token (kv): B/token;
    link_bytes_per_s (BW): effective link bandwidth in B/s.
    """
    if link_bytes_per_s <= 0:
        return math.inf
    return tokens * kv_per_token / link_bytes_per_s


def exposed_transfer_seconds(transfer_s: float, n_layers: int) -> float:
    """Transfer time left on the critical path with layer-wise pipelining: T / n_layers.

    transfer_s (T): serialized transfer time in s; n_layers: layers streamed one by one,
    so only the last layer's share is not hidden behind prefill compute.
    """
    return transfer_s / max(1, n_layers)


def pipelining_hides_transfer(
    prefill_seconds_per_token: float, kv_per_token: float, link_bytes_per_s: float
) -> bool:
    """Whether each layer's KV moves faster than the next layer computes.

    Overlap holds when t_prefill/token >= kv / BW (both per token, the layer count cancels).
    prefill_seconds_per_token: compute time per prompt token on one worker (s/token);
    kv_per_token: B/token; link_bytes_per_s: B/s.
    """
    return prefill_seconds_per_token >= kv_per_token / link_bytes_per_s


def transfer_feasible(transfer_s: float, budget_s: float) -> bool:
    """A handoff is feasible when its serialized time T fits the transfer budget (s)."""
    return transfer_s <= budget_s


def fleet_link_demand(arrival_rate: float, tokens: float, kv_per_token: float) -> float:
    """Aggregate KV bytes per second the fleet must move: lambda * L * kv (B/s).

    arrival_rate (lambda): req/s sent to remote prefill; tokens (L): prompt tokens per
    request; kv_per_token: B/token. Latency can be pipelined away; this cannot.
    """
    return arrival_rate * tokens * kv_per_token


def link_fits(demand_bytes_per_s: float, link_capacity_bytes_per_s: float) -> bool:
    """True when the fleet link demand (B/s) fits the deployed link capacity (B/s)."""
    return demand_bytes_per_s <= link_capacity_bytes_per_s


def prefill_demand_tokens(
    arrival_rate: float, input_len: float, hit_rate: float, local_share: float = 0.0
) -> float:
    """Prompt tokens per second the prefill pool must compute: lambda (1-h)(1-s) L_in.

    arrival_rate (lambda): req/s; input_len (L_in): mean prompt tokens; hit_rate (h):
    fraction of prompt tokens found in the prefix cache; local_share (s): fraction of
    uncached prompt tokens prefilled in place on decode workers.
    """
    return arrival_rate * (1.0 - hit_rate) * (1.0 - local_share) * input_len


def prefill_pool_size(
    arrival_rate: float,
    input_len: float,
    hit_rate: float,
    supply_tokens_per_s: float,
    target_utilisation: float,
    local_share: float = 0.0,
) -> int:
    """Prefill workers x = ceil(lambda (1-h)(1-s) L_in / (supply * rho_P)).

    supply_tokens_per_s: prompt tokens one worker computes per busy second (tok/s);
    target_utilisation (rho_P): fraction of that supply we plan to use (0..1].
    Other variables as in `prefill_demand_tokens`.
    """
    demand = prefill_demand_tokens(arrival_rate, input_len, hit_rate, local_share)
    if demand <= 0:
        return 0
    return math.ceil(demand / (supply_tokens_per_s * target_utilisation) - 1e-9)


def md1_wait_seconds(utilisation: float, service_s: float) -> float:
    """Mean queueing wait of an M/D/1 queue: W = rho * S / (2 (1 - rho)).

    utilisation (rho): offered load / capacity; service_s (S): deterministic service time.
    Returns inf at or above saturation.
    """
    if utilisation >= 1.0:
        return math.inf
    return max(0.0, utilisation) * service_s / (2.0 * (1.0 - utilisation))


def predicted_ttft(prefill_service_s: float, utilisation: float, exposed_transfer_s: float) -> float:
    """TTFT ~ prefill time + M/D/1 wait at utilisation rho + exposed transfer (all s)."""
    return prefill_service_s + md1_wait_seconds(utilisation, prefill_service_s) + exposed_transfer_s


def decode_concurrency(arrival_rate: float, ttft_s: float, output_len: float, tpot_s: float) -> float:
    """Little's law: sessions in flight C = lambda (TTFT + L_out * TPOT).

    arrival_rate (lambda): req/s; ttft_s: time to first token (s); output_len (L_out):
    mean generated tokens; tpot_s: time per output token (s).
    """
    return arrival_rate * (ttft_s + output_len * tpot_s)


def resident_context(input_len: float, output_len: float) -> float:
    """Mean tokens a decoding session holds: L_in + L_out / 2 (half-way through output)."""
    return input_len + output_len / 2.0


def kv_capacity_batch_bound(kv_capacity_tokens: float, input_len: float, output_len: float) -> float:
    """Sessions one decode worker can hold: KV capacity (tokens) / (L_in + L_out/2)."""
    return kv_capacity_tokens / max(1.0, resident_context(input_len, output_len))


def tpot_bandwidth_batch_bound(tpot_slo_s: float, step_intercept_s: float, step_per_seq_s: float) -> float:
    """Largest batch whose decode step meets the TPOT SLO.

    With a step time linear in batch, t(B) = a + b*B (a: step_intercept_s, the weight read;
    b: step_per_seq_s, one session's KV read at the current context), t(B) <= TPOT_SLO
    gives B <= (TPOT_SLO - a) / b. The roofline form is (TPOT*beta - W) / (kv * L_ctx).
    """
    if tpot_slo_s <= step_intercept_s:
        return 0.0
    if step_per_seq_s <= 0:
        return math.inf
    return (tpot_slo_s - step_intercept_s) / step_per_seq_s


def decode_batch_cap(kv_bound: float, tpot_bound: float) -> float:
    """B_cap = min(KV capacity bound, TPOT bandwidth bound), sessions per worker."""
    return min(kv_bound, tpot_bound)


def decode_pool_size(concurrency: float, batch_cap: float, target_utilisation: float) -> int:
    """Decode workers y = ceil(C / (B_cap * rho_D)); C sessions, B_cap sessions/worker."""
    if concurrency <= 0:
        return 0
    if batch_cap <= 0:
        return 2**31 - 1  # no batch fits the SLO: no finite pool does
    return math.ceil(concurrency / (batch_cap * target_utilisation) - 1e-9)


def disaggregation_threshold(
    fixed_overhead_s: float, prefill_seconds_per_token: float, kv_per_token: float, link_bytes_per_s: float
) -> float:
    """Prompt length above which remote prefill beats local: O_fixed / (t_p - kv/BW).

    The router's own formula (baton.router.threshold), at no load, so the controller plans
    with the threshold the router applies to an idle fleet. fixed_overhead_s (O_fixed):
    queueing + scheduling + control cost of the remote path; prefill_seconds_per_token (t_p);
    kv_per_token: B; link_bytes_per_s: B/s. inf when the wire is slower than computing in place.
    """
    return threshold_tokens(fixed_overhead_s, prefill_seconds_per_token, kv_per_token, link_bytes_per_s)


@dataclass(frozen=True)
class FleetLoad:
    """The workload and per-worker capacities a split is judged against.

    arrival_rate: req/s; input_len, output_len: mean tokens; hit_rate, local_share: 0..1;
    prefill_supply: tok/s per prefill worker; step_intercept_s, step_per_seq_s: decode step
    time t(B) = a + b*B at the current context; kv_capacity_tokens: per decode worker;
    exposed_transfer_s: handoff time left on the critical path; ttft_slo_s, tpot_slo_s;
    context_tokens: measured mean KV tokens per decoding session, when known (long outputs
    stay longer, so it differs from L_in + L_out/2 of the arrival means under a mixed load).
    """

    arrival_rate: float
    input_len: float
    output_len: float
    hit_rate: float
    prefill_supply: float
    step_intercept_s: float
    step_per_seq_s: float
    kv_capacity_tokens: float
    exposed_transfer_s: float
    ttft_slo_s: float
    tpot_slo_s: float
    local_share: float = 0.0
    context_tokens: float | None = None

    @property
    def resident_tokens(self) -> float:
        if self.context_tokens:
            return self.context_tokens
        return resident_context(self.input_len, self.output_len)

    @property
    def prefill_demand(self) -> float:
        return prefill_demand_tokens(self.arrival_rate, self.input_len, self.hit_rate, self.local_share)

    @property
    def prefill_service_s(self) -> float:
        """One request's prefill on one worker: (1-h) L_in / supply."""
        return (1.0 - self.hit_rate) * self.input_len / self.prefill_supply

    @property
    def batch_cap(self) -> float:
        kv_bound = self.kv_capacity_tokens / max(1.0, self.resident_tokens)
        tpot_bound = tpot_bandwidth_batch_bound(self.tpot_slo_s, self.step_intercept_s, self.step_per_seq_s)
        return decode_batch_cap(kv_bound, tpot_bound)


@dataclass(frozen=True)
class SplitAssessment:
    """How one (x prefill, y decode) split fares under a FleetLoad.

    prefill_utilisation (rho_P), decode_utilisation (C / (y B_cap)), ttft_s predicted,
    tpot_s predicted at the resulting batch, concurrency C, headroom = 1 - the busier
    pool's utilisation, meets_slo when TTFT and TPOT SLOs and KV capacity all hold.
    """

    prefill_workers: int
    decode_workers: int
    prefill_utilisation: float
    decode_utilisation: float
    ttft_s: float
    tpot_s: float
    concurrency: float
    headroom: float
    meets_slo: bool


def assess_split(load: FleetLoad, prefill_workers: int, decode_workers: int) -> SplitAssessment:
    """Predict utilisation, TTFT and TPOT of x prefill and y decode workers under `load`.

    Decode concurrency solves Little's law with the step time at the batch it produces:
    C = lambda (TTFT + L_out (a + b C / y))  =>  C = lambda (TTFT + L_out a) / (1 - lambda L_out b / y).
    """
    return _SplitModel(load).assess(prefill_workers, decode_workers)


class _SplitModel:
    """`assess_split` with the load's own terms computed once, so scanning every split of a
    fleet of thousands costs a few float operations per split."""

    def __init__(self, load: FleetLoad) -> None:
        self.load = load
        self.demand = load.prefill_demand
        self.service = load.prefill_service_s
        self.cap = load.batch_cap
        self.lam = load.arrival_rate
        self.per_seq_load = load.arrival_rate * load.output_len * load.step_per_seq_s
        self.intercept_time = load.output_len * load.step_intercept_s

    def measures(self, x: int, y: int) -> tuple[float, float, float, float, float]:
        """(rho_P, rho_D, TTFT, TPOT, C) of the split x, y."""
        load = self.load
        rho_p = self.demand / (x * load.prefill_supply) if x > 0 else math.inf
        ttft = predicted_ttft(self.service, rho_p, load.exposed_transfer_s) if x > 0 else math.inf
        # A prefill pool past the TTFT objective is fixed by x, not by more decode: size the
        # decode side at most at the objective. At infinity every split would tie at infinite
        # decode load, and the tie (fewest prefill workers) takes a worker from the overloaded
        # pool; just short of saturation the prompts' wait (161 s at 0.97 on a 2-core machine)
        # counted as decode load (4.9x its capacity) and made an overloaded split (prefill at
        # 1.94) look better than the one nearly keeping up.
        decode_ttft = min(ttft, load.ttft_slo_s)
        if y <= 0 or x <= 0:
            concurrency, tpot = math.inf, math.inf
        else:
            drain = 1.0 - self.per_seq_load / y
            concurrency = self.lam * (decode_ttft + self.intercept_time) / drain if drain > 0 else math.inf
            tpot = load.step_intercept_s + load.step_per_seq_s * concurrency / y
        rho_d = concurrency / (y * self.cap) if y > 0 and self.cap > 0 else math.inf
        return rho_p, rho_d, ttft, tpot, concurrency

    def meets(self, rho_d: float, ttft: float, tpot: float) -> bool:
        return ttft <= self.load.ttft_slo_s and tpot <= self.load.tpot_slo_s and rho_d <= 1.0

    def assess(self, x: int, y: int) -> SplitAssessment:
        rho_p, rho_d, ttft, tpot, concurrency = self.measures(x, y)
        return SplitAssessment(x, y, rho_p, rho_d, ttft, tpot, concurrency, 1.0 - max(rho_p, rho_d),
                               self.meets(rho_d, ttft, tpot))


def best_fixed_split(load: FleetLoad, total_workers: int, min_prefill: int = 1, min_decode: int = 1) -> SplitAssessment:
    """Split x + y = N that meets both SLOs with the most headroom.

    Headroom is 1 minus the busier pool's utilisation, so the winner balances the pools.
    When no split meets the SLOs the least overloaded one is returned (meets_slo False).
    Ties go to fewer prefill workers, keeping decode (which holds live sessions) larger.
    """
    return best_split_within_devices(load, total_workers, WorkerDevices(), min_prefill, min_decode)


def best_split_within_devices(load: FleetLoad, devices: int, per_worker: WorkerDevices,
                              min_prefill: int = 1, min_decode: int = 1) -> SplitAssessment:
    """The split x, y with x*a + y*b <= D that meets both SLOs with the most headroom.

    devices (D): the fleet's devices; per_worker: devices a prefill (a) and a decode (b)
    worker hold. For each x the decode pool takes every whole worker the rest holds,
    y = floor((D - x*a) / b): more decode workers never cost headroom. With a = b = 1 this
    is `best_fixed_split` of N = D workers. Ranking as in `best_fixed_split`.
    """
    model = _SplitModel(load)
    best_key, best_split = None, None
    x = min_prefill
    while x * per_worker.prefill <= devices:
        y = (devices - x * per_worker.prefill) // per_worker.decode
        if y < min_decode:
            break
        rho_p, rho_d, ttft, tpot, _ = model.measures(x, y)
        # Meeting splits first, then headroom; ">" keeps the first (fewest prefill) of ties.
        key = (model.meets(rho_d, ttft, tpot), 1.0 - max(rho_p, rho_d))
        if best_key is None or key > best_key:
            best_key, best_split = key, (x, y)
        x += 1
    if best_split is None:
        raise ValueError(f"cannot split {devices} devices ({per_worker.prefill} per prefill, "
                         f"{per_worker.decode} per decode worker) with minimums {min_prefill}/{min_decode}")
    return model.assess(*best_split)


def elastic_pool_sizes(
    load: FleetLoad,
    prefill_utilisation: float,
    decode_utilisation: float,
    prefill_bounds: tuple[int, int],
    decode_bounds: tuple[int, int],
) -> tuple[int, int]:
    """Independent pool sizes for an elastic fleet, each clamped to its (min, max).

    Prefill from `prefill_pool_size`; decode from Little's law with the step time at the
    planned batch rho_D * B_cap and the TTFT the planned prefill pool would give.
    """
    x = prefill_pool_size(
        load.arrival_rate, load.input_len, load.hit_rate, load.prefill_supply, prefill_utilisation, load.local_share
    )
    x = clamp(x, *prefill_bounds)
    rho_p = load.prefill_demand / (x * load.prefill_supply) if x > 0 else math.inf
    ttft = predicted_ttft(load.prefill_service_s, rho_p, load.exposed_transfer_s)
    ttft = min(ttft, load.ttft_slo_s)  # an overloaded prefill pool is fixed by x, not by more decode
    cap = load.batch_cap
    tpot = load.step_intercept_s + load.step_per_seq_s * decode_utilisation * cap
    concurrency = decode_concurrency(load.arrival_rate, ttft, load.output_len, tpot)
    y = clamp(decode_pool_size(concurrency, cap, decode_utilisation), *decode_bounds)
    return x, y


def clamp(value: int, low: int, high: int) -> int:
    """Keep a pool size within its elastic bounds [low, high]."""
    return max(low, min(high, value))
