"""Average CEPE adapters trained along one route (``cepe.soup.average_adapters``).

Usage: python scripts/average_adapters.py OUT_DIR ADAPTER_DIR ADAPTER_DIR [...] [--weights W W ...]
"""

from __future__ import annotations

import argparse

from cepe.soup import average_adapters


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", help="the new adapter directory")
    ap.add_argument("adapters", nargs="+", help="two or more adapter directories with one config")
    ap.add_argument("--weights", type=float, nargs="+", default=None, help="one weight per adapter")
    a = ap.parse_args()
    try:
        path = average_adapters(a.adapters, a.out, a.weights)
    except ValueError as e:
        raise SystemExit(f"error: {e}") from None
    print(f"wrote the average of {len(a.adapters)} adapters to {path}")


if __name__ == "__main__":
    main()
