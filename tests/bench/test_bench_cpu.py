"""`wamrt bench latency` end to end on CPU with a tiny model: the result files keep performance.md's
schema (the GPU runs that produce the committed results use the same code), and the load scaling math."""

from __future__ import annotations

import datetime
import json

import pytest
import torch

from wamrt.bench.load import scaling_vs
from wamrt.cli import main

LATENCY_KEYS = ("kind", "git_sha", "command", "date", "gpu", "torch", "model", "tier", "steps", "guidance",
                "guidance_interval", "recipe", "parallel", "gpus", "batch", "weights", "p50_ms", "p90_ms", "p99_ms",
                "ci95_p50_ms", "n", "warmup", "floor_ms", "stages_ms", "peak_mem_gib", "peer")


def test_latency_exact_and_lossy_rows_write_schema_files(tmp_path, monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    rc = main(["bench", "latency", "--model", "tiny-qwen", "--device", "cpu", "--tiny-vae", "--rows", "E3",
               "--steps", "2", "--warmup", "0", "--runs", "2", "--full-rows", "E3", "--lossy-rows", "E7,E5-interval",
               "--quality",
               "--out", str(tmp_path)])
    assert rc == 0
    exact = json.loads((tmp_path / "tiny-qwen-s2-E3.json").read_text())
    lossy = json.loads((tmp_path / "tiny-qwen-s2-E7.json").read_text())
    for row in (exact, lossy):
        missing = [k for k in LATENCY_KEYS if k not in row]
        assert not missing, missing
        assert row["kind"] == "latency" and row["n"] == 2 and row["p50_ms"] > 0
        start, end = (datetime.datetime.fromisoformat(t) for t in row["timed_utc"])  # gpu_clocks.py --rows reads it
        assert start.tzinfo is not None and start < end
    assert exact["recipe"] == "bf16" and not exact["lossy"]
    assert lossy["recipe"] == "gen-fp8" and lossy["lossy"] and lossy["steps"] == 2
    q = lossy["quality"]
    assert 0 < q["rel_l2_vs_bf16_same_config"] < q["bf16_other_seed_rel_l2"]  # fp8 moves less than new noise
    quality = json.loads((tmp_path / "tiny-qwen-quality-gen-fp8.json").read_text())
    assert quality["kind"] == "quality" and quality["sqnr"]["failing"] == []
    assert quality["sqnr"]["min_db"] >= quality["sqnr"]["bar_db"]
    w = quality["weight_gib"]
    assert w["gen-fp8+reasoner-w8"] < w["gen-fp8"] < w["bf16"]
    assert (tmp_path / "waterfall-tiny-qwen-lossy.png").stat().st_size > 0
    # The bf16 row with CFG on the first step only ran before the model was quantized for E7: its chunks equal the
    # exact engine's under the same interval, and differ from full CFG.
    interval = json.loads((tmp_path / "tiny-qwen-s4-E5-interval.json").read_text())
    assert interval["recipe"] == "bf16" and interval["lossy"] and interval["steps"] == 4
    lo, hi = interval["guidance_interval"]
    assert lo < hi
    assert interval["quality"]["rel_l2_vs_bf16_same_config"] == 0
    assert interval["quality"]["rel_l2_vs_bf16_4_steps"] > 0
    assert list(quality["rows"]) == ["E5-interval", "E7"]  # measured in that order, whatever the order asked


def test_load_scaling_ratios():
    one = {"model": "nano", "lanes": 1, "throughput_rps": 1.5, "p50_ms": 700.0}
    eight = {"model": "nano", "lanes": 8, "throughput_rps": 1.35, "max_ms": 6300.0, "p99_ms": 6000.0}
    s = scaling_vs(eight, one)
    assert s["efficiency_vs_baseline"] == pytest.approx(0.9)
    assert s["max_over_baseline_p50"] == pytest.approx(9.0)
    with pytest.raises(ValueError, match="baseline model"):
        scaling_vs({**eight, "model": "edge"}, one)


def test_latency_rows_opt_in_and_unknown(tmp_path, monkeypatch):
    """The untimed alternatives are opt-in (autotuning would eat a default GPU run's time limit) and run; a
    misspelt row is a clear error, not a KeyError halfway through a run."""
    from wamrt.bench.catalog import DEFAULT_ROWS, ROWS

    assert "E5-autotune" not in DEFAULT_ROWS and "E5-bucket" not in DEFAULT_ROWS and "E5" in DEFAULT_ROWS
    assert set(DEFAULT_ROWS) < set(ROWS)
    with pytest.raises(SystemExit, match="unknown rows"):
        main(["bench", "latency", "--model", "tiny-qwen", "--device", "cpu", "--rows", "E3,E9", "--out", str(tmp_path)])
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    rc = main(["bench", "latency", "--model", "tiny-qwen", "--device", "cpu", "--tiny-vae", "--rows", "E5-bucket",
               "--full-rows", "E5-bucket", "--steps", "1", "--warmup", "0", "--runs", "1", "--out", str(tmp_path)])
    assert rc == 0
    row = json.loads((tmp_path / "tiny-qwen-s1-E5-bucket.json").read_text())
    assert row["n"] == 1 and row["p50_ms"] > 0


def test_world_bench_writes_schema_files_with_the_peer(tmp_path, monkeypatch):
    """`wamrt bench world` on a tiny model: both modes, ours and diffusers' pipeline in one process."""
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    rc = main(["bench", "world", "--model", "tiny-qwen", "--device", "cpu", "--tiny-vae", "--t2i-size", "32x32",
               "--i2v-size", "32x48", "--i2v-frames", "5", "--steps", "2", "--warmup", "0", "--runs", "2",
               "--peer-warmup", "0", "--peer-runs", "2", "--out", str(tmp_path)])
    assert rc == 0
    for mode, frames in (("t2i", 1), ("i2v", 5)):
        row = json.loads((tmp_path / f"tiny-qwen-{mode}.json").read_text())
        missing = [k for k in LATENCY_KEYS if k not in row]
        assert not missing, missing
        assert row["mode"] == mode and row["num_frames"] == frames and row["n"] == 2 and row["steps"] == 2
        assert row["peer"]["p50_ms"] > 0 and row["speedup_vs_peer"] == row["peer"]["p50_ms"] / row["p50_ms"]
        assert {"reasoner_prefill", "denoise", "vae_decode"} <= set(row["stages_ms"])
        assert {"vae_decode", "denoise_and_rest"} <= set(row["peer"]["stages_ms"])
        assert row["text_tokens"]["cond"] > row["text_tokens"]["uncond"] > 0
        assert row["engine"]["epilogues"] == "inductor" and row["engine"]["implicit_pad_decode"] is True
        assert row["engine"]["last_layer_read_rows"] is True  # --all-rows turns it off for the comparison
    assert "vae_encode" in json.loads((tmp_path / "tiny-qwen-i2v.json").read_text())["peer"]["stages_ms"]
    assert (tmp_path / "world-tiny-qwen.png").stat().st_size > 0


def test_world_bench_refuses_quack_epilogues_where_they_cannot_run(tmp_path):
    with pytest.raises(SystemExit, match="--epilogues quack: needs quack-kernels"):
        main(["bench", "world", "--model", "tiny-qwen", "--device", "cpu", "--tiny-vae", "--modes", "t2i",
              "--peer", "none", "--epilogues", "quack", "--out", str(tmp_path)])
    assert not list(tmp_path.iterdir())  # nothing built or written


@pytest.mark.parametrize("fa4", [True, False])
def test_world_attention_measure_times_fa4_over_the_models_kv_heads(monkeypatch, fa4: bool):
    """flash-attn-4 is timed over the model's K/V heads (the engine's GQA step buffers with fa4), every other backend
    over K/V repeated per query head, as the engine runs each."""
    from wamrt.bench import world
    from wamrt.model.config import Cosmos3Config

    calls = []

    def measure(q_shape, kv_heads, kv_len, *, dtype, device, backends):
        calls.append((q_shape, kv_heads, kv_len, tuple(backends)))
        return {b: float(kv_heads) for b in backends}

    monkeypatch.setattr(world, "measure_backends", measure)
    monkeypatch.setattr(world, "fa4_available", lambda device: fa4)
    cfg = Cosmos3Config(num_attention_heads=32, num_key_value_heads=8, head_dim=128)
    got = world.measure_generator_attention(cfg, 3510, 3638, torch.bfloat16, torch.device("cpu"))
    want_calls = [((2, 32, 3510, 128), 32, 3638, ("cudnn", "flash", "efficient"))]
    if fa4:
        want_calls.append(((2, 32, 3510, 128), 8, 3638, ("fa4",)))
    assert calls == want_calls
    assert got == {"cudnn": 32.0, "flash": 32.0, "efficient": 32.0, **({"fa4": 8.0} if fa4 else {})}


def test_paced_requests_start_on_the_clock_and_the_wait_is_not_timed():
    """`time_requests(pace_hz=...)`: requests start one period apart (a robot's control loop), a request that overruns
    its tick is followed at once, and only the requests themselves are timed."""
    import time

    from wamrt.bench.rows import time_requests

    starts: list[float] = []

    def request(i: int) -> dict:
        starts.append(time.perf_counter())
        time.sleep(0.130 if i == 2 else 0.002)  # request 2 overruns a 100 ms tick
        return {"i": i}

    # 10 Hz with a 130 ms overrun: wide enough margins that a loaded 2-core CI box's late sleeps (tens of ms) cannot
    # turn "on the clock" into "back to back" or "at once" into "at the next tick".
    totals, stages = time_requests(request, warmup=1, runs=4, pace_hz=10.0)
    gaps = [b - a for a, b in zip(starts, starts[1:], strict=False)]
    assert [s["i"] for s in stages] == [1, 2, 3, 4] and len(totals) == 4
    assert all(t < 90 for i, t in enumerate(totals) if i != 1) and totals[1] >= 130  # waits are not in the times
    assert 0.099 <= gaps[0] < 0.170  # on the clock, not back to back (0.002)
    assert 0.129 <= gaps[2] < 0.190  # after the overrun: at once, not at the next tick (0.200)
    back_to_back, _ = time_requests(request, warmup=0, runs=2)
    assert len(back_to_back) == 2


def test_world_bench_large_modes_write_per_step_rows(tmp_path, monkeypatch):
    """`wamrt bench world --modes t2v720,transfer` at tiny sizes (the H200 job's dry run): a `kind: latency` row per
    mode with the per-step comparison against diffusers, the decode alone and the request's stages."""
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    rc = main(["bench", "world", "--model", "tiny-qwen", "--device", "cpu", "--tiny-vae", "--modes", "t2v720,transfer",
               "--t2v720-size", "32x32", "--t2v720-frames", "5", "--transfer-size", "32x32", "--transfer-frames", "5",
               "--large-steps", "2", "--large-runs", "1", "--peer-steps", "2", "--no-profile", "--out", str(tmp_path)])
    assert rc == 0
    for mode in ("t2v720", "transfer"):
        row = json.loads((tmp_path / f"tiny-qwen-{mode}.json").read_text())
        assert row["kind"] == "latency" and row["mode"] == mode and row["n"] == 1 and row["p50_ms"] > 0
        assert not [k for k in LATENCY_KEYS if k not in row]
        assert row["peer"]["steps"] == 2 and len(row["peer"]["step_ms"]) == 2
        assert row["speedup_per_step"] == row["peer"]["step_p50_ms"] / row["step_ms"]["p50_ms"]
        assert row["decode"]["p50_ms"] > 0 and row["decode"]["tiled"] is False and "peak_mem_gib" in row
        assert row["projected_35_step_ms"] > row["p50_ms"]
    t2v = json.loads((tmp_path / "tiny-qwen-t2v720.json").read_text())
    transfer = json.loads((tmp_path / "tiny-qwen-transfer.json").read_text())
    assert t2v["sound"] is True and t2v["generator_tokens"]["sound"] > 0 and "sound_decode" in t2v["stages_ms"]
    assert transfer["controls"] == ["edge"] and {"controls", "control_encode"} <= set(transfer["stages_ms"])
    assert transfer["peer_mode"] == "text2video" and transfer["flops_ratio_vs_peer"] > 1


def test_graph_wait_gives_up_on_a_server_that_is_gone():
    # On the H200 a server died at startup and `bench load --graph-wait` polled its closed port for ~7 minutes.
    import socket
    import time

    from wamrt.bench.load import wait_for_graphs

    with socket.socket() as s:  # a port nothing listens on once this closes
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    t0 = time.monotonic()
    waited, warmup = wait_for_graphs(f"ws://127.0.0.1:{port}", timeout=60.0, unreachable_s=0.5)
    assert warmup is None and 0.5 <= waited < 5 and time.monotonic() - t0 < 10


def test_bench_decode_tiny_writes_its_rows(tmp_path):
    """`wamrt bench decode --tiny` on the CPU: prefill, eager decode rows at each batch with the step that first
    used its bucket (on a GPU, the capture a chat server pays once), and transformers' generate as the baseline."""
    assert main(["bench", "decode", "--tiny", "--out", str(tmp_path)]) == 0
    (path,) = tmp_path.glob("*-decode-tiny-qwen.json")
    res = json.loads(path.read_text())
    assert res["kind"] == "latency" and res["mode"] == "decode" and res["prefill"]["tokens_per_s"] > 0
    # the plain rows, then the same batches with one matrix for q/k/v and one for gate/up (fuse_reasoner), then
    # batches 1 and 8 with the next step launched before the tokens are read, with SDPA and the split-key kernel
    assert [(r["batch"], r["fused_weights"], r["lookahead"], r["attention"]) for r in res["rows"]] == [
        (1, False, False, "sdpa"), (8, False, False, "sdpa"), (32, False, False, "sdpa"), (1, True, False, "sdpa"),
        (8, True, False, "sdpa"), (32, True, False, "sdpa"), (1, True, True, "sdpa"), (8, True, True, "sdpa"),
        (1, True, True, "split"), (8, True, True, "split")]
    assert res["rows"][6]["greedy_tokens_agreeing_unfused"] == 16  # the same tokens, read a step later
    assert res["rows"][8]["greedy_tokens_agreeing_unfused"] == 16  # on the CPU the kernel's reference runs
    for r in res["rows"]:
        assert r["tokens_per_s"] > 0 and r["first_use_step_ms"] > 0 and r["cuda_graph"] is False
    fused1 = res["rows"][3]  # fp32 on the CPU: the fused matrices decode the same greedy tokens
    assert fused1["greedy_tokens_agreeing_unfused"] == 16
    hf = res["transformers_generate"]
    assert hf["greedy_tokens_agreeing"] >= 1
    fastest = max(r["tokens_per_s"] for r in res["rows"] if r["batch"] == 1)  # the speedup of the best row too
    assert hf["speedup_best_batch1"] == pytest.approx(fastest / hf["tokens_per_s"])
    assert res["copy_floor"] is None and all(r["copy_floor_fraction"] is None for r in res["rows"])  # no GPU


def test_decode_floor_is_the_cards_own():
    """The floor a decode row is measured against is the card's datasheet bandwidth, not the H200's everywhere."""
    from wamrt.bench.decode import datasheet_bandwidth

    assert datasheet_bandwidth("NVIDIA H200")[0] == 4.8e12
    assert datasheet_bandwidth("NVIDIA H100 80GB HBM3")[0] == 3.35e12
    assert datasheet_bandwidth("NVIDIA H100 PCIe")[0] == 2.0e12
    assert datasheet_bandwidth("NVIDIA GH200 480GB")[0] == 4.0e12
    bytes_per_s, source = datasheet_bandwidth("Some Future GPU")
    assert bytes_per_s == 4.8e12 and source.startswith("assumed")


def test_bench_prefix_cost_tiny_times_every_mode(tmp_path):
    """`wamrt bench prefix-cost` on the CPU: the three modes at a delay, interleaved, with their ratios; RTC
    guidance runs a backward pass per step, so it must cost clearly more than inpainting."""
    assert main(["bench", "prefix-cost", "--model", "tiny-edge", "--delays", "2", "--warmup", "0", "--runs", "2",
                 "--device", "cpu", "--out", str(tmp_path)]) == 0
    (path,) = tmp_path.glob("*-prefix-cost-tiny-edge.json")
    res = json.loads(path.read_text())
    (row,) = res["rows"]
    assert row["kind"] == "latency" and row["mode"] == "prefix-cost" and row["delay_steps"] == 2
    assert set(row["requests"]) == {"none", "inpaint", "guided"}
    assert all(r["n"] == 2 and r["p50_ms"] > 0 for r in row["requests"].values())
    assert row["guided_over_inpaint"] > 1.2, row
    guided, inpaint = row["requests"]["guided"]["stages_ms"], row["requests"]["inpaint"]["stages_ms"]
    assert guided["denoise"] > inpaint["denoise"]  # the backward passes are inside the denoising loop


def test_decode_profile_sorts_kernels_by_kind_and_runs_on_the_cpu():
    """`bench decode --profile-steps`: kernel names fall into the kinds the step's time is split by, and the profile
    runs its steps (on the CPU eagerly, with no device events: busy 0, all of the step idle)."""
    import torch

    from wamrt.bench.decode_profile import _union_us, describe, kernel_kind, profile_decode
    from wamrt.pipeline.random_weights import random_transformer
    from wamrt.reasoner.engine import Reasoner
    from wamrt.reasoner.lm import ReasonerLM
    from wamrt.reasoner.load import random_lm_head
    from wamrt.reasoner.prompt import PreparedPrompt

    assert kernel_kind("fmha_cutlassF_bf16_aligned_64x64_rf_sm80") == "attention"
    assert kernel_kind("cudnn_generated_fort_native_sdpa_sm90_flash_fprop") == "attention"
    assert kernel_kind("void gemv2T_kernel_val<int, int, __nv_bfloat16>") == "gemv/gemm"
    assert kernel_kind("nvjet_tst_64x8_64x16_4x1_v_bz_TNT") == "gemv/gemm"
    assert kernel_kind("triton_red_fused__to_copy_add_mean_mul_pow_rsqrt_0") == "triton (fused elementwise, norms)"
    assert kernel_kind("Memcpy DtoD (Device -> Device)") == "copy"
    assert kernel_kind("void at::native::index_elementwise_kernel<128, 4>") == "index/scatter"
    assert kernel_kind("void at::native::reduce_kernel<512, 1, ArgMaxOps>") == "reduce/argmax"
    assert kernel_kind("void at::native::vectorized_elementwise_kernel<4, FillFunctor>") == "other"

    model = random_transformer("tiny-qwen", torch.device("cpu"), torch.float32)
    lm = ReasonerLM(model, random_lm_head(model, seed=1))
    reasoner = Reasoner(lm, None, max_len=64)
    ids = list(range(5, 21))
    prompt = PreparedPrompt(ids, torch.arange(len(ids), dtype=torch.float32).expand(3, -1), len(ids), [], None)
    assert profile_decode(reasoner, prompt, steps=3, lookahead=True, attention="split")["attention"] == "split"
    p = profile_decode(reasoner, prompt, steps=3)
    assert p["steps"] == 3 and p["step_ms_p50"] > 0 and p["device_events"] == 0 and p["busy_ms_per_step"] == 0
    assert p["idle_ms_per_step"] == p["step_ms_p50"] and p["top_kernels"] == []
    assert describe(p).startswith("profile, batch 1") and "overlapping" not in describe(p)
    # busy time under PDL: the union of the kernels' intervals, not their sum
    assert _union_us([(0, 10), (5, 12), (20, 25), (21, 22)]) == 17 and _union_us([]) == 0
    assert "overlapping 0.30 ms" in describe({**p, "busy_ms_per_step": 1.0, "overlap_ms_per_step": 0.3})


def test_every_gemv_row_of_bench_decode_builds_its_decode_batch():
    """`bench decode`'s batch-1 GEMV rows run only on a GPU, after everything else; 5e3177d's call lost all ten
    one-row rows to a setup the CPU never built (the GemvLinear swap of the rows before them, refused by
    OneRowDecode). Here each label, in the bench's order on one fused model, sets the model up and its DecodeBatch is
    made and steps once."""
    import torch

    from wamrt.bench.decode import GEMV_ROWS, setup_gemv_row
    from wamrt.engine.fuse import fuse_reasoner
    from wamrt.ops import gemv_fused
    from wamrt.ops.gemv import GemvLinear
    from wamrt.pipeline.random_weights import random_transformer
    from wamrt.reasoner.engine import DecodeBatch, Reasoner
    from wamrt.reasoner.lm import ReasonerLM
    from wamrt.reasoner.load import random_lm_head
    from wamrt.reasoner.prompt import PreparedPrompt
    from wamrt.reasoner.sampling import SamplingParams

    model = random_transformer("tiny-qwen", torch.device("cpu"), torch.float32)
    lm = ReasonerLM(model, random_lm_head(model, seed=1))
    fuse_reasoner(model)
    reasoner = Reasoner(lm, None, max_len=64)
    ids = list(range(5, 21))
    prompt = PreparedPrompt(ids, torch.arange(len(ids), dtype=torch.float32).expand(3, -1), len(ids), [], None)
    default_preload = gemv_fused.PDL_PRELOAD_SLICES
    try:
        for label in GEMV_ROWS:
            options = setup_gemv_row(lm, label)
            swapped = any(type(m) is GemvLinear for m in lm.modules())
            assert swapped == (label == "all"), label  # "large": no tiny matrix is GEMV_LARGE_NUMEL
            assert gemv_fused.PDL_PRELOAD_SLICES == (int(label[-1]) if "+preload" in label else 1), label
            batch = DecodeBatch(reasoner, 1, cuda_graphs=False, lookahead=True, decode_attention="sdpa", **options)
            batch.admit(prompt, SamplingParams(max_tokens=2, temperature=0, ignore_eos=True))
            batch.step()
    finally:
        gemv_fused.PDL_PRELOAD_SLICES = default_preload


def test_gemvs_alone_reads_every_matrix_of_the_step_once():
    """`bench decode`'s `gemvs_alone`: every matrix a batch-1 step reads, by kind (fused q/k/v and gate/up or not),
    each read once per timed run, its bytes those of the Reasoner's matrices; on the CPU by F.linear, eagerly."""
    import torch

    from wamrt.bench.decode import reasoner_weight_bytes
    from wamrt.bench.decode_gemvs import describe, gemvs_alone, step_matrices
    from wamrt.engine.fuse import fuse_reasoner
    from wamrt.pipeline.random_weights import random_transformer
    from wamrt.reasoner.lm import ReasonerLM
    from wamrt.reasoner.load import random_lm_head

    model = random_transformer("tiny-qwen", torch.device("cpu"), torch.float32)
    lm = ReasonerLM(model, random_lm_head(model, seed=1))
    layers = len(model.layers)
    separate = step_matrices(lm)
    assert [len(separate[k]) for k in ("qkv", "o", "gate_up", "down", "lm_head")] == [3 * layers, layers,
                                                                                       2 * layers, layers, 1]
    fuse_reasoner(model)
    alone = gemvs_alone(lm, reps=2)
    assert alone["triton_in_graphs"] is False and alone["ms"] > 0
    assert [alone["kinds"][k]["matrices"] for k in ("qkv", "gate_up")] == [layers, layers]
    norms = sum(p.numel() * p.element_size() for layer in model.layers for m in
                (layer.input_layernorm, layer.post_attention_layernorm, layer.self_attn.norm_q,
                 layer.self_attn.norm_k) for p in m.parameters())
    norms += sum(p.numel() * p.element_size() for p in model.norm.parameters())
    assert alone["bytes"] == reasoner_weight_bytes(model, lm.lm_head) - norms  # every matrix, nothing else
    assert describe(alone, 2 * alone["ms"]).startswith("GEMVs alone:") and "besides them" in describe(alone, 1.0)
