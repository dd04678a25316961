"""The election's decisions, without etcd: who leads at a given time, whom a standby names,
when a leader steps down, the fencing epoch, and the ``--ha`` / ``--coordinator`` lists."""

from __future__ import annotations

import pytest

from coordinator.ha.election import (
    ElectionView,
    KeyHolder,
    leadership_compute,
    should_campaign,
    standby_message,
    transition,
)
from coordinator.ha.options import advertised, ha_options, parse_ha_url
from coordinator.intake.spool_check import Wanted
from coordinator.records import UpdateKey
from wire.config_table import ConfigError
from wire.net.leader import next_address, parse_addresses

OPTS = ha_options("etcd://127.0.0.1:2379", "job", "a:7070", 6)  # margin 1 s


def mine(renewed_until: float, revision: int = 40) -> ElectionView:
    return ElectionView(7, renewed_until, KeyHolder("a:7070", 7, revision))


def test_the_key_holder_leads_until_its_margin_before_the_lease_can_lapse():
    view = mine(renewed_until=100.0)
    now = leadership_compute(98.9, view, OPTS)
    assert now.leading and now.epoch == 40 and now.leader == "a:7070"
    later = leadership_compute(99.0, view, OPTS)  # 100 - margin: etcd may elect another soon
    assert not later.leading and later.leader is None
    assert "may have lapsed" in later.reason
    assert transition(True, later) == "step_down"


def test_a_key_naming_this_address_under_another_lease_is_not_this_candidates():
    view = ElectionView(7, 100.0, KeyHolder("a:7070", 8, 40))  # an earlier process of this host
    now = leadership_compute(50.0, view, OPTS)
    assert not now.leading and now.leader == "a:7070"


def test_a_standby_names_the_leader_or_says_none_is_elected():
    other = ElectionView(7, 100.0, KeyHolder("b:7070", 9, 41))
    now = leadership_compute(50.0, other, OPTS)
    assert not now.leading and now.leader == "b:7070"
    assert standby_message(now) == "standby; the leader is b:7070"
    nobody = leadership_compute(50.0, ElectionView(7, 100.0, None, "etcd down"), OPTS)
    assert nobody.leader is None
    assert standby_message(nobody) == "standby; no leader elected (etcd down); retry"
    assert transition(False, now) == "stay"


def test_campaign_only_with_a_live_lease_and_no_holder():
    assert should_campaign(50.0, ElectionView(7, 100.0, None), OPTS)
    assert not should_campaign(50.0, ElectionView(7, 100.0, KeyHolder("b:1", 9, 2)), OPTS)
    assert not should_campaign(50.0, ElectionView(None, 100.0, None), OPTS)
    assert not should_campaign(150.0, ElectionView(7, 100.0, None), OPTS)


def test_an_elected_candidate_takes_over():
    assert transition(False, leadership_compute(1.0, mine(100.0), OPTS)) == "take_over"


def test_ha_url_parsing():
    assert parse_ha_url("etcd://10.0.0.1:2379") == ((("10.0.0.1", 2379),), "isthmus")
    assert parse_ha_url("etcd://a:1,b.example:2/jobs/x") == ((("a", 1), ("b.example", 2)), "jobs/x")
    assert parse_ha_url("etcd://[::1]:2379")[0] == (("::1", 2379),)
    opts = ha_options("etcd://a:1/p", "gpt", "h:7", 10)
    assert opts.key == "p/gpt/leader" and opts.keepalive_s == pytest.approx(10 / 3)


@pytest.mark.parametrize(
    "url",
    [
        "http://a:1",
        "etcd://",
        "etcd://a",
        "etcd://a:0",
        "etcd://a:99999",
        "etcd://a:1,",
        "etcd://a:1/..",
    ],
)
def test_malformed_ha_urls_are_refused_in_one_line(url):
    with pytest.raises(ConfigError, match="etcd://HOST:PORT"):
        parse_ha_url(url)


def test_a_short_ttl_is_refused():
    with pytest.raises(ConfigError, match="--ha-ttl"):
        ha_options("etcd://a:1", "job", "h:1", 1)


def test_advertised_address():
    assert advertised("127.0.0.1:0", "127.0.0.1:4242", None) == "127.0.0.1:4242"
    assert advertised("0.0.0.0:7070", "0.0.0.0:7070", "coord-a.dc1:7070") == "coord-a.dc1:7070"
    assert not advertised("0.0.0.0:7070", "0.0.0.0:7070", None).startswith("0.0.0.0")


def test_coordinator_lists_and_where_a_client_goes_next():
    assert parse_addresses("a:1") == (["a:1"], None)
    assert parse_addresses("a:1, b:2") == (["a:1", "b:2"], None)
    assert parse_addresses("a:1,a:1")[1] == "an address is named twice"
    assert "'b'" in parse_addresses("a:1,b")[1]
    assert parse_addresses("a")[1].startswith("expected 'HOST:PORT'")  # as for one address
    addresses = ["a:1", "b:2", "c:3"]
    assert next_address(addresses, "a:1", None) == "b:2"
    assert next_address(addresses, "c:3", None) == "a:1"
    assert next_address(addresses, "a:1", "c:3") == "c:3"  # the leader a standby named
    assert next_address(addresses, "z:9", None) == "a:1"


def test_after_a_takeover_every_update_of_the_round_and_the_next_is_wanted_once():
    key = UpdateKey("site-0")
    wanted = Wanted.after_takeover(5, frozenset())
    assert wanted.asks_for(5, key, counted={}, committing=set())
    assert not wanted.asks_for(5, key, counted={key: object()}, committing=set())
    assert not wanted.asks_for(5, key, counted={}, committing={key})
    # The old leader may have opened round 6 (theta_6 recoverable, its checkpoint not yet
    # committed) and counted updates there; it cannot have opened round 7.
    assert wanted.asks_for(6, key, counted={}, committing=set())
    assert not wanted.asks_for(6, key, counted={key: object()}, committing=set())
    assert not wanted.asks_for(7, key, counted={}, committing=set())
    assert not wanted.asks_for(4, key, counted={}, committing=set())
    assert not Wanted(5).asks_for(5, key, counted={}, committing=set())
    assert Wanted(5, frozenset({key})).asks_for(5, key, counted={}, committing=set())
    assert not Wanted(5, frozenset({key})).asks_for(6, key, counted={}, committing=set())
