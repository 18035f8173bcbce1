"""The Python API explains itself: dir()/help() list the lazy names, the public callables are documented and
typed, and a misspelled keyword or observation key says what was meant."""

from __future__ import annotations

import dataclasses
import pydoc
import subprocess
import sys
import typing

import numpy as np
import pytest

import wamrt
from wamrt.pipeline.denoise import SamplingOverrides, UnknownOptionError
from wamrt.sample import sample_observation


def test_dir_and_help_list_the_lazy_names() -> None:
    names = [n for n in dir(wamrt) if not n.startswith("_")]
    assert names == sorted(wamrt.__all__)
    text = pydoc.render_doc(wamrt, renderer=pydoc.plaintext)
    for needle in ("load_policy(path_or_name", "class ActionChunk", "class SamplingOptions", "class Policy"):
        assert needle in text, needle
    # Listing the names imports nothing heavy.
    code = "import sys, wamrt; dir(wamrt); assert 'torch' not in sys.modules and 'diffusers' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_public_callables_are_documented_and_typed() -> None:
    for obj in (wamrt.load_policy, wamrt.Policy.infer, wamrt.SamplingOptions, wamrt.ActionChunk):
        assert obj.__doc__ and len(obj.__doc__.split()) > 20, obj
    options = [f.name for f in dataclasses.fields(wamrt.SamplingOptions)]
    assert list(typing.get_type_hints(SamplingOverrides)) == options  # the keyword overrides cover every option
    hints = typing.get_type_hints(wamrt.Policy.infer, include_extras=True)
    assert hints["overrides"] == typing.Unpack[SamplingOverrides] and hints["return"] is wamrt.ActionChunk


@pytest.fixture(scope="module")
def policy(tmp_path_factory):
    mp = pytest.MonkeyPatch()
    mp.setenv("WAMRT_CACHE", str(tmp_path_factory.mktemp("cache")))
    yield wamrt.load_policy("tiny-droid", device="cpu")
    mp.undo()


def test_unknown_keyword_says_did_you_mean(policy) -> None:
    for call in (lambda: policy.infer(sample_observation(), step=2),
                 lambda: policy.infer_batch([sample_observation()], step=2)):
        with pytest.raises(UnknownOptionError) as err:
            call()
        assert isinstance(err.value, TypeError) and isinstance(err.value, wamrt.RequestError)
        assert err.value.field == "step" and "did you mean 'steps'?" in str(err.value)
        assert "\n" not in str(err.value)


def test_misspelled_observation_key_says_did_you_mean(policy) -> None:
    obs = sample_observation()
    obs["observation/gripper_postion"] = obs.pop("observation/gripper_position")
    with pytest.raises(wamrt.RequestError) as err:
        policy.infer(obs)
    assert err.value.field == "observation/gripper_position"
    assert "did you mean 'observation/gripper_position'?" in str(err.value)
    # An extra key that is close to a known one is ignored and said, with the likely meaning.
    extra = {**sample_observation(), "observation/exterior_image_2_lef": np.zeros((8, 8, 3), np.uint8)}
    chunk = policy.infer(extra, seed=0, steps=1)
    assert any("did you mean 'observation/exterior_image_2_left'?" in n for n in chunk.notes), chunk.notes
