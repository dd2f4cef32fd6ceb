"""Peak host memory of one rank while the trainer builds and initialises its model (no step is taken).

Run it as one process and under ``torchrun`` to see what the meta-device build saves: each rank holds its shards
and one part of the model at a time, never the whole model. Prints every rank's peak resident set size and
writes rank 0's JSON (``--out``). Arguments after ``--`` are trainer overrides.

    python scripts/init_memory.py --out one.json -- --job.config_file train_configs/hola_1.3B.toml \\
        --model.tokenizer_path bundled --model.vocab_size 8192 --data.dataset bundled --training.device cpu
    torchrun --nproc_per_node 2 scripts/init_memory.py --out fsdp2.json -- (the same overrides)
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    extra = argv[argv.index("--") + 1:] if "--" in argv else []
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=Path("outputs/init_memory.json"))
    args = p.parse_args(argv[:argv.index("--")] if "--" in argv else argv)
    sys.path.insert(0, str(ROOT))
    import torch.distributed as dist

    from hola_titan.config import parse_config
    from hola_titan.metrics import setup_logging
    from hola_titan.train import Trainer
    from hola_titan.parallelisms.parallel_dims import end_process_group

    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    setup_logging(rank)
    with tempfile.TemporaryDirectory(prefix="init_memory_") as tmp:
        begin = time.perf_counter()
        trainer = Trainer(parse_config([*extra, "--checkpoint.enable", "false", "--validation.enable", "false",
                                        "--metrics.enable_tensorboard", "false", "--job.dump_folder",
                                        os.path.join(tmp, "run")]))
        seconds = time.perf_counter() - begin
        peak_gib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux
        row = dict(rank=rank, world_size=world, num_params=trainer.num_params, build_s=seconds, peak_rss_gib=peak_gib,
                   params_gib_fp32=trainer.num_params * 4 / 2**30)
        print(json.dumps(row), flush=True)
        if dist.is_initialized():
            rows = [None] * world
            dist.all_gather_object(rows, row)
        else:
            rows = [row]
        if rank == 0:
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(json.dumps(rows, indent=1) + "\n")
        del trainer
        end_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
