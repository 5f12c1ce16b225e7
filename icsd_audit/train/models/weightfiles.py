"""Checks of the files a model, adapter or checkpoint folder holds, before any library parses them.

Transformers, peft and safetensors trust their inputs: a safetensors header that claims
2**60 bytes, offsets past the end of the file, an unknown dtype, a weight file that is a
symlink to some other file, or a ``config.json`` nested 100,000 levels deep end in a
traceback (or an allocation that takes the machine) deep inside them. :func:`check_folder`
reads only headers and small JSON files, without torch, and raises :class:`WeightFileError`
(one line naming the file) on the first thing that is not what a model folder holds.
"""

from __future__ import annotations

import json
import math
import os
import struct
from pathlib import Path
from typing import Any

__all__ = ["WeightFileError", "MAX_JSON_DEPTH", "MAX_HEADER_BYTES", "read_json", "check_plain", "safetensors_header",
           "check_folder"]

#: deepest nesting of any JSON file icsd reads from a model or run folder (real ones stay below 10)
MAX_JSON_DEPTH = 64
#: largest safetensors header accepted (a 70B model's index of ~1,000 tensors is under 200 kB)
MAX_HEADER_BYTES = 100 * 2**20
#: largest small JSON file read (config.json, adapter_config.json, trainer_state.json)
MAX_JSON_BYTES = 256 * 2**20
#: safetensors dtype -> bytes per element (the format's full list)
DTYPE_BYTES = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E5M2": 1, "F8_E4M3": 1, "F8_E8M0": 1, "I16": 2, "U16": 2, "F16": 2,
               "BF16": 2, "I32": 4, "U32": 4, "F32": 4, "I64": 8, "U64": 8, "F64": 8, "C64": 8, "F4": 1, "F6_E2M3": 1,
               "F6_E3M2": 1}


class WeightFileError(ValueError):
    """A file of a model, adapter or checkpoint folder that is not what it claims: one line naming it."""


def _regular(path: Path) -> Path:
    """``path`` itself, refused unless it is (or links to) a regular file."""
    if not path.is_file():
        target = f" (a link to {os.path.realpath(path)})" if path.is_symlink() else ""
        raise WeightFileError(f"{path}: not a regular file{target}")
    return path


def check_plain(value: Any, where: Path, *, field: str = "") -> None:
    """Refuse JSON nested deeper than :data:`MAX_JSON_DEPTH` or holding a number that is not finite.

    The message names the file and the field (``next_step``, ``optimizer.param_groups.0.lr``).
    """
    todo: list[tuple[Any, str, int]] = [(value, field, 0)]
    while todo:
        v, path, depth = todo.pop()
        if depth > MAX_JSON_DEPTH:
            raise WeightFileError(f"{where}: nested more than {MAX_JSON_DEPTH} levels deep at {path or 'the top'}")
        if isinstance(v, float) and not math.isfinite(v):
            raise WeightFileError(f"{where}: {path or 'the value'} is {v!r}, not a finite number")
        if isinstance(v, dict):
            todo.extend((x, f"{path}.{k}" if path else str(k), depth + 1) for k, x in v.items())
        elif isinstance(v, list):
            todo.extend((x, f"{path}.{i}" if path else str(i), depth + 1) for i, x in enumerate(v))


def read_json(path: str | Path, *, what: str = "JSON file") -> Any:
    """A small JSON file, refused in one line when unreadable, too large, too deep or not finite."""
    f = _regular(Path(path))
    size = f.stat().st_size
    if size > MAX_JSON_BYTES:
        raise WeightFileError(f"{f}: {size} bytes is too large for a {what} (at most {MAX_JSON_BYTES})")
    try:
        doc = json.loads(f.read_bytes().decode("utf-8"))
    except RecursionError:
        raise WeightFileError(f"{f}: nested too deeply to read (more than {MAX_JSON_DEPTH} levels); "
                              f"not a {what}") from None
    except (ValueError, UnicodeDecodeError) as exc:
        raise WeightFileError(f"{f}: not a valid {what} ({' '.join(str(exc).split())[:160]})") from None
    check_plain(doc, f)
    return doc


def safetensors_header(path: str | Path) -> dict[str, Any]:
    """The tensor entries of a safetensors file (name -> dtype, shape, data_offsets), each checked against the file.

    Refused: a header length past the file or above :data:`MAX_HEADER_BYTES`, a header
    that is not a JSON object, an unknown dtype, a shape that is not a list of integers
    >= 0, and offsets that are out of range or do not hold exactly the shape's bytes.
    """
    f = _regular(Path(path))
    size = f.stat().st_size
    with f.open("rb") as fh:
        head = fh.read(8)
        if len(head) < 8:
            raise WeightFileError(f"{f}: {size} bytes is too short for a safetensors file")
        (n,) = struct.unpack("<Q", head)
        if n > min(MAX_HEADER_BYTES, size - 8):
            raise WeightFileError(f"{f}: not a safetensors file: its header claims {n} bytes, the file holds {size - 8}")
        raw = fh.read(n)
    try:
        header = json.loads(raw.decode("utf-8"))
    except RecursionError:
        raise WeightFileError(f"{f}: not a safetensors file: its header is nested too deeply") from None
    except (ValueError, UnicodeDecodeError):
        raise WeightFileError(f"{f}: not a safetensors file: its header is not JSON") from None
    if not isinstance(header, dict):
        raise WeightFileError(f"{f}: not a safetensors file: its header is not a JSON object")
    body = size - 8 - n
    tensors = {k: v for k, v in header.items() if k != "__metadata__"}
    for name, e in tensors.items():
        if not isinstance(e, dict):
            raise WeightFileError(f"{f}: tensor {name!r}: its entry is not an object")
        dtype, shape, offs = e.get("dtype"), e.get("shape"), e.get("data_offsets")
        if dtype not in DTYPE_BYTES:
            raise WeightFileError(f"{f}: tensor {name!r} has dtype {dtype!r}, not a safetensors dtype")
        if not (isinstance(shape, list) and all(isinstance(d, int) and not isinstance(d, bool) and d >= 0
                                                for d in shape)):
            raise WeightFileError(f"{f}: tensor {name!r} has shape {shape!r}, not a list of integers >= 0")
        if not (isinstance(offs, list) and len(offs) == 2 and all(isinstance(o, int) and not isinstance(o, bool)
                                                                   for o in offs) and 0 <= offs[0] <= offs[1] <= body):
            raise WeightFileError(f"{f}: tensor {name!r} has data_offsets {offs!r} outside the file's {body} data bytes")
        if offs[1] - offs[0] != math.prod(shape) * DTYPE_BYTES[dtype]:
            raise WeightFileError(f"{f}: tensor {name!r}: data_offsets {offs} hold {offs[1] - offs[0]} bytes, "
                                  f"its shape {shape} of {dtype} needs {math.prod(shape) * DTYPE_BYTES[dtype]}")
    return tensors


def check_folder(folder: str | Path) -> None:
    """Check every safetensors file and JSON config of a model, adapter or checkpoint folder (see the module doc)."""
    d = Path(folder)
    for name in ("config.json", "adapter_config.json", "icsd_adapter.json", "generation_config.json",
                 "model.safetensors.index.json"):
        if os.path.lexists(d / name):
            doc = read_json(d / name, what=name)
            if not isinstance(doc, dict):
                raise WeightFileError(f"{d / name}: not a JSON object")
    for f in sorted(d.glob("*.safetensors")):
        safetensors_header(f)
