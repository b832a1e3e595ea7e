"""compressed strategy: identity == sync, convergence per codec, momentum correction by hand, exact
resume, options, reshard."""

import math
import warnings
from pathlib import Path

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import Callback
from torch.utils.data import DataLoader, TensorDataset

from gradsync.errors import OptionError
from gradsync.recipes import CharData, CharGPT, DigitsClassifier, DigitsData
from gradsync.strategies import STRATEGIES, SyncStrategy
from gradsync.strategies.compressed import CompressedStrategy
from gradsync.strategies.parts import read_parts
from harness import ValLoss, assert_resumed_at, fit, max_abs_diff

pytestmark = pytest.mark.timeout(180)

# Convergence budget: the recipe's own optimizer (DigitsClassifier() defaults: SGD, lr 0.05,
# momentum 0.9), 2 processes x batch 16, 150 steps, default strategy options. Sync reaches 0.973
# val_acc. sign and topk pass only with momentum correction (issue 17: plain sign reached 0.34);
# docs/strategies/compressed.md has the table.
CONVERGENCE_STEPS = 150
TOLERANCE = {"fp16": 0.015, "bf16": 0.015, "int8": 0.015, "powersgd": 0.015, "sign": 0.04, "topk": 0.04}
MIN_RATIO = {"fp16": 1.99, "bf16": 1.99, "int8": 3.9, "powersgd": 2.5, "sign": 25.0, "topk": 40.0}


def digits_model(**kwargs):
    L.seed_everything(0, verbose=False)
    return DigitsClassifier(**kwargs)


def val_acc(params: dict) -> float:
    model = DigitsClassifier()
    model.load_state_dict(params)
    model.eval()
    data = DigitsData()
    data.setup("fit")
    x, y = data.val_set.tensors if hasattr(data.val_set, "tensors") else zip(*data.val_set)
    with torch.no_grad():
        return float((model(x).argmax(1) == y).float().mean())


def test_compressed_is_registered_under_one_name():
    assert STRATEGIES["compressed"] is CompressedStrategy
    assert L.Trainer(strategy="compressed", accelerator="cpu", devices=1, logger=False).strategy.codec == "int8"


@pytest.mark.parametrize("world", [2, 3])
def test_identity_codec_equals_sync(tmp_path, world):
    sync = fit(digits_model(lr=0.1, momentum=0.0), DigitsData(batch_size=16), strategy=SyncStrategy(), devices=world,
               max_steps=20, out=tmp_path / "sync")
    ident = fit(digits_model(lr=0.1, momentum=0.0), DigitsData(batch_size=16),
                strategy=CompressedStrategy(codec="identity"), devices=world, max_steps=20, out=tmp_path / "identity")
    assert max_abs_diff(sync[0]["params"], digits_model().state_dict()) > 1e-3  # it trained
    assert max_abs_diff(ident[0]["params"], sync[0]["params"]) <= 1e-6
    assert ident[0]["ledger"]["wire_bytes"] == sync[0]["ledger"]["wire_bytes"]
    assert ident[0]["ledger"]["compression_ratio"] == 1.0


@pytest.fixture(scope="module")
def sync_reference(tmp_path_factory):
    ranks = fit(digits_model(), DigitsData(batch_size=16), strategy=SyncStrategy(), devices=2,
                max_steps=CONVERGENCE_STEPS, out=tmp_path_factory.mktemp("sync"))
    return val_acc(ranks[0]["params"])


@pytest.mark.parametrize("codec", list(TOLERANCE))
def test_codec_converges_near_sync_and_ranks_agree(tmp_path, sync_reference, codec):
    ranks = fit(digits_model(), DigitsData(batch_size=16), strategy=CompressedStrategy(codec=codec),
                devices=2, max_steps=CONVERGENCE_STEPS, out=tmp_path)
    for r in ranks[1:]:
        assert max_abs_diff(r["params"], ranks[0]["params"]) == 0.0, f"{codec}: ranks disagree"
    acc = val_acc(ranks[0]["params"])
    assert sync_reference >= 0.95, f"sync reached only {sync_reference:.3f}: the budget is too small to compare"
    assert acc >= sync_reference - TOLERANCE[codec], f"{codec}: val_acc {acc:.4f} vs sync {sync_reference:.4f}"
    ratio = ranks[0]["ledger"]["compression_ratio"]
    assert ratio >= MIN_RATIO[codec], f"{codec}: compression ratio {ratio:.2f}"


