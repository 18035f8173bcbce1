"""`wamrt chat`: a terminal conversation with the checkpoint's Reasoner, its answers streamed as they decode.

Type a message and Enter; `/image PATH` attaches an image to the next message (checkpoints with a vision_encoder/),
`/reset` starts over, an empty line or Ctrl-D ends. `--prompt TEXT` answers one message and exits.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--model", default="tiny-world", help="checkpoint folder or built-in name (default: tiny-world)")
    ap.add_argument("--device", help="cpu or cuda (default: cuda if available)")
    ap.add_argument("--tokenizer", help="tokenizer folder (default: the checkpoint's text_tokenizer/ or tokenizer/)")
    ap.add_argument("--vae", help="VAE folder (default: the checkpoint's vae/)")
    ap.add_argument("--system", help="a system message (the checkpoints have none by default)")
    ap.add_argument("--prompt", help="answer this one message and exit")
    ap.add_argument("--image", type=Path, help="attach an image to the first message")
    ap.add_argument("--max-tokens", type=int, default=512, help="longest answer, in tokens")
    ap.add_argument("--temperature", type=float, default=0.7, help="0 = greedy")
    ap.add_argument("--top-p", type=float, default=0.9, help="nucleus sampling mass (1: off)")
    ap.add_argument("--top-k", type=int, default=0, help="sample among the k likeliest tokens (0: off)")
    ap.add_argument("--repetition-penalty", type=float, default=1.05,
                    help="divides (multiplies) the positive (negative) logits of tokens already seen (1: off)")
    ap.add_argument("--seed", type=int, help="sampling seed (default: a random one)")
    ap.add_argument("--context", type=int, default=8192, help="prompt + answer tokens")
    ap.add_argument("--decode", choices=["one-row", "layers"], default="one-row",
                    help="one-row = the one-row GEMV stack on the model's matrices (as `wamrt serve --chat-decode`); "
                         "layers = the model's layers (also where the stack cannot run this model)")


def _user_message(text: str, image: Path | None) -> dict[str, Any]:
    if image is None:
        return {"role": "user", "content": text}
    from PIL import Image

    return {"role": "user", "content": [{"type": "image", "image": Image.open(image).convert("RGB")},
                                        {"type": "text", "text": text}]}


def run(args: argparse.Namespace) -> int:
    from ..pipeline import RequestError, load_policy
    from ..reasoner import SamplingParams, reasoner_of

    try:
        params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                                top_k=args.top_k, repetition_penalty=args.repetition_penalty, seed=args.seed)
        policy = load_policy(args.model, device=args.device, tokenizer=args.tokenizer, vae=args.vae)
        reasoner, why = reasoner_of(policy, args.model, max_len=args.context)
    except (RequestError, ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if reasoner is None:
        print(f"error: {args.model} cannot chat: {why}", file=sys.stderr)
        return 2
    info = reasoner.describe()
    print(f"{args.model}: Reasoner, {info['note']}", file=sys.stderr)
    one_row = args.decode == "one-row"
    if one_row:
        from ..reasoner.fused import OneRowDecode

        problem = OneRowDecode.problem(reasoner.lm)
        if problem:
            print(f"--decode one-row cannot run this model ({problem}); decoding with its layers", file=sys.stderr)
            one_row = False
    history: list[dict[str, Any]] = [{"role": "system", "content": args.system}] if args.system else []
    image = args.image
    while True:
        if args.prompt is not None:
            text = args.prompt
        else:
            try:
                text = input("you> ").strip()
            except EOFError:
                return 0
            if not text:
                return 0
            if text == "/reset":
                history = history[:1] if args.system else []
                continue
            if text.startswith("/image "):
                image = Path(text.split(" ", 1)[1].strip())
                continue
        history.append(_user_message(text, image))
        image = None
        try:
            prompt = reasoner.prepare(history)
        except RequestError as e:
            print(f"error: {e}", file=sys.stderr)
            history.pop()
            if args.prompt is not None:
                return 2
            continue
        print("reasoner> " if args.prompt is None else "", end="", flush=True)
        seq = None
        for events in reasoner.generate([prompt], params, one_row=one_row):
            for e in events:
                print(e.text, end="", flush=True)
                seq = e.seq
        print()
        assert seq is not None
        if seq.finish_reason == "length":
            print(f"[stopped at --max-tokens {args.max_tokens}]", file=sys.stderr)
        history.append({"role": "assistant", "content": seq.text})
        if args.prompt is not None:
            return 0
