"""`python -m appliance ...` is the same as the `appliance` console script."""

import sys

from appliance.cli import main

sys.exit(main())
