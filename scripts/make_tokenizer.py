#!/usr/bin/env python3
"""Rebuilds Meta's LLaMA-2 SentencePiece `tokenizer.model` from npm llama-tokenizer-js@1.2.2.

The package holds the 32000 pieces (base64, '\n'-joined, id order) but no scores, types or
spec. The scores follow from the ids (see ../shared/TOKENIZER.md): NORMAL piece i scores
-(i - 259), pure-U+2581 runs score -1e9, special and byte pieces 0. The ModelProto is written
by hand here (no protobuf runtime needed), fields in field-number order, so the output is
byte-identical to Meta's file; the sha256 check below fails loudly otherwise.

usage: make_tokenizer.py PATH/TO/llama-tokenizer.js OUT/tokenizer.model
"""
import base64
import hashlib
import re
import struct
import sys

EXPECTED_SHA256 = "9e556afd44213b6bd1be2b850ebbbd98f5481437a8021afaf58ee7fb1818d347"
EXPECTED_SIZE = 499723

# SentencePiece piece types (sentencepiece_model.proto).
NORMAL, UNKNOWN, CONTROL, BYTE = 1, 2, 3, 6


def varint(n):
    if n < 0:
        n += 1 << 64  # int32/int64 negatives are sign-extended to ten bytes
    out = bytearray()
    while True:
        b = n & 0x7F
        n >>= 7
        if n:
            out.append(b | 0x80)
        else:
            out.append(b)
            return bytes(out)


def key(field, wire):
    return varint((field << 3) | wire)


def f_varint(field, v):
    return key(field, 0) + varint(int(v))


def f_bytes(field, b):
    if isinstance(b, str):
        b = b.encode("utf-8")
    return key(field, 2) + varint(len(b)) + b


def f_float(field, v):
    return key(field, 5) + struct.pack("<f", v)


def read_vocab(js_path):
    text = open(js_path, encoding="utf-8").read()
    m = re.search(r'llama_vocab_base64\s*=\s*"([^"]+)"', text)
    if not m:
        sys.exit(f"make_tokenizer: no llama_vocab_base64 in {js_path}")
    pieces = base64.b64decode(m.group(1)).decode("utf-8").split("\n")
    if len(pieces) != 32000:
        sys.exit(f"make_tokenizer: expected 32000 pieces, found {len(pieces)}")
    return pieces


def piece_message(i, piece):
    if i == 0:
        ptype, score = UNKNOWN, 0.0
    elif i in (1, 2):
        ptype, score = CONTROL, 0.0
    elif 3 <= i <= 258:
        ptype, score = BYTE, 0.0
    else:
        ptype = NORMAL
        score = -1e9 if set(piece) == {"\u2581"} else -float(i - 259)
    body = f_bytes(1, piece) + f_float(2, score)
    if ptype != NORMAL:
        body += f_varint(3, ptype)
    return f_bytes(1, body)


def trainer_spec():
    # Field numbers from sentencepiece_model.proto, written in ascending order.
    fields = [
        f_bytes(1, "/large_experiments/theorem/datasets/MERGED/all.test1.merged"),
        f_bytes(2, "spm_model_32k_200M_charcov099995_allowWSO__v2"),
        f_varint(3, 2),  # model_type BPE
        f_varint(4, 32000),  # vocab_size
        f_varint(6, 0),  # self_test_sample_size
        f_bytes(7, "text"),  # input_format
        f_float(10, 0.99995),  # character_coverage
        f_varint(11, 200000000),  # input_sentence_size
        f_varint(14, 1000000),  # seed_sentencepiece_size
        f_float(15, 0.75),  # shrinking_factor
        f_varint(16, 80),  # num_threads
        f_varint(17, 2),  # num_sub_iterations
        f_varint(18, 4192),  # max_sentence_length
        f_varint(19, 1),  # shuffle_input_sentence
        f_varint(20, 16),  # max_sentencepiece_length
        f_varint(21, 1),  # split_by_unicode_script
        f_varint(22, 1),  # split_by_whitespace
        f_varint(23, 1),  # split_by_number
        f_varint(24, 0),  # treat_whitespace_as_suffix
        f_varint(25, 1),  # split_digits
        f_varint(26, 1),  # allow_whitespace_only_pieces
        f_varint(32, 1),  # vocabulary_output_piece_score
        f_varint(33, 1),  # hard_vocab_limit
        f_varint(34, 0),  # use_all_vocab
        f_varint(35, 1),  # byte_fallback
        f_bytes(36, ""),  # required_chars
        f_varint(40, 0),  # unk_id
        f_varint(41, 1),  # bos_id
        f_varint(42, 2),  # eos_id
        f_varint(43, -1),  # pad_id
        f_bytes(44, " \u2047 "),  # unk_surface
        f_bytes(45, "<unk>"),
        f_bytes(46, "<s>"),
        f_bytes(47, "</s>"),
        f_bytes(48, "<pad>"),
        f_varint(49, 0),  # train_extremely_large_corpus
        f_varint(50, 0),  # enable_differential_privacy
        f_float(51, 0.0),  # differential_privacy_noise_level
        f_varint(52, 0),  # differential_privacy_clipping_threshold
    ]
    return b"".join(fields)


def normalizer_spec():
    return b"".join([
        f_bytes(1, "identity"),
        f_bytes(2, b""),  # precompiled_charsmap
        f_varint(3, 1),  # add_dummy_prefix
        f_varint(4, 0),  # remove_extra_whitespaces
        f_bytes(6, ""),  # normalization_rule_tsv
    ])


def main():
    if len(sys.argv) != 3:
        sys.exit("usage: make_tokenizer.py llama-tokenizer.js OUT/tokenizer.model")
    pieces = read_vocab(sys.argv[1])
    model = b"".join(piece_message(i, p) for i, p in enumerate(pieces))
    model += f_bytes(2, trainer_spec()) + f_bytes(3, normalizer_spec())
    digest = hashlib.sha256(model).hexdigest()
    if digest != EXPECTED_SHA256 or len(model) != EXPECTED_SIZE:
        sys.exit(f"make_tokenizer: rebuilt model has sha256 {digest} ({len(model)} bytes); "
                 f"expected {EXPECTED_SHA256} ({EXPECTED_SIZE} bytes)")
    with open(sys.argv[2], "wb") as f:
        f.write(model)
    print(f"make_tokenizer: wrote {sys.argv[2]} ({len(model)} bytes, sha256 ok)")


if __name__ == "__main__":
    main()
