"""Where theta_0 comes from: a ``module:function`` returning an ``nn.Module``, or a file."""

from __future__ import annotations

import importlib
from collections.abc import Collection
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from coordinator.import_path import nearest_holding
from wire.config_table import ConfigError, non_empty, setting
from wire.safetensors_io import read_header


class FactoryImportError(ConfigError):
    """The module a ``module:function`` key names (``model.factory``, ``evaluation.fn``) is
    not importable; ``missing`` is the module Python did not find (its own package, or one its
    code imports)."""

    def __init__(
        self, message: str, module: str, missing: str | None, key: str = "model.factory"
    ) -> None:
        super().__init__(message)
        self.module, self.missing, self.key = module, missing, key


def import_hint(
    module: str, missing: str | None, config_dir: Path, cwd: Path, key: str = "model.factory"
) -> str:
    """What to do about a factory module that did not import, in one sentence.

    When the factory's own package is what is missing, look for it next to the config file
    and in every folder above it: the folder that holds it must be importable.
    """
    top = module.split(".")[0]
    if missing is None or not (missing == top or module.startswith(missing + ".")):
        return (
            f"the module imports {missing!r}, which is not installed in this Python"
            if missing
            else "the module failed to import"
        )
    if (base := nearest_holding(module, config_dir)) is not None:
        return (
            f"{base} holds {module}: run `coordinator serve` from {base}, or add it to "
            f"PYTHONPATH (export PYTHONPATH={base}); `coordinator local` adds it by itself"
        )
    return (
        f"the coordinator imports {key} from its working directory ({cwd}) and "
        f"PYTHONPATH, and neither holds {top}/: run it from the folder that holds {top}/, or "
        "add that folder to PYTHONPATH"
    )


def factory_spec(v: str) -> str | None:
    """expected ``package.module:function``, a function in a module, both named"""
    module_name, _, function = v.partition(":")
    if module_name.strip() and function.strip():
        return None
    return "expected 'package.module:function'"


@dataclass(frozen=True)
class ModelConfig:
    """The ``[model]`` table: theta_0 from ``factory(**kwargs)`` seeded with ``seed``, or read
    from the safetensors file at ``path``."""

    factory: str | None = setting(
        None,
        check=(non_empty, factory_spec),
        help="``package.module:function`` returning the ``nn.Module`` whose parameters are "
        "theta_0 (importable from the working directory or ``PYTHONPATH``); exactly one of "
        "``factory`` and ``path``",
    )
    path: Path | None = setting(
        None,
        check=non_empty,
        help="a safetensors file holding theta_0 (relative to the config's folder); exactly one "
        "of ``factory`` and ``path``",
    )
    seed: int = setting(0, help="the torch seed set before the factory runs")
    kwargs: dict[str, Any] = setting(
        factory=dict, help="keyword arguments of the factory (``{ d_model = 128 }``)"
    )

    def check(self) -> None:
        """Exactly one source of theta_0: with neither there is none, with both it would be
        a guess which one the job trains from."""
        if (self.factory is None) == (self.path is None):
            raise ConfigError(
                "model: set exactly one of model.factory ('module:function') or model.path"
            )


def initial_theta(
    cfg: ModelConfig, names: Collection[str] | None = None
) -> dict[str, torch.Tensor]:
    """Build theta_0 (every parameter and buffer, by state-dict name); only ``names`` when
    given (a coordinator shard's): read alone from ``model.path``, kept alone from the
    factory's model."""
    if cfg.path is not None:
        _check_path(cfg.path)
        try:
            with safe_open(str(cfg.path), framework="pt") as f:
                stored = list(f.keys())
                keep = stored if names is None else [n for n in stored if n in names]
                return {n: f.get_tensor(n) for n in keep}
        except Exception as exc:
            raise ConfigError(f"model.path: {cfg.path} is not a safetensors file: {exc}") from exc
    model = build_module(cfg)
    # No copy: the module goes once the caller has laid theta out in its buffer.
    state = model.state_dict()
    keep = state if names is None else [n for n in state if n in names]
    return {k: state[k].detach().to("cpu").contiguous() for k in keep}


def tensor_sizes(cfg: ModelConfig) -> dict[str, int]:
    """Each tensor's bytes in theta_0 (what the shard plan deals): from ``model.path``'s header
    alone, without reading the tensors."""
    if cfg.path is None:
        return {n: t.numel() * t.element_size() for n, t in initial_theta(cfg).items()}
    _check_path(cfg.path)
    try:
        manifest, _, _ = read_header(cfg.path)
    except Exception as exc:
        raise ConfigError(f"model.path: {cfg.path} is not a safetensors file: {exc}") from exc
    return {e.name: e.nbytes for e in manifest.entries}


def _check_path(path: Path) -> None:
    if not path.is_file():
        raise ConfigError(f"model.path: no such file {path}")


def build_module(cfg: ModelConfig) -> torch.nn.Module:
    """``factory(**kwargs)`` after seeding torch's global generator with ``seed``; errors are
    ``ConfigError``s naming the key."""
    module_name, _, attr = (cfg.factory or "").partition(":")
    try:
        factory = getattr(importlib.import_module(module_name), attr)
    except ImportError as exc:
        raise FactoryImportError(
            f"model.factory: cannot load {cfg.factory!r}: {exc}", module_name, exc.name
        ) from exc
    except AttributeError as exc:
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
    return model


def trainable_names(theta: dict[str, torch.Tensor]) -> list[str]:
    """The tensors that updates carry and outer steps change: the floating-point ones."""
    return sorted(k for k, v in theta.items() if v.is_floating_point())
