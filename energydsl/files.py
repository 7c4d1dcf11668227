"""Small helpers for the files the commands write."""

from __future__ import annotations

import contextlib
import os


def new_file_mode() -> int:
    """The mode open() gives a new file: 0o666 less the umask. A file written through a private temporary one
    (mkstemp, safetensors: 0600) and renamed gets this mode, as any file the user writes.

    Linux reports the umask in /proc; elsewhere it can only be read by setting it and back (which another
    thread creating a file in between would see)."""
    with contextlib.suppress(OSError, ValueError):
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return 0o666 & ~int(line.split()[1], 8)
    mask = os.umask(0o022)
    os.umask(mask)
    return 0o666 & ~mask
