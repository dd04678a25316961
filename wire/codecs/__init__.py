"""Codecs for pseudo-gradients and model deltas on the WAN.

The sender picks a codec per tensor (``choose_codec``) and encodes; the receiver decodes from the
manifest entry alone::

    codec = choose_codec(name, delta, config)          # config: CompressionConfig
    enc = codec_state.encode(name, delta, codec)       # error feedback kept in codec_state
    entry = TensorEntry(name, dtype, shape, offset, enc.data.numel(), enc.codec, enc.meta)
    ...
    decode_into(acc, data, entry.codec_meta, alpha, codec=entry.codec, name=entry.name)

=======  =====================  ==================================================  ============
codec    bytes / element        error bound (element-wise)                          feedback
=======  =====================  ==================================================  ============
none     itemsize (raw)         exact                                               no
bf16     2                      2^-8 relative                                       no
fp16     2                      2^-11 relative for |x| >= 6.1e-5, 3e-8 below       no
int8     1 + scales             0.5 * s_b, s_b ~ max|x_b| / 127                     optional
int4     0.5 + scales           0.5 * s_b, s_b ~ max|x_b| / 7                       default on
topk     ~(2 + 1.2) * fraction  unsent |v| <= smallest sent; sent fp16 2^-11 rel.   default on
=======  =====================  ==================================================  ============

Size: ``codec.max_encoded_bytes(shape, dtype)`` is the most data bytes ``encode`` writes (exactly
that many but for topk); a receiver bounds an entry by ``data_bounds(meta)`` before it takes a byte.

Range: fp16 refuses ``|x| >= 65520``, bf16 ``|x| >= 3.396e38``; int8, int4 and topk refuse
``|x| + max|r| >= 1.7e38``; none takes anything finite.

Hostile input: ``encode`` refuses NaN/Inf (and values a cast would overflow) with a
``CodecError`` (a ``ValueError``) naming the tensor, and leaves codec state unchanged. ``decode``
and ``decode_into`` validate the meta (CRC32), the data length against shape/block/k, the data
(CRC32), scales, indices and values before writing, so they raise ``CodecError`` or produce a
finite, well-formed tensor; see ``wire/codecs/base.py`` for what each integrity layer guarantees.
"""

from wire.codecs.base import MAX_META_BYTES, Codec, CodecError, Encoded
from wire.codecs.cast import Bf16Codec, Fp16Codec, NoneCodec
from wire.codecs.quantize import Int4Codec, Int8Codec
from wire.codecs.registry import (
    CODEC_NAMES,
    CODECS,
    codec_params,
    data_bounds,
    decode,
    decode_into,
    make_codec,
    meta_info,
    verify,
)
from wire.codecs.rules import CodecConfigError, CodecRule, CompressionConfig, choose_codec
from wire.codecs.state import CodecState, TensorState
from wire.codecs.topk import TopKCodec

__all__ = [
    "CODECS",
    "CODEC_NAMES",
    "MAX_META_BYTES",
    "Bf16Codec",
    "Codec",
    "CodecConfigError",
    "CodecError",
    "CodecRule",
    "CodecState",
    "CompressionConfig",
    "Encoded",
    "Fp16Codec",
    "Int4Codec",
    "Int8Codec",
    "NoneCodec",
    "TensorState",
    "TopKCodec",
    "choose_codec",
    "codec_params",
    "data_bounds",
    "decode",
    "decode_into",
    "make_codec",
    "meta_info",
    "verify",
]
