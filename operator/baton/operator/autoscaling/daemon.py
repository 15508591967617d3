"""The controller on Kubernetes: one kopf daemon per PDDeployment with autoscaling enabled.

It measures through Prometheus when spec.autoscaling.prometheusUrl is set, else by scraping
the worker pods directly; it acts by patching the PDDeployment spec (KubernetesActuator) and
explains each decision in status.lastDecision, a Kubernetes Event and the process's
`baton_autoscaler_*` metrics. kopf stops the daemon when autoscaling is switched off.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import kopf

from baton.api import GROUP, PLURAL, VERSION, SpecProblem, parse_spec
from baton.api.models import Autoscaling, PDDeploymentSpec
from baton.autoscaler.inputs import Action, Decision, Mode, PolicyConfig
from baton.autoscaler.loop import Controller
from baton.autoscaler.metrics import MetricsSource
from baton.autoscaler.metrics_prometheus import PrometheusSource
from baton.autoscaler.metrics_scrape import ScrapeSource
from baton.autoscaler.policy import SizingPolicy
from baton.autoscaler.promql import deployment_matchers

from .. import labels
from ..config import OperatorConfig
from ..kube import KubeApi
from ..planning import PodView
from .actuator import KubernetesActuator

log = logging.getLogger(__name__)


def policy_config(settings: Autoscaling, prefill_tp: int = 1, decode_tp: int = 1) -> PolicyConfig:
    """The policy's configuration from spec.autoscaling and the pools' tensorParallelSize
    (pure): the controller counts each worker at the larger size, as the operator sizes
    every worker pod while autoscaling is on."""
    return PolicyConfig(
        ttft_slo_s=settings.slo.ttft_seconds,
        tpot_slo_s=settings.slo.tpot_seconds,
        mode=Mode(settings.mode),
        prefill_utilisation=settings.target_utilization,
        decode_utilisation=settings.target_utilization,
        prefill_bounds=(settings.prefill.min, settings.prefill.max),
        decode_bounds=(settings.decode.min, settings.decode.max),
        cooldown_s=float(settings.cooldown_seconds),
        prefill_tensor_parallel=prefill_tp,
        decode_tensor_parallel=decode_tp,
    )


def spec_policy_config(spec: PDDeploymentSpec) -> PolicyConfig:
    return policy_config(spec.autoscaling, spec.prefill.tensor_parallel_size,
                         spec.decode.tensor_parallel_size)


def rate_window(period_s: int) -> str:
    """A Prometheus window long enough for several scrapes yet close to the loop's period."""
    return f"{max(60, 2 * period_s)}s"


def replacing_patch(previous: dict[str, Any] | None, new: dict[str, Any]) -> dict[str, Any]:
    """A merge patch that replaces `previous` by `new`: keys only in `previous` become null
    (a merge patch otherwise keeps them, mixing two decisions' inputs)."""
    patch: dict[str, Any] = {key: None for key in (previous or {}) if key not in new}
    for key, value in new.items():
        old = (previous or {}).get(key)
        patch[key] = replacing_patch(old, value) if isinstance(value, dict) and isinstance(old, dict) else value
    return patch


def worker_urls(pods: list[dict[str, Any]], port: int) -> list[str]:
    """Scrape targets: every running worker pod with an address (pure)."""
    urls = []
    for pod in map(PodView.of, pods):
        if pod.ip and pod.phase == "Running" and not pod.deleting:
            host = f"[{pod.ip}]" if ":" in pod.ip else pod.ip
            urls.append(f"http://{host}:{port}")
    return urls


def make_source(settings: Autoscaling, api: KubeApi, namespace: str, name: str,
                port: int) -> MetricsSource:
    if settings.prometheus_url:
        return PrometheusSource(settings.prometheus_url, window=rate_window(settings.period_seconds),
                                matchers=deployment_matchers(namespace, name), worker_label="pod")

    async def targets() -> list[str]:
        pods = await api.list("Pod", namespace, labels.selector(name, labels.WORKER))
        return worker_urls(pods, port)

    return ScrapeSource(targets)


class DecisionReporter:
    """Writes each decision to status.lastDecision, and posts an Event for every action and
    for the first hold after something else (a steady hold is not news)."""

    def __init__(self, api: KubeApi, owner: dict[str, Any], previous: dict[str, Any] | None):
        self.api = api
        self.owner = owner
        self.previous = previous
        self.last_posted: Action | None = None

    async def __call__(self, decision: Decision, record: dict[str, Any]) -> None:
        meta = self.owner["metadata"]
        patch = {"status": {"lastDecision": replacing_patch(self.previous, record)}}
        await self.api.patch("PDDeployment", meta["namespace"], meta["name"], patch, sub="status")
        self.previous = record
        if decision.action is Action.HOLD and self.last_posted is Action.HOLD:
            return
        self.last_posted = decision.action
        try:
            kopf.info(self.owner, reason="SizingDecision", message=record["reason"][:1000])
        except Exception:  # events are best effort
            log.debug("event not posted", exc_info=True)


def register_autoscaler(registry: kopf.OperatorRegistry, config: OperatorConfig,
                        api: Callable[[], KubeApi]) -> None:
    """Add the autoscaler daemon to the operator's registry; `api` gives the logged-in client."""

    @kopf.daemon(GROUP, VERSION, PLURAL, registry=registry, id="autoscaler",
                 field="spec.autoscaling.enabled", value=True, cancellation_timeout=5.0)
    async def autoscaler(namespace: str, name: str, body: kopf.Body,
                         stopped: kopf.DaemonStopped, **_: Any) -> None:
        client = api()
        owner = {"apiVersion": body.get("apiVersion"), "kind": body.get("kind"),
                 "metadata": {k: body.metadata.get(k) for k in ("name", "namespace", "uid")}}
        spec = parse_spec(dict(body.get("spec", {})))
        settings = spec.autoscaling
        previous = dict((body.get("status") or {}).get("lastDecision") or {}) or None
        controller = Controller(
            name, make_source(settings, client, namespace, name, config.worker_port),
            SizingPolicy(spec_policy_config(spec)),
            KubernetesActuator(client, namespace, name),
            period_s=settings.period_seconds,
            on_decision=DecisionReporter(client, owner, previous))
        try:
            while not stopped:
                try:
                    spec = parse_spec(dict(body.get("spec", {})))
                    settings = spec.autoscaling
                    controller.policy.config = spec_policy_config(spec)  # follow spec edits
                    await controller.step()
                except SpecProblem as problem:
                    log.info("%s/%s: autoscaler waits for a valid spec: %s", namespace, name, problem)
                except Exception:
                    # Never a crash loop: the next period tries again.
                    log.exception("autoscaler period of %s/%s failed", namespace, name)
                await stopped.wait(settings.period_seconds)
        finally:
            await controller.aclose()
