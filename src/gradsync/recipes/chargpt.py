"""``chargpt``: a GPT-style decoder-only transformer that predicts text one character at a time.

The default corpus is the Python standard library's own source: the top-level ``*.py`` modules of
``sysconfig.get_paths()["stdlib"]`` that are plain ASCII, in sorted order (4.4 million characters
on CPython 3.11; present wherever Python is, nothing to download). ``--data.path FILE`` trains on
any UTF-8 text file instead. The last ``val_fraction`` of the text is held out for validation.

The vocabulary is the sorted set of characters in the corpus; the data builds it and the model
reads it at set-up, and the context length is the model's ``block_size`` (the data reads it), so
neither has to be given twice.

Sizes (parameters, with a ~100-character vocabulary)::

    --model.n_layer 4  --model.n_head 4  --model.n_embd 128 --model.block_size 128   ~0.8M (default)
    --model.n_layer 6  --model.n_head 6  --model.n_embd 384 --model.block_size 256   ~10.7M
    --model.n_layer 12 --model.n_head 12 --model.n_embd 768 --model.block_size 256   ~85M
    --model.n_layer 14 --model.n_head 16 --model.n_embd 768 --model.block_size 512   ~99M
"""

from __future__ import annotations

import sysconfig
from pathlib import Path
from typing import Any, Literal, Optional

import numpy as np
import torch
import torch.nn.functional as F
from torch.utils.data import Dataset
from torchmetrics.text import Perplexity

from gradsync.errors import GradsyncError, check
from gradsync.recipes.base import Recipe, RecipeData, Scheduler
from gradsync.recipes.transformer import Block, Transformer, TransformerConfig, count_parameters


# ---- corpus -----------------------------------------------------------------------------------
def stdlib_corpus_files() -> list[Path]:
    """The default corpus: the standard library's top-level modules that are plain ASCII, sorted."""
    root = Path(sysconfig.get_paths()["stdlib"])
    return [f for f in sorted(root.glob("*.py")) if f.read_bytes().isascii()]


def read_corpus(path: Optional[str] = None, max_chars: Optional[int] = None) -> str:
    """The text of ``path``, or of the standard-library corpus; at most ``max_chars`` characters."""
    if path is not None:
        try:
            text = Path(path).read_text(encoding="utf-8")
        except UnicodeDecodeError as exc:
            raise GradsyncError(f"--data.path {path}: not UTF-8 text ({exc.reason} at byte {exc.start})") from None
        return text[:max_chars] if max_chars else text
    parts, size = [], 0
    for f in stdlib_corpus_files():
        parts.append(f.read_text(encoding="ascii"))
        size += len(parts[-1])
        if max_chars and size >= max_chars:
            break
    return "".join(parts)[:max_chars] if max_chars else "".join(parts)


def encode(text: str, vocab: str) -> torch.Tensor:
    """Characters -> int32 ids (vectorized: a lookup table indexed by code point)."""
    codes = np.frombuffer(text.encode("utf-32-le"), dtype=np.uint32)
    table = np.full(max(int(codes.max(initial=0)), max(map(ord, vocab))) + 1, -1, dtype=np.int32)
    table[[ord(c) for c in vocab]] = np.arange(len(vocab), dtype=np.int32)
    ids = table[codes]
    if (ids < 0).any():
        missing = sorted({text[i] for i in np.flatnonzero(ids < 0)[:100]})
        raise GradsyncError(f"characters {''.join(missing)!r} are not in the model's vocabulary")
    return torch.from_numpy(ids)


def decode(ids: Any, vocab: str) -> str:
    return "".join(vocab[int(i)] for i in ids)


class Windows(Dataset):
    """Item i is (input, target): ``block_size`` characters from ``starts[i]`` and the same shifted by one."""

    def __init__(self, ids: torch.Tensor, block_size: int, starts: torch.Tensor) -> None:
        self.ids, self.block_size, self.starts = ids, block_size, starts

    def __len__(self) -> int:
        return len(self.starts)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        s = int(self.starts[i])
        chunk = self.ids[s : s + self.block_size + 1].long()
        return chunk[:-1], chunk[1:]


