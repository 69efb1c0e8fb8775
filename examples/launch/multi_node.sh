#!/usr/bin/env bash
# Pretrain on several machines: run this once on every node, with the same MASTER_ADDR/NNODES
# and that node's NODE_RANK (0 .. NNODES-1).
#   MASTER_ADDR=node0 NNODES=2 NODE_RANK=0 examples/launch/multi_node.sh examples/configs/610m.yaml
#   MASTER_ADDR=node0 NNODES=2 NODE_RANK=1 examples/launch/multi_node.sh examples/configs/610m.yaml
# Optional: GPUS (per node, default 8), MASTER_PORT (default 29500), RDZV_ID (default mlmclm),
# MLMCLM_PYTHON (the Python with megatron_mlmclm installed, e.g. a venv's; default: python3).
# Everything after the script name goes to `mlmclm pretrain`.
set -euo pipefail
: "${MASTER_ADDR:?set MASTER_ADDR to the host name or address of node 0}"
: "${NNODES:?set NNODES to the number of nodes}"
: "${NODE_RANK:?set NODE_RANK to the rank of this node, 0 .. NNODES-1}"
if [ "$#" -lt 1 ]; then
  echo "usage: MASTER_ADDR=... NNODES=N NODE_RANK=R $0 CONFIG [key.sub=value ...]" >&2
  exit 2
fi
exec "${MLMCLM_PYTHON:-python3}" -m torch.distributed.run \
  --nnodes "$NNODES" --node_rank "$NODE_RANK" --nproc_per_node "${GPUS:-8}" \
  --rdzv_backend c10d --rdzv_endpoint "$MASTER_ADDR:${MASTER_PORT:-29500}" \
  --rdzv_id "${RDZV_ID:-mlmclm}" \
  -m megatron_mlmclm pretrain "$@"
