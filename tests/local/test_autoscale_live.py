"""System test: `baton up --prefill 1 --decode 2 --autoscale` converts roles as the traffic shifts.

Real processes and sockets: the stack runs as a `baton up` subprocess, the traffic comes from
the load generator's runner (`baton bench`'s), roles are read from the workers' own
/metrics, and the decisions from the controller's /decisions. Phase 1 sends long prompts with
short outputs (the single prefill worker saturates: a decode worker must become prefill);
phase 2 short prompts with long outputs (the prefill pool idles, the lone decode worker
carries every stream: it must convert back). No request may fail in either phase.

"Within 3 periods of the shift being measurable": the shift is measurable from the first
decision whose measuring window lies wholly in the new phase and which measured every input
itself (the lengths come from finished requests, so a long-output phase measures nothing
until its first requests finish; until then they are unknown, or carried from an earlier
window). The conversion decision must come at most 3 periods after that.
"""

from __future__ import annotations

import asyncio
import json
import math
import re
import threading
import time
from dataclasses import asdict

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from stack_harness import UpProcess

from baton.loadgen import datasets, runner
from baton.loadgen.stats import summarize
from tests.server.workers import TOKEN, WorkerApi

pytestmark = pytest.mark.slow

PERIOD_S = 5.0
WINDOW_S = 3 * PERIOD_S
MAX_PERIODS = 3
ARGS = ["--prefill", "1", "--decode", "2", "--port", "0", "--autoscale",
        "--autoscale-period", str(PERIOD_S), "--autoscale-window", str(WINDOW_S),
        "--autoscale-cooldown", str(2 * PERIOD_S),
        # objectives three workers on 2 busy cores can meet: a decode step takes 0.2-0.7 s here
        "--slo", "ttft=30s,tpot=2s",
        # a fixed split of the traffic: long prompts go to the prefill pool, short ones
        # prefill where they decode, whatever the router measures along the way
        "--disagg-threshold", "256", "--worker-arg=--num-kv-blocks=512"]
INPUTS = ("arrival_rate", "input_len", "output_len", "hit_rate", "prefill_supply",
          "step_intercept_s", "step_per_seq_s", "kv_capacity_tokens", "unreachable_workers")


class Load:
    """A closed loop of the load generator on its own thread, until `finish()`."""

    def __init__(self, url: str, model: str, specs: list[datasets.RequestSpec], concurrency: int):
        self.url, self.model, self.specs, self.concurrency = url, model, specs, concurrency
        self.stop = threading.Event()
        self.records: list = []
        self.error: BaseException | None = None
        self.started = time.time()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        async def main():
            target = runner.Target(self.url, self.model, timeout_s=180)
            try:
                return await runner.run_closed_loop(target, self.specs, self.concurrency, lambda r: None,
                                                    until=self.stop.is_set)
            finally:
                await target.close()
        try:
            self.records = asyncio.run(main())
        except BaseException as error:  # reported by finish()
            self.error = error

    def finish(self, timeout_s: float = 120.0) -> dict:
        """Stop sending, wait for the requests in flight; the bench's result (with per-request records)."""
        self.stop.set()
        self._thread.join(timeout_s)
        assert not self._thread.is_alive(), "requests in flight did not finish"
        assert self.error is None, repr(self.error)
        return {"summary": summarize(self.records, time.time() - self.started),
                "requests": [{**asdict(r), "tpot": r.tpot} for r in self.records]}


def worker_urls(up: UpProcess) -> list[str]:
    line = re.search(r"Baton is up: .*\(workers: ([^;]+);", up.out_path.read_text()).group(1)
    return [part.split("@", 1)[1] for part in line.split(", ")]


def controller_url(up: UpProcess) -> str:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        found = re.search(r"Autoscaler: (http://\S+)", up.out_path.read_text())
        if found:
            return found.group(1)
        time.sleep(0.5)
    raise AssertionError(f"no controller address:\n{up.output()}")


def worker_roles(urls: list[str]) -> list[str]:
    """Each worker's role as the worker itself reports it (baton_worker_role == 1)."""
    roles = []
    for url in urls:
        text = httpx.get(f"{url}/metrics", timeout=10).text
        current = [s.labels["role"] for f in text_string_to_metric_families(text)
                   for s in f.samples if s.name == "baton_worker_role" and s.value == 1]
        roles.append(current[0] if current else "unknown")
    return roles


def decisions(ctl: str) -> list[dict]:
    return httpx.get(f"{ctl}/decisions", timeout=10).json()["decisions"]


def decision_lines(ctl: str) -> str:
    """The controller's decisions so far, a line each: what a failure shows."""
    return "\n".join(f"{d['period']} {d['action']}: {d['explanation']}" for d in decisions(ctl))


