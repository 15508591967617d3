import pytest


@pytest.fixture(params=["tcp", "shm"])
def transport_name(request):
    """Run an end-to-end test over each socket transport."""
    return request.param
