"""megatron_mlmclm: Megatron-Core pretraining of text encoders with MLM, CLM and CLM->MLM."""

from megatron_mlmclm import megatron_jit

__version__ = "0.20.0"  # CHANGELOG.md's newest release; pyproject.toml reads it from here

megatron_jit.install()  # before any module of ours imports megatron-core
