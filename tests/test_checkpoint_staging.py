"""The background save's host copies (project.checkpoint.staging): every save a snapshot of the state as it was when
staged, into the same host tensors as the save before where the state kept its shape."""

import gc
import weakref
from collections import OrderedDict

import pytest
import torch

from project.checkpoint.staging import ReusedHostCopies, tensor_places


class Records:
    """An object of a kind the stager does not walk (as Lightning's loop records are)."""

    def __init__(self, steps: int):
        self.steps = steps
        self.log = [steps]


def training_state(step: int) -> dict:
    weights = OrderedDict(w=torch.full((3, 4), float(step)), b=torch.arange(4.0) + step)
    return {
        "state_dict": weights,
        "optimizer": {"state": {0: {"step": torch.tensor(float(step)), "exp_avg": torch.ones(3, 4) * step}},
                      "param_groups": [{"lr": 0.1 / (step + 1), "betas": (0.9, 0.95), "params": ["w", "b"]}]},
        "records": Records(step),
        "views": [weights["w"][0], (weights["w"][1:], "named")],
    }  # fmt: skip


def snapshot(state: dict) -> dict:
    """What `state` holds now, by value, for comparison after the source has changed."""
    return {
        "w": state["state_dict"]["w"].clone(),
        "b": state["state_dict"]["b"].clone(),
        "exp_avg": state["optimizer"]["state"][0]["exp_avg"].clone(),
        "step": float(state["optimizer"]["state"][0]["step"]),
        "lr": state["optimizer"]["param_groups"][0]["lr"],
        "steps": state["records"].steps,
        "row": state["views"][0].clone(),
        "rows": state["views"][1][0].clone(),
    }


def assert_equal_snapshots(got: dict, expected: dict) -> None:
    assert got.keys() == expected.keys()
    for key, value in expected.items():
        if isinstance(value, torch.Tensor):
            assert torch.equal(got[key], value), key
        else:
            assert got[key] == value, key


def step_in_place(state: dict, step: int) -> None:
    """An optimizer step as training takes it: the same tensors, new values; the plain records replaced."""
    state["state_dict"]["w"].fill_(float(step))
    state["state_dict"]["b"].copy_(torch.arange(4.0) + step)
    state["optimizer"]["state"][0]["exp_avg"].fill_(float(step))
    state["optimizer"]["state"][0]["step"].fill_(float(step))
    state["optimizer"]["param_groups"][0]["lr"] = 0.1 / (step + 1)
    state["records"].steps = step


def test_each_stage_holds_the_state_as_it_was_when_staged_into_the_same_host_tensors():
    stager = ReusedHostCopies(pinned=False)
    state = training_state(1)
    first = stager.stage(state)
    assert_equal_snapshots(snapshot(first), snapshot(state))
    kept = snapshot(first)

    step_in_place(state, 2)  # training goes on: the first copy must not change with it ...
    assert_equal_snapshots(snapshot(first), kept)
    second = stager.stage(state)  # ... until the next save, which writes into the same host tensors
    assert_equal_snapshots(snapshot(second), snapshot(state))
    assert second["state_dict"]["w"] is first["state_dict"]["w"]
    assert second["optimizer"]["state"][0]["exp_avg"] is first["optimizer"]["state"][0]["exp_avg"]
    assert type(second["state_dict"]) is OrderedDict and isinstance(second["views"][1], tuple)
    # Copies, never the training tensors themselves; the other records copied too
    assert second["state_dict"]["w"].data_ptr() != state["state_dict"]["w"].data_ptr()
    assert second["records"] is not state["records"] and second["records"].log is not state["records"].log
    step_in_place(state, 3)
    assert second["state_dict"]["w"].max() == 2.0 and second["records"].steps == 2
    stager.close()


def test_a_tensor_new_to_the_state_or_of_another_shape_gets_a_copy_of_its_own_and_the_others_keep_theirs():
    stager = ReusedHostCopies(pinned=False)
    state = training_state(1)
    first = stager.stage(state)
    state["state_dict"]["w"] = torch.full((5, 4), 7.0)  # another size at the same place
    state["state_dict"]["extra"] = torch.zeros(2)  # and a new tensor
    again = stager.stage(state)
    assert again["state_dict"]["w"] is not first["state_dict"]["w"]
    assert torch.equal(again["state_dict"]["w"], torch.full((5, 4), 7.0))
    assert torch.equal(again["state_dict"]["extra"], torch.zeros(2))
    assert again["optimizer"]["state"][0]["exp_avg"] is first["optimizer"]["state"][0]["exp_avg"]
    state["state_dict"]["b"] = state["state_dict"]["b"].double()  # another dtype
    assert stager.stage(state)["state_dict"]["b"].dtype == torch.float64
    stager.close()


def test_tied_tensors_that_stop_sharing_their_memory_each_keep_their_own_values():
    """Tied at the first save (one host copy for both, as torch stages them), apart at the next: the second is
    given a copy of its own instead of overwriting the first's."""
    stager = ReusedHostCopies(pinned=False)
    tied = torch.ones(3, 4)
    first = stager.stage({"embedding": tied, "head": tied})
    assert first["embedding"].data_ptr() == first["head"].data_ptr()  # shared, as at the source
    again = stager.stage({"embedding": torch.full((3, 4), 2.0), "head": torch.full((3, 4), 3.0)})
    assert torch.equal(again["embedding"], torch.full((3, 4), 2.0)) and again["embedding"] is first["embedding"]
    assert torch.equal(again["head"], torch.full((3, 4), 3.0))
    tied.fill_(4.0)  # tied again: each place copies into its own copy from now on, with the values of the source
    last = stager.stage({"embedding": tied, "head": tied})
    assert torch.equal(last["embedding"], tied) and torch.equal(last["head"], tied)
    assert last["head"] is again["head"]
    stager.close()


