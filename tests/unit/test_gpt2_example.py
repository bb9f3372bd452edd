"""The transformers causal LM example: byte windows of the stdlib, models from a config, checkpoints to from_pretrained."""

from __future__ import annotations

import math
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from gossamer.checkpoint import save_model_checkpoint
from gossamer.checkpoint.sharded import ShardSnapshot, save_shard
from gossamer.examples import gpt2

pytest.importorskip("transformers")

TINY = {"d_model": 32, "n_layers": 1, "n_heads": 4, "seq_len": 32}


@pytest.fixture(autouse=True)
def offline(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # nothing here may reach the network
    yield


def test_windows_are_byte_ids_with_labels_equal_to_inputs_and_eval_after_train() -> None:
    train, held = gpt2.data(seq_len=32, max_bytes=50_000)
    text = gpt2.corpus(50_000)
    assert len(text) == 50_000 and int(text.max()) < gpt2.VOCAB
    split = 50_000 - 5_000
    assert len(train) == split // 32 and len(held) == 5_000 // 32
    item = train[3]
    assert set(item) == {"input_ids", "labels"} and item["input_ids"].dtype == torch.long
    assert torch.equal(item["input_ids"], item["labels"]) and item["input_ids"].shape == (32,)
    assert torch.equal(train[3]["input_ids"], text[96:128].long())
    assert torch.equal(held[0]["input_ids"], text[split : split + 32].long())
    assert held.targets().numel() == len(held) * 31
    assert bytes(text[:200].tolist()).decode("utf-8", "replace").count("\n") > 3  # it is source text


def test_unigram_entropy_is_that_of_the_bytes_own_frequencies() -> None:
    assert gpt2.unigram_entropy(torch.arange(256)) == pytest.approx(math.log(256))
    assert gpt2.unigram_entropy(torch.tensor([7, 7, 7])) == 0.0
    assert gpt2.unigram_entropy(torch.tensor([1, 2, 2, 2])) == pytest.approx(-(0.25 * math.log(0.25) + 0.75 * math.log(0.75)))
    _, held = gpt2.data(seq_len=32)
    h = gpt2.unigram_entropy(held.targets())
    assert 2.5 < h < math.log(256)  # source code: far from uniform, far from constant


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_models_from_a_config_compute_their_own_causal_lm_loss(arch: str) -> None:
    torch.manual_seed(0)
    net = gpt2.model(arch=arch, **TINY)
    train, _ = gpt2.data(seq_len=32, max_bytes=50_000)
    batch = torch.utils.data.default_collate([train[i] for i in range(4)])
    out = net(**batch)
    assert out.logits.shape == (4, 32, gpt2.VOCAB)
    # transformers shifts the labels itself: the loss is the next-byte cross-entropy.
    want = torch.nn.functional.cross_entropy(out.logits[:, :-1].reshape(-1, gpt2.VOCAB),
                                             batch["labels"][:, 1:].reshape(-1))
    assert out.loss.item() == pytest.approx(want.item(), rel=1e-5)
    assert abs(out.loss.item() - math.log(gpt2.VOCAB)) < 0.5  # fresh: about uniform
    tied = net.get_output_embeddings().weight is net.get_input_embeddings().weight
    assert tied == (arch == "gpt2")
    torch.manual_seed(0)
    again = gpt2.model(arch=arch, **TINY)
    assert all(torch.equal(a, b) for a, b in zip(net.state_dict().values(), again.state_dict().values(), strict=True))
    with pytest.raises(ValueError, match="arch must be one of gpt2, llama"):
        gpt2.model(arch="bert")


def _trained(arch: str) -> torch.nn.Module:
    """A model a few steps away from its initialisation, so a round trip cannot pass by re-initialising."""
    torch.manual_seed(1)
    net = gpt2.model(arch=arch, **TINY)
    train, _ = gpt2.data(seq_len=32, max_bytes=50_000)
    opt = torch.optim.AdamW(net.parameters(), lr=1e-2)
    for step in range(3):
        batch = torch.utils.data.default_collate([train[i] for i in range(step * 8, step * 8 + 8)])
        opt.zero_grad()
        net(**batch).loss.backward()
        opt.step()
    return net.eval()


def _sharded_checkpoint(net: torch.nn.Module, root: Path) -> Path:
    """The net's parameters as the two local ranks of an fsdp node save them (named_parameters: a tied one once)."""
    named = list(net.named_parameters())
    flat = torch.cat([p.detach().reshape(-1) for _, p in named])
    half = flat.numel() // 2
    for shard, (lo, hi) in enumerate([(0, half), (half, flat.numel())]):
        save_shard(root, ShardSnapshot(
            experiment="e", step=3, shard=shard, num_shards=2, total_numel=flat.numel(), version=3,
            pieces={lo: {"param": flat[lo:hi].clone()}}, layout=[(n, list(p.shape)) for n, p in named]))
    return root / "step-00000003"


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
@pytest.mark.parametrize("kind", ["model.pt", "sharded"])
def test_a_checkpoint_saved_pretrained_loads_with_from_pretrained_and_gives_identical_logits(
        tmp_path: Path, arch: str, kind: str) -> None:
    from transformers import AutoModelForCausalLM

    net = _trained(arch)
    if kind == "model.pt":
        ckpt = save_model_checkpoint(tmp_path / "ckpt", {k: v.clone() for k, v in net.state_dict().items()}, {})
    else:
        ckpt = _sharded_checkpoint(net, tmp_path / "ckpt")
    out = gpt2.save_pretrained(ckpt, tmp_path / "hf", arch=arch, **TINY)
    loaded = AutoModelForCausalLM.from_pretrained(out).eval()
    assert type(loaded) is type(net)
    ids = gpt2.data(seq_len=32, max_bytes=50_000)[1][0]["input_ids"][None]
    with torch.no_grad():
        assert torch.equal(loaded(input_ids=ids).logits, net(input_ids=ids).logits)
    if arch == "gpt2":
        assert loaded.lm_head.weight is loaded.transformer.wte.weight


def test_a_checkpoint_missing_a_parameter_that_is_not_a_tied_alias_is_refused(tmp_path: Path) -> None:
    net = _trained("gpt2")
    state = {k: v.clone() for k, v in net.state_dict().items() if k != "transformer.wpe.weight"}
    ckpt = save_model_checkpoint(tmp_path / "ckpt", state, {})
    with pytest.raises(RuntimeError, match=r"missing \['transformer.wpe.weight'\]"):
        gpt2.save_pretrained(ckpt, tmp_path / "hf", arch="gpt2", **TINY)
    assert not (tmp_path / "hf").exists()


def test_the_example_file_names_this_model_with_its_own_loss_and_matching_lengths() -> None:
    from gossamer.core.experiment import Experiment

    exp = Experiment.from_toml(Path(__file__).parents[2] / "examples" / "gpt2-tiny.toml")
    assert exp.loss == "model" and exp.model == "gossamer.examples.gpt2:model"
    assert exp.model_args["seq_len"] == exp.dataset_args["seq_len"]
    assert gpt2.config(**exp.model_args).n_positions == exp.dataset_args["seq_len"]