# ---- momentum correction, by hand on a 2-rank toy problem ------------------------------------------
TOY_N, TOY_LR, TOY_MOMENTUM, TOY_STEPS = 16, 0.1, 0.9, 5


def toy_gradient(rank: int, step: int) -> torch.Tensor:
    """Rank ``rank``'s gradient of the toy loss at optimizer step ``step`` (without weight decay)."""
    return torch.randn(TOY_N, generator=torch.Generator().manual_seed(1000 * rank + step))


def toy_w0() -> torch.Tensor:
    return torch.linspace(-1.0, 1.0, TOY_N)


class LinearToy(L.LightningModule):
    """loss = <g(rank, step), w>: each rank's gradient is a known vector, whatever w is."""

    def __init__(self, **sgd) -> None:
        super().__init__()
        self.sgd = sgd
        self.w = torch.nn.Parameter(toy_w0())

    def training_step(self, batch, batch_idx):
        return (self.w * toy_gradient(self.global_rank, self.global_step)).sum()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=TOY_LR, momentum=TOY_MOMENTUM, **self.sgd)


class ToyData(L.LightningDataModule):
    def train_dataloader(self):
        return DataLoader(TensorDataset(torch.zeros(4 * TOY_STEPS, 1)), batch_size=1)


class RecordOptimizer(Callback):
    """Each rank's optimizer as the fit leaves it: its settings and whether it built momentum buffers."""

    def __init__(self, out: Path) -> None:
        self.out = Path(out)

    def on_train_end(self, trainer, pl_module) -> None:
        opt = trainer.optimizers[0]
        group = {k: v for k, v in opt.param_groups[0].items() if k != "params"}
        torch.save({"group": group, "buffers": sum("momentum_buffer" in st for st in opt.state.values())},
                   self.out / f"optimizer{trainer.global_rank}.pt")


def scaled_sign(x: torch.Tensor, chunk: int = 8) -> torch.Tensor:
    """EF-signSGD's compressor per chunk: mean |x| times sign(x) (sign(0) = +1, as the codec packs it)."""
    rows = x.view(-1, chunk)
    return (rows.abs().mean(1, keepdim=True) * torch.where(rows >= 0, 1.0, -1.0)).flatten()


def fit_toy(tmp_path, **options):
    out = tmp_path / "_".join(f"{k}-{v}" for k, v in options.items())
    sgd = options.pop("sgd", {})
    ranks = fit(LinearToy(**sgd), ToyData(), strategy=CompressedStrategy(**options), devices=2, max_steps=TOY_STEPS,
                out=out, callbacks=(RecordOptimizer(out),))
    optimizers = [torch.load(out / f"optimizer{r}.pt", weights_only=False) for r in range(2)]
    return ranks, optimizers


def test_sign_momentum_correction_two_ranks_by_hand(tmp_path):
    """sign compresses each rank's velocity u = m u + g (no worker residual) and the optimizer steps
    without momentum; the plain variant compresses gradients with both residuals and the optimizer
    applies momentum. Both by hand: two hops (8-entry shards, one chunk each), warm-up of 2 steps."""
    warmup = 2
    g = [[toy_gradient(r, t) for r in (0, 1)] for t in range(TOY_STEPS)]

    def by_hand(corrected: bool):
        w, u, e, buf = toy_w0(), [None, None], [torch.zeros(TOY_N)] * 2, None
        reducer = torch.zeros(TOY_N)  # rank j keeps the residual of shard j
        for t in range(TOY_STEPS):
            if corrected:
                u = [g[t][r] if u[r] is None else TOY_MOMENTUM * u[r] + g[t][r] for r in (0, 1)]
                x = u
            else:
                x = [g[t][r] + (e[r] if t >= warmup else 0) for r in (0, 1)]
            if t < warmup:  # exact fp32 mean
                out = (x[0] + x[1]) / 2
            else:
                hop1 = [scaled_sign(x[r] / 2) for r in (0, 1)]
                if not corrected:
                    e = [x[r] - 2 * hop1[r] for r in (0, 1)]
                relay = hop1[0] + hop1[1] + reducer
                out = scaled_sign(relay)
                reducer = relay - out
            if corrected:
                w = w - TOY_LR * out
            else:
                buf = out if buf is None else TOY_MOMENTUM * buf + out
                w = w - TOY_LR * buf
        return w, u

    results = {}
    for corrected in (True, False):
        ranks, optimizers = fit_toy(tmp_path, codec="sign", chunk_size=8, warmup_steps=warmup,
                                    momentum_correction=corrected)
        w, u = by_hand(corrected)
        results[corrected] = w
        state = ranks[0]["algorithm"]["compressed"]["codec_state"]
        for r, rank in enumerate(ranks):
            assert (rank["params"]["w"] - w).abs().max() <= 1e-6, f"momentum_correction={corrected}, rank {r}"
            assert optimizers[r]["group"]["momentum"] == TOY_MOMENTUM  # restored after every step
        if corrected:
            for r in (0, 1):
                assert (ranks[r]["algorithm"]["compressed"]["velocities"]["w"] - u[r]).abs().max() <= 1e-6
            assert not state["residuals"], "the velocity is the worker's memory: no worker residual"
            assert optimizers[0]["buffers"] == 0, "the optimizer applied momentum too"
        else:
            assert "velocities" not in state and state["residuals"]["w"].abs().max() > 0
            assert optimizers[0]["buffers"] == 1
    assert (results[True] - results[False]).abs().max() > 1e-2  # the two variants are told apart


