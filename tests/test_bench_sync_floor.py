"""The transport floor of ``bench.sync``: real mutual-TLS gRPC between real processes."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from bench.sync_floor import REPO, exchange, floor_seconds
from wire.identity import init_ca, issue


@pytest.fixture(scope="module")
def pki(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("pki")
    init_ca(root / "ca", "floor-test")
    issue(root / "ca", "coordinator", "coordinator", root / "coord", hosts=("127.0.0.1",))
    for i in range(2):
        issue(root / "ca", "site", f"site-{i}", root / f"site-{i}")
    return root


def test_two_sites_exchange_the_bytes_and_the_floor_is_the_slower_ones_median(pki):
    seconds = floor_seconds(pki, (3 << 20) + 5, sites=2, repeats=2)
    assert seconds > 0  # each exchange checked every byte both ways, or it raised


def test_an_exchange_that_moved_other_than_the_bytes_asked_fails(pki):
    server = subprocess.Popen(
        [sys.executable, "-m", "bench.sync_floor", "serve", str(pki / "coord"), "1000", "1"],
        cwd=REPO,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        port = int(server.stdout.readline())
        with pytest.raises(RuntimeError, match="down of 1001 bytes"):
            exchange(pki / "site-0", port, 1001, repeats=1)
    finally:
        server.stdin.close()
        server.wait(timeout=30)


def test_the_last_line_sets_sync_floor_and_all_reduce_side_by_side_largest_model_first(capsys):
    from bench.sync_report import References, report
    from bench.sync_run import JobResult

    results = [
        JobResult("5m", "fp32", 5_000_000, [1.0, 3.0, 2.0], 0.0, 0),
        JobResult("50m", "fp32", 50_000_000, [12.0], 0.0, 0, busy=0.875),
        JobResult("50m", "int8", 50_000_000, [6.0], 0.0, 0),  # in the table, not the ratios
    ]
    tiny = JobResult("1m", "fp32", 262_656, [], 0.125, 0)
    seconds = {"allreduce": [], "floor": []}

    def reference(kind: str, per_param: float):
        return lambda n: seconds[kind].append(n) or n * per_param

    report(results, tiny, 0, References(reference("allreduce", 1e-8), reference("floor", 4e-8)))
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert last.split()[:6] == [
        "sync_vs_allreduce_50m=24.00",  # 12 s against 0.5 s
        "sync_vs_allreduce_5m=40.00",  # the median, 2 s, against 0.05 s
        "floor_vs_allreduce_50m=4.00",
        "floor_vs_allreduce_5m=4.00",
        "sync_vs_floor_50m=6.00",
        "sync_vs_floor_5m=10.00",
    ]
    assert "round_1mib_s=0.125" in last
    assert "sync_machine_busy_50m=0.88" in last and "sync_machine_busy_5m=nan" in last
    assert seconds == {"allreduce": [5_000_000, 50_000_000], "floor": [5_000_000, 50_000_000]}


def test_the_machines_busy_share_is_taken_between_the_samples_inside_a_window():
    from bench.dataplane.machine import busy_between

    # (wall, busy jiffies, total jiffies): 2 cores, 100 jiffies per second each
    samples = [(t, busy, 200 * t) for t, busy in [(0, 0), (1, 50), (2, 250), (3, 450), (4, 460)]]
    assert busy_between(samples, 1.0, 3.0) == 400 / 400  # both cores busy from 1 to 3
    assert busy_between(samples, 0.5, 4.0) == 410 / 600
    assert busy_between(samples, 3.5, 3.9) is None  # no two samples inside
