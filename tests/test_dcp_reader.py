"""Site checkpoints load through an allow-listed unpickler: a tampered metadata file that asks
for any other object is refused before anything runs."""

from __future__ import annotations

import pickle

import pytest
import torch
import torch.distributed.checkpoint as dcp

from site_client.checkpoint.dcp_reader import SafeFileSystemReader


class _Boom:
    def __reduce__(self):
        return (print, ("this must never run",))


def _saved(tmp_path):
    state = {"w": torch.arange(6.0).reshape(2, 3), "b": torch.ones(2, dtype=torch.bfloat16)}
    with pytest.warns(UserWarning):  # DCP says it assumes a single process
        dcp.save(state, storage_writer=dcp.FileSystemWriter(tmp_path))
    return state


def test_a_real_checkpoint_loads_exactly(tmp_path):
    state = _saved(tmp_path)
    target = {k: torch.zeros_like(v) for k, v in state.items()}
    with pytest.warns(UserWarning):
        dcp.load(target, storage_reader=SafeFileSystemReader(tmp_path))
    for k in state:
        assert torch.equal(target[k], state[k])


def test_tampered_metadata_is_refused_without_running_it(tmp_path, capsys):
    _saved(tmp_path)
    (tmp_path / ".metadata").write_bytes(pickle.dumps(_Boom()))
    with pytest.raises(pickle.UnpicklingError, match="builtins.print"):
        SafeFileSystemReader(tmp_path).read_metadata()
    assert "this must never run" not in capsys.readouterr().out
    # The payload is a live one: plain pickle (what DCP's stock reader uses) runs it.
    pickle.loads((tmp_path / ".metadata").read_bytes())
    assert "this must never run" in capsys.readouterr().out
