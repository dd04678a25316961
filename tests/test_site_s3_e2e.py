"""A real job whose sites keep their checkpoints in object storage (``--checkpoint-url``): a
coordinator over mutual TLS, two ``siteclient start`` agents with 2 FSDP2 trainers each, and a
real SeaweedFS. One trainer of site-0 is killed in round 1; the restarted trainers resume from
the checkpoint in the bucket and the job ends with both sites holding the coordinator's theta."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import uuid

import pytest
from coord_harness import subprocess_env
from test_site_e2e import ROUNDS, final_theta_hash, start_site, start_tls_coordinator, tiny_gpt_job

from site_client.checkpoint import s3_layout as layout

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


def test_fsdp_sites_resume_from_checkpoints_in_object_storage(tmp_path, seaweed):
    coord = start_tls_coordinator(tmp_path, tiny_gpt_job("site-s3-e2e", sites=2))
    env = {**subprocess_env(), **seaweed.env()}
    env["ISTHMUS_FAULTS"] = "site=site-0,round=1,step=3,rank=1,action=kill"
    prefix = f"sites-{uuid.uuid4().hex[:8]}"
    flags = ("--checkpoint-url", f"s3://{seaweed.bucket}/{prefix}")
    sites = [start_site(tmp_path, coord.address, i, env, flags) for i in range(2)]
    try:
        codes = [p.wait(timeout=300) for p in sites]
        logs = {i: (tmp_path / f"site-{i}.log").read_text() for i in range(2)}
        assert codes == [0, 0], f"site exit codes {codes}:\n{logs[0][-3000:]}\n{logs[1][-3000:]}"
        assert coord.wait(timeout=60) == 0, coord.log_tail()
    finally:
        for p in sites:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGKILL)
        coord.stop()
    rank1 = (tmp_path / "site-0" / "trainers" / "rank-1.pid").read_text().split()
    assert rank1[1] == "1", "site-0's trainers were not restarted once"
    want = final_theta_hash(tmp_path)
    for i in range(2):
        final = json.loads((tmp_path / f"site-{i}" / "final.json").read_text())
        assert final["version"] == ROUNDS and final["theta_hash"] == want
    # The checkpoints are in the bucket, each site under its own folder, pruned to two; none
    # in the run folder.
    client = seaweed.client()
    for i in range(2):
        pages = client.get_paginator("list_objects_v2").paginate(
            Bucket=seaweed.bucket, Prefix=f"{prefix}/site-{i}/"
        )
        keys = [o["Key"].split("/", 2)[2] for p in pages for o in p.get("Contents", [])]
        names = layout.committed(keys, str)
        assert len(names) == 2, keys
        for name in names:
            doc = json.loads(
                client.get_object(
                    Bucket=seaweed.bucket, Key=f"{prefix}/site-{i}/{layout.manifest_key(name)}"
                )["Body"].read()
            )
            assert doc["world_size"] == 2
            assert {".metadata", "__0_0.distcp", "__1_0.distcp"} <= set(doc["files"])
        assert not list((tmp_path / f"site-{i}" / "checkpoints").glob("step-*"))
