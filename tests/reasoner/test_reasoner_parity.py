"""Our Reasoner (the transformer's Reasoner half + lm_head + transformers' vision tower) vs transformers'
`Qwen3VLForConditionalGeneration` with the same weights (tiny configs, CPU, fp32): logits on text, on an image and
on a short video; greedy decoding; and the decode loop's cache against a full re-forward at every step."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from oracle.reasoner import build_tiny_reasoner
from PIL import Image

from wamrt.reasoner.sampling import SamplingParams

pytestmark = pytest.mark.parity

REL_TOL = 1e-5  # max |ours - oracle| <= REL_TOL * max |oracle|


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return build_tiny_reasoner(tmp_path_factory.mktemp("tiny_reasoner"))


def _close(ours: torch.Tensor, ref: torch.Tensor) -> float:
    err = (ours - ref).abs().max().item()
    assert err <= REL_TOL * ref.abs().max().item(), (err, ref.abs().max().item())
    return err


def _image(seed: int, hw=(80, 112)) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (*hw, 3), dtype=np.uint8))


def _token_types(ids: list[int], tiny) -> torch.Tensor:
    types = torch.zeros(1, len(ids), dtype=torch.int32)
    types[0, torch.tensor(ids) == tiny.token_ids["image_token_id"]] = 1
    types[0, torch.tensor(ids) == tiny.token_ids["video_token_id"]] = 2
    return types


def _ours(tiny, prompt) -> torch.Tensor:
    r = tiny.reasoner
    embeds, deepstack = r.prompt_embeddings(prompt)
    return r.lm.run_prompt(embeds, prompt.positions[None], deepstack=deepstack, all_logits=True)


def _oracle_kwargs(prompt) -> dict:
    kw = {}
    for m in prompt.media:
        key = "pixel_values" if m.kind == "image" else "pixel_values_videos"
        grid = "image_grid_thw" if m.kind == "image" else "video_grid_thw"
        kw[key] = torch.cat([kw[key], m.pixel_values]) if key in kw else m.pixel_values
        kw[grid] = torch.cat([kw[grid], torch.tensor([m.grid_thw])]) if grid in kw else torch.tensor([m.grid_thw])
    return kw


@torch.no_grad()
def test_text_logits_equal_qwen3vl(tiny) -> None:
    prompt = tiny.reasoner.prepare([{"role": "user", "content": "Describe a robot arm stacking three red cubes."}])
    assert prompt.media_mask is None and prompt.next_position == prompt.length  # text: plain 1-D RoPE
    ref = tiny.oracle(input_ids=torch.tensor([prompt.ids])).logits
    _close(_ours(tiny, prompt), ref)


@torch.no_grad()
def test_image_logits_equal_qwen3vl(tiny) -> None:
    messages = [{"role": "user", "content": [
        {"type": "image", "image": _image(0)}, {"type": "text", "text": "What is on the table?"},
        {"type": "image", "image": _image(1, (64, 64))}]}]
    prompt = tiny.reasoner.prepare(messages)
    assert [m.grid_thw for m in prompt.media] == [(1, 4, 8), (1, 4, 4)]  # 80x112 -> 64x128 (factor 32), 64x64
    ids = torch.tensor([prompt.ids])
    types = _token_types(prompt.ids, tiny)
    kw = _oracle_kwargs(prompt)
    # Our MRoPE ids are transformers' get_rope_index.
    ref_pos, _ = tiny.oracle.model.get_rope_index(ids, types, image_grid_thw=kw["image_grid_thw"])
    assert torch.equal(prompt.positions.long(), ref_pos[:, 0])
    assert prompt.next_position == int(ref_pos.max()) + 1
    ref = tiny.oracle(input_ids=ids, mm_token_type_ids=types, **kw).logits
    _close(_ours(tiny, prompt), ref)
    # DeepStack is really in play: without it the logits move.
    r = tiny.reasoner
    embeds, _ = r.prompt_embeddings(prompt)
    plain = r.lm.run_prompt(embeds, prompt.positions[None], all_logits=True)
    assert (plain - ref).abs().max() > 1e-3


@torch.no_grad()
def test_video_logits_equal_qwen3vl(tiny) -> None:
    rng = np.random.default_rng(3)
    frames = rng.integers(0, 256, (12, 64, 96, 3), dtype=np.uint8)  # 12 frames at 6 fps -> 4 sampled at 2 fps
    messages = [{"role": "user", "content": [{"type": "video", "video": frames, "fps": 6.0},
                                             {"type": "text", "text": "What happens?"}]}]
    prompt = tiny.reasoner.prepare(messages)
    video = prompt.media[0]
    # Frames 0, 4, 7, 11 sampled (uniform, 2 fps of 6); timestamps as transformers' processor computes them.
    from transformers import Qwen3VLProcessor

    assert video.grid_thw[0] == 2
    assert video.timestamps == Qwen3VLProcessor._calculate_timestamps(None, [0, 4, 7, 11], 6.0, 2)
    text = tiny.tokenizer.decode(prompt.ids)
    assert "<0.3 seconds><|vision_start|>" in text and "<1.5 seconds><|vision_start|>" in text
    ids = torch.tensor([prompt.ids])
    types = _token_types(prompt.ids, tiny)
    kw = _oracle_kwargs(prompt)
    ref_pos, _ = tiny.oracle.model.get_rope_index(ids, types, video_grid_thw=kw["video_grid_thw"])
    assert torch.equal(prompt.positions.long(), ref_pos[:, 0])
    ref = tiny.oracle(input_ids=ids, mm_token_type_ids=types, **kw).logits
    _close(_ours(tiny, prompt), ref)


def test_video_patches_follow_the_image_layout(tiny) -> None:
    """A still video (every frame the same) patches exactly like the image processor's output of that frame, which
    repeats the frame over the temporal patch: the two layouts agree."""
    frame = np.asarray(_image(4, (64, 64)))
    tower = tiny.reasoner.vision
    still = tower.video(np.stack([frame] * 4), fps=2.0)
    image = tower.image(Image.fromarray(frame))
    assert still.grid_thw == (2, 4, 4) and image.grid_thw == (1, 4, 4)
    per_patch = image.pixel_values.shape[0]
    assert torch.allclose(still.pixel_values[:per_patch], image.pixel_values, atol=1e-6)


@torch.no_grad()
@pytest.mark.parametrize("with_image", [False, True])
def test_greedy_64_tokens_equal_generate(tiny, with_image: bool) -> None:
    content = [{"type": "text", "text": "Tell me about the scene."}]
    if with_image:
        content.insert(0, {"type": "image", "image": _image(7, (64, 96))})
    prompt = tiny.reasoner.prepare([{"role": "user", "content": content}])
    seq = None
    for events in tiny.reasoner.generate([prompt], SamplingParams(max_tokens=64, temperature=0, ignore_eos=True)):
        seq = events[0].seq
    ids = torch.tensor([prompt.ids])
    kw = _oracle_kwargs(prompt)
    if with_image:
        kw["mm_token_type_ids"] = _token_types(prompt.ids, tiny)
    ref = tiny.oracle.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=64, min_new_tokens=64,
                               do_sample=False, **kw)
    assert seq is not None and len(seq.tokens) == 64 and seq.finish_reason == "length"
    assert seq.tokens == ref[0, ids.shape[1]:].tolist()


@torch.no_grad()
def test_cached_decode_equals_full_reforward_every_step(tiny) -> None:
    """Two prompts of different lengths decode as one batch (rows at different cache positions); at every step each
    row's logits equal a full forward of its whole sequence without a cache."""
    r = tiny.reasoner
    prompts = [r.prepare([{"role": "user", "content": c}]) for c in ("Short.", "A longer prompt about robots.")]
    prompts[1] = r.prepare([{"role": "user", "content": [{"type": "image", "image": _image(9, (64, 64))},
                                                          {"type": "text", "text": "A longer prompt."}]}])
    from wamrt.reasoner.engine import DecodeBatch

    batch = DecodeBatch(r, 2)
    seqs = [batch.admit(p, SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)).seq for p in prompts]
    seen_logits = []
    original = r.lm.decode_step

    def spy(*args, **kw):
        out = original(*args, **kw)
        seen_logits.append(out.clone())
        return out

    r.lm.decode_step = spy
    try:
        while batch.live:
            batch.step()
            logits = seen_logits[-1]
            for s in seqs:
                fed = s.tokens[:-1]  # the step fed the previous token; its logits chose the last one
                embeds, deepstack = r.prompt_embeddings(s.prompt)
                embeds = torch.cat([embeds, r.lm.embed(torch.tensor([fed]))], dim=1)
                tail = torch.arange(len(fed), dtype=torch.float32) + s.prompt.next_position
                pos = torch.cat([s.prompt.positions, tail.expand(3, -1)], dim=1)[None]
                if deepstack is not None:
                    deepstack.mask = torch.cat([deepstack.mask, torch.zeros(len(fed), dtype=torch.bool)])
                full = r.lm.run_prompt(embeds, pos, deepstack=deepstack)[0]
                _close(logits[s.row], full)
    finally:
        del r.lm.decode_step
    assert len(seen_logits) == 23 and all(len(s.tokens) == 24 for s in seqs)


