"""A Hugging Face causal LM (GPT-2 or Llama) built from a config, trained from scratch on the stdlib's sources as bytes."""

from __future__ import annotations

import functools
import math
import os
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import Dataset

from gossamer.examples.charlm import source_files

#: Byte-level vocabulary: every UTF-8 byte is a token, so no tokenizer is downloaded.
VOCAB = 256
ARCHS = ("gpt2", "llama")


def config(arch: str = "gpt2", d_model: int = 64, n_layers: int = 2, n_heads: int = 4, seq_len: int = 64,
           dropout: float = 0.0, init_std: float | None = None) -> Any:
    """The transformers config of a byte-level causal LM: `GPT2Config` or `LlamaConfig`.

    No special tokens (ids 0..255 are bytes); the loss is transformers' causal-LM loss, the
    mean over every predicted position of the labels shifted by one. Weights start with
    standard deviation `init_std`, by default 0.5 / sqrt(d_model): GPT-2's 0.02 at its width
    768, scaled with the width. (At d_model 64, 0.02 left GPT-2 near the unigram entropy for
    over 100 steps: 0.89x of it after 100 AdamW steps, against 0.75x with 0.0625.)
    """
    std = 0.5 / math.sqrt(d_model) if init_std is None else init_std
    common: dict[str, Any] = {"vocab_size": VOCAB, "bos_token_id": None, "eos_token_id": None, "pad_token_id": None,
                              "initializer_range": std}
    if arch == "gpt2":
        from transformers import GPT2Config

        return GPT2Config(n_positions=seq_len, n_embd=d_model, n_layer=n_layers, n_head=n_heads,
                          resid_pdrop=dropout, embd_pdrop=dropout, attn_pdrop=dropout, **common)
    if arch == "llama":
        from transformers import LlamaConfig

        return LlamaConfig(hidden_size=d_model, intermediate_size=4 * d_model, num_hidden_layers=n_layers,
                           num_attention_heads=n_heads, num_key_value_heads=n_heads,
                           max_position_embeddings=seq_len, attention_dropout=dropout, **common)
    raise ValueError(f"arch must be one of {', '.join(ARCHS)}, got {arch!r}")


def model(arch: str = "gpt2", d_model: int = 64, n_layers: int = 2, n_heads: int = 4, seq_len: int = 64,
          dropout: float = 0.0, init_std: float | None = None) -> torch.nn.Module:
    """A freshly initialised `GPT2LMHeadModel` (input and output embeddings tied) or `LlamaForCausalLM`.

    Built from `config(...)` with the current torch seed; no weights are downloaded.
    `seq_len` must be at least the data's.
    """
    from transformers import AutoModelForCausalLM

    net = AutoModelForCausalLM.from_config(config(arch, d_model, n_layers, n_heads, seq_len, dropout, init_std))
    net.loss_type = "ForCausalLM"  # GPT2LMHeadModel's class name does not say it: transformers warns, then uses it
    return net


@functools.lru_cache(maxsize=4)
def corpus(max_bytes: int = 400_000) -> torch.Tensor:
    """The stdlib's `.py` sources (charlm's files, in its order) concatenated as bytes, up to `max_bytes`."""
    parts: list[bytes] = []
    size = 0
    for path in source_files():
        try:
            raw = path.read_bytes()
        except OSError:
            continue
        parts.append(raw)
        size += len(raw)
        if size >= max_bytes:
            break
    return torch.frombuffer(bytearray(b"".join(parts)[:max_bytes]), dtype=torch.uint8).clone()


class ByteWindows(Dataset[dict[str, torch.Tensor]]):
    """Non-overlapping windows of a byte sequence as transformers batches: {input_ids, labels}.

    `labels` is `input_ids` itself: the model shifts it, so a window of `seq_len` bytes
    makes `seq_len - 1` predictions.
    """

    def __init__(self, ids: torch.Tensor, seq_len: int, stride: int | None = None) -> None:
        if ids.numel() < seq_len:
            raise ValueError(f"{ids.numel()} bytes are too few for one window of {seq_len}")
        self.windows = ids.long().unfold(0, seq_len, stride or seq_len).contiguous()

    def __len__(self) -> int:
        return self.windows.shape[0]

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        w = self.windows[i]
        return {"input_ids": w, "labels": w}

    def targets(self) -> torch.Tensor:
        """Every byte the model predicts (each window's bytes after its first), flattened."""
        return self.windows[:, 1:].reshape(-1)


def data(seq_len: int = 64, max_bytes: int = 400_000, eval_fraction: float = 0.1,
         stride: int | None = None) -> tuple[ByteWindows, ByteWindows]:
    """(train, eval) datasets of byte windows: the eval set is the last `eval_fraction` of the text.

    Train windows start every `stride` bytes (default `seq_len`) in the text before the
    eval part, so no eval byte is trained on. The text is the running Python's stdlib: every
    process of one experiment should run the same Python version.
    """
    if seq_len < 2 or max_bytes < 2 or not 0 < eval_fraction < 1:
        raise ValueError(f"bad arguments: seq_len={seq_len} max_bytes={max_bytes} eval_fraction={eval_fraction}")
    ids = corpus(max_bytes)
    split = len(ids) - int(len(ids) * eval_fraction)
    return ByteWindows(ids[:split], seq_len, stride), ByteWindows(ids[split:], seq_len)


def unigram_entropy(targets: torch.Tensor) -> float:
    """Entropy in nats of the bytes' own frequencies in `targets`: the best any unigram model scores on them."""
    p = torch.bincount(targets.long(), minlength=VOCAB).double()
    p = p[p > 0] / p.sum()
    return float(-(p * p.log()).sum())


def save_pretrained(checkpoint: str | os.PathLike[str], out_dir: str | os.PathLike[str],
                    **model_args: Any) -> Path:
    """Write a gossamer checkpoint of `model(**model_args)` as a transformers model directory.

    `gossamer.load_checkpoint` + `load_state_dict` + `save_pretrained`: the directory then
    loads with `AutoModelForCausalLM.from_pretrained(out_dir)`. A sharded (fsdp) checkpoint
    holds a tied parameter once (GPT-2's `lm_head.weight` is `transformer.wte.weight`):
    only such aliases may be missing from it.
    """
    from gossamer.checkpoint import load_checkpoint

    net = model(**model_args)
    load_tied_state(net, load_checkpoint(checkpoint))
    net.save_pretrained(out_dir)  # type: ignore[operator]
    return Path(out_dir)


def load_tied_state(net: torch.nn.Module, state: dict[str, torch.Tensor]) -> None:
    """`net.load_state_dict(state)`, where a key may be missing only if it names a parameter tied to one present.

    Raises:
        RuntimeError: a key is missing that is not a tied alias, or one is unexpected.
    """
    owner = {id(p): name for name, p in net.named_parameters()}  # the first name of each parameter
    aliases = {name for name, p in net.named_parameters(remove_duplicate=False) if owner[id(p)] != name}
    missing, unexpected = net.load_state_dict(state, strict=False)
    bad = [k for k in missing if k not in aliases or owner.get(id(net.get_parameter(k))) not in state]
    if bad or unexpected:
        raise RuntimeError(f"checkpoint does not match the model: missing {bad}, unexpected {list(unexpected)}")


def perplexity(eval_loss: float) -> float:
    """Perplexity per byte of a mean cross-entropy in nats."""
    return math.exp(eval_loss)
