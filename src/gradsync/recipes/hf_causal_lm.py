"""``hf_causal_lm``: any Hugging Face ``transformers`` causal language model, built from a config.

The model is ``AutoModelForCausalLM.from_config`` of ``--model.arch`` (a transformers model type:
``gpt2``, ``llama``, ``qwen2``, ``mistral``, ...) with random weights, sized by ``--model.n_layer``,
``--model.n_head``, ``--model.n_embd`` and ``--model.block_size`` (the config's
``num_hidden_layers``, ``num_attention_heads``, ``hidden_size``, ``max_position_embeddings``) and any
other config field through ``--model.config '{"intermediate_size": 256}'``; or the model saved in a
local directory, ``--model.pretrained DIR`` (``save_pretrained``'s config and weights). Nothing is
downloaded at run time.

The data is the chargpt corpus (the Python standard library's source) or any UTF-8 text file
(``--data.path``), cut into windows of ``block_size`` tokens. Without a tokenizer the vocabulary is
the 256 byte values (UTF-8 bytes, nothing to download or fit); ``--data.tokenizer DIR`` uses a
tokenizer saved in a local directory instead. Needs the optional extra: ``pip install 'gradsync[hf]'``.

    gradsync fit --recipe hf_causal_lm --model.arch gpt2 --model.n_layer 2 --model.n_embd 64 --devices 2
    gradsync fit --recipe hf_causal_lm --model.arch llama --model.config '{"intermediate_size": 256}' \\
        --strategy diloco --strategy.period 16 --devices 2
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal, Optional

import torch
import torch.nn.functional as F

from gradsync.errors import GradsyncError, check
from gradsync.recipes.base import Recipe, Scheduler
from gradsync.recipes.chargpt import TextWindows

#: The byte vocabulary: every UTF-8 byte value is a token.
BYTE_VOCAB_SIZE = 256

INSTALL = "pip install 'gradsync[hf]' (transformers)"


def _transformers() -> Any:
    try:
        import transformers
    except ImportError:
        raise GradsyncError(f"--recipe hf_causal_lm needs the transformers package: {INSTALL}") from None
    return transformers


# ---- data -------------------------------------------------------------------------------------
class TextData(TextWindows):
    """Token windows of a text corpus (default: chargpt's), as bytes or through a local tokenizer."""

    unit = "tokens"
    example_model = "gradsync.recipes.hf_causal_lm.HFCausalLM"

    def __init__(self, *, path: Optional[str] = None, tokenizer: Optional[str] = None,
                 max_chars: Optional[int] = None, val_fraction: float = 0.1, val_windows: int = 256,
                 batch_size: int = 16) -> None:
        """
        Args:
            path: a UTF-8 text file to train on; default: the standard library's top-level modules.
            tokenizer: a directory holding a saved tokenizer (``save_pretrained``); default: UTF-8
                bytes, a vocabulary of 256.
            max_chars: use only the first ``max_chars`` characters of the corpus (quick runs), >= 1.
            val_fraction: the share of the tokens, taken from the end, held out for validation, in (0, 0.5].
            val_windows: how many evenly spaced windows of the held-out text validation reads, >= 1.
            batch_size: per-process micro-batch size in windows, >= 1.
        """
        super().__init__(batch_size=batch_size)
        check(path is None or Path(path).is_file(), "path", path, "is not a file", "give a UTF-8 text file")
        check(tokenizer is None or Path(tokenizer).is_dir(), "tokenizer", tokenizer, "is not a directory",
              "give a directory a tokenizer was saved to (tokenizer.save_pretrained(DIR)), or leave it unset "
              "for the byte vocabulary")
        check(max_chars is None or max_chars >= 1, "max_chars", max_chars, "must be >= 1")
        check(0 < val_fraction <= 0.5, "val_fraction", val_fraction, "must be in (0, 0.5]")
        check(val_windows >= 1, "val_windows", val_windows, "must be >= 1")
        self.path, self.tokenizer, self.max_chars = path, tokenizer, max_chars
        self.val_fraction, self.val_windows = val_fraction, val_windows
        self.vocab_size: Optional[int] = None  # read by the model at set-up
        self.block_size: Optional[int] = None  # the model's context length, read from it

    def encode(self, text: str) -> torch.Tensor:
        if self.tokenizer is None:
            self.vocab_size = BYTE_VOCAB_SIZE
            return torch.frombuffer(bytearray(text.encode("utf-8")), dtype=torch.uint8).to(torch.int32)
        tok = _transformers().AutoTokenizer.from_pretrained(self.tokenizer, local_files_only=True)
        self.vocab_size = len(tok)
        return torch.tensor(tok(text)["input_ids"], dtype=torch.int32)

    def tokenize(self, text: str) -> torch.Tensor:
        return self.encode(text)


# ---- model ------------------------------------------------------------------------------------
class HFCausalLM(Recipe):
    """Any Hugging Face transformers causal LM from a config (GPT-2, Llama, ...), on text as bytes (needs gradsync[hf])."""

    def __init__(self, *, arch: str = "gpt2", pretrained: Optional[str] = None, n_layer: Optional[int] = 2,
                 n_head: Optional[int] = 2, n_embd: Optional[int] = 64, block_size: int = 128,
                 dropout: float = 0.0, config: Optional[dict] = None,
                 optimizer: Literal["sgd", "adamw", "muon"] = "adamw", lr: float = 2e-3,
                 betas: tuple[float, float] = (0.9, 0.99), weight_decay: float = 0.1, scheduler: Scheduler = "cosine",
                 warmup_steps: int = 20, min_lr_ratio: float = 0.1, **kwargs: Any) -> None:
        """
        Args:
            arch: a transformers model type (``gpt2``, ``llama``, ``qwen2``, ``mistral``, ...): the
                config class ``AutoConfig.for_model(arch)`` builds.
            pretrained: a local directory a model was saved to (``save_pretrained``): its config and
                weights; ``arch`` and the sizes are then read from it.
            n_layer: transformer blocks (the config's ``num_hidden_layers``); None: the config's default.
            n_head: attention heads (``num_attention_heads``); must divide ``n_embd``.
            n_embd: hidden size (``hidden_size``).
            block_size: context length in tokens (``max_position_embeddings``; the data cuts windows of it).
            dropout: every dropout probability of the config, in [0, 1); 0 keeps runs on N processes
                comparable with one process.
            config: any other config fields, e.g. ``{"intermediate_size": 256, "tie_word_embeddings": false}``.
            optimizer, lr, betas, weight_decay, scheduler, warmup_steps, min_lr_ratio, **kwargs: the
                :class:`~gradsync.recipes.base.Recipe` options (AdamW with a cosine schedule here, as chargpt).
        """
        super().__init__(optimizer=optimizer, lr=lr, betas=betas, weight_decay=weight_decay, scheduler=scheduler,
                         warmup_steps=warmup_steps, min_lr_ratio=min_lr_ratio, **kwargs)
        _transformers()
        check(pretrained is None or Path(pretrained).is_dir(), "pretrained", pretrained, "is not a directory",
              "give a directory a model was saved to (model.save_pretrained(DIR))")
        for name, value in (("n_layer", n_layer), ("n_head", n_head), ("n_embd", n_embd)):
            check(value is None or value >= 1, name, value, "must be >= 1 (or unset: the config's default)")
        check(n_head is None or n_embd is None or n_embd % n_head == 0, "n_head", n_head,
              f"must divide n_embd={n_embd}", "e.g. --model.n_head 2 with --model.n_embd 64")
        check(block_size >= 1, "block_size", block_size, "must be >= 1")
        check(0 <= dropout < 1, "dropout", dropout, "must be in [0, 1)")
        check(config is None or isinstance(config, dict), "config", config, "must be a mapping of config fields",
              "e.g. --model.config '{\"intermediate_size\": 256}'")
        self.arch, self.pretrained = arch, pretrained
        self.n_layer, self.n_head, self.n_embd, self.block_size, self.dropout = (
            n_layer, n_head, n_embd, block_size, dropout)
        self.config_overrides = dict(config or {})
        if pretrained is None:
            self.hf_config(BYTE_VOCAB_SIZE)  # an unknown arch or config field fails now, not at set-up
        self.save_hyperparameters()
        self.vocab_size: Optional[int] = None
        self.net: Optional[torch.nn.Module] = None

    def hf_config(self, vocab_size: int) -> Any:
        """The transformers config of this model for a vocabulary of ``vocab_size`` tokens."""
        transformers = _transformers()
        fields = {"num_hidden_layers": self.n_layer, "num_attention_heads": self.n_head,
                  "hidden_size": self.n_embd, "max_position_embeddings": self.block_size, "vocab_size": vocab_size}
        fields = {k: v for k, v in fields.items() if v is not None}
        try:
            config = transformers.AutoConfig.for_model(self.arch, **fields, **self.config_overrides)
        except ValueError as exc:
            raise GradsyncError(f"--model.arch {self.arch}: {str(exc).splitlines()[0]}") from None
        for key, value in config.to_dict().items():
            if ("dropout" in key or key.endswith("pdrop")) and isinstance(value, float) and key not in self.config_overrides:
                setattr(config, key, self.dropout)
        for key in ("bos_token_id", "eos_token_id", "pad_token_id"):  # GPT-2's 50256 is no byte
            if isinstance(getattr(config, key, None), int) and getattr(config, key) >= vocab_size:
                setattr(config, key, None)
        return config

    # ---- building: the vocabulary comes from the data -----------------------------------
    def build(self, vocab_size: int) -> None:
        """Create the network for ``vocab_size`` tokens. Idempotent for the same size."""
        if self.net is not None:
            if vocab_size != self.vocab_size:
                raise GradsyncError(f"the model was built for a vocabulary of {self.vocab_size} and the data has "
                                    f"{vocab_size}: train and resume with the same tokenizer")
            return
        transformers = _transformers()
        if self.pretrained is not None:
            self.net = transformers.AutoModelForCausalLM.from_pretrained(self.pretrained, local_files_only=True)
            size = self.net.get_input_embeddings().num_embeddings
            if size < vocab_size:
                raise GradsyncError(f"--model.pretrained {self.pretrained}: its vocabulary has {size} tokens, the "
                                    f"data's {vocab_size}; give --data.tokenizer the tokenizer it was trained with")
        else:
            self.net = transformers.AutoModelForCausalLM.from_config(self.hf_config(vocab_size))
        self.vocab_size = vocab_size

    def setup(self, stage: str) -> None:
        data = self.trainer.datamodule if self.attached_trainer is not None else None
        vocab_size = getattr(data, "vocab_size", None)
        if vocab_size is None and self.net is None:
            raise GradsyncError("HFCausalLM takes its vocabulary size from the data: train it with TextData "
                                "(or another DataModule with a .vocab_size), or call model.build(vocab_size) first")
        if vocab_size is not None:
            self.build(int(vocab_size))

    def on_save_checkpoint(self, checkpoint: dict) -> None:
        super().on_save_checkpoint(checkpoint)
        checkpoint["hf_vocab_size"] = self.vocab_size

    def on_load_checkpoint(self, checkpoint: dict) -> None:
        if checkpoint.get("hf_vocab_size"):
            self.build(int(checkpoint["hf_vocab_size"]))

    # ---- training -------------------------------------------------------------------------
    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.net(input_ids=idx).logits

    def compute_loss(self, batch: Any) -> tuple[torch.Tensor, int]:
        x, y = batch
        logits = self(x)
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), y.reshape(-1)), y.numel()

    def count_tokens(self, batch: Any) -> int:
        return int(batch[1].numel())

    def parameter_groups(self) -> list[dict]:
        params = [p for p in self.parameters() if p.requires_grad]
        return [{"params": [p for p in params if p.dim() >= 2]},
                {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