def _decode_to_the_end(r, batch, prompts, params) -> tuple[torch.Tensor, list[list[int]]]:
    """Every step's logits [steps, rows, V] (through a spy on `decode_step`) and each prompt's tokens."""
    original, seen = r.lm.decode_step, []

    def spy(*args, **kw):
        out = original(*args, **kw)
        seen.append(out.clone())
        return out

    r.lm.decode_step = spy
    try:
        seqs = [batch.admit(p, params).seq for p in prompts]
        while batch.live:
            batch.step()
    finally:
        del r.lm.decode_step
    return torch.stack(seen), [s.tokens for s in seqs]


def test_fused_decode_layers_equal_the_model_layers(tiny) -> None:
    """The compiled decode layers (reasoner/fused.py: the layer's code split around attention, Inductor-compiled)
    give the logits of `MoTLayer.reasoner` at every step of a two-row batch, so the same greedy tokens."""
    from torch._dynamo.utils import counters

    from wamrt.reasoner.engine import DecodeBatch

    r = tiny.reasoner
    prompts = [r.prepare([{"role": "user", "content": c}]) for c in ("Short.", "A longer prompt about robots.")]
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    logits, tokens = {}, {}
    torch._dynamo.reset()  # an earlier test may have compiled the same regions (the cache is per function): count anew
    graphs_before = counters["stats"]["unique_graphs"]
    for fused in (False, True):
        batch = DecodeBatch(r, 2, cuda_graphs=False, fused=fused)
        assert (batch.layer_fn is not None) == fused
        logits[fused], tokens[fused] = _decode_to_the_end(r, batch, prompts, params)
    assert counters["stats"]["unique_graphs"] - graphs_before >= 2  # the two regions compiled (not a fallback)
    assert tokens[True] == tokens[False]
    _close(logits[True], logits[False])


