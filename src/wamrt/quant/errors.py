"""Typed errors of `wamrt.quant`. Artifact errors carry the file they are about, so a refusal can say
which file to look at."""

from __future__ import annotations

from pathlib import Path


class RecipeError(ValueError):
    """An unknown recipe name, or a recipe whose rules would quantize a protected module."""


class ArtifactError(ValueError):
    """A quantized artifact that cannot be loaded; `file` names the offending file."""

    def __init__(self, file: str | Path, message: str) -> None:
        self.file = Path(file)
        super().__init__(f"{self.file}: {message}")


class ArtifactMissingFileError(ArtifactError):
    """A file the manifest lists is absent (or the manifest itself is)."""


class ArtifactIntegrityError(ArtifactError):
    """A file whose sha256 differs from the manifest's, or a file the manifest does not list."""


class ArtifactMismatchError(ArtifactError):
    """Files that are intact but disagree with each other (recipe vs config vs tensors)."""
