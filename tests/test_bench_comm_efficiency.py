"""``python -m bench.comm_efficiency``: the streaming simulation against blocking DiLoCo on a
tiny model, the grid syntax and the plan of every scale."""

from __future__ import annotations

import pytest
import torch

from bench.comm.links import NUM_SITES
from bench.comm.plan import SCALES, check_jobs, describe, parse_grid, setup_of
from bench.comm.report import blocking_of, streaming_lines
from bench.comm.runs import Job, Result, Setup, corpus_for, diloco_theta
from bench.comm.streaming import plan_of, streaming_config, streaming_theta
from bench.comm_efficiency import main

TINY = Setup(
    model={"d_model": 16, "n_layers": 2, "n_heads": 2, "d_ff": 32, "seq_len": 16},
    steps=8,
    batch=2,
    warmup=1,
    final_lr_frac=0.1,
    weight_decay=0.01,
    corpus_bytes=1 << 20,
    eval_batches=2,
    eval_batch=4,
)


@pytest.mark.parametrize("codec", ["fp32", "int4+EF"])
def test_one_fragment_without_delay_is_blocking_diloco_bit_for_bit(codec: str):
    corpus = corpus_for(TINY)
    blocking, blocking_bytes = diloco_theta(corpus, TINY, Job(6e-3, 4, codec, 1.0, 0.6))
    job = Job(6e-3, 4, codec, 1.0, 0.6, fragments=1, tau=0, alpha=0.0)
    streamed, streamed_bytes = streaming_theta(corpus, TINY, job)
    assert blocking.keys() == streamed.keys()
    assert all(torch.equal(blocking[n], streamed[n]) for n in blocking)
    assert streamed_bytes == blocking_bytes


def test_each_round_carries_its_fragment_only_both_ways():
    corpus = corpus_for(TINY)
    job = Job(6e-3, 4, "int4+EF", 1.0, 0.6, fragments=2, tau=1, alpha=0.5)
    trace: list = []
    theta, traffic = streaming_theta(corpus, TINY, job, trace)
    plan = plan_of(theta, streaming_config(job))
    rounds = TINY.steps * 2 // 4
    assert [(r, d) for r, d, _ in trace] == [
        (r, d) for r in range(rounds) for d in ["up"] * NUM_SITES + ["down"]
    ]
    for r, _, names in trace:
        assert names == plan.names(r)
    _, blocking = diloco_theta(corpus, TINY, Job(6e-3, 4, "int4+EF", 1.0, 0.6))
    assert 0.4 < traffic.peak / blocking.peak < 0.6  # two fragments of about half the model


def test_grid_items_and_their_checks():
    assert parse_grid(
        ["250:int8", "10:fp32:1:0", "50:int4+EF:1:0.6:P=2:tau=2:alpha=0.5"], 1.0, 0.6
    ) == [
        (250, "int8", 1.0, 0.6),
        (10, "fp32", 1.0, 0.0),
        (50, "int4+EF", 1.0, 0.6, 2, 2, 0.5),
    ]
    with pytest.raises(SystemExit, match="expected"):
        parse_grid(["250:fp32:P=2:rho=1"], 1.0, 0.6)
    with pytest.raises(SystemExit, match="multiple of streaming.fragments"):
        check_jobs([Job(6e-3, *parse_grid(["250:fp32:P=4"], 1.0, 0.6)[0])], 2000)
    with pytest.raises(SystemExit, match="delay_steps"):
        check_jobs([Job(6e-3, *parse_grid(["50:fp32:P=2:tau=25"], 1.0, 0.6)[0])], 2000)


@pytest.mark.parametrize("name", sorted(SCALES))
def test_every_scale_plans(name: str):
    scale = SCALES[name]
    jobs = [Job(scale.lr, *entry) for entry in scale.grid]
    check_jobs(jobs, scale.steps)
    text = describe(setup_of(scale, scale.steps, scale.batch, scale.device), jobs)
    assert text.count("rounds") == len(jobs)
    if name == "gpu":
        assert "114.00 M parameters" in text
        assert "largest 0.25 of the model" in text


def test_gpu_dry_run_parses(capsys):
    main(["--scale", "gpu", "--dry-run"])
    assert "on cuda" in capsys.readouterr().out


def test_streaming_rows_compare_with_blocking_at_the_same_h_and_codec():
    def result(job: Job, loss: float, peak: int) -> Result:
        return Result(job, loss, 0, 0, 0.0, peak)

    blocking = result(Job(6e-3, 250, "fp32", 1.0, 0.6), 2.0, 1000)
    other = result(Job(6e-3, 50, "fp32", 1.0, 0.6), 1.0, 1000)
    streamed = result(Job(6e-3, 250, "fp32", 1.0, 0.6, 2, 5, 0.0), 2.02, 510)
    assert blocking_of(streamed, [other, blocking, streamed]) is blocking
    (line,) = streaming_lines([other, blocking, streamed])
    assert "gap_vs_blocking_pct=1.00 peak_ratio=0.510" in line


@pytest.mark.slow
def test_quick_run_end_to_end(tmp_path, capsys):
    main(["--quick", "--png", str(tmp_path / "plot.png")])
    out = capsys.readouterr().out.splitlines()
    assert out[-1].startswith("ddp_bytes=")
    assert any(line.startswith("streaming H=50 int4+EF") for line in out)
    assert (tmp_path / "plot.png").stat().st_size > 0
