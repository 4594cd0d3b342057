"""``python -m ckptio.cli``: the ``ckptio`` command."""

import sys

from ckptio.cli.main import main

sys.exit(main())
