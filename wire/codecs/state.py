"""Codec state kept on the encoding side: error-feedback residuals, one per tensor.

The state is plain tensors (``state_dict`` / ``load_state_dict``), so a site saves it with its
checkpoint as safetensors, never pickled. ``CodecState.state_dict()`` keys are
``"<tensor name>#residual"``; values are float32 tensors of the tensor's shape. As with
``nn.Module``, ``state_dict`` returns the live tensors: clone them to keep a snapshot while a
later ``encode`` goes on mutating them.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from wire.codecs.base import Codec, CodecError, Encoded, finite_absmax, who

SEP = "#"
_KEYS = ("residual",)


class TensorState:
    """One tensor's codec state: the residual ``r`` (None until first used) and ``bound = max |r|``
    (kept by the encoders, measured on load), which lets an encoder refuse an overflowing
    ``x + r`` before touching ``r``; it is derived from ``r``, so it is not saved."""

    def __init__(self) -> None:
        self.residual: torch.Tensor | None = None
        self.bound = 0.0

    def prepare(self, shape: torch.Size, name: str = "") -> None:
        """Make a zero residual of ``shape`` if there is none; refuse a shape change."""
        if self.residual is None:
            self.residual = torch.zeros(shape, dtype=torch.float32)
            self.bound = 0.0
        elif self.residual.shape != shape:
            raise CodecError(
                f"{who(name)}: codec residual has shape {list(self.residual.shape)}, the tensor "
                f"{list(shape)}; reset the codec state to change shapes"
            )

    def flat(self) -> torch.Tensor:
        assert self.residual is not None, "prepare() first"
        return self.residual.view(-1)

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {} if self.residual is None else {"residual": self.residual}

    def load_state_dict(self, sd: Mapping[str, torch.Tensor], name: str = "") -> None:
        """Load a residual, refusing unknown keys, other dtypes and NaN/Inf values."""
        unknown = sorted(set(sd) - set(_KEYS))
        if unknown:
            raise CodecError(f"{who(name)}: unknown codec state key {unknown[0]!r}")
        r = sd.get("residual")
        if r is None:
            self.residual, self.bound = None, 0.0
            return
        if not isinstance(r, torch.Tensor) or r.dtype != torch.float32:
            raise CodecError(f"{who(name)}: codec residual must be a float32 tensor")
        r = r.detach().to("cpu").clone().contiguous()
        self.bound = finite_absmax(r.view(-1), name)
        self.residual = r


class CodecState:
    """Per-model codec state: a ``TensorState`` per tensor name, created on first use."""

    def __init__(self) -> None:
        self._tensors: dict[str, TensorState] = {}

    def __getitem__(self, name: str) -> TensorState:
        state = self._tensors.get(name)
        if state is None:
            state = self._tensors[name] = TensorState()
        return state

    def __contains__(self, name: object) -> bool:
        return name in self._tensors

    def __len__(self) -> int:
        return len(self._tensors)

    def names(self) -> list[str]:
        return sorted(self._tensors)

    def reset(self, name: str | None = None) -> None:
        """Forget one tensor's residual, or all of them."""
        if name is None:
            self._tensors.clear()
        else:
            self._tensors.pop(name, None)

    def encode(self, name: str, x: torch.Tensor, codec: Codec) -> Encoded:
        """Encode ``x`` with this tensor's state when ``codec`` uses error feedback. A codec
        without it sends ``x`` plus the residual an earlier codec left (an adaptive job's
        change of rung, ``wire.codecs.adaptive``), which is then forgotten: what an earlier
        rung withheld is sent, never dropped. The state changes only once encoded."""
        if codec.error_feedback or not self.owes(name):
            return codec.encode(x, self[name] if codec.error_feedback else None, name=name)
        enc = codec.encode(self._with_residual(name, x), None, name=name)
        self._tensors.pop(name)
        return enc

    def owes(self, name: str) -> bool:
        """Whether tensor ``name`` holds a residual that has not been sent yet."""
        state = self._tensors.get(name)
        return state is not None and state.residual is not None

    def carry(self, name: str, x: torch.Tensor) -> torch.Tensor:
        """``x`` plus tensor ``name``'s residual (in ``x``'s dtype), the residual forgotten:
        for a tensor sent raw (codec ``none``) after a codec with error feedback. ``x``
        itself when nothing is owed."""
        if not self.owes(name):
            return x
        out = self._with_residual(name, x)
        self._tensors.pop(name)
        return out

    def _with_residual(self, name: str, x: torch.Tensor) -> torch.Tensor:
        r = self._tensors[name].residual
        if r.shape != x.shape:
            raise CodecError(
                f"{who(name)}: codec residual has shape {list(r.shape)}, the tensor "
                f"{list(x.shape)}; reset the codec state to change shapes"
            )
        return (x.detach().to("cpu", torch.float32) + r).to(x.dtype)

    def state_dict(self) -> dict[str, torch.Tensor]:
        out: dict[str, torch.Tensor] = {}
        for name in sorted(self._tensors):
            for key, t in self._tensors[name].state_dict().items():
                out[f"{name}{SEP}{key}"] = t
        return out

    def load_state_dict(self, sd: Mapping[str, torch.Tensor]) -> None:
        """Replace the whole state; nothing changes unless every entry is valid."""
        grouped: dict[str, dict[str, torch.Tensor]] = {}
        for full, t in sd.items():
            name, sep, key = full.rpartition(SEP)
            if not sep or not name:
                raise CodecError(f"codec state key {full!r} is not '<tensor name>{SEP}<key>'")
            grouped.setdefault(name, {})[key] = t
        loaded: dict[str, TensorState] = {}
        for name, entries in grouped.items():
            state = TensorState()
            state.load_state_dict(entries, name)
            loaded[name] = state
        self._tensors = loaded
