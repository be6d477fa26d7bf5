"""One error type for bad user input, shared by every CLI command and component."""

from __future__ import annotations

from kfp_nvrx.components.redaction import REDACTED, redact


class UserError(Exception):
    """Bad input: reported as a single line naming the field and the fix, exit code 2.

    Args:
        field: The setting, flag or parameter that is wrong (e.g. ``train.steps``, ``--nodes``).
        message: What is wrong and how to fix it.
    """

    exit_code = 2

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message

    def one_line(self) -> str:
        """The error as one line (newlines folded)."""
        return " ".join(str(self).split())


# One redaction for the whole process (components/redaction.py); re-exported here, where every
# caller already imports UserError from.
__all__ = ["REDACTED", "UserError", "redact"]
