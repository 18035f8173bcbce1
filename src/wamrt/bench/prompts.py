"""Instruction sets for `wamrt bench load --prompts`: one fixed instruction, a built-in mix, or a file.

A fleet of robots (or simulator lanes) sends different instructions, so a server's batches mix prefix
lengths; `mixed` reproduces that. Its twelve instructions have twelve different token counts under the
text-following tokenizer `wamrt serve --model random:SIZE` uses (`VariableLengthTokenizer`: 118-152
tokens as plain DROID captions), and they straddle a 64-token bucket boundary (128), so without
`--prompt-width` a batch's width would depend on which lanes it holds. `fleet` spans what a server must accept:
1 to 254 instruction tokens.
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

# Nine instructions from 1 to 254 tokens of their own (118-371 as DROID captions under `random:SIZE`'s tokenizer;
# tests/serving/test_load_prompts.py counts them), a word to a page: the lengths a fleet's operators type, across
# the two prefix widths `wamrt serve` captures by default (256 and 512 tokens at random:nano).
FLEET_INSTRUCTIONS: tuple[str, ...] = (
    "wave",
    "open the top drawer",
    "put the red block in the blue bowl, then push the bowl to the left",
    "pick up the marker from the table, put it in the cup next to the laptop, and then move the cup to the back "
    "corner of the desk",
    "take the lid off the pot on the stove, place the lid upside down on the counter, pick up the wooden spoon, "
    "stir the soup three times, put the spoon back on the spoon rest, and put the lid back on the pot",
    "clear the table: pick up the two empty glasses and put them in the sink, then take the plate with the bread "
    "crumbs and tip the crumbs into the bin under the sink, put the plate in the dish rack, fold the napkin in "
    "half twice and lay it on the left side of the table, and finally push both chairs in so that their backs "
    "touch the edge of the table",
    "sort the objects on the tray by colour into the three bins in front of you. The red objects go into the bin "
    "on the left, the green objects go into the bin in the middle and the blue objects go into the bin on the "
    "right. Pick the objects up one at a time, starting with the one closest to you, and place each one gently at "
    "the bottom of its bin rather than dropping it from above. If an object is two colours, put it in the bin of "
    "the colour that covers more of it. When the tray is empty, slide it to the far side of the table",
    "prepare the workstation for the next shift. First, collect every tool lying on the bench: the screwdrivers, "
    "the pliers, the small hammer and the tape measure. Hang the screwdrivers on the pegboard from the smallest to "
    "the largest, left to right, with their handles pointing down. Put the pliers in the second drawer of the grey "
    "cabinet and the hammer in the third drawer. Close both drawers fully. Then wind up the loose cable on the "
    "bench, secure it with the velcro strap that is lying next to it, and hang it on the hook at the right end of "
    "the pegboard. Wipe the surface of the bench with the cloth from the blue bucket, wring the cloth out over the "
    "bucket, and drape it over the edge of the bucket to dry. Finally, put the tape measure in the tray by the door",
    "you are helping in a small kitchen. The dishwasher in front of you has finished and is still open. Unload it "
    "in this order so that nothing drips onto clean items: start with the top rack, then the cutlery basket, then "
    "the bottom rack. From the top rack, take the cups and glasses one at a time, hold each one upside down for a "
    "moment so that any water on the base runs off, and place them on the second shelf of the open cupboard above "
    "the sink, cups on the left and glasses on the right, in rows from the back to the front. From the cutlery "
    "basket, take the forks, knives and spoons and put each kind into its own compartment of the drawer to the "
    "right of the dishwasher, with the knives pointing away from you. Leave the large serving spoon and the ladle "
    "on the counter. From the bottom rack, stack the plates by size on the lowest shelf of the cupboard, largest at "
    "the bottom, and put the two bowls on top of the smallest plates. When the dishwasher is empty, push both "
    "racks back in, close the door gently until it clicks, and return to your starting position with the gripper "
    "open",
)

PROMPT_SETS = ("fixed", "mixed", "fleet")


def load_prompts(spec: str) -> list[str]:
    """`fixed`: the built-in sample instruction only; `mixed`: MIXED_INSTRUCTIONS; `fleet`: FLEET_INSTRUCTIONS;
    anything else: a UTF-8 file with one instruction per line (blank lines skipped)."""
    from ..sample import INSTRUCTION

    if spec == "fixed":
        return [INSTRUCTION]
    if spec == "mixed":
        return list(MIXED_INSTRUCTIONS)
    if spec == "fleet":
        return list(FLEET_INSTRUCTIONS)
    path = Path(spec)
    if not path.is_file():
        raise ValueError(f"--prompts must be one of {', '.join(PROMPT_SETS)} or a file of instructions, "
                         f"and {spec!r} is not a file")
    prompts = [line.strip() for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    if not prompts:
        raise ValueError(f"--prompts file {spec} has no instructions (one per line)")
    return prompts
