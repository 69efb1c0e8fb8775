"""`python -m megatron_mlmclm ...` is the same as `mlmclm ...` (handy under torchrun)."""

from megatron_mlmclm.cli import entry

if __name__ == "__main__":
    entry()
