"""`tandem bench serve --traffic-mix` on its own (bench/traffic_mix.py): parsing, seeded draws
and the fields each class travels as. The live run is in tests/router/test_traffic_classes.py."""

from __future__ import annotations

import pytest

from bench.datasets import BenchRequest
from bench.serve_bench import LoadConfig, schedule
from bench.traffic_mix import assign, body_fields, keep_only, parse_mix, parse_priorities


def test_parse_mix_and_priorities():
    assert parse_mix("interactive:0.3,batch:0.7") == {"interactive": 0.3, "batch": 0.7}
    for bad in ("interactive:0.3", "a:0.5,a:0.5", "a:x", "a:0,b:1", ":1"):
        with pytest.raises(ValueError):
            parse_mix(bad)
    mix = parse_mix("interactive:0.3,batch:0.7")
    assert parse_priorities("interactive:0,batch:10", mix) == {"interactive": 0, "batch": 10}
    with pytest.raises(ValueError, match="lacks batch"):
        parse_priorities("interactive:0", mix)


def test_draws_follow_the_shares_and_the_seed():
    requests = [BenchRequest(f"p{i}", 4, -1) for i in range(2000)]
    mix = parse_mix("interactive:0.3,batch:0.7")
    drawn = assign(requests, mix, seed=1)
    share = sum(r.traffic_class == "interactive" for r in drawn) / len(drawn)
    assert 0.26 < share < 0.34
    assert [r.traffic_class for r in drawn] == [r.traffic_class for r in assign(requests, mix, seed=1)]
    assert [r.traffic_class for r in drawn] != [r.traffic_class for r in assign(requests, mix, seed=2)]


def test_a_class_travels_by_name_or_as_vllms_priority_alone():
    request = BenchRequest("p", 4, -1, traffic_class="batch")
    assert LoadConfig("http://x/v1", "m").body(request)["traffic_class"] == "batch"
    fields = body_fields("priority", {"interactive": 0, "batch": 10})
    body = LoadConfig("http://x/v1", "m", class_fields=fields).body(request)
    assert body["priority"] == 10 and "traffic_class" not in body
    assert "traffic_class" not in LoadConfig("http://x/v1", "m").body(BenchRequest("p", 4, -1))


def test_traffic_only_keeps_the_mixs_arrival_times():
    requests = assign([BenchRequest(f"p{i}", 4, -1) for i in range(50)], parse_mix("interactive:0.3,batch:0.7"), 3)
    offsets = schedule(len(requests), LoadConfig("http://x/v1", "m", request_rate=4.0, seed=3))
    kept, kept_offsets = keep_only(requests, offsets, "interactive")
    assert kept and all(r.traffic_class == "interactive" for r in kept)
    assert kept_offsets == [o for r, o in zip(requests, offsets) if r.traffic_class == "interactive"]
