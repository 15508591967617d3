"""A GGUF file in a k-quant mix on a PersistentVolumeClaim (model.source: pvc, model.path
naming the file): the workers rewrite its blocks at load (quant/transcode.py), say so in their
logs, and answer as the offline engine does on the same file.
"""

from __future__ import annotations

import json

import openai
import pytest

from e2e.harness import apply_and_wait_ready, router_url

pytestmark = pytest.mark.slow
NAME = "kquant"
CLAIM = "kquant-weights"
FILE = "smollm2-kquant-mix.gguf"


@pytest.fixture(scope="module")
def model_file(cluster):
    from e2e.models import write_kquant_gguf

    claim = {"apiVersion": "v1", "kind": "PersistentVolumeClaim", "metadata": {"name": CLAIM},
             "spec": {"accessModes": ["ReadOnlyMany"], "resources": {"requests": {"storage": "1Gi"}}}}
    path = cluster.dir / f"{CLAIM}.json"
    path.write_text(json.dumps(claim))
    cluster.kubectl("apply", "-f", str(path))
    volume = cluster.dir / "state" / "volumes" / f"default_{CLAIM}"  # where the node keeps the claim's files
    volume.mkdir(parents=True, exist_ok=True)
    return write_kquant_gguf(volume / FILE)


@pytest.fixture(scope="module")
def deployed(cluster, model_file):
    manifest = {"apiVersion": "baton.dev/v1alpha1", "kind": "PDDeployment", "metadata": {"name": NAME},
                "spec": {"image": "baton-worker:0.1.0", "engine": {"dtype": "float32", "kvCacheMemoryGb": 0.25},
                         "model": {"source": "pvc", "claimName": CLAIM, "path": FILE}}}
    yield apply_and_wait_ready(cluster, manifest)
    cluster.kubectl("delete", "pdd", NAME, "--wait=true", "--timeout=240s", timeout=260)
    cluster.kubectl("delete", "pvc", CLAIM, "--wait=true", timeout=60)


def test_workers_serve_a_kquant_file_from_a_claim_as_the_offline_engine_does(cluster, model_file, deployed):
    from baton.engine.engine import Engine
    from baton.engine.sampling import SamplingParams

    logs = cluster.pod_logs(NAME)
    assert logs.count("rewritten at load: 1 x IQ4_XS as IQ4_NL, 1 x Q2_K as Q8_0 (requantized)") >= 2, logs[-3000:]  # the prefill and decode workers
    engine = Engine(model=str(model_file), dtype="float32", num_kv_blocks=64)
    prompt = "The capital of France is"
    offline = engine.generate([engine.tokenizer.encode(prompt)],
                              SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))[0]
    client = openai.OpenAI(base_url=f"{router_url(cluster, deployed)}/v1", api_key="none",
                           max_retries=0, timeout=120)
    model = client.models.list().data[0].id
    assert model == "smollm2-kquant-mix"
    served = client.completions.create(model=model, prompt=prompt, max_tokens=12, temperature=0,
                                       extra_body={"ignore_eos": True})
    assert served.choices[0].text == offline.text
