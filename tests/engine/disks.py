"""A loop-mounted file system filled to a given free space (with the `small_fs` fixture
of conftest.py): what the full-disk tests write onto."""

import errno
import os
from pathlib import Path


def fill(mnt: Path, free_blocks: int) -> None:
    """Leaves about `free_blocks` blocks free on `mnt`, with one file of zeros."""
    fill = mnt / "fill"
    fill.unlink(missing_ok=True)
    os.sync()  # blocks freed by the journal's last transaction count only once committed
    st = os.statvfs(mnt)
    n = st.f_bavail - free_blocks
    while n > 0:
        fd = os.open(fill, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        try:
            os.posix_fallocate(fd, 0, n * st.f_frsize)
            break
        except OSError as e:  # the fill's own extent blocks did not fit: a little less
            if e.errno != errno.ENOSPC:
                raise
            n -= 1
        finally:
            os.close(fd)
    os.sync()