@pytest.mark.parametrize(("rows", "attention", "weights"), [(1, "auto", "fused"), (2, "auto", "fused"),
                                                         (1, "split", "fused"), (1, "auto", "separate"),
                                                         (2, "auto", "separate")])
def test_one_row_decode_equals_the_fused_layers(tmp_path, rows: int, attention: str, weights: str) -> None:
    """`OneRowDecode` (reasoner/fused.py: norms and SiLU * up inside the GEMVs, residual adds in their epilogues; off
    the GPU kernel the model's ops, one by one) gives the logits of the per-layer fused decode at every step: one row
    through the whole-stack path (on folded norms where the matrices are fused; on separate q/k/v and gate/up
    matrices, one GEMV each into its slice, as a served model keeps them), two through the per-layer one (with
    separate matrices and `fused=False`: the model's own layers, nothing compiled); with the split attention's
    reference (no Triton here), the norms and RoPE stay in the compiled region."""
    from wamrt.engine.fuse import fold_reasoner_norms, fuse_reasoner
    from wamrt.reasoner.engine import DecodeBatch
    from wamrt.reasoner.fused import OneRowDecode

    r = build_tiny_reasoner(tmp_path, vision=False).reasoner
    if weights == "fused":
        fuse_reasoner(r.lm.transformer)
        if rows == 1:  # the one-row path also on norms folded into the matrices (exact in fp32, up to rounding)
            fold_reasoner_norms(r.lm.transformer, r.lm.lm_head)
    prompts = [r.prepare([{"role": "user", "content": c}]) for c in ("Short.", "A longer prompt about robots.")][:rows]
    params = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    logits, tokens, stacks = {}, {}, []
    compiled = weights == "fused"
    for one_row in (False, True):
        batch = DecodeBatch(r, rows, cuda_graphs=False, fused=compiled or not one_row, one_row=one_row,
                            decode_attention=attention)
        assert isinstance(batch.layer_fn, OneRowDecode) == one_row
        if one_row:
            assert batch.layer_fn.compile_rows == compiled
            run_stack = batch.layer_fn.run_stack
            batch.layer_fn.run_stack = lambda lm, u, *a: stacks.append(u.shape[0]) or run_stack(lm, u, *a)
        logits[one_row], tokens[one_row] = _decode_to_the_end(r, batch, prompts, params)
    assert stacks and set(stacks) == {rows}  # every step went through the whole-stack runner
    assert tokens[True] == tokens[False]
    _close(logits[True], logits[False])


