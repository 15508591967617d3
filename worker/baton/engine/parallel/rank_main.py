"""A tensor-parallel rank other than 0: `python -m baton.engine.parallel.rank_main SPEC`.

It connects to its leader, joins the process group, loads its slice of the model, says
"ready", and then runs whatever the leader sends: steps (no reply: the step's collectives
keep the ranks in lock step) and calls (answered). On any error it tells the leader why
and exits, which also closes its process-group sockets, so a leader waiting in a
collective fails at once instead of waiting out the timeout.
"""

from __future__ import annotations

import json
import logging
import os
import queue
import sys
import threading
import time
import traceback
from dataclasses import asdict, dataclass

log = logging.getLogger("baton.engine.parallel.rank")

# what a leader may call on a rank's runner (anything else is refused)
CALLABLE = ("resize_kv_cache",)


@dataclass
class RankSpec:
    """Everything a rank needs to join its group (sent as JSON on the command line)."""

    rank: int
    size: int
    model: str | None
    engine: dict  # EngineConfig fields, dtype as asked: `auto` also picks the prompt products'
    dtype: str  # the dtype the leader resolved, which every rank runs in
    kv_dtype: str  # and its KV cache's
    device: str
    num_blocks: int
    store_host: str
    store_port: int
    control_host: str
    control_port: int
    timeout_s: float  # every collective's limit
    start_timeout_s: float  # joining the group and loading the model
    leader_pid: int | None = None  # set when the leader is this process's parent
    own_node: bool = False  # on a node of its own: its connections bind its node's address

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> RankSpec:
        return cls(**json.loads(text))


def command(spec: RankSpec) -> list[str]:
    return [sys.executable, "-m", "baton.engine.parallel.rank_main", spec.to_json()]


def node_host(spec: RankSpec) -> str | None:
    """This rank's own node address when it runs away from its leader (its Ray actor says
    which), else None: it shares the leader's node and its defaults."""
    if not spec.own_node:
        return None
    from baton.engine.parallel.ray_launcher import NODE_HOST_ENV

    host = os.environ.get(NODE_HOST_ENV)
    if not host:
        raise RuntimeError(f"a rank on a node of its own needs its node's address in {NODE_HOST_ENV}")
    return host


def build_runner(spec: RankSpec):
    """Join the group and load this rank's slice; returns its ModelRunner."""
    import datetime

    import torch
    from torch.distributed import TCPStore

    from baton.engine.config import DTYPES, EngineConfig
    from baton.engine.loader import load_source
    from baton.engine.model_runner import ModelRunner
    from baton.engine.parallel.comm import ShardComm, gloo_group
    from baton.engine.parallel.launcher import rank_cores
    from baton.engine.parallel.shards import shards_for

    config = EngineConfig(model=spec.model, **spec.engine)
    cores = rank_cores(config.cpu_cores, spec.size, spec.rank)
    if cores:
        os.sched_setaffinity(0, cores)
    if config.threads or cores:
        torch.set_num_threads(config.threads or len(cores))
    store = TCPStore(spec.store_host, spec.store_port, spec.size, False,
                     timeout=datetime.timedelta(seconds=spec.start_timeout_s))
    group = gloo_group(store, spec.rank, spec.size, spec.timeout_s, node_host(spec))
    source = load_source(spec.model, keep_quantized=config.keeps_quantized)
    shards = shards_for(source.config, spec.size)
    comm = ShardComm(group, shards, spec.rank)
    runner = ModelRunner(config, source.config, source.tensors, torch.device(spec.device),
                         DTYPES[spec.dtype], shards[spec.rank], comm, spec.num_blocks, DTYPES[spec.kv_dtype])
    runner.store = store  # the group's sockets live as long as the runner
    return runner


class Serving:
    """A rank's two threads: the reader takes every message and answers KV calls at once;
    the compute thread (the main one) runs steps and the other calls in the order sent."""

    def __init__(self, conn, runner, rank: int, host: str | None = None):
        from baton.engine.parallel.rank_kv import RankKV

        self.conn, self.runner = conn, runner
        self._send_lock = threading.Lock()
        self.kv = RankKV(runner, rank, self.emit, host)
        self._work: queue.SimpleQueue = queue.SimpleQueue()

    def send(self, message) -> None:
        with self._send_lock:
            self.conn.send(message)

    def emit(self, event) -> None:
        try:
            self.send(("event", event))
        except OSError:
            pass  # the leader is gone; this rank is about to follow it

    def read(self) -> None:
        from baton.engine.parallel.rank_kv import KV_CALLS

        while True:
            try:
                message = self.conn.recv()
            except (EOFError, OSError):
                log.info("leader gone: rank exits")
                self._work.put(("stop",))
                return
            if message[0] == "call" and message[2] in KV_CALLS:
                _, call_id, name, args = message
                try:
                    self.send(("reply", call_id, True, getattr(self.kv, name)(*args)))
                except Exception as exc:  # one request's KV trouble: the rank serves on
                    log.exception("%s failed", name)
                    self.send(("reply", call_id, False, f"{type(exc).__name__}: {exc}"))
            else:
                self._work.put(message)

    def compute(self) -> None:
        """Run the leader's commands until it says stop (or goes away)."""
        threading.Thread(target=self.read, name="baton-tp-rank-reader", daemon=True).start()
        try:
            while True:
                message = self._work.get()
                kind = message[0]
                if kind == "step":
                    inputs = message[1]
                    self.runner.execute(inputs, self.kv.step_hook(inputs.exports))
                elif kind == "call":
                    _, call_id, name, args = message
                    if name not in CALLABLE:
                        raise ValueError(f"the leader called {name!r}, which a rank does not offer")
                    self.send(("reply", call_id, True, getattr(self.runner, name)(*args)))
                elif kind == "stop":
                    return
                else:
                    raise ValueError(f"unknown command {kind!r} from the leader")
        finally:
            self.kv.close()


def main(argv: list[str]) -> int:
    spec = RankSpec.from_json(argv[0])
    logging.basicConfig(level=os.environ.get("BATON_TP_LOG_LEVEL", "WARNING"),
                        format=f"%(asctime)s %(levelname)s tp-rank-{spec.rank}: %(message)s")
    if spec.leader_pid is not None and os.getppid() != spec.leader_pid:
        return 3  # the leader died before this rank could tie its life to it
    from baton.engine.parallel.control import connect_to_leader

    deadline = time.monotonic() + spec.start_timeout_s
    conn = connect_to_leader((spec.control_host, spec.control_port), spec.rank, spec.start_timeout_s)
    serving = None
    try:
        runner = build_runner(spec)
        if time.monotonic() > deadline:
            raise TimeoutError(f"loading took longer than {spec.start_timeout_s} s")
        serving = Serving(conn, runner, spec.rank, node_host(spec))
        serving.send(("ready", spec.rank))
        serving.compute()
    except BaseException as exc:
        text = f"{type(exc).__name__}: {exc}"
        log.error("rank %d failed: %s\n%s", spec.rank, text, traceback.format_exc())
        try:
            (serving.send if serving is not None else conn.send)(("error", text))
        except OSError:
            pass
        # skip interpreter teardown: the process group's threads may be mid-collective
        os._exit(1)
    return 0


if __name__ == "__main__":
    code = main(sys.argv[1:])
    sys.stdout.flush()
    os._exit(code)
