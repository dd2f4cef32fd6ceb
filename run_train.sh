#!/usr/bin/env bash
# Launch training with torchrun, in torchtitan's manner. Environment variables:
#   CONFIG_FILE   TOML config (default ./train_configs/debug_model.toml)
#   NGPU          processes per node (default: the number of GPUs, or 1 on a machine without GPUs, where the
#                 processes train on the CPU with gloo)
#   NNODES, NODE_RANK, MASTER_ADDR, MASTER_PORT   multi-node rendezvous (defaults 1, 0, localhost, 29500)
#   LOG_RANK      local ranks whose output is shown (default 0; e.g. 0,1), same as --local-ranks-filter
#   MAX_RESTARTS  torchrun --max-restarts (default 0)
# Arguments are passed on as config overrides (--section.key value) or flags (--dry-run).
# Before torchrun starts, the launch is checked in one process (hola_titan.preflight): a mistake ends there in one
# line with exit status 2. SIGTERM, SIGUSR1 or SIGINT (Ctrl-C) to this script (or to the whole job) makes the workers
# save a checkpoint at the next step boundary and exit 0; a second Ctrl-C stops them at once. kill -9 of this script
# alone ends torchrun with it, and the workers then stop the same way (save, exit, run folder free).
#
# Multi-node example (2 nodes x 8 GPUs), on node 0 and node 1 respectively:
#   NNODES=2 NODE_RANK=0 MASTER_ADDR=10.0.0.1 CONFIG_FILE=train_configs/hola_1.3B.toml ./run_train.sh
#   NNODES=2 NODE_RANK=1 MASTER_ADDR=10.0.0.1 CONFIG_FILE=train_configs/hola_1.3B.toml ./run_train.sh
# On Slurm: scripts/slurm/train.sbatch (one of these per node through srun, requeued on preemption).
set -euo pipefail
cd "$(dirname "$0")"
CONFIG_FILE=${CONFIG_FILE:-./train_configs/debug_model.toml}
NNODES=${NNODES:-1}
NODE_RANK=${NODE_RANK:-0}
MASTER_ADDR=${MASTER_ADDR:-localhost}
MASTER_PORT=${MASTER_PORT:-29500}
LOG_RANK=${LOG_RANK:-0}
MAX_RESTARTS=${MAX_RESTARTS:-0}
PYTHON=${PYTHON:-}
if [ -z "$PYTHON" ]; then
  if [ -x .venv/bin/python ]; then PYTHON=.venv/bin/python; else PYTHON=python3; fi
fi
overrides=()
while [ $# -gt 0 ]; do
  case "$1" in
    --local-ranks-filter) LOG_RANK=$2; shift 2 ;;
    --local-ranks-filter=*) LOG_RANK=${1#*=}; shift ;;
    *) overrides+=("$1"); shift ;;
  esac
done
if [ -z "${NGPU:-}" ]; then
  NGPU=$("$PYTHON" -c 'import torch; print(max(1, torch.cuda.device_count()))')
fi
if [ "$NNODES" -gt 1 ]; then
  rdzv=(--nnodes "$NNODES" --node_rank "$NODE_RANK" --master_addr "$MASTER_ADDR" --master_port "$MASTER_PORT")
else
  rdzv=(--nnodes 1 --rdzv_backend c10d --rdzv_endpoint "localhost:0")
fi
export PYTHONUNBUFFERED=1
# Restarted ranks must not reuse the previous attempt's store addresses (torchrun restarts with gloo failed 2 in 3
# without it: pytorch/pytorch#135712).
export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=${TORCH_DISABLE_SHARE_RDZV_TCP_STORE:-1}
# Check the launch in one process first: a config, data or run-folder mistake ends here, in one line, exit 2.
folder_check=()
[ "$NODE_RANK" -gt 0 ] && folder_check=(--no-folder-check)
WORLD_SIZE=$((NGPU * NNODES)) "$PYTHON" -m hola_titan.preflight "${folder_check[@]}" \
  --job.config_file "$CONFIG_FILE" "${overrides[@]}" || exit $?
# A worker that stops on an error of its own (exit 2, one line) leaves the line here; torchrun's failure report is
# then dropped, and this script exits 2.
work=$(mktemp -d "${TMPDIR:-/tmp}/run_train.XXXXXX")
export HOLA_TITAN_ERROR_FILE="$work/error"
mkfifo "$work/stderr"
# torchrun's own lines (no [rankN] prefix) wait until the next worker line or the end; the rest passes at once.
filter() {
  local held=() line
  while IFS= read -r line || [ -n "$line" ]; do
    if [[ $line == \[rank* ]]; then
      if [ ${#held[@]} -gt 0 ]; then printf '%s\n' "${held[@]}"; held=(); fi
      printf '%s\n' "$line"
    else
      held+=("$line")
    fi
  done
  if [ ! -s "$HOLA_TITAN_ERROR_FILE" ] && [ ${#held[@]} -gt 0 ]; then printf '%s\n' "${held[@]}"; fi
}
# The filter outlives a signal to the whole job (it must print the workers' last lines). After a kill -9 of this
# script it is the last one left, and removes the work folder.
( trap '' TERM USR1 INT; filter; kill -0 "$$" 2>/dev/null || rm -rf "$work" ) < "$work/stderr" >&2 &
filtering=$!
# SIGTERM (a scheduler's warning before a kill), SIGUSR1 and SIGINT (Ctrl-C) go to the workers, which save a
# checkpoint at the next step boundary and exit cleanly. torchrun itself ignores the three (it would otherwise stop the workers at once and end
# with a traceback), whether the signal is sent to this script or to every process of the job.
# hola_titan.launch has the kernel kill torchrun when this script ends, even by kill -9 (no trap sees that); the
# workers, orphaned then, stop as on SIGTERM and free the run folder.
# The traps are set before the launch: a signal that came between the launch and the traps ended this script by
# default (status 143: no save, and a Slurm job not requeued). One that comes before the launcher has workers has
# nobody to reach (before its pid is known, the launcher has just been forked) and is dropped.
launcher=""
forward() { [ -z "$launcher" ] || pkill "-$1" -P "$launcher" 2>/dev/null || true; }
trap 'forward TERM' TERM
trap 'forward USR1' USR1
trap 'forward INT' INT
( trap '' TERM USR1 INT; exec "$PYTHON" -m hola_titan.launch "$$" --nproc_per_node "$NGPU" "${rdzv[@]}" \
    --max-restarts "$MAX_RESTARTS" --signals-to-handle SIGHUP,SIGQUIT --local-ranks-filter "$LOG_RANK" \
    --role rank --tee 3 -m hola_titan.train --job.config_file "$CONFIG_FILE" "${overrides[@]}" ) 2> "$work/stderr" &
launcher=$!
# wait returns early (status > 128) when a trapped signal arrives: wait again until the launcher has ended, then read
# its status (bash keeps it). Taking the interrupted wait's status when the launcher ended meanwhile (its workers
# quick to save) made a clean stop exit 143, and a Slurm job was then not requeued.
while kill -0 "$launcher" 2>/dev/null; do wait "$launcher" || true; done
wait "$launcher" && status=0 || status=$?
wait "$filtering" || true
if [ -s "$HOLA_TITAN_ERROR_FILE" ]; then status=2; fi
rm -rf "$work"
exit "$status"
