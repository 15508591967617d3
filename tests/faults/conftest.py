"""The fault and load tests' `baton up` stack (fault_stack.py says how it is set up)."""

from __future__ import annotations

import re

import httpx
import psutil
import pytest

from tests.faults.fault_stack import ENV, THRESHOLD, WORKER_ARGS, Stack
from tests.local.stack_harness import UpProcess, assert_all_exit
from tests.server.workers import WorkerApi

WORKERS_LINE = re.compile(r"workers: prefill@(http://\S+), decode@(http://\S+);")


# package scope: the stack stops once the fault and load tests are done, not at the end of the run
@pytest.fixture(scope="package")
def stack(tmp_path_factory):
    up = UpProcess(["--prefill", "1", "--decode", "1", "--port", "0", "--disagg-threshold", str(THRESHOLD),
                    *WORKER_ARGS], tmp_path_factory.mktemp("faults"), env=ENV)
    started: list[psutil.Process] = []
    try:
        url = up.wait_up()
        prefill_url, decode_url = WORKERS_LINE.search(up.printed()).groups()
        model = httpx.get(f"{url}/v1/models", timeout=30).json()["data"][0]["id"]
        yield Stack(up, url, WorkerApi(prefill_url), WorkerApi(decode_url), model)
        started = up.descendants()  # restarted servers included: they must stop as well
    finally:
        code = up.stop()
    assert code == 0, up.output()
    assert_all_exit(started)
