"""Reading and writing a Hugging Face model directory without PyTorch.

A Hugging Face directory holds ``config.json`` and the weights in one of four layouts:
``model.safetensors``, sharded ``model-0000i-of-0000n.safetensors`` with
``model.safetensors.index.json``, ``pytorch_model.bin``, or sharded ``pytorch_model-*.bin`` with
``pytorch_model.bin.index.json``. Safetensors is read and written here directly (an 8-byte
header length, a JSON header of ``{name: {dtype, shape, data_offsets}}``, then raw
little-endian bytes), so converting needs neither ``torch`` nor the ``safetensors`` package;
bfloat16 comes from ``ml_dtypes`` (a JAX dependency). Only ``.bin`` files need ``torch``.
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Mapping

import ml_dtypes
import numpy as np

CONFIG_FILE = "config.json"
SAFETENSORS_FILE = "model.safetensors"
SAFETENSORS_INDEX = "model.safetensors.index.json"
TORCH_FILE = "pytorch_model.bin"
TORCH_INDEX = "pytorch_model.bin.index.json"

_DTYPES = {
    "F64": np.dtype(np.float64),
    "F32": np.dtype(np.float32),
    "F16": np.dtype(np.float16),
    "BF16": np.dtype(ml_dtypes.bfloat16),
    "I64": np.dtype(np.int64),
    "I32": np.dtype(np.int32),
    "I16": np.dtype(np.int16),
    "I8": np.dtype(np.int8),
    "U8": np.dtype(np.uint8),
    "BOOL": np.dtype(np.bool_),
}
_NAMES = {dtype: name for name, dtype in _DTYPES.items()}


class ConversionError(ValueError):
    """A checkpoint or config this project cannot convert exactly; the message says why."""


def read_config(directory: str) -> dict:
    """The parsed ``config.json`` of a Hugging Face model directory."""
    path = os.path.join(directory, CONFIG_FILE)
    if not os.path.isfile(path):
        raise FileNotFoundError(
            f"{directory!r} is not a Hugging Face model directory: {CONFIG_FILE} is missing "
            "(expected what save_pretrained writes: config.json and model.safetensors)"
        )
    try:
        with open(path, "rb") as f:
            data = json.loads(f.read().decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ConversionError(f"{path}: not valid JSON ({err}); the file is damaged or "
                              "truncated: download or save it again") from None
    if not isinstance(data, dict):
        raise ConversionError(f"{path}: expected a JSON object of config fields, got "
                              f"{type(data).__name__}")
    return data


def read_safetensors(path: str) -> dict[str, np.ndarray]:
    """All tensors of one ``.safetensors`` file as numpy arrays (memory-mapped, read-only)."""
    def damaged(why: str) -> ConversionError:
        return ConversionError(f"{path}: damaged safetensors file ({why}); download or save "
                               "it again")

    size = os.path.getsize(path)
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise damaged(f"{size} bytes, shorter than the 8-byte header length")
        (header_len,) = struct.unpack("<Q", head)
        if header_len > size - 8:
            raise damaged(f"header of {header_len} bytes announced, {size - 8} in the file")
        try:
            header = json.loads(f.read(header_len).decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as err:
            raise damaged(f"header is not valid JSON: {err}") from None
    if not isinstance(header, dict):
        raise damaged("header is not a JSON object")
    data_size = size - 8 - header_len
    data = np.memmap(path, dtype=np.uint8, mode="r", offset=8 + header_len) if data_size else (
        np.zeros(0, np.uint8))
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        if not isinstance(info, dict) or not {"dtype", "shape", "data_offsets"} <= set(info):
            raise damaged(f"tensor {name!r}: entry {info!r} lacks dtype, shape, data_offsets")
        if not isinstance(info["dtype"], str) or info["dtype"] not in _DTYPES:
            raise ConversionError(
                f"{path}: tensor {name!r} has dtype {info['dtype']}, which this reader does not "
                f"handle (known: {', '.join(_DTYPES)})"
            )
        shape, offsets = info["shape"], info["data_offsets"]
        if not (isinstance(shape, list) and all(_is_count(d) for d in shape)
                and isinstance(offsets, list) and len(offsets) == 2
                and all(_is_count(o) for o in offsets)):
            raise damaged(f"tensor {name!r}: shape {shape!r} or data_offsets {offsets!r} "
                          "are not lists of non-negative integers")
        begin, end = offsets
        dtype = _DTYPES[info["dtype"]].newbyteorder("<")
        want = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        if not begin <= end <= data_size or end - begin != want:
            raise damaged(f"tensor {name!r} of shape {shape} ({info['dtype']}, {want} bytes) "
                          f"has data_offsets {offsets} in {data_size} bytes of data")
        out[name] = data[begin:end].view(dtype).reshape(shape)
    return out


def _is_count(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def write_safetensors(path: str, tensors: Mapping[str, np.ndarray], metadata: dict | None = None):
    """Write ``tensors`` as one ``.safetensors`` file (what ``safetensors.torch.save_file`` reads).

    ``metadata`` defaults to ``{"format": "pt"}``, which ``transformers`` expects.
    """
    header: dict = {"__metadata__": dict(metadata or {"format": "pt"})}
    offset = 0
    arrays = []
    for name in sorted(tensors):
        array = np.ascontiguousarray(tensors[name])
        if array.dtype not in _NAMES:
            raise ConversionError(f"cannot write tensor {name!r} of dtype {array.dtype}")
        size = array.nbytes
        header[name] = {
            "dtype": _NAMES[array.dtype],
            "shape": list(array.shape),
            "data_offsets": [offset, offset + size],
        }
        offset += size
        arrays.append(array)
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)  # the data starts 8-byte aligned, as the reference writer does
    tmp = path + ".tmp"
    with open(tmp, "wb") as f:
        f.write(struct.pack("<Q", len(blob)))
        f.write(blob)
        for array in arrays:
            f.write(array.astype(array.dtype.newbyteorder("<"), copy=False).tobytes())
    os.replace(tmp, path)


def _read_torch_bin(path: str) -> dict[str, np.ndarray]:
    try:
        import torch
    except ImportError:
        raise ConversionError(
            f"{path} is a PyTorch pickle: reading it needs torch (pip install "
            "'transformers-jax[parity]'), or re-save the model with safe_serialization=True "
            "to get model.safetensors"
        ) from None
    state = torch.load(path, map_location="cpu", weights_only=True)
    out = {}
    for name, tensor in state.items():
        tensor = tensor.detach().contiguous()
        if tensor.dtype == torch.bfloat16:  # numpy has no bfloat16: reinterpret the bits
            out[name] = tensor.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
        else:
            out[name] = tensor.numpy()
    return out


def read_weights(directory: str) -> dict[str, np.ndarray]:
    """Every tensor of a Hugging Face checkpoint, by its state-dict name (numpy, source dtype)."""
    layouts = ((SAFETENSORS_INDEX, read_safetensors), (TORCH_INDEX, _read_torch_bin))
    for index_name, reader in layouts:
        index_path = os.path.join(directory, index_name)
        if os.path.isfile(index_path):
            with open(index_path) as f:
                shards = sorted(set(json.load(f)["weight_map"].values()))
            out: dict[str, np.ndarray] = {}
            for shard in shards:
                out.update(reader(os.path.join(directory, shard)))
            return out
    if os.path.isfile(os.path.join(directory, SAFETENSORS_FILE)):
        return read_safetensors(os.path.join(directory, SAFETENSORS_FILE))
    if os.path.isfile(os.path.join(directory, TORCH_FILE)):
        return _read_torch_bin(os.path.join(directory, TORCH_FILE))
    raise FileNotFoundError(
        f"no weights in {directory!r}: expected {SAFETENSORS_FILE}, {SAFETENSORS_INDEX}, "
        f"{TORCH_FILE} or {TORCH_INDEX}"
    )


def source_dtype(hf_config: dict, tensors: Mapping[str, np.ndarray]) -> str:
    """The checkpoint's floating dtype name (``dtype``/``torch_dtype`` in the config, else the
    first floating tensor's), as one of float32, bfloat16, float16."""
    name = hf_config.get("dtype") or hf_config.get("torch_dtype")
    if name in ("float32", "bfloat16", "float16"):
        return name
    for array in tensors.values():
        if array.dtype in (np.float32, np.float16, ml_dtypes.bfloat16):
            return str(np.dtype(array.dtype))
    return "float32"
