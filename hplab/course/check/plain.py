"""Plain data across the sandbox's wall. What the learner's process sends the checker is JSON:
numbers, strings, None, lists, tuples, dicts, sets, ranges, reduce ops and tensors (dtype, shape
and raw bytes). Never pickle: loading a pickle runs whatever code the object names in its
`__reduce__`, in the process that loads it.

So a value crosses as what it is worth, not as the object that claims it: an int subclass whose
`__eq__` says yes to everything arrives as its digits, a tensor subclass as its numbers, and
`unittest.mock.ANY`, which has no numbers at all, does not cross (NotPlain names it instead).

    data = encode(value)   # in the sandbox: bytes, or NotPlain
    value = decode(data)   # in the checker: plain Python values and plain CPU tensors
"""

from __future__ import annotations

import base64
import json
import math
import numbers

import torch
import torch.distributed as dist

#: Reduce ops a learner may pass to a collective (`op=dist.ReduceOp.SUM`), by name.
REDUCE_OPS = ("SUM", "AVG", "PRODUCT", "MIN", "MAX", "BAND", "BOR", "BXOR")


class NotPlain(TypeError):
    """A value with no plain form; the text names it, e.g. "a _ANY (<ANY>)"."""


def _named(value) -> str:
    try:
        shown = f"{value!r:.60}"
    except Exception:  # (a repr that raises is the learner's too)
        shown = "its repr raised"
    return f"a {type(value).__name__} ({shown})"


def _tensor(value: torch.Tensor) -> dict:
    """A tensor as dtype, shape and its bytes in base64: numbers only, no subclass, no autograd."""
    flat = value.detach().cpu().contiguous().reshape(-1)
    raw = flat.view(torch.uint8).numpy().tobytes()
    dtype = str(flat.dtype).removeprefix("torch.")
    return {"tensor": [dtype, list(value.shape), base64.b64encode(raw).decode("ascii")]}


def _reduce_op_name(value) -> str | None:
    """'SUM' for dist.ReduceOp.SUM (or its RedOpType), None for anything else."""
    name = getattr(value, "name", None)
    if type(value) in (dist.ReduceOp, dist.ReduceOp.RedOpType) and name in REDUCE_OPS:
        return name
    return None


def to_plain(value):
    """The JSON-ready form of `value` (in the sandbox). Tags say what JSON cannot: a tuple is
    {"tuple": [...]}, a dict {"dict": [[key, value], ...]} (any plain key), a tensor {"tensor":
    [dtype, shape, base64]}. Raises NotPlain for what has no plain form."""
    if value is None or isinstance(value, bool):
        return value
    if isinstance(value, int):
        return int(int.__repr__(value))  # its digits, whatever its class says of itself
    if isinstance(value, float):
        return float(float.__repr__(value))
    if isinstance(value, str):
        return str.__str__(value)
    if torch.is_tensor(value):
        return _tensor(value)
    if isinstance(value, numbers.Integral):  # numpy's integers
        return int(value)
    if isinstance(value, numbers.Real):  # numpy's floats
        return float(value)
    if isinstance(value, list):
        return [to_plain(v) for v in value]
    if isinstance(value, tuple):  # torch.Size and named tuples too
        return {"tuple": [to_plain(v) for v in value]}
    if isinstance(value, dict):
        return {"dict": [[to_plain(k), to_plain(v)] for k, v in value.items()]}
    if isinstance(value, frozenset):
        return {"frozenset": to_plain(list(value))}
    if isinstance(value, set):
        return {"set": to_plain(list(value))}
    if isinstance(value, range):
        return {"range": [value.start, value.stop, value.step]}
    if name := _reduce_op_name(value):
        return {"reduce_op": name}
    raise NotPlain(_named(value))


def encode(value) -> bytes:
    """`value` as JSON bytes (in the sandbox); NotPlain when some part of it is not plain."""
    try:
        return json.dumps(to_plain(value)).encode()
    except RecursionError:  # a list that holds itself
        raise NotPlain(_named(value)) from None


def _tensor_from(dtype_name: str, shape: list, text: str) -> torch.Tensor:
    dtype = getattr(torch, dtype_name, None)
    if not isinstance(dtype, torch.dtype) or not all(type(d) is int and d >= 0 for d in shape):
        raise ValueError(f"not a tensor: dtype {dtype_name!r}, shape {shape!r}")
    raw = bytearray(base64.b64decode(text, validate=True))
    if len(raw) != math.prod(shape) * dtype.itemsize:
        raise ValueError(f"a tensor of shape {shape} {dtype_name} does not hold {len(raw)} bytes")
    if not raw:
        return torch.empty(shape, dtype=dtype)
    return torch.frombuffer(raw, dtype=dtype).reshape(shape)


def from_plain(data):
    """The value `to_plain` described (in the checker): loading JSON runs no code of theirs."""
    if isinstance(data, list):
        return [from_plain(v) for v in data]
    if not isinstance(data, dict):
        return data  # None, bool, int, float, str: JSON's own
    ((tag, body),) = data.items()
    if tag == "tensor":
        return _tensor_from(*body)
    if tag == "tuple":
        return tuple(from_plain(v) for v in body)
    if tag == "dict":
        return {from_plain(k): from_plain(v) for k, v in body}
    if tag in ("set", "frozenset"):
        items = [from_plain(v) for v in body]
        return set(items) if tag == "set" else frozenset(items)
    if tag == "range":
        return range(*(int(i) for i in body))
    if tag == "reduce_op" and body in REDUCE_OPS:
        return getattr(dist.ReduceOp, body)
    raise ValueError(f"not plain data: {tag!r}")


def decode(data: bytes):
    """What `encode` sent, as plain values (in the checker)."""
    return from_plain(json.loads(data))
