"""`baton bench` statistics and datasets (pure)."""

from __future__ import annotations

import pytest

from baton.loadgen.datasets import (
    interference_longs,
    multi_turn_dataset,
    random_dataset,
    shared_prefix_dataset,
)
from baton.loadgen.records import records_from_json
from baton.loadgen.stats import RequestRecord, Slo, parse_slo, percentile, summarize
from baton.loadgen.timeline import plot_timeline


def record(i, ttft, e2e, tokens, kind="short", ok=True):
    step = (e2e - ttft) / max(tokens - 1, 1)
    return RequestRecord(index=i, kind=kind, prompt_len=10, start=float(i), success=ok, ttft=ttft,
                         e2e=e2e, output_tokens=tokens,
                         chunk_times=[ttft + k * step for k in range(tokens)] if ok else [])


def test_vllm_definitions():
    records = [record(0, 0.1, 1.1, 11), record(1, 0.3, 0.3, 1), record(2, 0, 0, 0, ok=False)]
    s = summarize(records, duration_s=2.0, slo=parse_slo("ttft=200ms,tpot=150ms"))
    assert (s["completed"], s["failed"]) == (2, 1)
    assert s["tpot"]["median_ms"] == pytest.approx(100.0)  # (1.1 - 0.1) / 10; 1-token requests have none
    assert s["itl"]["p99_ms"] == pytest.approx(100.0)
    assert s["ttft"]["p50_ms"] == pytest.approx(200.0)
    assert s["goodput"] == pytest.approx(0.5)  # only request 0 met both SLOs, over 2 s
    assert s["output_throughput"] == pytest.approx(6.0)


def test_percentile_and_slo_parsing():
    assert percentile([1.0, 2.0, 3.0, 4.0], 50) == 2.5
    assert percentile([5.0], 99) == 5.0
    assert parse_slo("ttft=2s,tpot=100ms") == Slo(ttft=2.0, tpot=0.1)
    with pytest.raises(ValueError):
        parse_slo("latency=1s")


def test_datasets_are_exact_and_repeatable():
    a = random_dataset(5, 64, 16, seed=3)
    assert a == random_dataset(5, 64, 16, seed=3) and all(len(r.prompt) == 64 for r in a)
    shared = shared_prefix_dataset(6, prefix_len=32, suffix_len=8, output_len=4, num_prefixes=2)
    assert shared[0].prompt[:32] == shared[2].prompt[:32] != shared[1].prompt[:32]
    longs = interference_longs(duration_s=10, every_s=3, input_len=100, output_len=4, first_at_s=1)
    assert [r.at for r in longs] == [1, 4, 7] and all(r.kind == "long" for r in longs)


def test_a_sessions_turns_each_extend_the_last_turns_prompt():
    sessions = multi_turn_dataset(3, turns=4, system_len=32, user_len=8, reply_len=5, output_len=5, seed=1)
    assert sessions == multi_turn_dataset(3, turns=4, system_len=32, user_len=8, reply_len=5, output_len=5, seed=1)
    assert len(sessions) == 3 and all(len(turns) == 4 for turns in sessions)
    for turns in sessions:
        assert [len(t.prompt) for t in turns] == [40, 53, 66, 79]  # + the stand-in reply and a new message
        assert [t.kind for t in turns] == ["first", "follow-up", "follow-up", "follow-up"]
        for earlier, later in zip(turns, turns[1:]):
            assert later.prompt[: len(earlier.prompt)] == earlier.prompt
    firsts = [turns[0].prompt for turns in sessions]
    assert firsts[0][:32] == firsts[1][:32] and firsts[0][32:] != firsts[1][32:]  # one system prompt


def test_timeline_png(tmp_path):
    records = [record(0, 0.1, 1.0, 5), record(1, 0.5, 2.0, 3, kind="long")]
    result = {"requests": [{**r.__dict__, "tpot": r.tpot} for r in records]}
    path = tmp_path / "timeline.png"
    plot_timeline(records_from_json(result), str(path))
    assert path.read_bytes()[:4] == b"\x89PNG"
