"""A character-level transformer language model trained on the Python standard library's own source."""

from __future__ import annotations

import functools
import math
import os
import sysconfig
from pathlib import Path
from typing import NamedTuple

import torch
from torch import nn
from torch.utils.data import TensorDataset

#: Printable ASCII (32..126) as ids 0..94, then '\n', '\t', and one id for every other character.
PRINTABLE = 95
NEWLINE, TAB, OTHER = PRINTABLE, PRINTABLE + 1, PRINTABLE + 2
#: Vocabulary size, the same on every machine whatever the Python version.
VOCAB = PRINTABLE + 3

_SKIP_DIRS = frozenset({"site-packages", "dist-packages", "test", "tests", "idlelib", "__pycache__"})


def _byte_table() -> torch.Tensor:
    table = torch.full((256,), OTHER, dtype=torch.uint8)
    table[32:127] = torch.arange(PRINTABLE, dtype=torch.uint8)
    table[ord("\n")] = NEWLINE
    table[ord("\t")] = TAB
    return table


_TABLE = _byte_table()


def source_files(root: str | os.PathLike[str] | None = None) -> list[Path]:
    """The stdlib's `.py` files in a fixed (sorted by relative path) order, tests and IDLE left out."""
    base = Path(root or sysconfig.get_paths()["stdlib"])
    found: list[Path] = []
    for dirpath, dirnames, filenames in os.walk(base):
        dirnames[:] = [d for d in dirnames if d not in _SKIP_DIRS]
        found += [Path(dirpath) / f for f in filenames if f.endswith(".py")]
    return sorted(found, key=lambda p: p.relative_to(base).as_posix())


def encode(text: str) -> torch.Tensor:
    """Character ids (uint8) of `text`: one id per character, every non-ASCII character -> OTHER."""
    if not text:
        return torch.zeros(0, dtype=torch.uint8)
    raw = torch.frombuffer(bytearray(text.encode("utf-8")), dtype=torch.uint8)
    # A UTF-8 character is one lead byte (< 0x80 or >= 0xC0) and its continuation bytes:
    # dropping the continuations leaves one byte per character (the table maps leads to OTHER).
    return _TABLE[raw[(raw < 0x80) | (raw >= 0xC0)].long()]


def decode(ids: torch.Tensor) -> str:
    """Text of character ids (OTHER shows as U+FFFD)."""
    chars = [chr(32 + i) if i < PRINTABLE else {NEWLINE: "\n", TAB: "\t"}.get(i, "\ufffd") for i in ids.tolist()]
    return "".join(chars)


@functools.lru_cache(maxsize=4)
def _text(max_chars: int) -> torch.Tensor:
    """The encoded corpus (read once per process): stdlib sources concatenated up to `max_chars`."""
    parts: list[str] = []
    size = 0
    for path in source_files():
        try:
            text = path.read_bytes().decode("utf-8")
        except (OSError, UnicodeDecodeError):
            continue
        parts.append(text)
        size += len(text)
        if size >= max_chars:
            break
    return encode("".join(parts)[:max_chars])


def _windows(ids: torch.Tensor, seq_len: int, stride: int) -> tuple[torch.Tensor, torch.Tensor]:
    if ids.numel() < seq_len + 1:
        raise ValueError(f"{ids.numel()} characters are too few for one window of {seq_len} + 1")
    w = ids.long().unfold(0, seq_len + 1, stride)
    return w[:, :-1].contiguous(), w[:, 1:].contiguous()


def _split(seq_len: int, max_chars: int, eval_fraction: float,
           stride: int | None) -> tuple[tuple[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor], int]:
    """(train windows, eval windows, eval windows left out as copies of a train window)."""
    if seq_len < 1 or max_chars < 2 or not 0 < eval_fraction < 1:
        raise ValueError(f"bad arguments: seq_len={seq_len} max_chars={max_chars} eval_fraction={eval_fraction}")
    ids = _text(max_chars)
    split = len(ids) - int(len(ids) * eval_fraction)
    train = _windows(ids[:split], seq_len, stride or seq_len)
    x, y = _windows(ids[split:], seq_len, seq_len)
    # Code repeats itself (licence headers, runs of spaces or '#'): an eval window equal to a train
    # window would be scored on text the model was trained on.
    seen = {row.tobytes() for row in train[0].numpy()}
    keep = torch.tensor([row.tobytes() not in seen for row in x.numpy()], dtype=torch.bool)
    return train, (x[keep], y[keep]), int((~keep).sum())


