"""Packing algorithms: budgets, exactly-once placement, fill on long-tailed lengths, bounded carry-over."""

from __future__ import annotations

import numpy as np
import pytest

from nanovlm.data.packing import constrained, ffd_reference, pack_online, pad_to_longest, padded_slots


def long_tailed(n: int, seed: int = 0, mean_log: float = 5.0, sigma: float = 0.9, max_len: int = 8000):
    rng = np.random.default_rng(seed)
    lengths = np.clip(rng.lognormal(mean_log, sigma, n).astype(int) + 1, 1, max_len)
    images = rng.integers(0, 3, n)
    return lengths.tolist(), images.tolist()


def check_valid(res, lengths, images, max_tokens, max_images):
    placed = [i for p in res.packs for i in p]
    skipped = [i for v in res.skipped.values() for i in v]
    assert sorted(placed + skipped) == list(range(len(lengths)))  # every item exactly once
    for p in res.packs:
        assert p, "no empty pack"
        assert sum(res.lengths[i] for i in p) <= max_tokens
        assert sum(images[i] for i in p) <= max_images


@pytest.mark.parametrize("max_tokens,max_images,lookahead", [(4096, 16, 64), (1024, 4, 32), (512, 64, 8)])
def test_online_respects_budgets_and_places_every_item_once(max_tokens, max_images, lookahead):
    lengths, images = long_tailed(3000, seed=max_tokens)
    res = pack_online(lengths, images, max_tokens, max_images, lookahead=lookahead, max_carry=8)
    check_valid(res, lengths, images, max_tokens, max_images)
    assert sorted(res.skipped.get("overlength", [])) == [i for i, n in enumerate(lengths) if n > max_tokens]


def test_online_small_example_fills_largest_first():
    # pack 1: 6 + 4 fills it exactly (larger items are preferred); pack 2: 5 + 3 + 2
    res = pack_online([6, 5, 4, 3, 2], [0] * 5, max_tokens=10, max_images=8, lookahead=5, max_carry=8)
    assert res.packs == [[0, 2], [1, 3, 4]]
    # equal lengths: the oldest goes first
    res = pack_online([5, 5, 5, 5, 5], [0] * 5, max_tokens=10, max_images=8, lookahead=5)
    assert res.packs == [[0, 1], [2, 3], [4]]


def test_online_fills_packs_exactly_where_greedy_best_fit_cannot():
    # greedy best fit: 5+4, 4+3+2, 2 (three packs); the subset-sum fill finds 4+4+2 and 5+3+2 (two full packs)
    res = pack_online([3, 4, 2, 4, 5, 2], [0] * 6, max_tokens=10, max_images=8, lookahead=6)
    assert res.packs == [[1, 3, 2], [4, 0, 5]]


