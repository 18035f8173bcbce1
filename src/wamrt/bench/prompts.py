"""Instruction sets for `wamrt bench load --prompts`: one fixed instruction, a built-in mix, or a file.

A fleet of robots (or simulator lanes) sends different instructions, so a server's batches mix prefix
lengths; `mixed` reproduces that. Its twelve instructions have twelve different token counts under the
text-following tokenizer `wamrt serve --model random:SIZE` uses (`VariableLengthTokenizer`: 118-152
tokens as plain DROID captions), and they straddle a 64-token bucket boundary (128), so without
`--prompt-width` a batch's width would depend on which lanes it holds.
"""

from __future__ import annotations

from pathlib import Path

MIXED_INSTRUCTIONS: tuple[str, ...] = (
    "wave",
    "open the drawer",
    "put the red block in the blue bowl",
    "pick up the marker and put it in the cup",
    "move the green sponge to the left side of the sink",
    "take the lid off the pot and place it on the counter next to the stove",
    "fold the towel in half, then slide it to the back corner of the table",
    "pick up the banana from the fruit bowl and put it into the brown paper bag on the right",
    "stack the three wooden blocks on top of each other, largest at the bottom and smallest at the top",
    "push the coffee mug behind the laptop, then close the laptop lid slowly so that it does not slam shut",
    "open the top drawer of the cabinet, take out the silver spoon, place it next to the white plate, and close "
    "the drawer again",
    "find the yellow tennis ball under the chair, roll it across the floor towards the open door, then return to "
    "the starting position and wait for the next instruction",
)

PROMPT_SETS = ("fixed", "mixed")


def load_prompts(spec: str) -> list[str]:
    """`fixed`: the built-in sample instruction only; `mixed`: MIXED_INSTRUCTIONS; anything else: a UTF-8 file
    with one instruction per line (blank lines skipped)."""
    from ..sample import INSTRUCTION

    if spec == "fixed":
        return [INSTRUCTION]
    if spec == "mixed":
        return list(MIXED_INSTRUCTIONS)
    path = Path(spec)
    if not path.is_file():
        raise ValueError(f"--prompts must be one of {', '.join(PROMPT_SETS)} or a file of instructions, "
                         f"and {spec!r} is not a file")
    prompts = [line.strip() for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    if not prompts:
        raise ValueError(f"--prompts file {spec} has no instructions (one per line)")
    return prompts
