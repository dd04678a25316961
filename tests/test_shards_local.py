"""A job split over coordinator shards, end to end: ``coordinator local`` with two real sites
over mutual TLS (FSDP2 trainers of the example GPT), ``[shards] count = K``. K = 2 and K = 3
end on the final model K = 1 gives, bit for bit, and so does a run whose shard process is
killed with -9 in the middle of the job."""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time
import tomllib

import pytest
import tomli_w
import torch
from safetensors.torch import load_file

try:  # tests/ as a package or as a plain folder on sys.path
    from . import coord_harness as h
    from .test_local import SMALL, TRAIN_ARGS
except ImportError:
    import coord_harness as h
    from test_local import SMALL, TRAIN_ARGS

pytestmark = [pytest.mark.e2e]
EXAMPLE = h.REPO / "examples" / "gpt_diloco"
FINAL = ("run", "coordinator", "final", "model.safetensors")


def job_file(folder, shards: int, rounds: int = 2):
    job = tomllib.loads((EXAMPLE / "job.toml").read_text())
    for table in ("compression", "evaluation"):
        job.pop(table)
    job["model"]["kwargs"] = {**SMALL, "n_layers": 2}
    job["rounds"].update(total=rounds, inner_steps=3, join_window_s=1.0)
    job["shards"] = {"count": shards}
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "job.toml").write_text(tomli_w.dumps(job))
    return folder / "job.toml"


def run_local(folder, config, during=None):
    cmd = [*h.coordinator_command(), "local", "--sites", "2", "--config", str(config)]
    cmd += ["--run-dir", str(folder / "run"), "--", str(EXAMPLE / "train.py"), *TRAIN_ARGS]
    proc = subprocess.Popen(
        cmd, cwd=h.REPO, env=h.subprocess_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT
    )
    if during is not None:
        threading.Thread(target=during, daemon=True).start()
    out, _ = proc.communicate(timeout=300)
    text = out.decode(errors="replace")
    assert proc.returncode == 0, text[-4000:]
    assert "theta hashes: every site matches the coordinator" in text, text[-4000:]
    return load_file(str(folder.joinpath(*FINAL)))


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    folder = tmp_path_factory.mktemp("k1")
    return run_local(folder, job_file(folder, 1))


def same(a: dict, b: dict) -> bool:
    return set(a) == set(b) and all(torch.equal(a[n], b[n]) for n in a)


@pytest.fixture(scope="module")
def two_shards(tmp_path_factory):
    folder = tmp_path_factory.mktemp("k2")
    return folder, run_local(folder, job_file(folder, 2))


def test_two_shards_end_on_the_model_of_one_process_bit_for_bit(two_shards, one_process):
    tmp_path, final = two_shards
    assert same(final, one_process)
    shard = tmp_path / "run" / "coordinator" / "shards" / "1"
    assert sorted(p.name for p in (shard / "parts").iterdir()) == ["v00000001", "v00000002"]
    # the shard the lead started takes closes from the lead's certificate only
    log = (shard / "shard.log").read_text()
    assert "rounds closed by the lead 'coordinator'" in log, log
    # the lead's checkpoint holds its own tensors only; the final model holds them all
    ckpt = load_file(str(tmp_path / "run/coordinator/checkpoints/round-00000002/theta.safetensors"))
    assert 0 < len(ckpt) < len(final)


@pytest.mark.slow
def test_three_shards_end_on_the_model_of_one_process_bit_for_bit(tmp_path, one_process):
    assert same(run_local(tmp_path, job_file(tmp_path, 3)), one_process)


def test_a_shard_killed_with_minus_9_mid_job_changes_nothing(tmp_path_factory):
    folder = tmp_path_factory.mktemp("killed")
    reference = tmp_path_factory.mktemp("k1-long")
    want = run_local(reference, job_file(reference, 1, rounds=4))
    shard = folder / "run" / "coordinator" / "shards" / "1"
    killed = []

    def kill_after_round_1():  # once the shard holds theta_2, kill -9 it, as a host that fails
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline and not (shard / "parts" / "v00000002").exists():
            time.sleep(0.02)
        pid = int((shard / "lock").read_text().split()[1])
        os.kill(pid, signal.SIGKILL)
        killed.append(pid)

    final = run_local(folder, job_file(folder, 2, rounds=4), during=kill_after_round_1)
    assert killed, "the shard was never killed"
    assert same(final, want)
    log = (shard / "shard.log").read_text()
    assert log.count("serving on") >= 2  # started again by the lead


def test_exporting_a_sharded_checkpoint_is_refused_not_written_half(two_shards):
    tmp_path, _ = two_shards
    out = tmp_path / "round1.safetensors"
    got = h.run_cli(
        "export", "--state-dir", str(tmp_path / "run" / "coordinator"), "--round", "1",
        "--out", str(out),
    )  # fmt: skip
    assert got.returncode != 0
    assert "split over coordinator shards" in got.stderr and "final/model.safetensors" in got.stderr
    assert not out.exists()


def test_a_shard_on_a_host_of_its_own_ends_on_the_same_model(tmp_path, one_process):
    """The K-hosts path of docs/howto/shards.md: the key and the shard's own certificate made
    with `coordinator certs`, the shard started by hand before the lead, `[shards] addresses`."""
    from wire.identity import init_ca, issue

    pki = tmp_path / "run" / "pki"  # coordinator local keeps the bundles it finds there
    init_ca(pki, "isthmus-local")
    issue(pki, "coordinator", "coordinator", pki / "coordinator", hosts=("127.0.0.1", "localhost"))
    issue(pki, "coordinator", "shard-1", pki / "shard-1", hosts=("127.0.0.1",))
    key = tmp_path / "run" / "coordinator" / "shard.key"  # the lead's state_dir/shard.key
    made = h.run_cli("certs", "shard-key", "--out", str(key))
    assert made.returncode == 0 and key.stat().st_mode & 0o777 == 0o600, made.stderr
    config = job_file(tmp_path, 2)
    cmd = [*h.coordinator_command(), "shard", "--config", str(config), "--index", "1"]
    cmd += ["--listen", "127.0.0.1:0", "--state-dir", str(tmp_path / "shard-1")]
    cmd += ["--key", str(key), "--tls-dir", str(pki / "shard-1"), "--lead", "coordinator"]
    log = open(tmp_path / "shard-1.log", "wb")  # noqa: SIM115 - the process holds it
    shard = subprocess.Popen(cmd, cwd=h.REPO, env=h.subprocess_env(), stdout=log, stderr=log)
    try:
        address_file = tmp_path / "shard-1" / "address"
        deadline = time.monotonic() + 60
        while not address_file.exists() and shard.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert address_file.exists(), (tmp_path / "shard-1.log").read_text()
        job = tomllib.loads(config.read_text())
        job["shards"]["addresses"] = [address_file.read_text().strip()]
        config.write_text(tomli_w.dumps(job))
        assert same(run_local(tmp_path, config), one_process)
        assert not (tmp_path / "run" / "coordinator" / "shards").exists()  # none started here
    finally:
        shard.terminate()
        shard.wait(10)
        log.close()
