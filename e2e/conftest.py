"""One local cluster for the whole e2e session: the operator installed, nothing deployed."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from e2e.harness import ClusterProcess


@pytest.fixture(scope="session")
def cluster() -> Iterator[ClusterProcess]:
    process = ClusterProcess(extra=["--allow-host-path", "/var/tmp"])
    failed = False
    try:
        process.wait_ready()
        yield process
    except BaseException:
        failed = True
        raise
    finally:
        code = process.stop()
        if not failed and code == 0:
            process.remove()
        else:
            print(f"cluster state kept in {process.dir}")