def test_topk_momentum_correction_two_ranks_by_hand(tmp_path):
    """topk with DGC's momentum correction: nesterov velocity with weight decay, residual of
    velocities, top-k sent, momentum factor masking; the plain variant: top-k of error-fed
    gradients, then the optimizer's nesterov momentum and weight decay."""
    wd, k = 0.05, math.ceil(0.25 * TOY_N)
    g = [[toy_gradient(r, t) for r in (0, 1)] for t in range(TOY_STEPS)]

    def top(v):
        idx = torch.topk(v.abs(), k).indices
        sent = torch.zeros_like(v)
        sent[idx] = v[idx]
        return sent

    def by_hand(corrected: bool):
        w, u, e, buf = toy_w0(), [None, None], [torch.zeros(TOY_N)] * 2, None
        for t in range(TOY_STEPS):
            sent = []
            for r in (0, 1):
                if corrected:
                    d = g[t][r] + wd * w
                    u[r] = d if u[r] is None else TOY_MOMENTUM * u[r] + d
                    v = d + TOY_MOMENTUM * u[r] + e[r]  # nesterov velocity plus residual
                else:
                    v = g[t][r] + e[r]
                s = top(v)
                e[r] = v - s
                if corrected:
                    u[r] = torch.where(s != 0, 0.0, u[r])  # momentum factor masking
                sent.append(s)
            out = sent[0] / 2 + sent[1] / 2
            if corrected:
                w = w - TOY_LR * out
            else:
                d = out + wd * w
                buf = d if buf is None else TOY_MOMENTUM * buf + d
                w = w - TOY_LR * (d + TOY_MOMENTUM * buf)
        return w, u

    results = {}
    for corrected in (True, False):
        ranks, optimizers = fit_toy(tmp_path, codec="topk", fraction=0.25, momentum_correction=corrected,
                                    sgd={"nesterov": True, "weight_decay": wd})
        w, u = by_hand(corrected)
        results[corrected] = w
        for r, rank in enumerate(ranks):
            assert (rank["params"]["w"] - w).abs().max() <= 1e-6, f"momentum_correction={corrected}, rank {r}"
            assert optimizers[r]["group"]["momentum"] == TOY_MOMENTUM and optimizers[r]["group"]["weight_decay"] == wd
            if corrected:
                assert (rank["algorithm"]["compressed"]["velocities"]["w"] - u[r]).abs().max() <= 1e-6
        assert optimizers[0]["buffers"] == (0 if corrected else 1)
    assert (results[True] - results[False]).abs().max() > 1e-2


class AdamToy(LinearToy):
    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=TOY_LR, betas=ADAM_BETAS, eps=1e-8, weight_decay=TOY_WD)


ADAM_BETAS, TOY_WD = (0.9, 0.99), 0.05


