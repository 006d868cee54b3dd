"""What a limit of this process or machine (open files, file size, memory) says to the
user. No imports beyond the standard library: writing a file under `ulimit -n` may have
no descriptor left to import a module with."""

from __future__ import annotations

import errno
import resource

__all__ = ["limit_hint"]


def limit_hint(code: int | None) -> str:
    """For an errno that means a limit of this process or machine was met (open files,
    file size, memory), a clause naming the limit, its value and how to raise it; ""
    for any other errno. Those failures are not a disk's or a path's fault, and a
    message saying so sent users to check the disk."""
    if code == errno.EMFILE:
        soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
        return (f"this process may hold only {soft} open files (RLIMIT_NOFILE, ulimit -n) "
                "and holds that many; raise the limit where training starts (ulimit -n "
                "65536; docker run --ulimit nofile=65536; LimitNOFILE= in a systemd unit)")
    if code == errno.ENFILE:
        return ("the machine's open-file table is full (fs.file-max); close files of other "
                "processes or raise it (sysctl -w fs.file-max=...)")
    if code == errno.EFBIG:
        soft = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
        if soft == resource.RLIM_INFINITY:
            return ("the file system's largest file size is reached (FAT32's is 4 GiB); give "
                    "a directory on a file system that takes larger files (ext4, xfs)")
        return (f"files this process writes may not grow past {soft} bytes (RLIMIT_FSIZE, "
                "ulimit -f); raise the limit where training starts (ulimit -f unlimited)")
    if code == errno.ENOMEM:
        soft = resource.getrlimit(resource.RLIMIT_AS)[0]
        cap = ("" if soft == resource.RLIM_INFINITY else
               f"this process may map only {soft} bytes (RLIMIT_AS, ulimit -v), or ")
        return (f"the kernel refused this process memory: {cap}a container's memory limit "
                "or the machine's free memory was met; raise the limit where training "
                "starts (ulimit -v unlimited; docker run --memory=...) or free memory")
    return ""
