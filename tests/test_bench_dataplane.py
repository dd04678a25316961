"""bench.dataplane's parts: the sampler's windows, thread names, the floor, the figures."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from bench.dataplane.floor import PassFloor, TlsFloor, pass_floor
from bench.dataplane.report import Figures
from bench.dataplane.run import JobRun, Phase
from bench.dataplane.sampler import PROCESS, Sampler, group_of, thread_times

REPO = Path(__file__).resolve().parent.parent


def test_cpu_in_a_window_is_the_difference_of_the_samples_around_it():
    s = Sampler()
    s.series["c"] = [
        (10.0, {PROCESS: 6.0, (1, "fold_0"): 1.0, (2, "grpc-handler_0"): 5.0}),
        (11.0, {PROCESS: 7.5, (1, "fold_0"): 1.5, (2, "grpc-handler_0"): 6.0}),
        # A gRPC thread that lived between the samples spent 0.25 s: only the total knows.
        (12.0, {PROCESS: 9.75, (1, "fold_0"): 3.0, (2, "grpc-handler_0"): 6.0, (3, "ckpt"): 0.5}),
    ]
    # The samples enclosing the window: 10.0 and 12.0.
    assert s.cpu("c", 10.5, 11.5) == pytest.approx(3.75)
    assert s.cpu("c", 11.0, 12.0, "fold") == pytest.approx(1.5)
    assert s.by_group("c", 10.0, 12.0) == {
        "checkpoint": pytest.approx(0.5),
        "fold": pytest.approx(2.0),
        "grpc handlers": pytest.approx(1.0),
        "exited threads": pytest.approx(0.25),
    }
    assert s.cpu("nobody", 0, 1) == 0.0


def test_thread_groups_by_native_name():
    assert group_of("fold_0") == "fold"
    assert group_of("checkpoint_0") == "checkpoint"
    assert group_of("grpc-handler_3") == "grpc handlers"
    assert group_of("digest_2") == "digests"
    assert group_of("Thread-1 (_serv") == "grpc poller"
    assert group_of("python") == "main thread"  # the process's first thread bears its name
    assert group_of("lifeguard") == "lifeguard"  # no known part: its own name


def test_child_threads_carry_their_python_names(tmp_path):
    """The injected sitecustomize names native threads, so /proc tells them apart."""
    code = textwrap.dedent(
        """
        import threading, time, sys
        stop = threading.Event()
        t = threading.Thread(target=stop.wait, name="fold_7")
        t.start()
        print("ready", flush=True)
        sys.stdin.readline()
        stop.set()
        """
    )
    inject = REPO / "bench" / "dataplane" / "inject"
    env = dict(os.environ, PYTHONPATH=f"{inject}:{REPO}")
    proc = subprocess.Popen(
        [sys.executable, "-c", code], env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE
    )
    try:
        assert proc.stdout.readline().strip() == b"ready"
        names = {name for _, name in thread_times(proc.pid)}
    finally:
        proc.communicate(b"\n", timeout=30)
    assert "fold_7" in names


def test_figures_weigh_each_direction_by_its_bytes():
    push = Phase(bytes=2_000_000_000, coordinator=4.0, agents=2.0)
    close = Phase(coordinator=1.0)
    fetch = Phase(bytes=2_000_000_000, coordinator=1.0, agents=3.0)
    job = JobRun(push, close, fetch, checkpoint_s=9.0, model_bytes=10**9, rounds=1)
    tls = TlsFloor(server_recv=0.5, server_send=0.3, client_send=0.4, client_recv=0.6)
    passes = PassFloor(memcpy=0.1, digest=0.2, add=0.05)
    f = Figures.of(job, tls, passes)
    assert f.coord == pytest.approx((4 + 1 + 1) / 4)
    assert f.coord_floor == pytest.approx((2 * (0.5 + 0.1 + 0.2 + 0.05) + 2 * 0.3) / 4)
    assert f.agent == pytest.approx(5 / 4)
    assert f.agent_floor == pytest.approx((2 * (0.4 + 0.2) + 2 * (0.6 + 0.1 + 0.2)) / 4)
    line = f.last_line()
    assert line.startswith("coord_cpu_s_per_gb=1.500 ")
    assert "coord_vs_floor=" in line and "agent_vs_floor=" in line


def test_pass_floor_measures_each_pass():
    floor = pass_floor(16 << 20, repeats=1)
    assert floor.memcpy > 0 and floor.digest > 0 and floor.add > 0


def test_a_finished_job_keeps_only_its_logs(tmp_path):
    from bench.sync_run import shed

    (tmp_path / "state" / "checkpoints").mkdir(parents=True)
    (tmp_path / "state" / "checkpoints" / "theta.safetensors").write_bytes(b"x" * 100)
    (tmp_path / "run-0").mkdir()
    (tmp_path / "run-0" / "timings.jsonl").write_text("{}\n")
    (tmp_path / "coordinator.log").write_text("ok\n")
    (tmp_path / "site-0").mkdir()
    (tmp_path / "site-0" / "cert.pem").write_text("-----")
    shed(tmp_path)
    left = sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*"))
    assert left == ["coordinator.log", "run-0", "run-0/timings.jsonl", "site-0", "site-0/cert.pem"]


def test_the_site_checkpoint_bench_writes_both_ways_and_ends_on_its_figures(
    capsys, tmp_path, monkeypatch
):
    from bench.dataplane import site_checkpoint

    monkeypatch.chdir(tmp_path)
    assert site_checkpoint.main(["--size", "1m", "--writes", "3", "--pause", "0"]) == 0
    last = capsys.readouterr().out.strip().splitlines()[-1]
    figures = dict(item.split("=") for item in last.split())
    assert set(figures) == {
        "spare_wall_s",
        "spare_cpu_s",
        "new_files_wall_s",
        "new_files_cpu_s",
        "new_files_over_spare_cpu",
    }
    # Figures, not timings to judge: a 1 MB write's CPU can print as 0.000.
    assert all(float(v) >= 0 for v in figures.values())
    assert list(tmp_path.iterdir()) == []  # its folders are gone
