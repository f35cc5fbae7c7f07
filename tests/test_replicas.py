"""The digest ReplicaCheck compares copies by (project.training.callbacks.replicas): exact, piece by piece."""

import torch

from project.training.callbacks import replicas


def test_a_digest_taken_in_pieces_is_the_whole_tensors_and_one_unit_in_the_last_place_changes_it(monkeypatch):
    tensor = torch.randn(5, 7, generator=torch.Generator().manual_seed(0))
    bits = tensor.view(torch.int32).flatten().long()
    whole = torch.stack([bits.sum(), (bits * torch.arange(1, bits.numel() + 1)).sum()])  # computed at once
    monkeypatch.setattr(replicas, "PIECE", 8)  # 35 elements in 5 pieces, the last one short
    assert torch.equal(replicas.digest(tensor), whole)
    moved = tensor.clone()
    moved[3, 4] = torch.nextafter(moved[3, 4], torch.tensor(float("inf")))
    assert not torch.equal(replicas.digest(moved), whole)
    swapped = tensor.flatten().flip(0).view(5, 7)  # the same values elsewhere: the weighted sum tells them apart
    assert not torch.equal(replicas.digest(swapped), whole)
    assert torch.equal(replicas.digest(tensor.bfloat16()), replicas.digest(tensor.bfloat16().clone()))
