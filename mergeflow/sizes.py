"""Sizes as people read them."""

UNITS = ("B", "kB", "MB", "GB", "TB", "PB")
"""Decimal units, as the Hub and `--max-shard-size` count."""


def human_size(size: int | float) -> str:
    """`26.1 kB`, `3.09 GB`: three significant digits (whole bytes below 1 kB).

    Example:
        >>> human_size(26112)
        '26.1 kB'
    """
    value, unit = float(size), 0
    while abs(value) >= 999.5 and unit < len(UNITS) - 1:
        value /= 1000
        unit += 1
    return f"{int(value)} B" if unit == 0 else f"{value:.3g} {UNITS[unit]}"
