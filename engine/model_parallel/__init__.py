"""zero.model_parallel: tensor parallelism and ZeRO-R's activation checkpointing.

Owns: the model-parallel groups (mpu.py, Megatron's mpu interface), column- and row-parallel
layers (tensor_parallel.py), and activation checkpointing with partitioned (Pa), CPU-offloaded
(Pa+cpu) and contiguous (MD) checkpoints (activation.py, DeepSpeed's deepspeed.checkpointing).
May import: zero.optim and everything below it.
"""
