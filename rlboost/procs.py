"""Process liveness, for the embedded servers (`rlboost.services`) and the weight cache's
locks (`rlboost.weights.disk`): one definition below both, so neither imports the other."""

from __future__ import annotations

import os


def pid_alive(pid: int) -> bool:
    """Whether process `pid` exists and has not exited (a zombie, exited but not yet reaped, is
    dead). A process of another user is alive."""
    if pid <= 0:
        return False
    try:
        with open(f"/proc/{pid}/stat") as f:
            if f.read().split(")")[-1].split()[0] == "Z":  # zombie: exited, not yet reaped
                return False
    except FileNotFoundError:
        return False
    except OSError:
        pass
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