def test_a_view_that_stops_being_one_keeps_its_own_values_and_the_whole_its_own():
    """A row staged as a view into its matrix's copy: once the row is a tensor of its own, writing it into that view
    would change the matrix's copy."""
    stager = ReusedHostCopies(pinned=False)
    matrix = torch.zeros(3, 4)
    first = stager.stage({"matrix": matrix, "row": matrix[1]})
    assert first["row"].untyped_storage().data_ptr() == first["matrix"].untyped_storage().data_ptr()
    again = stager.stage({"matrix": torch.ones(3, 4), "row": torch.full((4,), 5.0)})
    assert torch.equal(again["matrix"], torch.ones(3, 4)) and torch.equal(again["row"], torch.full((4,), 5.0))
    matrix.fill_(2.0)  # a view again, at the same place: copied as such
    last = stager.stage({"matrix": matrix, "row": matrix[1]})
    assert torch.equal(last["matrix"], matrix) and torch.equal(last["row"], matrix[1])
    stager.close()


def test_a_modules_state_dict_keeps_its_version_records_at_every_stage():
    """torch's module state dicts carry their modules' versions (read by load_state_dict) beside the tensors."""
    stager = ReusedHostCopies(pinned=False)
    module = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.LayerNorm(2))
    for _ in range(2):
        staged = stager.stage({"state_dict": module.state_dict()})["state_dict"]
        assert vars(staged) == vars(module.state_dict()) and vars(staged)
        torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.LayerNorm(2)).load_state_dict(staged)
    stager.close()


def check_fsdp2_state_staged_again_saves_and_loads(folder: str) -> None:
    """FSDP2's shards (DTensors) staged twice: the second save's copies are the first's host tensors holding the
    new values, and torch's distributed checkpoint writes them and loads them back into another model."""
    import torch.distributed.checkpoint as dcp
    from test_parallel_in_process import CONFIG
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor

    from project.model.llama import Llama
    from project.parallel.fsdp2 import apply_fsdp2

    def sharded(seed: int) -> tuple[Llama, torch.optim.Optimizer]:
        torch.manual_seed(seed)
        model = Llama(CONFIG)
        apply_fsdp2(model, init_device_mesh("cpu", (2,)))
        return model, torch.optim.AdamW(model.parameters(), lr=1e-2)

    def step(model: Llama, optimizer: torch.optim.Optimizer) -> None:
        tokens = torch.randint(0, CONFIG.vocab_size, (2, 16), generator=torch.Generator().manual_seed(7))
        model(tokens).sum().backward()
        optimizer.step()
        optimizer.zero_grad()

    def state(model: Llama, optimizer: torch.optim.Optimizer) -> dict:
        return {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, optimizer)}

    def values(state: dict) -> dict:
        return {
            place: (tensor.to_local().clone(), tensor.placements) if isinstance(tensor, DTensor) else tensor.clone()
            for place, tensor in _places(state)
        }

    model, optimizer = sharded(0)
    step(model, optimizer)
    stager = ReusedHostCopies(pinned=False)
    first = stager.stage(state(model, optimizer))
    kept = values(first)
    assert kept.keys() == values(state(model, optimizer)).keys() and any(isinstance(v, tuple) for v in kept.values())
    step(model, optimizer)
    for place, value in values(first).items():  # training went on; the copy did not
        assert _equal(value, kept[place]), place
    second = stager.stage(state(model, optimizer))
    now = values(state(model, optimizer))
    for (place, staged), (_, earlier) in zip(_places(second), _places(first)):
        assert staged is earlier, place  # the same host tensors ...
        assert _equal(values(second)[place], now[place]), place  # ... holding this step's values
    assert any(not _equal(now[place], kept[place]) for place in now)

    dcp.save(second, checkpoint_id=folder)
    other, other_optimizer = sharded(1)
    step(other, other_optimizer)  # its optimizer state exists, with other values
    loaded = state(other, other_optimizer)
    dcp.load(loaded, checkpoint_id=folder)
    for place, value in values(loaded).items():
        assert _equal(value, now[place]), place
    stager.close()


def _places(state: dict) -> list:
    return list(tensor_places(state))


def _equal(a, b) -> bool:
    if isinstance(a, tuple):
        return a[1] == b[1] and torch.equal(a[0], b[0])
    return torch.equal(a, b)


@pytest.mark.slow
def test_fsdp2_shards_are_staged_again_into_the_same_host_tensors_and_saved_as_torch_saves_them(tmp_path):
    from test_parallel_in_process import on_two_gloo_ranks

    on_two_gloo_ranks(check_fsdp2_state_staged_again_saves_and_loads, str(tmp_path / "checkpoint"))


def test_copies_of_tensors_the_state_no_longer_holds_are_let_go():
    stager = ReusedHostCopies(pinned=False)
    state = training_state(1)
    state["extra"] = torch.zeros(1000)
    copy_of_extra = weakref.ref(stager.stage(state)["extra"])
    del state["extra"]
    staged = stager.stage(state)
    gc.collect()
    assert "extra" not in staged and copy_of_extra() is None
    assert stager.stage(state)["state_dict"]["w"] is staged["state_dict"]["w"]  # the others still reused
