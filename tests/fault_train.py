"""The trainer with a fault injected, for the checkpoint tests (production code carries none).

Usage, as a script or a torchrun entry point::

    python tests/fault_train.py [--kill-after-step N [--kill-rank R]] [--kill-in-save N] -- TRAINER ARGS

- ``--kill-after-step N``: after step N (and its save, if any) rank R (default 0) kills itself with SIGKILL;
- ``--kill-in-save N``: rank 0 kills itself with SIGKILL inside the save of step N, after the data files are
  written and before the metadata is (in the background thread with ``checkpoint.async_mode = async``), through an
  injected storage writer.

Faults fire in the first attempt only: a torchrun restart (``TORCHELASTIC_RESTART_COUNT`` > 0) runs clean.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
from pathlib import Path

from torch.distributed.checkpoint import FileSystemWriter

from hola_titan import checkpoint, train


def _kill(message: str) -> None:
    print(f"fault injection: {message}", flush=True)
    os.kill(os.getpid(), signal.SIGKILL)


def main() -> int:
    argv = sys.argv[1:]
    split = argv.index("--")
    parser = argparse.ArgumentParser()
    parser.add_argument("--kill-after-step", type=int)
    parser.add_argument("--kill-rank", type=int, default=0)
    parser.add_argument("--kill-in-save", type=int)
    faults = parser.parse_args(argv[:split])
    first_attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) == 0
    if first_attempt and faults.kill_after_step is not None:
        original = checkpoint.Checkpointer.maybe_save

        def maybe_save(self, step, *, final=False, **health):
            saved = original(self, step, final=final, **health)
            if step == faults.kill_after_step and self.rank == faults.kill_rank:
                if self._pending is not None:
                    self._wait_pending()
                _kill(f"killing rank {self.rank} after step {step}")
            return saved

        checkpoint.Checkpointer.maybe_save = maybe_save
    if first_attempt and faults.kill_in_save is not None:
        class KillingWriter(FileSystemWriter):
            def finish(self, metadata, results):
                if Path(self.path).name == f"step-{faults.kill_in_save}.tmp":
                    _kill(f"killing this process inside the save of {self.path}")
                return super().finish(metadata, results)

        init = checkpoint.Checkpointer.__init__

        def patched_init(self, *args, **kwargs):
            init(self, *args, **{**kwargs, "storage_writer": KillingWriter})

        checkpoint.Checkpointer.__init__ = patched_init
    return train.main(argv[split + 1:])


if __name__ == "__main__":
    sys.exit(main())
