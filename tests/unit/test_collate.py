"""collate_packed: the batch contract the varlen attention kernels rely on."""

from __future__ import annotations

import torch


class _Tokens:
    """A stand-in processed sample of n tokens with raw labels (no -100 of its own)."""

    def __init__(self, n):
        self.key, self.input_ids, self.labels = "s", torch.arange(n), torch.arange(n)
        self.pixel_values = torch.zeros(0, 3, 4, 4, dtype=torch.uint8)


def test_collate_max_seqlen_counts_the_padding_tail_and_each_first_label_is_ignored():
    """The varlen kernels need max_seqlen >= every segment, the padding tail included (on CPU/SDPA too short a
    value changes nothing, so only this catches it); no prediction crosses into the next sample."""
    from nanovlm.data.collate import collate_packed

    b = collate_packed([_Tokens(3), _Tokens(2)], max_tokens=16, pad_id=0, image_size=4)
    cu = b["cu_seqlens"]
    assert b["max_seqlen"] == int((cu[1:] - cu[:-1]).max()) == 11
    assert b["labels"][0, 0] == -100 and b["labels"][0, 3] == -100


def test_a_batch_is_one_storage_carved_into_disjoint_tensors():
    """A DataLoader worker hands a batch over one shared-memory segment per storage: every tensor of a batch is a
    view of one storage (no two overlapping), and holds what it would hold on its own."""
    from nanovlm.data.collate import collate_packed, collate_padded

    imaged = _Tokens(2)
    imaged.pixel_values = torch.arange(2 * 3 * 4 * 4, dtype=torch.uint8).view(2, 3, 4, 4)
    packed = collate_packed([_Tokens(3), imaged], max_tokens=8, pad_id=9, image_size=4)
    padded = collate_padded([_Tokens(3), imaged], pad_id=9, image_size=4)
    for batch in (packed, padded):
        tensors = [v for v in batch.values() if isinstance(v, torch.Tensor)]
        assert len(tensors) >= 5 and len({t.untyped_storage().data_ptr() for t in tensors}) == 1
        spans = sorted((t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()) for t in tensors)
        assert all(end <= start for (_, end), (start, _) in zip(spans, spans[1:]))
        assert torch.equal(batch["pixel_values"], imaged.pixel_values)
    assert packed["input_ids"].tolist() == [[0, 1, 2, 0, 1, 9, 9, 9]]
    assert packed["labels"].tolist() == [[-100, 1, 2, -100, 1, -100, -100, -100]]
    assert packed["position_ids"].tolist() == [[0, 1, 2, 0, 1, 0, 1, 2]]
    assert packed["cu_seqlens"].tolist() == [0, 3, 5, 8]
    assert padded["input_ids"].tolist() == [[0, 1, 2], [0, 1, 9]]
    assert padded["position_ids"].tolist() == [[0, 1, 2], [0, 1, 0]]
    assert padded["attention_mask"].tolist() == [[1, 1, 1], [1, 1, 0]]


def test_images_of_another_size_are_refused_not_left_unwritten():
    """``cat`` into a view of the wrong shape would resize the view and leave the pack's pixel rows as they were
    allocated (uninitialised): a sample whose images are not ``image_size`` is an error naming it."""
    import pytest

    from nanovlm.data.collate import collate_packed, collate_padded

    odd = _Tokens(2)
    odd.key, odd.pixel_values = "odd", torch.zeros(1, 3, 5, 5, dtype=torch.uint8)
    for collate in (lambda s: collate_packed(s, 8, 0, 4), lambda s: collate_padded(s, 0, 4)):
        with pytest.raises(ValueError, match="'odd' has images of shape"):
            collate([_Tokens(3), odd])
