"""The product on the emulated WAN: a real ``coordinator serve`` in namespace b, a site in a.

The site is a lightweight client speaking the real protocol (``CoordinatorClient``, as in
``bench.scale``), plaintext: TLS changes the CPU cost, not what the link does to one stream.
Each round it fetches theta_r whole into a safetensors file, as an agent does, and pushes a
float32 update of the same size over one of the stream counts asked for (``[transfer]
streams``: the job allows the largest, the site takes each in turn, round after round, each K
on connections of its own, which its pushes use too: ``[transfer] keep_connections``); every
call is timed from the client, on connections opened before the first round, so the figures
compare with a raw TCP stream's first byte to receipt (``bench.streams_tcp``). A K's first
round is its connections' first transfer; later rounds find them as the round before left
them. The job is DiLoCo on a residual Linear stack of about the requested size, one site,
``repeats`` rounds per stream count.
"""

from __future__ import annotations

import math
import shutil
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

from bench.wan_link import WanLink

DEPTH = 4


def model_shape(mib: float) -> tuple[int, int]:
    """(width, depth) of a residual stack of about ``mib`` MiB of float32 weights."""
    return max(8, round(math.sqrt(mib * 2**20 / 4 / DEPTH))), DEPTH


def site(address: str, width: int, depth: int, rounds: int, streams: list[int]) -> dict:
    """In namespace a: join, then per round fetch theta_r and push an update over the next of
    ``streams``; the timings, ``{"fetch": {"K": [(s, bytes)...]}, "push": {"K": [...]}}``."""
    import torch

    from bench.sync import residual_stack
    from site_client.agent.update_payload import payload_of
    from site_client.transfer.client import CoordinatorClient
    from wire.tensors import pack

    like = residual_stack(width, depth).state_dict()
    payload = payload_of(*pack({n: torch.full_like(t, 1e-3) for n, t in like.items()}))
    timings: dict[str, dict[str, list]] = {"fetch": {}, "push": {}}
    main = CoordinatorClient(address, "site-0", transfer_timeout_s=600)
    main.join()
    # Each K on connections of its own, as a job with that K would have: a connection that was
    # one of 8 keeps the small ssthresh its share of the link left it, and one stream on it
    # would ramp up slowly. They share the site's lease (one site, one join).
    clients = {k: CoordinatorClient(address, "site-0", transfer_timeout_s=600) for k in streams}
    for k, client in clients.items():
        client.lease, client.transfer = main.lease, replace(main.transfer, streams=k)
        client.connect_streams(k)
    scratch = Path(tempfile.mkdtemp(prefix="isthmus-streams-site-"))
    try:
        for r in range(rounds):
            k = streams[r % len(streams)]
            client = clients[k]
            main.wait_for_round(r - 1, poll_s=0.2)
            dest = scratch / f"theta-{r}.safetensors"
            t = time.monotonic()
            theta = client.fetch(dest=dest).theta  # theta_r, whole
            # The payload's bytes, not the bytes received: a piece one stream takes over from
            # another at the end of a fetch may come twice (site_client.transfer.overlap).
            took = (time.monotonic() - t, sum(v.nbytes for v in theta.values()))
            timings["fetch"].setdefault(str(k), []).append(took)
            t = time.monotonic()
            client.push(r, payload, base_version=r)
            took = (time.monotonic() - t, payload.total_bytes)
            timings["push"].setdefault(str(k), []).append(took)
            del theta
            dest.unlink()
        main.leave("done")
    finally:
        for client in [main, *clients.values()]:
            client.close()
        shutil.rmtree(scratch, ignore_errors=True)
    return timings


def _job(folder: Path, listen: str, width: int, depth: int, rounds: int, streams: int) -> Path:
    from bench.sync_run import job_config

    timeouts = {"heartbeat_interval_s": 2.0, "lease_ttl_s": 120.0}
    text = job_config(width, depth, rounds, 1, "fp32", timeouts)
    text = text.replace("min_sites = 2", "min_sites = 1").replace("max_sites = 2", "max_sites = 1")
    # One site is sent at most half the send slots at once (coordinator.service.send_slots): at the
    # default 8, a site of 8 streams would be sent 4 and have the others refused and retried.
    server = f'listen = "{listen}:0"\nconcurrent_fetches = {2 * streams}'
    text = text.replace('listen = "127.0.0.1:0"', server)
    text += f"\n[transfer]\nstreams = {streams}\nkeep_connections = true\n"
    (folder / "job.toml").write_text(text)
    return folder / "job.toml"


def run(link: WanLink, folder: Path, mib: float, repeats: int, streams: list[int]) -> dict:
    """Serve a job of ``repeats`` rounds per stream count in b, run ``site`` in a; what
    ``site`` returns."""
    from bench.sync_run import _env, _wait_address

    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    width, depth = model_shape(mib)
    rounds = repeats * len(streams)
    config = _job(folder, link.addr_b, width, depth, rounds, max(streams))
    log = open(folder / "coordinator.log", "w")  # noqa: SIM115 - the child's
    cmd = [
        sys.executable,
        "-m",
        "coordinator.cli",
        "serve",
        "--config",
        str(config),
        "--insecure",
    ]
    coord = link.popen_in("b", cmd, env=_env(), stdout=log, stderr=log)
    try:
        address = _wait_address(folder / "state" / "address", coord)
        args = (address, width, depth, rounds, list(streams))
        result = link.call_in("a", "bench.streams_isthmus:site", *args)
        coord.wait(timeout=120)  # the job is done once the site has left
    except Exception as exc:
        raise RuntimeError(f"isthmus on the link failed ({exc}); see {folder}") from exc
    finally:
        if coord.poll() is None:
            coord.kill()
        log.close()
    return result
