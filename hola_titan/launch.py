"""torchrun that ends with its launcher: ``python -m hola_titan.launch LAUNCHER_PID [torchrun arguments ...]``.

``run_train.sh`` starts torchrun through this module. On Linux it asks the kernel to SIGKILL this process when its
parent (``run_train.sh``, whose pid is ``LAUNCHER_PID``) ends, then execs ``python -m torch.distributed.run`` with
the arguments: the request survives the exec, so torchrun itself ends with the script, also on a ``kill -9`` that
no trap in the script can see. Its workers, orphaned in turn, stop as on SIGTERM (saving at the next step
boundary) and release the run folder (``hola_titan.train`` watches its parent). Elsewhere (no ``prctl``) torchrun
starts all the same and a warning says that it would outlive a killed launcher.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys

PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def end_with_parent(parent: int) -> str | None:
    """Have the kernel SIGKILL this process when its parent ends; None when done, else why it could not be.
    Exits with status 1 when the parent is no longer ``parent`` (it ended before the request took effect)."""
    if not sys.platform.startswith("linux"):
        return f"no prctl on {sys.platform}"
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0) != 0:
        return f"prctl(PR_SET_PDEATHSIG) failed: {os.strerror(ctypes.get_errno())}"
    if os.getppid() != parent:
        print(f"error: the launcher (process {parent}) ended before torchrun started", file=sys.stderr)
        sys.exit(1)
    return None


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv or not argv[0].isdigit():
        print("usage: python -m hola_titan.launch LAUNCHER_PID [torchrun arguments ...]", file=sys.stderr)
        return 2
    why = end_with_parent(int(argv[0]))
    if why is not None:
        print(f"warning: torchrun would outlive its launcher if the launcher is killed ({why})", file=sys.stderr)
    os.execv(sys.executable, [sys.executable, "-m", "torch.distributed.run", *argv[1:]])
    return 1  # not reached: execv replaces this process or raises


if __name__ == "__main__":
    sys.exit(main())
