# megatron_mlmclm on NVIDIA's NGC PyTorch image, which ships CUDA, NCCL, Transformer Engine, Apex
# and DALI. A run takes Transformer Engine's layer spec, fused attention and FusedAdam (and FP8)
# only with `model.kernels: te`; by default it runs the path measured on GPUs (docs/gpu.md).
#
# Written against the nvcr.io/nvidia/pytorch:25.12-py3 release notes (Python 3.12, CUDA 13.1,
# PyTorch 2.10). It has never been built: the project's development machines have no Docker engine
# (docs/gpu.md says what has run on a GPU, outside any image). It is kept deliberately simple:
# install the package, keep the image's own torch (the image's pip constraint file pins it), and
# pin megatron-core to the 0.16.1 that mcore_patches/registry.yaml was checked against (pyproject.toml;
# every run verifies it).
#
#   docker build -t megatron-mlmclm .
#   docker run --gpus all --ipc=host -v $PWD/data:/data -e MLMCLM_DATA_DIR=/data megatron-mlmclm \
#       torchrun --standalone --nproc_per_node 8 -m megatron_mlmclm pretrain examples/configs/210m.yaml
#   docker run --gpus all --ipc=host --rm megatron-mlmclm make test-gpu   # the GPU tier, first
#
# The install below is what runs: start a container outside any host checkout of this repository
# (pyxis: --container-workdir=$STUDY_DIR, docs/cluster.md). `python -m megatron_mlmclm` run from a
# checkout imports that checkout instead, and its C++ extension (git-ignored, excluded below by
# .dockerignore) is not built for this image's Python: `pretrain` then stops at once with one line.
# MLMCLM_DATA_DIR is not set in the image: pyxis gives an image's variables precedence over the
# job's, and the jobs set it (docs/cluster.md).
ARG BASE=nvcr.io/nvidia/pytorch:25.12-py3
FROM ${BASE}

WORKDIR /workspace/megatron_mlmclm
COPY . .

# The image's torch satisfies "torch>=2.6", so pip keeps it; megatron-core is pinned in pyproject.
# The check runs from / : the installed package, with its extension, not the working directory.
RUN python -m pip install --no-cache-dir -e ".[eval,test]" "megatron-core==0.16.1" \
 && cd / && python -c "import megatron_mlmclm._sample_index, megatron.core, transformer_engine"

ENV PYTHONUNBUFFERED=1

CMD ["mlmclm", "--help"]
