"""The worker's settings, from `baton worker` arguments (pure)."""

from __future__ import annotations

import re
import socket
from dataclasses import dataclass, field

from baton.engine.config import DEFAULT_TPOT_OBJECTIVE_S, ROLES
from baton.kv.endpoint import is_loopback
from baton.server.cpu_priority import check_priority

KV_TRANSPORTS = ("tcp", "shm", "auto")


@dataclass
class WorkerSettings:
    role: str = "both"
    model: str | None = None  # None: the bundled model
    host: str = "127.0.0.1"
    port: int = 8100
    kv_port: int = 8101
    kv_transport: str = "auto"  # the receiving side: auto = tcp; senders follow the ticket
    advertise_host: str | None = None  # host put in tickets; default: --host, or the hostname
    worker_id: str | None = None
    dtype: str = "auto"
    kv_cache_dtype: str = "auto"
    quantization: str = "auto"
    prompt_products: str = "auto"  # what many-row products on quantized weights run on (CPU)
    block_size: int = 16
    max_num_batched_tokens: int = 2048
    chunk_size: int = 512
    tpot_objective_s: float = DEFAULT_TPOT_OBJECTIVE_S  # prompt tokens per step capped to keep it (0: no cap)
    # the longest step saved time may buy, in objectives (None: the role's default)
    tpot_bank_objectives: float | None = None
    commit_hold: float = 0.5  # a step waits up to this part of a step for a prompt's KV due (0: never)
    kv_cache_memory_gb: float = 1.0
    num_kv_blocks: int | None = None
    max_num_seqs: int = 64
    threads: int | None = None  # per tensor-parallel rank
    tensor_parallel_size: int = 1
    cpu_cores: list[int] = field(default_factory=list)
    prefill_cpu_priority: str = "normal"  # idle: SCHED_IDLE while a one-process prefill worker (cpu_priority.py)
    ray_address: str | None = None  # start the other ranks through Ray (baton up passes it)
    rank_placement: str = "pack"  # pack: the other ranks on this node; spread: each on its own
    peers: list[str] = field(default_factory=list)  # decode workers to migrate to on drain
    ticket_ttl_s: float = 30.0
    # longest wait of a generate request in the engine's queue before it first runs (KV pool
    # or batch full): then 429. Shorter than the router's wait for a worker's answer (60 s),
    # which would count the worker as lost.
    queue_timeout_s: float = 30.0
    insecure_no_token: bool = False

    def validate(self) -> None:
        if self.role not in ROLES:
            raise ValueError(f"--role must be one of {ROLES}, got {self.role!r}")
        if self.kv_transport not in KV_TRANSPORTS:
            raise ValueError(f"--kv-transport must be one of {KV_TRANSPORTS}, got {self.kv_transport!r}")
        if not 0 <= self.tpot_objective_s < float("inf"):
            raise ValueError("--tpot-objective-ms must be a finite number >= 0 (0: no cap), "
                             f"got {self.tpot_objective_s * 1e3!r}")
        if not 0 <= self.commit_hold <= 1:
            raise ValueError(f"--commit-hold must be a fraction of a step from 0 to 1, got {self.commit_hold!r}")
        if self.tpot_bank_objectives is not None and not 1 <= self.tpot_bank_objectives < float("inf"):
            raise ValueError("--tpot-bank-objectives must be a finite number >= 1 (1: no step past the "
                             f"objective), got {self.tpot_bank_objectives!r}")
        if self.tensor_parallel_size < 1:
            raise ValueError(f"--tensor-parallel-size must be at least 1, got {self.tensor_parallel_size}")
        check_priority(self.prefill_cpu_priority, "--prefill-cpu-priority")
        if self.ticket_ttl_s <= 0:
            raise ValueError("--ticket-ttl must be positive")
        if not self.queue_timeout_s > 0:
            raise ValueError(f"--queue-timeout must be positive, got {self.queue_timeout_s}")
        if self.insecure_no_token and not is_loopback(self.host):
            # without a token the HTTP API is open and the KV port takes a well-known token:
            # acceptable only where no other machine can reach either
            raise ValueError(f"--insecure-no-token serves an open API: --host must be a loopback "
                             f"address (127.0.0.1, ::1, localhost), got {self.host!r}")

    @property
    def name(self) -> str:
        """This worker's identity in tickets and KV handshakes."""
        if self.worker_id:
            return self.worker_id
        return f"{self.public_host}-{self.port}"

    @property
    def public_host(self) -> str:
        if self.advertise_host:
            return self.advertise_host
        if self.host in ("0.0.0.0", "::", ""):
            return socket.gethostname()
        return self.host

    @property
    def url_host(self) -> str:
        """`public_host` as it goes into a URL or an endpoint (an IPv6 address in brackets)."""
        host = self.public_host
        return f"[{host}]" if ":" in host and not host.startswith("[") else host

    @property
    def receive_transport(self) -> str:
        return "tcp" if self.kv_transport == "auto" else self.kv_transport

    def kv_address(self) -> str:
        """What the receiver listens on: host:port for tcp, a socket name for shm."""
        if self.receive_transport == "shm":
            return re.sub(r"[^A-Za-z0-9._-]", "-", self.name)[:100]
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{host}:{self.kv_port}"

    def engine_settings(self) -> dict:
        settings = dict(
            dtype=self.dtype,
            kv_cache_dtype=self.kv_cache_dtype,
            quantization=self.quantization,
            prompt_products=self.prompt_products,
            block_size=self.block_size,
            max_num_batched_tokens=self.max_num_batched_tokens,
            chunk_size=self.chunk_size,
            tpot_objective_s=self.tpot_objective_s,
            tpot_bank_objectives=self.tpot_bank_objectives,
            kv_cache_memory_gb=self.kv_cache_memory_gb,
            max_num_seqs=self.max_num_seqs,
            role=self.role,
            threads=self.threads,
            tensor_parallel_size=self.tensor_parallel_size,
            cpu_cores=list(self.cpu_cores),
            ray_address=self.ray_address,
            rank_placement=self.rank_placement,
        )
        if self.num_kv_blocks:
            settings["num_kv_blocks"] = self.num_kv_blocks
        return settings
