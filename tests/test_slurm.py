"""``scripts/slurm/train.sbatch`` in a simulated Slurm job on the CPU (issue 50, item 11): ``srun`` and ``scontrol``
are stubs on PATH, ``PYTHON`` is a stub that records the torchrun command each node's ``run_train.sh`` builds and
stands in for its worker. Checks the torchrun arguments per node, the requeue after SIGTERM (only after a clean
save), and the one-line refusals."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SBATCH = ROOT / "scripts" / "slurm" / "train.sbatch"

# srun: one task per node (SLURM_NODEID per task), SIGTERM passed on to the tasks as srun does.
SRUN = r"""#!/usr/bin/env bash
printf '%s\n' "$*" >> "$STUB_LOG/srun"
while [ $# -gt 0 ]; do case "$1" in --nodes|--ntasks-per-node) shift 2 ;; --*) shift ;; *) break ;; esac; done
pids=()
trap 'kill -TERM "${pids[@]}" 2>/dev/null' TERM
for ((i = 0; i < SLURM_JOB_NUM_NODES; i++)); do
  SLURM_NODEID=$i SLURM_PROCID=$i "$@" &
  pids+=($!)
done
status=0
for pid in "${pids[@]}"; do
  while kill -0 "$pid" 2>/dev/null; do wait "$pid" || true; done
  wait "$pid" || status=$?
done
exit $status
"""
SCONTROL = r"""#!/usr/bin/env bash
printf '%s\n' "$*" >> "$STUB_LOG/scontrol"
if [ "$1 $2" = "show hostnames" ]; then printf 'gpu-a17\ngpu-a18\n'; fi
"""
# The interpreter run_train.sh calls: the launch check passes, the torchrun launch is recorded per node and runs a
# stand-in worker that ends at once (STUB_WORKER=exit) or on SIGTERM, with status STUB_STATUS.
PYTHON = r"""#!/usr/bin/env bash
case "$1 $2" in
  "-m hola_titan.preflight") exit 0 ;;
  "-m hola_titan.launch")
    printf '%s\n' "$*" > "$STUB_LOG/torchrun.$SLURM_NODEID"
    [ "$STUB_WORKER" = exit ] && exit "${STUB_STATUS:-0}"
    # run_train.sh signals the launcher's children: a worker that exits on SIGTERM as the trainer does after its save
    # (Python: bash cannot trap a signal ignored at its start, as torchrun's SIGTERM is).
    "$REAL_PYTHON" -c 'import os, pathlib, signal, sys, time
signal.signal(signal.SIGTERM, lambda *_: sys.exit(int(os.environ.get("STUB_STATUS", "0"))))
pathlib.Path(os.environ["STUB_LOG"], "worker." + os.environ["SLURM_NODEID"]).touch()
time.sleep(600)' &
    wait $!
    exit $? ;;
esac
echo "unexpected interpreter call: $*" >&2
exit 3
"""


def _job(tmp_path: Path, **env: str) -> tuple[list[str], dict, Path]:
    stubs, log = tmp_path / "bin", tmp_path / "log"
    stubs.mkdir(parents=True)
    log.mkdir()
    for name, text in (("srun", SRUN), ("scontrol", SCONTROL), ("python", PYTHON)):
        (stubs / name).write_text(text)
        (stubs / name).chmod(0o755)
    job = dict(os.environ, PATH=f"{stubs}{os.pathsep}{os.environ['PATH']}", STUB_LOG=str(log),
               PYTHON=str(stubs / "python"), REAL_PYTHON=sys.executable, TMPDIR=str(tmp_path), STUB_WORKER="exit",
               SLURM_JOB_ID="731", SLURM_JOB_NODELIST="gpu-a[17-18]", SLURM_JOB_NUM_NODES="2",
               SLURM_SUBMIT_DIR=str(ROOT), SLURM_GPUS_ON_NODE="4")
    for key in ("MASTER_ADDR", "MASTER_PORT", "NGPU", "NNODES", "NODE_RANK", "HOLA_TITAN_ROOT"):
        job.pop(key, None)
    job.update(env)
    return ["bash", str(SBATCH), "--training.steps", "7"], job, log


def test_each_node_runs_one_torchrun_with_the_rendezvous_of_the_first_node(tmp_path):
    cmd, env, log = _job(tmp_path)
    result = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    port = 20000 + 731 % 20000
    for rank in (0, 1):
        torchrun = (log / f"torchrun.{rank}").read_text().split()
        assert torchrun[2].isdigit()  # run_train.sh's pid: torchrun ends with it (hola_titan.launch)
        args = " ".join(torchrun[3:])
        assert args.startswith(f"--nproc_per_node 4 --nnodes 2 --node_rank {rank} --master_addr gpu-a17 "
                               f"--master_port {port} "), args
        assert args.endswith("-m hola_titan.train --job.config_file ./train_configs/debug_model.toml "
                             "--training.steps 7"), args
    assert (log / "srun").read_text().startswith("--nodes 2 --ntasks-per-node 1 --kill-on-bad-exit=1 bash -c ")
    assert (log / "scontrol").read_text() == "show hostnames gpu-a[17-18]\n"  # no requeue after a finished run
    assert f"rendezvous gpu-a17:{port}" in result.stdout


@pytest.mark.parametrize("worker_status", [0, 1])
def test_sigterm_to_the_batch_script_saves_then_requeues(tmp_path, worker_status):
    """--signal=B:TERM@120: SIGTERM reaches the batch script only; the workers of both nodes get it (through srun and
    run_train.sh) and the job is requeued once they exited cleanly (after a failed save it is not)."""
    cmd, env, log = _job(tmp_path, STUB_WORKER="wait", STUB_STATUS=str(worker_status))
    proc = subprocess.Popen(cmd, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        deadline = time.time() + 60
        while not all((log / f"worker.{r}").exists() for r in (0, 1)) and time.time() < deadline:
            time.sleep(0.1)
        assert all((log / f"worker.{r}").exists() for r in (0, 1)), "the stand-in workers did not start"
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    scontrol = (log / "scontrol").read_text().splitlines()
    if worker_status == 0:
        assert proc.returncode == 0, out + err
        assert scontrol == ["show hostnames gpu-a[17-18]", "requeue 731"]
        assert "SIGTERM: the workers save at the next step boundary, then the job is requeued" in out
    else:
        assert proc.returncode != 0 and scontrol == ["show hostnames gpu-a[17-18]"], out + err
        assert "not requeued" in err


def test_outside_slurm_or_the_checkout_it_stops_in_one_line(tmp_path):
    cmd, env, _ = _job(tmp_path)
    del env["SLURM_JOB_ID"]
    result = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60)
    assert result.returncode == 2 and result.stderr.startswith("error: SLURM_JOB_ID is not set"), result.stderr
    cmd, env, _ = _job(tmp_path / "b", SLURM_SUBMIT_DIR=str(tmp_path))
    result = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60)
    assert result.returncode == 2 and result.stderr.startswith("error: HOLA_TITAN_ROOT: no run_train.sh in"), \
        result.stderr
