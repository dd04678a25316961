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

CHUNK = 1 << 20  # elements per step of the in-place update


def _flat_ok(*tensors: torch.Tensor) -> bool:
    return all(t.is_contiguous() for t in tensors)


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
        the same IEEE operations in the same order (elementwise, a chunk at a time), so the
        same bits, with one chunk of scratch instead of model-sized temporaries."""
        out = dict(theta)
        for name, g in grads.items():
            th = theta[name]
            if g.dtype != torch.float32 or th.dtype != torch.float32 or not _flat_ok(g, th):
                out[name] = self.step({name: th}, {name: g}, lr, mu, nesterov)[name]
                continue
            buf = self.buffers.get(name)
            if mu and buf is None:
                self.buffers[name] = buf = g.clone()
                first = True
            else:
                first = False
            flat_g, flat_th = g.view(-1), th.view(-1)
            flat_buf = buf.view(-1) if mu else None
            for i in range(0, flat_g.numel(), CHUNK):
                part = slice(i, i + CHUNK)
                b = flat_buf[part] if mu else None
                self._chunk(flat_th[part], flat_g[part], b, first, lr, mu, nesterov)
            out[name] = g
        return out

    def _chunk(self, th, g, buf, first: bool, lr: float, mu: float, nesterov: bool) -> None:
        """One chunk of ``step_in_place``: ``g`` becomes theta_{r+1}."""
        tmp = self._scratch(g)
        if buf is not None:
            if not first:
                buf.mul_(mu).add_(g)  # m <- mu * m + g
            if nesterov:
                torch.mul(buf, mu, out=tmp).add_(g)  # g + mu * m
            else:
                tmp.copy_(buf)
        else:
            tmp.copy_(g)
        tmp.mul_(lr)
        torch.sub(th, tmp, out=g)

    def _scratch(self, like: torch.Tensor) -> torch.Tensor:
        """A float32 tensor shaped like ``like`` (a chunk), reused across tensors and rounds."""
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
