"""The re-sharding plan: every decode rank gets exactly its KV heads, each from one prefill
rank that holds it (pure), and the route tickets and coverage built on it."""

from __future__ import annotations

import time

import pytest

from baton.engine.parallel.reshard import Route, reshard_plan
from baton.engine.parallel.shards import Span, kv_head_span
from baton.kv.routes import HeadCoverage, RouteId, parse_route_id, route_ticket, target_endpoints
from baton.kv.ticket import Ticket


def _sizes(heads):
    return [n for n in range(1, 3 * heads + 1) if heads % n == 0 or n % heads == 0]


@pytest.mark.parametrize("heads", [1, 3, 4, 6, 8])
def test_every_target_gets_exactly_its_heads_from_holders(heads):
    for a in _sizes(heads):
        for b in _sizes(heads):
            routes = reshard_plan(heads, a, b)
            for target in range(b):
                mine = [r for r in routes if r.target == target]
                got = [h for r in mine for h in range(r.heads.start, r.heads.end)]
                span = kv_head_span(heads, b, target)
                assert got == list(range(span.start, span.end)), (heads, a, b, target)
                for r in mine:  # the source holds what it sends
                    held = kv_head_span(heads, a, r.source)
                    assert held.start <= r.heads.start and r.heads.end <= held.end
            # neighbouring heads from one source to one target travel as one route
            assert all(not (x.target == y.target and x.source == y.source and x.heads.end == y.heads.start)
                       for x, y in zip(routes, routes[1:]))


def test_known_plans():
    # the tiny model's 4 KV heads: prefill TP=2 into decode TP=4 and back
    assert reshard_plan(4, 2, 4) == [Route(0, 0, Span(0, 1)), Route(0, 1, Span(1, 2)),
                                     Route(1, 2, Span(2, 3)), Route(1, 3, Span(3, 4))]
    assert reshard_plan(4, 4, 2) == [Route(0, 0, Span(0, 1)), Route(1, 0, Span(1, 2)),
                                     Route(2, 1, Span(2, 3)), Route(3, 1, Span(3, 4))]
    assert reshard_plan(4, 1, 1) == [Route(0, 0, Span(0, 4))]
    # a prefill group replicating each head twice (8 ranks, 4 heads) spreads the sending
    assert {r.source for r in reshard_plan(4, 8, 8)} == set(range(8))


def test_a_size_that_cannot_split_the_heads_is_refused():
    with pytest.raises(ValueError, match="decode tensor-parallel size 2 cannot split 3 KV heads"):
        reshard_plan(3, 3, 2)


def _ticket(**changes):
    fields = dict(request_id="req-1", worker_id="d", kv_endpoint="tcp://127.0.0.1:9000", block_ids=(4, 5),
                  block_size=16, dtype="float32", num_layers=2, num_kv_heads=4, head_dim=8, head_start=0,
                  head_end=4, num_tokens=20, expires_at=time.time() + 60)
    return Ticket(**(fields | changes))


def test_route_tickets_narrow_the_heads_and_name_the_route():
    ticket = _ticket(rank_endpoints=("tcp://127.0.0.1:9000", "tcp://127.0.0.1:9001"))
    assert Ticket.from_dict(ticket.to_dict()) == ticket
    assert Ticket.from_dict({k: v for k, v in ticket.to_dict().items() if k != "rank_endpoints"}).rank_endpoints == ()
    route = RouteId("req-1", "ab12", 2, 4)
    sub = route_ticket(ticket, route, target_endpoints(ticket)[1])
    assert (sub.head_start, sub.head_end, sub.num_heads, sub.kv_endpoint) == (2, 4, 2, "tcp://127.0.0.1:9001")
    assert parse_route_id(sub.request_id) == route and sub.rank_endpoints == ()
    assert parse_route_id("req-1") is None and parse_route_id("a#kv:zz:1-2") is None
    with pytest.raises(ValueError, match="outside"):
        route_ticket(_ticket(head_start=0, head_end=2), route, "tcp://127.0.0.1:9001")
    with pytest.raises(ValueError, match="kv_endpoint"):
        _ticket(rank_endpoints=("tcp://127.0.0.1:1", "tcp://127.0.0.1:2"))


def test_coverage_completes_once_every_head_is_in():
    cover = HeadCoverage(2, 6)
    assert not cover.add(2, 4)
    assert not cover.add(2, 4)  # a retried route brings nothing new
    assert cover.add(4, 6)
    with pytest.raises(ValueError, match="not among"):
        cover.add(0, 2)
