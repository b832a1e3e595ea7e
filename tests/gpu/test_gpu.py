"""The GPU path, on one CUDA device (``make test-gpu``; skipped without CUDA; < 5 minutes).

* every strategy trains a few steps over NCCL at world size 1 (two processes need two GPUs: NCCL
  refuses two ranks on one device, so that case runs only where there are two);
* every codec on CUDA matches its CPU result: the GPU run's update differs from the CPU run's by at
  most 5% of the update, for every codec: the model's float arithmetic order is the only difference.
  int8 and int4 draw the same rounding noise on both devices and give bit-identical codes and decoded
  values for the same input (tests/unit/test_codecs.py, exact), so they need no wider margin;
* the compiled (Triton) int8/int4 encoder gives the eager encoder's bytes on CUDA, and sparseloco's
  messages and decoded sums on CUDA are the CPU's bytes (tails, odd sizes, fp16/bf16 values);
* a resumed GPU run equals an uninterrupted one, CUDA generator (stochastic rounding) included;
* the run summary names the NCCL version.
"""

import json

import pytest
import torch

pytestmark = [pytest.mark.timeout(240),
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

from gradsync.recipes import DigitsClassifier, DigitsData  # noqa: E402
from gradsync.strategies import STRATEGIES  # noqa: E402
from gradsync.strategies.compressed import CompressedStrategy  # noqa: E402
from harness import assert_resumed_at, fit, max_abs_diff  # noqa: E402

OPTIONS = {"accumulate": {}, "local_sgd": {"period": 2}, "diloco": {"period": 2}, "async_ps": {}}
TOLERANCE = {codec: 0.05 for codec in ("fp16", "bf16", "sign", "topk", "powersgd", "int8", "int4")}


def model():
    torch.manual_seed(0)
    return DigitsClassifier()


def _update(params, start):
    return max(float((params[k].float().cpu() - start[k].float()).abs().max()) for k in start)


@pytest.mark.parametrize("name", sorted(STRATEGIES))
def test_every_strategy_trains_over_nccl(tmp_path, name):
    kwargs = {"accumulate_grad_batches": 2} if name == "accumulate" else {}
    ranks = fit(model(), DigitsData(batch_size=16), strategy=STRATEGIES[name](**OPTIONS.get(name, {})), devices=1,
                max_steps=4, out=tmp_path, accelerator="gpu", **kwargs)
    assert ranks[0]["global_step"] == 4
    assert all(torch.isfinite(v.float()).all() for v in ranks[0]["params"].values())
    assert _update(ranks[0]["params"], model().state_dict()) > 0


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="NCCL needs a GPU per rank; this machine has one")
def test_two_ranks_over_nccl_agree(tmp_path):
    ranks = fit(model(), DigitsData(batch_size=16), strategy=STRATEGIES["sync"](), devices=2, max_steps=4,
                out=tmp_path, accelerator="gpu")
    assert max_abs_diff(ranks[0]["params"], ranks[1]["params"]) == 0.0


@pytest.mark.parametrize("codec", sorted(TOLERANCE))
def test_codec_on_cuda_matches_its_cpu_result(tmp_path, codec):
    start = model().state_dict()
    runs = {acc: fit(model(), DigitsData(batch_size=16), strategy=CompressedStrategy(codec=codec), devices=1,
                     max_steps=5, out=tmp_path / acc, accelerator=acc)[0]["params"] for acc in ("cpu", "gpu")}
    update = _update(runs["cpu"], start)
    diff = max_abs_diff({k: v.cpu() for k, v in runs["gpu"].items()}, runs["cpu"])
    assert update > 0 and diff <= TOLERANCE[codec] * update, f"{codec}: |gpu - cpu| {diff:.2e}, update {update:.2e}"


def test_resume_on_cuda_restores_the_generator(tmp_path):
    from lightning.pytorch.callbacks import Callback

    ckpt = tmp_path / "step5.ckpt"

    class SaveAt(Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            if trainer.global_step == 5:
                trainer.save_checkpoint(ckpt)

    whole = fit(model(), DigitsData(batch_size=16), strategy=CompressedStrategy(codec="int8"), devices=1,
                max_steps=10, out=tmp_path / "whole", accelerator="gpu", callbacks=(SaveAt(),))
    resumed = fit(model(), DigitsData(batch_size=16), strategy=CompressedStrategy(codec="int8"), devices=1,
                  max_steps=10, out=tmp_path / "resumed", accelerator="gpu", ckpt_path=str(ckpt))
    assert_resumed_at(resumed, 5, 10)
    assert max_abs_diff(resumed[0]["params"], whole[0]["params"]) <= 1e-6


def test_summary_names_the_nccl_version(tmp_path):
    from gradsync.cli.main import main

    out = tmp_path / "run"
    assert main(["fit", "--recipe", "digits", "--accelerator", "gpu", "--devices", "1", "--max-steps", "3",
                 "--output-dir", str(out)]) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["backend"] == "nccl" and summary["nccl_version"].count(".") == 2


@pytest.mark.parametrize("codec", ["int8", "int4"])
@pytest.mark.parametrize("rows,shard,chunk,dtype", [(1, 4096, 512, torch.float32), (2, 1000, 64, torch.float32),
                                                    (3, 2050, 2048, torch.float16), (2, 778, 8, torch.bfloat16)])
def test_compiled_encoder_on_cuda_gives_the_eager_bytes(codec, rows, shard, chunk, dtype, monkeypatch):
    from gradsync.comm.codecs import fused
    from gradsync.comm.codecs.int8 import Int4Reducer, Int8Reducer

    g = torch.Generator().manual_seed(shard)
    x = (torch.randn(rows, shard, generator=g) * torch.logspace(-4, 2, shard)).to(dtype).float().cuda()

    def messages(compiled: bool) -> torch.Tensor:
        monkeypatch.setenv("GRADSYNC_COMPILED_CODECS", "1" if compiled else "0")
        reducer = {"int8": Int8Reducer, "int4": Int4Reducer}[codec](chunk_size=chunk, seed=5)
        msgs = torch.empty(rows, reducer.message_bytes(shard), dtype=torch.uint8, device="cuda")
        reducer.encode(x, msgs, torch.empty(rows, shard, device="cuda"), divisor=2)
        return msgs.cpu()

    eager, compiled = messages(False), messages(True)
    assert fused._kernels.get("cuda") is not None, "the compiled encoder was not used on CUDA"
    assert torch.equal(compiled, eager)


@pytest.mark.parametrize("chunk,k,bits", [(4096, 64, 2), (256, 16, 4), (64, 48, 2), (1024, 3, 8)])
def test_sparseloco_on_cuda_gives_the_cpu_bytes(chunk, k, bits):
    from gradsync.comm.codecs import sparse

    g = torch.Generator().manual_seed(chunk + k)
    x = torch.randn(3 * chunk + 77, generator=g).mul_(4).round_().div_(4)  # ties on a coarse grid
    x[: chunk // 2] = 0
    for values in (x, x.half().float(), x.bfloat16().float()):
        cpu = torch.stack([sparse.encode(values, chunk, k, bits), sparse.encode(-values.flip(0), chunk, k, bits)])
        gpu = torch.stack([sparse.encode(v.cuda(), chunk, k, bits) for v in (values, -values.flip(0))])
        assert torch.equal(gpu.cpu(), cpu)
        total = sparse.decode_sum(gpu, values.numel(), chunk, k, bits).cpu()
        assert torch.equal(total, sparse.decode_sum(cpu, values.numel(), chunk, k, bits))
