"""The store's ``config`` file: format version, chunker and compression parameters.

Kept apart from repository.py so that the modules below the façade (reader, writer, ...)
can name the type (repo_view.py) without importing the façade.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from .chunking import ChunkerParams
from .errors import UnsupportedFormat

FORMAT = "infinijup-store"
VERSION = 2
ENCRYPTED_VERSION = 3  # an encrypted store (local_crypto.py); a plain store stays at 2
READABLE_VERSIONS = (1, 2, 3)
MAX_PACK = 512 << 20


@dataclass(frozen=True)
class StoreConfig:
    """The parameters fixed when a store is created (the ``config`` file)."""

    id: str
    chunker: ChunkerParams
    compression_level: int = 1
    min_saving: float = 0.05
    pack_size: int = 128 << 20
    version: int = VERSION
    page_deltas: bool = True  # store changed chunks as page deltas (version 2 only)
    encrypted: bool = False  # keyed ids, sealed objects, commits and refs (version 3)

    def to_json(self) -> bytes:
        """Encoding of the config file (always the current version)."""
        extra = {"encryption": "local_crypto 1"} if self.encrypted else {}
        return json.dumps({
            **extra,
            "format": FORMAT, "version": ENCRYPTED_VERSION if self.encrypted else VERSION,
            "id": self.id,
            "chunker": self.chunker.to_dict(),
            "compression": {"algorithm": "zstd", "level": self.compression_level,
                            "min_saving": self.min_saving},
            "pack_size": self.pack_size,
            "page_deltas": self.page_deltas,
        }, indent=2, sort_keys=True).encode() + b"\n"

    @classmethod
    def from_json(cls, data: bytes) -> StoreConfig:
        """Parse and validate a config file."""
        try:
            obj = json.loads(data)
            if obj.get("format") != FORMAT:
                raise UnsupportedFormat("not an infinijup store config")
            version = obj.get("version")
            if version not in READABLE_VERSIONS or isinstance(version, bool):
                raise UnsupportedFormat(
                    f"store format version {version!r} is not supported "
                    f"(this code reads versions {', '.join(map(str, READABLE_VERSIONS))})")
            comp = obj["compression"]
            if comp.get("algorithm") != "zstd":
                raise UnsupportedFormat(f"unknown compression {comp.get('algorithm')!r}")
            deltas = obj.get("page_deltas", False) if version >= 2 else False
            if not isinstance(deltas, bool):
                raise UnsupportedFormat("page_deltas must be true or false")
            encrypted = version == ENCRYPTED_VERSION
            if encrypted != (obj.get("encryption") == "local_crypto 1") or (
                    "encryption" in obj and not encrypted):
                raise UnsupportedFormat(f"store format {version} with encryption "
                                        f"{obj.get('encryption')!r} is not supported")
            cfg = cls(str(obj["id"]), ChunkerParams.from_dict(obj["chunker"]),
                      int(comp["level"]), float(comp["min_saving"]), int(obj["pack_size"]),
                      version, deltas, encrypted)
        except UnsupportedFormat:
            raise
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise UnsupportedFormat(f"store config is malformed: {exc}") from exc
        if not (0 < cfg.pack_size <= MAX_PACK):
            raise UnsupportedFormat(f"pack_size must be in (0, {MAX_PACK}]")
        return cfg


__all__ = ["ENCRYPTED_VERSION", "FORMAT", "MAX_PACK", "READABLE_VERSIONS", "VERSION", "StoreConfig"]
