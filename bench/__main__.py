"""`python -m bench serve ...` (what `pagestream bench serve ...` runs): the load generator.

bench/ is the top floor: it imports the service, never the other way round, so the
`pagestream` command hands `bench ...` to this module as a new program.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["serve"]:
        from bench.serve import main as serve_main

        return serve_main(argv[1:])
    print("usage: pagestream bench serve [--help] ...", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