# ---- data -------------------------------------------------------------------------------------
class TextWindows(RecipeData):
    """Windows of ``block_size + 1`` ids of a text corpus: non-overlapping for training, a fixed evenly
    spaced subset of the held-out end for validation. Subclasses say how text becomes ids
    (:meth:`tokenize`); ``block_size`` is read from the model at set-up."""

    #: what an id is, for messages
    unit: str = "characters"
    #: a model that has a ``block_size``, for the message when the model has none
    example_model: str = "gradsync.recipes.chargpt.CharGPT"
    # set by the subclass's __init__
    path: Optional[str]
    max_chars: Optional[int]
    val_fraction: float
    val_windows: int
    block_size: Optional[int]

    def tokenize(self, text: str) -> torch.Tensor:
        raise NotImplementedError

    def setup(self, stage: str) -> None:
        if self.train_set is not None:
            return
        if self.block_size is None:
            model = self.trainer.lightning_module if self.trainer is not None else None
            if getattr(model, "block_size", None) is None:
                raise GradsyncError(f"{type(self).__name__} needs the model's block_size: train it with a model that "
                                    f"has one (e.g. {self.example_model}) or set data.block_size first")
            self.block_size = int(model.block_size)
        ids = self.tokenize(read_corpus(self.path, self.max_chars))
        split = int(len(ids) * (1 - self.val_fraction))
        train, val = ids[:split], ids[split:]
        block = self.block_size
        source = self.path or "the standard-library corpus"
        for part, n in (("training", len(train)), ("validation", len(val))):
            if n < block + 1:
                raise GradsyncError(f"{source}: its {part} part has {n} {self.unit}, fewer than block_size + 1 = "
                                    f"{block + 1}; use a longer text or a smaller --model.block_size")
        # Training: non-overlapping windows, visited in the order the sampler draws them.
        self.train_set = Windows(train, block, torch.arange(0, len(train) - block, block))
        # Validation: a fixed, evenly spaced subset, so its cost does not grow with the corpus.
        last = len(val) - block - 1
        count = min(self.val_windows, last + 1)
        self.val_set = Windows(val, block, torch.linspace(0, last, count).round().long())


class CharData(TextWindows):
    """Character windows of a text corpus (default: the Python standard library's source)."""

    def __init__(self, *, path: Optional[str] = None, max_chars: Optional[int] = None, val_fraction: float = 0.1,
                 val_windows: int = 256, batch_size: int = 32) -> None:
        """
        Args:
            path: a UTF-8 text file to train on; default: the standard library's top-level modules.
            max_chars: use only the first ``max_chars`` characters of the corpus (quick runs), >= 1.
            val_fraction: the share of the text, taken from its end, held out for validation, in (0, 0.5].
            val_windows: how many evenly spaced windows of the held-out text validation reads, >= 1.
            batch_size: per-process micro-batch size in windows, >= 1.
        """
        super().__init__(batch_size=batch_size)
        check(path is None or Path(path).is_file(), "path", path, "is not a file", "give a UTF-8 text file")
        check(max_chars is None or max_chars >= 1, "max_chars", max_chars, "must be >= 1")
        check(0 < val_fraction <= 0.5, "val_fraction", val_fraction, "must be in (0, 0.5]")
        check(val_windows >= 1, "val_windows", val_windows, "must be >= 1")
        self.path, self.max_chars, self.val_fraction, self.val_windows = path, max_chars, val_fraction, val_windows
        self.vocab: Optional[str] = None
        self.block_size: Optional[int] = None  # the model's context length; read from it in setup()

    def tokenize(self, text: str) -> torch.Tensor:
        self.vocab = "".join(sorted(set(text)))
        return encode(text, self.vocab)


