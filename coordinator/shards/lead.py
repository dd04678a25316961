"""The lead's side of a sharded coordinator: the plan it keeps, the receipts it checks before it
counts an update, the closes it sends, and theta's digest composed from every shard's.

With ``[shards] count = K > 1`` the coordinator holds shard 0's tensors through its usual parts
(intake, running sum, outer step, theta file, checkpoint) and is the lead: it alone keeps
membership, leases, the round clock and the close records. Shards 1..K-1 hold the rest
(``coordinator.shards.shard_core``). A site pushes its parts to shards 1..K-1 first and its
part for the lead last, with their digests and receipts in the header; the lead counts the
update only when every receipt checks. At a close the lead records the keys (the spool keeps
each update's part digests), steps its own tensors, has every shard fold the same updates in
the same order (``close``: a shard that is down is waited for, and a close sent again after a
crash is answered from the shard's record), and publishes theta's digest composed from all
the tensors' digests: the value one process holding every tensor would publish.

The plan is made once, from theta_0, and kept in ``state_dir/shards.json``; a later start with
another count is refused.
"""

from __future__ import annotations

import json
import logging
import random
import threading
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

import grpc
import torch

from coordinator.persist.local_store import StoreError, write_atomic
from coordinator.records import PushHeader, Refused
from coordinator.shards.link import CountedUpdate, ShardLead
from coordinator.shards.part_store import TensorRecord, records_of
from coordinator.shards.receipts import ShardPass, sign_pass
from wire.backoff import BackoffPolicy, next_delay
from wire.digest import compose
from wire.proto import isthmus_pb2 as pb
from wire.proto import isthmus_pb2_grpc as pb_grpc
from wire.shard_plan import ShardPlan, plan_shards

log = logging.getLogger("isthmus.coordinator")
PLAN_FILE = "shards.json"
# A shard that is down is waited for as long as it takes (the round cannot close without it).
CLOSE_BACKOFF = BackoffPolicy(initial_s=0.2, cap_s=5.0, deadline_s=1e9)
WAIT_FOR = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)


def load_or_make_plan(
    state_dir: Path, count: int, sizes: Callable[[], Mapping[str, int]]
) -> ShardPlan:
    """The job's plan: as first made (``state_dir/shards.json``), or made now from theta_0's
    tensor ``sizes`` (name -> bytes)."""
    path = Path(state_dir) / PLAN_FILE
    if path.exists():
        try:
            saved = json.loads(path.read_text())
            owner = {str(n): int(i) for n, i in saved["owner"].items()}
            sizes_kept = {str(n): int(b) for n, b in saved["sizes"].items()}
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
            raise ValueError(
                f"{path} is damaged ({type(exc).__name__}: {exc}): it records how this job's "
                "model is split over its shards; restore it, or start the job in a new folder"
            ) from exc
        if saved["count"] != count:
            raise ValueError(
                f"{path}: this job's model is split over {saved['count']} shards, not {count}: "
                f"set [shards] count = {saved['count']} (a job keeps its split)"
            )
        return ShardPlan(count, owner, sizes_kept)
    plan = plan_shards(dict(sizes()), count)
    path.parent.mkdir(parents=True, exist_ok=True)
    body = {"count": count, "owner": dict(plan.owner), "sizes": dict(plan.sizes)}
    write_atomic(path, json.dumps(body).encode())
    return plan


def records_to_json(records: Sequence[TensorRecord]) -> list:
    return [[r.name, r.dtype, list(r.shape), r.digest.hex()] for r in records]


def records_from_json(items: list) -> list[TensorRecord]:
    return [TensorRecord(n, d, tuple(s), bytes.fromhex(h)) for n, d, s, h in items]


def composed(own: Mapping[str, torch.Tensor], others: Sequence[TensorRecord]) -> bytes:
    """theta's state digest from the lead's tensors and the other shards' records."""
    return compose([r.as_tuple() for r in [*records_of(own), *others]])


