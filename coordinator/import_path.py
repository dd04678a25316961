"""Where a job's own code imports from: the project its config file belongs to.

A job names code of the user's project as ``package.module:name``: ``model.factory``,
``evaluation.fn`` and a plugin's ``strategy.name``. The module's folder is found from the
config file, never from the working directory: the nearest folder, from the config file's own
folder upwards, that holds the module (the folder holding ``examples/`` for
``examples.gpt_diloco.model``, whose file is ``examples/gpt_diloco/model.py``).

``coordinator local`` puts these folders on the PYTHONPATH of every process it starts (the
coordinator, the sites and their trainers), so a job runs from any working directory.
``coordinator serve`` keeps its explicit rule, its working directory and PYTHONPATH, and names
the folder to add in its error (``coordinator.model_source.import_hint``).
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path

from wire.config_table import ConfigError

FLOWER_PREFIX = "flower:"  # a Flower strategy's name, not a module of the user's project


def module_files(module: str) -> tuple[Path, Path]:
    """The two files, relative to a folder on the import path, that make ``module``
    importable: ``a/b.py`` or ``a/b/__init__.py`` for ``a.b``."""
    rel = Path(*module.split("."))
    return rel.with_suffix(".py"), rel / "__init__.py"


def holds_module(folder: Path, module: str) -> bool:
    """Whether ``module`` imports from ``folder`` once ``folder`` is on the import path."""
    return any((folder / f).is_file() for f in module_files(module))


def project_folder(module: str, config: Path) -> Path | None:
    """The nearest folder at or above the folder of the config file ``config`` (a relative
    path is taken from the working directory) that holds ``module``; None when none does."""
    return nearest_holding(module, Path(config).resolve().parent)


def nearest_holding(module: str, start: Path) -> Path | None:
    """``start`` or the nearest folder above it that holds ``module``; None when none does."""
    for folder in (start, *start.parents):
        if holds_module(folder, module):
            return folder
    return None


def job_modules(cfg) -> list[tuple[str, str]]:
    """``(key, module)`` for each module of the user's code that the job config ``cfg``
    (a ``JobConfig``) names."""
    named = [("model.factory", cfg.model.factory)]
    if cfg.evaluation is not None:
        named.append(("evaluation.fn", cfg.evaluation.fn))
    strategy = cfg.strategy.name
    if ":" in strategy and not strategy.startswith(FLOWER_PREFIX):
        named.append(("strategy.name", strategy))
    return [(key, spec.partition(":")[0]) for key, spec in named if spec]


def installed(package: str) -> bool:
    """Whether the top-level ``package`` imports in this Python without any folder added
    (installed, or on its own PYTHONPATH); nothing is imported to tell."""
    return importlib.util.find_spec(package) is not None


def import_folders(
    modules: Iterable[tuple[str, str]],
    config: Path,
    cwd: Path,
    is_installed: Callable[[str], bool] = installed,
) -> dict[Path, list[str]]:
    """The folders to put on the import path, in the order the modules are named, each with
    the modules it holds; a module already importable (installed) needs none.

    Each module is looked for in the config file's project first, then in the working
    directory (where ``coordinator serve`` looks). A ``ConfigError`` naming the key, the module
    and where it looked when a module is found nowhere.
    """
    folders: dict[Path, list[str]] = {}
    for key, module in modules:
        folder = project_folder(module, config)
        if folder is None and holds_module(cwd, module):
            folder = cwd
        if folder is not None:
            folders.setdefault(folder, []).append(module)
        elif not is_installed(module.split(".")[0]):
            raise ConfigError(not_found(key, module, Path(config).resolve().parent, cwd))
    return folders


def not_found(key: str, module: str, config_dir: Path, cwd: Path) -> str:
    """The one-line error for a module that no folder holds and no package provides."""
    top = module.split(".")[0]
    py, init = module_files(module)
    return (
        f"{key}: cannot find module {module!r}: no {py} or {init} in {config_dir} or any "
        f"folder above it, nor in the working directory {cwd}, and no installed package "
        f"{top!r}; put {top}/ in the config file's folder or one above it, or install it"
    )


def with_import_path(environ: Mapping[str, str], folders: Iterable[Path]) -> dict[str, str]:
    """A copy of ``environ`` whose PYTHONPATH starts with ``folders`` (its own entries kept
    after them)."""
    env = dict(environ)
    parts = [str(f) for f in folders]
    if parts:
        if env.get("PYTHONPATH"):
            parts.append(env["PYTHONPATH"])
        env["PYTHONPATH"] = os.pathsep.join(parts)
    return env


def describe(folders: Mapping[Path, list[str]]) -> str:
    """The log line saying what was added to the import path, and why."""
    held = "; ".join(f"{f} (holds {', '.join(dict.fromkeys(m))})" for f, m in folders.items())
    return f"import path: added {held} to PYTHONPATH of the coordinator, sites and trainers"
