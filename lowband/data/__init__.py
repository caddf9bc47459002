"""Byte tokenizer, built-in offline corpus, your own text files, ``.bin`` token shards and the distributed
loader."""

from lowband.data.corpus import (
    build_corpus,
    builtin_corpus,
    default_cache_dir,
    is_val_document,
    iter_documents,
)
from lowband.data.loader import DistributedLoader
from lowband.data.shards import ShardError, load_tokens, read_shard, write_shard
from lowband.data.text import TextSourceError, text_corpus, text_files
from lowband.data.tokenizer import ByteTokenizer

__all__ = ["ByteTokenizer", "DistributedLoader", "ShardError", "TextSourceError", "build_corpus", "builtin_corpus",
           "default_cache_dir", "is_val_document", "iter_documents", "load_tokens", "read_shard", "text_corpus",
           "text_files", "write_shard"]
