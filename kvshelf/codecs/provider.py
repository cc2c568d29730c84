"""The default codec provider: every latent and key/value lego, under the versioned id ``kvshelf-cache-v1``."""

from __future__ import annotations

from .codec import CodecProvider
from .encoded_codec import EncodedCodec
from .kv_codecs import KV_CODECS
from .mla_codec import MLACodec
from .paged_codec import PagedCodec

DEFAULT_PROVIDER_ID = "kvshelf-cache-v1"

default_provider = CodecProvider(
    DEFAULT_PROVIDER_ID, [MLACodec(dsa=False), MLACodec(dsa=True), EncodedCodec(), PagedCodec(), *KV_CODECS]
)

__all__ = ["DEFAULT_PROVIDER_ID", "default_provider"]
