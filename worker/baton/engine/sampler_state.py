"""A seeded request's sampler state as text, to travel with a handoff (pure).

The state is the request's CPU generator after the tokens sampled so far (sampling.draw_noise
draws on the CPU on every device, so one format serves every worker). The text names its
format, so a receiver refuses a state it cannot continue instead of sampling another stream.
"""

from __future__ import annotations

import base64
import binascii

import torch

FORMAT = "torch-cpu-mt19937/1"
STATE_BYTES = torch.Generator().get_state().numel()
MAX_TEXT_CHARS = 4 * STATE_BYTES  # base64 of the state is 4/3 of it; anything longer is bad


def export_state(generator: torch.Generator | None) -> str | None:
    """`FORMAT:base64(state)`, or None for a request without a generator (no seed)."""
    if generator is None:
        return None
    if generator.device.type != "cpu":
        raise ValueError(f"sampler state: only CPU generators travel, got one on {generator.device}")
    raw = generator.get_state().numpy().tobytes()
    return f"{FORMAT}:{base64.b64encode(raw).decode()}"


def restore_state(text: object) -> torch.Generator:
    """A generator continuing exactly where the exported one stopped; ValueError naming the
    problem for anything else."""
    if not isinstance(text, str) or len(text) > MAX_TEXT_CHARS:
        raise ValueError(f"sampler_state: expected a string of at most {MAX_TEXT_CHARS} chars")
    fmt, sep, body = text.partition(":")
    if not sep or fmt != FORMAT:
        raise ValueError(f"sampler_state: format {fmt!r} is not {FORMAT!r}")
    try:
        raw = base64.b64decode(body, validate=True)
    except (binascii.Error, ValueError):
        raise ValueError("sampler_state: the state is not base64") from None
    if len(raw) != STATE_BYTES:
        raise ValueError(f"sampler_state: {len(raw)} state bytes, expected {STATE_BYTES}")
    generator = torch.Generator()
    try:
        generator.set_state(torch.frombuffer(bytearray(raw), dtype=torch.uint8))
    except RuntimeError as exc:
        raise ValueError(f"sampler_state: not a valid generator state ({exc})") from None
    return generator
