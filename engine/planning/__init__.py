"""zero.planning: how many bytes a rank will hold and send, before and while training.

Owns: the model-state formulas of the paper (memory.py) and the measured report beside them,
the buffers and activations of a step (footprint.py), and `zero-estimate` (estimator.py), which
lays a model out with the partition core's own rules to count exactly.
May import: zero.partition and everything below it.
"""
