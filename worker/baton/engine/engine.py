"""The engine: requests in, tokens out, one scheduled step at a time."""

from __future__ import annotations

import dataclasses
import itertools
import logging
import time
from collections.abc import Sequence as Seq

import torch

from baton.engine.block_manager import BlockManager
from baton.engine.calibration import calibrate
from baton.engine.config import EngineConfig
from baton.engine.loader import ModelSource, load_source
from baton.engine.model_runner import ModelRunner
from baton.engine.outputs import RequestOutput
from baton.engine.sampling import SampleResult, SamplingParams, sample, skip_draws
from baton.engine.scheduler import ScheduledBatch, Scheduler
from baton.engine.sequence import Sequence, SequenceStatus
from baton.engine.stats import EngineStats, off_cpu_seconds
from baton.engine.step_budget import (
    StepCosts,
    attention_work,
    colocated_bank,
    prefill_token_budget,
    prompt_batch_tokens,
    step_allowance_s,
)
from baton.engine.stopping import StopChecker
from baton.engine.weights import model_tensors

log = logging.getLogger(__name__)

Prompt = str | list[int]


class Engine:
    """Offline and step-driven inference over a paged KV cache.

    >>> engine = Engine()  # the bundled SmolLM2-135M-Instruct
    >>> engine.generate(["Hello"], SamplingParams(max_tokens=8))[0].text
    """

    def __init__(self, model: str | None = None, **settings):
        self.config = EngineConfig(model=model, **settings)
        self.config.validate()
        if self.config.threads:
            torch.set_num_threads(self.config.threads)
        self.device = self.config.torch_device()
        source = load_source(model, keep_quantized=self.config.keeps_quantized)
        self.dtype, why = self.config.dtype_choice(self.device, source.quantized)
        log.info("dtype %s (%s)", str(self.dtype).removeprefix("torch."), why)
        self.kv_dtype, why = self.config.kv_dtype_choice(self.device, self.dtype)
        log.info("KV cache dtype %s (%s)", str(self.kv_dtype).removeprefix("torch."), why)
        self.model_name = source.name
        self.model_config = source.config
        self.tokenizer = source.tokenizer
        self.max_model_len = self.config.max_model_len or self.model_config.max_position_embeddings
        torch.manual_seed(self.config.seed)
        self.runner = self._new_runner(source)
        self.blocks = BlockManager(
            self.runner.num_blocks, self.config.block_size, self.config.enable_prefix_caching
        )
        self.scheduler = self._new_scheduler()
        self.sequences: dict[str, Sequence] = {}
        self.stop_checkers: dict[str, StopChecker] = {}
        self._ids = itertools.count()
        self.stats = EngineStats()
        self.step_costs = StepCosts()
        self._prompts_deferred_since: float | None = None  # prompts waiting for a worthwhile chunk

    @property
    def failure(self) -> str | None:
        """Why the engine cannot run steps any more (a tensor-parallel group that went
        down), or None while it can."""
        return getattr(self.runner, "failure", None)

    def close(self) -> None:
        """Stop the tensor-parallel ranks, if any (an engine of one process has none)."""
        close = getattr(self.runner, "close", None)
        if close is not None:
            close()

    def _new_runner(self, source):
        config = self.config
        if config.tensor_parallel_size > 1:
            from baton.engine.parallel.launcher import rank_cores
            from baton.engine.parallel.ray_launcher import launcher_for
            from baton.engine.parallel.runner import TensorParallelRunner

            size = config.tensor_parallel_size
            launcher = launcher_for(config.ray_address, size, len(rank_cores(config.cpu_cores, size, 1)),
                                    config.tensor_parallel_start_timeout_s, config.rank_placement)
            try:
                return TensorParallelRunner(config, source, self.device, self.dtype, launcher=launcher,
                                            host=getattr(launcher, "host", "127.0.0.1"), kv_dtype=self.kv_dtype)
            except BaseException:
                if launcher is not None:  # a group that never started gives its reservation back
                    launcher.close()
                raise
        return ModelRunner(self.config, self.model_config, source.tensors, self.device, self.dtype,
                           kv_dtype=self.kv_dtype)

    def regroup(self, tensor_parallel_size: int, num_kv_blocks: int) -> str:
        """Run on `tensor_parallel_size` ranks from now on (drained first), with a KV pool of
        `num_kv_blocks` per rank. The new group is built and loaded before the old one stops,
        so a failure leaves the engine as it was; the dtypes stay (peers hold KV in them).
        Rank 0 (this process) cuts its new slice from the weights it holds when they contain
        it, and reloads it from the checkpoint only when they do not; new ranks load theirs.
        Returns how rank 0 got its weights: "resliced" or "reloaded"."""
        self._require_drained("change the tensor-parallel size")
        config = dataclasses.replace(self.config, tensor_parallel_size=tensor_parallel_size, num_kv_blocks=num_kv_blocks)
        config.validate()
        source, weights, why = self._regroup_source(config)
        old_config, self.config = self.config, config
        try:
            runner = self._new_runner(source)
        except BaseException:
            self.config = old_config
            raise
        old, self.runner = self.runner, runner
        close = getattr(old, "close", None)
        if close is not None:
            close()
        log.info("regrouped on %d rank(s): %d KV blocks per rank; rank 0 %s its weights (%s)",
                 tensor_parallel_size, runner.num_blocks, weights, why)
        self._forget_requests()
        self.step_costs = StepCosts()  # the old group's step times say nothing of the new one's
        try:  # the group is in place: a failed measurement leaves its costs to its own steps
            log.info("step costs on %d rank(s): %s", tensor_parallel_size, calibrate(self))
        except Exception:
            log.exception("measuring the step costs of the new group failed")
        return weights

    def _forget_requests(self) -> None:
        """No sequences, an empty KV pool (no cached prefix) and a fresh scheduler, on the
        current runner (a regroup; calibration's made-up requests)."""
        self.blocks = BlockManager(self.runner.num_blocks, self.config.block_size, self.config.enable_prefix_caching)
        self.scheduler = self._new_scheduler()
        self.sequences.clear()
        self.stop_checkers.clear()
        self._prompts_deferred_since = None

    def _regroup_source(self, config: EngineConfig) -> tuple[ModelSource, str, str]:
        """Where rank 0's weights for `config`'s group come from: the source, "resliced" or
        "reloaded", and why in words."""
        from baton.engine.parallel.shards import shards_for, within
        from baton.engine.parallel.weight_shards import keeps_blocks

        full, local = self.model_config, getattr(self.runner, "local", self.runner)  # rank 0's ModelRunner
        held = local.shard or shards_for(full, 1)[0]
        wanted = shards_for(full, config.tensor_parallel_size)[0]
        quantized = local.quantization != "none"
        try:
            within(wanted, held)
        except ValueError as exc:
            why = f"the slice it held lacks part of the new one: {exc}"
        else:
            if not quantized or keeps_blocks(held, full.head_dim):
                tensors = model_tensors(local.model)
                source = ModelSource(full, self.tokenizer, tensors, self.model_name, quantized, held=held)
                return source, "resliced", "cut from the slice it held, no checkpoint read"
            why = "the slice it held had quantized blocks cut inside, so dequantized"
        return load_source(self.config.model, keep_quantized=config.keeps_quantized), "reloaded", why

    def _require_drained(self, action: str) -> None:
        busy = [s.request_id for s in self.sequences.values() if not s.is_finished]
        if busy:
            raise RuntimeError(f"cannot {action} with {len(busy)} requests in flight: drain first")

    def _new_scheduler(self) -> Scheduler:
        c = self.config
        return Scheduler(self.blocks, c.max_num_seqs, c.max_num_batched_tokens, c.chunk_size,
                         shortest_first=c.role == "prefill")

    # -- requests ----------------------------------------------------------------------
    def tokenize(self, prompt: Prompt) -> list[int]:
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt is empty")
            return self.tokenizer.encode(prompt)
        ids = list(prompt)
        if not ids:
            raise ValueError("prompt is empty")
        vocab = self.model_config.vocab_size
        bad = next((t for t in ids if not isinstance(t, int) or not 0 <= t < vocab), None)
        if bad is not None:
            raise ValueError(f"prompt token id {bad!r} is outside the vocabulary [0, {vocab})")
        return ids

    def _new_sequence(self, prompt: Prompt, params: SamplingParams, request_id: str | None,
                      skip_seeded_draws: bool = True) -> Sequence:
        """`skip_seeded_draws`: advance a seeded generator past `params.seed_offset` tokens
        (a handoff that brings the generator's state along skips that work)."""
        params.validate()
        ids = self.tokenize(prompt)
        if len(ids) >= self.max_model_len:
            raise ValueError(
                f"prompt has {len(ids)} tokens; the context limit is {self.max_model_len} "
                "(prompt plus at least one generated token)"
            )
        if -(-(len(ids) + 1) // self.config.block_size) > self.blocks.num_blocks:
            raise ValueError(f"prompt of {len(ids)} tokens does not fit this worker's KV cache")
        if params.seed_offset > len(ids):  # each skipped draw costs a vocabulary of noise
            raise ValueError(f"seed_offset {params.seed_offset} exceeds the prompt's {len(ids)} tokens "
                             "(it counts sampled tokens kept in the prompt)")
        request_id = request_id or f"req-{next(self._ids)}"
        if request_id in self.sequences:
            raise ValueError(f"request id {request_id!r} is already in use")
        seq = Sequence(request_id, ids, params)
        if skip_seeded_draws and seq.generator is not None and params.seed_offset and not params.greedy:
            skip_draws(seq.generator, params.seed_offset, self.model_config.vocab_size)
        return seq

    def _register(self, seq: Sequence) -> None:
        # the checker first: if it cannot be built, no half-registered sequence stays behind
        checker = StopChecker(self.tokenizer, seq, self.max_model_len)
        self.sequences[seq.request_id] = seq
        self.stop_checkers[seq.request_id] = checker

    def add_request(
        self,
        prompt: Prompt,
        params: SamplingParams | None = None,
        request_id: str | None = None,
        prefill_only: bool = False,
        arrival_time: float | None = None,
    ) -> str:
        """Queue a request. With `prefill_only` it stops after its first token and keeps its
        KV blocks (status HELD) until `release` — the prefill side of a handoff.
        `arrival_time`: when it reached the worker (time.monotonic()), where that was before
        this call: a server queues requests for the step loop, which takes them between steps."""
        seq = self._new_sequence(prompt, params or SamplingParams(), request_id)
        seq.prefill_only = prefill_only
        if arrival_time is not None:
            seq.arrival_time = min(arrival_time, seq.arrival_time)
        self._register(seq)
        self.scheduler.add(seq)
        return seq.request_id

    def abort(self, request_id: str) -> bool:
        seq = self.sequences.get(request_id)
        if seq is None or seq.is_finished:
            return False
        self.scheduler.remove(seq)
        self._finish(seq, "abort")
        return True

    def release(self, request_id: str) -> None:
        """Free a finished or held sequence's blocks (into the prefix cache) and forget it."""
        seq = self.sequences.pop(request_id, None)
        self.stop_checkers.pop(request_id, None)
        if seq is not None:
            if not seq.is_finished and seq.status != SequenceStatus.HELD:
                self.scheduler.remove(seq)
            self.blocks.free_sequence(seq)
            seq.status = SequenceStatus.FINISHED

    def _finish(self, seq: Sequence, reason: str) -> None:
        seq.finish_reason = reason
        if reason == "prefill":
            seq.status = SequenceStatus.HELD  # keep the KV for the decode worker
            return
        seq.status = SequenceStatus.FINISHED
        self.blocks.free_sequence(seq)

    # -- the step loop ------------------------------------------------------------------
    def has_unfinished(self) -> bool:
        return self.scheduler.has_work()

    def step(self, layer_hook=None) -> list[RequestOutput]:
        """Schedule, run and sample one step; report every request that progressed.

        A failure is charged to the sequences that cause it: the batch is re-run one
        sequence at a time, those that fail alone end with the error, the others go on."""
        cap = self._prefill_cap()
        batch = self.scheduler.schedule(cap, self._admission_cap())
        if cap == 0 and self._prompts_deferred_since is None:
            self._prompts_deferred_since = time.monotonic()
        elif batch.prefills:
            self._prompts_deferred_since = None
        outputs = []
        for seq in batch.out_of_kv:
            self._finish(seq, "length")
            outputs.append(self._output(seq, [], ""))
        if not (batch.prefills or batch.decodes):
            return outputs
        work = sum(attention_work(seq.num_computed_tokens, n) for seq, n in batch.prefills)  # before they advance
        started, cpu_started = time.perf_counter(), time.process_time()
        try:
            sampled = self._run(batch, layer_hook)
        except Exception as exc:
            sampled = self._run_one_by_one(batch, layer_hook, exc, outputs)
        seconds = time.perf_counter() - started
        self.stats.record_step(batch, seconds, off_cpu_seconds(seconds, time.process_time() - cpu_started))
        self.step_costs.observe(len(batch.decodes), batch.num_tokens - len(batch.decodes), seconds, work)
        now = time.monotonic()
        for seq, result in sampled:
            try:
                outputs.append(self._append_token(seq, result, now))
            except Exception as exc:
                outputs.append(self._fail(seq, exc))
        return outputs

    def _prefill_cap(self) -> int | None:
        """Prompt tokens the next step may carry (None: no cap); see step_budget.py."""
        decoding, objective = self.scheduler.decoding(), self.config.tpot_objective_s
        wanted = sum(seq.num_uncomputed_tokens for seq in self.scheduler.waiting)
        wanted += sum(seq.num_uncomputed_tokens for seq in self.scheduler.running if seq.in_prefill)
        if not wanted or not objective:
            self._prompts_deferred_since = None
            return None
        if not decoding:
            self._prompts_deferred_since = None
            return None  # no decodes to protect (a prefill worker's batches: _admission_cap)
        now = time.monotonic()
        paces = [(seq.num_completion_tokens - seq.paced_from[1], now - seq.paced_from[0])
                 for seq in decoding if seq.paced_from is not None]
        deferred = now - self._prompts_deferred_since if self._prompts_deferred_since is not None else 0.0
        bank = self.config.bank_objectives
        if self.config.bank_follows_decodes:
            bank = colocated_bank(self.step_costs.decode_step_s(len(decoding)), objective, bank)
        # the next chunk is the first running prompt's (the scheduler's order), else a new one's
        head = next((seq for seq in self.scheduler.running if seq.in_prefill), None)
        start = head.num_computed_tokens if head is not None else 0
        return prefill_token_budget(objective, len(decoding), self.step_costs, self.config.max_num_batched_tokens,
                                    allowance_s=step_allowance_s(objective, paces, bank), wanted=wanted,
                                    deferred_s=deferred, bank=bank, context_start=start,
                                    tiles=self.runner.row_tiles,
                                    finishing=head.num_uncomputed_tokens if head is not None else None)

    def _admission_cap(self) -> int | None:
        """Prompt tokens a prefill worker's step may carry, its first prompt's whatever their
        number (None: no limit). It hands every prompt off at its step's end, so prompts that share a step
        get their first tokens together: they do only where sharing the step's fixed cost
        gains more than waiting for each other costs (step_budget.prompt_batch_tokens). Its
        scheduler takes the prompt with the fewest tokens left first (scheduler.py), so a
        short prompt neither waits behind a long one's chunks nor rides beside them. Prompts
        that decode where they prefill join the batch together (a colocated worker)."""
        if self.config.role != "prefill" or not self.config.tpot_objective_s or self.scheduler.decoding():
            return None
        return prompt_batch_tokens(self.step_costs, self.scheduler.max_num_batched_tokens)

    def _run(self, batch: ScheduledBatch, layer_hook) -> list[tuple[Sequence, SampleResult]]:
        """Run and sample a batch; a sequence's state changes only once both succeeded, so a
        failed run can be retried."""
        sampling, logits = self.runner.run(batch, layer_hook or _listener_hook(batch))
        generators = [s.generator for s in sampling]
        # a seeded stream must not lose a draw to a retry: put the generators back on failure
        saved = [(g, g.get_state()) for g in generators if g is not None]
        try:
            results = sample(logits, [s.params for s in sampling], generators)
        except Exception:
            for g, state in saved:
                g.set_state(state)
            raise
        for seq, n in batch.prefills:
            seq.num_computed_tokens += n
            self.blocks.register_full_blocks(seq)
        for seq in batch.decodes:
            seq.num_computed_tokens += 1
            self.blocks.register_full_blocks(seq)
        return list(zip(sampling, results))

    def _run_one_by_one(self, batch: ScheduledBatch, layer_hook, error: Exception,
                        outputs: list[RequestOutput]) -> list[tuple[Sequence, SampleResult]]:
        seqs = [seq for seq, _ in batch.prefills] + batch.decodes
        if len(seqs) == 1:
            outputs.append(self._fail(seqs[0], error))
            return []
        log.warning("a step of %d sequences failed (%r); running them one by one", len(seqs), error)
        parts = [ScheduledBatch(prefills=[p]) for p in batch.prefills]
        parts += [ScheduledBatch(decodes=[d]) for d in batch.decodes]
        sampled = []
        for seq, part in zip(seqs, parts):
            try:
                sampled += self._run(part, layer_hook)
            except Exception as exc:
                outputs.append(self._fail(seq, exc))
        return sampled

    def _fail(self, seq: Sequence, error: Exception) -> RequestOutput:
        """End one sequence because of an error; its output carries the message."""
        log.error("request %s failed in an engine step: %r", seq.request_id, error)
        self.scheduler.remove(seq)
        self._finish(seq, "abort")
        out = self._output(seq, [], "")
        out.error = f"engine step failed: {type(error).__name__}: {error}"
        return out

    def _append_token(self, seq: Sequence, result, now: float) -> RequestOutput:
        seq.token_ids.append(result.token_id)
        if seq.first_token_time is None:
            seq.first_token_time = now
        if seq.paced_from is None:
            seq.paced_from = (now, seq.num_completion_tokens)
        if result.logprob is not None:
            seq.logprobs.append({"token_id": result.token_id, "logprob": result.logprob,
                                 "top_logprobs": result.top_logprobs or {}})
        checker = self.stop_checkers[seq.request_id]
        new_text, reason = checker.add(result.token_id)
        if reason is None and seq.prefill_only:
            reason = "prefill"
        if reason is not None:
            self.scheduler.remove(seq)
            self._finish(seq, reason)
        return self._output(seq, [result.token_id], new_text)

    def _output(self, seq: Sequence, new_ids: list[int], new_text: str) -> RequestOutput:
        finished = seq.status in (SequenceStatus.FINISHED, SequenceStatus.HELD)
        return RequestOutput(
            request_id=seq.request_id,
            prompt_token_ids=seq.token_ids[: seq.num_prompt_tokens],
            token_ids=seq.completion_token_ids,
            text=self.stop_checkers[seq.request_id].text,
            finished=finished,
            finish_reason=seq.finish_reason,
            num_cached_tokens=seq.num_cached_tokens,
            new_token_ids=new_ids,
            new_text=new_text,
            logprobs=list(seq.logprobs),
            arrival_time=seq.arrival_time,
            first_token_time=seq.first_token_time,
        )

    def reconfigure(self, role: str | None = None, num_kv_blocks: int | None = None,
                    max_num_batched_tokens: int | None = None, chunk_size: int | None = None) -> None:
        """Reshard for a new role without reloading weights. The worker must be drained."""
        self._require_drained("reconfigure")
        updates = {"role": role, "num_kv_blocks": num_kv_blocks,
                   "max_num_batched_tokens": max_num_batched_tokens, "chunk_size": chunk_size}
        for key, value in updates.items():
            if value is not None:
                setattr(self.config, key, value)
        self.config.validate()
        if num_kv_blocks is not None and num_kv_blocks != self.runner.num_blocks:
            self.runner.resize_kv_cache(num_kv_blocks)
            self.blocks = BlockManager(num_kv_blocks, self.config.block_size, self.config.enable_prefix_caching)
        self.scheduler = self._new_scheduler()
        self.sequences.clear()
        self.stop_checkers.clear()

    # -- offline API ---------------------------------------------------------------------
    def generate(
        self,
        prompts: Prompt | Seq[Prompt],
        params: SamplingParams | Seq[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        """Run prompts to completion and return their outputs in order."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        params_list = params if isinstance(params, list | tuple) else [params or SamplingParams()] * len(prompts)
        if len(params_list) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(params_list)} sampling params")
        ids = [self.add_request(p, sp) for p, sp in zip(prompts, params_list)]
        final: dict[str, RequestOutput] = {}
        while len(final) < len(ids):
            outputs = self.step()
            if not outputs and not self.scheduler.running:
                raise RuntimeError("engine made no progress: the waiting requests cannot be scheduled")
            for out in outputs:
                if out.finished:
                    final[out.request_id] = out
        for rid in ids:
            self.release(rid)
        return [final[rid] for rid in ids]


def _listener_hook(batch):
    """One hook calling every prefill sequence's layer listener (the KV streamers)."""
    # a prompt whose last chunk is a single token runs in the decode part of the step
    chunks = [*batch.prefills, *((seq, 1) for seq in batch.decodes)]
    listeners = [
        (seq.layer_listener, seq.num_computed_tokens, seq.num_computed_tokens + n)
        for seq, n in chunks
        if seq.layer_listener is not None
    ]
    if not listeners:
        return None

    def hook(layer, k_cache, v_cache):
        for listener, start, end in listeners:
            listener(layer, k_cache, v_cache, start, end)

    return hook