def wait_for_roles(up: UpProcess, urls: list[str], ctl: str, prefill: int, timeout_s: float) -> float:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        roles = worker_roles(urls)
        if roles.count("prefill") == prefill and roles.count("decode") == len(urls) - prefill:
            return time.time()
        time.sleep(1.0)
    raise AssertionError(f"roles {worker_roles(urls)} after {timeout_s:.0f}s, wanted {prefill} prefill\n"
                         f"{decision_lines(ctl)}\n{up.output()}")


def assert_pool_sizes(urls: list[str], sizes: dict[str, int]) -> None:
    """Every worker runs its pool's tensor-parallel size (a converted one regrouped)."""
    for url, role in zip(urls, worker_roles(urls), strict=True):
        state = WorkerApi(url).state()
        assert state["tensor_parallel_size"] == sizes[role], (url, role, state)


def periods_to_convert(records: list[dict], shift_at: float, action: str) -> tuple[dict, int]:
    """The conversion after `shift_at` and how many periods it came after the shift was measurable."""
    after = [d for d in records if d["unix_time"] > shift_at]
    conversion = next((d for d in after if d["action"] == action), None)
    assert conversion is not None, f"no {action} after the shift: {[d['action'] for d in after]}"
    assert conversion["applied"] and not conversion["error"], conversion
    measurable = next(d for d in after if d is conversion or (
        d["unix_time"] >= shift_at + WINDOW_S and "unknown inputs" not in d["explanation"]
        and "carried from" not in d["explanation"]))
    return conversion, conversion["period"] - measurable["period"] + 1


def assert_names_its_inputs(record: dict) -> None:
    """The explanation names inputs, with the values the decision was taken on."""
    text, inputs = record["explanation"], record["inputs"]
    unknown = re.search(r"unknown inputs \(([^)]*)\)", text)
    if unknown:
        named = unknown.group(1).split(", ")
        assert named and all(n in INPUTS and n not in inputs for n in named), record
        return
    pairs = re.findall(r"(\w+) [-+.\de]+->([-+.\de]+)", text) + re.findall(r"(\w+)=([-+.\de]+)", text)
    assert pairs, f"names no input: {text}"
    for name, value in pairs:
        assert name in INPUTS, text
        assert float(value) == pytest.approx(inputs[name], rel=0.01, abs=1e-3), (name, value, inputs)
    if "did not answer" in text:  # a worker missed a period: nothing to size
        return
    assert re.search(r"prefill at [\d.]+ and decode at ([\d.]+|inf|nan) of capacity", text), text


def assert_pressured_pool(conversion: dict, grown: str) -> None:
    """The pool a conversion grows was measured busier than the pool it shrinks.

    A pool that cannot meet its objective at any size (a decode step slower than the TPOT
    objective, as on a slow or crowded CPU) has no finite utilisation, and /decisions leaves
    it out: then there is nothing to compare with.

    Decode concurrency counts a request from its arrival (Little's law over TTFT + its
    output): its KV is reserved on a decode worker while its prompt waits on the prefill pool.
    Where that wait is most of it, a prefill-bound fleet shows a busy decode pool too (a Zen 4
    machine: prefill at 0.96, decode at 1.02, 11.7 of 11.7 requests there waiting on a
    predicted 23 s TTFT); then the conversion must shorten the predicted TTFT instead.
    """
    shrunk = {"prefill": "decode", "decode": "prefill"}[grown]
    outputs = conversion["outputs"]
    assert f"{grown}_utilisation" in outputs, conversion
    waiting_on_prefill = conversion["inputs"]["arrival_rate"] * outputs.get("predicted_ttft_s", 0.0)
    if grown == "prefill" and waiting_on_prefill > 0.5 * outputs.get("concurrency", math.inf):
        assert outputs["desired_ttft_s"] < outputs["predicted_ttft_s"], conversion
    elif f"{shrunk}_utilisation" in outputs:
        assert outputs[f"{grown}_utilisation"] > outputs[f"{shrunk}_utilisation"], conversion


