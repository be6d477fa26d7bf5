"""What a training container's exit says: its codes, and the lines that tell ft_launcher's 1s apart.

The words every side shares: the pod's entrypoint (:mod:`.pod_entry`) turns ft_launcher's exit
into one of these codes, a worker prints :data:`GAVE_UP` (or :data:`BUDGET_SPENT`) to end the job
rather than restart it, and the launchers and the rounds read the codes and the lines back
(docs/eks.md, "Why the failure policies are set this way").
"""

from __future__ import annotations

import signal

#: The exit code of a container stopped on request (128 + SIGTERM).
TERMINATED = 128 + signal.SIGTERM
#: ft_launcher lost a peer pod or its rendezvous host (another pod's infrastructure failure).
#: >= 128 (restarted by both job APIs) and above 128 + SIGRTMAX (64): no signal reads as it.
PEER_LOST = 200
#: ft_launcher's last line when it gave up (its ``main`` catching ``ChildFailedError``).
GAVE_UP_LINE = "Some rank(s) exited with non-zero exit code"
#: ft_launcher's last line when its agent raised (store or rendezvous lost, closed, timed out).
BROKE_LINE = "Agent run ended with exception"
#: How a worker's own verdict that the job must end (not restart) begins; it then stops its
#: agent, whose exit reads as a give-up, never as a lost peer.
GAVE_UP = "[trainer] gave up:"
#: What rank 0 prints when the job's in-job restarts exceed ``resilience.max_restarts`` (all
#: nodes together, :mod:`.rounds`).
BUDGET_SPENT = f"{GAVE_UP} the job's in-job restarts are used up"


#: What a training container's exit code says (the failure-policy table in docs/eks.md).
MEANINGS = {
    1: "ft_launcher gave up: in-job restarts used up (resilience.max_restarts) or no start",
    2: "bad command line or config",
    93: "ft_launcher saw no training progress",
    137: "killed (SIGKILL: OOM kill, lost node)",
    TERMINATED: "stopped (SIGTERM: deleted, drained or recreated)",
    PEER_LOST: "lost a peer pod or the rendezvous host (another pod's failure)",
}


def exit_meaning(code: int | None) -> str:
    """One phrase for a training container's exit code ('' when it has none)."""
    return MEANINGS.get(code, "") if code is not None else ""


def verdict(code: int, output: str) -> int:
    """The container's exit code for a child that exited with ``code`` after writing ``output``.

    Only ft_launcher's 1 is re-read: :data:`PEER_LOST` when its verdict line (its ``main`` writes
    one, once) says its agent broke (a store or rendezvous error), 1 when it says it gave up or
    there is none, or when a worker stopped it with its own verdict (:data:`GAVE_UP`: the job's
    restart budget is spent, the loss diverged).
    """
    if code != 1 or GAVE_UP_LINE in output or GAVE_UP in output:
        return code
    return PEER_LOST if BROKE_LINE in output else 1
