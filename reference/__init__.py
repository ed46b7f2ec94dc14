"""Float64 NumPy oracle for every QuantMLA op (``quantmla_core.reference``).

It shares no code with any backend: the quantizer, the bit packing, the page writer and
decode attention are written here again, plainly, so that a backend bug cannot hide in
shared code. Only the :class:`~quantmla_core.formats.PackFormat` (the layout contract) is
shared.
"""

from .quantize import bf16_round, quantize_groups, dequantize_groups
from .packing import pack, unpack
from .pages import decode_page, encode_token, gather_request, read_token, write
from .attention import decode_attention, mla_attention

__all__ = [
    "bf16_round",
    "quantize_groups",
    "dequantize_groups",
    "pack",
    "unpack",
    "write",
    "encode_token",
    "decode_page",
    "read_token",
    "gather_request",
    "decode_attention",
    "mla_attention",
]