# prefill TP=3 (SmolLM2's 9 query heads split in three): both conversions change a worker's
# tensor-parallel size, 1 -> 3 ranks and back, under the same traffic. Heavy: five to seven
# processes on two cores make it ~2 minutes (`make test-tp`).
@pytest.mark.parametrize("prefill_tp", [1, pytest.param(3, marks=pytest.mark.heavy)])
def test_traffic_shifts_convert_a_worker_and_back(tmp_path, prefill_tp):
    up = UpProcess([*ARGS, "--prefill-tp", str(prefill_tp)], tmp_path, env={"BATON_INTERNAL_TOKEN": TOKEN})
    loads: list[Load] = []
    try:
        url = up.wait_up()
        urls, ctl = worker_urls(up), controller_url(up)
        assert worker_roles(urls) == ["prefill", "decode", "decode"]
        model = asyncio.run(runner.resolve_model(url))

        # Phase 1: long prompts, short outputs, enough in flight to keep one prefill worker busy.
        long_specs = datasets.random_dataset(2000, 1200, 6, seed=1, range_ratio=0.1)
        loads.append(Load(url, model, long_specs, concurrency=3))
        shift1 = loads[0].started
        converted1 = wait_for_roles(up, urls, ctl, prefill=2, timeout_s=WINDOW_S + 10 * PERIOD_S)
        assert_pool_sizes(urls, {"prefill": prefill_tp, "decode": 1})
        time.sleep(PERIOD_S)  # traffic keeps flowing over the new split
        phase1 = loads[0].finish()
        # the split phase 1 asked for still stands: phase 2 must be what converts it back
        assert worker_roles(urls).count("prefill") == 2, decision_lines(ctl)

        # Phase 2: short prompts, long outputs, many streams.
        short_specs = datasets.random_dataset(2000, 48, 96, seed=2, range_ratio=0.5)
        loads.append(Load(url, model, short_specs, concurrency=8))
        shift2 = loads[1].started
        converted2 = wait_for_roles(up, urls, ctl, prefill=1, timeout_s=60 + WINDOW_S + 10 * PERIOD_S)
        assert_pool_sizes(urls, {"prefill": prefill_tp, "decode": 1})
        time.sleep(PERIOD_S)
        phase2 = loads[1].finish(timeout_s=150)

        records = decisions(ctl)
        controller_metrics = httpx.get(f"{ctl}/metrics", timeout=10).text
    finally:
        for load in loads:
            load.stop.set()
        up.stop()
    for name, result in (("phase1", phase1), ("phase2", phase2)):
        (tmp_path / f"{name}.json").write_text(json.dumps(result))
    (tmp_path / "decisions.json").write_text(json.dumps(records, indent=1))

    to_prefill, periods1 = periods_to_convert(records, shift1, "convert-decode-to-prefill")
    to_decode, periods2 = periods_to_convert(records, shift2, "convert-prefill-to-decode")
    print(f"\nphase 1: {phase1['summary']['requests']} requests, {phase1['summary']['failed']} failed; "
          f"decode->prefill decided {periods1} period(s) after measurable, roles changed "
          f"{converted1 - shift1:.0f}s after the shift\nphase 2: {phase2['summary']['requests']} requests, "
          f"{phase2['summary']['failed']} failed; prefill->decode decided {periods2} period(s) after "
          f"measurable, roles changed {converted2 - shift2:.0f}s after the shift")
    for name, d in (("decode->prefill", to_prefill), ("prefill->decode", to_decode)):
        load = {pool: d["outputs"].get(f"{pool}_utilisation", float("inf")) for pool in ("prefill", "decode")}
        print(f"{name} measured input_len={d['inputs']['input_len']:.0f} output_len="
              f"{d['inputs']['output_len']:.1f}, prefill at {load['prefill']:.2f}, decode at {load['decode']:.2f}")
    assert periods1 <= MAX_PERIODS, to_prefill
    assert periods2 <= MAX_PERIODS, to_decode
    for result in (phase1, phase2):
        failed = [r for r in result["requests"] if not r["success"]]
        assert result["requests"] and not failed, failed[:3]
    for record in records:
        assert_names_its_inputs(record)
    # The conversions were driven by the traffic: long prompts first, long outputs second.
    assert to_prefill["inputs"]["input_len"] > 500 and to_prefill["outputs"]["prefill_utilisation"] > 0.5
    assert_pressured_pool(to_prefill, "prefill")
    assert_pressured_pool(to_decode, "decode")
    # The second is decided on a window that may still hold phase 1's long prompts (longer on a
    # slower CPU, which finishes them later): compare what the two decisions measured, not the
    # phases' nominal lengths. The traffic measured had shorter prompts and more output per prompt.
    first, second = to_prefill["inputs"], to_decode["inputs"]
    assert second["input_len"] < first["input_len"]
    assert second["output_len"] / second["input_len"] > first["output_len"] / first["input_len"]
    counts = {s.labels["action"]: s.value for f in text_string_to_metric_families(controller_metrics)
              for s in f.samples if s.name == "baton_autoscaler_decisions_total"}
    assert counts["convert-decode-to-prefill"] >= 1 and counts["convert-prefill-to-decode"] >= 1
    assert sum(counts.values()) >= len(records)
    assert "autoscaler period" in up.out_path.read_text()
