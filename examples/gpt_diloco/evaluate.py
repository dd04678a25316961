"""The demo's server-side evaluation: the validation loss of each global theta_r, computed at
the coordinator (``[evaluation] fn = "examples.gpt_diloco.evaluate:val_loss"`` in job.toml).

It uses the same held-out batches as the sites' own evaluation in ``train.py`` (4 batches of
8 windows from the validation files of a 4 MiB corpus), on the whole model in one process.
"""

from __future__ import annotations

from torch import nn

from examples.gpt_diloco.data import CorpusConfig, evaluate, load_corpus

EVAL_BATCHES = 4
BATCH_SIZE = 8
CORPUS_BYTES = 4 << 20


def val_loss(model: nn.Module, round: int) -> dict[str, float]:
    """``{"val_loss": ...}`` of ``model`` (theta after ``round`` rounds) on the held-out text."""
    corpus = load_corpus(CorpusConfig(max_bytes=CORPUS_BYTES, seq_len=model.config.seq_len))
    return {"val_loss": evaluate(model, corpus, EVAL_BATCHES, BATCH_SIZE)}
