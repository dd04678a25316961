"""``coordinator status``: the state of a running job as a message and as a table."""

from __future__ import annotations

from wire.proto import isthmus_pb2 as pb


def status_reply(core) -> pb.StatusReply:
    with core.lock:
        now = core.clock()
        r = core.round
        sites = []
        for name in sorted(core.sites):
            rec = core.sites[name]
            lease = core.leases.get(name)
            p = rec.progress or {}
            sites.append(
                pb.SiteStatus(
                    site=name,
                    state=rec.state if lease is not None or rec.state != "active" else "expired",
                    token=lease.token if lease else 0,
                    lease_remaining_s=max(lease.remaining(now), 0.0) if lease else 0.0,
                    last_heartbeat_age_s=now - rec.last_heartbeat,
                    last_update_age_s=(
                        now - rec.last_update_at if rec.last_update_at is not None else -1.0
                    ),
                    last_round_pushed=rec.last_round_pushed or 0,
                    phi=core.detector.phi(name, now) if lease is not None else 0.0,
                    suspected=name in core.suspected,
                    data_units=_units_of(core, name),
                    progress=pb.Progress(
                        round=p.get("round", 0),
                        inner_step=p.get("inner_step", 0),
                        train_loss=p.get("train_loss", 0.0),
                        phase=p.get("phase", ""),
                    ),
                )
            )
        reply = pb.StatusReply(
            job_name=core.cfg.name,
            round=pb.RoundInfo(**core.round_info()),
            sites=sites,
            updates_received=len(r.received),
            updates_expected=len(r.participants),
            round_age_s=now - r.opened_at if r.opened_at is not None else 0.0,
            strategy=core.strategy.describe(),
            wan_bytes_in=core.bytes_in,
            wan_bytes_out=core.bytes_out,
            rejections=list(core.rejections),
            aggregation=core.aggregator.describe(),
            data_mode=core.cfg.data.mode,
        )
        if core.shared and core.ledger.open_round_number() == r.number:
            units = core.ledger.units_in(r.number)
            reply.units_committed.extend(u for u in units if core.ledger.committed_by(u))
        if core.shared:
            reply.units_pending.extend(core.ledger.pending())
    reply.waiting_reason = core.waiting_reason()
    return reply


def _units_of(core, site: str) -> list[str]:
    r = core.round
    if not core.shared or core.ledger.open_round_number() != r.number:
        return []
    return core.ledger.units_of(r.number, site)


def _age(seconds: float) -> str:
    if seconds < 0:
        return "never"
    return f"{seconds:.1f}s ago"


def format_status(s: pb.StatusReply) -> str:
    r = s.round
    lines = [
        f"job {s.job_name}  round {r.round}/{r.total_rounds}"
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
    if s.rejections:
        lines.append(f"rejected updates ({len(s.rejections)} most recent):")
        lines += [f"  {x}" for x in s.rejections]
    lines.append("")
    header = (
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
    )
    rows = [
        (
            x.site,
            x.state + (" (suspected)" if x.suspected else ""),
            str(x.token),
            f"{x.lease_remaining_s:.1f}s",
            _age(x.last_heartbeat_age_s),
            f"{x.phi:.1f}",
            _age(x.last_update_age_s),
            str(x.last_round_pushed) if x.last_update_age_s >= 0 else "-",
            ",".join(x.data_units) or "-",
            f"{x.progress.phase} r{x.progress.round} step {x.progress.inner_step}"
            if x.progress.phase
            else "-",
        )
        for x in s.sites
    ]
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header))]
    for row in [header, *rows]:
        lines.append("  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip())
    if not rows:
        lines.append("(no sites have joined)")
    return "\n".join(lines)
