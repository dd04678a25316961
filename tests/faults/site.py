"""One site of a fault run: a ``siteclient start`` agent with one or more FSDP2 trainers of
``examples/gpt_diloco/train.py``, killable as a whole and restartable on the same run dir."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

from coord_harness import REPO

from faults.spec import JobSpec
from site_client.trainer.session import STEP_SLOTS

TRAIN = REPO / "examples" / "gpt_diloco" / "train.py"


class SiteProcess:
    """``site-<index>``: its agent runs in a session of its own, so ``kill`` reaches the
    agent and every trainer it launched at once."""

    def __init__(
        self,
        folder: Path,
        spec: JobSpec,
        index: int,
        address: str,
        tls_dir: Path | None,
        env: dict[str, str],
        trainer_args: tuple[str, ...] = (),
    ) -> None:
        """``trainer_args``: more arguments for this site's trainers (``--slowdown 2``)."""
        self.name = f"site-{index}"
        self.trainer_args = tuple(trainer_args)
        self.index = index
        self.spec = spec
        self.address = address
        self.tls_dir = tls_dir
        self.env = env
        self.run_dir = Path(folder) / self.name
        self.log_path = Path(folder) / f"{self.name}.log"
        self.proc: subprocess.Popen | None = None
        self.starts = 0
        self.kills = 0

    def command(self) -> list[str]:
        security = ["--tls-dir", str(self.tls_dir)] if self.tls_dir else ["--insecure"]
        return [
            sys.executable,
            "-m",
            "site_client.cli",
            "start",
            "--coordinator",
            self.address,
            "--site",
            self.name,
            "--run-dir",
            str(self.run_dir),
            *security,
            "--nproc-per-node",
            str(self.spec.nproc),
            "--connect-timeout",
            "60",
            "--outage-timeout",
            str(self.spec.outage_timeout_s),
            "--",
            str(TRAIN),
            "--site-index",
            str(self.index),
            "--num-sites",
            str(self.spec.sites),
            "--batch-size",
            "4",
            "--eval-batches",
            "1",
            "--corpus-bytes",
            str(1 << 20),
            "--checkpoint-every",
            str(self.spec.checkpoint_every),
            *self.trainer_args,
        ]

    def start(self) -> None:
        assert not self.running, f"{self.name} is already running"
        self.starts += 1
        with open(self.log_path, "a") as log:
            log.write(f"\n===== start {self.starts}\n")
            log.flush()
            self.proc = subprocess.Popen(
                self.command(),
                cwd=REPO,
                env=self.env,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def exited_badly(self) -> bool:
        return self.proc is not None and self.proc.poll() not in (None, 0) and not self.killed

    @property
    def killed(self) -> bool:
        return self.proc is not None and self.proc.returncode == -signal.SIGKILL

    def kill(self) -> None:
        """SIGKILL the agent's whole process group (agent, launcher, trainers)."""
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.kills += 1
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(timeout=30)
        # A killed agent cannot remove its shared-memory folder (named after its pid).
        for base in (Path("/dev/shm"), Path("/tmp")):
            shutil.rmtree(base / f"isthmus-{self.name}-{self.proc.pid}", ignore_errors=True)

    def restart(self) -> None:
        """Start again on the same run dir (site checkpoints, codec state, metrics)."""
        self.kill()
        self.start()

    def wait(self, timeout: float) -> int | None:
        """The exit code, or None if it still runs after ``timeout`` seconds."""
        assert self.proc is not None
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            return None

    def final_hash(self) -> str | None:
        path = self.run_dir / "final.json"
        if not path.exists():
            return None
        return json.loads(path.read_text()).get("theta_hash")

    def checkpointed(self) -> list[tuple[int, int]]:
        """(round, inner step) of each site checkpoint on disk, oldest first."""
        folder = self.run_dir / "checkpoints"
        names = [p.name for p in folder.glob("step-*")] if folder.is_dir() else []
        seq = sorted(int(n.removeprefix("step-")) for n in names if n[5:].isdigit())
        return [divmod(x, STEP_SLOTS) for x in seq]

    def reached(self, round_number: int, step: int) -> bool:
        return any(cp >= (round_number, step) for cp in self.checkpointed())

    def tail(self, n: int = 60) -> str:
        try:
            return "\n".join(self.log_path.read_text().splitlines()[-n:])
        except OSError:
            return "(no log)"


def wait_while_sites_live(predicate, timeout: float, what: str, sites, tails, interval: float):
    """``predicate()``'s first true value within ``timeout``; ``AssertionError`` at once if a
    site dies meanwhile, ``TimeoutError`` (with ``tails()``, the processes' logs) after it."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        for site in sites:
            if site.exited_badly():
                raise AssertionError(f"{site.name} died waiting for {what}:\n{site.tail()}")
        time.sleep(interval)
    raise TimeoutError(f"timed out after {timeout}s waiting for {what}\n{tails()}")
