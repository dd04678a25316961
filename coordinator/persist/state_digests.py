"""The digests a checkpoint records of its tensors, and their check when it is loaded.

A checkpoint's ``meta.json`` holds the state digest (``wire.digest.state_digest``) of each of
its three tensor files: ``theta_digest`` (theta's, the value sites check theta against),
``strategy_digest`` and ``downlink_digest``. The lead of a job split over coordinator shards
keeps only its own tensors in ``theta.safetensors`` and the others' records in
``shard_tensors``: ``theta_digest`` is composed from both (``file_theta_digest``).
Checkpoints written before the digests were BLAKE3 (2026-12) hold SHA-256 state hashes instead
(``theta_sha256``, ...): they are checked with that, and theta's digest is taken anew for
serving, so a job resumes across the change.
Both stores (the local folder's and the object store's) use this.
"""

from __future__ import annotations

import functools
import hashlib
from collections.abc import Mapping

import torch

from wire.digest import compose, state_digest, tensor_records
from wire.safetensors_io import file_tensor_records
from wire.tensors import dtype_name

FILES = ("theta", "strategy", "downlink")


def recorded(theta_digest: bytes, strategy, downlink) -> dict[str, str]:
    """What ``meta.json`` records of a checkpoint's tensors."""
    return {
        "theta_digest": theta_digest.hex(),
        "strategy_digest": state_digest(strategy).hex(),
        "downlink_digest": state_digest(downlink).hex(),
    }


def _other_shards(meta: Mapping) -> list[tuple[str, str, tuple[int, ...], bytes]]:
    """The other shards' tensors as ``meta`` records them (none: the job is not split)."""
    return [(n, d, tuple(s), bytes.fromhex(h)) for n, d, s, h in meta.get("shard_tensors", [])]


def file_theta_digest(path, meta: Mapping) -> bytes:
    """theta's digest from its file's tensors (read a block at a time), with the other
    shards' tensors as ``meta`` records them when the job is split over shards."""
    return compose([*file_tensor_records(path), *_other_shards(meta)])


def _theta_digest_of(tensors: Mapping[str, torch.Tensor], meta: Mapping) -> bytes:
    """theta's digest from these tensors, with the other shards' as ``meta`` records them."""
    return compose([*tensor_records(tensors), *_other_shards(meta)])


def legacy(meta: Mapping) -> bool:
    """Whether ``meta`` is of a checkpoint written with SHA-256 state hashes."""
    return "theta_digest" not in meta and "theta_sha256" in meta


def mismatch(name: str, tensors: Mapping[str, torch.Tensor], meta: Mapping) -> str | None:
    """Why the tensors of ``name.safetensors`` are not what ``meta`` records (None: they are,
    or ``meta`` records nothing for that file)."""
    key, digest = (f"{name}_sha256", sha256_state) if legacy(meta) else (f"{name}_digest", None)
    want = meta.get(key)
    if want is None:
        return None
    if digest is None and name == "theta":  # the lead of a split job holds its part
        digest = functools.partial(_theta_digest_of, meta=meta)
    found = (digest or state_digest)(tensors).hex()
    return None if found == want else f"{name}.safetensors does not match its digest in meta.json"


def theta_digest(meta: Mapping, theta: Mapping[str, torch.Tensor]) -> bytes:
    """theta's state digest: as recorded, or taken now for a legacy checkpoint."""
    if legacy(meta):
        return state_digest(theta)
    return bytes.fromhex(meta["theta_digest"])


def sha256_state(tensors: Mapping[str, torch.Tensor]) -> bytes:
    """The SHA-256 state hash legacy checkpoints record: names, dtypes, shapes and bytes in
    name order, one stream."""
    h = hashlib.sha256()
    for name in sorted(tensors):
        t = tensors[name].detach().to("cpu").contiguous()
        h.update(name.encode())
        h.update(b"\0" + dtype_name(t.dtype).encode() + b"\0")
        h.update(repr(tuple(t.shape)).encode())
        if t.numel():
            h.update(memoryview(t.reshape(-1).view(torch.uint8).numpy()))
    return h.digest()
