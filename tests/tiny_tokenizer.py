"""Re-export: the helper lives in ``loadtests.tiny_tokenizer`` so benchmarks can train it too."""

from loadtests.tiny_tokenizer import BOS, UNK, VOCAB_SIZE, tiny_corpus, train_tiny_tokenizer

__all__ = ["BOS", "UNK", "VOCAB_SIZE", "tiny_corpus", "train_tiny_tokenizer"]
