"""``python -m ckptio.cli``: the ``ckptio`` command."""

import sys

from ckptio.cli.command import main

sys.exit(main())
