"""``topk``: send only the largest ``fraction`` of entries, as (index, value) pairs.

Each rank keeps the k = ceil(fraction * n) entries of its input of largest magnitude and sends
them as int32 indices plus float32 values (divided by N) through one all-gather; every rank
scatter-adds all N sparse parts in rank order, so all ranks get identical means. With error
feedback (:class:`~gradsync.comm.error_feedback.ErrorFeedback`, on by default) what was not sent
stays in the residual and is sent once it has grown large enough (Lin et al., "Deep Gradient
Compression", ICLR 2018; Stich et al., "Sparsified SGD with Memory", NeurIPS 2018).

**With SGD momentum** (the ``compressed`` strategy's default, ``momentum_correction``), this is
Deep Gradient Compression's *momentum correction*
(:class:`~gradsync.comm.error_feedback.MomentumCorrection`): each rank accumulates its velocity
``u <- m u + g`` locally and the residual accumulates velocities, ``v <- v + u``; top-k of ``v``
is sent and applied by the optimizer without momentum of its own. Top-k of the gradient followed
by the optimizer's momentum (the plain variant) instead lets each late coordinate into the
momentum buffer only when it is finally sent. *Momentum factor masking* then zeroes ``u`` (and
``v``, already zero there) at the coordinates sent, so a coordinate whose accumulated velocity
was just applied does not keep pushing with its stale momentum. DGC's local gradient clipping is
not done here (Lightning clips after the reduction, i.e. the delivered update; the strategy warns).

Bytes for n entries: (N-1) x 8k, against 2(N-1)/N x 4n for fp32 — a ratio of 1 / (N fraction):
50x at the default 1% on 2 ranks, 12.5x on 8. All-gathered sparse vectors grow with N, so top-k
suits few ranks and slow links; for many ranks prefer ``sign`` or ``powersgd``.
"""

from __future__ import annotations

import math
from typing import Hashable, Optional

import torch

from gradsync.comm.codecs import native
from gradsync.comm.codecs.common import flatten, unflatten
from gradsync.comm.futures import Reduction
from gradsync.comm.reducer import Reducer
from gradsync.errors import check


def num_kept(numel: int, fraction: float) -> int:
    return min(numel, max(1, math.ceil(fraction * numel)))


#: Entries of the strided sample that estimates top-k's threshold (see :func:`compress`).
SAMPLE = 1 << 18
#: Rows of the column view whose per-column peak magnitude prefilters top-k's candidates.
BLOCK = 16


def compress(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Indices (int32, ascending) and values of the ``k`` entries of ``x`` with the largest magnitude.

    Exact, but without a full sort, selection or even a full-size ``abs`` when ``k`` is a small
    share. A strided sample of ``SAMPLE`` entries gives a magnitude a little below the k-th largest
    (four standard deviations of the sample count). ``x`` is viewed as ``BLOCK`` rows; a column whose
    largest magnitude (two reductions over the rows) reaches that threshold holds candidates, and
    only those few columns are compared entry by entry (on CPU, one native pass over ``x`` finds the
    same candidates: ``native.c``). The exact top-k is taken among the
    candidates, which come out in ascending index order and keep it. Should they be too few, the
    whole vector is searched. Ties at the k-th magnitude may resolve either way, as in ``torch.topk``.
    """
    check(x.numel() < 2**31, "message numel", x.numel(), "must be < 2^31 for int32 indices",
          "lower --strategy.bucket_cap_mb")
    n = x.numel()
    if n >= 4 * SAMPLE and 16 * k <= n:
        sample = x[:: n // SAMPLE].abs()
        expected = k * sample.numel() / n  # sample entries above the k-th largest magnitude
        keep = min(sample.numel(), int(expected + 4 * math.sqrt(expected) + 8))
        threshold = torch.topk(sample, keep, sorted=False).values.min()
        found = _native_candidates(x, threshold, room=int(1.5 * keep * n / sample.numel()) + 1024)
        if found is not None:
            candidates, magnitudes = found
        else:
            candidates, magnitudes = _candidates(x, threshold)
        if candidates.numel() >= k:
            chosen = torch.zeros(candidates.numel(), dtype=torch.bool, device=x.device)
            chosen[torch.topk(magnitudes, k, sorted=False).indices] = True  # a mask keeps the ascending order
            idx = candidates.masked_select(chosen)
            return idx.to(torch.int32), x.index_select(0, idx)
    idx = torch.topk(x.abs(), k, sorted=False).indices.sort().values
    return idx.to(torch.int32), x[idx]


def _candidates(x: torch.Tensor, threshold: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Indices (ascending) and magnitudes of every entry of ``x`` with ``|x| >= threshold``."""
    n = x.numel()
    cols = n // BLOCK
    rows = x[: cols * BLOCK].view(BLOCK, cols)
    # Two reductions over the rows (aminmax(dim=0) is several times slower on CPU); no full-size abs.
    hot = (rows.amax(0) >= threshold).logical_or_(rows.amin(0) <= -threshold).nonzero().squeeze(1)
    block = rows.index_select(1, hot).abs_()
    hit = (block >= threshold).view(-1).nonzero().squeeze(1)  # row-major: ascending flat index
    candidates = hit.div(hot.numel(), rounding_mode="floor").mul_(cols).add_(
        hot.index_select(0, hit.remainder(hot.numel())))
    magnitudes = block.view(-1).index_select(0, hit)
    if cols * BLOCK < n:
        tail = x[cols * BLOCK:].abs()
        at = (tail >= threshold).nonzero().squeeze(1)
        candidates = torch.cat([candidates, at + cols * BLOCK])
        magnitudes = torch.cat([magnitudes, tail.index_select(0, at)])
    return candidates, magnitudes


def _candidates_native(fn, x: torch.Tensor, threshold: float, cap: int = 1024) -> tuple[torch.Tensor, torch.Tensor]:
    while True:
        idx, mags = torch.empty(cap, dtype=torch.int64), torch.empty(cap, dtype=torch.float32)
        found = fn(x.data_ptr(), x.numel(), threshold, idx.data_ptr(), mags.data_ptr(), cap)
        if found <= cap:
            return idx[:found], mags[:found]
        cap = found


def _probe_candidates() -> bool:
    fn = native.raw("topk_candidates")
    g = torch.Generator().manual_seed(0)
    x = torch.randn(BLOCK * 1000 + 13, generator=g).mul_(8).round_().div_(8)  # ties at the threshold
    for t in (0.0, 1.0, 2.5, 3.0, 100.0):
        threshold = torch.tensor(t)
        got, want = _candidates_native(fn, x, float(threshold)), _candidates(x, threshold)
        if not (torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])):
            return False
    return True


