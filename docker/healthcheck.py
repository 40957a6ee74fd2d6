#!/usr/bin/env python3
"""Container health check for the pagestream image: exit 0 iff GET /health answers 200.

Python rather than curl because the slim base image has no curl, and installing one only
for this would grow every image.  The server answers 503 while the model loads and while
it drains after SIGTERM, so a stopping replica turns unhealthy before it goes.
"""

import os
import sys
import urllib.error
import urllib.request


def main() -> int:
    port = os.environ.get("PAGESTREAM_PORT") or "8000"
    req = urllib.request.Request(f"http://127.0.0.1:{port}/health")
    # /health should not need a key, but sending it costs nothing and keeps the check
    # working if a deployment puts /health behind auth.
    key = os.environ.get("PAGESTREAM_API_KEY")
    if key:
        req.add_header("Authorization", f"Bearer {key}")
    try:
        with urllib.request.urlopen(req, timeout=4) as resp:
            ok = resp.status == 200
            status = resp.status
    except urllib.error.HTTPError as e:  # 503 while loading or draining
        ok, status = False, e.code
    except OSError as e:  # not listening yet, or gone
        print(f"health: {e}", file=sys.stderr)
        return 1
    if not ok:
        print(f"health: HTTP {status}", file=sys.stderr)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
