"""megatron_mlmclm: Megatron-Core pretraining of text encoders with MLM, CLM and CLM->MLM."""

__version__ = "0.20.0"  # CHANGELOG.md's newest release; pyproject.toml reads it from here
