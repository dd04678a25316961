"""Health probes and the rules on them: the ``[health]`` table, which sites the verdicts drain
(and which they may not), the probe's own measures on this machine, ECC parsing, when a site's
trainers probe, and the ``slow_probe`` fault."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from site_client.trainer.faults import fault_at, parse_faults
from site_client.trainer.health_probe import (
    SiteProber,
    ecc_errors,
    gpu_errors,
    matmul_gflops,
    probe_sizes,
    run_probe,
)
from wire.config_table import ConfigError
from wire.health import HealthConfig, Probe, health_from_job, health_verdicts


def _probes(**gflops) -> dict[str, Probe]:
    return {s.replace("_", "-"): Probe(0, g, 0.0, 1, "cpu") for s, g in gflops.items()}


def test_the_table_defaults_and_refusals():
    cfg = health_from_job({})
    assert cfg == HealthConfig() and cfg.enabled and cfg.min_fraction == 0.0
    assert health_from_job({"health": {"every_rounds": 5}}).due(10)
    for table, key in (
        ({"min_fraction": 1.0}, "health.min_fraction"),
        ({"every_rounds": -1}, "health.every_rounds"),
        ({"matmul_size": 99999}, "health.matmul_size"),
        ({"probe": True}, "health.probe"),
    ):
        with pytest.raises(ConfigError, match=key):
            health_from_job({"health": table})


def test_a_site_far_below_the_median_is_drained_and_why():
    probes = _probes(site_a=100.0, site_b=80.0, site_c=5.0)
    cfg = HealthConfig(min_fraction=0.25)
    [verdict] = health_verdicts(probes, cfg, set(probes), min_sites=1)
    assert verdict.site == "site-c" and not verdict.held
    assert "matmul 5 GFLOP/s is 0.06 of the median 80 GFLOP/s of 3 sites" in verdict.reason
    assert health_verdicts(probes, HealthConfig(min_fraction=0.05), set(probes), 1) == []
    assert health_verdicts(probes, HealthConfig(), set(probes), 1) == []  # 0: never


def test_too_few_peers_a_liar_and_min_sites():
    two = _probes(site_a=100.0, site_c=1.0)
    assert health_verdicts(two, HealthConfig(min_fraction=0.5), set(two), 1) == []
    # One site claiming a huge figure cannot make honest ones look slow: the median holds.
    liar = _probes(site_a=1e8, site_b=100.0, site_c=90.0)
    assert health_verdicts(liar, HealthConfig(min_fraction=0.5), set(liar), 1) == []
    slow = _probes(site_a=100.0, site_b=90.0, site_c=1.0, site_d=2.0)
    verdicts = health_verdicts(slow, HealthConfig(min_fraction=0.5), set(slow), min_sites=3)
    assert [(v.site, v.held) for v in verdicts] == [("site-c", False), ("site-d", True)]
    # Sites out of the job (drained, gone) are neither judged nor peers.
    judged = health_verdicts(slow, HealthConfig(min_fraction=0.5), {"site-a", "site-b"}, 1)
    assert judged == []


def test_gpu_errors_drain_and_all_reduce_compares_multi_rank_sites_only():
    probes = {
        "a": Probe(0, 100.0, 10.0, 2, "cuda:x"),
        "b": Probe(0, 100.0, 9.0, 2, "cuda:x"),
        "c": Probe(0, 100.0, 0.5, 2, "cuda:x"),
        "d": Probe(0, 100.0, 0.0, 1, "cuda:x", ("GPU 0: 2 uncorrected ECC errors",)),
    }
    verdicts = {
        v.site: v.reason
        for v in health_verdicts(probes, HealthConfig(min_fraction=0.25), set(probes), 1)
    }
    assert set(verdicts) == {"c", "d"}
    assert verdicts["c"].startswith("all-reduce 0.5 GB/s") and "of 3 sites" in verdicts["c"]
    assert verdicts["d"] == "GPU errors: GPU 0: 2 uncorrected ECC errors"
    off = HealthConfig(min_fraction=0.0, drain_on_gpu_errors=False)
    assert health_verdicts(probes, off, set(probes), 1) == []


@pytest.mark.parametrize(
    "bad",
    [
        {"matmul_gflops": float("nan")},
        {"allreduce_gbps": -1.0},
        {"matmul_gflops": 1e12},
        {"device": "x" * 129},
        {"gpu_errors": ("e",) * 17},
        {"gpu_errors": ("e" * 257,)},
        {"device": "cpu\n2026-12-01 ERROR forged line"},
        {"gpu_errors": ("\x1b[2J",)},
    ],
)
def test_an_unreadable_probe_names_its_problem(bad):
    fields = {"round": 0, "matmul_gflops": 1.0, "allreduce_gbps": 0.0, "world_size": 1}
    assert Probe(**{**fields, "device": "cpu", **bad}).problem()
    assert Probe(**fields, device="cpu").problem() is None


def test_ecc_counts_from_nvidia_smi_output(monkeypatch):
    out = "0, 0\n1, 3\n2, [N/A]\nnot a line\n"
    assert ecc_errors(out) == ("GPU 1: 3 uncorrected ECC errors",)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert gpu_errors(run=lambda cmd: out) == ()  # no GPU: nothing asked
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    asked = []
    assert gpu_errors(run=lambda cmd: asked.append(cmd) or out) == ecc_errors(out)
    assert asked[0][0] == "nvidia-smi" and "ecc.errors.uncorrected" in asked[0][1]

    def fails(cmd):
        raise OSError("driver not loaded")

    assert gpu_errors(run=fails) == ()


def test_the_probe_measures_this_machine_and_the_fault_slows_it():
    n, nbytes = probe_sizes(HealthConfig(), on_gpu=False)
    assert (n, nbytes) == (256, 1 << 20)
    assert probe_sizes(HealthConfig(matmul_size=64, allreduce_mib=1), True) == (64, 1 << 20)
    assert matmul_gflops(64, torch.device("cpu")) > 0
    # 4 matmuls of 64 x 64 are 2.1 MFLOP: with 0.5 s more they cannot reach 0.005 GFLOP/s.
    assert matmul_gflops(64, torch.device("cpu"), slower_s=0.5) < 0.005


def test_a_one_rank_probe_and_when_trainers_probe(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    try:
        sent = []
        prober = SiteProber(
            HealthConfig(every_rounds=3, matmul_size=64), 0, 1, lambda r: 0.0, sent.append
        )
        assert [r for r in range(8) if prober.before(r) is not None] == [0, 3, 6]
        assert prober.before(6) is None  # each round once
        late = SiteProber(
            HealthConfig(every_rounds=3, matmul_size=64), 0, 1, lambda r: 0.0, sent.append
        )
        assert late.before(4) is not None  # the trainers' start, whatever the round
        off = SiteProber(HealthConfig(enabled=False), 0, 1, lambda r: 0.0, sent.append)
        assert off.before(0) is None
        result = run_probe(HealthConfig(matmul_size=64), 2, 0, 1, torch.device("cpu"))
        assert result.round == 2 and result.world_size == 1 and result.allreduce_gbps == 0.0
        assert result.device == "cpu" and result.matmul_gflops > 0 and result.gpu_errors == ()
        assert [r.round for r in sent] == [0, 3, 6, 4]
    finally:
        dist.destroy_process_group()


def test_the_slow_probe_fault():
    faults = parse_faults("site=a,round=0,step=0,action=slow_probe,seconds=4")
    assert fault_at(faults, "a", 0, 0, 0, 0, actions=("slow_probe",)).seconds == 4.0
    assert fault_at(faults, "a", 0, 0, 0, 0) is None  # no step fault: it is the probe's
    with pytest.raises(ValueError, match="slow_probe needs seconds"):
        parse_faults("site=a,round=0,step=0,action=slow_probe")
