"""The end of a job: the final model file, ``coordinator export``, a restart of a finished job,
and a job stopped by a signal."""

from __future__ import annotations

import json
import signal
import threading

import pytest
import torch
from safetensors.torch import load_file

try:  # tests/ as a package or as a plain folder on sys.path
    from . import coord_harness as h
    from .test_coordinator_cli import one_line_error
except ImportError:
    import coord_harness as h
    from test_coordinator_cli import one_line_error

from coordinator.persist.export import load_model, read_card
from coordinator.persist.local_store import CheckpointStore
from coordinator.service.job_end import already_complete, signal_exit_code, stopped_message

pytestmark = pytest.mark.e2e
ROUNDS = 2


@pytest.fixture(scope="module")
def finished(tmp_path_factory):
    """A two-round job run to its end by one site."""
    folder = tmp_path_factory.mktemp("finished")
    cfg = h.job_config(name="ends", rounds={"total": ROUNDS, "max_sites": 1})
    coord = h.start_coordinator(folder, cfg)
    hashes = []
    site = threading.Thread(target=lambda: hashes.append(h.drive_site(coord.address, "s0")))
    site.start()
    site.join(timeout=60)
    try:
        assert coord.wait(timeout=30) == 0, coord.log_tail()
    finally:
        coord.kill()
    assert hashes, coord.log_tail()
    return coord, hashes[0]


def test_the_final_model_is_written_and_its_path_printed(finished):
    coord, site_hash = finished
    path = coord.state_dir / "final" / "model.safetensors"
    assert f"job 'ends' complete; final model: {path}" in coord.log_path.read_text()
    card = read_card(path)
    assert (card.job, card.round, card.theta_digest) == ("ends", ROUNDS, site_hash.hex())
    assert card.model["factory"] == "coord_harness:tiny_model"
    model = load_model(path)  # the [model] table's factory, theta loaded strictly
    assert isinstance(model, h.TinyModel)
    want = CheckpointStore(coord.state_dir, read_only=True).load_round(ROUNDS).theta
    got = model.state_dict()
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)


def test_restarting_a_finished_job_says_so_and_exits_0(finished):
    coord, _ = finished
    result = h.run_cli("serve", "--config", str(coord.config_path), "--insecure", timeout=30)
    assert result.returncode == 0, result.stderr
    line = result.stdout.strip()
    final = coord.state_dir / "final" / "model.safetensors"
    assert line.startswith("job 'ends' is complete (2 rounds); final model: "), line
    assert str(final) in line, line


def test_export_a_kept_round(finished, tmp_path):
    coord, _ = finished
    out = tmp_path / "r1.safetensors"
    result = h.run_cli(
        "export", "--state-dir", str(coord.state_dir), "--round", "1", "--out", str(out)
    )
    assert result.returncode == 0, result.stderr
    assert str(out) in result.stdout and "round 1" in result.stdout, result.stdout
    want = CheckpointStore(coord.state_dir, read_only=True).load_round(1).theta
    got = load_file(str(out))
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
    card = json.loads((tmp_path / "r1.json").read_text())
    assert card["round"] == 1 and card["model"]["kwargs"] == {"d_in": 8}


@pytest.mark.parametrize(
    "args, words",
    [
        (["--round", "7"], ["no checkpoint of round 7", "kept: 0, 1, 2"]),
        (["--out", "model.pt"], ["must end in .safetensors"]),
        (["--out", "/nonexistent/m.safetensors"], ["no folder /nonexistent"]),
    ],
    ids=["round-not-kept", "not-safetensors", "no-folder"],
)
def test_export_refusals(finished, tmp_path, args, words):
    coord, _ = finished
    argv = ["export", "--state-dir", str(coord.state_dir), "--out", str(tmp_path / "m.safetensors")]
    result = h.run_cli(*argv, *args)
    assert result.returncode == 2
    line = one_line_error(result)
    assert all(w in line for w in words), line


def test_export_from_a_folder_that_is_no_state_folder(tmp_path):
    result = h.run_cli(
        "export", "--state-dir", str(tmp_path / "nope"), "--out", str(tmp_path / "m.safetensors")
    )
    assert result.returncode == 2
    assert "holds no checkpoints" in one_line_error(result)
    assert not (tmp_path / "nope").exists(), "export must create nothing"


@pytest.mark.parametrize("sig, code", [(signal.SIGTERM, 143), (signal.SIGINT, 130)])
def test_a_signal_stops_a_running_job_non_zero_saying_how_to_resume(tmp_path, sig, code):
    coord = h.start_coordinator(tmp_path, h.job_config(name="stopped"))
    try:
        coord.kill(sig)
        assert coord.proc.returncode == code, coord.log_tail()
    finally:
        coord.kill()
    last = coord.log_tail().splitlines()[-1]
    assert last.startswith(f"coordinator: stopped by {sig.name} in round 0 of 3"), last
    assert f"resume with `coordinator serve --config {coord.config_path}`" in last, last
    assert not (coord.state_dir / "complete.json").exists()


def test_completion_and_exit_rules():
    from coordinator.service.job_end import Completion

    done = Completion("j", 5, "final/model.safetensors", "ab" * 32)
    assert already_complete(done, "j", 5)
    assert not already_complete(done, "j", 8), "more rounds configured: train on"
    assert not already_complete(done, "other", 5)
    assert not already_complete(None, "j", 5)
    assert (signal_exit_code(signal.SIGINT), signal_exit_code(signal.SIGTERM)) == (130, 143)
    text = stopped_message(signal.SIGTERM, 5, 5, "st", "coordinator serve --config j.toml")
    assert "after the last round" in text


def test_a_call_in_flight_after_leave_does_not_join_again(tmp_path):
    """A heartbeat sent while the agent leaves comes back refused ("holds no lease"): it must
    not re-join, or the coordinator waits for a site that is gone."""
    from site_client.transfer.client import CoordinatorClient, CoordinatorError

    coord = h.start_coordinator(tmp_path, h.job_config(name="leaving"))
    client = CoordinatorClient(coord.address, "s0", backoff=h.FAST_BACKOFF)
    try:
        client.join()
        client.leave("done")
        with pytest.raises(CoordinatorError, match="has left the job"):
            client.heartbeat()
        assert {s.site: s.state for s in h.status(coord.address).sites} == {"s0": "left"}
    finally:
        client.close()
        coord.kill()
