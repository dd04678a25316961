"""One coordinator shard: its tensors' theta, the parts sites push, the steps the lead orders.

A shard decides nothing. A part arrives (``begin``, ``write``, ``finish``) through the
coordinator's own intake (the same manifest checks, digest, NaN screen and fsync into a spool),
is kept under its upload id, and is answered with a receipt (``coordinator.shards.receipts``).
When the lead closes a round it names the parts that count, in fold order, with their weights
(``close``); the shard folds them with the coordinator's own ``fold_into``, divides by the
same total and takes the strategy's step with the same ``step_by_tensor``, so each tensor gets
exactly the operations a one-process coordinator gives it: theta is the same bits whatever the
number of shards. The new version is written whole (``part_store``) before it is served, so a
shard killed with -9 restarts from it, and a close sent again is answered from its record.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

import torch

from coordinator.intake.receiver import UpdateIntake
from coordinator.intake.spool import SpooledUpdate, UpdateSpool
from coordinator.intake.uploads import Upload, UploadTable
from coordinator.persist.theta_file import ThetaFile
from coordinator.records import Admission, PushHeader, Refused, UpdateKey, check_name
from coordinator.round.accumulate import fold_into
from coordinator.round.close import step_by_tensor
from coordinator.round.round_tensors import RoundTensors
from coordinator.shards.fence import AlignStep, EpochFence, align_compute
from coordinator.shards.part_store import FoldedPart, PartStore, StoredPart, records_of
from coordinator.shards.receipts import PartReceipt, ShardPass, pass_valid, sign
from strategies import Strategy
from strategies.base import Aggregate, all_finite, call_hook, check_outer_result, steps_in_place
from wire.safetensors_io import read_header
from wire.shard_plan import ShardPlan
from wire.tensors import Manifest, PayloadError

log = logging.getLogger("isthmus.shard")
MAX_PARTS_PER_SITE = 4  # parts of one site held for one round (a restarted site pushes again)


@dataclass(frozen=True)
class ShardSpec:
    """Which shard this is, of which plan, where every shard serves (for refusals), and who
    its lead is."""

    index: int
    plan: ShardPlan
    addresses: tuple[str, ...] = ()
    max_update_bytes: int = 8 << 30
    # The names in the certificates of the coordinators that may lead (a standby's too):
    # only they close rounds (empty: any coordinator certificate of the job).
    leads: tuple[str, ...] = ()

    def names(self) -> tuple[str, ...]:
        return self.plan.names(self.index)


class ShardCore:
    def __init__(
        self,
        spec: ShardSpec,
        strategy: Strategy,
        theta_0: Callable[[], Mapping[str, torch.Tensor]],
        folder: Path,
        key: bytes,
    ) -> None:
        """``theta_0``: the whole model's first theta, read only when the shard has no saved
        version yet (its own tensors are kept)."""
        self.spec, self.strategy, self.key = spec, strategy, key
        self.lock = threading.Lock()  # one close at a time; the intake has its own locks
        self.parts = PartStore(Path(folder) / "parts")
        self.fence = EpochFence(Path(folder), spec.index)
        self.spool = UpdateSpool(Path(folder) / "spool")
        self.uploads = UploadTable(self.spool)
        stored = self.parts.latest()
        if stored is None:
            stored = self._first(theta_0())
        elif state := stored.strategy_state():
            call_hook(strategy, "load_state_dict", state)
        self._serve(stored)
        theta = self.theta
        trainable = sorted(n for n, t in theta.items() if t.is_floating_point())
        self.trainable = trainable
        self.intake = UpdateIntake(
            self.spool,
            self.uploads,
            {n: t.to("meta") for n, t in theta.items()},
            RoundTensors.of(theta, trainable, None),
            spec.max_update_bytes,
            measure_norms=False,
        )
        call_hook(strategy, "begin_round", self.version, theta)

    def _first(self, whole: Mapping[str, torch.Tensor]) -> StoredPart:
        own = set(self.spec.names())
        if missing := own - set(whole):
            raise ValueError(f"the model has no tensor {sorted(missing)[0]!r} of the shard plan")
        theta = {n: t for n, t in whole.items() if n in own}
        return self._save(0, theta, None, ())

    def _save(self, version, theta, round_number, parts) -> StoredPart:
        state = call_hook(self.strategy, "state_dict")
        records = tuple(records_of(theta))
        return self.parts.save(version, theta, state, round_number, parts, records)

    def _serve(self, stored: StoredPart) -> None:
        manifest, _, _ = read_header(stored.theta_path)
        self.stored, self.file = stored, ThetaFile(stored.theta_path, manifest)

    @property
    def version(self) -> int:
        return self.stored.version

    @property
    def theta(self) -> dict[str, torch.Tensor]:
        return dict(self.file.theta.tensors)

    # ---- parts in -------------------------------------------------------------------------

    def begin(self, header: PushHeader) -> Upload:
        """Start (or resume) receiving a part: for the open round, of this shard's tensors."""
        check_name("site", header.site)
        check_name("upload id", header.upload_id)
        r, v = header.round, self.version
        if r != v:
            when = "closed" if r < v else "not open yet"
            raise Refused(
                "late" if r < v else "early",
                f"shard {self.spec.index} serves theta_{v}: round {r} is {when}",
            )
        try:
            manifest = Manifest.from_proto(header.manifest, self.spec.max_update_bytes)
        except PayloadError as exc:
            raise Refused("invalid", f"bad part manifest: {exc}") from exc
        for e in manifest.entries:
            if problem := self.spec.plan.outside(e.name, self.spec.index, self.spec.addresses):
                raise Refused("invalid", problem)
        held = self.spool.round_dir(r).glob(f"{header.site}@*.update")
        if sum(1 for _ in held) >= MAX_PARTS_PER_SITE:
            raise Refused(
                "full",
                f"shard {self.spec.index} holds {MAX_PARTS_PER_SITE} parts of "
                f"{header.site} for round {r} already; no more are taken",
            )
        key = UpdateKey(header.site, unit=header.upload_id)
        return self.intake.open(header, Admission(key, r, r))

    def check_pass(self, site: str, version: int, mac: bytes, what: str) -> None:
        """Refuse ``site`` unless ``mac`` is the lead's pass for it and ``version``: the lead
        gives one with theta_version to a site it leases, and to no other."""
        if not pass_valid(self.key, ShardPass(site, version), mac):
            raise Refused(
                "lease",
                f"shard {self.spec.index}: {what} of {site} for {version} carries no valid pass "
                "of the lead: fetch theta from the coordinator first (a site whose lease lapsed, "
                "or that was drained, gets none)",
            )

    def write(self, upload: Upload, offset: int, data, piece=None) -> None:
        self.intake.write(upload, offset, data, piece)

    def finish(self, upload: Upload) -> bytes | None:
        """Verify and spool a complete part; its receipt (None: bytes are missing)."""
        if not upload.complete:
            return None
        with self.uploads.finishing(upload):
            self.intake.verify(upload)
            spooled = self.intake.commit(upload, upload.weight)
        self.uploads.forget(upload)
        m = spooled.manifest
        receipt = PartReceipt(
            self.spec.index, upload.round, upload.site, upload.upload_id, m.digest, upload.weight
        )
        return sign(self.key, receipt)

    # ---- the lead's close ----------------------------------------------------------------

    def _check_plan(self, plan_digest: str) -> None:
        if plan_digest != self.spec.plan.digest():
            raise Refused(
                "invalid",
                f"the lead's shard plan {plan_digest} is not this shard's "
                f"{self.spec.plan.digest()}: start every shard from the lead's job config",
            )

    def align(self, version: int, epoch: int, plan_digest: str) -> AlignStep:
        """Serve theta ``version``, the lead's checkpoint's (``coordinator.shards.fence``): go
        back one version when the lead of an earlier epoch closed a round it never
        checkpointed. Refused when the lead's epoch is older than one followed, or the version
        is not this one or the one before."""
        self._check_plan(plan_digest)
        with self.lock:
            self.fence.check(epoch)
            step = align_compute(self.spec.index, self.version, self.parts.versions(), version)
            if step.action == "refuse":
                raise Refused("invalid", step.why)
            self.fence.admit(epoch)
            if step.action == "rewind":
                self._rewind(version)
            log.info("%s (lead epoch %d)", step.why, epoch)
            return step

    def _rewind(self, version: int) -> None:
        back = self.parts.load(version)
        assert back is not None  # align_compute rewinds only to a kept version
        self.parts.drop_after(version)
        call_hook(self.strategy, "load_state_dict", back.strategy_state())
        self._serve(back)
        call_hook(self.strategy, "begin_round", self.version, self.theta)

    def close(
        self, round_number: int, parts: tuple[FoldedPart, ...], plan_digest: str, epoch: int = 0
    ) -> tuple[StoredPart, bool]:
        """Fold ``parts`` in order and step: theta_{round+1} of this shard's tensors, written
        and served; ``True`` with it when the round was closed before (a replay). ``epoch``:
        the lead's (refused when older than one followed)."""
        self._check_plan(plan_digest)
        with self.lock:
            self.fence.check(epoch)
            done = self.stored
            if done.round == round_number:
                if done.parts != parts:
                    raise Refused(
                        "invalid", f"round {round_number} was closed with other parts than these"
                    )
                self.fence.admit(epoch)
                return done, True
            if round_number != self.version:
                raise Refused(
                    "invalid",
                    f"shard {self.spec.index} serves theta_{self.version}: it cannot close "
                    f"round {round_number}",
                )
            updates = [self._held(round_number, p) for p in parts]
            theta = self._step(round_number, updates, parts)
            self.fence.admit(epoch)  # once the close is sure to be carried out
            stored = self._save(round_number + 1, theta, round_number, parts)
            self._serve(stored)
            self.uploads.drop_rounds_before(round_number + 1)
            self.spool.drop_rounds_before(round_number + 1, keep=self.uploads.busy_paths())
            call_hook(self.strategy, "begin_round", self.version, self.theta)
            log.info(
                "shard %d: round %d closed, %d part(s)", self.spec.index, round_number, len(parts)
            )
            return stored, False

    def _held(self, round_number: int, part: FoldedPart) -> SpooledUpdate:
        label = UpdateKey(part.site, unit=part.upload_id).label
        found = {u.key.label: u for u in self.spool.completed(round_number)}.get(label)
        if found is None or found.manifest.digest != part.digest:
            raise Refused(
                "not_found",
                f"shard {self.spec.index} holds no part {part.upload_id} of {part.site} for "
                f"round {round_number} with that digest: the site pushes it again",
            )
        return found

    def _step(self, r: int, updates: list[SpooledUpdate], parts) -> dict[str, torch.Tensor]:
        theta = self.theta
        if not parts:
            return theta
        acc = {n: torch.zeros(theta[n].shape, dtype=torch.float32) for n in self.trainable}
        for update, part in zip(updates, parts, strict=True):
            fold_into(acc, update, part.alpha)
        total = sum(p.weight for p in parts)
        if total <= 0:
            raise Refused("invalid", f"round {r}: the parts' weights add up to {total}")
        for t in acc.values():
            t.div_(total)
        if not all(all_finite(t) for t in acc.values()):
            raise Refused("invalid", f"round {r}: the mean of the parts is not finite")
        weights = {UpdateKey(p.site, unit=p.upload_id).label: p.weight for p in parts}
        agg = Aggregate(acc, total, weights, r)
        s, new = self.strategy, None
        if s.separable and steps_in_place(s):  # theta_r's pages go back as each tensor steps
            new = step_by_tensor(s, theta, agg, self.file.release)
        if new is None:
            new = check_outer_result(s, theta, call_hook(s, "outer_step", theta, agg))
        return {n: new.get(n, t) for n, t in theta.items()}

    def parts_held(self) -> int:
        return len(self.spool.completed(self.version))
