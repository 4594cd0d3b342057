"""moto's S3 server, with each object write decided atomically against its ``If-None-Match``.

moto checks ``If-None-Match: *`` and then stores the object, two steps of a threaded server, so two
racing conditional PUTs can both win on a loaded machine (seen in a fresh-clone CI run: two
winners of one key); S3 decides them atomically. The conformance race test is about the backend,
not moto's threading, so the tests run moto with one lock around its object writes (PUT and the
multipart completion), which is how the service behaves; and around DeleteObject, whose
``If-Match`` moto also checks before it deletes. Usage: as ``python -m moto.server``.
"""

from __future__ import annotations

import functools
import threading
from typing import Any

from moto.s3 import responses
from moto.server import main

_lock = threading.Lock()


def _atomic(method: Any) -> Any:
    @functools.wraps(method)
    def locked(self: Any, *args: Any, **kwargs: Any) -> Any:
        with _lock:
            return method(self, *args, **kwargs)

    return locked


for _name in ("put_object", "_key_response_post", "delete_object"):
    setattr(responses.S3Response, _name, _atomic(getattr(responses.S3Response, _name)))

if __name__ == "__main__":
    main()
