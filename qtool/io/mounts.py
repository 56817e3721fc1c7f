"""Mount points: an output that is one can never be replaced by a rename (EBUSY), so it is
refused before any work. Found by device/inode against the parent (os.path.ismount) and in
/proc/self/mountinfo, which also lists bind mounts within one filesystem. Torch-free."""

from __future__ import annotations

import os
import re
from pathlib import Path

MOUNTINFO = "/proc/self/mountinfo"
_MAX_MOUNTINFO_BYTES = 64 << 20
_ESCAPE = re.compile(rb"\\([0-7]{3})")


def is_mount_point(path: Path) -> bool:
    """Whether `path` (not followed if it is a link) is the root of a mount."""
    try:
        if os.path.ismount(path):
            return True
    except (OSError, ValueError):
        return False
    real = os.path.join(os.path.realpath(path.parent), path.name)
    return real in mount_points()


def mount_points() -> set[str]:
    """Every mount point this process sees (empty where /proc is not mounted)."""
    try:
        with open(MOUNTINFO, "rb") as f:
            data = f.read(_MAX_MOUNTINFO_BYTES)
    except OSError:
        return set()
    points = set()
    for line in data.splitlines():
        fields = line.split(b" ")
        if len(fields) > 4:  # field 5 is the mount point, with octal escapes (\040 a space)
            raw = _ESCAPE.sub(lambda m: bytes([int(m.group(1), 8)]), fields[4])
            points.add(os.fsdecode(raw))
    return points
