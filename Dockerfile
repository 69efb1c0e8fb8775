# megatron_mlmclm on NVIDIA's NGC PyTorch image, which ships CUDA, NCCL, Transformer Engine, Apex
# and DALI: the engine picks up Transformer Engine's layer spec (bf16/FP8, fused attention) and
# Apex/TE fused optimizers automatically.
#
# Written against the nvcr.io/nvidia/pytorch:25.01-py3 release notes (Python 3.12, PyTorch 2.6,
# Transformer Engine 1.14). It cannot be built on the CPU-only development machines of this project
# (no Docker engine there), so it is kept deliberately simple: install the package, keep the
# image's own torch.
#
#   docker build -t megatron-mlmclm .
#   docker run --gpus all --ipc=host -v $PWD/data:/data megatron-mlmclm \
#       torchrun --standalone --nproc_per_node 8 -m megatron_mlmclm pretrain examples/configs/210m.yaml
#   docker run --gpus all megatron-mlmclm python -m pytest -q      # the test suite, inside
ARG BASE=nvcr.io/nvidia/pytorch:25.01-py3
FROM ${BASE}

WORKDIR /workspace/megatron_mlmclm
COPY . .

# The image's torch satisfies "torch>=2.6", so pip keeps it; megatron-core is pinned in pyproject.
RUN python -m pip install --no-cache-dir -e ".[eval,test]" \
 && python -c "import megatron_mlmclm._sample_index, megatron.core, transformer_engine"

ENV MLMCLM_DATA_DIR=/data \
    PYTHONUNBUFFERED=1

CMD ["mlmclm", "--help"]