@pytest.mark.parametrize("max_tokens", [1024, 2048, 4096])
def test_online_packs_reach_the_lower_bound(max_tokens):
    """ceil(sum of lengths / budget) packs: no budget is left to a half-filled pack (greedy best fit leaves one
    to seven extra packs here)."""
    lengths, images = long_tailed(6000, seed=1)
    res = pack_online(lengths, images, max_tokens, 64, lookahead=64, max_carry=8)
    check_valid(res, lengths, images, max_tokens, 64)
    assert len(res.packs) == -(-res.real_tokens() // max_tokens)


def test_image_budget_binds():
    res = pack_online([10] * 9, [1] * 9, max_tokens=1000, max_images=2, lookahead=4)
    assert [len(p) for p in res.packs] == [2, 2, 2, 2, 1]
    assert [i for p in res.packs for i in p] == list(range(9))
    res = pack_online([10, 10], [3, 1], max_tokens=100, max_images=2)
    assert res.skipped == {"too_many_images": [0]} and res.packs == [[1]]


def test_fill_at_least_99_percent_on_long_tailed_lengths():
    """Token budget binds, samples small relative to it: steady-state fill >= 99% and close to offline FFD."""
    lengths, images = long_tailed(6000, seed=1)
    res = pack_online(lengths, images, 4096, 64, lookahead=64, max_carry=8)
    check_valid(res, lengths, images, 4096, 64)
    steady = res.packs[:-3]  # the last packs drain the buffer after the stream ends
    fill = sum(res.lengths[i] for p in steady for i in p) / (len(steady) * 4096)
    assert fill >= 0.99, fill
    ref = ffd_reference(lengths, images, 4096, 64)
    check_valid(ref, lengths, images, 4096, 64)
    assert len(res.packs) <= len(ref.packs) * 1.01 + 1
    # the flush-per-buffer alternative (pack each lookahead window alone) is clearly worse
    flushed = sum(
        len(ffd_reference(lengths[k : k + 64], images[k : k + 64], 4096, 64).packs) for k in range(0, 6000, 64)
    )
    assert flushed > len(res.packs) * 1.1


def test_carry_over_is_bounded():
    # one 40-token item among 50s: best fit alone would always prefer two 50s and starve it
    lengths = [40] + [50] * 200
    res = pack_online(lengths, [0] * len(lengths), max_tokens=100, max_images=8, lookahead=16, max_carry=3)
    where = next(k for k, p in enumerate(res.packs) if 0 in p)
    assert where == 3 and res.packs[3][0] == 0  # forced first into the pack after waiting max_carry packs
    none = pack_online(lengths, [0] * len(lengths), max_tokens=100, max_images=8, lookahead=16, max_carry=1000)
    assert next(k for k, p in enumerate(none.packs) if 0 in p) == len(none.packs) - 1  # starves without the bound
    # hard bound on random data: a forced item waits at most `lookahead` packs more
    lengths, images = long_tailed(4000, seed=2)
    for la, mc in [(64, 2), (32, 8), (128, 4)]:
        res = pack_online(lengths, images, 1024, 8, lookahead=la, max_carry=mc)
        check_valid(res, lengths, images, 1024, 8)
        assert res.max_wait <= mc + la


def test_overlength_drop_and_truncate():
    lengths, images = [10, 300, 20, 150], [0, 1, 0, 0]
    drop = pack_online(lengths, images, 100, 4, overlength="drop")
    assert drop.skipped == {"overlength": [1, 3]} and sorted(i for p in drop.packs for i in p) == [0, 2]
    trunc = pack_online(lengths, images, 100, 4, overlength="truncate")
    assert trunc.skipped == {} and trunc.truncated == [1, 3] and trunc.lengths == [10, 100, 20, 100]
    check_valid(trunc, lengths, images, 100, 4)
    with pytest.raises(ValueError, match="overlength"):
        pack_online(lengths, images, 100, 4, overlength="split")


def test_padded_baselines():
    lengths = [5, 9, 3, 200, 7, 1, 2]
    res = pad_to_longest(lengths, [0] * 7, batch_size=3, max_tokens=100)
    assert res.packs == [[0, 1, 2], [4, 5, 6]] and res.skipped == {"overlength": [3]}
    assert padded_slots(res) == 3 * 9 + 3 * 7
    res = constrained(lengths, [0] * 7, batch_size=3, cutoff=6, overlength="truncate")
    assert res.packs == [[0, 1, 2], [3, 4, 5], [6]] and res.lengths == [5, 6, 3, 6, 6, 1, 2]
    assert padded_slots(res) == 18 + 18 + 2


# Exact packs: budgets alone cannot tell a worse choice of samples (found by mutating the packer)


def test_overdue_samples_are_taken_first_into_the_subset():
    res = pack_online([3, 2, 5, 5, 10, 4, 6], [0] * 7, max_tokens=10, max_images=8, lookahead=4, max_carry=2)
    assert res.packs == [[2, 3], [4], [0, 5, 1], [6]] and res.max_wait == 2


def test_a_subset_that_fills_the_image_budget_exactly_is_taken():
    res = pack_online([3, 3, 4, 4, 2], [0, 2, 1, 1, 2], max_tokens=10, max_images=3, lookahead=5)
    assert res.packs == [[2, 0, 1], [3, 4]]


def test_empty_samples_are_skipped_as_empty():
    assert pack_online([0, 5], [0, 0], 10, 4).skipped == {"empty": [0]}
