"""The KV handoff between prefill and decode workers: tickets, wire format, transports,
and layer-wise streaming. Engine-independent: the engine plugs in through KVSink (decode
side) and LayerStreamer.on_layer_done (prefill side).

Decode worker:
    receiver = select_transport("tcp").receiver(sink, worker_id=ME, address="0.0.0.0:8101")
    await receiver.start()            # receiver.endpoint goes into every Ticket it issues
    ...                               # sink.lookup / write_layer / finish / abort get called
    await receiver.close()

Prefill worker (compute thread has no event loop of its own):
    bg = BackgroundLoop()             # or the server's own loop, running in another thread
    sender = select_transport("auto", ticket.kv_endpoint).sender(
        ticket.kv_endpoint, worker_id=ticket.worker_id)      # one per decode worker, reused
    streamer = LayerStreamer(ticket, sender, bg.loop, src_block_ids=..., src_block_size=16)
    for each layer: ...compute...; streamer.on_layer_done(layer, k_cache, v_cache)
    report = streamer.finish(first_token, logprob)   # END, then waits for ACK; raises TransferError
    # after ACK the prefill copy may go to the prefix cache; report has per-layer timings.
"""

from baton.kv.layout import gather_layer, scatter_layer
from baton.kv.messages import Ack, ErrorCode, ErrorInfo
from baton.kv.stream import BackgroundLoop, LayerStreamer, StreamReport
from baton.kv.ticket import Ticket
from baton.kv.transport import (
    KVReceiver,
    KVSender,
    KVSink,
    KVTransfer,
    ReceiveStats,
    TransferError,
    TransferRefused,
    TransferTimeout,
    select_transport,
)

__all__ = [
    "Ack",
    "BackgroundLoop",
    "ErrorCode",
    "ErrorInfo",
    "KVReceiver",
    "KVSender",
    "KVSink",
    "KVTransfer",
    "LayerStreamer",
    "ReceiveStats",
    "StreamReport",
    "Ticket",
    "TransferError",
    "TransferRefused",
    "TransferTimeout",
    "gather_layer",
    "scatter_layer",
    "select_transport",
]