def _native_candidates(x: torch.Tensor, threshold: torch.Tensor,
                       room: int = 1024) -> Optional[tuple[torch.Tensor, torch.Tensor]]:
    """:func:`_candidates` by one native pass on CPU (float32, contiguous; ``room`` for the expected
    number of candidates, more is searched again); None elsewhere."""
    if x.dtype != torch.float32 or not native.usable(x):
        return None
    fn = native.kernel("topk_candidates", _probe_candidates)
    return None if fn is None else _candidates_native(fn, x, float(threshold), room)


def decompress_eager(indices: torch.Tensor, values: torch.Tensor, numel: int, *,
                     out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The dense vector of ``numel`` entries (into ``out`` when given): ``values`` at ``indices``, 0 elsewhere."""
    out = torch.zeros(numel, dtype=torch.float32, device=values.device) if out is None else out.view(-1)[:numel].zero_()
    out[indices.long()] = values.to(torch.float32)
    return out


def decompress(indices: torch.Tensor, values: torch.Tensor, numel: int, *,
               out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """:func:`decompress_eager`; on CPU, for ascending int32 indices (as :func:`compress` gives), one
    native pass that zeroes and fills the vector block by block."""
    if (indices.dtype == torch.int32 and values.dtype == torch.float32 and indices.numel()
            and native.usable(indices, values, *([] if out is None else [out]))):
        fn = native.kernel("topk_decode", _probe_decode)
        if fn is not None:
            dense = torch.empty(numel, dtype=torch.float32) if out is None else out.view(-1)[:numel]
            if fn(indices.data_ptr(), values.data_ptr(), indices.numel(), numel, dense.data_ptr()) == 0:
                return dense
    return decompress_eager(indices, values, numel, out=out)


def _probe_decode() -> bool:
    fn = native.raw("topk_decode")
    g = torch.Generator().manual_seed(0)
    x = torch.randn(10_000 + 7, generator=g)
    idx, vals = compress(x, 123)
    got = torch.full((x.numel(),), float("nan"))
    return fn(idx.data_ptr(), vals.data_ptr(), idx.numel(), x.numel(), got.data_ptr()) == 0 and torch.equal(
        got, decompress_eager(idx, vals, x.numel())) and fn(idx.flip(0).data_ptr(), vals.data_ptr(), 2, x.numel(),
                                                            got.data_ptr()) == -1


class TopKReducer(Reducer):
    """``topk``: every rank's largest entries, one all-gather of index/value pairs."""

    codec = "topk"
    lossy = True
    biased = True
    momentum_correctable = True
    masks_sent = True

    def __init__(self, *, fraction: float = 0.01, **kwargs) -> None:
        """
        Args:
            fraction: share of the entries sent per reduction, in (0, 1]. 0.01 is Deep Gradient
                Compression's working point; raise it if accuracy lags, lower it on very slow links.
        """
        check(0 < fraction <= 1, "fraction", fraction, "must be in (0, 1]",
              "e.g. --strategy.fraction 0.01 sends 1% of the entries")
        super().__init__(**kwargs)
        self.fraction = float(fraction)

    def options(self) -> dict:
        return {"fraction": self.fraction}

    def run(self, tensors: list[torch.Tensor], names: list[str], sync: Hashable) -> Reduction:
        world = self.world_size()
        flat = flatten(tensors)
        n = flat.numel()
        k = num_kept(n, self.fraction)
        idx, vals = compress(flat, k)
        sent = None
        if self.need_sent:
            sent = unflatten(decompress(idx, vals, n), tensors)
        # One message of 2k int32 words: the indices, then the values' bits (already divided by N).
        send = torch.cat([idx, vals.to(torch.float32).div_(world).view(torch.int32)])
        gathered = torch.empty(world * 2 * k, dtype=torch.int32, device=flat.device)
        gathered = yield self.ledger.all_gather_single(gathered, send, **self.account(sync))
        out = torch.zeros(n, dtype=torch.float32, device=flat.device)
        # Rank by rank: indices are unique within a rank, so each index_add_ is deterministic.
        for part in gathered.view(world, 2 * k).unbind(0):
            out.index_add_(0, part[:k].long(), part[k:].view(torch.float32))
        return unflatten(out, tensors), sent
