"""PDDeployment, group baton.dev, version v1alpha1: the one resource a platform team writes.

The models are the source of truth: the CRD schema is generated from them (`baton crds`) and
the operator validates every spec with them before acting on it.
"""

from __future__ import annotations

from typing import Annotated, ClassVar, Literal

from pydantic import AfterValidator, Field

from .cel import ApiModel, CelRule
from .quantity import parse_quantity

GROUP = "baton.dev"
VERSION = "v1alpha1"
KIND = "PDDeployment"
PLURAL = "pddeployments"
SINGULAR = "pddeployment"
SHORT_NAMES = ("pdd",)

Role = Literal["prefill", "decode", "both"]


def _quantity(value: int | str) -> int | str:
    parse_quantity(value)  # refused here, naming the field, not later by the API server
    return value


Quantity = Annotated[int | str, AfterValidator(_quantity)]  # Kubernetes quantities: 2, "500m", "16Gi"


class ModelSource(ApiModel):
    """Where the worker reads the weights from."""

    __cel__: ClassVar = (
        CelRule(
            rule="self.source != 'pvc' || has(self.claimName)",
            message="claimName is required when source is pvc",
            field="claimName",
            holds=lambda m: m.source != "pvc" or m.claim_name is not None,
        ),
        CelRule(
            rule="self.source == 'bundled' || has(self.path)",
            message="path is required unless source is bundled",
            field="path",
            holds=lambda m: m.source == "bundled" or m.path is not None,
        ),
    )

    source: Literal["bundled", "image", "pvc", "hostPath"] = Field(
        "bundled",
        description="bundled: the small default model inside the worker image; image: a path "
        "inside the image; pvc: a HF folder on a PersistentVolumeClaim; hostPath: a node folder "
        "(refused unless the operator allows its prefix with --allow-host-path)",
    )
    path: str | None = Field(None, min_length=1, description="folder or file of the weights")
    claim_name: str | None = Field(None, min_length=1, description="PVC holding the weights")


class EngineSettings(ApiModel):
    dtype: Literal["auto", "float32", "float16", "bfloat16"] = "auto"
    kv_cache_dtype: Literal["auto", "float32", "float16", "bfloat16"] = Field(
        "auto", description="the KV cache's dtype (auto: the activations', or bfloat16 under float32 "
        "activations on a CPU with bf16 in hardware); prefill and decode workers must agree, so pin "
        "it where nodes' CPUs differ")
    quantization: Literal["auto", "none"] = Field(
        "auto", description="auto: a GGUF model's quantized weights served as blocks (Q4_0, Q4_1, "
        "Q5_0, Q5_1, Q8_0 and IQ4_NL as stored; Q4_K, Q5_K and IQ4_XS rewritten with their quants "
        "kept; every other GGUF block format requantized to Q8_0); none: dequantized to dtype at load")
    prompt_products: Literal["auto", "int8", "bf16"] = Field(
        "auto", description="on CPU, what many-row products on quantized weights (prompt chunks) run "
        "on: auto = AMX tiles where the node's CPU has them, else int8 on AVX512-VNNI (on AVX2 "
        "where it has neither VNNI nor AVX-512), else AVX512-BF16; int8 or bf16 ask for one (a worker whose CPU has none stops at start saying so)")
    block_size: int = Field(16, ge=1, le=1024, description="tokens per KV block")
    max_num_batched_tokens: int = Field(2048, ge=1, description="token budget of one step")
    chunk_size: int = Field(512, ge=1, description="prefill chunk, in tokens")
    kv_cache_memory_gb: float = Field(
        1.0, gt=0, description="memory each worker gives its KV cache, in GiB (the workers' "
        "--kv-cache-memory-gb); a role switch trades it against the step's token budget, so "
        "size the pools' memory requests to hold it plus the weights")


class Toleration(ApiModel):
    key: str | None = None
    operator: Literal["Exists", "Equal"] | None = None
    value: str | None = None
    effect: Literal["NoSchedule", "PreferNoSchedule", "NoExecute"] | None = None
    toleration_seconds: int | None = None


