"""The API a training script calls, inside a process started by ``siteclient start``.

::

    session = SiteSession()                      # every rank; joins the site's process group
    model = build(); fully_shard(...); opt = AdamW(model.parameters())
    for rnd in session.rounds(model, opt):       # theta_r is loaded into the model
        for step in rnd.steps():                 # H inner steps (fewer after a restart)
            if rnd.data_unit_index is None:      # federated: the site's own data
                batch = my_batch(rnd.number, step)
            else:                                # shared data: unit k of the shared stream
                batch = shared_batch(rnd.data_unit_index, step)
            loss = train_step(batch)
            rnd.loss = loss.item()               # shown in progress and `coordinator status`
        # leaving the body hands the pseudo-gradient theta_r - theta_local to the agent,
        # unless rnd.cancelled
    session.report(val_loss=...)                 # the final theta is loaded when rounds() ends

All ranks take part in every call (``rounds``, ``steps``, ``report``, ``close``).

Each item of ``rounds()`` is a *task*: round ``rnd.number`` on data unit ``rnd.data_unit``
(``""`` in federated mode; ``"u<k>"``, ``rnd.data_unit_index == k``, in shared-data mode,
where the same unit must give the same batches at whichever site trains it). In shared-data
mode one round may bring several tasks, all from the same theta_r: after its own unit, a site
may be given a backup copy of a straggler's. When another copy of the unit being trained was
committed first, ``steps()`` stops early on every rank at the same step, ``rnd.cancelled`` is
true, nothing is submitted and ``rounds()`` goes on to the next task.

Hand-off to the agent goes through safetensors files in shared memory, never pickle: rank 0
reads theta_r and the other ranks receive their shards from it (``broadcast_from_rank0``); for
the update, the full state is gathered on rank 0 (CPU offload) and the difference written once.
A per-shard hand-off can replace ``_gather_full`` and ``_load_theta`` without changing this API.

Site checkpoints (``torch.distributed.checkpoint``, inner optimiser included) are written when a
task starts, every ``checkpoint_every`` inner steps, and when its steps are done, so a trainer
restarted by the launcher resumes where it was, with any number of ranks, provided the agent
still hands out the same task (same round and unit); otherwise the new task starts afresh.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import time
import tomllib
from collections.abc import Iterator
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors.torch import load_file, save_file
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    set_model_state_dict,
)

from site_client.checkpoint import (
    latest_site_checkpoint,
    load_site_checkpoint,
    prune_site_checkpoints,
    save_site_checkpoint,
    site_checkpoint_path,
)
from site_client.faults import ENV as FAULTS_ENV
from site_client.faults import parse_faults
from site_client.local_ipc import IpcClient
from site_client.tasks import unit_index, unit_name
from site_client.trainer_round import Round, RoundSpec
from wire.tensors import state_hash

ENV_SOCKET = "ISTHMUS_AGENT_SOCKET"
# Checkpoint names are sequence numbers: round * STEP_SLOTS + step for a round's first task
# (so (round, step) = divmod(name, STEP_SLOTS) there), bumped past the last one for later
# tasks of the same round, so names always sort in the order they were written.
STEP_SLOTS = 1 << 20
PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:
    """Ask Linux to SIGKILL this trainer when its launcher (the site agent) dies.

    Otherwise a trainer whose agent was killed lingers, half-connected, and a later gloo
    rendezvous on a reused local port can be answered by it.
    """
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
        if os.getppid() == 1:  # the parent died before prctl took effect
            os.kill(os.getpid(), signal.SIGKILL)


def _init_process_group(backend: str, attempt: int) -> None:
    """``init_process_group`` on the launcher's store, with keys private to this attempt.

    After a worker-group restart the launcher's store still holds the previous attempt's
    gloo addresses; a restarted rank that read one would dial a dead trainer and time out.
    """
    global _STORE
    store, rank, world_size = next(dist.rendezvous("env://"))
    _STORE = dist.PrefixStore(f"isthmus/attempt-{attempt}", store)
    dist.init_process_group(backend, store=_STORE, rank=rank, world_size=world_size)


_STORE: dist.Store | None = None


def _leave_together(world_size: int) -> None:
    """Destroy the process group only once every rank is past its last collective.

    A rank that tears gloo down while a peer is still finishing the final barrier on its
    sockets aborts that peer ("terminate called without an active exception"): so after the
    barrier, the ranks also meet on the launcher's store, which needs no gloo socket.
    """
    dist.barrier()
    if _STORE is not None:
        arrived = _STORE.add("closing", 1)
        deadline = time.monotonic() + 60
        while arrived < world_size and time.monotonic() < deadline:
            time.sleep(0.01)
            arrived = _STORE.add("closing", 0)
    dist.destroy_process_group()


class TrainerError(RuntimeError):
    """The trainer cannot go on (no agent, theta mismatch, misuse of the API)."""


class SiteSession:
    def __init__(self, backend: str = "gloo", checkpoint_every: int = 0) -> None:
        socket_path = os.environ.get(ENV_SOCKET)
        if not socket_path:
            raise TrainerError(
                f"{ENV_SOCKET} is not set: start this script with `siteclient start ... -- SCRIPT`"
            )
        _die_with_parent()
        self.restart_count = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
        if not dist.is_initialized():
            _init_process_group(backend, self.restart_count)
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        self.checkpoint_every = checkpoint_every
        # Every rank says hello (to read the job config); only rank 0 drives the rounds.
        channel = IpcClient(socket_path)
        hello = channel.call("hello")
        self.ipc = channel if self.rank == 0 else None
        if self.ipc is None:
            channel.close()
        self.site = hello["site"]
        self.run_dir = Path(hello["run_dir"])
        self.shm_dir = Path(hello["shm_dir"])
        self.job_config: dict = tomllib.loads(hello["job_config"]) if hello["job_config"] else {}
        self.ckpt_dir = self.run_dir / "checkpoints"
        pid_dir = self.run_dir / "trainers"
        pid_dir.mkdir(parents=True, exist_ok=True)
        (pid_dir / f"rank-{self.rank}.pid").write_text(f"{os.getpid()} {self.restart_count}\n")
        self.final: RoundSpec | None = None
        self.faults = parse_faults(os.environ.get(FAULTS_ENV, ""))
        self.faults_fired: set = set()
        self._last_seq = -1

    # ---- the round loop -------------------------------------------------------------------

    def rounds(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> Iterator[Round]:
        """The tasks the agent hands out, each with theta_r loaded into ``model``.

        After the body of the loop, the task's update is handed to the agent unless the task
        was cancelled. Ends when the job is finished, with the final theta loaded.
        """
        resume = self._resume(model, optimizer)

        def checkpoint(rnd: Round, step: int) -> None:
            seq = max(self._last_seq + 1, rnd.number * STEP_SLOTS + step)
            extra = {
                "round": rnd.number,
                "unit": -1 if rnd.data_unit_index is None else rnd.data_unit_index,
                "step": step,
                "seq": seq,
            }
            save_site_checkpoint(site_checkpoint_path(self.ckpt_dir, seq), model, optimizer, extra)
            self._last_seq = seq
            if self.rank == 0:
                prune_site_checkpoints(self.ckpt_dir, keep_last=2)
            dist.barrier()

        while True:
            spec = self._wait_round()
            if spec.finished:
                self._load_theta(model, spec)
                self.final = spec
                return
            if resume and resume[:2] == (spec.round, spec.data_unit) and resume[2] > 0:
                start = resume[2]
                theta_r = load_file(spec.theta_path) if self.rank == 0 else {}
            else:
                start = 0
                theta_r = self._load_theta(model, spec)
            resume = None
            rnd = Round(self, spec, start, checkpoint)
            if start == 0:
                checkpoint(rnd, 0)
            yield rnd
            if rnd.cancelled:
                continue
            if rnd.completed_steps < spec.inner_steps:
                raise TrainerError(
                    f"round {spec.round}: the loop over rnd.steps() stopped after "
                    f"{rnd.completed_steps} of {spec.inner_steps} steps"
                )
            if start < spec.inner_steps:
                checkpoint(rnd, spec.inner_steps)
            self._submit(model, spec, theta_r, rnd.weight)

    def report(self, **metrics: float) -> None:
        """Send metrics (e.g. validation loss) to the agent's log and ``metrics.jsonl``."""
        if self.ipc:
            self.ipc.call("metrics", **metrics)

    def close(self) -> None:
        if self.ipc:
            self.ipc.close()
        if dist.is_initialized():
            _leave_together(self.world_size)

    # ---- pieces ---------------------------------------------------------------------------

    def _resume(self, model, optimizer) -> tuple[int, str, int] | None:
        """(round, data unit, step) of the newest site checkpoint, loaded into the model."""
        path = latest_site_checkpoint(self.ckpt_dir)
        if path is None:
            return None
        extra = load_site_checkpoint(path, model, optimizer)
        round_number, step = int(extra["round"]), int(extra["step"])
        self._last_seq = int(extra.get("seq", round_number * STEP_SLOTS + step))
        return round_number, unit_name(int(extra.get("unit", -1))), step

    def _wait_round(self) -> RoundSpec:
        # Rank 0 polls the agent with a short timeout and tells the others each time, so no
        # collective waits longer than a poll however long the round takes elsewhere.
        while True:
            reply = self.ipc.call("wait_round") if self.ipc else {}
            flag = torch.tensor([1 if reply.get("ready") else 0], dtype=torch.int64)
            dist.broadcast(flag, src=0)
            if flag.item():
                break
        unit = unit_index(reply.get("data_unit", "")) if self.rank == 0 else None
        fields = torch.tensor(
            [
                reply.get("round", 0),
                reply.get("version", 0),
                reply.get("inner_steps", 0),
                reply.get("total_rounds", 0),
                int(bool(reply.get("finished"))),
                -1 if unit is None else unit,
            ],
            dtype=torch.int64,
        )
        dist.broadcast(fields, src=0)
        r, v, h, total, finished, unit = (int(x) for x in fields.tolist())
        return RoundSpec(
            r,
            v,
            h,
            total,
            bool(finished),
            reply.get("theta_path", ""),
            reply.get("theta_hash", ""),
            unit_name(unit),
        )

    def _load_theta(self, model, spec: RoundSpec) -> dict[str, torch.Tensor]:
        """Load theta_r into the (sharded) model; returns theta_r on rank 0."""
        theta_r = load_file(spec.theta_path) if self.rank == 0 else {}
        to_load = load_file(spec.theta_path) if self.rank == 0 else {}
        set_model_state_dict(
            model,
            to_load,
            options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True),
        )
        full = self._gather_full(model)
        if self.rank == 0 and state_hash(full).hex() != spec.theta_hash:
            raise TrainerError(
                f"theta_{spec.version} loaded into the model does not match the coordinator's hash"
            )
        return theta_r

    def _gather_full(self, model) -> dict[str, torch.Tensor]:
        return get_model_state_dict(
            model, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
        )

    def _submit(self, model, spec: RoundSpec, theta_r: dict, weight: float) -> None:
        full = self._gather_full(model)
        if self.rank == 0:
            delta = {
                k: theta_r[k].to(torch.float32) - v.to(torch.float32)
                for k, v in full.items()
                if v.is_floating_point()
            }
            unit = f"-{spec.data_unit}" if spec.data_unit else ""
            name = f"delta-r{spec.round}{unit}-{self.restart_count}.safetensors"
            path = self.shm_dir / name
            tmp = path.with_suffix(".tmp")
            save_file(delta, str(tmp))
            os.replace(tmp, path)
            self.ipc.call(
                "submit",
                round=spec.round,
                data_unit=spec.data_unit,
                path=str(path),
                weight=weight,
            )
        dist.barrier()

    def _progress(self, rnd: Round, step: int) -> bool:
        """Tell the agent how far ``rnd`` got; on rank 0, whether it says to stop."""
        if not self.ipc:
            return False
        reply = self.ipc.call(
            "progress",
            round=rnd.number,
            data_unit=rnd.data_unit,
            step=step,
            loss=rnd.loss if rnd.loss == rnd.loss else 0.0,
        )
        return bool(reply.get("cancel"))
