"""The dtype tables: what a checkpoint stores, safetensors' codes, and names users type."""

from __future__ import annotations

import torch

# Every dtype a checkpoint can hold, by the name the index records (``str(dtype)`` less
# ``torch.``), with its safetensors code.
STORED: dict[str, tuple[torch.dtype, str]] = {
    "float64": (torch.float64, "F64"),
    "float32": (torch.float32, "F32"),
    "float16": (torch.float16, "F16"),
    "bfloat16": (torch.bfloat16, "BF16"),
    "int64": (torch.int64, "I64"),
    "int32": (torch.int32, "I32"),
    "int16": (torch.int16, "I16"),
    "int8": (torch.int8, "I8"),
    "uint8": (torch.uint8, "U8"),
    "bool": (torch.bool, "BOOL"),
}
BY_NAME: dict[str, torch.dtype] = {name: dtype for name, (dtype, _) in STORED.items()}
SAFETENSORS_CODES: dict[torch.dtype, str] = {dtype: code for dtype, code in STORED.values()}

# Floating dtypes a user may name for a conversion (``--dtype bf16``), aliases included.
FLOAT_ALIASES: dict[str, torch.dtype] = {
    "bf16": torch.bfloat16,
    "bfloat16": torch.bfloat16,
    "fp16": torch.float16,
    "float16": torch.float16,
    "half": torch.float16,
    "fp32": torch.float32,
    "float32": torch.float32,
    "float": torch.float32,
}
