"""sha256 manifest of an artifact folder: written last, checked first."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from .errors import ArtifactError, ArtifactIntegrityError, ArtifactMismatchError, ArtifactMissingFileError

MANIFEST_NAME = "manifest.json"
# Unlisted files with these suffixes are refused: the loader could otherwise be fed a stray shard.
_GUARDED_SUFFIXES = (".safetensors", ".json")


def sha256_file(path: Path) -> str:
    with path.open("rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def write_manifest(folder: Path) -> Path:
    files = sorted(p for p in folder.iterdir() if p.is_file() and p.name != MANIFEST_NAME)
    entries = {p.name: {"sha256": sha256_file(p), "bytes": p.stat().st_size} for p in files}
    out = folder / MANIFEST_NAME
    out.write_text(json.dumps({"algorithm": "sha256", "files": entries}, indent=2, sort_keys=True) + "\n")
    return out


def verify_manifest(folder: Path) -> dict[str, dict[str, object]]:
    """Check every listed file exists with its recorded size and hash; refuse unlisted shards/json."""
    path = folder / MANIFEST_NAME
    if not path.is_file():
        raise ArtifactMissingFileError(path, "manifest missing: not a wamrt artifact, or an incomplete copy")
    try:
        files = json.loads(path.read_text())["files"]
    except (OSError, json.JSONDecodeError, KeyError, TypeError) as e:
        raise ArtifactIntegrityError(path, f"unreadable manifest ({e})") from e
    for name, entry in files.items():
        if Path(name).name != name:  # plain file names only: no paths out of the folder
            raise ArtifactIntegrityError(path, f"manifest entry {name!r} is not a plain file name")
        f = folder / name
        if not f.is_file():
            raise ArtifactMissingFileError(f, "listed in manifest.json but missing")
        if f.stat().st_size != entry.get("bytes"):
            size = f.stat().st_size
            raise ArtifactIntegrityError(f, f"size {size} differs from manifest.json ({entry.get('bytes')})")
        if sha256_file(f) != entry.get("sha256"):
            raise ArtifactIntegrityError(f, "sha256 differs from manifest.json (file modified or corrupt)")
    for p in folder.iterdir():
        if p.is_file() and p.suffix in _GUARDED_SUFFIXES and p.name != MANIFEST_NAME and p.name not in files:
            raise ArtifactIntegrityError(p, "file is not listed in manifest.json")
    return files


def read_json(path: Path) -> dict:
    try:
        raw = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ArtifactMismatchError(path, f"cannot read JSON ({e})") from e
    if not isinstance(raw, dict):
        raise ArtifactMismatchError(path, "expected a JSON object")
    return raw


__all__ = ["MANIFEST_NAME", "ArtifactError", "read_json", "sha256_file", "verify_manifest", "write_manifest"]
