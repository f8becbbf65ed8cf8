"""Reading DCP checkpoints without unpickling arbitrary objects.

DCP's .metadata file is a pickle; this reader unpickles it with an allow-list of DCP's own
metadata classes and refuses "bytes" entries (DCP would torch.load those with
weights_only=False). titanlite saves only tensors, so any such entry is a crafted checkpoint.
"""

from __future__ import annotations

import pickle
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader

_ALLOWED_GLOBALS = {
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("pathlib", "PosixPath"),
    ("pathlib", "PurePosixPath"),
    ("pathlib._local", "PosixPath"),  # where the class lives on Python 3.13+
    ("collections", "OrderedDict"),
}


class _MetadataUnpickler(pickle.Unpickler):
    """Unpickles DCP's .metadata but refuses any class outside DCP's own metadata types."""

    def find_class(self, module: str, name: str) -> Any:
        allowed = (
            (module, name) in _ALLOWED_GLOBALS
            or module == "torch.distributed.checkpoint.metadata"
            or (module == "torch" and isinstance(getattr(torch, name, None), torch.dtype))
        )
        if not allowed:
            raise pickle.UnpicklingError(f"refusing to load {module}.{name}")
        return super().find_class(module, name)


class SafeFileSystemReader(FileSystemReader):
    def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
        path = Path(self.path) / ".metadata"
        with open(path, "rb") as f:
            metadata = _MetadataUnpickler(f).load()
        from torch.distributed.checkpoint.metadata import BytesStorageMetadata

        for fqn, md in metadata.state_dict_metadata.items():
            if isinstance(md, BytesStorageMetadata):
                raise pickle.UnpicklingError(f"refusing to load pickled object {fqn!r}")
        if getattr(metadata, "storage_meta", None) is None:
            from torch.distributed.checkpoint.metadata import StorageMeta

            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata
