import json
import time

import pytest
from kv_helpers import make_ticket

from baton.kv.endpoint import parse_endpoint
from baton.kv.ticket import Ticket


def test_round_trip_through_json():
    ticket = make_ticket()
    again = Ticket.from_dict(json.loads(json.dumps(ticket.to_dict())))
    assert again == ticket
    assert again.layer_payload_shape == (2, 40, 4, 8)
    assert again.layer_payload_nbytes == 2 * 40 * 4 * 8 * 4
    assert again.total_payload_nbytes == 4 * again.layer_payload_nbytes


@pytest.mark.parametrize(
    "overrides, field",
    [
        ({"block_ids": [1, -2, 3]}, "block_ids[1]"),
        ({"block_ids": [1, 2]}, "block_ids"),  # 2 x 16 < 40 tokens
        ({"block_ids": [1, 1, 2]}, "block_ids"),
        ({"head_start": 2, "head_end": 5}, "head_end"),
        ({"head_start": 3, "head_end": 3}, "head_end"),
        ({"head_start": -1}, "head_start"),
        ({"dtype": "int8"}, "dtype"),
        ({"num_tokens": 0}, "num_tokens"),
        ({"block_size": True}, "block_size"),
        ({"request_id": ""}, "request_id"),
        ({"kv_endpoint": "http://x:1"}, "kv_endpoint"),
        ({"kv_endpoint": "tcp://host"}, "kv_endpoint"),
        ({"expires_at": "soon"}, "expires_at"),
    ],
)
def test_bad_fields_are_named(overrides, field):
    data = make_ticket().to_dict() | overrides
    with pytest.raises(ValueError) as err:
        Ticket.from_dict(data)
    assert str(err.value).startswith(field + ":"), str(err.value)


def test_expired_ticket_is_refused_unless_allowed():
    data = make_ticket(expires_at=time.time() - 1).to_dict()
    with pytest.raises(ValueError, match="^expires_at: .*expired"):
        Ticket.from_dict(data)
    assert Ticket.from_dict(data, allow_expired=True).is_expired()


def test_unknown_and_missing_fields():
    data = make_ticket().to_dict()
    with pytest.raises(ValueError, match="^colour: unknown"):
        Ticket.from_dict(data | {"colour": "red"})
    del data["head_dim"]
    with pytest.raises(ValueError, match="^head_dim: missing"):
        Ticket.from_dict(data)
    with pytest.raises(ValueError, match="ticket: expected a JSON object"):
        Ticket.from_dict([1, 2])


def test_endpoints():
    assert str(parse_endpoint("tcp://127.0.0.1:8101")) == "tcp://127.0.0.1:8101"
    assert parse_endpoint("tcp://[::1]:9").host == "::1"
    assert parse_endpoint("shm://decode-0").name == "decode-0"
    for bad in ("shm://a/b", "tcp://h:0", "tcp://h:70000", "udp://h:1", "plain"):
        with pytest.raises(ValueError, match="^kv_endpoint:"):
            parse_endpoint(bad)
