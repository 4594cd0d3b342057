"""``python -m ckptio.bench ...``: the same as ``ckptio bench ...``."""

import sys

from ckptio.bench import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
