"""What a command line's log shows: isthmus's own INFO lines, and only third parties'
warnings (``wire.cli_flags.configure_logging``, used by ``coordinator`` and ``siteclient``)."""

from __future__ import annotations

import logging
import subprocess
import sys

import pytest

try:  # tests/ as a package or as a plain folder on sys.path
    from . import coord_harness as h
except ImportError:
    import coord_harness as h

from wire.cli_flags import OwnInfoOnly

pytestmark = pytest.mark.e2e

# Run a command line's own main() in a fresh process; once it has returned, and before
# logging shuts down (atexit runs the later registration first), log through the handlers it
# set up: a library's INFO and WARNING, isthmus's INFO under both kinds of name.
EMIT = """
import atexit, logging, sys

def emit():
    logging.getLogger("matplotlib.font_manager").info("third-party info")
    logging.getLogger("somelib.sub").warning("third-party warning")
    logging.getLogger("isthmus.site").info("isthmus info")
    logging.getLogger("coordinator.persist.local_store").info("own module info")

atexit.register(emit)
from {module} import main
sys.exit(main(sys.argv[1:]))
"""


def cli_commands(tmp_path) -> dict[str, tuple[str, list[str]]]:
    """A command of each CLI that sets its logging up and fails fast: nobody listens there."""
    script = tmp_path / "train.py"
    script.write_text("")
    nobody = f"127.0.0.1:{h.free_port()}"
    site = ["start", "--coordinator", nobody, "--site", "site-0", "--insecure"]
    site += ["--connect-timeout", "1", "--run-dir", str(tmp_path / "run"), "--", str(script)]
    return {
        "coordinator": ("coordinator.cli", ["status", "--coordinator", nobody, "--insecure"]),
        "siteclient": ("site_client.cli", site),
    }


@pytest.mark.parametrize("cli", ["coordinator", "siteclient"])
def test_a_third_party_info_line_does_not_reach_the_output_an_isthmus_one_does(cli, tmp_path):
    module, argv = cli_commands(tmp_path)[cli]
    result = subprocess.run(
        [sys.executable, "-c", EMIT.format(module=module), *argv],
        cwd=tmp_path, env=h.subprocess_env(), capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    out = result.stdout + result.stderr
    assert result.returncode == 1, out  # the command itself failed as planned
    assert "INFO isthmus.site: isthmus info" in out, out
    assert "INFO coordinator.persist.local_store: own module info" in out, out
    assert "WARNING somelib.sub: third-party warning" in out, out
    assert "third-party info" not in out, out


def test_the_filter_by_logger_name_and_level():
    keep = OwnInfoOnly().filter

    def record(name: str, level: int) -> logging.LogRecord:
        return logging.LogRecord(name, level, __file__, 1, "m", None, None)

    assert keep(record("isthmus", logging.INFO)) and keep(record("isthmus.site", logging.DEBUG))
    assert keep(record("wire.net.metrics_http", logging.INFO))
    assert keep(record("botocore.credentials", logging.WARNING))
    assert not keep(record("botocore.credentials", logging.INFO))
    assert not keep(record("isthmusx", logging.INFO))  # a prefix is not a package
    assert not keep(record("root", logging.INFO))
