"""`build_layer_path`: which code runs each piece of a Generator pass. (That the pieces compute the reference
pass is the engine tests' subject: test_engine_cpu.py, and the GPU tests for the compiled and captured forms.)"""

from __future__ import annotations

import os

import pytest
import torch

from wamrt.engine import EngineConfig
from wamrt.engine.fuse import FusedGeneratorQKV
from wamrt.engine.layer_path import CUBLASLT_WORKSPACE_ENV, build_layer_path, use_workspace_free_gemms
from wamrt.pipeline.policy import random_policy


def test_refusal_leaves_the_shared_model_untouched() -> None:
    policy = random_policy("tiny-qwen", torch.device("cpu"), torch.float32, tiny_vae=True)
    with pytest.raises(ValueError, match="epilogues='quack' needs quack-kernels"):
        build_layer_path(policy.model, EngineConfig(compile=True, cuda_graph=False, epilogues="quack"),
                         torch.device("cpu"))
    assert not any(isinstance(layer.self_attn, FusedGeneratorQKV) for layer in policy.model.layers)


def test_resolved_choices_off_cuda() -> None:
    policy = random_policy("tiny-qwen", torch.device("cpu"), torch.float32, tiny_vae=True)
    path = build_layer_path(policy.model, EngineConfig(compile=False, cuda_graph=False), torch.device("cpu"))
    assert path.head_epilogue == "inductor"  # "auto" without CUDA
    assert path.fp8_triton_gemms == () and path.fp8_fast_accum is False  # unquantized weights: no fused gen-fp8 layer
    with pytest.raises(ValueError, match="head_epilogue='triton' cannot serve this model here: .*CUDA"):
        build_layer_path(policy.model, EngineConfig(compile=False, cuda_graph=False, head_epilogue="triton"),
                         torch.device("cpu"))


def test_workspace_free_gemms_only_lowers_and_respects_a_named_size(monkeypatch) -> None:
    monkeypatch.delenv(CUBLASLT_WORKSPACE_ENV, raising=False)
    assert use_workspace_free_gemms() is True
    assert os.environ[CUBLASLT_WORKSPACE_ENV] == "0"
    assert use_workspace_free_gemms() is False  # already 0
    monkeypatch.setenv(CUBLASLT_WORKSPACE_ENV, "4096")  # named by whoever runs the process: it holds
    assert use_workspace_free_gemms() is False
    assert os.environ[CUBLASLT_WORKSPACE_ENV] == "4096"


def test_cpu_engine_leaves_the_cublaslt_environment_alone(monkeypatch) -> None:
    from wamrt.engine import Engine

    monkeypatch.delenv(CUBLASLT_WORKSPACE_ENV, raising=False)
    policy = random_policy("tiny-qwen", torch.device("cpu"), torch.float32, tiny_vae=True)
    engine = Engine.from_policy(policy, EngineConfig(compile=False, cuda_graph=False))
    assert engine.config.workspace_free_gemms  # the default
    assert CUBLASLT_WORKSPACE_ENV not in os.environ
    meta = engine.metadata()["engine"]
    assert meta["workspace_free_gemms"] is True and meta["cublaslt_workspace_kib"] is None