class Resources(ApiModel):
    requests: dict[str, Quantity] = Field(default_factory=dict)
    limits: dict[str, Quantity] = Field(default_factory=dict)


class WorkerPool(ApiModel):
    replicas: int = Field(1, ge=0, description="worker pods in this pool")
    resources: Resources = Field(
        default_factory=Resources, description="per tensor-parallel rank: a worker pod requests "
        "and is limited to these amounts times its size, which is this pool's "
        "tensorParallelSize, or with autoscaling on (role conversions) the larger of the two "
        "pools' sizes, since a converted pod regroups in place and cannot grow")
    node_selector: dict[str, str] = Field(default_factory=dict)
    tolerations: list[Toleration] = Field(default_factory=list)
    tensor_parallel_size: int = Field(
        1, ge=1, le=64, description="tensor-parallel ranks per worker pod (processes on the "
        "pod's cores, or its GPUs); a pod converted into this pool regroups onto this many. "
        "Resources are per rank: with autoscaling on, every worker pod is sized for the larger "
        "of the two pools' sizes")


class SecretKeyRef(ApiModel):
    """One key of a Secret in the PDDeployment's namespace."""

    name: str = Field(..., min_length=1, description="the Secret's name")
    key: str = Field("api-key", min_length=1, description="the key within the Secret")


class RouterSpec(ApiModel):
    replicas: int = Field(1, ge=1)
    api_key_secret: SecretKeyRef | None = Field(
        None, description="a Secret key holding the API key clients must send as a bearer token; "
        "without it the router's OpenAI API is open to anyone who can reach its Service"
    )
    service_type: Literal["ClusterIP", "NodePort", "LoadBalancer"] = "ClusterIP"
    disaggregation_threshold: int = Field(
        512, ge=0, description="uncached prompt tokens below which decode prefills in place"
    )
    resources: Resources = Field(default_factory=Resources)


class KVTransfer(ApiModel):
    transport: Literal["tcp"] = Field(
        "tcp", description="how KV caches move between worker pods (the workers' "
        "--kv-transport); tcp is the one transport between pods: shared memory needs one host, "
        "and a GPU transport (NCCL, NIXL) is not implemented yet")


class PoolBounds(ApiModel):
    __cel__: ClassVar = (
        CelRule(
            rule="self.min <= self.max",
            message="min must not exceed max",
            field="min",
            holds=lambda b: b.min <= b.max,
        ),
    )

    min: int = Field(1, ge=0)
    max: int = Field(4, ge=0)


class ServiceLevelObjectives(ApiModel):
    __cel__: ClassVar = (
        CelRule(
            rule="self.ttftSeconds > 0.0",
            message="ttftSeconds must be positive",
            field="ttftSeconds",
            holds=lambda s: s.ttft_seconds > 0,
        ),
        CelRule(
            rule="self.tpotSeconds > 0.0",
            message="tpotSeconds must be positive",
            field="tpotSeconds",
            holds=lambda s: s.tpot_seconds > 0,
        ),
    )

    ttft_seconds: float = Field(1.0, gt=0, description="time-to-first-token target")
    tpot_seconds: float = Field(0.1, gt=0, description="time-per-output-token target")


class Autoscaling(ApiModel):
    enabled: bool = False
    mode: Literal["fixed-fleet", "elastic"] = "fixed-fleet"
    prefill: PoolBounds = Field(default_factory=PoolBounds)
    decode: PoolBounds = Field(default_factory=PoolBounds)
    slo: ServiceLevelObjectives = Field(default_factory=ServiceLevelObjectives)
    target_utilization: float = Field(0.8, gt=0, le=1)
    period_seconds: int = Field(30, ge=1)
    cooldown_seconds: int = Field(120, ge=0)
    prometheus_url: str | None = Field(None, min_length=1)


class RoleConversion(ApiModel):
    """A request that one worker pod change role in place (written by the controller)."""

    pod: str = Field(min_length=1)
    to_role: Literal["prefill", "decode"]  # there is no "both" pool to convert into


