"""The site's side of update compression: the job's codec rules and the error-feedback
residuals, which outlive a restart of the agent (fsynced beside the site's checkpoints)."""

from __future__ import annotations

import os
import tomllib
from pathlib import Path

from safetensors.torch import load_file, save_file

from wire.codecs import CodecState
from wire.codecs.rules import CompressionConfig, compression_tables

CODEC_STATE_FILE = "codec_state.safetensors"


def compression_of(job_toml: str) -> CompressionConfig | None:
    """The job's ``[compression]`` uplink rules (None: raw float32, the table is absent).
    The downlink sub-table is the coordinator's business: deltas describe themselves."""
    table = tomllib.loads(job_toml).get("compression") if job_toml else None
    return None if table is None else compression_tables(table)[0]


def load_codec_state(path: Path) -> CodecState:
    """Error-feedback residuals kept across agent restarts (empty if there are none yet)."""
    state = CodecState()
    if path.exists():
        state.load_state_dict(load_file(str(path)))
    return state


def save_codec_state(path: Path, state: CodecState) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    save_file({k: v.contiguous() for k, v in state.state_dict().items()}, str(tmp))
    with open(tmp, "rb+") as f:
        os.fsync(f.fileno())
    os.replace(tmp, path)
