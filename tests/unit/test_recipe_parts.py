"""Recipe parts without a Trainer: the schedule, the chargpt corpus and model, synthetic sizing, the CIFAR reader."""

import math
import pickle
import string

import pytest
import torch

from fake_cifar import CLASSES, write_fake_cifar10
from gradsync.errors import GradsyncError, OptionError
from gradsync.recipes.base import lr_factor
from gradsync.recipes.chargpt import CharData, CharGPT, decode, encode, read_corpus, stdlib_corpus_files
from gradsync.recipes.cifar10 import CifarImages, Cifar10Data, Cifar10ResNet, load_cifar10
from gradsync.recipes.synthetic import SyntheticModel
from gradsync.recipes.transformer import count_parameters


# ---- schedule -----------------------------------------------------------------------------------
def test_warmup_then_cosine_to_the_floor():
    f = lambda s: lr_factor(s, scheduler="cosine", warmup_steps=4, decay_steps=14, min_lr_ratio=0.1)  # noqa: E731
    assert [f(s) for s in range(4)] == [0.25, 0.5, 0.75, 1.0]
    assert f(4) == 1.0
    assert f(9) == pytest.approx(0.55)  # half-way through the cosine: (1 + floor) / 2
    assert f(14) == pytest.approx(0.1) and f(1000) == pytest.approx(0.1)
    assert all(f(s) >= f(s + 1) for s in range(4, 20))
    assert lr_factor(0, scheduler="constant") == 1.0 and lr_factor(99, warmup_steps=10) == 1.0


def test_schedule_options_are_validated():
    with pytest.raises(OptionError, match="scheduler"):
        SyntheticModel(num_params=20_000, scheduler="step")
    with pytest.raises(OptionError, match="warmup_steps"):
        SyntheticModel(num_params=20_000, warmup_steps=-1)
    with pytest.raises(OptionError, match="betas"):
        SyntheticModel(num_params=20_000, betas=(0.9, 1.0))


# ---- chargpt ------------------------------------------------------------------------------------
def test_default_corpus_is_the_stdlib_sorted_and_ascii():
    files = stdlib_corpus_files()
    assert len(files) > 50 and files == sorted(files) and any(f.name == "os.py" for f in files)
    text = read_corpus(max_chars=5000)
    assert len(text) == 5000 and text.isascii() and text == read_corpus(max_chars=5000)


def test_text_file_corpus_round_trips(tmp_path):
    path = tmp_path / "tiny.txt"
    path.write_text("héllo wörld\n" * 50, encoding="utf-8")
    text = read_corpus(str(path))
    vocab = "".join(sorted(set(text)))
    ids = encode(text, vocab)
    assert ids.dtype == torch.int32 and int(ids.max()) == len(vocab) - 1
    assert decode(ids, vocab) == text
    with pytest.raises(GradsyncError, match="not in the model's vocabulary"):
        encode("hello?", vocab)
    with pytest.raises(OptionError, match="path"):
        CharData(path=str(tmp_path / "missing.txt"))


def test_char_windows_follow_the_model_block_size(tmp_path):
    path = tmp_path / "abc.txt"
    path.write_text(string.ascii_lowercase * 40)
    data = CharData(path=str(path), val_fraction=0.25, val_windows=3, batch_size=2)
    data.block_size = 8
    data.setup("fit")
    x, y = data.train_set[1]
    assert decode(x, data.vocab) == "ijklmnop" and decode(y, data.vocab) == "jklmnopq"
    assert len(data.train_set) == (780 - 8) // 8 + 1 and len(data.val_set) == 3
    short = CharData(path=str(path), val_fraction=0.01)
    short.block_size = 64
    with pytest.raises(GradsyncError, match="fewer than block_size"):
        short.setup("fit")


def test_chargpt_parameter_count_and_options():
    model = CharGPT(n_layer=2, n_head=2, n_embd=16, block_size=8)
    model.build("abcdefghij")
    assert sum(p.numel() for p in model.parameters()) == count_parameters(2, 16, 10, 8) == model.num_parameters
    with pytest.raises(OptionError, match="n_head"):
        CharGPT(n_head=3, n_embd=128)
    with pytest.raises(GradsyncError, match="vocabulary"):
        model.build("abc")


