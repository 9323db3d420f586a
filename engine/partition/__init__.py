"""zero.partition: the ZeRO-DP core, partitioning of model states over data-parallel ranks.

Owns: the flat layout of parameters in padded buckets (flat.py), the stage 0-2 optimizer wrapper
that reduce-scatters gradients and all-gathers parameters (stages.py), stage 3's fetch units
(units.py) and their all-gathers, releases and prefetch (gatherer.py, with its module hooks in
unit_hooks.py, its saved-tensor hooks in saved_weights.py, UsageGuard in usage_guard.py), its
frozen parameters' shards (frozen_shards.py), zero.Init, which partitions while a model is built
(init.py), and GatheredParameters (gathered.py), and the process groups of hierarchical
partitioning, MiCS and hpZ (hierarchy.py). shared.py holds what stages 0-2 and stage 3 both use;
ds_params.py DeepSpeed's attributes on partitioned parameters (ds_id, ds_status, ds_tensor, ...),
views of units.py's and init.py's state.
May import: zero.offload and everything below it.
"""
