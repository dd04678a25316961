"""Robust aggregation: median, trimmed mean, clipping, NaN/Inf and outlier rejection, the
buffer limit, the [aggregation] config table and what `coordinator status` shows.

References are computed in float64 from the deltas the sites sent, with numpy's median.
"""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch

from coordinator.config import ConfigError, parse_config
from coordinator.intake.spool import UpdateSpool
from coordinator.observe.status import format_status
from strategies import AggregationError, FedAvg, RobustAggregator, load_strategy
from strategies.robust import close_round
from wire.digest import state_digest
from wire.proto import isthmus_pb2 as pb

try:
    from . import coord_harness as h
    from . import strategy_helpers as sh
except ImportError:
    import coord_harness as h
    import strategy_helpers as sh

LIKE = {"a": torch.zeros(7, 3), "b": torch.zeros(4, dtype=torch.bfloat16), "c": torch.zeros(())}


def _deltas(n: int, seed: int = 0) -> dict[str, dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    out = {}
    for i in range(n):
        out[f"s{n - i}"] = {  # names not in site order
            "a": torch.randn(7, 3, generator=g),
            "b": torch.randn(4, generator=g).to(torch.bfloat16),
            "c": torch.randn((), generator=g),
        }
    return out


def _updates(tmp_path, deltas, weights=None):
    spool = UpdateSpool(tmp_path / "spool")
    return [
        sh.spool_update(spool, 0, s, d, (weights or {}).get(s, 1.0)).as_site_update()
        for s, d in deltas.items()
    ]


@pytest.mark.parametrize("n", [5, 4])  # odd and even: numpy averages the two middle values
def test_median_is_numpy_median_per_coordinate(tmp_path, n):
    deltas = _deltas(n)
    weights = {s: float(3 * i + 1) for i, s in enumerate(deltas)}  # ignored by the median
    out = RobustAggregator("median").aggregate(_updates(tmp_path, deltas, weights), LIKE, 0)
    agg = out.aggregate
    assert not out.rejected and agg.total_weight == sum(weights.values())
    for k in LIKE:
        ref = np.median(np.stack([deltas[s][k].double().numpy() for s in deltas]), axis=0)
        torch.testing.assert_close(agg.mean_delta[k].double(), torch.as_tensor(ref))


@pytest.mark.parametrize(("n", "fraction"), [(5, 0.2), (10, 0.25), (5, 0.1)])
def test_trimmed_mean_cuts_int_fraction_n_at_each_end(tmp_path, n, fraction):
    deltas = _deltas(n, seed=n)
    out = RobustAggregator("trimmed_mean", trim_fraction=fraction).aggregate(
        _updates(tmp_path, deltas), LIKE, 0
    )
    cut = int(fraction * n)
    for k in LIKE:
        values = np.sort(np.stack([deltas[s][k].double().numpy() for s in deltas]), axis=0)
        ref = values[cut : n - cut].mean(axis=0)
        torch.testing.assert_close(out.aggregate.mean_delta[k].double(), torch.as_tensor(ref))


def test_clip_norm_scales_large_updates_only(tmp_path):
    deltas = _deltas(3)
    deltas["s1"] = {k: v * 50 for k, v in deltas["s1"].items()}
    norms = {
        s: float(torch.sqrt(sum((t.double() ** 2).sum() for t in d.values())))
        for s, d in deltas.items()
    }
    clip = sorted(norms.values())[1] * 1.01  # between the middle and the largest norm
    weights = {"s1": 2.0, "s2": 1.0, "s3": 5.0}
    out = RobustAggregator(clip_norm=clip).aggregate(_updates(tmp_path, deltas, weights), LIKE, 0)
    assert set(out.clipped) == {"s1"} and out.clipped["s1"] == pytest.approx(norms["s1"])
    factor = {s: min(1.0, clip / norms[s]) for s in deltas}
    for k in LIKE:
        ref = sum(weights[s] * factor[s] * deltas[s][k].double() for s in deltas) / 8.0
        torch.testing.assert_close(out.aggregate.mean_delta[k].double(), ref, rtol=1e-5, atol=1e-6)


def test_outlier_norm_is_rejected_with_its_reason(tmp_path):
    deltas = _deltas(5)
    deltas["s3"] = {k: v * 100 for k, v in deltas["s3"].items()}
    deltas["s4"] = {k: v * 0.01 for k, v in deltas["s4"].items()}  # small: harmless, kept
    out = RobustAggregator(outlier_zscore=3.5).aggregate(_updates(tmp_path, deltas), LIKE, 2)
    assert list(out.rejected) == ["s3"]
    assert re.search(
        r"norm \S+ is an outlier .*aggregation.outlier_zscore = 3.5", out.rejected["s3"]
    )
    kept = [s for s in deltas if s != "s3"]
    assert sorted(out.aggregate.weights) == sorted(kept) and out.aggregate.rejected == out.rejected
    for k in LIKE:
        ref = sum(deltas[s][k].double() for s in kept) / len(kept)
        torch.testing.assert_close(out.aggregate.mean_delta[k].double(), ref, rtol=1e-5, atol=1e-6)
    # Fewer than three updates: no rejection by norm (nothing to call typical).
    two = {s: deltas[s] for s in ("s3", "s5")}
    assert (
        not RobustAggregator(outlier_zscore=3.5)
        .aggregate(_updates(tmp_path / "2", two), LIKE, 0)
        .rejected
    )


@pytest.mark.parametrize("method", ["mean", "median"])
def test_nan_and_inf_updates_are_rejected(tmp_path, method):
    deltas = _deltas(4)
    deltas["s2"]["a"][1, 1] = float("nan")
    deltas["s4"]["c"] = torch.tensor(float("inf"))
    out = RobustAggregator(method).aggregate(_updates(tmp_path, deltas), LIKE, 0)
    assert out.rejected == {
        "s2": "NaN or Inf values in tensor 'a'",
        "s4": "NaN or Inf values in tensor 'c'",
    }
    assert sorted(out.aggregate.weights) == ["s1", "s3"]
    for k in LIKE:
        ref = (deltas["s1"][k].double() + deltas["s3"][k].double()) / 2
        torch.testing.assert_close(out.aggregate.mean_delta[k].double(), ref, rtol=1e-5, atol=1e-6)


def test_every_update_rejected_keeps_theta_and_skips_the_strategy(tmp_path):
    deltas = _deltas(2)
    for d in deltas.values():
        d["a"][0, 0] = float("nan")

    class Boom(FedAvg):
        def outer_step(self, theta, aggregate):
            raise AssertionError("must not be called")

    theta = {k: torch.ones_like(v) for k, v in LIKE.items()}
    new, out = close_round(Boom(), RobustAggregator(), theta, _updates(tmp_path, deltas), 0)
    assert new is theta and out.aggregate is None and sorted(out.rejected) == ["s1", "s2"]


def test_buffer_limit_refuses_with_the_key_and_the_numbers():
    like = {"w": torch.zeros(1000, 250), "b": torch.zeros(250)}  # 1 MB in float32
    fedavg = FedAvg()
    RobustAggregator(max_buffer_bytes=1).check(fedavg, 64, like)  # the mean streams: no buffer
    median = RobustAggregator("median", max_buffer_bytes=10_000_000)
    assert median.buffer_bytes(4, like, fedavg) == 16 * 4 * 250_000
    median.check(fedavg, 2, like)
    with pytest.raises(AggregationError) as err:
        median.check(fedavg, 4, like)
    msg = str(err.value)
    assert msg.startswith("aggregation.max_buffer_bytes:")
    assert "16.0 MB, over the limit of 10.0 MB" in msg and "rounds.max_sites" in msg


def test_median_with_a_strategy_that_combines_updates_itself_is_refused():
    krum = load_strategy("flower:Krum", {})
    with pytest.raises(AggregationError, match=r"^aggregation.method: 'median' cannot be combined"):
        RobustAggregator("median").check(krum, 2, {"w": torch.zeros(3)})
    RobustAggregator("mean", clip_norm=1.0).check(krum, 2, {"w": torch.zeros(3)})


# ---- the [aggregation] table ---------------------------------------------------------------


def _cfg(tmp_path, **aggregation):
    data = h.job_config()
    if aggregation:
        data["aggregation"] = aggregation
    return parse_config(data, tmp_path)


def test_aggregation_table_defaults_and_values(tmp_path):
    a = _cfg(tmp_path).aggregation
    assert (a.method, a.trim_fraction, a.clip_norm, a.outlier_zscore) == ("mean", 0.2, 0.0, 0.0)
    assert a.max_buffer_bytes == 8 << 30
    b = _cfg(
        tmp_path, method="trimmed_mean", trim_fraction=0.1, clip_norm=2, outlier_zscore=3
    ).aggregation
    assert (b.method, b.trim_fraction, b.clip_norm, b.outlier_zscore) == (
        "trimmed_mean",
        0.1,
        2.0,
        3.0,
    )
    assert (
        RobustAggregator.from_config(b).describe() == "trimmed_mean, trim 0.1, clip 2, outlier z 3"
    )


@pytest.mark.parametrize(
    ("table", "message"),
    [
        ({"method": "avg"}, "aggregation.method: must be one of"),
        ({"methd": "median"}, "aggregation.methd: unknown key"),
        (
            {"trim_fraction": 0.1},
            "aggregation.trim_fraction: only used with method = 'trimmed_mean'",
        ),
        (
            {"method": "trimmed_mean", "trim_fraction": 0.5},
            "aggregation.trim_fraction: must be in [0, 0.5)",
        ),
        ({"clip_norm": -1.0}, "aggregation.clip_norm: must be a finite number >= 0"),
        ({"outlier_zscore": "3"}, "aggregation.outlier_zscore: expected a number"),
        ({"max_buffer_bytes": 0}, "aggregation.max_buffer_bytes: must be > 0"),
        ({"max_buffer_bytes": 1.5}, "aggregation.max_buffer_bytes: expected an integer"),
    ],
)
def test_aggregation_table_errors_name_the_key(tmp_path, table, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        _cfg(tmp_path, **table)


def test_status_shows_rejections_and_the_aggregation():
    reply = pb.StatusReply(
        job_name="j",
        round=pb.RoundInfo(round=2, total_rounds=5),
        strategy="FedAvg()",
        aggregation="median, clip 1",
        rejections=["round 1: site-c: norm 900 is an outlier (...)"],
        waiting_reason="waiting",
    )
    text = format_status(reply)
    assert "aggregation median, clip 1" in text.splitlines()[0]
    assert "rejected updates (1 most recent):\n  round 1: site-c: norm 900 is an outlier" in text
    assert "rejected" not in format_status(pb.StatusReply(job_name="j"))


# ---- end to end -----------------------------------------------------------------------------


@pytest.mark.e2e
def test_outlier_rejected_by_a_real_coordinator_shows_in_status(tmp_path):
    weights = {"site-a": 1.0, "site-b": 2.0, "site-c": 1.0}
    cfg = h.job_config(
        strategy={"name": "fedavg"},
        aggregation={"outlier_zscore": 3.0},
        rounds={"total": 2, "min_sites": 3, "max_sites": 3},
    )
    coord = h.start_coordinator(tmp_path, cfg)
    seen = {}

    def delta(theta, k, r):
        if k == 0 and r == 1:
            seen["status"] = h.status(coord.address)
        d = sh.sine_delta(theta, k, r)
        return {n: t * 1000 for n, t in d.items()} if (k, r) == (2, 0) else d

    try:
        runs = sh.run_sites(coord.address, weights, delta)
        assert coord.wait(timeout=20) == 0, coord.log_tail()
    finally:
        coord.kill()
    for run in runs:
        assert run.error is None, f"{run.name}: {run.error!r}\n{coord.log_tail()}"
    status = seen["status"]
    assert len(status.rejections) == 1 and status.aggregation == "mean, outlier z 3"
    assert re.match(r"round 0: site-c: norm \S+ is an outlier", status.rejections[0])
    assert "rejected updates (1 most recent)" in format_status(status)
    theta0, theta1 = runs[0].fetched[0].theta, runs[0].fetched[1].theta
    d = {k: sh.sine_delta(theta0, k, 0) for k in (0, 1)}
    for name, t in theta0.items():
        if not t.is_floating_point():
            assert torch.equal(theta1[name], t)
            continue
        want = t.double() - (1.0 * d[0][name].double() + 2.0 * d[1][name].double()) / 3.0
        torch.testing.assert_close(theta1[name].double(), want, rtol=1e-6, atol=1e-6)
    name, meta, _ = sh.latest_checkpoint(tmp_path / "state")
    assert meta["theta_digest"] == state_digest(runs[0].final.theta).hex()
    assert "site-c" not in meta["closed_round"]["rejected"]  # round 1 had no outlier
    assert "round 0: update of site-c rejected: norm" in coord.log_path.read_text()


@pytest.mark.e2e
def test_coordinator_refuses_to_start_over_the_buffer_limit(tmp_path):
    cfg = h.job_config(aggregation={"method": "median", "max_buffer_bytes": 1000})
    with pytest.raises(RuntimeError, match="exited with 2 before listening") as err:
        h.start_coordinator(tmp_path, cfg)
    assert "coordinator: error: aggregation.max_buffer_bytes: combining 2 updates" in str(err.value)
