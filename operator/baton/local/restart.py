"""When `baton up` restarts a server process that exited (pure).

Kubernetes' restartPolicy Always, scaled to one machine: the kubelet waits 10 s, doubles the
wait after each crash up to 5 minutes, and forgets the crashes once a container has run for
10 minutes. Here the first wait is 1 s (a worker that dies is back serving within a
minute: the wait plus loading the model), the cap 30 s (a crash loop costs little), and a
process that ran for a minute starts a fresh streak.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Backoff:
    initial_s: float = 1.0  # wait before the first restart of a streak
    factor: float = 2.0  # each further crash in a row multiplies the wait
    cap_s: float = 30.0  # longest wait
    healthy_after_s: float = 60.0  # a run this long ends the streak: the next crash waits initial_s

    def __post_init__(self) -> None:
        if self.initial_s < 0 or self.factor < 1 or self.cap_s < self.initial_s or self.healthy_after_s < 0:
            raise ValueError("backoff needs 0 <= initial_s <= cap_s, factor >= 1 and healthy_after_s >= 0")


def crash_streak(previous_streak: int, ran_for_s: float, backoff: Backoff) -> int:
    """Crashes in a row, counting the one that just happened after `ran_for_s` seconds up."""
    return 1 if ran_for_s >= backoff.healthy_after_s else previous_streak + 1


def restart_delay(streak: int, backoff: Backoff) -> float:
    """Seconds to wait before restarting a process whose streak of crashes is `streak`."""
    if streak < 1:
        raise ValueError(f"streak counts the crash that just happened: at least 1, got {streak}")
    delay = backoff.initial_s
    for _ in range(streak - 1):  # a loop, not a power: a long streak must not overflow
        delay = min(backoff.cap_s, delay * backoff.factor)
        if delay >= backoff.cap_s:
            break
    return min(delay, backoff.cap_s)
