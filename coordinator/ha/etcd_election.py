"""The election's I/O: an etcd lease, its renewals, the election transaction, the key's watch.

``aetcd`` is asyncio, the coordinator is threads: the client runs on an event loop of its own
thread, and the rest of the coordinator sees only ``view()`` (an ``ElectionView`` snapshot) and
``leadership()`` (``coordinator.ha.election.leadership_compute`` of it at the current time), both
safe from any thread. What to do about it is decided there; this module only keeps the view
true:

* a lease of ``ttl_s``, renewed every TTL/3; ``renewed_until`` counts from when each renewal
  was *sent*. A lease etcd no longer knows (renewal answered with TTL 0) is replaced by a new
  one, which a deposed leader's coordinator never uses: it steps down and exits.
* the leader key, read, then watched from the revision after the read (each event updates the
  view; a re-read every TTL/3 mends a missed one); when it does not exist, the election
  transaction ``create_revision(key) == 0 -> put(key, advertise, lease)``.
* an endpoint that fails is left for the next one, after a pause of up to a second.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import replace

from coordinator.ha.election import (
    ElectionView,
    KeyHolder,
    Leadership,
    leadership_compute,
    should_campaign,
)
from coordinator.ha.options import HaOptions

log = logging.getLogger("isthmus.coordinator")


class LeaseLost(Exception):
    """etcd no longer knows this candidate's lease."""


class EtcdElection:
    """One candidate in the election of ``opts.key``."""

    def __init__(self, opts: HaOptions, clock: Callable[[], float] = time.monotonic) -> None:
        self.opts, self.clock = opts, clock
        self._cond = threading.Condition()
        self._view = ElectionView()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._run, name="etcd-election", daemon=True)
        self._client = None
        self._task: asyncio.Task | None = None
        self._stopping = False

    # ---- what the coordinator sees ----------------------------------------------------------

    def start(self) -> EtcdElection:
        self._thread.start()
        return self

    def view(self) -> ElectionView:
        with self._cond:
            return self._view

    def leadership(self) -> Leadership:
        return leadership_compute(self.clock(), self.view(), self.opts)

    def wait(self, timeout_s: float) -> None:
        """Return when the view changes, or after ``timeout_s``."""
        with self._cond:
            self._cond.wait(timeout_s)

    def close(self, resign: bool = False, timeout_s: float = 3.0) -> None:
        """Leave the election; with ``resign``, give the leadership up at once (revoke the
        lease, and etcd deletes the key) rather than letting a standby wait out the TTL."""
        self._stopping = True  # first: no campaign with a new lease after the revoke
        lease, client = self.view().lease, self._client
        if resign and lease is not None and client is not None and self._thread.is_alive():
            done = asyncio.run_coroutine_threadsafe(client.revoke_lease(lease), self._loop)
            try:
                done.result(timeout_s)
                log.info("left the election (etcd lease %x revoked)", lease)
            except Exception as exc:  # the lease lapses by itself within the TTL
                log.warning("could not revoke the etcd lease: %s", exc)
        if self._thread.is_alive() and self._task is not None:
            self._loop.call_soon_threadsafe(self._task.cancel)
            self._thread.join(timeout=timeout_s)

    # ---- the loop thread --------------------------------------------------------------------

    def _set(self, **changes) -> None:
        with self._cond:
            self._view = replace(self._view, **changes)
            self._cond.notify_all()

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        self._task = self._loop.create_task(self._main())
        with contextlib.suppress(asyncio.CancelledError):
            self._loop.run_until_complete(self._task)

    async def _main(self) -> None:
        import aetcd

        turn = 0
        while not self._stopping:
            host, port = self.opts.endpoints[turn % len(self.opts.endpoints)]
            client = aetcd.Client(host, port, timeout=self.opts.keepalive_s)
            self._client = client
            try:
                await self._session(client)
            except LeaseLost:
                log.warning("etcd lease %x lapsed; a new one is granted", self.view().lease or 0)
                self._set(lease=None, renewed_until=float("-inf"))
            except Exception as exc:  # aetcd's errors, grpc's, timeouts: try the next endpoint
                if self._stopping:
                    break
                log.warning("etcd %s:%d: %s", host, port, exc or type(exc).__name__)
                self._set(error=f"etcd {host}:{port}: {exc or type(exc).__name__}")
                turn += 1
                await asyncio.sleep(min(1.0, self.opts.keepalive_s))
            finally:
                with contextlib.suppress(Exception):
                    await client.close()

    async def _session(self, client) -> None:
        if self.view().lease is None:
            sent = self.clock()
            lease = await client.lease(self.opts.ttl_s)
            self._set(lease=lease.id, renewed_until=sent + lease.ttl, error="")
        tasks = [
            asyncio.ensure_future(self._keepalive(client)),
            asyncio.ensure_future(self._follow(client)),
        ]
        try:
            done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
            for task in done:
                task.result()
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def _keepalive(self, client) -> None:
        while not self._stopping:
            lease = self.view().lease
            sent = self.clock()
            try:
                reply = await client.refresh_lease(lease)
            except Exception as exc:
                if "lease not found" in str(exc):  # revoked, or expired while unrenewed
                    raise LeaseLost(lease) from exc
                raise
            if reply is None or reply.TTL <= 0:
                raise LeaseLost(lease)
            self._set(renewed_until=sent + reply.TTL, error="")
            await asyncio.sleep(self.opts.keepalive_s)

    async def _follow(self, client) -> None:
        """Keep ``holder`` true: watch the key, read it, campaign while nobody holds it."""
        events: asyncio.Queue = asyncio.Queue()
        # The watch first, from the current revision: a change after it is never missed,
        # and each event (or TTL/3 without one) is followed by a fresh read.
        watch = await client.watch(self.opts.key.encode())
        pump = asyncio.ensure_future(_pump(watch, events))
        try:
            while not self._stopping:
                await self._read(client)
                if should_campaign(self.clock(), self.view(), self.opts):
                    await self._campaign(client)
                    await self._read(client)
                await self._next_event(events)
        finally:
            pump.cancel()
            with contextlib.suppress(Exception):
                await watch.cancel()

    async def _next_event(self, events: asyncio.Queue) -> None:
        """Wait for the key's next change (or TTL/3, then the key is read again anyway)."""
        with contextlib.suppress(asyncio.TimeoutError):
            event = await asyncio.wait_for(events.get(), self.opts.keepalive_s)
            if isinstance(event, BaseException):
                raise event

    async def _read(self, client) -> None:
        got = await client.get(self.opts.key.encode())
        holder = None
        if got is not None:
            holder = KeyHolder(got.value.decode(errors="replace"), got.lease, got.create_revision)
        self._set(holder=holder)

    async def _campaign(self, client) -> None:
        key, lease = self.opts.key.encode(), self.view().lease
        t = client.transactions
        won, _ = await client.transaction(
            compare=[t.create(key) == 0],
            success=[t.put(key, self.opts.advertise.encode(), lease=lease)],
            failure=[],
        )
        if won:
            log.info("won the election of %s as %s", self.opts.key, self.opts.advertise)


async def _pump(watch, events: asyncio.Queue) -> None:
    """The watch's events into ``events`` (a wake-up each; the key is read again)."""
    try:
        async for event in watch:
            await events.put(event)
    except asyncio.CancelledError:
        raise
    except Exception as exc:  # the stream broke: the session starts again
        await events.put(exc)