def _within(replicas: int, bounds: PoolBounds) -> bool:
    return bounds.min <= replicas <= bounds.max


class PDDeploymentSpec(ApiModel):
    __cel__: ClassVar = (
        CelRule(
            rule="!self.autoscaling.enabled || (self.prefill.replicas >= self.autoscaling.prefill.min"
            " && self.prefill.replicas <= self.autoscaling.prefill.max)",
            message="prefill.replicas must lie within autoscaling.prefill bounds",
            field="prefill.replicas",
            holds=lambda s: not s.autoscaling.enabled
            or _within(s.prefill.replicas, s.autoscaling.prefill),
        ),
        CelRule(
            rule="!self.autoscaling.enabled || (self.decode.replicas >= self.autoscaling.decode.min"
            " && self.decode.replicas <= self.autoscaling.decode.max)",
            message="decode.replicas must lie within autoscaling.decode bounds",
            field="decode.replicas",
            holds=lambda s: not s.autoscaling.enabled
            or _within(s.decode.replicas, s.autoscaling.decode),
        ),
    )

    image: str = Field(min_length=1, description="worker image")
    image_pull_policy: Literal["Always", "IfNotPresent", "Never"] = "IfNotPresent"
    model: ModelSource = Field(default_factory=ModelSource)
    engine: EngineSettings = Field(default_factory=EngineSettings)
    prefill: WorkerPool = Field(default_factory=WorkerPool)
    decode: WorkerPool = Field(default_factory=WorkerPool)
    router: RouterSpec = Field(default_factory=RouterSpec)
    kv_transfer: KVTransfer = Field(default_factory=KVTransfer)
    autoscaling: Autoscaling = Field(default_factory=Autoscaling)
    drain_timeout_seconds: int = Field(
        300, ge=0, description="longest wait for a worker to drain before it is removed anyway"
    )


# --- status (written by the operator and the controller, never by users) ---


class Condition(ApiModel):
    type: Literal["Ready", "Progressing", "Degraded", "Scaling"]
    status: Literal["True", "False", "Unknown"]
    reason: str = ""
    message: str = ""
    last_transition_time: str | None = None
    observed_generation: int | None = None


class PoolStatus(ApiModel):
    desired: int = 0
    current: int = 0
    ready: int = 0
    selector: str | None = Field(None, description="label selector of the pool's worker pods "
                                 "(the scale subresource's, for the decode pool)")


class ControllerTarget(ApiModel):
    """What the controller wants while autoscaling is on: pool sizes, and pods to convert in
    place. It lives in status, not in the spec: the spec is the user's (and GitOps'), and
    the operator follows this target instead of spec.*.replicas, within the spec's bounds."""

    prefill: int = Field(ge=0)
    decode: int = Field(ge=0)
    conversions: list[RoleConversion] = Field(default_factory=list)


class SizingDecision(ApiModel):
    """The controller's last sizing decision, kept so `kubectl describe` explains it."""

    time: str | None = None
    action: str | None = None
    reason: str | None = None
    inputs: dict[str, float] = Field(default_factory=dict)
    outputs: dict[str, float] = Field(default_factory=dict)


class ConversionStatus(ApiModel):
    pod: str
    from_role: Role
    to_role: Role
    phase: Literal["Draining", "Resharding"]
    started_at: str | None = None


class PDDeploymentStatus(ApiModel):
    observed_generation: int | None = None
    conditions: list[Condition] = Field(default_factory=list)
    prefill: PoolStatus = Field(default_factory=PoolStatus)
    decode: PoolStatus = Field(default_factory=PoolStatus)
    router: PoolStatus = Field(default_factory=PoolStatus)
    last_decision: SizingDecision | None = None
    target: ControllerTarget | None = None
    conversions: list[ConversionStatus] = Field(default_factory=list)


class PDDeployment(ApiModel):
    api_version: Literal["baton.dev/v1alpha1"] = "baton.dev/v1alpha1"
    kind: Literal["PDDeployment"] = "PDDeployment"
    metadata: dict = Field(default_factory=dict)
    spec: PDDeploymentSpec
    status: PDDeploymentStatus | None = None
