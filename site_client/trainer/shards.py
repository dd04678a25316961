"""A trainer rank's own part of theta and of its update: no rank holds the whole model.

On this rank each tensor of the model's state dict is either a DTensor shard (FSDP2, tensor
parallelism, both on a 2-D device mesh) or a plain tensor (a buffer, or a model that is not
sharded). ``local_pieces`` says which box of each tensor this rank holds, by DTensor's own layout
function (the one ``torch.distributed.checkpoint`` saves by). Loading theta copies each box out
of the agent's theta file, which is mapped, so a rank reads only its own pages; the update is
written box by box into this rank's own hand-off file (``theta_r - theta_local`` in float32,
computed straight into the mapped file). Neither step allocates a model-sized tensor.

A box held by several ranks (replicated placements, a plain buffer) is handed over by one of
them: a DTensor's piece by the rank at coordinate 0 of its replicated mesh dimensions, a plain
tensor by rank 0. The agent drops any duplicate that remains (``site_client.agent.update_payload``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.distributed.tensor import DTensor, Replicate
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from site_client.agent.tasks import update_spares
from wire.file_reuse import mapped_anywhere
from wire.safetensors_io import MappedTensors, canonical_order, contiguous_manifest, create_mapped

BOXES_KEY = "isthmus.boxes"  # safetensors metadata: {name: {"offset": [...], "shape": [...]}}


@dataclass(frozen=True)
class Piece:
    """This rank's part of tensor ``name``: ``local`` holds the box at ``box_offset`` of a
    tensor of shape ``global_shape``; ``writer`` says whether this rank hands it over."""

    name: str
    local: torch.Tensor
    box_offset: tuple[int, ...]
    global_shape: tuple[int, ...]
    writer: bool

    @property
    def box(self) -> tuple[slice, ...]:
        return tuple(
            slice(o, o + d) for o, d in zip(self.box_offset, self.local.shape, strict=True)
        )

    @property
    def whole(self) -> bool:
        return tuple(self.local.shape) == self.global_shape


def local_pieces(model: torch.nn.Module, rank: int) -> list[Piece]:
    """Every tensor of ``model``'s state dict as this rank holds it."""
    pieces = []
    for name, t in model.state_dict().items():
        if isinstance(t, DTensor):
            shape, offset = compute_local_shape_and_global_offset(
                t.shape, t.device_mesh, t.placements
            )
            local = t.to_local()
            if tuple(local.shape) != tuple(shape):
                raise ValueError(f"{name}: local shard {tuple(local.shape)}, expected {shape}")
            coord = t.device_mesh.get_coordinate() or []
            replicas = [
                c for c, p in zip(coord, t.placements, strict=True) if isinstance(p, Replicate)
            ]
            writer = all(c == 0 for c in replicas)
            pieces.append(Piece(name, local, tuple(offset), tuple(t.shape), writer))
        else:
            zero = (0,) * t.dim()
            pieces.append(Piece(name, t, zero, tuple(t.shape), rank == 0))
    return pieces


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit-for-bit equality (``torch.equal`` calls -0 and +0 equal and NaN unequal to itself)."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if a.is_floating_point():
        as_int = {8: torch.int64, 4: torch.int32, 2: torch.int16}[a.element_size()]
        return torch.equal(a.view(as_int), b.view(as_int))
    return torch.equal(a, b)


def _fits(piece: Piece, source: torch.Tensor) -> bool:
    """Whether the file's tensor is the one the piece is a box of (shape and dtype)."""
    return tuple(source.shape) == piece.global_shape and source.dtype == piece.local.dtype


@torch.no_grad()
def load_pieces(pieces: list[Piece], theta: MappedTensors) -> list[str]:
    """Copy each piece's box of theta into the model; returns the names whose loaded bytes
    differ from the file's (empty when the load is exact)."""
    wrong = []
    for p in pieces:
        source = theta.tensors[p.name]
        if not _fits(p, source):
            wrong.append(p.name)
            continue
        box = source[p.box]
        p.local.copy_(box)
        if not same_bits(p.local, box):
            wrong.append(p.name)
    return wrong


@torch.no_grad()
def merge_pieces(
    pieces: list[Piece], theta: MappedTensors, names: frozenset[str], alpha: float
) -> list[str]:
    """``local <- alpha * local + (1 - alpha) * theta`` on the pieces of ``names`` (a fragment
    of streaming outer steps), in float32; ``alpha = 0`` is ``load_pieces``, an exact copy.
    Returns the names that could not be merged (a shape or dtype unlike the file's)."""
    chosen = [p for p in pieces if p.name in names]
    if alpha == 0.0:
        return load_pieces(chosen, theta)
    wrong = []
    for p in chosen:
        source = theta.tensors[p.name]
        if not _fits(p, source):
            wrong.append(p.name)
            continue
        mixed = p.local.to(torch.float32) * alpha + source[p.box].to(torch.float32) * (1 - alpha)
        p.local.copy_(mixed)
    return wrong


@torch.no_grad()
def write_update(
    pieces: list[Piece], theta: MappedTensors, path: Path, names: frozenset[str] | None = None
) -> Path:
    """This rank's share of ``theta_r - theta_local`` (floating tensors it writes; only
    ``names`` when given: one fragment), as a safetensors file whose metadata says where each
    piece lies."""
    mine = [p for p in pieces if p.writer and p.local.is_floating_point() and p.local.numel()]
    if names is not None:
        mine = [p for p in mine if p.name in names]
    like = {p.name: torch.empty(p.local.shape, dtype=torch.float32, device="meta") for p in mine}
    boxes = {
        p.name: {"offset": list(p.box_offset), "shape": list(p.global_shape)}
        for p in mine
        if not p.whole
    }
    manifest = contiguous_manifest(like, canonical_order(like))
    tmp = path.with_suffix(".tmp")
    # Over an earlier update's file nothing maps any more (the agent's resend copy is gone):
    # its pages are kept rather than new ones zeroed; every byte is written again below.
    reuse = update_spares(path.parent).take(tmp, mapped_anywhere)
    out = create_mapped(tmp, manifest, {BOXES_KEY: json.dumps(boxes)}, reuse=reuse)
    for p in mine:
        source = theta.tensors[p.name][p.box]
        if source.dtype == torch.float32 and p.local.dtype == torch.float32:
            torch.sub(source, p.local, out=out.tensors[p.name])
        else:
            torch.sub(source.to(torch.float32), p.local.to(torch.float32), out=out.tensors[p.name])
    out.flush()
    del out
    tmp.replace(path)
    return path
