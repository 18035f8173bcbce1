"""Ulysses sequence parallelism: the Generator sequence dealt out over `degree` ranks, swapped to head sharding
around each attention call and back (DeepSpeed-Ulysses: two all-to-alls per attention).

Outside attention every token is independent (norms, projections, MLP, the sampler's elementwise update), so a
rank runs those on its own rows only. Attention needs every key: before it, one all-to-all turns [local rows, all
heads] of q, k and v into [all rows, 1/degree of the heads]; after it, one all-to-all turns the output back. The
attention op then sees exactly what a single GPU sees, for its heads: the K/V buffer holds [Reasoner prefix |
every Generator token in sequence order] and the queries are in sequence order too, so every attention layout of
the engine (per-sequence calls, masks, prompt buckets, transfer's control passes) runs unchanged on it.

Which rows a rank holds (`SequenceLayout`): every segment of the sequence (each control video, the vision
tokens, the sound frames) is cut into `degree` near-equal consecutive chunks and rank r holds chunk r of each,
padded to a common row count. Cutting per segment, not the sequence as a whole, gives a rank the same vision and
sound rows in a pass with controls and in one without (transfer's control-guidance pass), so its share of the
sampler state is one thing. Padding rows are computed and dropped: they never reach the K/V buffers, and their
outputs are never read.

Heads (`HeadSplit`): the degree must divide the query heads. K/V heads are repeated up to lcm(K/V heads, degree)
(which divides the query heads) when the degree does not divide them; rank r then holds query heads
[r H/n, (r+1) H/n) and exactly the (repeated) K/V heads they read, so GQA grouping stays local.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class HeadSplit:
    """Query and K/V heads per rank at a Ulysses degree (`check` raises when the degree does not fit)."""

    heads: int
    kv_heads: int
    degree: int

    def __post_init__(self) -> None:
        if self.degree < 1 or self.heads % self.degree:
            raise ValueError(f"Ulysses degree {self.degree} must divide the model's {self.heads} attention heads")

    @property
    def kv_total(self) -> int:
        """K/V heads after repetition: a multiple of the degree that still divides the query heads."""
        return math.lcm(self.kv_heads, self.degree)

    @property
    def kv_repeat(self) -> int:
        return self.kv_total // self.kv_heads

    @property
    def local_heads(self) -> int:
        return self.heads // self.degree

    @property
    def local_kv_heads(self) -> int:
        return self.kv_total // self.degree


def chunk(n: int, degree: int, rank: int) -> tuple[int, int]:
    """Rank `rank`'s [start, stop) of n items cut into `degree` consecutive near-equal chunks."""
    return rank * n // degree, (rank + 1) * n // degree


class SequenceLayout:
    """Which Generator rows each rank holds, for a sequence of consecutive `segments` (token counts), and the index
    tensors the all-to-alls use (built once, on `device`, so that a captured graph holds them as constants).

    * `mine` [local]: this rank's rows as global positions (padding rows repeat position 0; their RoPE is unused);
    * `gather` ([G], [G]): for every global position in order, the sending rank and its row there;
    * `scatter` [degree, local]: for every rank and row, the global position it holds (padding: 0).
    """

    def __init__(self, segments: tuple[int, ...], degree: int, rank: int, device: torch.device) -> None:
        self.segments, self.degree, self.rank = tuple(segments), degree, rank
        starts = [sum(segments[:i]) for i in range(len(segments))]
        held = [[p for n, s in zip(segments, starts, strict=True) for p in range(s + chunk(n, degree, r)[0],
                                                                                   s + chunk(n, degree, r)[1])]
                for r in range(degree)]
        self.local = max(len(h) for h in held)
        self.length = sum(segments)
        padded = [h + [0] * (self.local - len(h)) for h in held]
        src, row = [0] * self.length, [0] * self.length
        for r, h in enumerate(held):
            for i, p in enumerate(h):
                src[p], row[p] = r, i
        self.mine = torch.tensor(padded[rank], dtype=torch.long, device=device)
        self.gather = (torch.tensor(src, dtype=torch.long, device=device),
                       torch.tensor(row, dtype=torch.long, device=device))
        self.scatter = torch.tensor(padded, dtype=torch.long, device=device)

    def span(self, segment: int, rank: int | None = None) -> tuple[int, int]:
        """(first local row, row count) of `segment`'s chunk on `rank` (default: this rank)."""
        rank = self.rank if rank is None else rank
        offset = sum(b - a for a, b in (chunk(n, self.degree, rank) for n in self.segments[:segment]))
        a, b = chunk(self.segments[segment], self.degree, rank)
        return offset, b - a


def rows_to_heads(parts: list[torch.Tensor], layout: SequenceLayout, group: dist.ProcessGroup | None
                  ) -> list[torch.Tensor]:
    """Each part [S, local, n_i, d] (this rank's rows, all n_i heads; n_i divisible by the degree) -> [S, G, n_i /
    degree, d] (every row in sequence order, this rank's heads), all parts in one all-to-all."""
    k = layout.degree
    s, local, _, d = parts[0].shape
    widths = [p.shape[2] // k for p in parts]
    # [destination rank, row, sequence, head, d]: dim 0 is what all_to_all_single splits by destination.
    send = parts[0].new_empty(k, local, s, sum(widths), d)
    at = 0
    for p, w in zip(parts, widths, strict=True):
        send[:, :, :, at:at + w].copy_(p.unflatten(2, (k, w)).permute(2, 1, 0, 3, 4))
        at += w
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)  # recv[r]: rank r's rows, this rank's heads
    ordered = recv[layout.gather].transpose(0, 1)  # [S, G, sum(widths), d] (one gather copy; a view after it)
    return list(ordered.split(widths, dim=2))


def heads_to_rows(o: torch.Tensor, layout: SequenceLayout, group: dist.ProcessGroup | None) -> torch.Tensor:
    """Attention output o [S, n, G, d] (this rank's n heads, every row) -> [S, local, n * degree, d] (this rank's
    rows, every head)."""
    k = layout.degree
    s, n, _, d = o.shape
    send = o.permute(2, 0, 1, 3)[layout.scatter].contiguous()  # [destination rank, row, S, n, d]
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)  # recv[r]: this rank's rows, rank r's heads
    return recv.permute(2, 1, 0, 3, 4).reshape(s, layout.local, k * n, d)


__all__ = ["HeadSplit", "SequenceLayout", "chunk", "heads_to_rows", "rows_to_heads"]
