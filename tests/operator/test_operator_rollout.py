"""Rolling pods through the real operator: a broken image stops the rollout, and putting the
image back reaches the broken pod."""

from __future__ import annotations

import asyncio

import pytest
from operator_harness import FakeWorker, api, eventually
from test_operator_kmock import PDD, make_all_ready, patch_spec, pdd_body, pods

pytestmark = pytest.mark.asyncio


def template(emulator, name):
    return pods(emulator)[name]["metadata"]["annotations"]["baton.dev/template-hash"]


async def test_a_broken_image_is_fixed_by_editing_spec_image(emulator, operator_factory):
    async with operator_factory():
        await api(emulator, "POST", PDD, pdd_body(prefill={"replicas": 1}, decode={"replicas": 1}))
        await eventually(lambda: len(pods(emulator)) == 2, what="2 pods")
        await make_all_ready(emulator, FakeWorker.HOSTS[1:])
        first = set(pods(emulator))
        good_hash = {template(emulator, n) for n in first}

        await patch_spec(emulator, {"image": "baton-worker:broken"}, generation=2)
        # the rolled pod drains and goes while its replacement starts
        [broken] = await eventually(lambda: len(pods(emulator)) == 2 and [
            n for n in pods(emulator) if n not in first], what="one pod rolled to the new image")
        [kept] = [n for n in pods(emulator) if n in first]
        await asyncio.sleep(1.0)  # the new pod never becomes ready: the rollout stops here
        assert set(pods(emulator)) == {kept, broken}

        await patch_spec(emulator, {"image": "baton-worker:test"}, generation=3)
        await eventually(lambda: broken not in pods(emulator) and len(pods(emulator)) == 2,
                         what="the broken pod replaced")
        assert kept in pods(emulator)  # the pod that kept serving was never touched
        assert {template(emulator, n) for n in pods(emulator)} == good_hash  # the good image
