"""zero.offload: optimizer state and parameters outside device memory (ZeRO-Offload/Infinity).

Owns: the NVMe swap store and the partial optimizer offload (nvme.py) and stage 3's parameter
swap to NVMe (param_swap.py). The CPU optimizer kernels are zero.ops.
May import: zero.model_parallel and everything below it, zero.ops.
"""
