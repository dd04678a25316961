"""Theta in one buffer: the layout every party serves, hashes and stores it in.

The global parameters live in a single byte buffer in :func:`~wire.safetensors_io.canonical_order`
with each tensor a view into it. The coordinator serves a whole-theta fetch as slices of that
buffer (no packed copy beside theta), writes its checkpoint as a safetensors header followed by
the buffer, and a site receives the stream straight into a file of the same layout that its
trainers map. The manifest is the same for every version of a job's theta, since it depends only
on names, dtypes and shapes.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch

from wire.safetensors_io import canonical_order, contiguous_manifest, tensor_bytes
from wire.tensors import DTYPES, Manifest


@dataclass(frozen=True)
class ThetaBuffer:
    """``tensors`` are views into ``buffer`` laid out as ``manifest``."""

    manifest: Manifest
    buffer: torch.Tensor
    tensors: dict[str, torch.Tensor]

    @classmethod
    def allocate(cls, like: Mapping[str, torch.Tensor]) -> ThetaBuffer:
        """Zeros shaped like ``like`` (pages are only touched when written)."""
        manifest = contiguous_manifest(like, canonical_order(like))
        return cls.on(manifest, torch.zeros(manifest.total_bytes, dtype=torch.uint8))

    @classmethod
    def on(cls, manifest: Manifest, buffer: torch.Tensor) -> ThetaBuffer:
        """Views of ``buffer`` (uint8, ``manifest.total_bytes`` long) as ``manifest`` says."""
        tensors = {}
        for e in manifest.entries:
            raw = buffer[e.offset : e.offset + e.nbytes]
            if e.nbytes == 0:
                tensors[e.name] = torch.empty(e.shape, dtype=DTYPES[e.dtype])
            else:
                tensors[e.name] = raw.view(DTYPES[e.dtype]).reshape(e.shape)
        return cls(manifest, buffer, tensors)

    @classmethod
    def copy_of(cls, tensors: Mapping[str, torch.Tensor]) -> ThetaBuffer:
        out = cls.allocate(tensors)
        for name, t in tensors.items():
            out.tensors[name].copy_(t)
        return out

    def payload(self) -> memoryview:
        return tensor_bytes(self.buffer)

    def same_layout(self, tensors: Mapping[str, torch.Tensor]) -> bool:
        """Whether ``tensors`` have exactly this buffer's names, dtypes and shapes."""
        return tensors.keys() == self.tensors.keys() and all(
            t.dtype == self.tensors[n].dtype and t.shape == self.tensors[n].shape
            for n, t in tensors.items()
        )
