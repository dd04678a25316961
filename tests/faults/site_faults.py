"""Faults of a site: ``kill -9`` of its agent and trainers at a chosen moment of round 1, then
a restart on the same run dir, well within the lease TTL (the round waits for the site).

Short moments are widened with the site's relay: a slow downlink makes the fetch last
seconds, a slow uplink the push.
"""

from __future__ import annotations

from faults.cluster import Cluster

ROUND = 1
SLOW_BPS = 24_000  # theta and an update are ~100 KB: a transfer lasts seconds


def _restart(c: Cluster, index: int, check_killed=None) -> None:
    """kill -9 the site, run ``check_killed`` on the dead site, start it again."""
    site = c.sites[index]
    c.mark_fault()
    site.kill()
    try:
        if check_killed is not None:
            check_killed(site)
    finally:  # the job goes on either way, so the run still ends and is judged
        c.relays[index].set_rate(None)
        site.start()


def kill_while_fetching(c: Cluster) -> None:
    """Killed while theta_1 streams down."""
    c.wait_trained(c.sites[0], ROUND - 1, 2)
    c.relays[0].set_rate(SLOW_BPS, direction="down")
    c.wait_phase("site-0", "fetching", ROUND)
    _restart(c, 0)


def kill_while_training(c: Cluster) -> None:
    """Killed between two inner steps of round 1, after a site checkpoint (resumes there)."""
    c.wait_trained(c.sites[0], ROUND, 2)

    def mid_round(site) -> None:
        done = [cp for cp in site.checkpointed() if cp[0] == ROUND]
        assert max(done)[1] < c.spec.round_steps, f"killed after training ended: {done}"

    _restart(c, 0, mid_round)


def kill_while_pushing(c: Cluster) -> None:
    """Killed while its round-1 update streams up; the restarted site sends it again.

    The moment is read off the relay, not off heartbeats: on a slow uplink the heartbeats
    queue behind the update on the same connection, so the phase they report is stale.
    """
    site, relay = c.sites[0], c.relays[0]
    c.wait_trained(site, ROUND, 2)
    relay.set_rate(SLOW_BPS, direction="up")
    c.wait_trained(site, ROUND, c.spec.round_steps)  # steps done: the update is handed over
    sent = relay.counters().bytes_up
    c.wait_for(lambda: relay.counters().bytes_up > sent + 20_000, 30, "the push to stream")
    reply = c.status()
    assert "site-0" not in _pushed(reply, ROUND), "the update counted before the kill"
    _restart(c, 0)


def kill_while_idle(c: Cluster) -> None:
    """Killed after its update counted, while round 1 waits for the other site."""
    c.wait_trained(c.sites[1], ROUND, 2)
    c.relays[1].set_rate(SLOW_BPS, direction="up")  # site-1's push takes seconds

    def site0_counted():
        reply = c.status()
        return (
            reply is not None and reply.round.round == ROUND and _pushed(reply, ROUND) == {"site-0"}
        )

    c.wait_for(site0_counted, 60, "site-0's round-1 update alone to count")
    _restart(c, 0)
    c.relays[1].set_rate(None)


def _pushed(reply, round_number: int) -> set[str]:
    return {
        s.site
        for s in reply.sites
        if s.last_update_age_s >= 0 and s.last_round_pushed == round_number
    }
