"""A tiny BPE ``tokenizer.json`` trained offline in milliseconds, for tests and benchmarks that need a
real tokenizer (e.g. a simulated engine in precise KV-event mode).

The corpus is generated deterministically (no downloads, no randomness between runs), so a test may
rely on the same text always giving the same ids. A post-processor prepends ``<s>`` when special
tokens are requested, like a Llama-style BOS, so ``add_special_tokens`` has a visible effect.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from pathlib import Path

from tokenizers import Tokenizer, models, pre_tokenizers, processors, trainers

BOS = "<s>"
UNK = "[UNK]"
VOCAB_SIZE = 500

# ~150 distinct words: enough for BPE to learn ~500 merges (word pieces, then whole words).
_WORDS_TEXT = (
    "the a an every each our their this that router prefill decode pod node cache block token prompt "
    "request answer system user model engine scheduler queue batch prefix suffix hash key event index "
    "stream header route pick score cost link transfer memory budget limit window group epoch gate "
    "replica pool signal metric latency throughput deadline quickly slowly again before after during "
    "while within without across between under over near far long short small large warm cold hot "
    "fresh stale shared private local remote first last next previous same other new old good bad "
    "fast slow busy idle ready draining failed admitted routes computes stores evicts transfers reuses "
    "hashes admits rejects retries waits scales measures predicts reports drops keeps sends receives "
    "reads writes counts matches misses hits grows shrinks starts stops runs is was has had will can "
    "should must may and or but so because if then when where why how which who what"
)


def tiny_corpus(n_sentences: int = 400) -> Iterator[str]:
    """``n_sentences`` English-like sentences of 6..16 words; seeded, so always the same ones."""
    words = _WORDS_TEXT.split()
    rng = random.Random(20240611)
    for _ in range(n_sentences):
        sentence = rng.choices(words, k=rng.randint(6, 16))
        yield " ".join(sentence).capitalize() + rng.choice((".", "?", "!", ", then."))


def train_tiny_tokenizer(path: Path) -> Path:
    """Train a ~500-token BPE tokenizer (whitespace pre-tokenizer, BOS post-processor); save to ``path``."""
    tokenizer = Tokenizer(models.BPE(unk_token=UNK))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB_SIZE, special_tokens=[UNK, BOS], show_progress=False)
    tokenizer.train_from_iterator(tiny_corpus(), trainer=trainer)
    bos_id = tokenizer.token_to_id(BOS)
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A $B", special_tokens=[(BOS, bos_id)]
    )
    path.parent.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(path))
    return path
