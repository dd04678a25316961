"""MkDocs hooks: the two reference pages generated from the code at every build.

``reference/configuration.md`` comes from the config dataclasses
(``coordinator.config_reference``) and ``reference/cli.md`` from the argparse parsers of
``coordinator`` and ``siteclient``, so neither can fall behind the code and neither is
committed. Named in ``mkdocs.yml`` (``hooks:``); ``exclude_docs`` keeps this file out of the
site.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
from collections.abc import Iterator
from pathlib import Path

from mkdocs.structure.files import File, Files

ROOT = Path(__file__).resolve().parent.parent
CLI_PAGE = "reference/cli.md"
CONFIG_PAGE = "reference/configuration.md"
WIDTH = "100"  # argparse wraps help to $COLUMNS: fixed, so the page does not depend on a terminal

CLI_INTRO = """\
# Command-line reference

Every command's `--help`, generated from the argparse parsers at build time. Both programs
answer `--help` and `--version` at once (neither torch nor grpc is loaded for them). Every
command that talks gRPC needs `--tls-dir` (a bundle from `coordinator certs`) or an explicit
`--insecure`, which prints a warning: there is no silent plaintext.

`siteclient start` reads each of its own flags from a variable when the flag is not given, as
torchrun's flags read `PET_*`: `ISTHMUS_COORDINATOR`, `ISTHMUS_SITE`, `ISTHMUS_TLS_DIR`,
`ISTHMUS_INSECURE` (`1`), `ISTHMUS_RUN_DIR`, `ISTHMUS_CHECKPOINT_URL`,
`ISTHMUS_CHECKPOINT_DIR`, `ISTHMUS_INNER_STEPS`, `ISTHMUS_CONNECT_TIMEOUT`,
`ISTHMUS_OUTAGE_TIMEOUT`, `ISTHMUS_LOG_LEVEL`.
"""


@contextlib.contextmanager
def _plain_help() -> Iterator[None]:
    """argparse's help at a fixed width, without colour, and with none of ``siteclient``'s
    ``ISTHMUS_*`` defaults taken from this machine's environment."""
    saved = dict(os.environ)
    os.environ.update({"COLUMNS": WIDTH, "NO_COLOR": "1"})
    for name in [n for n in os.environ if n.startswith("ISTHMUS_")]:
        del os.environ[name]
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)


def _subcommands(parser: argparse.ArgumentParser) -> list[tuple[str, argparse.ArgumentParser]]:
    """``(name, parser)`` of each subcommand, in the order they were added."""
    out = []
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            out += list(action.choices.items())
    return out


def _sections(prog: str, parser: argparse.ArgumentParser, level: int) -> list[str]:
    out = [f"{'#' * level} `{prog}`", "", "```text", parser.format_help().rstrip(), "```", ""]
    for name, sub in _subcommands(parser):
        out += _sections(f"{prog} {name}", sub, min(level + 1, 4))
    return out


def cli_reference() -> str:
    """The command-line reference page, as Markdown."""
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    with _plain_help():
        from coordinator.cli import _parser as coordinator_parser
        from site_client.cli import _parser as siteclient_parser

        pages = [CLI_INTRO]
        pages += _sections("coordinator", coordinator_parser(), 2)
        pages += _sections("siteclient", siteclient_parser(), 2)
    return "\n".join(pages).rstrip() + "\n"


def config_reference() -> str:
    """The configuration reference page, as Markdown."""
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    from coordinator.config_reference import render

    return render()


def on_files(files: Files, config) -> Files:
    """Add the generated pages to the site's files (they exist in no folder)."""
    for uri, make in ((CONFIG_PAGE, config_reference), (CLI_PAGE, cli_reference)):
        files.append(File.generated(config, uri, content=make()))
    return files
