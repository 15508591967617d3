"""Baton's inference engine: paged KV cache, continuous batching, chunked prefill, prefix
caching, Triton kernels on GPU and torch references on CPU."""

from baton.engine.outputs import RequestOutput
from baton.engine.sampling import SamplingParams

__all__ = ["Engine", "RequestOutput", "SamplingParams"]


def __getattr__(name: str):
    # the Engine pulls in torch and the model code; import it only when asked for
    if name == "Engine":
        from baton.engine.engine import Engine

        return Engine
    raise AttributeError(name)
