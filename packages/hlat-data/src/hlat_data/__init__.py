"""hlat-data: streaming Arrow documents, online SentencePiece tokenization, exact packing and
exact resume, for LLM pre-training. Imports without torch.

>>> from hlat_data import ArrowSource, PackedLoader, Tokenizer
"""

from hlat_data.convert import convert_to_arrow, corpus_stats
from hlat_data.errors import DataError
from hlat_data.jsonl import JsonlSource, open_source
from hlat_data.loader import PackedLoader, merge_states
from hlat_data.mixture import MixedLoader, MixtureSource
from hlat_data.packer import IGNORE_INDEX, Batch
from hlat_data.source import ArrowSource, Source
from hlat_data.tokenizer import Tokenizer, default_threads, train_tokenizer

__version__ = "0.8.4"

__all__ = [
    "IGNORE_INDEX",
    "ArrowSource",
    "Batch",
    "DataError",
    "JsonlSource",
    "MixedLoader",
    "MixtureSource",
    "PackedLoader",
    "Source",
    "Tokenizer",
    "convert_to_arrow",
    "corpus_stats",
    "default_threads",
    "merge_states",
    "open_source",
    "train_tokenizer",
]
