"""Small types the coordinator's parts share: refusals, keys of updates, per-site records, the
served theta, a closed round. Everything that crosses a module boundary is one of these (frozen
where it is a value), never a string to split or a dict to index."""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from coordinator.persist.theta_file import ThetaSource
from wire.health import Probe
from wire.proto import isthmus_pb2 as pb
from wire.tensors import Manifest
from wire.transfer import Piece

NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,62}$")


class Refused(Exception):
    """A request refused without any change of state. ``code`` picks the gRPC status;
    ``committed_by`` names the winning site when a data unit's other copy came first;
    ``fold_round`` the round a late update folds into (code ``"later"``: send it then)."""

    def __init__(
        self, code: str, message: str, committed_by: str = "", fold_round: int | None = None
    ) -> None:
        super().__init__(message)
        self.code = code
        self.committed_by = committed_by
        self.fold_round = fold_round


class FatalError(RuntimeError):
    """The job cannot go on (e.g. the strategy failed); the last checkpoint is intact."""


def check_name(kind: str, value: str) -> None:
    if not NAME_RE.fullmatch(value):  # fullmatch: "$" alone would let a trailing newline in
        raise Refused(
            "invalid",
            f"{kind} {value[:70]!r} is invalid: use 1-63 letters, digits, '.', '_' or '-'",
        )


@dataclass(frozen=True)
class UpdateKey:
    """Which update of a round an upload is.

    Federated mode: a site's own update (``UpdateKey("site-0")``), or its late update for round
    ``late_from``, folded into the next round of its fragment (the round after it without
    ``[streaming]``). Shared-data mode: a site's copy of a data
    unit (``UpdateKey("site-0", unit="u3")``); one site may commit two units in a round.
    """

    site: str
    unit: str = ""
    late_from: int | None = None

    @property
    def label(self) -> str:
        """Unique within a round: spool file names, event fields, strategies' keys."""
        if self.unit:
            return f"{self.site}@{self.unit}"
        if self.late_from is not None:
            return f"{self.site}@late{self.late_from}"
        return self.site

    @classmethod
    def from_label(cls, label: str) -> UpdateKey:
        """The key ``label`` names (site names cannot hold ``@``: the split is unambiguous)."""
        site, _, rest = label.partition("@")
        late = rest.removeprefix("late")
        if rest.startswith("late") and late.isdigit():
            return cls(site, late_from=int(late))
        return cls(site, unit=rest)

    def to_json(self) -> dict:
        return {"site": self.site, "unit": self.unit, "late_from": self.late_from}

    @classmethod
    def from_json(cls, d: dict) -> UpdateKey:
        late = d.get("late_from")
        return cls(str(d["site"]), str(d.get("unit", "")), None if late is None else int(late))


@dataclass(frozen=True)
class PushHeader:
    """The first message of a push stream, as the servicer read it off the wire."""

    site: str
    token: int
    round: int
    upload_id: str
    manifest: pb.Manifest  # parsed (against the size limit) only once the push is admitted
    weight: float
    base_version: int
    data_unit: str = ""
    piece: Piece | None = None  # the bytes this stream carries (None: the whole payload)
    reserve: bool = False  # a header-only reservation: it carries no bytes
    # A sharded job's: each shard's part digest and receipt (``coordinator.shards.lead``).
    shard_digests: tuple[bytes, ...] = ()
    shard_receipts: tuple[bytes, ...] = ()


@dataclass(frozen=True)
class Admission:
    """What an admitted push will count as: its key, the round folder it is spooled in, the
    theta version it must have been trained from, its weight factor (a late update's
    staleness discount) and its staleness (versions of its fragment it is behind; 0: on time)."""

    key: UpdateKey
    storage_round: int
    trained_from: int
    weight_factor: float = 1.0
    staleness: int = 0


@dataclass(frozen=True)
class ClosedRound:
    """A round the coordinator closed: who was in it and which updates counted, in the order
    they were summed."""

    number: int
    participants: frozenset[str]
    keys: tuple[UpdateKey, ...]
    reason: str = ""

    @property
    def sites(self) -> frozenset[str]:
        return frozenset(k.site for k in self.keys)


def closed_round_json(closed: ClosedRound) -> dict:
    """What a checkpoint keeps of a closed round (``closed_round_of`` reads it back)."""
    return {
        "number": closed.number,
        "reason": closed.reason,
        "keys": [k.to_json() for k in closed.keys],
        "participants": sorted(closed.participants),
    }


def closed_round_of(d: dict) -> ClosedRound:
    """A closed round as ``closed_round_json`` (or a checkpoint's ``closed_round``) wrote it;
    an older checkpoint's without ``participants`` takes the sites that counted."""
    keys = tuple(UpdateKey.from_json(k) for k in d.get("keys", []))
    participants = frozenset(d.get("participants", d.get("sites", [])))
    return ClosedRound(int(d["number"]), participants, keys, d.get("reason", ""))


@dataclass(frozen=True)
class PinnedClose:
    """A round decided before a restart whose close cannot be replayed (a spooled update it
    names was damaged): it is open again to take exactly ``keys`` back, then closes as
    recorded (see ``coordinator.round.recovery``). ``released``: its deadline passed without them,
    and it closes by the ordinary rules."""

    keys: tuple[UpdateKey, ...]
    reason: str
    released: bool = False


@dataclass
class SiteRecord:
    state: str = "active"
    last_heartbeat: float = 0.0
    last_update_at: float | None = None
    last_round_pushed: int | None = None
    progress: dict | None = None
    last_data_at: float | None = None  # last chunk of an update received
    health: Probe | None = None  # the newest health probe (``wire.health``)
    # Bytes of its counted updates per codec, since this coordinator started (adaptive jobs
    # show their rungs here).
    codec_bytes: dict[str, int] = field(default_factory=dict)
    updates_counted: int = 0  # since this coordinator started
    late_updates: int = 0  # of those, counted into a later round of their fragment
    stale_versions: int = 0  # of those, the versions of their fragment they were behind, summed


@dataclass(frozen=True)
class Published:
    """What Fetch serves: theta_version whole and, with a compressed downlink, the encoded
    delta from version ``delta_from``."""

    version: int
    theta_hash: bytes
    manifest: Manifest
    payload: ThetaSource  # theta's buffer, then its file (``coordinator.persist.theta_file``)
    delta_from: int | None = None
    delta_manifest: Manifest | None = None
    delta_payload: memoryview | bytes | None = None
