"""Generation through the engine: engine.generate(...) calls the model's own generate(), with
the one argument stage 3 needs (DeepSpeed's engine reaches generate() through __getattr__).

[Note: synced decoding at stage 3]
Every decoding step all-gathers the parameters, so at stage 3 with more than one rank each rank
must run as many forwards as the others: a rank whose sequences finish first keeps stepping
until every rank has. Hugging Face's generate() does that with synced_gpus=True, which
transformers turns on by itself only under DeepSpeed's HfDeepSpeedConfig; zero passes it
unless the caller did (a model's generate() that cannot take it is left alone). An explicit
synced_gpus=False at stage 3 is refused by the ParamGatherer at the first unsynced step
(partition/usage_guard.py).
"""

import inspect


def generate(module, synced: bool, args: tuple, kwargs: dict):
    """module.generate(*args, **kwargs), with synced_gpus=True added when `synced` (stage 3 on
    more than one rank) and the caller did not pass synced_gpus."""
    method = module.generate
    if synced and "synced_gpus" not in kwargs:
        try:
            params = inspect.signature(method).parameters.values()
        except (TypeError, ValueError):  # not introspectable: assume transformers' keywords
            params = [inspect.Parameter("synced_gpus", inspect.Parameter.KEYWORD_ONLY)]
        if any(p.name == "synced_gpus" or p.kind is p.VAR_KEYWORD for p in params):
            kwargs = {**kwargs, "synced_gpus": True}
    return method(*args, **kwargs)
