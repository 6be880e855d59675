"""The torch states the peer scripts save: shared so every script measures the same shapes.

Other scripts in this folder import it (``sys.path`` holds the script's own directory).
"""

from __future__ import annotations

import torch

MiB = 1 << 20


def transformer_layer(h: int) -> list[tuple[str, tuple[int, ...]]]:
    """The fp32 tensors of one transformer layer of hidden size ``h`` (12 tensors,
    ``12 * h * h + 13 * h`` elements), by their name inside the layer."""
    return [
        ("ln1.weight", (h,)),
        ("ln1.bias", (h,)),
        ("attn.qkv.weight", (3 * h, h)),
        ("attn.qkv.bias", (3 * h,)),
        ("attn.proj.weight", (h, h)),
        ("attn.proj.bias", (h,)),
        ("ln2.weight", (h,)),
        ("ln2.bias", (h,)),
        ("mlp.up.weight", (4 * h, h)),
        ("mlp.up.bias", (4 * h,)),
        ("mlp.down.weight", (h, 4 * h)),
        ("mlp.down.bias", (h,)),
    ]


def fill(tensors: list[torch.Tensor], seed: int = 0) -> None:
    """Fills every tensor with pseudo-random bytes (a 64 MiB pattern, repeated)."""
    g = torch.Generator().manual_seed(seed)
    pattern = torch.randint(0, 256, (64 * MiB,), dtype=torch.uint8, generator=g)
    for t in tensors:
        u = t.reshape(-1).view(torch.uint8)
        for off in range(0, u.numel(), pattern.numel()):
            n = min(pattern.numel(), u.numel() - off)
            u[off : off + n].copy_(pattern[:n])
