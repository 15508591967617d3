"""Start and stop the local stack: Ray, one actor per server process, health waits.

`baton up` and `baton demo` use LocalStack; tests use it too (its stop() is what makes
"no orphan processes" true).
"""

from __future__ import annotations

import contextlib
import os
import random
import secrets
import socket
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from baton.local.plan import WorkerPlan, plan_roles, plan_workers, ray_cpus, worker_args
from baton.local.process_actor import ServerProcess
from baton.local.restart import Backoff
from baton.local.supervisor import Liveness, Supervisor
from baton.router.threshold import parse_threshold
from baton.server.cpu_priority import check_priority

WORKER_MODULE = "baton.server.main"
ROUTER_MODULE = "baton.router.main"


@dataclass
class StackSpec:
    prefill: int = 0
    decode: int = 0
    colocated: int = 0
    prefill_tp: int = 1  # tensor-parallel ranks per prefill worker
    decode_tp: int = 1  # and per decode or colocated worker
    convertible: bool = False  # --autoscale: workers may change pools (and regroup in place)
    prefill_cpu_priority: str = "normal"  # idle: prefill workers on cores of their own at SCHED_IDLE
    chunk_size: int | None = None
    port: int = 8000
    model: str | None = None
    address: str | None = None  # join this Ray cluster instead of starting one
    disagg_threshold: str | None = None
    worker_args: list[str] = field(default_factory=list)  # passed through to every worker
    router_args: list[str] = field(default_factory=list)
    log_dir: str | None = None
    ready_timeout_s: float = 300.0
    restart: bool = True  # restart a server process that exits, as a kubelet does
    backoff: Backoff = field(default_factory=Backoff)
    liveness: Liveness = field(default_factory=Liveness)

    def check(self) -> None:
        """Raise ValueError naming a setting the servers would refuse, before any starts (a
        server that exits on one leaves only its log to say why)."""
        plan_workers(plan_roles(self.prefill, self.decode, self.colocated), [], self.prefill_tp, self.decode_tp)
        if self.chunk_size is not None and self.chunk_size < 0:
            raise ValueError(f"--chunk-size must be 0 (whole prompts) or a number of tokens, got {self.chunk_size}")
        check_priority(self.prefill_cpu_priority, "--prefill-cpu-priority")
        if not 0 <= self.port <= 65535:
            raise ValueError(f"--port must be 0 (any free one) to 65535, got {self.port}")
        parse_threshold(self.disagg_threshold)


@dataclass
class RunningServer:
    name: str
    role: str
    url: str
    actor: object


EPHEMERAL_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")
FIXED_PORTS_SPAN = 16384  # ports below the ephemeral range the stack's servers are given from


