"""`python -m project.prepare [data=NAME | experiment=NAME] [data.KEY=VALUE ...]`: raw text -> token shards.

Run it once before training with the same data settings; it does nothing when the shards in
`data.dir` are already up to date.
"""

import hydra
from omegaconf import DictConfig

from project.data.prepare import prepare_shards
from project.errors import exit_on_config_error


@hydra.main(version_base="1.3", config_path="../conf", config_name="prepare")
@exit_on_config_error()
def main(cfg: DictConfig) -> dict:
    data = cfg.data
    return prepare_shards(
        data.sources if isinstance(data.sources, str) else list(data.sources),
        data.dir,
        tokenizer=data.tokenizer,
        vocab_size=data.vocab_size,
        seq_len=data.seq_len,
        val_fraction=data.val_fraction,
        text_field=data.text_field,
        num_workers=data.prepare_workers,
        seed=data.seed,
        overwrite=data.overwrite,
        fetch=data.fetch,
    )


if __name__ == "__main__":
    main()
