"""zero.zero: DeepSpeed's deepspeed.zero namespace, so `import zero as deepspeed` scripts that
call deepspeed.zero.Init and deepspeed.zero.GatheredParameters find them. The same objects as
zero.Init and zero.GatheredParameters."""

from .gathered import GatheredParameters
from .init import Init

__all__ = ["GatheredParameters", "Init"]