def ephemeral_low(default: int = 32768) -> int:
    """The lowest port the kernel hands out for port 0 and outgoing connections."""
    try:
        return int(EPHEMERAL_RANGE.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return default


def free_ports(count: int, rng: random.Random | None = None) -> list[int]:
    """`count` distinct ports free on loopback now, from below the kernel's ephemeral range.
    The servers bind them only later, while other processes start: one the kernel had just
    handed out as port 0 was taken meanwhile by a tensor-parallel rank's own socket of an
    earlier worker, and the next worker could not bind it; below that range only a process
    that names a port takes it. Every socket stays bound until all are chosen (one bound and
    closed at a time, two workers of one stack were once given the same port). Where the
    range leaves no room below it, the kernel's port 0."""
    rng = rng or random.Random()
    low = ephemeral_low()
    span = range(max(1024, low - FIXED_PORTS_SPAN), low)
    with contextlib.ExitStack() as sockets:
        chosen: list[int] = []
        for port in rng.sample(span, min(len(span), 8 * count + 64)) if len(span) >= 4 * count else []:
            if len(chosen) == count:
                break
            s = sockets.enter_context(socket.socket())
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            chosen.append(port)
        while len(chosen) < count:
            s = sockets.enter_context(socket.socket())
            s.bind(("127.0.0.1", 0))
            chosen.append(s.getsockname()[1])
        return chosen


def announce(message: str) -> None:
    print(f"baton up: {message}", flush=True)


class ActorProcess:
    """A ServerProcess actor as the supervisor sees it; every call has a deadline.

    An exit is seen through one pending `wait_exit` call per started server: `poll` only
    asks whether it has returned, a check within this process. With a poll call to each
    actor twice a second, an idle `baton up --colocated 2` kept its own process at 2.7% of
    a core and the GCS at 0.9% (0.5% and 0.5% now, with the probes' shared client), time a
    2-core machine's workers lose under load."""

    def __init__(self, actor):
        self.actor = actor
        self._exit = actor.wait_exit.remote()

    def poll(self) -> int | None:
        import ray

        done, _ = ray.wait([self._exit], timeout=0)
        return ray.get(done[0], timeout=10) if done else None

    def start(self) -> int:
        import ray

        pid = ray.get(self.actor.start.remote(), timeout=30)
        self._exit = self.actor.wait_exit.remote()
        return pid

    def stop(self) -> int | None:
        import ray

        return ray.get(self.actor.stop.remote(), timeout=30)


class LocalStack:
    def __init__(self, spec: StackSpec, say: Callable[[str], None] = announce):
        self.spec = spec
        # a caller may choose the internal token (to inspect the workers); else a fresh one
        self.token = os.environ.get("BATON_INTERNAL_TOKEN") or secrets.token_hex(16)
        self.say = say
        self.supervisor: Supervisor | None = None
        self.workers: list[RunningServer] = []
        self.router: RunningServer | None = None
        self.log_dir = Path(spec.log_dir or tempfile.mkdtemp(prefix="baton-up-"))
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self._started_ray = False

    @property
    def url(self) -> str:
        return self.router.url if self.router else ""

    def start(self) -> LocalStack:
        self.spec.check()  # before Ray is imported or started: a bad setting costs nothing
        import ray

        roles = plan_roles(self.spec.prefill, self.spec.decode, self.spec.colocated)
        yields = self.spec.prefill_cpu_priority == "idle"
        plans = plan_workers(roles, sorted(os.sched_getaffinity(0)), self.spec.prefill_tp, self.spec.decode_tp,
                             convertible=self.spec.convertible, prefill_yields=yields)
        if yields:
            kept = [f"prefill-{p.index}" for p in plans if p.role == "prefill" and not p.yields_cpu]
            if kept:  # said, not refused: the stack runs as it would without the flag
                self.say(f"--prefill-cpu-priority idle: not for {', '.join(kept)} (it shares a core with "
                         "another worker, has ranks in other processes, or may be converted: --autoscale)")
        if self.spec.address:
            ray.init(address=self.spec.address, log_to_driver=False)
        else:
            ray.init(num_cpus=ray_cpus(plans, self.spec.prefill_tp, self.spec.decode_tp),
                     include_dashboard=False, log_to_driver=False)
            self._started_ray = True
        # threaded: `wait_exit` blocks in one thread while `stop` or `pids` run in others
        remote = ray.remote(num_cpus=0, max_concurrency=4)(ServerProcess)
        try:
            # every server's ports chosen together, so that no two are handed one port
            ports = free_ports(2 * len(plans) + 1)
            self._start_workers(remote, plans, list(zip(ports[0:-1:2], ports[1:-1:2])))
            # the router starts while the workers load: it is ready once they are
            self._start_router(remote, self.spec.port or ports[-1])
            for server in [*self.workers, self.router]:
                self._wait_ready(server, "/ready")
        except BaseException:
            self.stop()
            raise
        if self.spec.restart:
            self.supervisor = Supervisor(self.spec.backoff, self.say, liveness=self.spec.liveness)
            for server in [*self.workers, self.router]:
                label = server.name if server is self.router else f"{server.name} ({server.role})"
                self.supervisor.watch(label, ActorProcess(server.actor), server.url + "/ready",
                                      server.url + "/health")
            self.supervisor.start()
        return self

    @property
    def restarts(self) -> dict[str, int]:
        """Restarts so far, by server."""
        return self.supervisor.restarts if self.supervisor else {}

    def _start_workers(self, remote, plans: list[WorkerPlan], ports: list[tuple[int, int]]) -> None:
        """`ports`: each worker's (HTTP, KV) ports."""
        local = not self.spec.address
        host = "127.0.0.1" if local else "0.0.0.0"
        advertise = "127.0.0.1"  # on a joined cluster each actor reports its node below
        env = {"BATON_INTERNAL_TOKEN": self.token}
        actors = []
        for plan in plans:
            log = str(self.log_dir / f"worker-{plan.index}-{plan.role}.log")
            actors.append(remote.options(name=f"baton-worker-{plan.index}-{os.getpid()}").remote(
                WORKER_MODULE, [], env, log))
        import ray

        ips = [advertise] * len(plans) if local else ray.get([a.node_ip.remote() for a in actors])
        ray_address = ray.get_runtime_context().gcs_address
        urls = [f"http://{ip}:{port}" for ip, (port, _) in zip(ips, ports)]
        decode_urls = [u for u, p in zip(urls, plans) if p.role in ("decode", "both")]
        for plan, actor, url, ip, (port, kv_port) in zip(plans, actors, urls, ips, ports):
            peers = [u for u in decode_urls if u != url]
            args = worker_args(plan, port, kv_port, host, ip, self.spec.model, self.spec.chunk_size,
                               peers, self.spec.worker_args, ray_address)
            ray.get(actor.configure.remote(WORKER_MODULE, args))
            ray.get(actor.start.remote())
            self.workers.append(RunningServer(f"worker-{plan.index}", plan.role, url, actor))

    def _start_router(self, remote, port: int) -> None:
        import ray

        args = ["--host", "127.0.0.1" if not self.spec.address else "0.0.0.0", "--port", str(port),
                "--workers", ",".join(w.url for w in self.workers)]
        if self.spec.model:
            args += ["--model", self.spec.model]
        if self.spec.disagg_threshold is not None:
            args += ["--disagg-threshold", str(self.spec.disagg_threshold)]
        args += self.spec.router_args
        env = {"BATON_INTERNAL_TOKEN": self.token}
        actor = remote.options(name=f"baton-router-{os.getpid()}").remote(
            ROUTER_MODULE, args, env, str(self.log_dir / "router.log"))
        ray.get(actor.start.remote())
        self.router = RunningServer("router", "router", f"http://127.0.0.1:{port}", actor)

    def _wait_ready(self, server: RunningServer, path: str) -> None:
        import ray

        deadline = time.monotonic() + self.spec.ready_timeout_s
        with httpx.Client(timeout=2.0) as http:
            while time.monotonic() < deadline:
                try:
                    if http.get(server.url + path).status_code == 200:
                        return
                except httpx.HTTPError:
                    pass
                code = ray.get(server.actor.poll.remote())
                if code is not None:
                    raise RuntimeError(f"{server.name} exited with code {code}; see {self._log_of(server)}")
                time.sleep(0.2)
        raise TimeoutError(f"{server.name} was not ready within {self.spec.ready_timeout_s:.0f}s; "
                           f"see {self._log_of(server)}")

    def _log_of(self, server: RunningServer) -> Path:
        return next(iter(sorted(self.log_dir.glob(f"{server.name}*.log"))), self.log_dir)

    def pids(self) -> list[int]:
        """Every process this stack started through its actors (actors and servers)."""
        import ray

        found: list[int] = []
        for server in [*self.workers, *([self.router] if self.router else [])]:
            found += ray.get(server.actor.pids.remote())
        return found

    def stop(self) -> None:
        import ray

        if self.supervisor is not None:
            self.supervisor.stop()  # first: nothing is restarted while the stack stops
        servers = ([self.router] if self.router else []) + list(reversed(self.workers))
        for server in servers:  # the router first: no new work reaches a stopping worker
            try:
                ray.get(server.actor.stop.remote(), timeout=20)
            except Exception:
                pass  # the kill below still takes the server down (PDEATHSIG)
            ray.kill(server.actor)
        self.workers, self.router = [], None
        if self._started_ray and ray.is_initialized():
            ray.shutdown()
