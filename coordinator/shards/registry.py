"""Shards found through etcd: each registers its address, the lead reads them when it leads.

With ``coordinator shard --ha etcd://...`` a shard holds the key ``PREFIX/JOB/shards/INDEX``
(beside the coordinators' ``PREFIX/JOB/leader``) under an etcd lease of its own, renewed
while it runs, with the address sites and the lead reach it at. It takes the key the way a
coordinator takes the leader key (``coordinator.ha.etcd_election``: create it only if nobody
holds it), so a second process started for the same index waits until the first's lease
lapses instead of taking its place. A coordinator of a ``--ha`` job with no ``[shards]
addresses`` reads the keys once it is elected (``resolve``), waiting for any shard not
registered yet, and leads the shards found there for its whole term.

A shard restarted keeps its address when it listens on a fixed port (sites hold the shard
map the lead gave them when they joined); one that moves is found by the next leader.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Mapping
from dataclasses import replace

from coordinator.ha.etcd_election import EtcdElection
from coordinator.ha.options import HaOptions

log = logging.getLogger("isthmus.coordinator")
POLL_S = 0.5
SAY_EVERY_S = 10.0


def shard_key(leader_key: str, index: int) -> str:
    """Shard ``index``'s key beside the job's ``leader_key`` (``PREFIX/JOB/leader``)."""
    return f"{leader_key.rpartition('/')[0]}/shards/{index}"


def missing(found: Mapping[int, str], count: int) -> list[int]:
    """The shards 1..count-1 not registered in ``found`` (index -> address)."""
    return [i for i in range(1, count) if not found.get(i)]


class ShardRegistration:
    """Shard ``index`` holding its key while it runs (``opts``: the job's ``--ha`` options,
    with this shard's address as ``advertise``)."""

    def __init__(self, opts: HaOptions, index: int) -> None:
        self.key = shard_key(opts.key, index)
        self._election = EtcdElection(replace(opts, key=self.key))

    def start(self) -> ShardRegistration:
        self._election.start()
        return self

    def registered(self) -> bool:
        return self._election.leadership().leading

    def holder(self) -> str | None:
        """The address registered under this shard's key now (None: nobody's)."""
        holder = self._election.view().holder
        return holder.address if holder is not None else None

    def close(self) -> None:
        """Give the key up at once (its lease revoked): the next process is found sooner."""
        self._election.close(resign=True)


def resolve(opts: HaOptions, count: int, stop: threading.Event) -> list[str] | None:
    """The addresses of shards 1..count-1 as registered, in order; waits for any missing
    (saying which every ``SAY_EVERY_S``). None if ``stop`` is set first."""
    said = time.monotonic() - SAY_EVERY_S
    while not stop.is_set():
        found, problem = _read(opts, count)
        if not (gone := missing(found, count)):
            return [found[i] for i in range(1, count)]
        if time.monotonic() - said >= SAY_EVERY_S:
            keys = ", ".join(shard_key(opts.key, i) for i in gone)
            log.warning(
                "waiting for shard(s) %s to register in etcd (%s)%s: start `coordinator "
                "shard --index I --ha ...` on their hosts",
                ", ".join(map(str, gone)),
                keys,
                f"; {problem}" if problem else "",
            )
            said = time.monotonic()
        stop.wait(POLL_S)
    return None


def _read(opts: HaOptions, count: int) -> tuple[dict[int, str], str]:
    """What etcd holds under the shards' keys (index -> address), from the first endpoint
    that answers, and why none did."""
    problem = ""
    for host, port in opts.endpoints:
        try:
            return asyncio.run(_get_all(host, port, opts, count)), ""
        except Exception as exc:  # aetcd's errors, grpc's, timeouts: the next endpoint
            problem = f"etcd {host}:{port}: {exc or type(exc).__name__}"
    return {}, problem


async def _get_all(host: str, port: int, opts: HaOptions, count: int) -> dict[int, str]:
    import aetcd

    client = aetcd.Client(host, port, timeout=opts.keepalive_s)
    try:
        found = {}
        for i in range(1, count):
            got = await client.get(shard_key(opts.key, i).encode())
            if got is not None:
                found[i] = got.value.decode(errors="replace")
        return found
    finally:
        await client.close()
