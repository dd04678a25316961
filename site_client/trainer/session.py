"""The API a training script calls, inside a process started by ``siteclient start``.

::

    session = SiteSession()                      # every rank; joins the site's process group
    model = build(); fully_shard(...); opt = AdamW(model.parameters())
    for rnd in session.rounds(model, opt):       # theta_r is loaded into the model
        for step in rnd.steps():                 # H inner steps (fewer after a restart)
            if rnd.data_unit_index is None:      # federated: the site's own data, or its
                # shard of data all sites hold: rnd.site_index of rnd.num_sites this round
                batch = my_batch(rnd.number, step)
            else:                                # shared data: unit k of the shared stream
                batch = shared_batch(rnd.data_unit_index, step)
            loss = train_step(batch)
            rnd.loss = loss.item()               # shown in progress and `coordinator status`
        # leaving the body hands the pseudo-gradient theta_r - theta_local to the agent,
        # unless rnd.cancelled
    session.report(val_loss=...)                 # the final theta is loaded when rounds() ends

All ranks take part in every call (``rounds``, ``steps``, ``report``, ``close``). On a site of
several hosts (``siteclient start --nnodes N``) the same script runs on every host: the lowest
rank on node 0 drives the rounds, and each host's agent fetches theta for its own trainers and
pushes their shards (``site_client.trainer.nodes``).

Each item of ``rounds()`` is a *task*: round ``rnd.number`` on data unit ``rnd.data_unit``
(``""`` in federated mode; ``"u<k>"``, ``rnd.data_unit_index == k``, in shared-data mode,
where the same unit must give the same batches at whichever site trains it). In shared-data
mode one round may bring several tasks, all from the same theta_r: after its own unit, a site
may be given a backup copy of a straggler's. When another copy of the unit being trained was
committed first, ``steps()`` stops early on every rank at the same step, ``rnd.cancelled`` is
true, nothing is submitted and ``rounds()`` goes on to the next task.

Hand-off to the agent goes through safetensors files in shared memory, never pickle, and no
rank ever holds the whole model (``site_client.trainer.shards``): each rank maps the agent's theta
file
and copies only its own shard of each tensor into the (sharded) model, checking the copy bit for
bit, and hands back only its own shard of ``theta_r - theta_local`` in a file of its own. This
holds for whatever DTensor layout the model has (FSDP2, FSDP2 with tensor parallelism on a 2-D
mesh); a plain tensor (a buffer, an unsharded model) is handed back by rank 0.

Site checkpoints (``torch.distributed.checkpoint``, inner optimiser included) are written every
``checkpoint_every`` inner steps and when a task's steps are done, in the background
(``AsyncCheckpointer``): the next round starts while the last one is written. The agent sends a
task's last chunk only once its end is checkpointed, so a site whose update counted can always
go on exactly from there. A trainer restarted by the launcher resumes from its newest checkpoint,
with any number of ranks: mid-task if the agent still hands out the same task, otherwise the
new task starts from theta with the optimiser state the checkpoint holds. They go to
``RUN_DIR/checkpoints``, or to object storage with ``siteclient start --checkpoint-url``
(``site_client.checkpoint.place``); a damaged newest checkpoint gives way to the one before it.
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

from site_client.agent.tasks import unit_index, unit_name
from site_client.checkpoint.local import AsyncCheckpointer
from site_client.checkpoint.place import CheckpointPlace, load_newest
from site_client.errors import SiteDrained, TrainerError
from site_client.local_ipc import IpcClient
from site_client.timings import record
from site_client.trainer.faults import ENV as FAULTS_ENV
from site_client.trainer.faults import fault_at, inject, parse_faults
from site_client.trainer.health_probe import SiteProber
from site_client.trainer.nodes import SiteNodes
from site_client.trainer.round import Round, RoundHooks, RoundSpec
from site_client.trainer.shards import Piece, load_pieces, local_pieces, write_update
from site_client.trainer.streaming_rounds import StreamingRounds
from wire.fragments import streaming_from_job
from wire.health import health_from_job
from wire.safetensors_io import MappedTensors, map_tensors

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
    _STORE = dist.PrefixStore(f"isthmus/{_generation(attempt)}", store)
    dist.init_process_group(backend, store=_STORE, rank=rank, world_size=world_size)


_STORE: dist.Store | None = None


def _generation(attempt: int) -> str:
    """A name every rank of this worker group gives its keys, and no earlier group's rank.

    On one host the launcher's store lives on across restarts, and the restart count names
    the attempt. A site of several hosts gets a fresh store for every rendezvous round
    (``siteclient start`` sets ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE``): nothing stale is in
    it, and its port is the same on every node, whose restart counts need not agree (a host
    that was replaced starts at 0).
    """
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        return f"attempt-{attempt}"
    return f"store-{os.environ.get('MASTER_PORT', '')}"


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


def _checkpoint_place(hello: dict, folder: Path, site: str) -> CheckpointPlace:
    """Where the agent says checkpoints go: ``folder``, or the ``--checkpoint-url`` bucket
    (files in transit staged in ``folder``)."""
    url = hello.get("checkpoint_url") or ""
    if not url:
        return CheckpointPlace(folder)
    from site_client.checkpoint.s3 import open_site_checkpoints

    return CheckpointPlace(folder, open_site_checkpoints(url, site, folder / "staging"))


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
        # Every rank says hello (to read the job config); only the driver (rank 0 on one host)
        # drives the rounds, and its checkpoint thread tells the agent when a task's end is on
        # disk. On a site of several hosts each node's leader also speaks to its own agent.
        channel = IpcClient(socket_path)
        hello = channel.call("hello", attempt=self.restart_count)
        self.nodes = SiteNodes(hello, self.rank, self.world_size)
        self.is_driver = self.nodes.is_driver
        self.ipc = channel if self.is_driver else None
        self._done_ipc = IpcClient(socket_path) if self.is_driver else None
        leads = self.nodes.multi and self.nodes.is_leader and not self.is_driver
        self.node_ipc = channel if leads else None  # node k > 0's leader: its own agent
        if self.ipc is None and self.node_ipc is None:
            channel.close()
        if self.nodes.multi:
            hello = self.nodes.shared_hello(hello)
            if self.node_ipc is not None:
                self.node_ipc.call("configure", job_config=hello["job_config"])
        self._task: dict = {}  # a multi-node site: the driver's task, for the other nodes
        # ... and this rank's boxes of the model ([name, offset, shape]): the bytes of theta
        # its node fetches for it. None: theta whole.
        self._boxes: list | None = None
        self._resumed_from = None  # the site checkpoint the trainers resumed from
        self.site = hello["site"]
        # This site's place among the participants of the latest round (rnd.site_index and
        # rnd.num_sites are those of each round): no need to pass them to the script.
        self.site_index, self.num_sites = 0, 0
        self.run_dir = Path(hello["run_dir"])
        self.shm_dir = Path(hello["shm_dir"])
        self.job_config: dict = tomllib.loads(hello["job_config"]) if hello["job_config"] else {}
        self.ckpt_dir = Path(hello.get("checkpoint_dir") or self.run_dir / "checkpoints")
        self.ckpt_place = _checkpoint_place(hello, self.ckpt_dir, self.site)
        pid_dir = self.run_dir / "trainers"
        pid_dir.mkdir(parents=True, exist_ok=True)
        (pid_dir / f"rank-{self.rank}.pid").write_text(f"{os.getpid()} {self.restart_count}\n")
        self.final: RoundSpec | None = None
        self.faults = parse_faults(os.environ.get(FAULTS_ENV, ""))
        self.faults_fired: set = set()
        self._last_seq = -1
        self.checkpointer = AsyncCheckpointer(write=self.ckpt_place.write)
        # ``[streaming]``: fragments sync in turn and merge late (``trainer.streaming_rounds``).
        self.streaming = streaming_from_job(self.job_config)
        self.prober = SiteProber(
            health_from_job(self.job_config),
            self.rank,
            self.world_size,
            self._probe_fault_s,
            lambda result: self.ipc and self.ipc.call("health", **result.as_report()),
        )

    # ---- the round loop -------------------------------------------------------------------

    def rounds(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> Iterator[Round]:
        """The tasks the agent hands out, each with theta_r loaded into ``model``.

        After the body of the loop, the task's update is handed to the agent unless the task
        was cancelled. Ends when the job is finished, with the final theta loaded. The
        checkpoint of a task's end is written from the optimiser's own tensors while the WAN
        sync runs: change them only inside ``rnd.steps()``, whose first step waits for it.
        """
        if self.streaming is not None:
            yield from StreamingRounds(self, self.streaming).run(model, optimizer)
            return
        resume = self._resume(model, optimizer)
        hooks = self._hooks(model, optimizer)
        if self.nodes.multi:
            held = local_pieces(model, self.rank)
            self._boxes = [[p.name, list(p.box_offset), list(p.local.shape)] for p in held]
        while True:
            spec = self._wait_round()
            theta = map_tensors(Path(spec.theta_path))
            pieces = local_pieces(model, self.rank)
            if spec.finished:
                self._load(pieces, theta, spec)
                self.final = spec
                return
            this_task = resume is not None and resume[:2] == (spec.round, spec.data_unit)
            if this_task and resume[2] >= spec.inner_steps:  # its end holds no model
                resume = self._redo(spec, model, optimizer)
            if resume and resume[:2] == (spec.round, spec.data_unit) and resume[2] > 0:
                start = resume[2]  # the model holds the checkpoint of this very task
            else:
                start = 0
                self._load(pieces, theta, spec)
            resume = None
            rnd = Round(spec, start, hooks)
            yield rnd
            if rnd.cancelled:
                continue
            if rnd.completed_steps < spec.inner_steps:
                raise TrainerError(
                    f"round {spec.round}: the loop over rnd.steps() stopped after "
                    f"{rnd.completed_steps} of {spec.inner_steps} steps"
                )
            # The task's end without the model: what follows it loads theta_{r+1}, and were
            # the update lost before it counted, the task is done again (see ``_redo``). It
            # starts first: the push's last chunk waits for it, and it reads only the
            # optimiser's state, which the hand-off of the update below leaves alone.
            end = spec.inner_steps
            self._checkpoint(model, optimizer, rnd, end, task_end=True, model_too=False)
            self._submit(pieces, theta, spec, rnd, durable=False)

    def report(self, **metrics: float) -> None:
        """Send metrics (e.g. validation loss) to the agent's log and ``metrics.jsonl``."""
        if self.ipc:
            self.ipc.call("metrics", **metrics)

    def close(self) -> None:
        self.checkpointer.close()
        if self.ipc:
            self.ipc.close()
        if self._done_ipc:
            self._done_ipc.close()
        if dist.is_initialized():
            _leave_together(self.world_size)

    # ---- pieces ---------------------------------------------------------------------------

    def _hooks(
        self, model, optimizer, before_step=None, settle=None, cancel_requested=None
    ) -> RoundHooks:
        return RoundHooks(
            cancel_requested=cancel_requested or self._cancel_requested,
            after_step=self._after_step,
            checkpoint=lambda rnd, step: self._checkpoint(model, optimizer, rnd, step),
            settle=settle or self.checkpointer.wait,
            checkpoint_every=self.checkpoint_every,
            report=self.report,
            record=self._record,
            before_step=before_step,
        )

    def _record(self, kind: str, **fields) -> None:
        if self.is_driver:
            record(self.run_dir / "trainer_timings.jsonl", kind, **fields)

    def _checkpoint(
        self, model, optimizer, rnd: Round, step: int, task_end: bool = False, model_too=True
    ):
        """Write a site checkpoint of ``step`` of ``rnd`` in the background (without the
        model unless ``model_too``)."""
        seq = max(self._last_seq + 1, rnd.number * STEP_SLOTS + step)
        extra = {
            "round": rnd.number,
            "unit": -1 if rnd.data_unit_index is None else rnd.data_unit_index,
            "step": step,
            "seq": seq,
        }
        if getattr(rnd, "merge_pending", None) is not None:  # streaming outer steps
            extra["merge_pending"] = int(rnd.merge_pending)
        task = {"round": rnd.number, "data_unit": rnd.data_unit}

        def written(_path) -> None:
            self._timing("checkpoint_written", started, round=rnd.number, step=step)
            self.ckpt_place.prune(keep_last=2)
            if task_end:
                self._done_ipc.call("checkpointed", **task)

        started = time.monotonic()
        on_done = written if self.is_driver else None
        path = self.ckpt_place.target(seq)
        # A task's end without the model: nothing changes the optimiser's state before the
        # next task's first step, which waits for the write (``Round.steps``): no copy.
        lean = task_end and not model_too
        self.checkpointer.save(
            path, model, optimizer, extra, on_done, with_model=model_too, copy=not lean
        )
        self._timing("checkpoint_staged", started, round=rnd.number, step=step)
        self._last_seq = seq

    def _resume(self, model, optimizer) -> tuple[int, str, int] | None:
        """(round, data unit, step) of the newest site checkpoint, loaded into the model."""
        extra = self._resume_extra(model, optimizer)
        if extra is None:
            return None
        return int(extra["round"]), unit_name(int(extra.get("unit", -1))), int(extra["step"])

    def _resume_extra(self, model, optimizer) -> dict | None:
        """The newest site checkpoint's saved values, loaded into the model (None: none)."""
        found = load_newest(self.ckpt_place, model, optimizer)
        if found is None:
            return None
        self._resumed_from, extra = found
        round_number, step = int(extra["round"]), int(extra["step"])
        self._last_seq = int(extra.get("seq", round_number * STEP_SLOTS + step))
        return extra

    def _redo(self, spec: RoundSpec, model, optimizer) -> tuple[int, str, int] | None:
        """Resumed at the end of the very task handed out again: the agent running now never
        had its update (it restarted; whether the update counted, the push will hear), and the
        checkpoint of the task's end holds no model to make it from. Load the checkpoint
        before (none: the task was the site's first) and train the task again: in
        deterministic mode the same update, bit for bit, and the same optimiser state."""
        if self.is_driver:
            print(
                f"[{self.site}] round {spec.round}: the update of the task resumed at its end "
                "is wanted again; training the task again from the checkpoint before it",
                file=sys.stderr,
            )
        found = load_newest(self.ckpt_place, model, optimizer, before=self._resumed_from)
        if found is None:
            optimizer.state.clear()  # the task was the first: from a fresh optimiser
            return None
        extra = found[1]
        return int(extra["round"]), unit_name(int(extra.get("unit", -1))), int(extra["step"])

    def _wait_round(self) -> RoundSpec:
        # Rank 0 waits for the agent with a short timeout and tells the others each time, so
        # no collective waits longer than that however long the round takes elsewhere.
        while (spec := self._poll_round(None)) is None:
            pass
        return spec

    def _poll_round(self, timeout_s: float | None = 0.0) -> RoundSpec | None:
        """The agent's next task if it has one within ``timeout_s`` (None: the agent's own
        poll interval), agreed on by every rank; None when it has none yet."""
        if self.ipc is None:
            reply = {}
        elif timeout_s is None:
            reply = self.ipc.call("wait_round")
        else:
            reply = self.ipc.call("wait_round", timeout=timeout_s)
        flag = torch.tensor([1 if reply.get("ready") else 0], dtype=torch.int64)
        dist.broadcast(flag, src=self.nodes.driver)
        if not flag.item():
            return None
        unit = unit_index(reply.get("data_unit", "")) if self.is_driver else None
        fields = torch.tensor(
            [
                reply.get("round", 0),
                reply.get("version", 0),
                reply.get("inner_steps", 0),
                reply.get("total_rounds", 0),
                int(bool(reply.get("finished"))),
                -1 if unit is None else unit,
                reply.get("site_index", 0),
                reply.get("num_sites", 0),
                int(bool(reply.get("drained"))),
            ],
            dtype=torch.int64,
        )
        dist.broadcast(fields, src=self.nodes.driver)
        r, v, h, total, finished, unit, index, sites, drained = (int(x) for x in fields.tolist())
        if drained:
            self._leave_drained()
        path = self.nodes.broadcast_text(reply.get("theta_path", ""))
        if self.nodes.multi:  # this node's own copy, and the task for the other nodes
            path, self._task = self.nodes.theta_here(path, reply, self.node_ipc, self._boxes)
        if not finished:  # the final theta is no round of this site's
            self.site_index, self.num_sites = index, sites
            self.prober.before(r)
        return RoundSpec(r, v, h, total, bool(finished), path, "", unit_name(unit), index, sites)

    def _leave_drained(self) -> None:
        """The site is drained and nothing more is asked of its trainers: finish the
        checkpoint being written (the agent's last push waits for it) and leave, every rank."""
        if self.is_driver:
            print(f"[{self.site}] drained by the coordinator: trainers leave", file=sys.stderr)
        self.close()
        raise SiteDrained("drained")

    def _probe_fault_s(self, round_number: int) -> float:
        """Seconds a planned ``slow_probe`` fault adds to the probe before ``round_number``."""
        here = (self.site, round_number, 0, self.rank, self.restart_count)
        fault = fault_at(self.faults, *here, actions=("slow_probe",))
        return fault.seconds if fault is not None else 0.0

    def _timing(self, kind: str, started: float, **fields) -> None:
        if self.is_driver:
            seconds = time.monotonic() - started
            record(self.run_dir / "trainer_timings.jsonl", kind, s=seconds, **fields)

    def _load(self, pieces: list[Piece], theta: MappedTensors, spec: RoundSpec) -> None:
        """Load this rank's shards of theta_version; every rank must load exactly."""
        started = time.monotonic()
        self._all_exact(
            load_pieces(pieces, theta),
            f"theta_{spec.version} loaded into the model does not match the agent's file",
        )
        self._timing("load", started, version=spec.version)

    def _all_exact(self, wrong: list[str], problem: str) -> None:
        """Raise ``problem`` on every rank unless every rank's ``wrong`` is empty."""
        flag = torch.tensor([0 if wrong else 1], dtype=torch.int64)
        dist.all_reduce(flag, op=dist.ReduceOp.MIN)
        if not flag.item():
            where = f": {', '.join(wrong[:5])} on rank {self.rank}" if wrong else " on another rank"
            raise TrainerError(f"{problem}{where}")

    def _submit(
        self, pieces, theta, spec: RoundSpec, rnd: Round, durable: bool, names=None
    ) -> None:
        """Every rank writes its own shard of the update (of ``names`` only, when given: a
        fragment); rank 0 hands the files over."""
        started = time.monotonic()
        unit = f"-{spec.data_unit}" if spec.data_unit else ""
        stem = f"delta-r{spec.round}{unit}-{self.restart_count}"
        mine = self.shm_dir / f"{stem}-rank{self.rank}.safetensors"
        write_update(pieces, theta, mine, names)
        dist.barrier()
        ranks = self.nodes.ranks_here()
        paths = [str(self.shm_dir / f"{stem}-rank{k}.safetensors") for k in ranks]
        # The task's seconds in step bodies: an adaptive uplink's deadline is a share of them.
        task = {"round": spec.round, "data_unit": spec.data_unit, "weight": rnd.weight}
        task["compute_s"] = round(rnd.compute_s, 6)
        if self.nodes.multi:
            agent = self.ipc or self.node_ipc
            self.nodes.submit_parts(agent, paths, task, spec.version, durable, self._task)
        elif self.is_driver:
            self.ipc.call("submit", paths=paths, durable=durable, **task)
        dist.barrier()
        self._timing("handoff", started, round=spec.round)

    def _cancel_requested(self, rnd: Round, step: int) -> bool:
        """Report progress; whether the agent says stop, agreed on by every rank."""
        cancel = False
        if self.ipc:
            cancel = bool(self._progress(rnd, step).get("cancel"))
        # Rank 0 alone hears the agent; every rank must leave the loop at the same step, or
        # the ones that go on would wait forever in their next collective.
        flag = torch.tensor([1 if cancel else 0], dtype=torch.int64)
        dist.broadcast(flag, src=self.nodes.driver)
        return bool(flag.item())

    def _progress(self, rnd: Round, step: int) -> dict:
        """Tell the agent where rank 0 is (shown in status); its reply."""
        loss = rnd.loss if rnd.loss == rnd.loss else 0.0
        return self.ipc.call(
            "progress", round=rnd.number, data_unit=rnd.data_unit, step=step, loss=loss
        )

    def _after_step(self, rnd: Round, step: int) -> None:
        here = (self.site, rnd.number, step, self.rank, self.restart_count)
        inject(fault_at(self.faults, *here), self.faults_fired)
