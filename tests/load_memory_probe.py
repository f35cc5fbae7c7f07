"""A callback for tests/test_resharded_loading.py, added to a run as `+callbacks.load_memory._target_=
tests.load_memory_probe.LoadMemory`: from `setup` (before the model is built) to the start of training, it samples the
process's resident anonymous memory (RssAnon: its own pages; a memory-mapped checkpoint file's pages are the kernel's
page cache, dropped under pressure, and not counted), and writes to `<output_dir>/load_memory/rank<R>.json` the
memory at setup, at `on_fit_start` (the model built and sharded, its optimizer made: a sharded strategy loads the
checkpoint right after), the peaks before and after that, and this rank's share of the training state: the bytes of
its parameters' and AdamW's tensors as they are laid out here."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from torch.distributed.tensor import DTensor


def resident_anonymous_bytes() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no RssAnon in /proc/self/status")


def local_bytes(tensor: torch.Tensor) -> int:
    local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
    return local.numel() * local.element_size()


class LoadMemory(Callback):
    def __init__(self, output_dir: str):
        self.output_dir = Path(output_dir)
        self._peak = self._at_setup = self._at_fit_start = self._peak_before_fit_start = 0
        self._done = threading.Event()
        self._sampler: threading.Thread | None = None

    def _sample(self) -> None:
        while not self._done.wait(0.002):
            self._peak = max(self._peak, resident_anonymous_bytes())

    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        self._at_setup = self._peak = resident_anonymous_bytes()
        self._sampler = threading.Thread(target=self._sample, daemon=True)
        self._sampler.start()

    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._at_fit_start = resident_anonymous_bytes()
        self._peak_before_fit_start, self._peak = max(self._peak, self._at_fit_start), self._at_fit_start

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._done.set()
        assert self._sampler is not None
        self._sampler.join()
        self._peak = max(self._peak, resident_anonymous_bytes())
        share = sum(local_bytes(p) for p in pl_module.parameters())
        for optimizer in trainer.optimizers:
            for state in optimizer.state.values():
                share += sum(local_bytes(v) for v in state.values() if isinstance(v, torch.Tensor))
        path = self.output_dir / "load_memory" / f"rank{trainer.global_rank}.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        memory = {"at_setup": self._at_setup, "at_fit_start": self._at_fit_start, "peak": self._peak}
        path.write_text(json.dumps({**memory, "peak_before_fit_start": self._peak_before_fit_start, "share": share}))
