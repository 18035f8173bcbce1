"""The package version, in one place: pyproject.toml reads it (setuptools' dynamic version) and `wamrt.__version__`
re-exports it. Bump it here; CHANGELOG.md says what each version holds."""

__version__ = "0.2.0.dev0"
