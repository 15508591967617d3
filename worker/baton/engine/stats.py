"""What the engine counts for the worker's metrics: cumulative counters, and each step's
shape and time since the metrics last looked."""

from __future__ import annotations

from collections import deque
from typing import NamedTuple

STEP_KINDS = ("decode", "mixed", "prompt")  # decodes only; decodes beside prompt tokens; prompt tokens only
RECENT_STEPS = 4096  # steps kept for a reader that has not looked (the oldest go first)


class StepRecord(NamedTuple):
    decodes: int
    prompt_tokens: int
    seconds: float
    # the step's wall time less the worker process's CPU time in it: time its core ran
    # something else (another process, the hypervisor, a CPU quota's throttling)
    off_cpu_seconds: float = 0.0

    @property
    def kind(self) -> str:
        if not self.prompt_tokens:
            return "decode"
        return "mixed" if self.decodes else "prompt"


def off_cpu_seconds(wall_seconds: float, cpu_seconds: float) -> float:
    """Time within a step that no thread of the process ran. Exact for a worker on one core
    (its own threads' CPU time, its event loop's too, is part of the wall time); where threads
    run side by side their CPU time can pass the wall time, and this reads 0."""
    return max(0.0, wall_seconds - cpu_seconds)


class EngineStats:
    """Counters the worker exports as metrics."""

    def __init__(self):
        self.steps = 0
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.prefill_seconds = 0.0
        self.decode_seconds = 0.0
        # each step on its own: a decode riding in a step waits that step's time for its next
        # token, so the per-step objective is seen in these, not in averages (baton_step_seconds)
        self._recent: deque[StepRecord] = deque(maxlen=RECENT_STEPS)

    def record_step(self, batch, seconds: float, off_cpu: float = 0.0) -> None:
        """`off_cpu`: the step's time off the CPU (off_cpu_seconds; 0 where not measured)."""
        self.steps += 1
        prompt = sum(n for _, n in batch.prefills)
        self.prompt_tokens += prompt
        self.generation_tokens += len(batch.decodes)
        if prompt:
            self.prefill_seconds += seconds
        else:
            self.decode_seconds += seconds
        self._recent.append(StepRecord(len(batch.decodes), prompt, seconds, off_cpu))

    def take_steps(self) -> list[StepRecord]:
        """The steps recorded since the last call, oldest first."""
        steps = list(self._recent)
        self._recent.clear()
        return steps
