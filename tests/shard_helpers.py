"""Coordinator shards as real processes (``coordinator shard``) over mutual TLS, a site's and
the lead's stubs to them, and the one-process coordinator that gives the theta they must match.

The site here is a plain one over the protobuf ``Shard.Push`` and ``Shard.Fetch`` (the agent
uses the raw-frame bulk methods, ``site_client.transfer.sharded``): both are served."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

import torch
from core_helpers import Clock, core_config, push

from coordinator.core import CoordinatorCore
from coordinator.model_source import initial_theta
from coordinator.shards.link import CountedUpdate, ShardLead
from coordinator.shards.receipts import KEY_FILE, ShardPass, create_key, load_key, sign_pass
from wire.identity import Bundle, init_ca, issue
from wire.net.channel import open_channel
from wire.proto import isthmus_pb2 as pb
from wire.proto import isthmus_pb2_grpc as pb_grpc
from wire.shard_plan import ShardPlan, plan_shards
from wire.tensors import Manifest, pack, unpack

ROOT = Path(__file__).resolve().parents[1]
SITES = ("site-a", "site-b")
MODEL = {
    "factory": "torch.nn:TransformerEncoderLayer",
    "kwargs": {"d_model": 16, "nhead": 2, "dim_feedforward": 24},
    "seed": 3,
}
STRATEGY = {"name": "diloco", "lr": 0.7, "momentum": 0.9}


def make_pki(root: Path) -> Path:
    ca = init_ca(root / "ca", "shard-test")
    issue(ca, "coordinator", "shards", root / "shards", hosts=("127.0.0.1", "localhost"))
    issue(ca, "coordinator", "lead", root / "lead", hosts=("127.0.0.1",))
    issue(ca, "coordinator", "standby", root / "standby", hosts=("127.0.0.1",))
    for site in SITES:
        issue(ca, "site", site, root / site)
    issue(ca, "operator", "ops", root / "ops")
    return root


def job_toml(state_dir: Path, **extra: str) -> str:
    lines = [
        f'[job]\nname = "shards"\nstate_dir = "{state_dir}"',
        f'[model]\nfactory = "{MODEL["factory"]}"\nseed = {MODEL["seed"]}',
        "[model.kwargs]\n" + "\n".join(f"{k} = {v}" for k, v in MODEL["kwargs"].items()),
        '[strategy]\nname = "diloco"\nlr = 0.7\nmomentum = 0.9',
        "[rounds]\ntotal = 4\ninner_steps = 1\nmin_sites = 2",
    ]
    lines += [f"{table}\n{body}" for table, body in extra.items()]
    return "\n\n".join(lines) + "\n"


@dataclass
class ShardProc:
    index: int
    shards: int
    config: Path
    folder: Path
    tls: Path
    key: Path
    address: str = ""
    proc: subprocess.Popen | None = None
    leads: tuple[str, ...] = ("lead",)
    env: dict[str, str] | None = None  # None: this environment, the repository importable
    extra: tuple[str, ...] = ()  # more flags (``--ha URL``)
    log: Path = field(init=False)

    def __post_init__(self) -> None:
        self.log = self.folder.with_suffix(".log")

    def start(self, timeout: float = 60.0) -> ShardProc:
        (self.folder / "address").unlink(missing_ok=True)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "coordinator.cli", "shard", "--config", str(self.config)]
            + ["--index", str(self.index), "--shards", str(self.shards)]
            + ["--listen", self.address or "127.0.0.1:0", "--state-dir", str(self.folder)]
            + ["--key", str(self.key), "--tls-dir", str(self.tls)]
            + [flag for name in self.leads for flag in ("--lead", name)]
            + list(self.extra),
            cwd=ROOT,
            env=self.env or {**os.environ, "PYTHONPATH": str(ROOT)},
            stdout=open(self.log, "ab"),  # noqa: SIM115 - the process holds it
            stderr=subprocess.STDOUT,
        )
        deadline = time.monotonic() + timeout
        while not (self.folder / "address").exists():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"shard {self.index} did not start:\n{self.log.read_text()}")
            time.sleep(0.05)
        self.address = (self.folder / "address").read_text().strip()
        return self

    def kill(self) -> None:
        """kill -9, as a host that fails."""
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait()

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.kill()


def start_shards(
    tmp: Path, pki: Path, k: int, leads: tuple[str, ...] = ("lead",)
) -> list[ShardProc]:
    state = tmp / "lead"
    config = tmp / "job.toml"
    config.write_text(job_toml(state))
    create_key(state / KEY_FILE)
    shards = [
        ShardProc(i, k, config, tmp / f"shard-{i}", pki / "shards", state / KEY_FILE, leads=leads)
        for i in range(k)
    ]
    for s in shards:  # one after another: each imports torch (in parallel on 2 cores: slower)
        s.start()
    return shards


def stub(address: str, pki: Path, who: str) -> pb_grpc.ShardStub:
    return pb_grpc.ShardStub(open_channel(address, Bundle.load(pki / who)))


def theta_0() -> dict[str, torch.Tensor]:
    return initial_theta(core_config(Path("/nonexistent"), model=MODEL).model)


def plan_of(k: int) -> ShardPlan:
    theta = theta_0()
    return plan_shards({n: t.numel() * t.element_size() for n, t in theta.items()}, k)


def delta(like: dict[str, torch.Tensor], site: str, round_number: int) -> dict[str, torch.Tensor]:
    """A site's update for a round: reproducible, different per site and round."""
    g = torch.Generator().manual_seed(sum(site.encode()) * 1000 + round_number)
    return {
        n: torch.randn(t.shape, generator=g, dtype=torch.float32) * 0.01
        for n, t in sorted(like.items())
        if t.is_floating_point()
    }


