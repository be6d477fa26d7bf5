"""The rank monitor's timeouts in words, for the trainer's log line once they are learned.

NVRx's ``HeartbeatTimeouts`` / ``SectionTimeouts`` print as reprs (``HeartbeatTimeouts(initial=
10.17, subsequent=4.00, were_calculated=True)``); a newcomer reading ``make demo`` wants to know
what they mean for the run: how long a rank may go without a step before it is taken for hung.
Duck-typed on those two classes' fields, so this module imports neither NVRx nor torch.
"""

from __future__ import annotations

from typing import Any


def _seconds(value: float | None) -> str:
    return "unbounded" if value is None else f"{value:.1f} s"


def heartbeat_words(hb: Any) -> str:
    """``hang detection after 4.0 s without a step (learned); the first step within 10.2 s``."""
    learned = " (learned)" if getattr(hb, "were_calculated", False) else ""
    between = (f"hang detection after {hb.subsequent:.1f} s without a step{learned}"
               if hb.subsequent is not None else "no hang detection between steps")
    first = (f"the first step within {hb.initial:.1f} s" if hb.initial is not None
             else "no limit on the first step")
    return f"{between}; {first}"


def sections_words(sections: Any) -> str:
    """``sections: step 4.0 s (learned), checkpoint 60.0 s; 300.0 s outside them``."""
    learned = set(getattr(sections, "calculated_sections", ()) or ())
    parts = [f"{name} {_seconds(limit)}{' (learned)' if name in learned else ''}"
             for name, limit in dict(sections.section).items()]
    return f"sections: {', '.join(parts) or 'none'}; {_seconds(sections.out_of_section)} outside them"


def describe_timeouts(hb: Any, sections: Any = None) -> str:
    """Both sets of timeouts on one line (``sections`` None: heartbeats mode, no sections)."""
    said = [heartbeat_words(hb)] if hb is not None else []
    if sections is not None:
        said.append(sections_words(sections))
    return "; ".join(said) or "no rank monitor"
