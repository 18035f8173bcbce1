"""What every `wamrt` parser shares: the help formatter that shows defaults, entry points imported when their
command runs, and the check that names a missing extra before any argument is parsed."""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import sys
from collections.abc import Callable, Sequence

# Import names a command needs, by the extra that installs them (pyproject's optional-dependencies).
EXTRA_MODULES = {
    # PyAV is in the server and sim extras, but only what writes or reads MP4 asks for it: a server without it
    # still serves policies, images and chat (MP4 requests get a typed 501, `serving.media.require_pyav`), and
    # rollouts, gates, grids and demo recording never touch it (the H200's image has no PyAV).
    "server": ("uvicorn", "starlette", "websockets", "msgpack", "prometheus_client"),
    "sim": ("mujoco", "pyarrow", "pandas"),
    "video": ("av",),
}
# Command path (the leading positional words) -> the extras it needs.
COMMAND_EXTRAS: dict[tuple[str, ...], tuple[str, ...]] = {
    ("serve",): ("server",),
    ("generate",): ("server", "video"),
    ("bench", "load"): ("server",),
    ("bench", "soak"): ("server",),
    ("demo",): ("server", "sim", "video"),  # it writes the first episode's MP4
    ("rollout",): ("sim",),
    ("eval", "gate"): ("sim",),
    ("eval", "grid"): ("sim",),
    ("demos", "record"): ("sim",),
    ("export", "lerobot"): ("sim", "video"),
    ("train", "record"): ("sim",),
}


class HelpFormatter(argparse.HelpFormatter):
    """Every option's help ends with its default, unless the text already says it or there is none to show
    (None, a flag's False, a required option)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        default = action.default
        if (not action.option_strings or action.required or default in (None, False, argparse.SUPPRESS)
                or default == [] or "default" in text.lower()):
            return text
        if isinstance(default, list | tuple):
            default = " ".join(str(v) for v in default)
        return f"{text} (default: {str(default).replace('%', '%%')})"


class Parser(argparse.ArgumentParser):
    """`argparse.ArgumentParser` with `HelpFormatter`; subparsers inherit the class, hence the formatter."""

    def __init__(self, *args, **kwargs) -> None:
        kwargs.setdefault("formatter_class", HelpFormatter)
        super().__init__(*args, **kwargs)


def lazy(target: str) -> Callable[[argparse.Namespace], int]:
    """The entry point 'package.module:function', imported only when its command runs."""
    module, _, name = target.partition(":")

    def run(args: argparse.Namespace) -> int:
        return getattr(importlib.import_module(module), name)(args)

    run.__qualname__ = run.__name__ = f"lazy({target})"
    return run


def command_path(argv: Sequence[str]) -> tuple[str, ...]:
    """The leading positional words of a command line: ('bench', 'load') for `bench load --url ...`."""
    words: list[str] = []
    for token in argv:
        if token.startswith("-"):
            break
        words.append(token)
    return tuple(words)


def missing_modules(modules: Sequence[str]) -> list[str]:
    """Those of `modules` that cannot be imported (not installed, or blocked with sys.modules[name] = None),
    found without importing them."""
    missing = []
    for name in modules:
        if name in sys.modules:
            if sys.modules[name] is None:
                missing.append(name)
            continue
        try:
            found = importlib.util.find_spec(name) is not None
        except (ImportError, ValueError):
            found = False
        if not found:
            missing.append(name)
    return missing


def missing_extra(argv: Sequence[str]) -> str | None:
    """One line naming the extra (and its missing packages) that the command of `argv` needs, or None."""
    path = command_path(argv)
    for n in range(len(path), 0, -1):
        for extra in COMMAND_EXTRAS.get(path[:n], ()):
            if missing := missing_modules(EXTRA_MODULES[extra]):
                return (f"`wamrt {' '.join(path[:n])}` needs the {extra} extra: pip install 'wamrt[{extra}]' "
                        f"(missing: {', '.join(missing)})")
    return None
