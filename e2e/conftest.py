"""One local cluster for the whole e2e session: the operator installed, nothing deployed."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from e2e.harness import ClusterProcess


@pytest.fixture(scope="session")
def cluster(request: pytest.FixtureRequest) -> Iterator[ClusterProcess]:
    # /var/tmp is where the hostPath scenario writes its model (and outside pods' /tmp)
    process = ClusterProcess(extra=["--allow-host-path", "/var/tmp"])
    try:
        process.wait_ready()
        yield process
    finally:
        code = process.stop()
        if request.session.testsfailed or code != 0:
            print(f"\ncluster exit code {code}; its folder (logs, flows, requests) is kept "
                  f"in {process.dir}")
        else:
            process.remove()


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """`helm uninstall` removes the operator every other scenario needs: it runs last,
    whatever the files' order."""
    last = [item for item in items if item.name == "test_helm_uninstall_removes_deployments_then_the_operator"]
    items[:] = [item for item in items if item not in last] + last
