"""``coordinator status``: the state of a running job as a snapshot, a message and a table.

The core builds a ``StatusSnapshot`` under its lock (``snapshot_of``); everything after that
reads only the snapshot.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from coordinator.observe.evaluation import Evaluation, describe
from wire.proto import isthmus_pb2 as pb


@dataclass(frozen=True)
class StatusSnapshot:
    job_name: str
    round_info: dict
    sites: tuple[pb.SiteStatus, ...]
    updates_received: int
    updates_expected: int
    round_age_s: float
    strategy: str
    wan_bytes_in: int
    wan_bytes_out: int
    rejections: tuple[str, ...]
    aggregation: str
    data_mode: str
    units_committed: tuple[str, ...]
    units_pending: tuple[str, ...]
    waiting_reason: str
    evaluation: Evaluation | None = None
    fragments: int = 0  # [streaming] fragments; 0 without
    codec_bytes: tuple[tuple[str, str, int], ...] = ()  # (site, codec, bytes of its updates)


def snapshot_of(core, now: float) -> StatusSnapshot:
    """Read everything status shows off the core (the caller holds its lock)."""
    s, members, data = core.state, core.members, core.data
    r = s.round
    sites = tuple(_site_status(core, name, now) for name in sorted(members.sites))
    committed: tuple[str, ...] = ()
    pending: tuple[str, ...] = ()
    if data.kind == "shared":
        ledger = data.ledger
        if ledger.open_round_number() == r.number:
            committed = tuple(u for u in ledger.units_in(r.number) if ledger.committed_by(u))
        pending = tuple(ledger.pending())
    return StatusSnapshot(
        job_name=core.cfg.name,
        round_info=core.round_info(),
        sites=sites,
        updates_received=len(r.received),
        updates_expected=len(r.participants),
        round_age_s=now - r.opened_at if r.opened_at is not None else 0.0,
        strategy=core.strategy.describe(),
        wan_bytes_in=s.bytes_in,
        wan_bytes_out=s.bytes_out,
        rejections=tuple(s.rejections),
        aggregation=core.aggregator.describe(),
        data_mode=core.cfg.data.mode,
        units_committed=committed,
        units_pending=pending,
        waiting_reason=core.waiting_reason(),
        evaluation=s.evaluation,
        fragments=core.tensors.fragments,
        codec_bytes=tuple(
            (site, codec, n)
            for site, rec in sorted(members.sites.items())
            for codec, n in sorted(rec.codec_bytes.items())
        ),
    )


def _site_status(core, name: str, now: float) -> pb.SiteStatus:
    members = core.members
    rec = members.sites[name]
    lease = members.leases.get(name)
    p = rec.progress or {}
    units = core.data.units_of(core.state.round, name) if core.data.kind == "shared" else []
    return pb.SiteStatus(
        site=name,
        state=rec.state if lease is not None or rec.state != "active" else "expired",
        token=lease.token if lease else 0,
        lease_remaining_s=max(lease.remaining(now), 0.0) if lease else 0.0,
        last_heartbeat_age_s=now - rec.last_heartbeat,
        last_update_age_s=now - rec.last_update_at if rec.last_update_at is not None else -1.0,
        last_round_pushed=rec.last_round_pushed or 0,
        phi=members.detector.phi(name, now) if lease is not None else 0.0,
        suspected=name in members.suspected,
        data_units=units,
        drained=core.control.drain_reason(name),
        health=rec.health.to_report() if rec.health is not None else None,
        progress=pb.Progress(
            round=p.get("round", 0),
            inner_step=p.get("inner_step", 0),
            train_loss=p.get("train_loss", 0.0),
            phase=p.get("phase", ""),
            merge_wait_s=p.get("merge_wait_s", 0.0),
            steps_per_s=p.get("steps_per_s", 0.0),
            compute_utilisation=p.get("compute_utilisation", 0.0),
        ),
        updates_counted=rec.updates_counted,
        late_updates=rec.late_updates,
        stale_versions=rec.stale_versions,
    )


def status_reply(snap: StatusSnapshot) -> pb.StatusReply:
    ev = snap.evaluation
    return pb.StatusReply(
        job_name=snap.job_name,
        round=pb.RoundInfo(**snap.round_info),
        sites=list(snap.sites),
        updates_received=snap.updates_received,
        updates_expected=snap.updates_expected,
        round_age_s=snap.round_age_s,
        strategy=snap.strategy,
        wan_bytes_in=snap.wan_bytes_in,
        wan_bytes_out=snap.wan_bytes_out,
        rejections=list(snap.rejections),
        aggregation=snap.aggregation,
        data_mode=snap.data_mode,
        units_committed=list(snap.units_committed),
        units_pending=list(snap.units_pending),
        waiting_reason=snap.waiting_reason,
        evaluation=(
            pb.Evaluation(version=ev.version, metrics=ev.metrics, seconds=ev.seconds)
            if ev is not None
            else None
        ),
        fragments=snap.fragments,
    )


def _age(seconds: float) -> str:
    if seconds < 0:
        return "never"
    return f"{seconds:.1f}s ago"


def status_json(s: pb.StatusReply) -> str:
    """The reply as JSON: field names as in the protocol, numbers as numbers (protobuf's own
    JSON writes 64-bit integers as strings), bytes in hex."""
    return json.dumps(status_doc(s), indent=1, sort_keys=True)


def status_doc(s: pb.StatusReply) -> dict:
    """The reply as plain dicts, lists and numbers (what ``status_json`` writes)."""
    return _plain(s)


def _plain(msg) -> dict:
    out = {}
    for f in msg.DESCRIPTOR.fields:
        value = getattr(msg, f.name)
        one = _plain if f.type == f.TYPE_MESSAGE else _scalar
        out[f.name] = [one(v) for v in value] if f.is_repeated else one(value)
    return out


def _scalar(value):
    return value.hex() if isinstance(value, bytes) else value


def format_status(s: pb.StatusReply) -> str:
    lines = _summary_lines(s)
    lines.append("")
    lines += _site_table(s.sites)
    lines += [f"drained: {x.site}: {x.drained}" for x in s.sites if x.drained]
    lines += [_shard_line(x) for x in s.shards]
    return "\n".join(lines)


def _shard_line(x: pb.ShardState) -> str:
    where = f"shard {x.shard} ({x.address})"
    if x.problem:
        return f"{where}: not answering: {x.problem}"
    held = f"{x.parts_held} part(s) of the open round"
    return f"{where}: theta_{x.version}, {x.bytes / 1e6:.1f} MB of tensors, {held}"


def _summary_lines(s: pb.StatusReply) -> list[str]:
    r = s.round
    lines = [
        f"job {s.job_name}  round {r.round}/{r.total_rounds}"
        + (f" (fragment {r.fragment} of {s.fragments})" if s.fragments else "")
        + ("  (finished)" if r.finished else "")
        + f"  theta {r.theta_hash.hex()[:12]}  strategy {s.strategy}"
        + (f"  aggregation {s.aggregation}" if s.aggregation and s.aggregation != "mean" else ""),
        f"updates {s.updates_received}/{s.updates_expected}  round age {s.round_age_s:.1f}s  "
        f"WAN in {s.wan_bytes_in / 1e6:.1f} MB out {s.wan_bytes_out / 1e6:.1f} MB",
        f"state: {s.waiting_reason}",
    ]
    if s.data_mode == "shared":
        lines.append(
            f"data units committed this round: {', '.join(s.units_committed) or '-'}; "
            f"waiting for a later round: {', '.join(s.units_pending) or '-'}"
        )
    if s.HasField("evaluation"):
        ev = Evaluation(s.evaluation.version, dict(s.evaluation.metrics), s.evaluation.seconds)
        lines.append(f"evaluation of theta_{ev.version}: {describe(ev)} ({ev.seconds:.1f}s)")
    if s.rejections:
        lines.append(f"rejected updates ({len(s.rejections)} most recent):")
        lines += [f"  {x}" for x in s.rejections]
    return lines


SITE_COLUMNS = (
    "SITE",
    "STATE",
    "TOKEN",
    "LEASE LEFT",
    "HEARTBEAT",
    "PHI",
    "LAST UPDATE",
    "PUSHED",
    "UNITS",
    "PHASE",
    "LOSS",
    "STEPS/S",
    "UTIL",
    "COUNTED",
    "MERGE WAIT",
    "HEALTH",
)


def _site_row(x: pb.SiteStatus) -> tuple[str, ...]:
    p = x.progress
    return (
        x.site,
        x.state + (" (suspected)" if x.suspected else "") + (" (drained)" if x.drained else ""),
        str(x.token),
        f"{x.lease_remaining_s:.1f}s",
        _age(x.last_heartbeat_age_s),
        f"{x.phi:.1f}",
        _age(x.last_update_age_s),
        str(x.last_round_pushed) if x.last_update_age_s >= 0 else "-",
        ",".join(x.data_units) or "-",
        f"{p.phase} r{p.round} step {p.inner_step}" if p.phase else "-",
        f"{p.train_loss:.4f}" if p.train_loss else "-",
        f"{p.steps_per_s:.3g}" if p.steps_per_s else "-",
        f"{p.compute_utilisation:.0%}" if p.compute_utilisation else "-",
        _counted(x),
        f"{p.merge_wait_s:.1f}s" if p.merge_wait_s else "-",
        _health_cell(x.health) if x.HasField("health") else "-",
    )


def _counted(x: pb.SiteStatus) -> str:
    """Updates counted, with how many of them late and how stale those were on average."""
    if not x.late_updates:
        return str(x.updates_counted)
    mean = x.stale_versions / x.late_updates
    return f"{x.updates_counted} ({x.late_updates} late, {mean:.1f} behind)"


def _health_cell(h: pb.HealthReport) -> str:
    cell = f"{h.matmul_gflops:.3g} GF/s"
    if h.world_size > 1:
        cell += f" {h.allreduce_gbps:.3g} GB/s"
    if h.gpu_errors:
        cell += f" {len(h.gpu_errors)} GPU error(s)"
    return cell


def _site_table(sites) -> list[str]:
    rows = [_site_row(x) for x in sites]
    widths = [max(len(row[i]) for row in [SITE_COLUMNS, *rows]) for i in range(len(SITE_COLUMNS))]
    lines = [
        "  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip()
        for row in [SITE_COLUMNS, *rows]
    ]
    if not rows:
        lines.append("(no sites have joined)")
    return lines
