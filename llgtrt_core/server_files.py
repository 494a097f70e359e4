"""Files the API workers of one server share (the engine process's socket, the stored responses).

They lie in a folder only this user can open, named after the workers' parent (the `bentoml serve`
process, so every worker of one server finds the same file and another server never does).
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path


def private_folder() -> Path:
    folder = Path(tempfile.gettempdir()) / f"llgtrt-{os.getuid()}"
    folder.mkdir(mode=0o700, exist_ok=True)
    if folder.stat().st_uid != os.getuid() or folder.stat().st_mode & 0o077:
        raise PermissionError(f"{folder} must belong to this user and be private to it")
    return folder


def server_file_path(stem: str, suffix: str) -> str:
    """`<private folder>/<stem>-<the workers' parent pid><suffix>`."""
    return str(private_folder() / f"{stem}-{os.getppid()}{suffix}")


def remove_stale_server_files(stem: str) -> None:
    """Remove `<stem>-<pid>*` files of servers that are gone (a server that crashed left them)."""
    for path in private_folder().glob(f"{stem}-*"):
        pid = path.name[len(stem) + 1:].split(".", 1)[0]
        if pid.isdigit() and not _alive(int(pid)):
            path.unlink(missing_ok=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process took the number: not ours to judge
        pass
    return True
