"""The image's HEALTHCHECK: exit 0 when GET /health on this container's server answers 200, else 1.

Plain standard library (the image has no curl). The port is the one the server listens on:
APPLIANCE_PORT, which configs/server/default.yaml reads too (the image sets it to 8000).
"""

from __future__ import annotations

import os
import sys
import urllib.error
import urllib.request


def main() -> int:
    url = f"http://127.0.0.1:{os.environ.get('APPLIANCE_PORT', '8000')}/health"
    try:
        with urllib.request.urlopen(url, timeout=4) as r:
            return 0 if r.status == 200 else 1
    except (urllib.error.URLError, OSError) as e:  # 503 while draining, refused while starting
        print(f"unhealthy: {url}: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
