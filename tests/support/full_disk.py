"""A small real filesystem for full-disk tests: a tmpfs mounted in a mount namespace of the child process's own, so
nothing outside the child ever sees it and it vanishes with the child (no unmount to forget).

    cmd = in_small_filesystem(mount_point, size_kib, [sys.executable, script, ...])   # None: not possible here

Root gets a plain mount namespace (`unshare -m`); another user a user namespace mapped to root in it
(`unshare -rm`), where the kernel allows one. Inside, the mount is private: it never propagates to the host.
"""

from __future__ import annotations

import os
import shutil
import subprocess


def in_small_filesystem(mount_point: str, size_kib: int, cmd: list[str]) -> list[str] | None:
    """CMD run with a tmpfs of SIZE_KIB mounted at MOUNT_POINT (which must exist), or None where this machine
    allows no mount namespace."""
    unshare = shutil.which("unshare")
    if unshare is None:
        return None
    for flags in (["-m"], ["-r", "-m"]) if os.geteuid() == 0 else (["-r", "-m"],):
        probe = subprocess.run([unshare, *flags, "--propagation", "private", "sh", "-c",
                                f"mount -t tmpfs -o size=4k tmpfs {mount_point}"], capture_output=True)
        if probe.returncode == 0:
            script = 'mount -t tmpfs -o size="$1"k tmpfs "$2" && shift 2 && exec "$@"'
            return [unshare, *flags, "--propagation", "private", "sh", "-c", script, "sh", str(size_kib),
                    mount_point, *cmd]
    return None


def fill(folder: str, leave_bytes: int = 0) -> str:
    """Take the free space of FOLDER's filesystem, all but `leave_bytes` of it; returns the filler's path."""
    path = os.path.join(folder, "filler")
    stat = os.statvfs(folder)
    size = stat.f_bavail * stat.f_frsize - leave_bytes
    with open(path, "wb", buffering=0) as f:
        if size > 0:
            os.posix_fallocate(f.fileno(), 0, size)
        if leave_bytes == 0:  # the last partial block too: write until the filesystem refuses
            try:
                while True:
                    f.write(b"\0" * 4096)
            except OSError:
                pass
    return path
