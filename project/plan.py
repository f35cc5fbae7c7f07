"""Plan a run: `python -m project.plan [model=NAME] [cluster=NAME] [cluster.nodes=N] [key=value ...]`.

Predicts, for every layout the strategies can build (data x tensor x pipeline degrees, micro batch,
schedule, recompute), the memory per device and the time per step, and prints them best first with the
best layout as `project.train` overrides; `out=DIR` also writes plan.json, plan.md and a wandb sweep
spec over the top `top_k` layouts; `format=json` prints JSON for scripts. The formulas and their sources
are in project/planning/.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import hydra
import yaml
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf

from project.config.command_line import check_command_line
from project.config.values import model_config
from project.model.flops import count_parameters, parameter_counts
from project.planning.candidates import SearchSpace
from project.planning.cluster import GIB, Cluster
from project.planning.memory import STORAGE_BYTES, Allowance
from project.planning.parameters import INIT_VALUES_PER_SECOND
from project.planning.placement import placement_line
from project.planning.planner import Workload, calibrated_fraction, plan
from project.planning.render import as_record, command_line, model_arguments, sweep_spec, table, train_overrides
from project.runtime.errors import ConfigError, exit_on_config_error


def workload(cfg: DictConfig) -> Workload:
    batch = cfg.global_batch_size
    if batch is None:
        if cfg.global_batch_tokens % cfg.seq_len:
            raise ConfigError(
                f"global_batch_tokens={cfg.global_batch_tokens} is not a whole number of sequences of "
                f"seq_len={cfg.seq_len}: set global_batch_size (sequences) instead, or a multiple of seq_len."
            )
        batch = cfg.global_batch_tokens // cfg.seq_len
    float8 = cfg.get("float8")
    return Workload(
        model_config(cfg), int(cfg.seq_len), int(batch), float(cfg.train_tokens), str(cfg.precision), float8
    )


def model_name(cfg: DictConfig) -> str | None:
    """The model preset, if the command line did not change its fields (then the overrides name them all)."""
    choice = HydraConfig.get().runtime.choices.get("model")
    changed = any(o.startswith("model.") for o in HydraConfig.get().overrides.task)
    return None if changed else choice


def run(cfg: DictConfig) -> dict:
    if cfg.format not in ("table", "json"):
        raise ConfigError(f"format={cfg.format}: choose table or json.")
    work, cluster = workload(cfg), Cluster.from_config(OmegaConf.to_container(cfg.cluster, resolve=True))
    space = SearchSpace(**OmegaConf.to_container(cfg.search, resolve=True))
    allowance, fraction, calibration = Allowance(**cfg.memory), float(cfg.achievable_fraction), None
    if cfg.calibrate.layout is not None and cfg.calibrate.mfu is None:
        raise ConfigError(
            f"calibrate.layout={cfg.calibrate.layout} needs calibrate.mfu: the MFU measured on that layout, e.g. 0.41."
        )
    if cfg.calibrate.mfu is not None:
        fraction, reference = calibrated_fraction(
            work, cluster, space, float(cfg.calibrate.mfu), cfg.calibrate.layout, allowance
        )
        calibration = {
            "layout": reference.prediction.candidate.name,
            "mfu": float(cfg.calibrate.mfu),
            "fits": reference.prediction.fits,
            "memory_bytes": reference.prediction.memory.total,
        }
    outcomes = plan(work, cluster, space, fraction, allowance)
    name = model_name(cfg)
    model = model_arguments(name, OmegaConf.to_container(cfg.model, resolve=True))
    overrides = train_overrides(outcomes[0].prediction.candidate, work, cluster, model)
    records = [as_record(o, train_overrides(o.prediction.candidate, work, cluster, model)) for o in outcomes]
    summary = {
        "model": name,
        "cluster": cluster.name,
        "devices": cluster.devices,
        "seq_len": work.seq_len,
        "global_batch_size": work.global_batch_size,
        "train_tokens": work.train_tokens,
        "precision": work.precision,
        "parameters": count_parameters(work.model),
        "active_parameters": count_parameters(work.model, active=True),
        "achievable_fraction": fraction,
        "calibrated_on": calibration,
        "layouts": records,
    }
    text = report(outcomes, cluster, work, name, overrides, fraction, calibration)
    if cfg.check_with_dry_run:
        top = [o for o in outcomes if o.prediction.fits][: cfg.top_k]
        checked = dry_run_states(top, work, cluster, model)
        for record, (outcome, share) in zip(records, checked):
            record["dry_run"] = {
                "rank": share.rank,
                "params": share.param_bytes,
                "grads": share.grad_bytes,
                "optimizer": share.optimizer_bytes,
            }
        text += "\n\n" + dry_run_table(checked)
    if cfg.out:
        folder = Path(cfg.out)
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "plan.json").write_text(json.dumps(summary, indent=1) + "\n")
        (folder / "plan.md").write_text(f"```text\n{text}\n```\n")
        top = [o for o in outcomes if o.prediction.fits][: cfg.top_k]
        spec = sweep_spec(f"plan-{folder.name}", top, work, cluster, model, folder)
        (folder / "sweep.yaml").write_text(yaml.safe_dump(spec, sort_keys=False))
        text += (
            f"\n\nwrote {folder}/plan.json, plan.md and sweep.yaml (the top {len(top)} layouts): "
            f"python -m project.sweep spec={folder}/sweep.yaml"
        )
    try:
        print(json.dumps(summary, indent=1) if cfg.format == "json" else text, flush=True)
    except BrokenPipeError:  # `python -m project.plan | head`: the reader has all it wanted
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    return summary


def dry_run_states(outcomes: list, work: Workload, cluster: Cluster, model: list[str]) -> list:
    """(outcome, RankShare) for each outcome: its layout run through `project.train dry_run=true`'s sharding
    (the strategy's own code on a fake process group) for the pipeline rank the formulas found fullest."""
    from hydra import compose

    from project.config.layout import plan_layout
    from project.planning.dry_run import rank_share

    checked = []
    for outcome in outcomes:
        candidate = outcome.prediction.candidate
        train_cfg = compose("train", overrides=train_overrides(candidate, work, cluster, model))
        layout = plan_layout(train_cfg, cluster.nodes, cluster.gpus_per_node)
        rank = outcome.prediction.memory.pipeline_rank * candidate.data_context_ranks * candidate.tensor_parallel
        checked.append((outcome, rank_share(train_cfg, layout, rank)))
    return checked


def dry_run_table(checked: list) -> str:
    width = max([len("layout")] + [len(o.prediction.candidate.name) for o, _ in checked])
    lines = [
        "model states per device (parameters, gradients, AdamW), the formulas against the dry run (project.train "
        "dry_run=true:",
        "the strategy's own sharding of the model on a fake process group of the cluster's size):",
        f"{'layout':<{width}} {'rank':>5} {'formulas GiB':>13} {'dry run GiB':>12} {'difference':>11}",
    ]
    for outcome, share in checked:
        predicted = outcome.prediction.memory.states
        lines.append(
            f"{outcome.prediction.candidate.name:<{width}} {share.rank:>5} {predicted / GIB:>13.2f} "
            f"{share.state_bytes / GIB:>12.2f} {predicted / share.state_bytes - 1:>+11.2%}"
        )
    return "\n".join(lines)


def report(
    outcomes,
    cluster: Cluster,
    work: Workload,
    name: str | None,
    overrides: list[str],
    fraction: float,
    calibration: dict | None,
) -> str:
    fitting = sum(o.prediction.fits for o in outcomes)
    head = (
        f"{name or 'model'} ({parameter_counts(work.model)}) on {cluster.nodes} x {cluster.gpus_per_node} "
        f"{cluster.name} ({cluster.devices} devices), "
        f"{work.global_batch_size} x {work.seq_len} tokens per step, {work.precision}: "
        f"{len(outcomes)} layouts, {fitting} fit"
    )
    basis = f"achievable_fraction {fraction:.3g}"
    if calibration:
        basis += (
            f", calibrated: {calibration['layout']} predicts the {calibration['mfu']:.1%} MFU given "
            "(calibrate.mfu) at it"
        )
        if not calibration["fits"]:
            basis += f" (though the formulas find it too large: {calibration['memory_bytes'] / GIB:.1f} GiB)"
    lines = [head, basis, "", table(outcomes, 10), ""]
    if fitting:
        best = next(o for o in outcomes if o.prediction.fits)
        values = best.prediction.memory.params / STORAGE_BYTES[work.precision]  # its fullest rank's parameters
        lines += [
            "best layout:",
            command_line(overrides),
            placement_line(best.prediction.candidate.shape, cluster.gpus_per_node),
            f"initialization: about {values / INIT_VALUES_PER_SECOND:.0f} s on its fullest rank, which draws only "
            f"its own {values / 1e9:.2f}B initial values ({INIT_VALUES_PER_SECOND / 1e6:.0f}M a second on one CPU "
            "core; none when resuming a checkpoint)",
        ]
    else:
        lines += ["no layout fits: add devices (cluster.nodes), shorten seq_len, or allow search.recompute=[full]."]
    return "\n".join(lines)


@hydra.main(version_base="1.3", config_path="../conf", config_name="plan")
def main(cfg: DictConfig) -> None:
    with exit_on_config_error():
        run(cfg)


if __name__ == "__main__":
    with exit_on_config_error():
        check_command_line(sys.argv[1:], config_name="plan")
    main()
