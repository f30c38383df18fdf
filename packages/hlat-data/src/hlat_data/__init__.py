"""hlat-data: streaming Arrow documents, online SentencePiece tokenization, exact packing and
exact resume, for LLM pre-training. Imports without torch.

>>> from hlat_data import ArrowSource, PackedLoader, Tokenizer
"""

from hlat_data.convert import convert_to_arrow, corpus_stats
from hlat_data.errors import DataError
from hlat_data.loader import PackedLoader, merge_states
from hlat_data.packer import IGNORE_INDEX, Batch
from hlat_data.source import ArrowSource
from hlat_data.tokenizer import Tokenizer, default_threads, train_tokenizer

__version__ = "0.5.1"

__all__ = [
    "IGNORE_INDEX",
    "ArrowSource",
    "Batch",
    "DataError",
    "PackedLoader",
    "Tokenizer",
    "convert_to_arrow",
    "corpus_stats",
    "default_threads",
    "merge_states",
    "train_tokenizer",
]
