"""Training and data, independent of the DSL: datasets, the training loop, checkpoints and sampling.

    import torch
    from energydsl import load
    from energydsl.training import TrainConfig, load_dataset, train
    torch.manual_seed(1337)  # the initial weights (TrainConfig.seed fixes the batches), as `energy train` does
    model = load("examples/models/gpt.energy").model("GPT")
    data = load_dataset("shakespeare_char")
    summary = train(model, data, TrainConfig(steps=2000, block_size=64), "runs/x")  # `energy sample runs/x` reads it
"""

from __future__ import annotations

from .config import TrainConfig
from .data import IGNORE_INDEX, LMDataset, TaskDataset, TextDataset, download_shakespeare, load_dataset
from .sampling import Codec, codec_from_json, load_checkpoint, sample, stream
from .trainer import train

__all__ = [
    "IGNORE_INDEX", "Codec", "LMDataset", "TaskDataset", "TextDataset", "TrainConfig", "codec_from_json",
    "download_shakespeare", "load_checkpoint", "load_dataset", "sample", "stream", "train",
]
