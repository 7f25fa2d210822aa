"""Lines flowrl writes to the console, each in one write.

The ranks of a launch share the launcher's stderr and run unbuffered (``python -u``), where
``print`` writes the text and its newline separately, so two ranks reporting the same error at
once could interleave mid-line (seen in CI: ``...on purposeflowrl: error: ...``). A line written
with its newline in one call reaches a pipe in one ``write`` (atomic up to ``PIPE_BUF`` bytes).
"""

from __future__ import annotations

import sys


def stderr_line(text: str) -> None:
    """Write ``text`` and a newline to stderr in one write, and flush."""
    try:
        sys.stderr.write(f"{text}\n")
        sys.stderr.flush()
    except (OSError, ValueError):  # a closed or broken stream: nothing more can be said on it
        pass
