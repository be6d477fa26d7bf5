"""The drill matrix: one scenario per fault, all on the same job (``tiny`` unless told).

Every final weight can so be compared bitwise with one fault-free reference run.

The job: ``tiny`` preset (``drill --config 125m`` on CUDA: the same schedule on a real model
size, where the bitwise resume matters), 2 local nodes x 1 process, :data:`STEPS` steps, a snapshot every
:data:`INTERVAL` steps and its durable write whenever the writer is free (all kept: the drills
exercise the durable tier at every snapshot). Healthy 0.4 s steps: the writer process is up
and writing within the first snapshots even on a busy machine (a write never waits for it: on a
job of a few fast steps nothing would be committed before the faults). Faults are placed
relative to those commits. On the CPU
the ranks talk over gloo; on CUDA (:class:`Placement`) each local node gets its own GPU, the
ranks talk over NCCL and the steps are deterministic, so the bitwise column holds there too.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from kfp_nvrx.components.core.faults import Fault, When, parse_fault
from kfp_nvrx.components.errors import UserError

#: Enough steps after the faults at 14 that wait for a commit: on a busy machine NVRx's writer
#: process may be up only ~15 s in (its imports), the first commit a few steps later.
STEPS = 24
INTERVAL = 4
#: Overrides every drill run shares (the reference too): same steps, schedule and data. Snapshots
#: go by steps (the larger presets' ``interval_s`` would take over): the faults are placed
#: against them.
BASE_OVERRIDES = (f"train.steps={STEPS}", f"checkpoint.interval={INTERVAL}",
                  "checkpoint.interval_s=0", "checkpoint.keep=4", "checkpoint.persist_duty=1",
                  "train.step_sleep=0.4")
#: The presets a drill may run: ``tiny`` anywhere, the larger ones on CUDA only (a 2-rank gloo
#: drill of 125m would take hours on a CPU). 8b needs more than one GPU's memory per rank.
CONFIGS = ("tiny", "125m", "1b")
CPU_CONFIGS = ("tiny",)
#: In-process restart on gloo (see ``trainer.bootstrap.check_in_process_timeouts``).
IN_PROCESS = ("resilience.in_process=true", "resilience.monitor=off",
              "resilience.learn_timeouts=false", "resilience.soft_timeout=6",
              "resilience.hard_timeout=10", "resilience.pg_timeout=4")

#: In-process restart over NCCL: the wrapper aborts blocked collectives, so the monitor and the
#: learned timeouts stay on (what users run), and NCCL's timeout exceeds the hard timeout.
IN_PROCESS_CUDA = ("resilience.in_process=true", "resilience.soft_timeout=30",
                   "resilience.hard_timeout=45", "resilience.pg_timeout=120")

SURVIVE, FAIL, STOP = "survive", "fail cleanly", "stop cleanly, then resume"


@dataclass(frozen=True)
class Scenario:
    """One drill.

    Attributes:
        name: Identifier (``--scenario``).
        what: One line: what is done to the job.
        expect: :data:`SURVIVE`, :data:`FAIL` or :data:`STOP`.
        faults: The trainer's faults (``KIND@STEP[/RANK]``, :mod:`...core.faults`).
        extra: ``--set`` items on top of :data:`BASE_OVERRIDES`.
        nodes: ``N`` or ``MIN:MAX`` local nodes.
        action: What the drill itself does during the run: ``kill-node``, ``flip-newest``,
            ``truncate-newest``, ``disk-full`` or ``sigterm`` ('' = nothing).
        bitwise: Whether the final weights must equal the reference (False when the world size
            changes: each rank draws its own batches, so fewer ranks train on other data).
        min_restarts: Restarts the run must show (None: one per fault of a failure kind,
            :func:`restarts_expected`).
        quick: Part of ``drill --quick`` (CI).
    """

    name: str
    what: str
    expect: str = SURVIVE
    faults: tuple[str, ...] = ()
    extra: tuple[str, ...] = ()
    nodes: str = "2"
    action: str = ""
    bitwise: bool = True
    min_restarts: int | None = None
    quick: bool = False

    def parsed_faults(self) -> list[Fault]:
        """The scenario's faults, typed."""
        return [parse_fault(text) for text in self.faults]

    def torn_steps(self) -> list[int]:
        """The steps whose checkpoint one of the faults tears (it fires while it is written)."""
        return [f.step for f in self.parsed_faults() if f.kind.when is When.CHECKPOINT]

    def least_restarts(self) -> int:
        """Restarts the run must show: :attr:`min_restarts`, else one per failure fault."""
        if self.min_restarts is not None:
            return self.min_restarts
        return restarts_expected(self.parsed_faults())


def restarts_expected(faults: list[Fault]) -> int:
    """Restarts a run must show for ``faults``: one per failure; a healthy stall causes none."""
    return sum(1 for f in faults if f.kind.failure)


