"""The one map from dtype names (as configs and command lines spell them) to torch dtypes."""

import torch

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}