def test_adamw_correction_two_ranks_by_hand(tmp_path):
    """With AdamW, sign sends each rank's own Adam direction m_hat / (sqrt(v_hat) + eps) (moments of
    its own gradient, kept with the codec), with the worker residual; the optimizer applies the
    delivered mean as w <- w (1 - lr wd) - lr mean. Warm-up: 2 exact steps of the same directions."""
    warmup, (b1, b2), eps = 2, ADAM_BETAS, 1e-8
    g = [[toy_gradient(r, t) for r in (0, 1)] for t in range(TOY_STEPS)]
    w, m, v, e = toy_w0(), [torch.zeros(TOY_N)] * 2, [torch.zeros(TOY_N)] * 2, [torch.zeros(TOY_N)] * 2
    reducer = torch.zeros(TOY_N)
    for t in range(TOY_STEPS):
        m = [b1 * m[r] + (1 - b1) * g[t][r] for r in (0, 1)]
        v = [b2 * v[r] + (1 - b2) * g[t][r] ** 2 for r in (0, 1)]
        x = [(m[r] / (1 - b1 ** (t + 1))) / ((v[r] / (1 - b2 ** (t + 1))).sqrt() + eps) for r in (0, 1)]
        if t < warmup:
            out = (x[0] + x[1]) / 2
        else:
            x = [x[r] + e[r] for r in (0, 1)]
            hop1 = [scaled_sign(x[r] / 2) for r in (0, 1)]
            e = [x[r] - 2 * hop1[r] for r in (0, 1)]
            relay = hop1[0] + hop1[1] + reducer
            out = scaled_sign(relay)
            reducer = relay - out
        w = w * (1 - TOY_LR * TOY_WD) - TOY_LR * out
    strategy = lambda c: CompressedStrategy(codec="sign", chunk_size=8, warmup_steps=warmup, momentum_correction=c)  # noqa: E731
    ranks = fit(AdamToy(), ToyData(), strategy=strategy(True), devices=2, max_steps=TOY_STEPS, out=tmp_path / "on")
    for r, rank in enumerate(ranks):
        assert (rank["params"]["w"] - w).abs().max() <= 1e-5, f"rank {r}"
        state = rank["algorithm"]["compressed"]["codec_state"]
        assert (rank["algorithm"]["compressed"]["velocities"]["w"] - m[r]).abs().max() <= 1e-6
        assert (state["adam"]["second_moments"]["w"] - v[r]).abs().max() <= 1e-7
        assert int(state["adam"]["steps"]["w"]) == TOY_STEPS
        assert (state["residuals"]["w"] - e[r]).abs().max() <= 1e-5  # Adam directions keep the worker residual
    plain = fit(AdamToy(), ToyData(), strategy=strategy(False), devices=2, max_steps=TOY_STEPS, out=tmp_path / "off")
    assert (plain[0]["params"]["w"] - w).abs().max() > 1e-2  # AdamW on compressed gradients is another rule


def test_adam_correction_resumes_exactly(tmp_path):
    ckpt = tmp_path / "step3.ckpt"
    make = lambda: CompressedStrategy(codec="topk", fraction=0.25)  # noqa: E731
    whole = fit(AdamToy(), ToyData(), strategy=make(), devices=2, max_steps=TOY_STEPS, out=tmp_path / "whole",
                callbacks=(SaveAt(3, ckpt),))
    resumed = fit(AdamToy(), ToyData(), strategy=make(), devices=2, max_steps=TOY_STEPS, out=tmp_path / "resumed",
                  ckpt_path=str(ckpt))
    assert_resumed_at(resumed, 3, TOY_STEPS)
    assert int(read_parts(ckpt)[0]["compressed"]["codec_state"]["adam"]["steps"]["w"]) == 3
    for a, b in zip(whole, resumed):
        assert (a["params"]["w"] - b["params"]["w"]).abs().max() <= 1e-6
        _assert_state_close(a["algorithm"]["compressed"], b["algorithm"]["compressed"])


# ---- chargpt at its own defaults (AdamW, warm-up + cosine): a short run ----------------------------
CHARGPT_STEPS = 80
#: Relative val_loss over sync's the codecs may reach (issue: 2% for the dense codecs, 5% for sign/topk).
CHARGPT_TOLERANCE = {"fp16": 0.02, "bf16": 0.02, "int8": 0.02, "powersgd": 0.02, "sign": 0.05, "topk": 0.05}


def chargpt_val_loss(tmp_path, strategy) -> float:
    L.seed_everything(0, verbose=False)
    model = CharGPT(n_layer=1, n_head=2, n_embd=48, block_size=32)
    data = CharData(max_chars=100_000, val_windows=64, batch_size=16)
    fit(model, data, strategy=strategy, devices=2, max_steps=CHARGPT_STEPS, out=tmp_path, callbacks=(ValLoss(tmp_path),))
    return torch.load(tmp_path / "val_loss0.pt")


