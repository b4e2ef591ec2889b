"""Check that Transformer Engine's version is in the range megatron-core was developed against.

    python scripts/check_te_version.py --min 2.9 --below 2.12 [--required 0]

Prints the version found and exits 1 when it is missing or outside ``[min, below)``, unless
``--required 0`` (then it only warns). The Dockerfile runs it on the base image's TE.
"""

from __future__ import annotations

import argparse
import sys

from packaging.version import Version


def te_version() -> Version | None:
    """The installed Transformer Engine's version, or None."""
    try:
        import transformer_engine
    except ImportError:
        return None
    return Version(str(transformer_engine.__version__))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--min", type=Version, required=True, help="lowest version accepted")
    parser.add_argument("--below", type=Version, required=True, help="first version refused")
    parser.add_argument("--required", type=int, choices=(0, 1), default=1,
                        help="1: exit 1 outside the range; 0: warn only")
    args = parser.parse_args(argv)
    found = te_version()
    if found is not None and args.min <= Version(found.base_version) < args.below:
        print(f"Transformer Engine {found}: within [{args.min}, {args.below})")
        return 0
    what = "is not installed" if found is None else f"{found} is outside [{args.min}, {args.below})"
    print(f"Transformer Engine {what}, the range megatron-core 0.16.1 is developed against; use "
          "a base image that ships it (--build-arg BASE_IMAGE=...) or pip install "
          f"'transformer-engine[pytorch]>={args.min},<{args.below}'"
          + ("" if args.required else " (warning only: --required 0)"), file=sys.stderr)
    return 1 if args.required else 0


if __name__ == "__main__":
    sys.exit(main())
