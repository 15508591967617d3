"""A model other than the bundled one, from a node folder (model.source: hostPath): the
workers and the router read the same model, so the router tokenizes and detokenizes with that
model's tokenizer and the answers equal the offline engine's on that folder.
"""

from __future__ import annotations

import openai
import pytest

from e2e.harness import apply_and_wait_ready, router_url

pytestmark = pytest.mark.slow
NAME = "shuffled"


@pytest.fixture(scope="module")
def folder(cluster):
    from e2e.models import write_model

    path = cluster.dir / "models" / NAME  # under /var/tmp: the cluster allows that prefix
    path.mkdir(parents=True)
    return write_model(path)


@pytest.fixture(scope="module")
def deployed(cluster, folder):
    manifest = {"apiVersion": "baton.dev/v1alpha1", "kind": "PDDeployment",
                "metadata": {"name": NAME},
                "spec": {"image": "baton-worker:0.1.0", "engine": {"dtype": "float32", "kvCacheMemoryGb": 0.25},
                         "model": {"source": "hostPath", "path": str(folder)}}}
    yield apply_and_wait_ready(cluster, manifest)
    cluster.kubectl("delete", "pdd", NAME, "--wait=true", "--timeout=240s", timeout=260)


def test_the_router_speaks_the_models_own_tokenizer(cluster, folder, deployed):
    from baton.engine.engine import Engine
    from baton.engine.loader import load_source
    from baton.engine.sampling import SamplingParams

    engine = Engine(model=str(folder), dtype="float32", num_kv_blocks=64)
    prompt = "The capital of France is"
    ids = engine.tokenizer.encode(prompt)
    offline = engine.generate([ids], SamplingParams(max_tokens=12, temperature=0.0,
                                                    ignore_eos=True))[0]
    bundled = load_source(None).tokenizer
    assert bundled.encode(prompt) != ids  # the two tokenizers really differ
    client = openai.OpenAI(base_url=f"{router_url(cluster, deployed)}/v1", api_key="none",
                           max_retries=0, timeout=120)
    model = client.models.list().data[0].id
    served = client.completions.create(model=model, prompt=prompt, max_tokens=12, temperature=0,
                                       extra_body={"ignore_eos": True})
    assert served.usage.prompt_tokens == len(ids)
    assert served.choices[0].text == offline.text
