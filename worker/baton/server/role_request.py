"""POST /internal/role as its callers send it (the operator, `baton up --autoscale`).

No imports beyond the standard library: the operator's image has no engine (torch) in it.
"""

from __future__ import annotations

# A role switch that changes the tensor-parallel size loads and starts a new group of ranks
# before it answers: the worker's deadline for that, which its callers wait for too.
REGROUP_TIMEOUT_S = 600.0


def role_request(role: str, tensor_parallel_size: int | None = None) -> dict:
    """The body: the new role, and the ranks to regroup onto if given."""
    body: dict = {"role": role}
    if tensor_parallel_size is not None:
        body["tensor_parallel_size"] = tensor_parallel_size
    return body
