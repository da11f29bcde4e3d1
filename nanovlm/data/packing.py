"""Packing algorithms: pure functions over (length, n_images) lists. No I/O, no tensors.

A *pack* is a list of item indices whose lengths fit one training sequence of ``max_tokens`` slots and whose
images fit the vision budget ``max_images``. Fill = real tokens / slots.

``pack_online`` is what training uses. It is online (it sees the stream through a bounded lookahead buffer, so
it runs in one pass and its output depends only on the order it is given) and it carries items that do not fit
the current pack over to later packs instead of flushing the whole buffer, which would leave a half-empty tail
pack every ``lookahead`` items. Each pack is filled by an exact subset-sum search over the buffer (a bitset
dynamic program: the most tokens that fit, often exactly ``max_tokens``), which is what closes the last percent
that greedy best-fit leaves (measured by ``scripts/benchmark.py --sections packing``). The carry-over is bounded
in age: an item that has waited ``max_carry`` packs is overdue; every pack starts with the oldest overdue item
and prefers overdue items in its search, so no item waits more than ``max_carry + lookahead`` packs.

``ffd_reference`` (offline first-fit-decreasing over everything, same two budgets) is the practical optimum
that fill is measured against; ``pad_to_longest`` and ``constrained`` are the padded baselines.
"""

from __future__ import annotations

import bisect
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

OVERLENGTH_CHOICES = ("drop", "truncate")


@dataclass
class PackResult:
    """Output of a batcher. Indices refer to positions in the input lists."""

    packs: list[list[int]]  # item indices per pack (packed mode) or per padded batch (baselines)
    lengths: list[int]  # effective length of every input item (clipped when truncated)
    skipped: dict[str, list[int]] = field(default_factory=dict)  # reason -> item indices never placed
    truncated: list[int] = field(default_factory=list)  # items whose length was clipped
    max_wait: int = 0  # most packs any item waited in the carry-over buffer (pack_online only)

    def real_tokens(self) -> int:
        return sum(self.lengths[i] for p in self.packs for i in p)

    def fill(self, slots_per_pack: int) -> float:
        """Real tokens / (packs x slots_per_pack)."""
        return self.real_tokens() / max(1, len(self.packs) * slots_per_pack)


SKIP_REASONS = ("empty", "too_many_images", "overlength")  # codes 1, 2, 3 of ``effective_lengths``