class OneProcess:
    """The one-process coordinator (K = 1 of today's code) given the same updates."""

    def __init__(self, tmp: Path) -> None:
        self.clock = Clock()
        cfg = core_config(tmp, model=MODEL, strategy=STRATEGY, rounds={"max_sites": 2})
        self.core = CoordinatorCore(cfg, clock=self.clock)
        self.tokens = {s: self.core.join(s)[0].token for s in SITES}
        self.clock.now += 1.0
        self.core.tick()

    def round(self, r: int, deltas: dict[str, dict[str, torch.Tensor]]) -> bytes:
        self.clock.now += 1.0
        self.core.tick()  # round r opens (the sites are in its quorum)
        for site in SITES:
            push(self.core, site, self.tokens[site], r, deltas[site])
        assert self.core.tick() and self.core.round.number == r + 1
        return self.core.published.theta_hash

    def close(self) -> None:
        self.core.writer.wait()
        self.core.events.close()


CHUNK_BYTES = 1 << 20


@dataclass(frozen=True)
class Part:
    """One shard's part of an update, laid out."""

    shard: int
    manifest: Manifest
    payload: memoryview


def split_update(tensors: Mapping[str, torch.Tensor], plan: ShardPlan) -> list[Part]:
    """``tensors`` (the update) cut into one raw payload per shard, by ``plan``."""
    out = []
    for i in range(plan.shards):
        own = {n: tensors[n] for n in plan.names(i) if n in tensors}
        manifest, payload = pack(own)
        out.append(Part(i, manifest, payload))
    return out


def push_part(
    stub: pb_grpc.ShardStub,
    site: str,
    round_number: int,
    upload_id: str,
    part: Part,
    weight: float,
    timeout: float = 600.0,
    shard_pass: bytes = b"",
) -> pb.PushReply:
    """Push ``part`` whole on one stream (with the lead's ``shard_pass``); the reply carries
    the shard's receipt."""
    header = pb.PushHeader(
        shard_pass=shard_pass,
        lease=pb.Lease(site=site),
        round=round_number,
        upload_id=upload_id,
        manifest=part.manifest.to_proto(),
        weight=weight,
        base_version=round_number,
    )

    def frames():
        yield pb.PushMessage(header=header)
        data = part.payload
        for offset in range(0, len(data), CHUNK_BYTES):
            chunk = bytes(data[offset : offset + CHUNK_BYTES])
            yield pb.PushMessage(chunk=pb.Chunk(offset=offset, data=chunk))

    return stub.Push(frames(), timeout=timeout)


def fetch_part(
    stub: pb_grpc.ShardStub, site: str, timeout: float = 600.0, shard_pass: bytes = b""
) -> tuple[int, dict[str, torch.Tensor]]:
    """The version a shard serves and its tensors of that theta (with the lead's pass)."""
    header, buf = None, bytearray()
    request = pb.FetchRequest(lease=pb.Lease(site=site), shard_pass=shard_pass)
    for msg in stub.Fetch(request, timeout=timeout):
        if msg.HasField("header"):
            header = msg.header
            buf = bytearray(header.manifest.total_bytes)
        else:
            data = msg.chunk.data
            buf[msg.chunk.offset : msg.chunk.offset + len(data)] = data
    if header is None:
        raise ValueError("the shard's fetch stream ended before its header")
    manifest = Manifest.from_proto(header.manifest)
    return header.version, unpack(manifest, bytes(buf))


def push_update(shards, pki, site, r, update, plan, upload_id=None):
    """A site's update cut by the plan and pushed to every shard; the lead's record of it."""
    upload_id = upload_id or f"{site}-r{r}"
    parts = split_update(update, plan)
    receipts = []
    granted = pass_of(shards, site, r)
    for part in parts:
        to = stub(shards[part.shard].address, pki, site)
        reply = push_part(to, site, r, upload_id, part, 1.0, shard_pass=granted)
        assert reply.complete and reply.receipt
        receipts.append(reply.receipt)
    digests = tuple(p.manifest.digest for p in parts)
    return CountedUpdate(site, upload_id, 1.0, 1.0, digests), receipts


def lead_of(shards, pki, plan, who: str = "lead"):
    """The lead's link to ``shards``, with certificate ``who``."""
    key = load_key(shards[0].key)
    return ShardLead([stub(s.address, pki, who) for s in shards], plan, key)


def pass_of(shards, site: str, version: int) -> bytes:
    """The lead's pass for ``site`` and ``version``, as the lead signs it."""
    return sign_pass(load_key(shards[0].key), ShardPass(site, version))


def fetch_all(shards, pki) -> tuple[set[int], dict[str, torch.Tensor]]:
    """Each shard's part as site-a fetches it (with the pass of the version each serves)."""
    versions, theta = set(), {}
    for s in shards:
        served = stub(s.address, pki, "ops").Status(pb.ShardStatusRequest(), timeout=10).version
        granted = pass_of(shards, "site-a", served)
        version, tensors = fetch_part(stub(s.address, pki, "site-a"), "site-a", shard_pass=granted)
        versions.add(version)
        theta.update(tensors)
    return versions, theta
