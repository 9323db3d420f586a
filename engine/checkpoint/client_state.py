"""client_state in a checkpoint: nested dicts, lists and tuples of tensors, numbers, strings,
booleans and None, stored without pickle.

DeepSpeed pickles client_state with torch.save; programs put tensors in it (Lightning's
checkpoint dict: a callback's best score, a scheduler's state). zero stores it in meta.json: plain
JSON stays as it is, and a value JSON cannot hold unchanged is encoded:

    tensor                  {"$tensor": "<n>"}, its values in a safetensors blob
    tuple                   {"$tuple": [items]}
    inf, -inf, nan          {"$float": "inf"}
    dict with a key that    {"$items": [[key, value], ...]}; keys are encoded as values
      is not a string, or
      starts with "$"

and the top level becomes {"$value": <encoded>, "$tensors": <base64 of safetensors bytes>}
(safetensors holds dtype, shape and values only, so loading runs no code). Tensors come back on
the CPU, contiguous, each with storage of its own; dict subclasses come back as dicts. Anything
else (an arbitrary object) is refused when saving, naming where it is.
"""

import base64
import math

import torch
from safetensors.torch import load as load_safetensors
from safetensors.torch import save as save_safetensors

from .format import CheckpointError

_TENSOR, _TUPLE, _ITEMS, _FLOAT = "$tensor", "$tuple", "$items", "$float"
_VALUE, _TENSORS = "$value", "$tensors"


def encode(client_state) -> dict:
    """client_state as a dict JSON holds unchanged. Raises CheckpointError naming the first
    value it cannot hold (path like client_state['callbacks'][0]) and the fix."""
    tensors: dict[str, torch.Tensor] = {}
    special = []  # set when any value needed a marker
    encoded = _encode(dict(client_state), "client_state", tensors, special)
    if not special:
        return encoded
    blob = save_safetensors(tensors) if tensors else b""
    return {_VALUE: encoded, _TENSORS: base64.b64encode(blob).decode("ascii")}


def decode(stored: dict) -> dict:
    """What encode() was given, from meta.json's client_state. Raises CheckpointError for a
    damaged encoding."""
    if set(stored) != {_VALUE, _TENSORS}:
        return stored
    try:
        blob = base64.b64decode(stored[_TENSORS], validate=True)
        tensors = load_safetensors(blob) if blob else {}
        return _decode(stored[_VALUE], tensors)
    except (ValueError, KeyError, TypeError, IndexError) as error:
        raise CheckpointError(f"meta.json's client_state is damaged ({error!r})") from None


def _encode(value, where: str, tensors: dict, special: list):
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, list):
        return [_encode(v, f"{where}[{i}]", tensors, special) for i, v in enumerate(value)]
    if isinstance(value, dict) and all(isinstance(k, str) and k[:1] != "$" for k in value):
        return {k: _encode(v, f"{where}[{k!r}]", tensors, special) for k, v in value.items()}
    if isinstance(value, float) and math.isfinite(value):
        return value
    special.append(where)
    if isinstance(value, float):  # inf and nan, which strict JSON has no words for
        return {_FLOAT: repr(value)}
    if isinstance(value, torch.Tensor):
        return {_TENSOR: _add(value, tensors)}
    if isinstance(value, tuple):
        return {_TUPLE: _encode(list(value), where, tensors, special)}
    if isinstance(value, dict):
        keys = _encode(list(value), f"{where} keys", tensors, special)
        values = [_encode(v, f"{where}[{k!r}]", tensors, special) for k, v in value.items()]
        return {_ITEMS: [list(pair) for pair in zip(keys, values)]}
    raise CheckpointError(
        f"{where} is a {type(value).__name__}, which a checkpoint's client_state cannot hold "
        "(it is stored without pickle): use tensors, numbers, strings, booleans, None, and "
        "lists, tuples and dicts of them (a dataclass as a dict, an object as its state_dict())"
    )


def _add(tensor: torch.Tensor, tensors: dict) -> str:
    key = str(len(tensors))
    # Each its own storage: safetensors refuses tensors that share memory.
    tensors[key] = tensor.detach().to("cpu", copy=True).contiguous()
    return key


def _decode(value, tensors: dict):
    if isinstance(value, list):
        return [_decode(v, tensors) for v in value]
    if not isinstance(value, dict):
        return value
    marker = next(iter(value)) if len(value) == 1 else None
    if marker == _TENSOR:
        return tensors[value[_TENSOR]]
    if marker == _FLOAT:
        return float(value[_FLOAT])
    if marker == _TUPLE:
        return tuple(_decode(v, tensors) for v in value[_TUPLE])
    if marker == _ITEMS:
        return {_decode(k, tensors): _decode(v, tensors) for k, v in value[_ITEMS]}
    return {k: _decode(v, tensors) for k, v in value.items()}
