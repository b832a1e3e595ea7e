"""The tensors a round moves: trainable parameters in model order, floating buffers, fragments."""

from __future__ import annotations

import re

import torch

from gradsync.errors import GradsyncError, spell


def layer_key(name: str) -> str:
    """The layer a parameter belongs to: its path up to the first numeric index (``blocks.3``),
    else its module's path (``tok_emb``). Fragments are strided over these keys."""
    parts = name.split(".")
    for i, part in enumerate(parts[:-1]):
        if re.fullmatch(r"\d+", part):
            return ".".join(parts[: i + 1])
    return ".".join(parts[:-1]) or name


def strided_fragments(names: list[str], fragments: int) -> list[list[int]]:
    """Parameter indices of each of ``fragments`` fragments: layer j (in model order) goes to j mod F.

    The strided pattern of Streaming DiLoCo (Douillard et al. 2025): every fragment holds layers
    from the whole depth of the model."""
    layers: dict[str, list[int]] = {}
    for i, name in enumerate(names):
        layers.setdefault(layer_key(name), []).append(i)
    if fragments > len(layers):
        raise GradsyncError(
            f"{spell('fragments', fragments)}: this model has only {len(layers)} layers to split "
            f"({', '.join(list(layers)[:8])}{', ...' if len(layers) > 8 else ''}); use at most {len(layers)}")
    out: list[list[int]] = [[] for _ in range(fragments)]
    for j, indices in enumerate(layers.values()):
        out[j % fragments].extend(indices)
    return [sorted(f) for f in out]


def local_part(t: torch.Tensor) -> torch.Tensor:
    """This process's part of ``t``: the local shard of a DTensor (FSDP2), else ``t`` itself."""
    to_local = getattr(t, "to_local", None)
    return to_local() if to_local is not None else t


class Layout:
    """A module's trainable parameters (named, in model order), its floating buffers and fragments.

    Under FSDP2 a parameter is a DTensor and ``params`` holds this process's shard of it (a view:
    writing it writes the parameter); ``num_trainable`` counts whole parameters.
    """

    def __init__(self, module: torch.nn.Module, *, with_buffers: bool = True, fragments: int = 1) -> None:
        named = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
        self.names = [n for n, _ in named]
        self.params = [local_part(p) for _, p in named]
        self.buffers = [b for _, b in module.named_buffers() if b.is_floating_point()] if with_buffers else []
        self.fragments = strided_fragments(self.names, fragments)
        self.num_trainable = sum(p.numel() for _, p in named)

    def values(self, indices: list[int]) -> list[torch.Tensor]:
        """Copies of the parameters ``indices``, as they are now."""
        return [self.params[i].detach().clone() for i in indices]

    @torch.no_grad()
    def write(self, indices: list[int], values: list[torch.Tensor]) -> None:
        for i, v in zip(indices, values):
            self.params[i].copy_(v)

    def fragment_numel(self, k: int) -> int:
        return sum(self.params[i].numel() for i in self.fragments[k])