def effective_lengths(
    lengths: np.ndarray,
    n_images: np.ndarray,
    limit: int,
    max_images: int,
    overlength: str,
    prompts: np.ndarray | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """The over-length rule, vectorised: (effective lengths [n], in the dtype of ``lengths``; skip code int8 [n]).

    Code 0 = packed (its length clipped to ``limit`` when truncated), else ``SKIP_REASONS[code - 1]``, the first
    that applies. ``prompts`` (optional) are the tokens before each item's first loss token: truncating an item
    whose prompt alone reaches the limit would leave nothing to learn from, so it is skipped as ``overlength``
    rather than planned as a full pack that the reader then drops (an empty batch and a wasted step). The packers
    and the planner's pack-count bound (``shards.split_epoch``) both apply the rule through this function.
    """
    if overlength not in OVERLENGTH_CHOICES:
        raise ValueError(f"overlength must be one of {OVERLENGTH_CHOICES}, got {overlength!r}")
    n, m = np.asarray(lengths), np.asarray(n_images)  # dtypes kept: the planner passes int32 columns of N rows
    if len(n) != len(m) or (prompts is not None and len(prompts) != len(n)):
        raise ValueError(f"lengths ({len(n)}), n_images ({len(m)}) and prompts differ in length")
    over = n > limit
    prompt_fills = np.asarray(prompts) >= limit if prompts is not None else np.zeros(len(n), bool)
    code = np.zeros(len(n), np.int8)  # assigned from the last reason to the first, so the first that applies wins
    code[over & ((overlength == "drop") | prompt_fills)] = 3
    code[m > max_images] = 2
    code[n <= 0] = 1
    return np.where(over, limit, n), code


def _effective(
    lengths: Sequence[int],
    n_images: Sequence[int],
    limit: int,
    max_images: int,
    overlength: str,
    prompts: Sequence[int] | None = None,
) -> tuple[list[int], dict[str, list[int]], list[int]]:
    """``effective_lengths`` as the packers use it: (effective lengths, skipped indices by reason, truncated)."""
    eff, code = effective_lengths(np.asarray(lengths), np.asarray(n_images), limit, max_images, overlength, prompts)
    n = np.asarray(lengths, np.int64)
    skipped = {r: np.flatnonzero(code == c + 1).tolist() for c, r in enumerate(SKIP_REASONS) if (code == c + 1).any()}
    truncated = np.flatnonzero((code == 0) & (n > limit)).tolist()
    return np.where(code > 0, n, eff).tolist(), skipped, truncated


def _subset_fill(candidates: list[tuple[int, int]], room: int) -> list[int]:
    """Indices of a subset of ``candidates`` ((length, index) pairs) with the largest total <= ``room``.

    Bitset dynamic program: bit s of ``reach`` is set when some subset of the candidates seen so far sums to s.
    It stops at the first candidate that makes ``room`` reachable. Walking back, a candidate is left out
    whenever the sum stays reachable without it, so the ones listed first are the most likely to be chosen.
    """
    mask = (1 << (room + 1)) - 1
    reach = 1
    before: list[int] = []  # reach before each candidate, for the walk back
    for n, _ in candidates:
        before.append(reach)
        reach = (reach | (reach << n)) & mask
        if reach >> room & 1:
            break
    total = reach.bit_length() - 1
    chosen = []
    for (n, i), prev in zip(reversed(candidates[: len(before)]), reversed(before)):
        if not prev >> total & 1:
            chosen.append(i)
            total -= n
    return chosen[::-1]  # in candidate order


def pack_online(
    lengths: Sequence[int],
    n_images: Sequence[int],
    max_tokens: int,
    max_images: int,
    lookahead: int = 64,
    max_carry: int = 8,
    overlength: str = "drop",
    prompts: Sequence[int] | None = None,
) -> PackResult:
    """Online packing over a lookahead buffer: exact subset-sum fill, bounded carry-over.

    The buffer holds the next ``lookahead`` valid items of the stream. A pack is built by (1) placing the oldest
    overdue item (one that has waited ``max_carry`` packs), (2) choosing, among the buffered items that fit, a
    subset with the most tokens (``_subset_fill``; overdue items first, then the larger ones, oldest first among
    equals), skipped if that subset would exceed the image budget, then (3) refilling the buffer and topping up
    with the largest item that still fits both budgets until none does. Every valid item ends in exactly one pack.
    """
    if max_tokens <= 0 or max_images < 0 or lookahead <= 0 or max_carry < 0:
        raise ValueError("max_tokens and lookahead must be positive, max_images and max_carry non-negative")
    eff, skipped, truncated = _effective(lengths, n_images, max_tokens, max_images, overlength, prompts)
    invalid = {i for idx in skipped.values() for i in idx}
    buf = _Lookahead(eff, [int(m) for m in n_images], invalid, lookahead)
    packs: list[list[int]] = []
    while True:
        buf.refill(len(packs))
        if not buf.entered:
            break
        pack: list[int] = []
        # (1) the oldest overdue item goes first (it always fits an empty pack)
        oldest = buf.oldest()
        if oldest is not None and len(packs) - buf.entered[oldest] >= max_carry:
            buf.take(oldest, pack, len(packs))
        # (2) the subset of the buffer with the most tokens that fit, overdue items first, then larger ones
        room = max_tokens - buf.pack_tokens
        candidates = [(n, -neg) for n, neg in reversed(buf.items) if n <= room]  # largest first, oldest first
        candidates.sort(key=lambda c: len(packs) - buf.entered[c[1]] < max_carry)  # stable: overdue ones first
        chosen = _subset_fill(candidates, room) if candidates else []
        if buf.pack_images + sum(buf.imgs[i] for i in chosen) <= max_images:
            for i in chosen:
                buf.take(i, pack, len(packs))
        # (3) best fit from the refilled buffer: the largest item that fits what is left
        while (i := buf.largest_fit(max_tokens - buf.pack_tokens, max_images - buf.pack_images, len(packs))) >= 0:
            buf.take(i, pack, len(packs))
        packs.append(pack)
        buf.close_pack()
    return PackResult(packs, eff, skipped, truncated, buf.max_wait)


class _Lookahead:
    """The online packer's buffer: the next ``size`` valid items, sorted by length for best-fit lookups."""

    def __init__(self, eff: list[int], imgs: list[int], invalid: set[int], size: int) -> None:
        self.eff, self.imgs, self.invalid, self.size = eff, imgs, invalid, size
        self.items: list[tuple[int, int]] = []  # sorted (length, -index): bisect finds the largest fit, oldest first
        self.entered: dict[int, int] = {}  # index -> number of packs emitted when it entered the buffer
        self.arrival: deque[int] = deque()  # buffered indices in arrival order (lazily cleaned)
        self.next = 0
        self.max_wait = 0
        self.pack_tokens = self.pack_images = 0  # of the pack being built

    def refill(self, n_packs: int) -> None:
        while len(self.entered) < self.size and self.next < len(self.eff):
            i = self.next
            self.next += 1
            if i in self.invalid:
                continue
            bisect.insort(self.items, (self.eff[i], -i))
            self.entered[i] = n_packs
            self.arrival.append(i)

    def oldest(self) -> int | None:
        while self.arrival and self.arrival[0] not in self.entered:
            self.arrival.popleft()
        return self.arrival[0] if self.arrival else None

    def take(self, i: int, pack: list[int], n_packs: int) -> None:
        del self.items[bisect.bisect_left(self.items, (self.eff[i], -i))]
        self.max_wait = max(self.max_wait, n_packs - self.entered.pop(i))
        pack.append(i)
        self.pack_tokens += self.eff[i]
        self.pack_images += self.imgs[i]

    def close_pack(self) -> None:
        self.pack_tokens = self.pack_images = 0

    def largest_fit(self, room: int, img_room: int, n_packs: int) -> int:
        """The largest buffered item (oldest among equals) within both budgets, after a refill; -1 if none."""
        self.refill(n_packs)
        j = bisect.bisect_right(self.items, (room, 1)) - 1
        while j >= 0 and self.imgs[-self.items[j][1]] > img_room:
            j -= 1
        return -self.items[j][1] if j >= 0 else -1


def ffd_reference(
    lengths: Sequence[int], n_images: Sequence[int], max_tokens: int, max_images: int, overlength: str = "drop"
) -> PackResult:
    """Offline first-fit-decreasing with the same two budgets: the fill reference (needs the whole dataset)."""
    eff, skipped, truncated = _effective(lengths, n_images, max_tokens, max_images, overlength)
    invalid = {i for idx in skipped.values() for i in idx}
    order = sorted((i for i in range(len(eff)) if i not in invalid), key=lambda i: (-eff[i], i))
    cap = max(1, len(order))
    room = np.zeros(cap, dtype=np.int64)  # token room per open pack
    img_room = np.zeros(cap, dtype=np.int64)
    packs: list[list[int]] = []
    for i in order:
        n, m = eff[i], int(n_images[i])
        k = len(packs)
        fits = np.flatnonzero((room[:k] >= n) & (img_room[:k] >= m))
        if fits.size:
            b = int(fits[0])
        else:
            b = k
            packs.append([])
            room[b], img_room[b] = max_tokens, max_images
        packs[b].append(i)
        room[b] -= n
        img_room[b] -= m
    return PackResult(packs, eff, skipped, truncated)


def pad_to_longest(
    lengths: Sequence[int],
    n_images: Sequence[int],
    batch_size: int,
    max_tokens: int,
    overlength: str = "drop",
    prompts: Sequence[int] | None = None,
) -> PackResult:
    """Baseline: consecutive batches of ``batch_size`` samples, each padded to its longest sample.

    Slots of a batch = batch_size x longest; samples longer than ``max_tokens`` follow ``overlength``.
    """
    return constrained(lengths, n_images, batch_size, max_tokens, overlength, prompts)


def constrained(
    lengths: Sequence[int],
    n_images: Sequence[int],
    batch_size: int,
    cutoff: int,
    overlength: str = "drop",
    prompts: Sequence[int] | None = None,
) -> PackResult:
    """Baseline: like pad_to_longest, but the padded length is capped at ``cutoff`` (longer samples are
    dropped or truncated to it), which bounds the padding a single long sample can cause."""
    if batch_size <= 0 or cutoff <= 0:
        raise ValueError("batch_size and cutoff must be positive")
    eff, skipped, truncated = _effective(lengths, n_images, cutoff, 1 << 30, overlength, prompts)
    invalid = {i for idx in skipped.values() for i in idx}
    valid = [i for i in range(len(eff)) if i not in invalid]
    packs = [valid[k : k + batch_size] for k in range(0, len(valid), batch_size)]
    return PackResult(packs, eff, skipped, truncated)


def padded_slots(result: PackResult) -> int:
    """Slots used by padded batches: sum over batches of batch_size_actual x longest."""
    return sum(len(p) * max(result.lengths[i] for i in p) for p in result.packs if p)
