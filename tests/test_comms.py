"""The collectives a training step runs are the planner's: on every layout, each rank's calls of each kind on each
process group (counted by benchmarks.count_collectives while the run trains) are those project.planning.communication
plans for the same layout, model and batch, and their bytes within 10%.

One step is compared, the third of four: the first two add torch's pipeline shape exchange (the first) and DDP's
bucket rebuild (the second), and a logging step (the fourth, the last, here) reduces the metrics, agrees on a stop
signal and saves; setup's collectives come before training starts and are not counted.
"""

import pytest
from conftest import train_overrides

from benchmarks.comms import GLOBAL_BATCH, LAYOUTS, MICRO_BATCH, PRECISION, by_group, model_config, parse
from benchmarks.count_collectives import read_record
from project.planning.communication import by_kind, by_kind_and_group, collectives
from project.runtime.errors import ConfigError

pytestmark = pytest.mark.slow

SEQ_LEN, VOCAB_SIZE, STEPS, COMPARED = 32, 300, 4, 2  # tiny_shards' sequences and vocabulary
# (fsdp2-moe-ep2's groups are data x context's whole: fsdp2-moe-dp4-ep2 and the other 4-rank ones cover mixtures.)
ON_TWO = [name for name, layout in LAYOUTS.items() if layout.devices == 2 and name != "fsdp2-moe-ep2"]
# 2-D layouts (tp_fsdp without sequence parallelism is tp's case again; 3-D takes 8 processes: bench_comms runs it)
ON_FOUR = ["tp_fsdp-sp", "pipeline-fsdp2", "pipeline-tp-sp", "tp_fsdp-float8", "pipeline-fsdp2-float8",
           "fsdp2-moe-dp4-ep2", "fsdp2-moe-cp2-ep2", "tp_fsdp-sp-moe-ep2", "fsdp2-hsdp",
           "fsdp2-hsdp-replicas-at-last", "cp4-ring"]  # fmt: skip
# (pipeline-moe-dp2-ep2, bench_comms': its expert groups inside a stage are named and counted as tp_fsdp's.)
RUN = [f"trainer.max_steps={STEPS}", f"trainer.log_every_n_steps={STEPS}", "ckpt_every_n_steps=100",
       "val_every_n_steps=100", f"global_batch_size={GLOBAL_BATCH}", f"micro_batch_size={MICRO_BATCH}",
       f"trainer.precision={PRECISION}"]  # fmt: skip


@pytest.fixture(scope="module")
def counted(tiny_shards, tmp_path_factory):
    from in_process import train_in_process

    runs = {}
    for name in ON_TWO + ON_FOUR:
        layout = LAYOUTS[name]
        run_dir = tmp_path_factory.mktemp(f"comms-{name}")
        counter = ["+callbacks.comms._target_=benchmarks.count_collectives.CountCollectives",
                   f"+callbacks.comms.output_dir={run_dir}"]  # fmt: skip
        overrides = [*layout.overrides, f"trainer.devices={layout.devices}", f"model.n_layers={layout.layers}"]
        runs[name] = (run_dir, train_overrides(tiny_shards, run_dir, *RUN, *overrides, *counter))
    for devices, names in ((2, ON_TWO), (4, ON_FOUR)):
        train_in_process(devices, [runs[name] for name in names])
    return {name: run_dir for name, (run_dir, _) in runs.items()}


def check_layout(run_dir, name: str) -> None:
    layout = LAYOUTS[name]
    candidate = layout.candidate()
    shape = candidate.shape
    config = model_config(layout, VOCAB_SIZE)
    routed = []  # each rank's all-to-all bytes against the plan's
    for rank in range(layout.devices):
        record = read_record(run_dir, rank)
        assert sorted(record["steps"]) == list(range(STEPS)) and COMPARED not in record["logging_steps"], record
        measured = by_group(record["steps"][COMPARED], shape)
        plan = collectives(config, candidate, SEQ_LEN, PRECISION, layout.pipeline_rank(rank))
        planned = by_kind_and_group(plan)
        where = f"{name}, rank {rank}: measured {measured}, planned {planned}"
        assert sorted(measured) == sorted(planned), where  # the same kinds on the same groups
        for key, (calls, size) in measured.items():
            assert calls == planned[key][0], (key, where)
            if key[0] == "all_to_all":
                routed.append((size, planned[key][1]))
                # Half of them carry the rank's own tokens' copies (sent, and their results' gradients back).
                assert size >= planned[key][1] / 2, (key, where)
            else:
                assert size == pytest.approx(planned[key][1], rel=0.10), (key, where)
        # And so by kind, what the planner's step time is computed from.
        totals = {kind: (calls, size) for kind, (calls, size) in by_kind(plan).items()}
        assert {kind for kind, _ in measured} == set(totals), where
    # Each rank's bytes inside a node and across nodes (two processes standing for a node): the planner's split.
    from benchmarks.comms import measured_by_node, planned_by_node

    for rank in range(layout.devices):
        record = read_record(run_dir, rank)
        plan = collectives(config, candidate, SEQ_LEN, PRECISION, layout.pipeline_rank(rank))
        inside, across = measured_by_node(record["steps"][COMPARED], 2, layout.devices)
        planned_inside, planned_across = planned_by_node(plan, 2)
        if not routed:  # (a mixture's all-to-alls carry what its router sends: their mean is planned, above)
            assert inside == pytest.approx(planned_inside, rel=0.10), (name, rank, "inside")
            assert across == pytest.approx(planned_across, rel=0.10), (name, rank, "across")
    # What a rank receives for its experts depends on the routing; the plan's even spread is their mean: over every
    # rank, each sends its own tokens' copies and gets them back, and every copy sent is received by one rank.
    if routed:
        assert sum(m for m, _ in routed) == pytest.approx(sum(p for _, p in routed), abs=1), (name, routed)


@pytest.mark.parametrize("name", ON_TWO + ON_FOUR)
def test_each_ranks_collectives_of_a_step_are_the_planned_ones(counted, name):
    check_layout(counted[name], name)


def test_bench_comms_refuses_unknown_layouts_and_a_step_that_logs():
    assert parse([])["layouts"] == list(LAYOUTS)
    with pytest.raises(ConfigError, match="layouts=nope"):
        parse(["layouts=nope"])
    for step in ("1", "3"):  # DDP's bucket rebuild; the last step, which logs
        with pytest.raises(ConfigError, match=f"step={step} with steps=4"):
            parse([f"step={step}"])
