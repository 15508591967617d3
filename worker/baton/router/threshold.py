"""The disaggregation threshold: below it, prefilling where the request decodes is faster.

Local prefill of L uncached tokens costs L·t_tok; the remote path costs a fixed overhead
O_fixed (reserve, scheduling, control traffic) plus the KV transfer L·kv/BW. Remote wins
beyond  L_thresh = O_fixed / (t_tok − kv/BW).  With `auto` the inputs are measured as the
router runs (smoothed); until each has been seen, a fallback threshold applies.

Load moves the threshold. A local prefill also stalls the n requests decoding on that worker
(each loses L·t_tok of its stream); a remote one first waits for the Q prompt tokens already
queued on the prefill worker (Q·t_tok). Remote then wins beyond
    L_thresh = (O_fixed + Q·t_tok) / (t_tok·(1 + n) − kv/BW),
the unloaded threshold when n = Q = 0: a busy decode worker and an idle prefill pool send
even short prompts away; a queued prefill pool keeps them home. The queue is counted in
tokens, not prompts, and in the prefill worker's order, fewest tokens left first
(policy.prefill_queue_ahead): a 64-token prompt waits for the shorter prompts queued there
and half the step that may be under way of a 2,000-token one, not all of it; a 2,000-token prompt
waits for everything shorter (counting prompts, the router once sent 64-token prompts to
wait behind a 2,000-token prefill, and a 2,000-token prompt home to stall eight streams).
t_tok is the prefill worker's own step cost per prompt token (queueing and batching out);
O_fixed is what a remote answer's time leaves once the prefill worker's own time (queue and
compute) and the transfer are taken out.

A prompt prefilled where it decodes costs that worker's own rate, t_local, not the prefill
worker's: it runs in chunks next to the decodes, under their TPOT cap, often too few rows for
the fast prompt products. The decode worker measures it from its own steps (`/internal/state`
`prefill_seconds_per_token`) and the local side of the formula uses it where known:
    L_thresh = (O_fixed + Q·t_tok) / (t_local·(1 + n) − kv/BW).
t_local is what prompt tokens add to a step; beside n decodes the prompt also waits for the
decodes' part of every step its chunks share with them, held to the TPOT objective T: its
own wait is t_local·f per token, f = T / (T − t_dec(n)) (policy.local_wait_factor, from the
objective and decode step line the decode worker publishes), while what it stalls the n
streams by stays its compute. In what follows t_local·(1 + n) reads t_local·(f + n).

The two paths' queues and what each holds up, in full. A remote prompt holds up the m
prompts that will wait behind it on the prefill worker (each loses L·t_tok): in its order,
fewest tokens first, those of at least its tokens that arrive while it waits there. By
Little's law m = λ·W: λ the rate such prompts were sent to the pool lately, W its own wait
there, O_fixed + (Q + L)·t_tok (policy.prompts_held_up). A local prompt waits for the
Q_local prompt tokens the decode worker is still to prefill (it takes them in arrival order):
    L_thresh = (O_fixed + Q·t_tok − Q_local·t_local) / (t_local·(1 + n) − kv/BW − m·t_tok).
An idle prefill pool and an idle decode queue (m = Q_local = 0) leave the formula as it was;
a prefill-bound pool keeps prompts home while the decode worker stalls fewer streams than
the prefill queue would hold up. n counts the streams that would decode during the local
prefill: a reservation whose prompt is still queued on the prefill worker is not one of
them unless it arrives within the local prefill's time (policy.decodes_stalled_by_local).

How much the others' time counts. The terms that charge a prompt for time it costs others
(the n streams a local prefill slows, the m prompts a remote one holds up) are scaled by a
stall weight w (the router's --stall-weight): with w = 1 the choice minimizes everyone's
delay summed; below 1 a prompt's own wait for its first token counts for more than the same
time spread over other streams. The decode worker keeps its streams within their TPOT
objective whatever it is sent (its per-step prompt budget), so a local prefill makes their
tokens come slower inside the objective rather than stopping them. On a Zen 4's two cores
(bench/serving.py, P/D, 8 streams of 256-token prompts and 64 tokens; two rounds each), w =
1 / 0.5 / 0.2 / 0 gave TTFT p50 749-768 / 643-689 / 528-530 / 477-523 ms, ITL p99 38-49 /
41-42 / 41-45 / 44-46 ms and 225-258 / 243-254 / 246-250 / 229 output tokens/s: 0.2 is the
default (at 0 the prefill worker idles while the decode worker's chunks fall behind). A
prompt longer than the prefill worker's chunk is placed at weight 1 (`stall_weight_for`), and
so is one headed to a decode worker whose decodes alone outrun their objective (a slow CPU):
there no budget keeps the streams within it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

DEFAULT_FALLBACK_TOKENS = 512.0
DEFAULT_STALL_WEIGHT = 0.2


def threshold_tokens(o_fixed_s: float, prefill_s_per_token: float, kv_bytes_per_token: float,
                     link_bytes_per_s: float, decoding: float = 0.0, queued_tokens: float = 0.0,
                     local_s_per_token: float | None = None, held_prompts: float = 0.0,
                     local_queued_tokens: float = 0.0, stall_weight: float = 1.0,
                     local_wait_factor: float = 1.0) -> float:
    """L_thresh in tokens. `local_s_per_token`: the decode worker's own cost of a prompt
    token, where measured (else the prefill worker's); `held_prompts`: those a remote prompt
    holds up on the prefill worker; `local_queued_tokens`: prompt tokens the decode worker
    prefills first; `stall_weight`: what the others' lost time (the decodes stalled, the
    prompts held up) counts for against the prompt's own; `local_wait_factor`: how many times
    its compute a prompt waits there beside its decodes (policy.local_wait_factor: the waits,
    not the stalls, which are the compute). Infinity where a token costs more sent than
    computed here (counting the decodes it stalls and the prompts it holds up) and the remote
    wait is the longer; zero where the local wait is longer and nothing favours computing
    here."""
    local = local_s_per_token if local_s_per_token and local_s_per_token > 0 else prefill_s_per_token
    waited = local * max(local_wait_factor, 1.0)
    per_token_gain = (waited + local * stall_weight * max(decoding, 0.0) - kv_bytes_per_token / link_bytes_per_s
                      - stall_weight * max(held_prompts, 0.0) * prefill_s_per_token)
    wait_saved = (max(0.0, o_fixed_s) + max(queued_tokens, 0.0) * prefill_s_per_token
                  - max(local_queued_tokens, 0.0) * waited)
    if per_token_gain <= 0:
        return math.inf if wait_saved > 0 else 0.0
    return max(wait_saved, 0.0) / per_token_gain


def parse_threshold(value: str | int | float | None) -> float | None:
    """`auto` (or empty) -> None; a number of tokens -> that number."""
    if value is None or (isinstance(value, str) and value.strip().lower() in ("", "auto")):
        return None
    try:
        number = float(value)
    except (TypeError, ValueError):
        number = math.nan
    if number < 0 or math.isnan(number):
        raise ValueError(f"the disaggregation threshold must be >= 0 tokens or 'auto', got {value!r}")
    return number


def stall_weight_for(weight: float, tokens: int, chunk_size: int, decodes_past_objective: bool = False) -> float:
    """The stall weight a prompt of `tokens` uncached tokens is placed with: `weight`, or 1
    for a prompt longer than the prefill worker's chunk. Kept home, such a prompt runs in many
    chunks beside the streams, each dearer than t_local prices as its context grows. At 0.2
    the interference experiment's 2,000-token prompts stayed home often enough to take its
    short streams' ITL p99 to 50 ms, against 34 with every prompt at 1 and 35 with this
    (bench/interference.py, a Zen 4, setup C).
    Also 1 where the decode worker's decodes alone outrun their TPOT objective
    (`decodes_past_objective`, from its state): a weight below 1 counts on its per-step
    budget keeping the streams within the objective, and there none can, so every chunk of a
    prompt kept home lengthens their gaps past it. On a Zen 3 core (no AVX-512; decode
    steps of 7-8 streams 43-50 ms against a 30 ms objective) 9-10 of 34 prompts stayed home
    at 0.2 and the P/D layout's ITL p99 was 1.07-1.27x vLLM's (bench/serving.py,
    results/serving.zen3.run4.json)."""
    return 1.0 if (chunk_size and tokens > chunk_size) or decodes_past_objective else weight


def parse_stall_weight(value: str | float | None) -> float:
    """The router's --stall-weight: a number >= 0 (None or empty: the default)."""
    if value is None or (isinstance(value, str) and not value.strip()):
        return DEFAULT_STALL_WEIGHT
    try:
        number = float(value)
    except ValueError:
        number = math.nan
    if not (number >= 0 and math.isfinite(number)):
        raise ValueError(f"the stall weight (--stall-weight, BATON_STALL_WEIGHT) must be a number >= 0, "
                         f"got {value!r}")
    return number