class LeadShards:
    """Shards 1..K-1 as the lead reaches them, and what it checks and sends them."""

    def __init__(
        self,
        plan: ShardPlan,
        key: bytes,
        addresses: Sequence[str],
        open_channel: Callable[[str], grpc.Channel],
        revive: Callable[[int], None] | None = None,
    ) -> None:
        """``addresses``: of shards 1..K-1, in order; ``revive(i)``: start shard ``i`` again
        when it is found gone (shards the lead started itself)."""
        if len(addresses) != plan.shards - 1:
            raise ValueError(f"{len(addresses)} addresses for shards 1..{plan.shards - 1}")
        self.plan, self.key = plan, key
        self.addresses = ("", *addresses)  # shard 0 is the lead: sites reach it already
        self._stubs = [pb_grpc.ShardStub(open_channel(a)) for a in addresses]
        self._remote = ShardLead([None, *self._stubs], plan, key)  # shard 0: this process
        self._revive = revive
        self.stopping = threading.Event()

    def own(self, theta: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The lead's tensors of a whole theta."""
        names = set(self.plan.names(0))
        return {n: t for n, t in theta.items() if n in names}

    def served_records(self, version: int) -> list[TensorRecord]:
        """The other shards' tensors' records of the theta they serve, which must be
        ``version`` (theta_0 at a job's first start: the lead never reads their tensors)."""
        out = []
        for i, stub in enumerate(self._stubs, start=1):
            try:
                reply = stub.Status(pb.ShardStatusRequest(), timeout=60)
            except grpc.RpcError as exc:
                raise StoreError(
                    f"shard {i} ({self.addresses[i]}) did not answer ({exc.code().name}: "
                    f"{exc.details()}): start every shard before the lead"
                ) from exc
            if reply.version != version or reply.plan_digest != self.plan.digest():
                raise StoreError(
                    f"shard {i} ({self.addresses[i]}) serves theta_{reply.version} of plan "
                    f"{reply.plan_digest}, not theta_{version} of {self.plan.digest()}: give "
                    "it this job's config and a fresh folder"
                )
            out += [
                TensorRecord(t.name, t.dtype, tuple(t.shape), bytes(t.digest))
                for t in reply.digests
            ]
        return out

    # ---- updates ----------------------------------------------------------------------

    def check_push(self, header: PushHeader) -> None:
        """Refuse a push whose other parts are not all held by their shards."""
        k = self.plan.shards
        if len(header.shard_digests) != k or len(header.shard_receipts) != k:
            raise Refused(
                "invalid",
                f"this job's model is split over {k} shards: push shards 1..{k - 1} their parts "
                "first and send their digests and receipts with this part "
                f"(got {len(header.shard_receipts)} receipts)",
            )
        bad = self._remote.missing_receipts(
            header.site, header.round, header.upload_id, list(header.shard_digests),
            header.weight, list(header.shard_receipts),
        )  # fmt: skip
        bad = [i for i in bad if i > 0]  # index 0 is this part, checked as it arrives
        if bad:
            raise Refused(
                "invalid",
                f"no valid receipt of shard {bad[0]} ({self.addresses[bad[0]]}) for upload "
                f"{header.upload_id} of round {header.round}: push that part to it again",
            )

    def pass_for(self, site: str, version: int) -> bytes:
        """The pass ``site`` shows the shards for theta ``version`` and round ``version``
        (``coordinator.shards.receipts.ShardPass``): given with theta to a leased site."""
        return sign_pass(self.key, ShardPass(site, version))

    def refuse_foreign(self, names: Sequence[str]) -> None:
        """Refuse tensors of other shards in the lead's part, naming their shard."""
        for name in names:
            if problem := self.plan.outside(name, 0, self.addresses):
                raise Refused("invalid", problem)

    # ---- closing ----------------------------------------------------------------------

    def close(self, round_number: int, updates: Sequence, epoch: int) -> list[TensorRecord]:
        """Every shard folds ``updates`` (spooled updates, in fold order) and steps, as told by
        the lead of ``epoch``; their tensors' records. A shard that cannot be reached is
        waited for (and started again when the lead started it); any other refusal raises."""
        counted = [
            CountedUpdate(u.site, u.upload_id, u.weight, u.weight, tuple(u.shard_digests))
            for u in updates
        ]
        return self._waiting(
            f"round {round_number}",
            lambda: self._remote.close_records(round_number, counted, first=1, epoch=epoch),
        )

    def align(self, version: int, epoch: int) -> None:
        """Every shard serves theta ``version``, the lead's checkpoint's, and follows the lead
        of ``epoch`` from now on (``coordinator.shards.fence``). A shard that cannot be
        reached is waited for; one that refuses stops the start (``StoreError``, naming it)."""
        request = pb.ShardAlignRequest(version=version, epoch=epoch, plan_digest=self.plan.digest())

        def one(i: int) -> None:
            try:
                self._stubs[i - 1].Align(request, timeout=60)
            except grpc.RpcError as exc:
                if exc.code() in WAIT_FOR:
                    raise
                raise StoreError(
                    f"shard {i} ({self.addresses[i]}) refused to serve theta_{version}: "
                    f"{exc.details()}"
                ) from exc

        self._waiting(
            f"theta_{version}", lambda: self._remote.each(one, range(1, self.plan.shards))
        )

    def _waiting(self, what: str, call: Callable):
        """``call()``, again after a backoff while a shard is unreachable."""
        attempt, rng = 0, random.Random()
        while True:
            try:
                return call()
            except grpc.RpcError as exc:
                if exc.code() not in WAIT_FOR:
                    raise
                attempt += 1
                log.warning("%s: a shard is unreachable (%s)", what, exc.details())
                if self._revive is not None:
                    self._revive(attempt)
                if self.stopping.wait(next_delay(CLOSE_BACKOFF, attempt, rng)):
                    raise

    @property
    def stubs(self) -> list[pb_grpc.ShardStub]:
        """Shards 1..K-1's stubs, in order."""
        return list(self._stubs)

    def states(self, timeout_s: float = 2.0) -> list[pb.ShardState]:
        """Each other shard as it answers now (``coordinator status``), side by side."""

        def ask(i: int) -> pb.ShardState:
            state = pb.ShardState(shard=i, address=self.addresses[i])
            try:
                reply = self._stubs[i - 1].Status(pb.ShardStatusRequest(), timeout=timeout_s)
            except grpc.RpcError as exc:
                state.problem = f"{exc.code().name}: {exc.details()}"
                return state
            state.version, state.parts_held = reply.version, reply.parts_held
            state.bytes = reply.bytes
            return state

        return self._remote.each(ask, range(1, self.plan.shards))

    def shard_map(self) -> pb.ShardMap:
        return pb.ShardMap(
            addresses=list(self.addresses),
            owner=dict(self.plan.owner),
            plan_digest=self.plan.digest(),
        )

    def close_channels(self) -> None:
        self.stopping.set()
        self._remote.shutdown()
