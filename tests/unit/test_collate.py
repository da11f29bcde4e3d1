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
