"""`engine.config.check_config`: a value no engine accepts fails before any model is touched, naming its field."""

from __future__ import annotations

from dataclasses import replace

import pytest

from wamrt.engine.config import EngineConfig, check_config


def test_defaults_pass():
    check_config(EngineConfig())


@pytest.mark.parametrize("field", ["compile_mode", "epilogues", "fp8_quantize", "head_epilogue", "vae_encode",
                                   "cfg_attention", "bucket_attention"])
def test_unknown_choice_names_the_field(field):
    with pytest.raises(ValueError, match=rf"^{field} must be one of .*got 'nonsense'"):
        check_config(replace(EngineConfig(), **{field: "nonsense"}))


@pytest.mark.parametrize(("changes", "message"), [
    (dict(prompt_bucket=-1), "prompt_bucket must be >= 0"),
    (dict(prompt_width=192), "prompt_width needs prompt_bucket > 0"),
    (dict(prompt_bucket=64, prompt_width=-64), "prompt_width needs prompt_bucket > 0 and must be >= 0"),
    (dict(prompt_bucket=64, batch_cfg=False), "prompt_bucket needs reuse_reasoner=True and batch_cfg=True"),
])
def test_prompt_bucket_rules(changes, message):
    with pytest.raises(ValueError, match=message):
        check_config(replace(EngineConfig(), **changes))
    check_config(replace(EngineConfig(), prompt_bucket=64, prompt_width=192))


def test_fp8_triton_gemms_names_the_field():
    check_config(replace(EngineConfig(), fp8_triton_gemms=("qkv", "out", "up", "down")))
    with pytest.raises(ValueError, match=r"^fp8_triton_gemms entries must be among .*got 'gate'"):
        check_config(replace(EngineConfig(), fp8_triton_gemms=("up", "gate")))
