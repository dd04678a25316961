"""Driving a ``CoordinatorCore`` in-process with a fake clock (no gRPC): join, heartbeat and
push through the same methods the servicer calls."""

from __future__ import annotations

import torch

from coordinator.config import parse_config
from coordinator.core import CoordinatorCore
from coordinator.records import PushHeader
from wire.tensors import pack


def core_config(tmp_path, **sections):
    data = {
        "job": {"name": "faults", "state_dir": "state"},
        "model": {"factory": "torch.nn:Linear", "kwargs": {"in_features": 4, "out_features": 3}},
        "strategy": {"name": "fedavg"},
        "rounds": {
            "total": 4,
            "inner_steps": 1,
            "min_sites": 2,
            "max_sites": 3,
            "join_window_s": 0.0,
            "deadline_s": 100.0,
        },
        "timeouts": {"heartbeat_interval_s": 1.0, "lease_ttl_s": 20.0},
    }
    for table, values in sections.items():
        data.setdefault(table, {}).update(values)
    return parse_config(data, tmp_path)


class Clock:
    def __init__(self, now: float = 0.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def new_core(tmp_path, clock: Clock, **sections) -> CoordinatorCore:
    return CoordinatorCore(core_config(tmp_path, **sections), clock=clock)


def delta_like(core: CoordinatorCore, value: float) -> dict[str, torch.Tensor]:
    return {n: torch.full_like(core.theta[n], value) for n in core.trainable}


def push(core, site, token, round_number, delta, *, unit="", base=None, upload_id=None):
    """One whole upload; returns True when counted (raises ``Refused`` otherwise)."""
    manifest, payload = pack(delta)
    return push_payload(
        core,
        site,
        token,
        round_number,
        manifest,
        payload,
        unit=unit,
        base=base,
        upload_id=upload_id,
    )


def push_payload(
    core, site, token, round_number, manifest, payload, *, unit="", base=None, upload_id=None
):
    """``push`` of a payload already laid out (encoded, in pieces, or hostile)."""
    header = PushHeader(
        site=site,
        token=token,
        round=round_number,
        upload_id=upload_id or f"{site}-{round_number}-{unit or 'own'}",
        manifest=manifest.to_proto(),
        weight=1.0,
        base_version=round_number if base is None else base,
        data_unit=unit,
    )
    upload = core.begin_upload(header)
    try:
        core.upload_chunk(upload, 0, bytes(payload))
        return core.finish_upload(upload, token)
    finally:
        core.release_upload(upload)


def heartbeat_all(core, clock: Clock, tokens: dict[str, int], seconds: float, step=1.0):
    """Advance the clock by ``seconds``, every site in ``tokens`` heartbeating each ``step``."""
    end = clock.now + seconds
    while clock.now < end:
        clock.now += step
        for site, token in tokens.items():
            core.heartbeat(site, token, None)
        core.tick()
