"""``--model.optimizer muon``: torch.optim.Muon on chargpt's block matrices, AdamW on the rest, as one optimizer."""

import copy

import pytest
import torch

from gradsync.errors import OptionError
from gradsync.recipes.chargpt import CharGPT
from gradsync.recipes.optim import MuonAdamW

VOCAB = "abcdefghij \n"
MATRICES = ("attn.qkv.weight", "attn.proj.weight", "mlp.0.weight", "mlp.2.weight")


def chargpt(**kwargs) -> CharGPT:
    torch.manual_seed(0)
    # constant lr, no warm-up: the optimizer steps at lr itself (a scheduler would scale it from the start)
    model = CharGPT(n_layer=2, n_head=2, n_embd=16, block_size=8, optimizer="muon", scheduler="constant",
                    warmup_steps=0, **kwargs)
    model.build(VOCAB)
    return model


def split(opt: torch.optim.Optimizer) -> dict[str, set]:
    out = {"muon": set(), "adamw": set()}
    for g in opt.param_groups:
        out[g["algorithm"]] |= {id(p) for p in g["params"]}
    return out


def test_muon_gets_the_block_matrices_and_adamw_everything_else():
    model = chargpt()
    opt = model.configure_optimizers()
    assert isinstance(opt, MuonAdamW)
    names = {id(p): n for n, p in model.named_parameters()}
    groups = split(opt)
    muon = {names[i] for i in groups["muon"]}
    adamw = {names[i] for i in groups["adamw"]}
    expected = {f"net.blocks.{b}.{m}" for b in range(2) for m in MATRICES}
    assert muon == expected
    assert adamw == set(names.values()) - expected  # embedding (tied with the head), positions, norms, biases
    assert "net.tok_emb.weight" in adamw and "net.pos_emb.weight" in adamw
    # every group keeps its weight decay: matrices and embeddings decay, norms and biases do not
    for g in opt.param_groups:
        decays = {names[id(p)].endswith("weight") and (g["algorithm"] == "muon" or "emb" in names[id(p)])
                  for p in g["params"]}
        assert decays == {g["weight_decay"] > 0}


def test_a_step_is_torch_muon_on_the_matrices_and_adamw_on_the_rest():
    model = chargpt(weight_decay=0.1)
    reference = copy.deepcopy(model)
    opt = model.configure_optimizers()
    ref_params = dict(reference.named_parameters())
    muon_names = {n for n, p in model.named_parameters() if any(n.endswith(m) for m in MATRICES)}
    decayed = [n for n in ref_params if n not in muon_names and n.endswith("emb.weight")]
    plain = [n for n in ref_params if n not in muon_names and n not in decayed]
    ref_muon = torch.optim.Muon([ref_params[n] for n in sorted(muon_names)], lr=model.lr, weight_decay=0.1,
                                momentum=0.95, adjust_lr_fn="match_rms_adamw")
    ref_adamw = torch.optim.AdamW([{"params": [ref_params[n] for n in decayed]},
                                   {"params": [ref_params[n] for n in plain], "weight_decay": 0.0}],
                                  lr=model.lr, betas=model.betas, weight_decay=0.1)
    x = torch.randint(0, len(VOCAB), (4, 8), generator=torch.Generator().manual_seed(1))
    for _ in range(3):
        for m in (model, reference):
            loss = torch.nn.functional.cross_entropy(m(x[:, :-1]).flatten(0, 1), x[:, 1:].flatten())
            loss.backward()
        opt.step()
        ref_muon.step()
        ref_adamw.step()
        opt.zero_grad()
        ref_muon.zero_grad()
        ref_adamw.zero_grad()
    for n, p in model.named_parameters():
        assert torch.equal(p, ref_params[n]), n
    assert all("momentum_buffer" in opt.state[ref] for ref in
               [p for n, p in model.named_parameters() if n in muon_names])


def test_state_dict_round_trip_resumes_both_halves():
    model = chargpt()
    opt = model.configure_optimizers()
    x = torch.randint(0, len(VOCAB), (4, 8), generator=torch.Generator().manual_seed(2))

    def step(m, o):
        o.zero_grad()
        torch.nn.functional.cross_entropy(m(x[:, :-1]).flatten(0, 1), x[:, 1:].flatten()).backward()
        o.step()

    step(model, opt)
    twin = copy.deepcopy(model)
    twin_opt = twin.configure_optimizers()
    twin_opt.load_state_dict(copy.deepcopy(opt.state_dict()))
    step(model, opt)
    step(twin, twin_opt)
    for (n, a), b in zip(model.named_parameters(), twin.parameters()):
        assert torch.equal(a, b), n  # without the restored momentum and moments the second step differs


def test_unknown_optimizer_is_refused_with_the_choices():
    with pytest.raises(OptionError, match="sgd, adamw or muon"):
        CharGPT(optimizer="lion")


def test_the_base_recipe_keeps_embeddings_and_vectors_off_muon():
    """A recipe that does not override muon_parameters (the Hugging Face one, a user's): Muon takes its 2-D
    weights, never an embedding table (of any shape), a bias or a norm's scale."""
    from gradsync.recipes import Recipe

    class Tagger(Recipe):
        def __init__(self) -> None:
            super().__init__(optimizer="muon", lr=0.01)
            self.emb = torch.nn.Embedding(50, 8)  # 2-D, like the weights: only its type tells it apart
            self.hidden = torch.nn.Linear(8, 8)
            self.norm = torch.nn.LayerNorm(8)
            self.head = torch.nn.Linear(8, 5)

    model = Tagger()
    names = {id(p): n for n, p in model.named_parameters()}
    assert sorted(names[id(p)] for p in model.muon_parameters()) == ["head.weight", "hidden.weight"]
    groups = split(model.configure_optimizers())
    assert {names[i] for i in groups["muon"]} == {"head.weight", "hidden.weight"}
    assert "emb.weight" in {names[i] for i in groups["adamw"]}
