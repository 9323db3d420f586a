"""zero: ZeRO distributed training for PyTorch."""
