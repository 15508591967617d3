"""KV handoff benchmark: real prefill and decode worker processes on this host.

For 512, 2,048 and 4,096-token prompts (fresh random tokens each run, so no prefix-cache
hits) it measures, per run: KV bytes moved, prefill time, transfer time (first layer sent
to ACK), wire time (the sender's time on the wire), exposed transfer (ACK minus end of
prefill, i.e. what the handoff adds to TTFT), and a back-to-back handoff of the same
bytes: this process plays the prefill side with the very code a prefill worker runs
(LayerStreamer, the transport's sender), fed every layer at once from a KV snapshot, into
the real decode worker (receiver, checksums, writes into reserved blocks, ACK); the time
runs from the sender's start, with every layer queued, to the ACK. That is the handoff
path without compute pacing it, so effective bandwidth = bytes / that time, compared with
raw loopback socket copies of the same bytes (bench/raw_loopback.py) measured in the same
run: one like for like (a process on the prefill side's core copies a source of that size
into a long-lived process on the decode worker's core, into a destination of that size;
two copies right after each back-to-back handoff, so each pair sees the same machine) and
the socket path's best case (4 MB chunks between cache-resident buffers). A migration between two decode workers is
timed too (informational: a different sender path).

Targets: effective bandwidth ≥ 0.7 × raw; exposed ≤ 2 × (transfer ÷ layers) + 5 ms.

    .venv/bin/python bench/kv.py [--repeats 3] [--bulk-repeats 7] [--out bench/results/kv.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).parent))
from machine_info import machine_record  # noqa: E402
from raw_loopback import PlacedCopier, raw_copy_gbps  # noqa: E402

TOKEN = "bench-kv-token"
HEADERS = {"Authorization": f"Bearer {TOKEN}"}
LENGTHS = (512, 2048, 4096)
VOCAB_RANGE = (300, 40000)  # ordinary tokens, away from special ids


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Worker:
    def __init__(self, name: str, role: str, core: int, args: list[str]):
        self.name, self.port = name, free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = open(Path(tempfile.gettempdir()) / f"bench-kv-{name}.log", "wb")
        cmd = [sys.executable, "-m", "baton.cli", "worker", "--role", role, "--port", str(self.port),
               "--kv-port", "0", "--worker-id", name, "--cpu-core", str(core), "--threads", "1",
               "--log-level", "warning", *args]
        env = {**os.environ, "BATON_INTERNAL_TOKEN": TOKEN}
        self.proc = subprocess.Popen(cmd, env=env, stdout=self.log, stderr=subprocess.STDOUT)

    def wait_ready(self, deadline: float) -> None:
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited ({self.proc.returncode}); see {self.log.name}")
            try:
                if httpx.get(self.url + "/ready", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.3)
        raise TimeoutError(f"{self.name} not ready")

    def post(self, path: str, body: dict, timeout: float = 300) -> dict:
        reply = httpx.post(self.url + path, json=body, headers=HEADERS, timeout=timeout)
        if reply.status_code != 200:
            raise RuntimeError(f"{self.name}{path}: {reply.status_code} {reply.text}")
        return reply.json()

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(15)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self.log.close()


class StreamReader:
    """Reads a request's token stream on a decode worker in the background.

    Construction returns once the stream is open (response headers in): opening it builds
    an HTTP client and connects, several ms of CPU that would otherwise run during the timed
    handoff, on the very core the sender is pinned to."""

    def __init__(self, worker: Worker, rid: str, on_tokens=None, open_timeout: float = 30):
        self.tokens: list[int] = []
        self.errors: list = []
        self._on_tokens = on_tokens
        self._open = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(worker, rid), daemon=True)
        self._thread.start()
        if not self._open.wait(open_timeout):
            raise TimeoutError(f"stream of {rid} on {worker.name} did not open within {open_timeout}s")

    def _run(self, worker: Worker, rid: str) -> None:
        try:
            self._read(worker, rid)
        except Exception as exc:
            self.errors.append(f"reading the stream failed: {exc}")
        finally:
            self._open.set()  # a stream that failed to open must not hold the caller

    def _read(self, worker: Worker, rid: str) -> None:
        with httpx.stream("GET", f"{worker.url}/internal/stream/{rid}", headers=HEADERS, timeout=600) as resp:
            self._open.set()
            for line in resp.iter_lines():
                if not line.startswith("data:") or line[5:].strip() == "[DONE]":
                    continue
                event = json.loads(line[5:])
                if "error" in event:
                    self.errors.append(event["error"])
                else:
                    self.tokens += event["token_ids"]
                    if self._on_tokens:
                        self._on_tokens(self.tokens)

    def join(self, timeout: float = 600) -> None:
        self._thread.join(timeout)


def handoff_once(prefill: Worker, decode: Worker, length: int, rng: random.Random, rid: str) -> dict:
    ids = [rng.randrange(*VOCAB_RANGE) for _ in range(length)]
    params = {"max_tokens": 1, "ignore_eos": True}
    ticket = decode.post("/internal/reserve", {"request_id": rid, "prompt_token_ids": ids,
                                               "params": params, "ttl_s": 600})["ticket"]
    reader = StreamReader(decode, rid)
    reply = prefill.post("/internal/prefill", {"request_id": rid, "prompt_token_ids": ids,
                                               "params": params, "ticket": ticket, "timeout_s": 600})
    reader.join()
    if reader.errors or reader.tokens != [reply["first_token"]]:
        raise RuntimeError(f"decode stream of {rid}: {reader.errors or reader.tokens}")
    return reply["transfer"]


def bulk_once(prefill: Worker, source: Worker, target: Worker, length: int, rng: random.Random, rid: str) -> dict:
    """Hand a prompt to `source`, then migrate the decoding sequence to `target`: every
    layer of its KV is ready, so this transfer runs back to back at the transport's pace."""
    ids = [rng.randrange(*VOCAB_RANGE) for _ in range(length)]
    params = {"max_tokens": 400, "ignore_eos": True}
    ticket = source.post("/internal/reserve", {"request_id": rid, "prompt_token_ids": ids,
                                               "params": params, "ttl_s": 600})["ticket"]
    decoding = threading.Event()
    reader = StreamReader(source, rid, on_tokens=lambda toks: len(toks) >= 2 and decoding.set())
    prefill.post("/internal/prefill", {"request_id": rid, "prompt_token_ids": ids, "params": params,
                                       "ticket": ticket, "timeout_s": 600})
    if not decoding.wait(120):
        raise RuntimeError(f"{rid} never started decoding on {source.name}")
    moved = source.post("/internal/migrate", {"request_id": rid, "target": target.url})
    httpx.post(f"{target.url}/internal/abort/{rid}", headers=HEADERS, timeout=30)
    reader.join(60)
    return moved["transfer"]


