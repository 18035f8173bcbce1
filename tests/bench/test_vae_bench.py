"""`wamrt bench vae` on the CPU with the tiny VAE: every variant of both stages runs, computes diffusers' function
(fp32 here, so the walk's and the decode's options may only reorder rounding), and the files keep their fields."""

from __future__ import annotations

import json

import pytest

from wamrt.bench.vae import ENCODE_VARIANTS, kind_of
from wamrt.cli import main

FP32_REORDER_TOL = 1e-4  # fp32 sums in another order: ~2e-6 measured


def test_vae_bench_times_every_variant_of_both_stages(tmp_path, monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    rc = main(["bench", "vae", "--tiny-vae", "--device", "cpu", "--tier", "256", "--encode-runs", "2",
               "--decode-runs", "1", "--latent-shape", "1,48,2,2,3", "--out", str(tmp_path)])
    assert rc == 0
    enc = json.loads((tmp_path / "vae-encode.json").read_text())
    assert enc["kind"] == "vae-encode" and enc["vae"] == "tiny" and enc["dtype"] == "float32" and enc["git_sha"]
    assert "--tier 256" in enc["command"] and enc["canvas"][:2] == [256, 320]
    assert list(enc["variants"]) == list(ENCODE_VARIANTS)
    for name, row in enc["variants"].items():
        assert row["n"] == 2 and row["p50_ms"] > 0, name
        assert row["max_abs_err_vs_fp32"] < FP32_REORDER_TOL, name
    assert enc["request_paths_max_abs_diff"] == 0  # the content path and the host pad encode the same pixels
    for path in ("request_content", "request_host_pad"):
        assert enc[path]["until_done"]["p50_ms"] >= enc[path]["host"]["p50_ms"] > 0
    assert enc["kernels_default"]["by_kind_ms"]["convolution"] > 0

    dec = json.loads((tmp_path / "vae-decode.json").read_text())
    assert dec["kind"] == "vae-decode" and dec["latent_shape"] == [1, 48, 2, 2, 3]
    assert list(dec["variants"]) == ["diffusers", "implicit_pad", "implicit_pad_fused_norm_compile",
                                     "implicit_pad_fused_norm_rows", "implicit_pad_fused_norm_rows_residual_blocks",
                                     "implicit_pad_fused_norm_rows_blocks"]
    for name in ("implicit_pad_fused_norm_rows", "implicit_pad_fused_norm_rows_residual_blocks",
                 "implicit_pad_fused_norm_rows_blocks"):
        assert dec[f"{name}_vs_compile_abs_diff"]["max"] < FP32_REORDER_TOL, name
    kernels = dec["kernels_implicit_pad_fused_norm_rows_blocks"]
    assert kernels["by_kind_ms"]["convolution"] > 0
    assert kernels["total_ms"] == pytest.approx(sum(kernels["by_kind_ms"].values()))


def test_vae_bench_refuses_an_unknown_stage_before_building(tmp_path):
    with pytest.raises(SystemExit, match="unknown"):
        main(["bench", "vae", "--stages", "encode,decoder", "--device", "cpu", "--out", str(tmp_path)])
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize("name,kind", [
    ("triton_poi_fused_rms_norm_silu_0", "norm"), ("sm90_xmma_fprop_implicit_gemm_bf16", "convolution"),
    ("aten::mkldnn_convolution", "convolution"), ("CatArrayBatchedCopy", "copy / cat"), ("aten::cat", "copy / cat"),
    ("Memcpy DtoD (Device -> Device)", "copy / cat"), ("aten::silu", "other"), ("aten::scatter", "other"),
])
def test_kernel_kinds(name: str, kind: str):
    assert kind_of(name) == kind