def test_codecs_on_chargpt_at_its_defaults_stay_near_sync(tmp_path):
    sync = chargpt_val_loss(tmp_path / "sync", SyncStrategy())
    assert sync < 3.0, f"sync reached only val_loss {sync:.3f}: the budget is too small to compare"
    results = {codec: chargpt_val_loss(tmp_path / codec, CompressedStrategy(codec=codec)) for codec in CHARGPT_TOLERANCE}
    for codec, loss in results.items():
        assert loss <= sync * (1 + CHARGPT_TOLERANCE[codec]), f"{codec}: val_loss {loss:.4f} vs sync {sync:.4f}: {results}"
    print({"sync": sync, **results})


def _powersgd_q_ranks(state) -> set:
    """The ranks (columns of Q) of every matrix PowerSGD compressed, found anywhere in a state dict."""
    if isinstance(state, dict):
        if "qs" in state:
            return {q.shape[1] for q in state["qs"].values()}
        return set().union(*(_powersgd_q_ranks(v) for v in state.values()))
    return set()


def test_powersgd_rank_follows_the_optimizer(tmp_path):
    """No --strategy.rank: 8 under AdamW (chargpt; rank 4 ends 2% above sync there in 160 steps),
    4 under SGD (digits). The default run is the explicit rank-8 run, bit for bit."""
    def chargpt(strategy, out):
        L.seed_everything(0, verbose=False)
        return fit(CharGPT(n_layer=1, n_head=2, n_embd=48, block_size=32),
                   CharData(max_chars=20_000, val_windows=8, batch_size=16), strategy=strategy, devices=2,
                   max_steps=5, out=out)

    default = chargpt(CompressedStrategy(codec="powersgd"), tmp_path / "default")
    explicit = chargpt(CompressedStrategy(codec="powersgd", rank=8), tmp_path / "explicit")
    assert max(_powersgd_q_ranks(default[0]["algorithm"])) == 8
    assert max_abs_diff(default[0]["params"], explicit[0]["params"]) == 0.0
    digits = fit(digits_model(), DigitsData(batch_size=16), strategy=CompressedStrategy(codec="powersgd"),
                 devices=2, max_steps=4, out=tmp_path / "digits")
    assert max(_powersgd_q_ranks(digits[0]["algorithm"])) == 4
    forced = chargpt(CompressedStrategy(codec="powersgd", rank=4), tmp_path / "forced")
    assert max(_powersgd_q_ranks(forced[0]["algorithm"])) == 4  # a given rank is kept


def test_momentum_correction_at_momentum_zero_is_the_plain_variant(tmp_path):
    """Nothing to correct: with SGD momentum 0 both variants send the same bytes and end bit-identical."""
    def run(corrected):
        L.seed_everything(0, verbose=False)
        return fit(DigitsClassifier(momentum=0.0), DigitsData(batch_size=16),
                   strategy=CompressedStrategy(codec="sign", momentum_correction=corrected), devices=2, max_steps=5,
                   out=tmp_path / str(corrected))
    on, off = run(True), run(False)
    assert max_abs_diff(on[0]["params"], off[0]["params"]) == 0.0
    assert on[0]["ledger"]["wire_bytes"] == off[0]["ledger"]["wire_bytes"]


class SaveAt(Callback):
    """Saves a checkpoint (on every rank, as ModelCheckpoint does) after optimizer step ``step``."""

    def __init__(self, step: int, path: Path) -> None:
        self.step, self.path = step, path

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.global_step == self.step:
            trainer.save_checkpoint(self.path)


@pytest.mark.parametrize("codec,corrected", [("identity", True), ("int8", True), ("sign", True), ("topk", True),
                                             ("powersgd", True), ("sign", False)],
                         ids=["identity", "int8", "sign", "topk", "powersgd", "sign-plain"])
