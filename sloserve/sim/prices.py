"""What a GPU costs to rent, in dollars per GPU-hour, for deployment searches that trade cost
against latency (sloserve/hetero.py). Prices move and differ by provider and commitment: these are
on-demand list prices of one provider where it lists the part, cited; pass your own (`--prices`).
"""
from __future__ import annotations

from typing import Mapping

PRICES_PER_GPU_HOUR: dict[str, float] = {
    # Lambda Cloud on-demand list prices, 2025: 8x H100 SXM at $2.99 per GPU-hour, 8x A100 SXM 80 GB at $1.79,
    # 1x A10 (24 GB PCIe) at $0.75.
    "h100-80g": 2.99,
    "a100-80g": 1.79,
    "a10-24g": 0.75,
    # Not listed by Lambda: an approximate marketplace price for one L40S (GPU clouds listed ~$0.9-1.0 per hour
    # in 2025). Replace it with your own.
    "l40s": 0.99,
}


def gpu_price(hardware: str, prices: Mapping[str, float] = PRICES_PER_GPU_HOUR) -> float:
    try:
        return float(prices[hardware])
    except KeyError:
        raise ValueError(f"no price for {hardware!r}: give one (--prices {hardware}=DOLLARS_PER_HOUR); "
                         f"known: {sorted(prices)}") from None


def parse_prices(text: str) -> dict[str, float]:
    """`h100-80g=2.99,a10-24g=0.75` over the defaults."""
    out = dict(PRICES_PER_GPU_HOUR)
    for part in filter(None, (p.strip() for p in text.split(","))):
        name, sep, value = part.partition("=")
        try:
            price = float(value)
        except ValueError:
            price = -1.0
        if not sep or not price >= 0:
            raise ValueError(f"--prices takes GPU=DOLLARS_PER_HOUR pairs, got {part!r}")
        out[name.strip()] = price
    return out
