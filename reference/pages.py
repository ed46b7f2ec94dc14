"""Reference page writer and reader (DESIGN.md §3.4, §3.5), NumPy, one token at a time.

Works in place on the arrays of an ``MLACache`` (NumPy arrays, or CPU torch tensors viewed
as NumPy without copies; bfloat16 buffers are handled through their uint16 bit patterns).
"""

from __future__ import annotations

import numpy as np

from .packing import pack, unpack
from .quantize import bf16_round, bf16_to_bits, bits_to_bf16, dequantize_groups, quantize_groups


def _view(a) -> tuple[np.ndarray, bool]:
    """NumPy view of an array or CPU tensor sharing its memory; flag True for bfloat16 data."""
    if isinstance(a, np.ndarray):
        return a, False
    import torch

    if a.device.type != "cpu":
        raise ValueError(f"reference: expected NumPy arrays or CPU tensors, got a tensor on {a.device}")
    if a.dtype == torch.bfloat16:
        return a.view(torch.int16).numpy().view(np.uint16), True
    return a.numpy(), False


def _host(a) -> np.ndarray:
    """Read-only host copy of an index array or tensor."""
    if isinstance(a, np.ndarray):
        return a
    return a.detach().cpu().numpy()


def _floats(a) -> np.ndarray:
    """Input values (float32 / bfloat16 / float64 arrays or tensors) -> float32 NumPy."""
    if isinstance(a, np.ndarray):
        return a.astype(np.float32)
    return a.detach().cpu().float().numpy()


def _store_protected(buf, row: int, col: int, x: np.ndarray) -> None:
    arr, is_bf16 = _view(buf)
    arr[row, col] = bf16_to_bits(bf16_round(x)) if is_bf16 else x.astype(arr.dtype)


def _load_protected(buf, row: int, cols) -> np.ndarray:
    arr, is_bf16 = _view(buf)
    v = arr[row, cols]
    return (bits_to_bf16(v) if is_bf16 else v).astype(np.float64)


def _section(page: np.ndarray, fmt, name: str, per_token: int) -> np.ndarray:
    off, size = fmt.sections[name]
    return page[off : off + size].reshape(fmt.page_size, per_token)


def encode_token(fmt, page: np.ndarray, slot: int, c: np.ndarray, kr: np.ndarray) -> None:
    """Write one token (float32 ``c [d_c]``, ``kr [d_r]``) at ``slot`` of a page row (uint8)."""
    if not fmt.quantized:
        vals = {"content_codes": c, "rope_codes": kr}
        for name, v in vals.items():
            bytes_ = bf16_to_bits(bf16_round(v)).astype("<u2").view(np.uint8)
            _section(page, fmt, name, bytes_.size)[slot] = bytes_
        return
    qc, sc, zc = quantize_groups(c, fmt.content_bits, fmt.content_group_size, fmt.content_scale_dtype)
    qr, sr, zr = quantize_groups(kr, fmt.rope_bits, fmt.rope_group_size, fmt.rope_scale_dtype)
    _section(page, fmt, "content_codes", fmt.content_code_bytes)[slot] = pack(qc, fmt.content_bits)
    _section(page, fmt, "rope_codes", fmt.rope_code_bytes)[slot] = pack(qr, fmt.rope_bits)
    _section(page, fmt, "content_scales", fmt.content_scale_bytes)[slot] = bf16_to_bits(sc).astype("<u2").view(np.uint8)
    _section(page, fmt, "content_zeros", fmt.content_zero_bytes)[slot] = zc
    _section(page, fmt, "rope_scales", fmt.rope_scale_bytes)[slot] = sr.astype("<f4").view(np.uint8)
    _section(page, fmt, "rope_zeros", fmt.rope_zero_bytes)[slot] = zr


