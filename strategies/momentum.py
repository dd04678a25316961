"""Outer SGD with (Nesterov) momentum on pseudo-gradients, shared by DiLoCo and FedAvgM.

It follows torch.optim.SGD::

    m   <- mu * m + g            (m = g on the first step)
    th  <- th - lr * m           (nesterov: th - lr * (g + mu * m))

Buffers are float32 whatever the parameters' dtype, and are replaced only after every tensor's
step succeeded, so a failed step leaves the state as it was.
"""

from __future__ import annotations

import torch

from strategies.base import Tensors, apply_in_float32


class OuterMomentum:
    def __init__(self) -> None:
        self.buffers: Tensors = {}

    def step(self, theta: Tensors, grads: Tensors, lr: float, mu: float, nesterov: bool) -> Tensors:
        """theta_{r+1} (a new dict) from theta_r and the mean pseudo-gradient ``grads``."""
        out = dict(theta)
        new_buffers: Tensors = {}
        for name, g in grads.items():
            g = g.to(torch.float32)
            if mu:
                buf = self.buffers.get(name)
                buf = g.clone() if buf is None else buf * mu + g
                new_buffers[name] = buf
                step = g + mu * buf if nesterov else buf
            else:
                step = g
            out[name] = apply_in_float32(theta[name], lr * step)
        self.buffers.update(new_buffers)
        return out

    def step_in_place(
        self, theta: Tensors, grads: Tensors, lr: float, mu: float, nesterov: bool
    ) -> Tensors:
        """``step``, with theta_{r+1} written into ``grads`` and the buffers updated in place:
        the same IEEE operations in the same order, so the same bits, without a model-sized
        temporary."""
        out = dict(theta)
        for name, g in grads.items():
            if g.dtype != torch.float32 or not g.is_contiguous():
                out[name] = self.step({name: theta[name]}, {name: g}, lr, mu, nesterov)[name]
                continue
            tmp = self._scratch(g)
            if mu:
                buf = self.buffers.get(name)
                if buf is None:
                    self.buffers[name] = buf = g.clone()
                else:
                    buf.mul_(mu).add_(g)
                if nesterov:
                    torch.mul(buf, mu, out=tmp).add_(g)
                else:
                    tmp.copy_(buf)
            else:
                tmp.copy_(g)
            tmp.mul_(lr)
            if theta[name].dtype == torch.float32:
                out[name] = torch.sub(theta[name], tmp, out=g)
            else:
                out[name] = apply_in_float32(theta[name], tmp)
        return out

    def _scratch(self, like: torch.Tensor) -> torch.Tensor:
        """A float32 tensor shaped like ``like``, reused across tensors and rounds."""
        buf = getattr(self, "_buf", None)
        if buf is None or buf.numel() < like.numel():
            buf = self._buf = torch.empty(like.numel(), dtype=torch.float32)
        return buf[: like.numel()].view(like.shape)

    def state_dict(self) -> Tensors:
        return {f"momentum.{k}": v for k, v in self.buffers.items()}

    def load_state_dict(self, state: Tensors) -> None:
        self.buffers = {
            k.removeprefix("momentum."): v.to(torch.float32)
            for k, v in state.items()
            if k.startswith("momentum.")
        }
