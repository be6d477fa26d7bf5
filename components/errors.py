"""One error type for bad user input, shared by every CLI command and component."""

from __future__ import annotations

import re
from collections.abc import Iterable


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


#: ``scheme://user:password@``: the credentials part of a URL.
_USERINFO = re.compile(r"(\b[a-zA-Z][a-zA-Z0-9+.-]*://)[^/@\s]+@")
#: What replaces a secret in any message.
REDACTED = "<redacted>"


def redact(text: str, secrets: Iterable[str]) -> str:
    """Replace every secret (and ``user:password@`` in URLs) in ``text`` with a placeholder.

    Every error and log line that may carry a credential passes through here before it is
    printed: a token read from ``--token-file`` or a password typed into ``--host`` must never
    reach stdout, stderr, logs or artifacts.
    """
    for secret in sorted({s for s in secrets if s}, key=len, reverse=True):
        text = text.replace(secret, REDACTED)
    return _USERINFO.sub(rf"\1{REDACTED}@", text)