def decode_page(fmt, page: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """All P tokens of one page row -> float64 ``c [P, d_c]``, ``kr [P, d_r]`` (slots never
    written decode to whatever their bytes say, NaN included; callers slice them away)."""
    with np.errstate(invalid="ignore", over="ignore"):
        return _decode_page(fmt, page)


def _decode_page(fmt, page: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    if not fmt.quantized:
        c = bits_to_bf16(_section(page, fmt, "content_codes", fmt.content_code_bytes).copy().view("<u2"))
        kr = bits_to_bf16(_section(page, fmt, "rope_codes", fmt.rope_code_bytes).copy().view("<u2"))
        return c.astype(np.float64), kr.astype(np.float64)
    qc = unpack(_section(page, fmt, "content_codes", fmt.content_code_bytes), fmt.content_bits)
    qr = unpack(_section(page, fmt, "rope_codes", fmt.rope_code_bytes), fmt.rope_bits)
    sc = bits_to_bf16(_section(page, fmt, "content_scales", fmt.content_scale_bytes).copy().view("<u2"))
    zc = _section(page, fmt, "content_zeros", fmt.content_zero_bytes)
    sr = _section(page, fmt, "rope_scales", fmt.rope_scale_bytes).copy().view("<f4")
    zr = _section(page, fmt, "rope_zeros", fmt.rope_zero_bytes)
    c = dequantize_groups(qc, sc, zc, fmt.content_group_size)
    kr = dequantize_groups(qr, sr, zr, fmt.rope_group_size)
    return c, kr


def read_token(cache, slot: int) -> tuple[np.ndarray, np.ndarray]:
    """Dequantized packed copy of the token at global ``slot`` (page * P + offset)."""
    fmt = cache.format
    pages, _ = _view(cache.pages)
    c, kr = decode_page(fmt, pages[slot // fmt.page_size])
    return c[slot % fmt.page_size], kr[slot % fmt.page_size]


def write(cache, latent, k_rope, slot_mapping, seq_ids, positions, seq_lens) -> None:
    """Reference of ``quantmla_core.write``: pack every token whose slot lies in the cache into its
    slot and copy protected tokens (``position < sink``; ``position >= seq_lens[seq] - local``,
    ring index ``position % local``) into the protection buffers, in place. As every backend
    masks them (``validate=False``): a slot of -1 or outside the pages skips the token, and a
    seq id outside ``[0, max_seqs)`` or a negative position skips its protection copies."""
    fmt = cache.format
    pages, _ = _view(cache.pages)
    c_all, kr_all = _floats(latent), _floats(k_rope)
    slots, seqs, pos, lens = _host(slot_mapping), _host(seq_ids), _host(positions), _host(seq_lens)
    p = fmt.page_size
    for t in range(c_all.shape[0]):
        slot = int(slots[t])
        if not 0 <= slot < pages.shape[0] * p:
            continue
        encode_token(fmt, pages[slot // p], slot % p, c_all[t], kr_all[t])
        seq, n = int(seqs[t]), int(pos[t])
        if not (0 <= seq < cache.max_seqs and n >= 0):
            continue
        both = np.concatenate([c_all[t], kr_all[t]])
        if n < cache.sink:
            _store_protected(cache.sink_buf, seq, n, both)
        if cache.local > 0 and n >= int(lens[seq]) - cache.local:
            _store_protected(cache.local_buf, seq, n % cache.local, both)


def gather_request(cache, block_table_row, length: int, seq_id: int) -> tuple[np.ndarray, np.ndarray]:
    """The operands decode attention sees for one request of ``length`` tokens: float64
    ``c [L, d_c]``, ``kr [L, d_r]``; token n from the sink buffer if ``n < sink``, else from
    the local ring if ``n >= L - local``, else its dequantized packed copy."""
    fmt = cache.format
    pages, _ = _view(cache.pages)
    table = _host(block_table_row)
    p, dc = fmt.page_size, fmt.latent_dim
    n_pages = (length + p - 1) // p
    c = np.empty((n_pages * p, dc))
    kr = np.empty((n_pages * p, fmt.rope_dim))
    for i in range(n_pages):
        c[i * p : (i + 1) * p], kr[i * p : (i + 1) * p] = decode_page(fmt, pages[int(table[i])])
    c, kr = c[:length], kr[:length]
    n_sink = min(cache.sink, length)
    if n_sink:
        both = _load_protected(cache.sink_buf, seq_id, slice(0, n_sink))
        c[:n_sink], kr[:n_sink] = both[:, :dc], both[:, dc:]
    first_local = max(length - cache.local, n_sink)
    if cache.local > 0 and first_local < length:
        idx = np.arange(first_local, length)
        both = _load_protected(cache.local_buf, seq_id, idx % cache.local)
        c[idx], kr[idx] = both[:, :dc], both[:, dc:]
    return c, kr
