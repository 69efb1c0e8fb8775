#!/usr/bin/env bash
# Pretrain on the GPUs of one machine: one process per GPU, torchrun's standalone rendezvous.
#   GPUS=8 examples/launch/single_node.sh examples/configs/210m.yaml [key.sub=value ...]
# Everything after the script name goes to `mlmclm pretrain` (config, overrides, --dry-run).
# MLMCLM_PYTHON: the Python with megatron_mlmclm installed, e.g. a venv's (default: python3).
set -euo pipefail
if [ "$#" -lt 1 ]; then
  echo "usage: GPUS=8 $0 CONFIG [key.sub=value ...]" >&2
  exit 2
fi
exec "${MLMCLM_PYTHON:-python3}" -m torch.distributed.run --standalone --nproc_per_node "${GPUS:-8}" -m megatron_mlmclm pretrain "$@"