def test_resume_restores_codec_state_exactly(tmp_path, codec, corrected):
    """The recipe's SGD momentum 0.9: sign and topk also carry momentum-correction velocities."""
    ckpt = tmp_path / "step10.ckpt"
    make = lambda: CompressedStrategy(codec=codec, momentum_correction=corrected)  # noqa: E731
    whole = fit(digits_model(), DigitsData(batch_size=16), strategy=make(), devices=2,
                max_steps=20, out=tmp_path / "whole", callbacks=(SaveAt(10, ckpt),))
    resumed = fit(digits_model(), DigitsData(batch_size=16), strategy=make(), devices=2,
                  max_steps=20, out=tmp_path / "resumed", ckpt_path=str(ckpt))
    saved = torch.load(ckpt, weights_only=False)
    assert saved["gradsync"]["world_size"] == 2
    parts = read_parts(ckpt)
    assert len(parts) == 2 and all(p["compressed"]["num_steps"] == 10 for p in parts)
    assert codec == "identity" or parts[0]["compressed"]["codec_state"], f"{codec}: no codec state saved"
    group = saved["optimizer_states"][0]["param_groups"][0]
    assert group["momentum"] == 0.9, "the checkpoint holds the user's momentum, not the step's 0"
    if codec in ("sign", "topk") and corrected:
        velocities = [p["compressed"]["velocities"] for p in parts]
        assert set(velocities[0]) == {n for n, _ in digits_model().named_parameters()}
        assert not torch.equal(velocities[0]["head.weight"], velocities[1]["head.weight"])  # each rank's own
        assert not saved["optimizer_states"][0]["state"], "the optimizer kept momentum buffers of its own"
    assert_resumed_at(resumed, 10, 20)
    for w, r in zip(whole, resumed):
        assert max_abs_diff(r["params"], w["params"]) <= 1e-6
        a, b = w["algorithm"]["compressed"], r["algorithm"]["compressed"]
        assert a["num_steps"] == b["num_steps"] == 20
        _assert_state_close(a["codec_state"], b["codec_state"])
        assert r["ledger"]["wire_bytes"] == w["ledger"]["wire_bytes"]


def _assert_state_close(a, b):
    assert type(a) is type(b)
    if isinstance(a, dict):
        assert a.keys() == b.keys()
        for k in a:
            _assert_state_close(a[k], b[k])
    elif isinstance(a, torch.Tensor):
        if a.dtype == torch.uint8:  # generator states
            assert torch.equal(a, b)
        else:
            assert float((a - b).abs().max()) <= 1e-6 if a.numel() else True


def test_world_size_change_resets_codec_state_with_a_warning():
    strategy = CompressedStrategy(codec="sign")  # unlaunched: world size 1, rank 0
    part = {"ledger": {"wire_bytes": 7}, "compressed": {"codec": "sign", "num_steps": 12, "codec_state": {
        "residuals": {"w": torch.ones(3)}, "inner": {"reducer_residuals": {"w": torch.ones(3)}}}}}
    with pytest.warns(UserWarning, match="reset codec state .*worker error-feedback residuals.*reducer"):
        state = strategy.reshard_algorithm_state([part, part], saved_world_size=2)
    assert state["compressed"]["num_steps"] == 12  # warm-up is not repeated
    assert "codec_state" not in state["compressed"]
    assert state["ledger"] == {"wire_bytes": 7}


def test_world_size_change_averages_momentum_correction_velocities():
    """Velocities are re-sharded, not reset: every new rank starts from the old ranks' mean (without
    masking, exactly the momentum buffer sync SGD would hold); residuals are reset."""
    strategy = CompressedStrategy(codec="topk")
    parts = [{"ledger": {}, "compressed": {"codec": "topk", "num_steps": 4, "momentum_correction": True, "codec_state": {
        "velocities": {"w": torch.full((3,), float(r)), "b": torch.ones(2)}, "residuals": {"w": torch.ones(3)}}}}
        for r in range(3)]
    said = "averaged momentum-correction velocities of the 3 saved ranks; reset codec state .*worker error-feedback"
    with pytest.warns(UserWarning, match=said):
        state = strategy.reshard_algorithm_state(parts, saved_world_size=3)
    velocities = state["compressed"]["velocities"]  # (written inside the codec state before the registry)
    assert torch.equal(velocities["w"], torch.full((3,), 1.0)) and torch.equal(velocities["b"], torch.ones(2))
    assert "codec_state" not in state["compressed"]


@pytest.mark.parametrize("options,option", [
    ({"codec": "fp8"}, "codec"),
    ({"codec": "powersgd", "rank": 0}, "rank"),
    ({"codec": "topk", "fraction": 0.0}, "fraction"),
    ({"codec": "topk", "fraction": 1.5}, "fraction"),
    ({"codec": "sign", "chunk_size": 100}, "chunk_size"),
    ({"codec": "powersgd", "warmup_steps": 1}, "warmup_steps"),
    ({"codec": "int8", "warmup_steps": -1}, "warmup_steps"),
    ({"codec": "int8", "rank": 8}, "rank"),  # an option the codec would silently ignore
    ({"codec": "powersgd", "momentum_correction": False}, "momentum_correction"),
])
def test_bad_options_fail_with_one_line(options, option):
    with pytest.raises(OptionError) as info:
        CompressedStrategy(**options)
    assert info.value.option == option
    assert "\n" not in str(info.value)


