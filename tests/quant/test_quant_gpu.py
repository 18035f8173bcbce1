"""The fp8 kernel path (`torch._scaled_mm`, rowwise scales) against the reference path and bf16, on
CUDA. Skipped without a GPU; needs sm 8.9+ (Ada/Hopper) for fp8 tensor cores."""

from __future__ import annotations

import copy

import pytest
import torch
from oracle.quant_models import policy_inputs, rel_l2, tiny_model
from torch import nn

from wamrt.quant import Fp8Linear, load_artifact, quantize_model, set_kernel, sqnr_db, write_artifact
from wamrt.quant.fp8 import resolve_kernel, scaled_mm_supported
from wamrt.quant.sqnr import SQNR_BAR_DB

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]
# Kernel vs reference compute the same function; they differ by accumulation order and the bf16
# output rounding (~50 dB), far above the quantization error itself (~28 dB).
KERNEL_VS_REFERENCE_DB = 40.0


@pytest.fixture(autouse=True)
def _fp8_capable():
    if not scaled_mm_supported(torch.device("cuda")):
        pytest.skip("fp8 GEMM needs sm 8.9+")


@pytest.mark.parametrize("m,k,n", [(6186, 4096, 6144), (6186, 4096, 4096), (6186, 12288, 4096),
                                   (37, 2048, 4096)])
def test_scaled_mm_vs_reference_and_bf16(m, k, n):
    """Nano-shaped GEMMs (fused QKV, out-proj, down) and a ragged small M."""
    g = torch.Generator(device="cuda").manual_seed(0)
    lin = nn.Linear(k, n, bias=False, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(n, k, device="cuda", generator=g) / k**0.5)
    x = torch.randn(m, k, device="cuda", generator=g, dtype=torch.bfloat16)
    fast = Fp8Linear.from_linear(lin, kernel="scaled_mm")
    ref = Fp8Linear.from_linear(lin, kernel="reference")
    y_fast, y_ref = fast(x), ref(x)
    assert y_fast.dtype == torch.bfloat16
    assert sqnr_db(y_ref, y_fast) >= KERNEL_VS_REFERENCE_DB
    assert sqnr_db(nn.functional.linear(x.float(), lin.weight.float()), y_fast) >= SQNR_BAR_DB


def test_tiny_model_on_cuda_kernel_vs_reference(tmp_path):
    ref = tiny_model(seed=1, dtype=torch.bfloat16).cuda()
    ref.time_embedder.float()
    quant = copy.deepcopy(ref)
    quantize_model(quant, "gen-fp8")  # auto -> scaled_mm here
    assert resolve_kernel(quant.layers[0].self_attn.add_qkv_proj.kernel, torch.device("cuda")) == "scaled_mm"
    ids, pos, tok = policy_inputs(ref, 1)
    ids, pos = ids.cuda(), pos.cuda()
    for f in ("timesteps", "vision", "vision_noisy", "action", "action_noisy", "domain_ids"):
        setattr(tok, f, getattr(tok, f).cuda())
    fast = quant(ids, pos, tok).action
    set_kernel(quant, "reference")
    slow = quant(ids, pos, tok).action
    truth = ref(ids, pos, tok).action
    # Not fast == slow: bf16-level differences can flip e4m3 roundings downstream (see
    # test_quant_engine.py), so both are judged against the unquantized model.
    assert rel_l2(fast, truth) < 0.12
    assert rel_l2(fast, truth) <= 1.25 * rel_l2(slow, truth)
    set_kernel(quant, "auto")
    loaded = load_artifact(write_artifact(quant, "gen-fp8", tmp_path / "a"), "cuda", torch.bfloat16)
    assert torch.equal(loaded(ids, pos, tok).action, fast)