def data(seq_len: int = 64, max_chars: int = 400_000, eval_fraction: float = 0.1,
         stride: int | None = None) -> tuple[TensorDataset, TensorDataset]:
    """Return (train, eval) datasets of (input ids, target ids), both LongTensor[seq_len].

    The target is the input shifted by one character. The eval set is the last
    `eval_fraction` of the text, cut into non-overlapping windows; train windows come from
    the text before it, every `stride` characters (default `seq_len`: non-overlapping).
    No eval character is an input or a target of a train window, and an eval window whose
    input equals a train window's is left out (a few of boilerplate, on some Python versions).

    The text is the Python standard library's `.py` sources, so it differs between Python
    versions: every process of one experiment should run the same one.
    """
    train, held, _ = _split(seq_len, max_chars, eval_fraction, stride)
    return TensorDataset(*train), TensorDataset(*held)


class Baseline(NamedTuple):
    """A cross-entropy in nats per character, and the same in bits per character."""

    nats: float
    bits_per_char: float


def bits_per_char(nats: float) -> float:
    """Bits per character of a mean cross-entropy in nats (what `eval_loss` reports): nats / ln 2."""
    return nats / math.log(2)


def unigram_baseline(seq_len: int = 64, max_chars: int = 400_000, eval_fraction: float = 0.1) -> Baseline:
    """Cross-entropy of the eval targets under the train text's character frequencies.

    A model that learnt nothing beyond character frequencies scores this; a language model
    should do much better. Frequencies are add-one smoothed so no eval character costs
    infinitely much. Same arguments as `data`, so it scores exactly the eval targets.
    """
    ids = _text(max_chars)
    split = len(ids) - int(len(ids) * eval_fraction)
    counts = torch.bincount(ids[:split].long(), minlength=VOCAB).double() + 1.0
    logp = (counts / counts.sum()).log()
    targets = _split(seq_len, max_chars, eval_fraction, None)[1][1].reshape(-1)
    nats = float(-logp[targets].mean())
    return Baseline(nats, bits_per_char(nats))


class CharTransformer(nn.Module):
    """Decoder-only transformer: token + learned position embeddings, pre-norm causal blocks, linear head.

    Each block is its own `nn.TransformerEncoderLayer` (`nn.TransformerEncoder` would deep-copy
    one layer, so every block would start from the same weights).
    """

    causal_mask: torch.Tensor

    def __init__(self, d_model: int, n_layers: int, n_heads: int, seq_len: int, dropout: float) -> None:
        super().__init__()
        self.seq_len = seq_len
        self.tok = nn.Embedding(VOCAB, d_model)
        self.pos = nn.Embedding(seq_len, d_model)
        self.blocks = nn.ModuleList(
            nn.TransformerEncoderLayer(d_model, n_heads, dim_feedforward=4 * d_model, dropout=dropout,
                                       activation="gelu", batch_first=True, norm_first=True)
            for _ in range(n_layers)
        )
        self.norm = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, VOCAB)
        self.drop = nn.Dropout(dropout)
        # Small embeddings (as GPT-2 does): with unit-variance ones the residual stream starts
        # dominated by them and the first steps mostly shrink them.
        nn.init.normal_(self.tok.weight, std=0.02)
        nn.init.normal_(self.pos.weight, std=0.02)
        mask = nn.Transformer.generate_square_subsequent_mask(seq_len)
        self.register_buffer("causal_mask", mask, persistent=False)  # not a parameter, not checkpointed

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Logits [B, T, VOCAB] for ids [B, T] (T <= seq_len); position t sees ids 0..t only."""
        t = x.shape[1]
        if t > self.seq_len:
            raise ValueError(f"sequence of {t} is longer than the model's seq_len {self.seq_len}")
        h = self.drop(self.tok(x) + self.pos.weight[:t])
        mask = self.causal_mask[:t, :t]
        for block in self.blocks:
            h = block(h, src_mask=mask, is_causal=True)
        return self.head(self.norm(h))


def model(d_model: int = 64, n_layers: int = 2, n_heads: int = 4, seq_len: int = 64,
          dropout: float = 0.0) -> nn.Module:
    """The char LM (fp32); `seq_len` must be at least the data's `seq_len`."""
    return CharTransformer(d_model, n_layers, n_heads, seq_len, dropout)
