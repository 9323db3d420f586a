"""zero.profiling: observers that measure what the model computes (DeepSpeed's
deepspeed.profiling).

Owns:
    flops_profiler.py  the FLOPs profiler: per-module parameters, MACs, FLOPs and forward
                       latency, counted with torch's FlopCounterMode; DeepSpeed's FlopsProfiler
                       and get_model_profile, and the `flops_profiler` block's report at
                       profile_step (StepProfile, which the engine attaches to its monitor)
May import: zero.checkpoint and everything below it (the monitor's layer; it uses only
zero.accelerator).
"""