# ---- model ------------------------------------------------------------------------------------
class CharGPT(Recipe):
    """A GPT-style transformer over characters (default corpus: the Python standard library)."""

    metric_name = "val_ppl"
    #: FSDP2 units under ``--strategy.shard node``: each transformer block (embeddings and head: the root)
    shard_modules = (Block,)

    def __init__(self, *, n_layer: int = 4, n_head: int = 4, n_embd: int = 128, block_size: int = 128,
                 dropout: float = 0.0, optimizer: Literal["sgd", "adamw", "muon"] = "adamw", lr: float = 2e-3,
                 betas: tuple[float, float] = (0.9, 0.99), weight_decay: float = 0.1,
                 scheduler: Scheduler = "cosine", warmup_steps: int = 50, min_lr_ratio: float = 0.1,
                 **kwargs: Any) -> None:
        """
        Args:
            n_layer: transformer blocks, >= 1.
            n_head: attention heads per block; must divide ``n_embd``.
            n_embd: width of the residual stream, >= 1.
            block_size: context length in characters (the data cuts windows of this length), >= 1.
            dropout: dropout on attention, residual and embedding outputs, in [0, 1); 0 keeps
                data-parallel runs exactly comparable with single-process ones.
            optimizer: ``adamw`` (default here), ``sgd``, or ``muon``: ``torch.optim.Muon`` on the
                blocks' weight matrices, AdamW on the (tied) embedding and head, positions, norms and
                biases, at the same ``lr`` and ``weight_decay`` (MuLoCo, arXiv 2505.23725).
            lr: peak learning rate, > 0.
            betas: AdamW's moment decay rates; 0.99 suits the few tokens per step of small runs.
            weight_decay: decoupled weight decay of matrices and embeddings (not biases, norms), >= 0.
            scheduler: ``cosine`` (default here) or ``constant``, after ``warmup_steps``.
            warmup_steps: optimizer steps of linear warm-up, >= 0.
            min_lr_ratio: the cosine's floor as a fraction of ``lr``, in [0, 1].
            **kwargs: the other :class:`~gradsync.recipes.base.Recipe` options (``momentum``, ``decay_steps``).
        """
        super().__init__(optimizer=optimizer, lr=lr, betas=betas, weight_decay=weight_decay, scheduler=scheduler,
                         warmup_steps=warmup_steps, min_lr_ratio=min_lr_ratio, **kwargs)
        check(n_layer >= 1, "n_layer", n_layer, "must be >= 1")
        check(n_embd >= 1, "n_embd", n_embd, "must be >= 1")
        check(n_head >= 1 and n_embd % n_head == 0, "n_head", n_head, f"must divide n_embd={n_embd}",
              "e.g. --model.n_head 4 with --model.n_embd 128")
        check(block_size >= 1, "block_size", block_size, "must be >= 1")
        check(0 <= dropout < 1, "dropout", dropout, "must be in [0, 1)")
        self.n_layer, self.n_head, self.n_embd, self.block_size, self.dropout = (
            n_layer, n_head, n_embd, block_size, dropout)
        self.save_hyperparameters()
        self.vocab: Optional[str] = None
        self.net: Optional[Transformer] = None
        self.val_ppl = Perplexity()

    # ---- building: the vocabulary comes from the data -----------------------------------
    def build(self, vocab: str) -> None:
        """Create the network for ``vocab`` (the characters, in id order). Idempotent for the same vocab."""
        if self.net is not None:
            if vocab != self.vocab:
                raise GradsyncError(f"the model was built for a {len(self.vocab or '')}-character vocabulary and the "
                                    f"data has {len(vocab)} characters: train and resume on the same corpus")
            return
        self.vocab = vocab
        self.net = Transformer(TransformerConfig(vocab_size=len(vocab), block_size=self.block_size,
                                                 n_layer=self.n_layer, n_head=self.n_head, n_embd=self.n_embd,
                                                 dropout=self.dropout))

    def setup(self, stage: str) -> None:
        data = self.trainer.datamodule if self.attached_trainer is not None else None
        vocab = getattr(data, "vocab", None)
        if vocab is None and self.net is None:
            raise GradsyncError("CharGPT takes its vocabulary from the data: train it with CharData "
                                "(or another DataModule with a .vocab), or call model.build(vocab) first")
        if vocab is not None:
            self.build(vocab)

    def on_save_checkpoint(self, checkpoint: dict) -> None:
        super().on_save_checkpoint(checkpoint)
        checkpoint["chargpt_vocab"] = self.vocab

    def on_load_checkpoint(self, checkpoint: dict) -> None:
        # Also reached by CharGPT.load_from_checkpoint before the weights are loaded.
        if checkpoint.get("chargpt_vocab"):
            self.build(checkpoint["chargpt_vocab"])

    @property
    def num_parameters(self) -> int:
        vocab = len(self.vocab) if self.vocab is not None else 100
        return count_parameters(self.n_layer, self.n_embd, vocab, self.block_size)

    # ---- training -------------------------------------------------------------------------
    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.net(idx)

    def compute_loss(self, batch: Any) -> tuple[torch.Tensor, int]:
        x, y = batch
        logits = self(x)
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))
        return loss, y.numel()  # weight: tokens, so accumulation normalizes per token

    def count_tokens(self, batch: Any) -> int:
        return int(batch[1].numel())

    def parameter_groups(self) -> list[dict]:
        params = [p for p in self.parameters() if p.requires_grad]
        return [{"params": [p for p in params if p.dim() >= 2]},
                {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]

    def muon_parameters(self) -> list[torch.nn.Parameter]:
        """The transformer blocks' weight matrices (attention and MLP): not the token embedding,
        which is also the output head, nor the position embedding."""
        return [p for p in self.net.blocks.parameters() if p.requires_grad and p.dim() == 2]

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        logits = self(x)
        self.log("val_loss", F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1)),
                 prog_bar=True, sync_dist=True)
        self.val_ppl.update(logits.float(), y)
        self.log("val_ppl", self.val_ppl, prog_bar=True)

    def test_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        logits = self(x)
        self.log("test_loss", F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1)), sync_dist=True)
        self.val_ppl.update(logits.float(), y)
        self.log("test_ppl", self.val_ppl)

    # ---- generation -----------------------------------------------------------------------
    def sample(self, prompt: str = "", num_chars: int = 200, *, temperature: float = 0.8,
               top_k: Optional[int] = None, seed: int = 0) -> str:
        """``num_chars`` characters generated after ``prompt`` (the prompt itself is not returned)."""
        if self.net is None:
            raise GradsyncError("the model has no vocabulary yet: train it, or load it from a checkpoint")
        check(num_chars >= 0, "num_chars", num_chars, "must be >= 0")
        check(temperature >= 0, "temperature", temperature, "must be >= 0 (0: always the likeliest character)")
        check(top_k is None or top_k >= 1, "top_k", top_k, "must be >= 1")
        start = prompt or ("\n" if "\n" in self.vocab else self.vocab[0])
        idx = encode(start, self.vocab).long().unsqueeze(0).to(self.device)
        gen = torch.Generator().manual_seed(seed)
        was_training = self.training
        self.eval()
        try:
            out = self.net.generate(idx, num_chars, temperature=temperature, top_k=top_k, generator=gen)
        finally:
            self.train(was_training)
        return decode(out[0, idx.shape[1]:].tolist(), self.vocab)
