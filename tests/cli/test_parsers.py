"""The `wamrt` parsers as a user meets them: fast, light (no torch to print help), every flag explained with its
default, `python -m wamrt`, and a missing extra named before the arguments are parsed."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

import pytest

from wamrt.cli import build_parser
from wamrt.cli.dispatch import HelpFormatter

HEAVY = ("torch", "diffusers", "transformers", "numpy", "msgpack", "uvicorn", "mujoco")


def _python(code: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONWARNINGS": "ignore"})


def _parsers(ap: argparse.ArgumentParser, path: str = "wamrt"):
    yield path, ap
    for action in ap._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, child in action.choices.items():
                yield from _parsers(child, f"{path} {name}")


def test_building_every_parser_imports_nothing_heavy():
    res = _python("import sys; from wamrt.cli import build_parser; build_parser(); "
                  f"print(sorted(m for m in {HEAVY!r} if m in sys.modules))")
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == "[]"


def test_help_answers_quickly():
    # The real guard is the test above; this one catches a slow path it cannot see (bound generous for a busy box).
    for argv in (["--help"], ["serve", "--help"]):
        best = float("inf")
        for _ in range(2):
            t0 = time.perf_counter()
            res = subprocess.run([sys.executable, "-m", "wamrt", *argv], capture_output=True, text=True, timeout=60)
            best = min(best, time.perf_counter() - t0)
            assert res.returncode == 0 and "usage: wamrt" in res.stdout, res.stderr
        assert best < 2.5, f"wamrt {' '.join(argv)} took {best:.2f} s"


def test_every_option_has_help_and_shows_its_default():
    formatter = HelpFormatter("wamrt")
    problems = []
    for path, ap in _parsers(build_parser()):
        assert ap.formatter_class is HelpFormatter, path
        for action in ap._actions:
            if isinstance(action, argparse._HelpAction | argparse._VersionAction | argparse._SubParsersAction):
                continue
            name = f"{path} {'/'.join(action.option_strings) or action.dest}"
            if not (action.help or "").strip():
                problems.append(f"{name}: no help")
            shown = action.default not in (None, False, [], argparse.SUPPRESS) and not action.required
            if action.option_strings and shown and "default" not in formatter._get_help_string(action).lower():
                problems.append(f"{name}: default {action.default!r} not shown")
    assert not problems, "\n".join(problems)


def test_python_dash_m_wamrt_runs_the_cli():
    from wamrt import __version__

    res = subprocess.run([sys.executable, "-m", "wamrt", "--version"], capture_output=True, text=True, timeout=60)
    assert res.returncode == 0 and res.stdout.strip() == f"wamrt {__version__}"


@pytest.mark.parametrize("blocked,argv,message", [
    ("uvicorn", ["serve", "--port", "8123"], "`wamrt serve` needs the server extra: pip install 'wamrt[server]'"),
    ("msgpack", ["generate", "--prompt", "p", "--out", "x.mp4"], "`wamrt generate` needs the server extra"),
    ("av", ["generate", "--prompt", "p", "--out", "x.mp4"], "`wamrt generate` needs the video extra: pip install "
                                                           "'wamrt[video]'"),
    ("mujoco", ["rollout", "--task", "lift"], "`wamrt rollout` needs the sim extra: pip install 'wamrt[sim]'"),
    ("pyarrow", ["export", "lerobot", "--demos", "d", "--out", "o"], "`wamrt export lerobot` needs the sim extra"),
])
def test_a_missing_extra_is_named_before_the_arguments_are_parsed(blocked, argv, message):
    # As after a plain `pip install .`: the module cannot be imported (sys.modules[name] = None blocks it).
    res = _python(f"import sys; sys.modules[{blocked!r}] = None; from wamrt.cli import main; "
                  "sys.exit(main(sys.argv[1:]))", *argv)
    assert res.returncode == 2
    assert message in res.stderr and f"missing: {blocked}" in res.stderr
    assert "unrecognized arguments" not in res.stderr and "OpenGL" not in res.stderr


def test_only_what_reads_or_writes_mp4_needs_pyav():
    # MP4 is optional for a server (a typed 501 on MP4 requests, tests/serving/test_dynamics.py); a policy server or
    # a load client on a machine without PyAV is not refused at the command line.
    # The simulator's commands (what the GPU jobs of the real-time grid run) do not need it either.
    needs_none = (["serve"], ["bench", "load"], ["rollout"], ["eval", "grid"], ["eval", "gate"], ["train", "record"])
    needs_av = (["generate"], ["demo"], ["export", "lerobot"])
    res = _python("import sys; sys.modules['av'] = None; from wamrt.cli.dispatch import missing_extra; "
                  f"print([missing_extra(a) for a in {[*needs_none, *needs_av]!r}])")
    assert res.returncode == 0, res.stderr
    found = eval(res.stdout)
    assert found[:len(needs_none)] == [None] * len(needs_none), found
    assert all("missing: av" in line for line in found[len(needs_none):]), found


def test_without_mujoco_the_simulator_names_mujoco_not_opengl():
    # Past the CLI's own check (a direct call): wamrt.sim's GL probe would fail for want of mujoco and blame OpenGL.
    res = _python("import sys; sys.modules['mujoco'] = None; from wamrt.cli.sim import _sim_problem; "
                  "print(_sim_problem())")
    assert res.returncode == 0, res.stderr
    assert "mujoco" in res.stdout and "wamrt[sim]" in res.stdout and "OpenGL" not in res.stdout


def test_parser_tables_match_the_code_they_stand_for():
    # The parsers repeat a few defaults and choices so that they stay light; these are the originals.
    from wamrt.cli import bench, quantize, serve
    from wamrt.engine.epilogues import EPILOGUES
    from wamrt.parallel import MODES
    from wamrt.quant.recipes import RECIPES
    from wamrt.serving.config import ATTENTION_CHOICES, EPILOGUE_CHOICES, ServeConfig
    from wamrt.serving.generation_settings import SAMPLER_CHOICES
    from wamrt.serving.server import config_from_args

    assert config_from_args(build_parser().parse_args(["serve"])) == ServeConfig()  # every default, field by field
    assert (serve.ATTENTION_CHOICES, serve.EPILOGUE_CHOICES) == (ATTENTION_CHOICES, EPILOGUE_CHOICES)
    assert serve.SAMPLER_CHOICES == SAMPLER_CHOICES and bench.EPILOGUES == EPILOGUES
    assert serve.PARALLEL_CHOICES == ("none", *MODES)
    assert quantize.RECIPES == tuple(sorted(RECIPES))
    from wamrt.cli import realtime
    from wamrt.client import realtime as runner
    from wamrt.eval.grid import GRID_STRATEGIES

    assert (realtime.STRATEGIES, realtime.PREFIX_MODES) == (runner.STRATEGIES, runner.PREFIX_MODES)
    assert realtime.GRID_STRATEGY_NAMES == tuple(GRID_STRATEGIES)
