"""megatron_mlmclm: Megatron-Core pretraining of text encoders with MLM, CLM and CLM->MLM."""

__version__ = "0.1.0"
