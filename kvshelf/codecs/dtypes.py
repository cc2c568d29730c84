"""Dtype names as headers write them (MLX names) and their safetensors / numpy counterparts.

Headers name dtypes by MLX name ("float32", "bfloat16", ...) so a header is readable without MLX; the safetensors
codes are what the file's own tensor table says, and numpy dtypes are how raw bytes become host arrays (bfloat16
travels as uint16 and is viewed back on the MLX side).
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from ..errors import InvalidCacheState

# name -> (mlx dtype, safetensors code, little-endian numpy dtype holding the same bytes); store/objects/chunkfile.py uses it too
_TABLE: dict[str, tuple[mx.Dtype, str, np.dtype]] = {
    "bool": (mx.bool_, "BOOL", np.dtype("?")),
    "uint8": (mx.uint8, "U8", np.dtype("u1")),
    "uint16": (mx.uint16, "U16", np.dtype("<u2")),
    "uint32": (mx.uint32, "U32", np.dtype("<u4")),
    "uint64": (mx.uint64, "U64", np.dtype("<u8")),
    "int8": (mx.int8, "I8", np.dtype("i1")),
    "int16": (mx.int16, "I16", np.dtype("<i2")),
    "int32": (mx.int32, "I32", np.dtype("<i4")),
    "int64": (mx.int64, "I64", np.dtype("<i8")),
    "float16": (mx.float16, "F16", np.dtype("<f2")),
    "bfloat16": (mx.bfloat16, "BF16", np.dtype("<u2")),
    "float32": (mx.float32, "F32", np.dtype("<f4")),
    "float64": (mx.float64, "F64", np.dtype("<f8")),
}
_BY_MLX = {mlx_dtype: name for name, (mlx_dtype, _, _) in _TABLE.items()}

DTYPE_NAMES = tuple(_TABLE)


def dtype_name(dtype: mx.Dtype) -> str:
    """The header name of an MLX dtype ("float32", "bfloat16", ...)."""
    try:
        return _BY_MLX[dtype]
    except KeyError:
        raise InvalidCacheState(f"dtype {dtype} cannot be persisted (supported: {', '.join(DTYPE_NAMES)})") from None


def is_known(name: str) -> bool:
    return name in _TABLE


def mlx_dtype(name: str) -> mx.Dtype:
    return _TABLE[name][0]


def safetensors_code(name: str) -> str:
    return _TABLE[name][1]


def numpy_dtype(name: str) -> np.dtype:
    return _TABLE[name][2]


def itemsize(name: str) -> int:
    return _TABLE[name][2].itemsize


def nbytes_of(name: str, shape: list[int] | tuple[int, ...]) -> int:
    count = 1
    for dim in shape:
        count *= dim
    return count * itemsize(name)


__all__ = ["DTYPE_NAMES", "dtype_name", "is_known", "mlx_dtype", "safetensors_code", "numpy_dtype", "itemsize", "nbytes_of"]