def test_powersgd_warmup_defaults_to_torchs_minimum():
    assert CompressedStrategy(codec="powersgd").warmup_steps == 2
    assert CompressedStrategy(codec="powersgd", error_feedback=False, warm_start=False, warmup_steps=0).warmup_steps == 0
    assert CompressedStrategy(codec="sign").warmup_steps == 0
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert CompressedStrategy(codec="topk", fraction=0.05).options["fraction"] == 0.05


# Digits' gradients are ~9.9k floats (~39 KiB): a 0.01 MiB cap cuts them into several DDP buckets.
SMALL_BUCKETS = 0.01


def test_several_buckets_count_bytes_and_steps_once(tmp_path):
    """fp16's wire bytes are 2 bytes per entry per step on 2 ranks however the gradient is bucketed."""
    steps = 6
    ranks = fit(digits_model(), DigitsData(batch_size=16),
                strategy=CompressedStrategy(codec="fp16", bucket_cap_mb=SMALL_BUCKETS), devices=2,
                max_steps=steps, out=tmp_path)
    numel = sum(p.numel() for p in digits_model().parameters())
    ledger = ranks[0]["ledger"]
    # DDP's first step runs with one large first bucket, later steps with the rebuilt ones (3 here)
    assert ledger["collectives"] >= 1 + 3 * (steps - 1), "the gradient was not split into several buckets"
    assert ledger["wire_bytes"] == steps * 2 * numel
    assert ledger["logical_bytes"] == steps * 4 * numel  # fp32 sync of the same entries
    assert ranks[0]["algorithm"]["compressed"]["num_steps"] == steps  # steps, not bucket calls


@pytest.mark.parametrize("codec", ["powersgd", "topk", "sign"])
def test_error_feedback_follows_parameters_across_bucket_rebuilds(tmp_path, codec):
    """DDP rebuilds its buckets after the first step and again after a resume; residuals are kept per
    parameter name, so they land on the right entries whatever bucket a parameter travels in.

    PowerSGD compresses each matrix on its own, so a resumed multi-bucket run is the uninterrupted
    one. top-k and sign select and scale over a whole bucket: the resumed run's first step, in DDP's
    first-step buckets, chunks differently (docs/strategies/compressed.md, "State, checkpoints,
    resume"), so for them only the per-parameter state is checked."""
    ckpt = tmp_path / "step5.ckpt"
    make = lambda: CompressedStrategy(codec=codec, bucket_cap_mb=SMALL_BUCKETS)  # noqa: E731
    whole = fit(digits_model(), DigitsData(batch_size=16), strategy=make(), devices=2, max_steps=12,
                out=tmp_path / "whole", callbacks=(SaveAt(5, ckpt),))
    names = {n for n, _ in digits_model().named_parameters()}
    # With the recipe's momentum, sign keeps velocities and reducer residuals (no worker residual),
    # topk velocities and residuals (of velocities), powersgd residuals.
    # (velocities are their own entry of the state, beside the codec state)
    stores = {"powersgd": [("codec_state", "residuals")], "topk": [("codec_state", "residuals"), ("velocities",)],
              "sign": [("velocities",), ("codec_state", "inner", "reducer_residuals")]}[codec]
    for part in read_parts(ckpt):
        for path in stores:
            store = part["compressed"]
            for key in path:
                store = store[key]
            assert set(store) == names, f"{'/'.join(path)}: one per parameter, whatever bucket it travelled in"
            assert store["head.weight"].abs().max() > 0  # (powersgd sends biases exactly: no residual)
    if codec != "powersgd":
        return
    resumed = fit(digits_model(), DigitsData(batch_size=16), strategy=make(), devices=2, max_steps=12,
                  out=tmp_path / "resumed", ckpt_path=str(ckpt))
    assert_resumed_at(resumed, 5, 12)
    for w, r in zip(whole, resumed):
        assert max_abs_diff(r["params"], w["params"]) <= 1e-6
