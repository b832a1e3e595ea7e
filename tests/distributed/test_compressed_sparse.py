"""``compressed --strategy.codec sparseloco``: the sparse codec as a gradient codec, 2 processes (fork).

Under SGD momentum it sends each rank's velocity (momentum correction, with momentum factor masking
as for ``topk``); every step's all-gather of packed messages leaves both ranks with the same model."""

import math

import lightning as L
import pytest
import torch

from gradsync.recipes import DigitsClassifier, DigitsData
from gradsync.strategies import CompressedStrategy
from harness import ValAccuracy, fit, max_abs_diff

pytestmark = pytest.mark.timeout(180)

STEPS = 60


def test_compressed_with_the_sparse_codec_trains_and_ranks_agree(tmp_path):
    L.seed_everything(0, verbose=False)
    module = DigitsClassifier()
    numel = sum(p.numel() for p in module.parameters())
    # 512-entry chunks, 32 per chunk: 6.25 % of the gradient each step (digits' 9,930 entries)
    strategy = CompressedStrategy(codec="sparseloco", sparse_chunk_size=512, sparse_k=32)
    ranks = fit(module, DigitsData(batch_size=32), strategy=strategy, devices=2, max_steps=STEPS, out=tmp_path,
                callbacks=(ValAccuracy(tmp_path),))
    assert max_abs_diff(ranks[0]["params"], ranks[1]["params"]) == 0.0
    acc = torch.load(tmp_path / "val_acc0.pt")
    assert acc > 0.5, f"val_acc {acc} (chance is 0.1)"
    chunks = math.ceil(numel / 512)
    # per chunk: 32 codes of log2(512 / 32) = 4 low index bits and a 2-bit value, a 32 + 512 / 2^4-bit bitmap;
    # one bucket: digits fits in DDP's first
    message = math.ceil(chunks * (32 * (4 + 2) + 32 + 512 // 2**4) / 8) + 4 * chunks
    assert ranks[0]["ledger"]["wire_bytes"] == STEPS * message
    print(f"compressed sparseloco on digits: val_acc {acc:.3f}, {message} bytes per step, "
          f"ratio {ranks[0]['ledger']['compression_ratio']:.0f}x")
