"""How many queued bytes wake a receiver (SO_RCVLOWAT), from the frames it knows are due
(pure: no sockets, no clocks).

A prompt's KV arrives one LAYER frame at a time, paced by the prefill's compute, and a
receiver that wakes for every frame pays for each wakeup, on caches gone cold since the
last: on a 2-core Xeon a decode worker's receiver spent 10-11 ms of CPU per 64-token
prompt woken per frame, 6.7 ms woken this way (bench/arrival_cost.py, docs/benchmarks.md).
The receiver knows what is due on a connection: each transfer under way
has its ticket's layers still to come, every frame of one transfer the same size. Waking
once half of that has queued reads a transfer in a handful of batches (the frames left
halve each time), while the layers read so far still show the decode worker the pace of
the arrival (engine/commit_hold.py forecasts the commit from it).

A sender may stop short (its prefill failed or was cancelled: no more frames, no END), so
bytes that are due may never come. Transfers with no frame for a while no longer count, and
the connection goes back to waking on any byte when nothing has been read for that long
(kv/conn.py).
"""

from __future__ import annotations

from collections.abc import Iterable

# No more than this is waited for at once: well under the receive buffer, and a large
# frame's payload is still read in a few large pieces.
LOW_WATER_CAP_BYTES = 1 << 20
# A transfer whose latest frame is older than this is not counted, and a connection that has
# read nothing for this long wakes on any byte again.
LOW_WATER_PATIENCE_S = 0.25


def low_water_bytes(due: Iterable[tuple[int, int]], cap: int = LOW_WATER_CAP_BYTES) -> int:
    """Queued bytes that should wake the reader of a connection. `due`: for each transfer
    under way on it, (LAYER frames still to come, bytes of one such frame). Half of what is
    due, at most `cap`; 1 (any byte) while fewer than two frames are due: the last frame and
    the END after it are read as they come. Never more than what is due, so a partly read
    frame is always finished."""
    frames = total = 0
    for count, nbytes in due:
        if count > 0 and nbytes > 0:
            frames += count
            total += count * nbytes
    if frames < 2:
        return 1
    return max(1, min(cap, total // 2))
