"""Site checkpoints: FSDP2 save on 2 ranks, resharded load on 1 and 3 ranks and in a plain process.

The multi-rank cases launch real trainer processes (gloo on loopback) running ``_WORKER``.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

from examples.gpt_diloco.model import build_model, lm_loss
from site_client.checkpoint import local as ckpt
from site_client.checkpoint.local import (
    MANIFEST,
    SiteCheckpointConfig,
    SiteCheckpointError,
    latest_site_checkpoint,
    load_site_checkpoint,
    prune_site_checkpoints,
    save_site_checkpoint,
    site_checkpoint_path,
)

REPO = Path(__file__).resolve().parents[1]
TINY = {"seq_len": 32, "d_model": 32, "n_layers": 2, "n_heads": 2, "d_ff": 64}


# Trains 2 steps and saves ("save"), or loads into a freshly initialised model ("load"); then
# snapshots the full model/optimiser state, takes one more step and snapshots the parameters.
_WORKER = textwrap.dedent(
    """
    import copy
    import os
    import sys
    import torch
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions, get_model_state_dict, get_optimizer_state_dict)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from examples.gpt_diloco.data import load_corpus
    from examples.gpt_diloco.model import build_model, lm_loss, transformer_blocks
    from site_client.checkpoint.local import load_site_checkpoint, save_site_checkpoint

    mode, path, out = sys.argv[1:4]
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))
    model = build_model(**TINY, init_seed=0 if mode == "save" else 7)
    for block in transformer_blocks(model):
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    lr = 1e-2 if mode == "save" else 1e-4  # the checkpoint's lr must win on load
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.1)
    corpus = load_corpus()

    def step(i):
        x, y = corpus.site_batch(0, 1, 0, i, rank, world, 6, seq_len=TINY["seq_len"])
        loss = lm_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()

    extra = None
    if mode == "save":
        step(0)
        step(1)
        saved_extra = {"inner_step": 2, "lr": 1e-2, "mark": torch.arange(5.0)}
        save_site_checkpoint(path, model, opt, saved_extra)
    else:
        extra = load_site_checkpoint(path, model, opt)
    full = StateDictOptions(full_state_dict=True, cpu_offload=True)
    # deepcopy: even a full, offloaded optimiser state dict aliases AdamW's live "step" tensors.
    snap = copy.deepcopy({
        "model": get_model_state_dict(model, options=full),
        "optim": get_optimizer_state_dict(model, opt, options=full),
        "extra": extra,
    })
    step(2)
    snap["after"] = get_model_state_dict(model, options=full)
    if rank == 0:
        torch.save(snap, out)
    # Leave together, then skip gloo's teardown: a rank destroying the group while a peer is
    # still in it can abort ("terminate called without an active exception") on a busy host.
    dist.barrier()
    os._exit(0)
    """
)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch(world: int, mode: str, path: Path, out: Path, script: Path) -> dict:
    script.write_text(f"TINY = {TINY!r}\n{_WORKER}")
    port = str(_free_port())
    procs = []
    for rank in range(world):
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
        env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port, OMP_NUM_THREADS="1")
        env.update(GLOO_SOCKET_IFNAME="lo", PYTHONPATH=str(REPO))
        cmd = [sys.executable, str(script), mode, str(path), str(out)]
        procs.append(subprocess.Popen(cmd, cwd=REPO, env=env, stderr=subprocess.PIPE, text=True))
    errors = []
    for rank, proc in enumerate(procs):
        try:
            _, err = proc.communicate(timeout=120)
        except subprocess.TimeoutExpired:
            for p in procs:
                p.kill()
            pytest.fail(f"{mode} with {world} ranks timed out")
        if proc.returncode:
            errors.append(f"rank {rank} exited {proc.returncode}:\n{err[-3000:]}")
    assert not errors, "\n".join(errors)
    return torch.load(out, weights_only=True)


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    root = tmp_path_factory.mktemp("site")
    path = site_checkpoint_path(root / "ckpts", 2)
    snap = _launch(2, "save", path, root / "saved.pt", root / "worker.py")
    return path, snap


def _assert_same_state(got: dict, want: dict) -> None:
    assert got["model"].keys() == want["model"].keys()
    for name, tensor in want["model"].items():
        assert torch.equal(got["model"][name], tensor), name
    assert got["optim"]["state"].keys() == want["optim"]["state"].keys()
    for name, slots in want["optim"]["state"].items():
        assert (
            slots.keys() == got["optim"]["state"][name].keys() == {"step", "exp_avg", "exp_avg_sq"}
        )
        for slot, tensor in slots.items():
            assert torch.equal(got["optim"]["state"][name][slot], tensor), (name, slot)
    assert got["optim"]["param_groups"] == want["optim"]["param_groups"]


def test_two_ranks_write_a_complete_sharded_checkpoint(saved: tuple[Path, dict]) -> None:
    path, snap = saved
    names = sorted(p.name for p in path.iterdir())
    assert [n for n in names if n.endswith(".distcp")] == ["__0_0.distcp", "__1_0.distcp"]
    assert MANIFEST in names and ".metadata" in names
    assert latest_site_checkpoint(path.parent) == path
    assert [p.name for p in path.parent.iterdir()] == [path.name]  # no temporary left
    # Two AdamW steps really happened, so the optimiser state under test is not trivial.
    steps = {float(s["step"]) for s in snap["optim"]["state"].values()}
    assert steps == {2.0}


# 6-12 s each: loading on 3 ranks (another world size) stays fast, on 1 rank is slow.
@pytest.mark.parametrize("world", [pytest.param(1, marks=pytest.mark.slow), 3])
def test_resharded_load_restores_model_and_optimizer_exactly(
    saved: tuple[Path, dict], world: int, tmp_path: Path
) -> None:
    path, want = saved
    got = _launch(world, "load", path, tmp_path / "loaded.pt", tmp_path / "worker.py")
    _assert_same_state(got, want)
    assert got["extra"]["inner_step"] == 2 and got["extra"]["lr"] == 1e-2
    assert torch.equal(got["extra"]["mark"], torch.arange(5.0))
    # Resuming continues the same trajectory: the step after loading (same site batch, split
    # over a different number of ranks) matches the one the saving ranks took.
    assert not torch.equal(want["after"]["head.weight"], want["model"]["head.weight"])
    for name, tensor in want["after"].items():
        torch.testing.assert_close(got["after"][name], tensor, rtol=1e-4, atol=1e-5)


def test_plain_process_without_process_group_loads_the_sharded_checkpoint(
    saved: tuple[Path, dict],
) -> None:
    path, want = saved
    model = build_model(**TINY, init_seed=7)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    extra = load_site_checkpoint(path, model, opt)
    assert extra["inner_step"] == 2
    got = {"model": model.state_dict(), "optim": get_optimizer_state_dict(model, opt)}
    _assert_same_state(got, want)


def test_read_failing_midway_leaves_model_unchanged(
    saved: tuple[Path, dict], tmp_path: Path
) -> None:
    # DCP copies each file into the tensors as it reads it: with rank 0's file intact and rank
    # 1's truncated, only loading into copies keeps the first file's values out of the model.
    path = tmp_path / "ckpt"
    shutil.copytree(saved[0], path)
    blob = path / "__1_0.distcp"
    blob.write_bytes(blob.read_bytes()[:100])
    model = build_model(**TINY, init_seed=7)
    opt = torch.optim.AdamW(model.parameters())
    before = _snapshot(model, opt)
    with pytest.raises(SiteCheckpointError, match="ckpt"):
        load_site_checkpoint(path, model, opt, config=SiteCheckpointConfig(verify=False))
    after = _snapshot(model, opt)
    assert len(after) == len(before)
    assert all(torch.equal(a, b) for a, b in zip(after, before, strict=True))


def _trained_plain(seed: int = 0) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    model = build_model(**TINY, init_seed=seed)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    x = torch.randint(0, 256, (2, TINY["seq_len"]), generator=torch.Generator().manual_seed(seed))
    loss = lm_loss(model(x), x)
    loss.backward()
    opt.step()
    return model, opt


def _snapshot(model: torch.nn.Module, opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    tensors = [t.clone() for t in model.state_dict().values()]
    for slots in opt.state.values():
        tensors += [t.clone() for t in slots.values()]
    return tensors


def _corrupt_data(path: Path) -> None:
    blob = path / "__0_0.distcp"
    data = bytearray(blob.read_bytes())
    data[len(data) // 2] ^= 0xFF  # a flipped bit DCP itself would load silently
    blob.write_bytes(data)


def _truncate_data(path: Path) -> None:
    blob = path / "__0_0.distcp"
    blob.write_bytes(blob.read_bytes()[:100])


def _garble_manifest(path: Path) -> None:
    (path / MANIFEST).write_text("{not json")


@pytest.mark.parametrize(
    ("damage", "verify", "expect"),
    [
        (None, True, "no such checkpoint"),
        (_corrupt_data, True, "corrupt: __0_0.distcp"),
        (_truncate_data, False, "EOFError"),
        (_garble_manifest, True, "unreadable manifest"),
    ],
)
def test_bad_checkpoint_raises_naming_path_and_changes_nothing(
    tmp_path: Path, damage, verify: bool, expect: str
) -> None:
    path = tmp_path / "ckpt"
    if damage is not None:
        save_site_checkpoint(path, *_trained_plain(seed=1))
        damage(path)
    for fresh_optimizer in (False, True):
        model, opt = _trained_plain(seed=2)
        if fresh_optimizer:
            opt = torch.optim.AdamW(model.parameters())
        before = _snapshot(model, opt)
        with pytest.raises(SiteCheckpointError, match=expect) as info:
            load_site_checkpoint(path, model, opt, config=SiteCheckpointConfig(verify=verify))
        assert str(path) in str(info.value)
        after = _snapshot(model, opt)
        assert len(after) == len(before)
        assert all(torch.equal(a, b) for a, b in zip(after, before, strict=True))


def test_failed_save_keeps_previous_checkpoint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "ckpt"
    old_model, old_opt = _trained_plain(seed=1)
    save_site_checkpoint(path, old_model, old_opt, {"version": 1})

    def crash(state, storage_writer):
        (Path(storage_writer.path) / "__0_0.distcp").write_bytes(b"half")
        raise OSError("disk full")

    monkeypatch.setattr(ckpt.dcp, "save", crash)
    with pytest.raises(SiteCheckpointError, match="disk full"):
        save_site_checkpoint(path, *_trained_plain(seed=2), {"version": 2})
    monkeypatch.undo()
    assert latest_site_checkpoint(tmp_path) == path
    model, opt = _trained_plain(seed=3)
    assert load_site_checkpoint(path, model, opt) == {"version": 1}
    restored, original = _snapshot(model, opt), _snapshot(old_model, old_opt)
    assert all(torch.equal(a, b) for a, b in zip(restored, original, strict=True))
    # A successful save over the same path replaces it.
    save_site_checkpoint(path, *_trained_plain(seed=2), {"version": 2})
    assert load_site_checkpoint(path, model, opt) == {"version": 2}


def test_untrained_optimizer_round_trips_as_untrained(tmp_path: Path) -> None:
    # DCP fills in missing AdamW state with a zero-lr step; neither save nor load may leave that
    # behind, or the first real step would use the wrong bias correction.
    model = build_model(**TINY)
    opt = torch.optim.AdamW(model.parameters())
    save_site_checkpoint(tmp_path / "ckpt", model, opt)
    assert not opt.state
    other, other_opt = _trained_plain(seed=4)
    load_site_checkpoint(tmp_path / "ckpt", other, other_opt)
    assert not other_opt.state
    pairs = zip(model.parameters(), other.parameters(), strict=True)
    assert all(torch.equal(a, b) for a, b in pairs)


def test_latest_and_prune_order_names_numerically(tmp_path: Path) -> None:
    model, opt = _trained_plain()
    for step in (9, 10, 2):
        save_site_checkpoint(site_checkpoint_path(tmp_path, step), model, opt)
    (tmp_path / "step-0000000099").mkdir()  # incomplete: no manifest
    assert latest_site_checkpoint(tmp_path) == site_checkpoint_path(tmp_path, 10)
    removed = prune_site_checkpoints(tmp_path, keep_last=2)
    assert removed == [site_checkpoint_path(tmp_path, 2)]
    assert latest_site_checkpoint(tmp_path) == site_checkpoint_path(tmp_path, 10)
    assert latest_site_checkpoint(tmp_path / "absent") is None


def test_extra_values_round_trip_exactly_and_others_are_rejected(tmp_path: Path) -> None:
    extra = {
        "round": 12,
        "loss": 0.1 + 0.2,
        "done": True,
        "rng": torch.get_rng_state(),
        "bf16": torch.randn(3, 2).to(torch.bfloat16),
        "scalar": torch.tensor(7, dtype=torch.int64),
        "empty": torch.zeros(0, 4),
    }
    model, opt = _trained_plain()
    save_site_checkpoint(tmp_path / "ok", model, opt, extra)
    got = load_site_checkpoint(tmp_path / "ok", model, opt)
    assert got.keys() == extra.keys()
    for key, value in extra.items():
        if isinstance(value, torch.Tensor):
            assert got[key].dtype == value.dtype and torch.equal(got[key], value), key
        else:
            assert type(got[key]) is type(value) and got[key] == value, key
    with pytest.raises(TypeError, match="'name'"):
        save_site_checkpoint(tmp_path / "x", model, opt, {"name": "text"})
    assert [p.name for p in tmp_path.iterdir()] == ["ok"]