@dataclass
class Smoothed:
    value: float | None = None
    alpha: float = 0.2

    def observe(self, sample: float) -> None:
        if sample is None or not math.isfinite(sample) or sample < 0:
            return
        self.value = sample if self.value is None else (1 - self.alpha) * self.value + self.alpha * sample


class ThresholdEstimator:
    def __init__(self, fixed: float | None = None, fallback: float = DEFAULT_FALLBACK_TOKENS,
                 kv_bytes_per_token: float | None = None, stall_weight: float = DEFAULT_STALL_WEIGHT):
        self.fixed = fixed
        self.fallback = fallback
        self.stall_weight = stall_weight
        self.o_fixed_s = Smoothed()
        self.prefill_s_per_token = Smoothed()
        self.link_bytes_per_s = Smoothed()
        self.kv_bytes_per_token = Smoothed(kv_bytes_per_token)

    @property
    def is_auto(self) -> bool:
        return self.fixed is None

    def observe_prefill(self, tokens: int, seconds: float) -> None:
        if tokens > 0 and seconds > 0:
            self.prefill_s_per_token.observe(seconds / tokens)

    def observe_prefill_rate(self, seconds_per_token: float) -> None:
        """The prefill worker's own measured cost of a prompt token (its step costs)."""
        if seconds_per_token and seconds_per_token > 0:
            self.prefill_s_per_token.observe(seconds_per_token)

    def observe_transfer(self, num_bytes: float, seconds: float, tokens: int | None = None) -> None:
        if num_bytes > 0 and seconds > 0:
            self.link_bytes_per_s.observe(num_bytes / seconds)
        if num_bytes > 0 and tokens:
            self.kv_bytes_per_token.observe(num_bytes / tokens)

    def observe_remote(self, tokens: int, ttft_s: float, worker_s: float | None = None) -> None:
        """A remote request's time to first token; what the prefill worker's own time
        (`worker_s`: its queue and compute, steps shared with other prompts included; else
        tokens x t_tok) and the transfer don't explain is the fixed overhead."""
        t_tok, bw, kv = (self.prefill_s_per_token.value, self.link_bytes_per_s.value,
                         self.kv_bytes_per_token.value)
        if t_tok is None or bw is None or kv is None:
            return
        worker = worker_s if worker_s is not None else tokens * t_tok
        self.o_fixed_s.observe(max(0.0, ttft_s - worker - tokens * kv / bw))

    def threshold(self, decoding: float = 0.0, queued_tokens: float = 0.0,
                  local_s_per_token: float | None = None, held_prompts: float = 0.0,
                  local_queued_tokens: float = 0.0, stall_weight: float | None = None,
                  local_wait_factor: float = 1.0) -> float:
        """For a prompt headed to a decode worker with `decoding` requests on it and its own
        measured cost of a prompt token `local_s_per_token` (None: not measured), while the
        best prefill worker has `queued_tokens` prompt tokens to prefill first and
        `held_prompts` prompts a remote one would hold up, and the decode worker
        `local_queued_tokens` (see `threshold_tokens`); `stall_weight`: this prompt's, where
        not the router's own (`stall_weight_for`); `local_wait_factor`: how many times its
        compute a prompt kept there waits (policy.local_wait_factor). A fixed
        threshold ignores load; the fallback (inputs not yet measured) stands for
        O_fixed / t_tok and moves with load as the formula does, a token's compute costing the
        same on either side, nothing to transfer, and the wait beside the decodes counted."""
        if self.fixed is not None:
            return self.fixed
        inputs = (self.o_fixed_s.value, self.prefill_s_per_token.value,
                  self.kv_bytes_per_token.value, self.link_bytes_per_s.value)
        weight = self.stall_weight if stall_weight is None else stall_weight
        if any(v is None for v in inputs):
            waited = max(local_wait_factor, 1.0)  # a prompt kept home waits for the decodes' steps too
            wait_saved = self.fallback + max(queued_tokens, 0.0) - max(local_queued_tokens, 0.0) * waited
            return max(wait_saved, 0.0) / (waited + weight * max(decoding, 0.0))
        return threshold_tokens(*inputs, decoding=decoding, queued_tokens=queued_tokens,
                                local_s_per_token=local_s_per_token, held_prompts=held_prompts,
                                local_queued_tokens=local_queued_tokens, stall_weight=weight,
                                local_wait_factor=local_wait_factor)

    def explain(self, with_threshold: bool = True) -> dict:
        """The estimates behind the threshold (None: not measured yet) and, `with_threshold`,
        the unloaded threshold itself (None where infinite: JSON has no infinity)."""
        out = {"mode": "fixed" if self.fixed is not None else "auto", "stall_weight": self.stall_weight}
        if with_threshold:
            unloaded = self.threshold()
            out["threshold_tokens"] = unloaded if math.isfinite(unloaded) else None
        return {**out, "o_fixed_s": self.o_fixed_s.value, "prefill_s_per_token": self.prefill_s_per_token.value,
                "kv_bytes_per_token": self.kv_bytes_per_token.value, "link_bytes_per_s": self.link_bytes_per_s.value}
