"""Fault injection switched on by environment variables (tests only; off when unset).

BATON_TEST_CORRUPT_LAYER=n        flip a byte of layer n the first time it is sent for each
                                  request (the receiver's checksum catches it, the sender
                                  re-sends the kept copy)
BATON_TEST_CORRUPT_PREFIX=p       ...only for request ids starting with p (default: all)
BATON_TEST_LAYER_DELAY_S=s        sleep s seconds before each layer a step streams goes out,
                                  once per layer however many prompts the step holds (a slow
                                  prefill, so a test can act mid-transfer)
"""

from __future__ import annotations

import os
import threading
import time


def corrupt_layer_hook():
    """A sender wire hook, or None when the switch is off."""
    raw = os.environ.get("BATON_TEST_CORRUPT_LAYER", "")
    if not raw:
        return None
    layer = int(raw)
    prefix = os.environ.get("BATON_TEST_CORRUPT_PREFIX", "")
    done: set[str] = set()

    def hook(header, view):
        rid = header.request_id
        if header.layer != layer or not rid.startswith(prefix) or rid in done:
            return view
        done.add(rid)
        corrupted = bytearray(view)
        corrupted[len(corrupted) // 2] ^= 0xFF
        return corrupted

    return hook


class LayerDelay:
    """A slow model: each layer of a step takes `seconds` longer, for every prompt in it.

    The step's listeners run layer by layer on the engine thread (layer 0 of every prompt,
    then layer 1, ...), so a layer other than the last one delayed is a new layer of a
    step: it is delayed, and the other prompts' copies of it are not."""

    def __init__(self, seconds: float):
        self.seconds = seconds
        self._last: int | None = None
        self._lock = threading.Lock()

    def before(self, layer: int) -> None:
        with self._lock:
            new_layer, self._last = layer != self._last, layer
        if new_layer:
            time.sleep(self.seconds)


_DELAY: LayerDelay | None = None


def layer_delay() -> LayerDelay | None:
    """This process's LayerDelay, or None when the switch is off."""
    global _DELAY
    seconds = float(os.environ.get("BATON_TEST_LAYER_DELAY_S", "0") or 0)
    if seconds <= 0:
        return None
    if _DELAY is None or _DELAY.seconds != seconds:
        _DELAY = LayerDelay(seconds)
    return _DELAY
