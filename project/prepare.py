"""`python -m project.prepare [data=NAME | experiment=NAME] [data.KEY=VALUE ...]`: raw text -> token shards.

Training prepares missing shards itself (`data.auto_prepare=true`, the default); run this to prepare
them up front, e.g. once for a cluster. It does nothing when the shards in `data.dir` are up to date.
"""

import sys

import hydra
from omegaconf import DictConfig

from project.config.command_line import check_command_line
from project.config.data import refuse_shards_of_other_settings
from project.data.prepare import prepare_from_config
from project.runtime.errors import exit_on_config_error


@hydra.main(version_base="1.3", config_path="../conf", config_name="prepare")
@exit_on_config_error()
def main(cfg: DictConfig) -> dict:
    refuse_shards_of_other_settings(cfg)  # before the sources are fetched or read, as training's check words it
    return prepare_from_config(cfg.data)


if __name__ == "__main__":
    with exit_on_config_error():
        check_command_line(sys.argv[1:], config_name="prepare")
    main()