SCENARIOS: tuple[Scenario, ...] = (
    Scenario("kill-rank", "SIGKILL rank 1 at step 10", faults=("kill@10/1",)),
    Scenario("kill-node", "SIGKILL node 1's ft_launcher agent and its worker (--nodes 1:2) after "
             "the first commit", nodes="1:2", action="kill-node", bitwise=False, min_restarts=1),
    Scenario("hang-rank", "rank 1 stops (no heartbeats, blocked) at step 10", faults=("hang@10/1",)),
    Scenario("raise-in-process", "exception on rank 1 at step 6 (the first checkpoint still in "
             "flight), in-process restart on", faults=("raise@6/1",), extra=IN_PROCESS),
    Scenario("kill-in-ckpt", "SIGKILL rank 1 while the step-8 checkpoint is being written",
             faults=("kill-in-ckpt@8/1",)),
    # after_commits: the kill waits for a commit to damage (a loaded machine writes late).
    Scenario("corrupt-newest", "SIGKILL rank 1 at step 14 (or the first step after it with a "
             "commit), then flip 64 bytes of the newest committed checkpoint (same size) before "
             "the restart", faults=("kill@14/1:after_commits=1",),
             action="flip-newest", quick=True),
    Scenario("truncate-newest", "SIGKILL rank 1 at step 14 (or the first step after it with a "
             "commit), then truncate the newest committed checkpoint to half before the restart",
             faults=("kill@14/1:after_commits=1",),
             action="truncate-newest"),
    Scenario("disk-full", "checkpoint volume (tmpfs) fills up while the step-8 checkpoint is "
             "written; space is freed once the failure shows", action="disk-full", min_restarts=1),
    Scenario("two-faults", "SIGKILL rank 1 at step 9 and rank 0 at step 11 (both before the next "
             "commit at 12)", faults=("kill@9/1", "kill@11/0")),
    Scenario("launcher-sigterm", "SIGTERM to `kfp-nvrx launch-local` after the first commit; "
             "then launch again (not with --quick)", expect=STOP, action="sigterm", min_restarts=0,
             quick=True),
    Scenario("max-restarts", "2 kills (steps 3, 6) with resilience.max_restarts=1", expect=FAIL,
             faults=("kill@3/1", "kill@6/1"), extra=("resilience.max_restarts=1",),
             bitwise=False, quick=True),
)


@dataclass(frozen=True)
class Placement:
    """Where the drill's ranks run: ``cpu`` (2 ranks, gloo) or ``cuda`` with 1 or 2 GPUs (NCCL).

    Scenarios are written for 2 ranks; on one GPU their faults all land on rank 0, and a
    scenario that needs a second node is skipped.
    """

    device: str = "cpu"
    world: int = 2

    @property
    def label(self) -> str:
        """How the setup line names the placement."""
        if self.device == "cpu":
            return f"{self.world} local nodes x 1 process (gloo, CPU)"
        return f"{self.world} local node(s) x 1 GPU (NCCL, deterministic)"

    def overrides(self, sc: Scenario | None) -> list[str]:
        """``--set`` items for this placement (the scenario's own last)."""
        extra = list(sc.extra) if sc is not None else []
        if self.device == "cpu":
            return extra
        if "resilience.in_process=true" in extra:
            extra = [e for e in extra if e not in IN_PROCESS] + list(IN_PROCESS_CUDA)
        return ["train.device=cuda", "train.deterministic=true", *extra]

    def faults(self, sc: Scenario) -> list[str]:
        """The scenario's faults with ranks folded onto the ranks that exist, as the trainer's text."""
        return [str(replace(f, rank=f.rank % self.world)) for f in sc.parsed_faults()]

    def nodes(self, nodes: str) -> str | None:
        """The scenario's ``--nodes`` here, or None when it needs more nodes than there are."""
        most = int(nodes.split(":")[-1])
        if most <= self.world:
            return nodes
        return None if ":" in nodes else str(self.world)


def check_config(config: str, place: Placement) -> None:
    """Refuses a preset the drill does not run, or one too large for the placement's device."""
    if config not in CONFIGS:
        raise UserError("config", f"is {config!r}; the drill runs {', '.join(CONFIGS)}")
    if place.device == "cpu" and config not in CPU_CONFIGS:
        raise UserError("config", f"{config} drills run on CUDA only (2 gloo ranks of it would "
                        "take hours); use `device=cuda` on a GPU host, or `config=tiny`")


def select(names: list[str] | None, quick: bool) -> list[Scenario]:
    """The scenarios to run: the named ones, the quick set, or all; raises UserError on a typo."""
    by_name = {s.name: s for s in SCENARIOS}
    if names:
        unknown = [n for n in names if n not in by_name]
        if unknown:
            raise UserError("scenario", f"unknown {', '.join(map(repr, unknown))}; known: "
                            f"{', '.join(by_name)}")
        return [by_name[n] for n in dict.fromkeys(names)]
    return [s for s in SCENARIOS if s.quick or not quick]
