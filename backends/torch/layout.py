"""Encode tokens into page-section bytes and decode whole pages, in PyTorch ops."""

from __future__ import annotations

import torch

from ...formats import PackFormat
from ...quantizer import dequantize, pack_codes, quantize, store_dtype, unpack_codes


def section_view(pages: torch.Tensor, fmt: PackFormat, name: str) -> torch.Tensor:
    """``[num_pages, P, bytes per token]`` uint8 view of one section of ``pages``."""
    offset, size = fmt.sections[name]
    return pages[:, offset : offset + size].view(pages.shape[0], fmt.page_size, size // fmt.page_size)


def encode_tokens(fmt: PackFormat, c: torch.Tensor, kr: torch.Tensor) -> dict[str, torch.Tensor]:
    """float32 ``c [n, d_c]``, ``kr [n, d_r]`` -> ``{section: uint8 [n, bytes per token]}``."""
    if not fmt.quantized:
        return {
            "content_codes": c.to(torch.bfloat16).view(torch.uint8),
            "rope_codes": kr.to(torch.bfloat16).view(torch.uint8),
        }
    qc, sc, zc = quantize(c, fmt.content_bits, fmt.content_group_size, store_dtype(fmt.content_scale_dtype))
    qr, sr, zr = quantize(kr, fmt.rope_bits, fmt.rope_group_size, store_dtype(fmt.rope_scale_dtype))
    return {
        "content_codes": pack_codes(qc, fmt.content_bits),
        "rope_codes": pack_codes(qr, fmt.rope_bits),
        "content_scales": sc.contiguous().view(torch.uint8),
        "content_zeros": zc,
        "rope_scales": sr.contiguous().view(torch.uint8),
        "rope_zeros": zr,
    }


def decode_pages(fmt: PackFormat, pages: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """uint8 ``[n, page_bytes]`` -> float32 ``c [n*P, d_c]``, ``kr [n*P, d_r]``."""
    pages = pages.contiguous()
    codes_c = section_view(pages, fmt, "content_codes").reshape(-1, fmt.content_code_bytes)
    codes_r = section_view(pages, fmt, "rope_codes").reshape(-1, fmt.rope_code_bytes)
    if not fmt.quantized:
        return codes_c.contiguous().view(torch.bfloat16).float(), codes_r.contiguous().view(torch.bfloat16).float()
    sc = section_view(pages, fmt, "content_scales").reshape(-1, fmt.content_scale_bytes).contiguous()
    zc = section_view(pages, fmt, "content_zeros").reshape(-1, fmt.content_zero_bytes)
    sr = section_view(pages, fmt, "rope_scales").reshape(-1, fmt.rope_scale_bytes).contiguous()
    zr = section_view(pages, fmt, "rope_zeros").reshape(-1, fmt.rope_zero_bytes)
    c = dequantize(unpack_codes(codes_c, fmt.content_bits), sc.view(torch.bfloat16), zc, fmt.content_group_size)
    kr = dequantize(unpack_codes(codes_r, fmt.rope_bits), sr.view(torch.float32), zr, fmt.rope_group_size)
    return c, kr
