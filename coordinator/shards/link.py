"""The lead's link to shards: the receipts it checks and the closes it sends.

A site pushes each part of its update to its shard (``site_client.transfer.sharded``), which
answers with a receipt. The lead counts the update only once every receipt checks
(``ShardLead.missing_receipts``), and closes a round by sending each shard the counted parts in
fold order (``ShardLead.close``, every shard at once); theta's digest is composed from the
shards' per-tensor digests, the value one process holding every tensor computes
(``wire.digest.compose``).
"""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from coordinator.shards.part_store import TensorRecord
from coordinator.shards.receipts import PartReceipt, valid
from wire.digest import compose
from wire.proto import isthmus_pb2 as pb
from wire.proto import isthmus_pb2_grpc as pb_grpc
from wire.shard_plan import ShardPlan

CHUNK_BYTES = 1 << 20
CLOSE_TIMEOUT_S = 600.0


@dataclass(frozen=True)
class CountedUpdate:
    """An update the lead counted: its parts' digests, one per shard, and its weights."""

    site: str
    upload_id: str
    weight: float
    alpha: float
    digests: tuple[bytes, ...]


def records_from_pb(items) -> list[TensorRecord]:
    """``TensorDigest`` messages as records."""
    return [TensorRecord(t.name, t.dtype, tuple(t.shape), bytes(t.digest)) for t in items]


class ShardLead:
    """The lead's side: the shards' stubs, the plan they share and the key of their receipts."""

    def __init__(self, stubs: Sequence[pb_grpc.ShardStub], plan: ShardPlan, key: bytes) -> None:
        if len(stubs) != plan.shards:
            raise ValueError(f"{len(stubs)} shard addresses for a plan of {plan.shards} shards")
        self.stubs, self.plan, self.key = list(stubs), plan, key
        self._pool = ThreadPoolExecutor(max_workers=plan.shards, thread_name_prefix="shard-link")

    def missing_receipts(
        self,
        site: str,
        round_number: int,
        upload_id: str,
        digests: Sequence[bytes],
        weight: float,
        receipts: Sequence[bytes],
    ) -> list[int]:
        """The shards whose receipt for this update is absent or does not check."""
        if len(digests) != self.plan.shards or len(receipts) != self.plan.shards:
            return list(range(self.plan.shards))
        return [
            i
            for i in range(self.plan.shards)
            if not valid(
                self.key,
                PartReceipt(i, round_number, site, upload_id, digests[i], weight),
                receipts[i],
            )
        ]

    def close(
        self, round_number: int, updates: Sequence[CountedUpdate], epoch: int = 0
    ) -> tuple[int, bytes]:
        """Close ``round_number`` on every shard at once; the version now served and theta's
        composed state digest. Raises the first shard's ``grpc.RpcError``."""
        records = self.close_records(round_number, updates, epoch=epoch)
        return round_number + 1, compose([r.as_tuple() for r in records])

    def close_records(
        self, round_number: int, updates: Sequence[CountedUpdate], first: int = 0, epoch: int = 0
    ) -> list[TensorRecord]:
        """Close ``round_number`` on shards ``first``..K-1 at once, as the lead of ``epoch``
        (``coordinator.shards.fence``); their tensors' records."""

        def one(i: int) -> pb.ShardCloseReply:
            request = pb.ShardCloseRequest(
                round=round_number,
                epoch=epoch,
                plan_digest=self.plan.digest(),
                parts=[
                    pb.ShardPart(
                        site=u.site,
                        upload_id=u.upload_id,
                        digest=u.digests[i],
                        weight=u.weight,
                        alpha=u.alpha,
                    )
                    for u in updates
                ],
            )
            return self.stubs[i].Close(request, timeout=CLOSE_TIMEOUT_S)

        replies = list(self._pool.map(one, range(first, self.plan.shards)))
        versions = {r.version for r in replies}
        if versions - {round_number + 1}:
            want = round_number + 1
            raise RuntimeError(f"shards answered versions {sorted(versions)}, not {want}")
        return [record for r in replies for record in records_from_pb(r.tensors)]

    def each(self, fn, indices) -> list:
        """``fn(i)`` for each shard index, side by side on the link's threads."""
        return list(self._pool.map(fn, indices))

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False)
