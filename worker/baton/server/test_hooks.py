"""Fault injection switched on by environment variables (tests only; off when unset).

BATON_TEST_CORRUPT_LAYER=n        flip a byte of layer n the first time it is sent for each
                                  request (the receiver's checksum catches it, the sender
                                  re-sends the kept copy)
BATON_TEST_CORRUPT_PREFIX=p       ...only for request ids starting with p (default: all)
BATON_TEST_LAYER_DELAY_S=s        sleep s seconds after each streamed layer (a slow prefill,
                                  so a test can act mid-transfer)
"""

from __future__ import annotations

import os


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


def layer_delay_s() -> float:
    return float(os.environ.get("BATON_TEST_LAYER_DELAY_S", "0") or 0)