def test_one_row_decode_refuses_what_it_cannot_run(tmp_path) -> None:
    """A Reasoner whose projections are not plain linear layers (a quantized one) or carry biases gets a one-line
    reason, and `DecodeBatch(one_row=True)` raises it. Layers swapped to the Triton GEMV (`use_gemv_kernel`, as
    `wamrt bench decode` leaves them) hold the same matrices and are taken."""
    from wamrt.ops.gemv import undo_gemv_kernel, use_gemv_kernel
    from wamrt.reasoner.engine import DecodeBatch
    from wamrt.reasoner.fused import OneRowDecode

    r = build_tiny_reasoner(tmp_path, vision=False).reasoner
    assert OneRowDecode.problem(r.lm) is None
    assert use_gemv_kernel(r.lm) > 0
    assert OneRowDecode.problem(r.lm) is None
    undo_gemv_kernel(r.lm)
    attn = r.lm.transformer.layers[1].self_attn
    plain = attn.to_k
    attn.to_k = torch.nn.Sequential(plain)
    assert OneRowDecode.problem(r.lm) == "layer 1: the one-row decode takes plain linear projections, not Sequential"
    with pytest.raises(ValueError, match="plain linear"):
        DecodeBatch(r, 1, cuda_graphs=False, one_row=True)
    attn.to_k = plain
    attn.to_out.bias = torch.nn.Parameter(torch.zeros(attn.to_out.out_features))
    assert "without biases" in OneRowDecode.problem(r.lm)


def test_folding_the_norms_into_the_matrices_keeps_the_logits(tmp_path) -> None:
    """`engine.fuse.fold_reasoner_norms`: each Reasoner norm's weight moved into the matrix after it (the norm left
    at ones, marked folded) gives the same prompt logits (fp32: within REL_TOL), once; it refuses unfused matrices
    and leaves an lm_head that shares the embedding's storage alone."""
    from wamrt.engine.fuse import fold_reasoner_norms, fuse_reasoner

    r = build_tiny_reasoner(tmp_path, vision=False).reasoner
    with pytest.raises(TypeError, match="fuse_reasoner"):
        fold_reasoner_norms(r.lm.transformer, r.lm.lm_head)
    fuse_reasoner(r.lm.transformer)
    ids = torch.tensor([[3, 17, 42, 99, 7, 250]])
    positions = torch.arange(6)[None, None].expand(1, 3, 6)
    before = r.lm.run_prompt(r.lm.embed(ids), positions, all_logits=True)
    layers = r.lm.transformer.layers
    assert any((layer.input_layernorm.weight != 1).any() for layer in layers)  # random norms: the fold changes W
    assert fold_reasoner_norms(r.lm.transformer, r.lm.lm_head) == 2 * len(layers) + 1
    assert fold_reasoner_norms(r.lm.transformer, r.lm.lm_head) == 0
    assert all((layer.post_attention_layernorm.weight == 1).all() for layer in layers)
    _close(r.lm.run_prompt(r.lm.embed(ids), positions, all_logits=True), before)

    tied = build_tiny_reasoner(tmp_path / "tied", vision=False).reasoner.lm
    fuse_reasoner(tied.transformer)
    tied.lm_head.weight = tied.transformer.embed_tokens.weight
    assert fold_reasoner_norms(tied.transformer, tied.lm_head) == 2 * len(layers)
    assert not getattr(tied.transformer.norm, "folded", False)
