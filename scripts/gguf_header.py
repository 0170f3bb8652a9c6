#!/usr/bin/env python3
"""Copies a GGUF file's header (metadata and tensor list, a few MiB) and
records the whole file's size beside it (DST.size).

    scripts/gguf_header.py SRC DST

The GPU scripts carry the catalog models' headers instead of the models
(hundreds of MB): on the GPU machine a header made a sparse file of the
recorded size is a template for `encore_llm::synthetic::synthetic_like`,
which fills the model's tensors, in their shapes and types, with random
weights.
"""
import os
import struct
import sys

# Bytes of each fixed-size metadata value type (GGUF v3).
SIZES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
STRING, ARRAY = 8, 9


def header_end(f):
    """The offset where the tensor data starts (the header, aligned)."""

    def u32():
        return struct.unpack("<I", f.read(4))[0]

    def u64():
        return struct.unpack("<Q", f.read(8))[0]

    def skip(t):
        if t == STRING:
            f.seek(u64(), 1)
        elif t == ARRAY:
            et, n = u32(), u64()
            if et in SIZES:
                f.seek(SIZES[et] * n, 1)
            else:
                for _ in range(n):
                    skip(et)
        else:
            f.seek(SIZES[t], 1)

    if f.read(4) != b"GGUF":
        sys.exit(f"{f.name}: not a GGUF file")
    u32()  # version
    n_tensors, n_kv = u64(), u64()
    alignment = 32
    for _ in range(n_kv):
        key = f.read(u64()).decode()
        t = u32()
        if key == "general.alignment":
            alignment = u32()
        else:
            skip(t)
    for _ in range(n_tensors):
        f.seek(u64(), 1)  # name
        f.seek(8 * u32() + 12, 1)  # dimensions, type, offset
    return (f.tell() + alignment - 1) // alignment * alignment


def main():
    if len(sys.argv) != 3:
        sys.exit("usage: gguf_header.py SRC DST")
    src, dst = sys.argv[1:]
    with open(src, "rb") as f:
        end = header_end(f)
        f.seek(0)
        header = f.read(end)
    with open(dst, "wb") as out:
        out.write(header)
    with open(dst + ".size", "w") as out:
        out.write(str(os.path.getsize(src)))


if __name__ == "__main__":
    main()
