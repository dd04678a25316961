"""The session tells the script who it is: ``session.site``, and each round its place among
the round's participants (``rnd.site_index`` of ``rnd.num_sites``) and its data unit, with no
flags of the script's own. Two real agents, one trainer each, on a real coordinator."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

try:  # tests/ as a package or as a plain folder on sys.path
    from . import coord_harness as h
except ImportError:
    import coord_harness as h

from coordinator.core import site_position

pytestmark = pytest.mark.e2e

TRAINER = """
import json, sys
import torch
from coord_harness import tiny_model
from site_client.trainer.session import SiteSession

torch.set_num_threads(1)
session = SiteSession()
model = tiny_model()
opt = torch.optim.SGD(model.parameters(), lr=0.1)
seen = []
for rnd in session.rounds(model, opt):
    for step in rnd.steps():
        model.lin(torch.ones(2, 8)).sum().backward()
        opt.step()
        opt.zero_grad()
    seen.append([rnd.number, rnd.site_index, rnd.num_sites, rnd.data_unit])
with open(sys.argv[1], "w") as f:
    json.dump({"site": session.site, "rounds": seen,
               "last": [session.site_index, session.num_sites]}, f)
session.close()
"""


@pytest.mark.slow  # 12 s
def test_the_script_learns_its_site_index_and_count(tmp_path):
    cfg = h.job_config(name="who", rounds={"total": 2, "min_sites": 2, "max_sites": 2})
    coord = h.start_coordinator(tmp_path, cfg)
    script = tmp_path / "train.py"
    script.write_text(TRAINER)
    sites = ["dc-west", "dc-east"]  # sorted: dc-east is 0, dc-west 1
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "site_client.cli",
                "start",
                "--coordinator",
                coord.address,
                "--site",
                site,
                "--insecure",
                "--run-dir",
                str(tmp_path / site),
                "--",
                str(script),
                str(tmp_path / f"{site}.json"),
            ],
            cwd=h.REPO,
            env=h.subprocess_env(),
            stdout=subprocess.DEVNULL,
            stderr=open(tmp_path / f"{site}.log", "w"),  # noqa: SIM115 - owned by the child
        )  # fmt: skip
        for site in sites
    ]
    try:
        codes = [p.wait(timeout=120) for p in procs]
        assert codes == [0, 0], [(tmp_path / f"{s}.log").read_text()[-2000:] for s in sites]
        assert coord.wait(timeout=30) == 0, coord.log_tail()
    finally:
        for p in procs:
            p.kill()
        coord.kill()
    for site, index in (("dc-east", 0), ("dc-west", 1)):
        seen = json.loads((tmp_path / f"{site}.json").read_text())
        assert seen["site"] == site
        assert seen["rounds"] == [[0, index, 2, ""], [1, index, 2, ""]]
        assert seen["last"] == [index, 2]


def test_site_position_rule():
    assert site_position("b", {"c", "a", "b"}) == (1, 3)
    assert site_position("z", {"a"}) == (0, 1)
    assert site_position(None, set()) == (0, 0)
