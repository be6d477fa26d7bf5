"""Run events: one JSON object per line in ``<run_dir>/events.jsonl``, one typed class per kind.

The classes of :mod:`.schema` are the one place that knows the events' field names: the trainer
and the drills write them (:class:`EventLog`), goodput, the timeline, the launchers' results and
the drills read them (:func:`read_events`). Every line has ``type`` and ``time`` (Unix seconds); the rest is:

- :class:`Start`: an incarnation began (``layer`` names the restart when it is one);
- :class:`Step`: one training step (``start`` .. ``end``);
- :class:`Checkpoint`: a save committed (``blocking_s`` stalled training);
- :class:`Snapshot`: a host snapshot taken or skipped (``stall_s``: every wait it caused);
- :class:`Replica`: a round of copies of a snapshot to peer nodes ended (``ok``: all held);
- :class:`Fault`: an injected fault fired (written by the faulting rank, or by a drill);
- :class:`Restart`: a restart of one of :data:`RESTART_LAYERS`;
- :class:`Join`: a node's agent started the workers of a rendezvous round (:mod:`.rounds`);
- :class:`End`: the run completed (or its node was asked to stop: ``stopped``);
- :class:`Queued`: a wait in a queue (Kueue held the job), written by the launcher.

Rank 0 writes everything except :class:`Fault`, :class:`Join` (each node's first worker) and
:class:`Queued` (the launcher, where the run dir is on its machine).
The on-disk form is unchanged from the dicts the trainer used to write: a field that is None is
left out unless it has always been written as ``null`` (``resumed_from``, ``loss``, ``rank``),
so files of older runs read, and older readers read ours. A line of a type this version does
not know reads as :class:`Other`.

The package by concern: :mod:`.schema` (the classes and what each field holds), :mod:`.log`
(writing), :mod:`.read` (checking and reading back); every public name is importable from here.
"""

from kfp_nvrx.components.core.events.log import EventLog
from kfp_nvrx.components.core.events.read import (
    in_time_order,
    parse_event,
    parse_events,
    read_events,
)
from kfp_nvrx.components.core.events.schema import (
    IN_JOB,
    IN_PROCESS,
    POD,
    RESTART_LAYERS,
    STOPPED,
    TYPES,
    Checkpoint,
    End,
    Event,
    Fault,
    Join,
    Other,
    Queued,
    Replica,
    Restart,
    Snapshot,
    Start,
    Step,
)

__all__ = [
    "IN_JOB", "IN_PROCESS", "POD", "RESTART_LAYERS", "STOPPED", "TYPES",
    "Checkpoint", "End", "Event", "EventLog", "Fault", "Join", "Other", "Queued", "Replica", "Restart",
    "Snapshot",
    "Start", "Step",
    "in_time_order", "parse_event", "parse_events", "read_events",
]