class SnapshotSource:
    """A prefill worker's KV in miniature: random caches in the ticket's layout, in this
    process, streamed by the prefill worker's own LayerStreamer and sender."""

    BLOCK_SIZE = 16

    def __init__(self, ticket: dict, length: int):
        import torch

        from baton.kv.dtypes import torch_dtype

        self.blocks = list(range(-(-length // self.BLOCK_SIZE)))
        shape = (len(self.blocks), self.BLOCK_SIZE, ticket["num_kv_heads"], ticket["head_dim"])
        dtype = torch_dtype(ticket["dtype"])
        gen = torch.Generator().manual_seed(length)
        self.caches = [(torch.randn(shape, generator=gen).to(dtype), torch.randn(shape, generator=gen).to(dtype))
                       for _ in range(ticket["num_layers"])]


def stream_once(decode: Worker, length: int, rng: random.Random, rid: str, state: dict) -> dict:
    """Back-to-back handoff into `decode`: every layer is ready, nothing waits for compute."""
    from baton.kv.stream import BackgroundLoop, LayerStreamer
    from baton.kv.ticket import Ticket
    from baton.kv.transport import select_transport

    ids = [rng.randrange(*VOCAB_RANGE) for _ in range(length)]
    params = {"max_tokens": 1, "ignore_eos": True}
    ticket = Ticket.from_dict(decode.post("/internal/reserve", {"request_id": rid, "prompt_token_ids": ids,
                                                                "params": params, "ttl_s": 600})["ticket"])
    if state.get("source_for") != len(ids):
        state["source"], state["source_for"] = SnapshotSource(ticket.to_dict(), len(ids)), len(ids)
    # the sender side on one core with one torch thread, as a prefill worker is (its loop
    # thread, started below, inherits this); two OpenMP threads on one core stall each
    # gather by ~15 ms
    import torch

    torch.set_num_threads(1)
    all_cores = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {0})
    try:
        if "loop" not in state:  # one sender (one connection) for all runs, as in a prefill worker
            state["loop"] = BackgroundLoop("bench-kv-sender")
            state["sender"] = select_transport("auto", ticket.kv_endpoint).sender(
                ticket.kv_endpoint, worker_id=ticket.worker_id, token=TOKEN)
        return _stream(decode, ids, rid, ticket, state, LayerStreamer)
    finally:
        os.sched_setaffinity(0, all_cores)


def _stream(decode: Worker, ids: list[int], rid: str, ticket, state: dict, LayerStreamer) -> dict:
    source = state["source"]
    reader = StreamReader(decode, rid)
    # blocks_stable, as a prefill worker passes it: the snapshot is never written, so layers
    # go out from its blocks without a copy
    background = state["loop"]
    streamer = LayerStreamer(ticket, state["sender"], background.loop, src_block_ids=source.blocks,
                             src_block_size=SnapshotSource.BLOCK_SIZE, blocks_stable=True)
    background.run(asyncio.sleep(0))  # the streamer's task has started and waits for layers
    # Queue every layer while the sender's loop is held, then start the clock and let it go:
    # handing 30 layers over one by one from this thread, on the sender's one core, costs
    # GIL and CPU hand-offs (up to a scheduler tick each) that a prefill worker, whose
    # layers come a compute step apart, does not pay.
    gate = threading.Event()
    background.loop.call_soon_threadsafe(gate.wait, 30)
    try:
        for layer, (k, v) in enumerate(source.caches):
            streamer.on_layer_done(layer, k, v)
        done = streamer.finish_async(first_token=ids[0], timeout=120)
        started = time.perf_counter()
    finally:
        gate.set()
    report = done.result(250)
    reader.join(60)
    if reader.errors or reader.tokens != [ids[0]]:
        raise RuntimeError(f"decode stream of {rid}: {reader.errors or reader.tokens}")
    return {"bytes": report.total_bytes, "seconds": report.ack_at - started,
            "end_to_ack_seconds": report.ack_at - report.compute_end}


def paired_bulk_and_raw(decode: Worker, length: int, rng: random.Random, state: dict, repeats: int):
    """Back-to-back handoffs alternating with like-for-like raw copies of the same bytes:
    this machine's copy speed drifts by tens of percent over minutes, and each pair sees
    the same state of it. Returns (handoff runs, raw copy summary over all its runs)."""
    bulk = [stream_once(decode, length, rng, f"bulk-{length}-0", state)]
    nbytes = bulk[0]["bytes"]
    raw_runs = []
    # the workers' placement: prefill side on core 0, decode worker on core 1; one
    # long-lived receiver, warmed by a first copy, as the decode worker is
    with PlacedCopier(nbytes, sender_core=0, receiver_core=1) as copier:
        copier.copy_seconds(nbytes)
        for i in range(repeats):
            if i:
                bulk.append(stream_once(decode, length, rng, f"bulk-{length}-{i}", state))
            raw_runs += [copier.copy_seconds(nbytes) for _ in range(2)]
    seconds = statistics.median(raw_runs)
    return bulk, {"gbps": nbytes / seconds / 1e9, "runs": raw_runs}


def exposed_limit(bulk_seconds: float, layers: int) -> float:
    """The exposed-transfer target: two layers' worth of a back-to-back transfer, plus 5 ms."""
    return 2 * bulk_seconds / layers + 0.005


def stop_all(workers: list[Worker], stream_state: dict) -> None:
    for w in workers:
        w.stop()
    if "loop" in stream_state:
        stream_state["loop"].close()


def summarize(length: int, runs: list[dict], bulk: list[dict], migration: list[dict], raw: dict,
              cached: dict, layers: int) -> dict:
    med = lambda key: statistics.median(r[key] for r in runs)
    nbytes = bulk[0]["bytes"]
    bulk_seconds = statistics.median(b["seconds"] for b in bulk)
    effective = nbytes / bulk_seconds / 1e9
    migration_seconds = statistics.median(m["seconds"] for m in migration)
    limit = exposed_limit(bulk_seconds, layers)
    return {
        "prompt_tokens": length,
        "bytes": nbytes,
        "layers": layers,
        "prefill_seconds": med("prefill_seconds"),
        "transfer_seconds": med("transfer_seconds"),
        "wire_seconds": med("wire_seconds"),
        "exposed_seconds": med("exposed_seconds"),
        "overlapped_layers": statistics.median(r["overlapped_layers"] for r in runs),
        "bulk_transfer_seconds": bulk_seconds,
        "effective_gbps": effective,
        "migration_seconds": migration_seconds,
        "migration_gbps": migration[0]["bytes"] / migration_seconds / 1e9,
        "wire_gbps": nbytes / med("wire_seconds") / 1e9,
        "raw_loopback_gbps": raw["gbps"],  # like for like: memory to memory, the workers' cores
        "effective_vs_raw": effective / raw["gbps"],
        "effective_vs_raw_paired": [  # each handoff against the two raw copies right after it
            (b["seconds"] and statistics.median(raw["runs"][2 * i : 2 * i + 2]) / b["seconds"])
            for i, b in enumerate(bulk)],
        "raw_cached_gbps": cached["gbps"],  # best case: cache-resident buffers, any core
        "effective_vs_raw_cached": effective / cached["gbps"],
        "exposed_limit_seconds": limit,
        "meets_bandwidth_target": effective >= 0.7 * raw["gbps"],
        "meets_exposed_target": med("exposed_seconds") <= limit,
        "runs": runs,
        "bulk_runs": bulk,
        "migration_runs": migration,
        "raw_runs": raw["runs"],  # seconds, two after each bulk run
        "raw_cached_runs": cached["runs"],
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--bulk-repeats", type=int, default=7,
                        help="back-to-back handoffs (each paired with raw copies) per length")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--transport", default="tcp", choices=["tcp", "shm"])
    parser.add_argument("--lengths", default=",".join(map(str, LENGTHS)), help="prompt lengths, comma-separated")
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "kv.json"))
    args = parser.parse_args()

    load_at_start = os.getloadavg()
    stream_state: dict = {}
    common = ["--dtype", args.dtype, "--block-size", "16", "--kv-cache-memory-gb", "0.5"]
    decode_args = [*common, "--kv-transport", args.transport]
    # prefill: whole-prompt steps, so every layer streams while the rest of the prompt computes
    prefill = Worker("prefill", "prefill", 0, [*common, "--chunk-size", "0", "--max-num-batched-tokens", "8192"])
    decode = Worker("decode", "decode", 1, decode_args)
    spare = Worker("decode-b", "decode", 0, decode_args)  # migration target; idle otherwise
    workers = [prefill, decode, spare]
    try:
        deadline = time.monotonic() + 300
        for w in workers:
            w.wait_ready(deadline)
        decode_state = httpx.get(decode.url + "/internal/state", headers=HEADERS).json()
        rng = random.Random(0)
        handoff_once(prefill, decode, 64, rng, "warmup")  # connections, allocator, caches
        stream_once(decode, 64, rng, "warmup-stream", stream_state)
        results = []
        for length in [int(x) for x in args.lengths.split(",")]:
            runs = [handoff_once(prefill, decode, length, rng, f"pd-{length}-{i}") for i in range(args.repeats)]
            bulk, raw = paired_bulk_and_raw(decode, length, rng, stream_state, args.bulk_repeats)
            migration = [bulk_once(prefill, decode, spare, length, rng, f"migrate-{length}-{i}")
                         for i in range(args.repeats)]
            cached = raw_copy_gbps(bulk[0]["bytes"], repeats=args.repeats)
            row = summarize(length, runs, bulk, migration, raw, cached, runs[0]["layers"])
            results.append(row)
            print(json.dumps({k: v for k, v in row.items() if not k.endswith("runs")}), flush=True)
        doc = {
            "benchmark": "kv_handoff",
            "transport": args.transport,
            "dtype": args.dtype,
            "repeats": args.repeats,
            "cpu_cores": os.cpu_count(),
            "machine": machine_record(),
            "load_average_at_start": load_at_start,  # 1, 5, 15 min: other work skews every number
            "load_average_at_end": os.getloadavg(),
            "decode_worker": {k: decode_state[k] for k in ("num_blocks", "block_size", "kv_endpoint")},
            "notes": "medians over repeats; effective bandwidth from the back-to-back handoff (this "
                     "process runs the prefill side's LayerStreamer and sender into the real decode "
                     "worker; sender start, every layer queued, to ACK; each run paired with two raw copies); migration_* is informational; transfer_seconds "
                     "spans the layer-wise stream and is paced by compute",
            "results": results,
        }
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(doc, indent=2) + "\n")
        print(f"wrote {args.out}")
    finally:
        stop_all(workers, stream_state)
    return 0


if __name__ == "__main__":
    sys.exit(main())
