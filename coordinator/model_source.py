"""Where theta_0 comes from: a ``module:function`` returning an ``nn.Module``, or a file."""

from __future__ import annotations

import importlib

import torch
from safetensors.torch import load_file

from coordinator.config import ConfigError, ModelConfig


def initial_theta(cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """Build theta_0 (every parameter and buffer, by state-dict name)."""
    if cfg.path is not None:
        if not cfg.path.is_file():
            raise ConfigError(f"model.path: no such file {cfg.path}")
        try:
            return dict(load_file(str(cfg.path)))
        except Exception as exc:
            raise ConfigError(f"model.path: {cfg.path} is not a safetensors file: {exc}") from exc
    module_name, _, attr = (cfg.factory or "").partition(":")
    try:
        factory = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as exc:
        raise ConfigError(f"model.factory: cannot load {cfg.factory!r}: {exc}") from exc
    torch.manual_seed(cfg.seed)
    try:
        model = factory(**cfg.kwargs)
    except TypeError as exc:
        raise ConfigError(f"model.kwargs: {cfg.factory} refused them: {exc}") from exc
    except Exception as exc:  # the user's own code: report it as a config problem, briefly
        raise ConfigError(
            f"model.factory: {cfg.factory} failed: {type(exc).__name__}: {exc}"
        ) from exc
    if not isinstance(model, torch.nn.Module):
        raise ConfigError(
            f"model.factory: {cfg.factory} returned {type(model).__name__}, not a torch.nn.Module"
        )
    return {k: v.detach().to("cpu").clone().contiguous() for k, v in model.state_dict().items()}


def trainable_names(theta: dict[str, torch.Tensor]) -> list[str]:
    """The tensors that updates carry and outer steps change: the floating-point ones."""
    return sorted(k for k, v in theta.items() if v.is_floating_point())