def test_sampling_is_seeded_and_stays_in_the_vocabulary():
    torch.manual_seed(0)
    model = CharGPT(n_layer=1, n_head=1, n_embd=8, block_size=4)
    model.build("ab\ncd")
    a = model.sample("ab", 12, seed=3)
    assert len(a) == 12 and set(a) <= set("ab\ncd") and a == model.sample("ab", 12, seed=3)
    assert len(model.sample("", 5, temperature=0)) == 5  # greedy; the context outgrows block_size


# ---- synthetic ----------------------------------------------------------------------------------
@pytest.mark.parametrize("num_params, num_layers, tolerance", [
    (20_000, 2, 0.02), (1_000_000, 4, 0.002), (25_000_000, 4, 0.001)])
def test_synthetic_model_has_the_requested_size(num_params, num_layers, tolerance):
    model = SyntheticModel(num_params=num_params, num_layers=num_layers)
    assert abs(model.actual_num_params - num_params) <= tolerance * num_params
    assert len([m for m in model.net if isinstance(m, torch.nn.Linear)]) == num_layers + 2


# ---- cifar10 ------------------------------------------------------------------------------------
def test_cifar_reader_parses_the_pickle_batches(tmp_path):
    folder = write_fake_cifar10(tmp_path, per_batch=6, num_test=4)
    with open(folder / "data_batch_2", "rb") as f:
        raw = pickle.load(f, encoding="bytes")
    for root in (tmp_path, folder):  # the parent of cifar-10-batches-py, or the folder itself
        d = load_cifar10(root)
        assert d["train_x"].shape == (30, 3, 32, 32) and d["train_x"].dtype.name == "uint8"
        assert d["test_x"].shape == (4, 3, 32, 32) and d["classes"] == CLASSES
        # image 0 of batch 2 is training image 6: red plane first, rows top to bottom
        img = d["train_x"][6]
        assert img[0, 0, 1] == raw[b"data"][0][1] and img[1, 0, 0] == raw[b"data"][0][1024]
        assert img[2, 31, 31] == raw[b"data"][0][3071] and d["train_y"][6] == raw[b"labels"][0]


def test_missing_cifar_is_one_clear_line(tmp_path):
    with pytest.raises(GradsyncError) as exc:
        Cifar10Data(root=str(tmp_path / "nowhere"))
    msg = str(exc.value)
    assert "\n" not in msg and "cifar-10-batches-py" in msg and "data_batch_1" in msg and "cifar-10-python.tar.gz" in msg
    folder = write_fake_cifar10(tmp_path)
    (folder / "test_batch").unlink()
    with pytest.raises(GradsyncError, match="lacks test_batch"):
        Cifar10Data(root=str(tmp_path))
    (folder / "test_batch").write_bytes(b"not a pickle")
    with pytest.raises(GradsyncError, match="not a CIFAR-10 python batch"):
        load_cifar10(tmp_path)


def test_cifar_augmentation_depends_only_on_epoch_and_index(tmp_path):
    d = load_cifar10(write_fake_cifar10(tmp_path))
    epoch = [0]
    images = CifarImages(d["train_x"], d["train_y"], augment=True, epoch_of=lambda: epoch[0])
    epoch0 = [images[i][0] for i in range(8)]
    assert all(torch.equal(a, images[i][0]) for i, a in enumerate(epoch0)) and epoch0[0].shape == (3, 32, 32)
    epoch[0] = 1
    assert any(not torch.equal(a, images[i][0]) for i, a in enumerate(epoch0))
    plain = CifarImages(d["train_x"], d["train_y"])[5][0]
    assert plain.mean().abs() < 3 and math.isfinite(float(plain.std()))


def test_resnet18_has_the_standard_size():
    assert sum(p.numel() for p in Cifar10ResNet().parameters()) == 11_173_962
