"""A saver that tests/store/test_resave.py kills (SIGKILL) or pauses between a commit's manifest and its
fence.

It commits step ``--good`` through a ``CheckpointManager``, then saves step ``--step`` (the
state of ``crash_campaign.state_for(--step + STATE_OFFSET)``: not the state a re-save of the
step writes, so a restore tells whose commit stands). That commit creates its manifest, then
stops before claiming its fence (:mod:`ckptio.store.fence`, step 4) until the file ``--go`` exists,
with its event loop free: its heartbeat goes on, as a live but slow save's would. It prints one
JSON line per event: ``ready`` (the good step committed), ``stalled`` (the manifest is created,
the fence not claimed), then ``ok`` or ``failed`` (with ``error``) once released.

    python tests/workers/resave_worker.py --root DIR --good 1 --step 2 --go FILE
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
from typing import Any

TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(TESTS, "scenarios"))  # crash_campaign

#: The stalled save writes ``state_for(step + STATE_OFFSET)``.
STATE_OFFSET = 1000


def _emit(event: str, **fields: Any) -> None:
    sys.stdout.write(json.dumps({"event": event, **fields}) + "\n")
    sys.stdout.flush()


def stall_before_fence(inner: Any, step: int, go: str, at: str) -> Any:
    """``inner``, whose commit of ``step`` waits (without blocking the loop) until the file ``go``
    exists: before its fence claim (``at="claim"``) or before it lists the step's revocations
    (``at="revocations"``, ckptio.store.fence step 3), once its manifest is created either way."""
    from ckptio.backends.wrappers import WrapperBackend
    from ckptio.manifest import MANIFEST_NAME
    from ckptio.manifest.names import FENCE_PREFIX, revoked_prefix

    async def stall(key: str) -> None:
        _emit("stalled", key=key)
        while not os.path.exists(go):
            await asyncio.sleep(0.01)

    class StallBeforeFence(WrapperBackend):
        manifest_made = False

        async def create_if_absent(self, key: str, data: bytes) -> None:
            where, _, name = key.rpartition("/")
            if at == "claim" and where == str(step) and name.startswith(FENCE_PREFIX) and data == b"commit":
                await stall(key)
            await super().create_if_absent(key, data)
            if key == f"{step}/{MANIFEST_NAME}":
                self.manifest_made = True

        async def list(self, prefix: str = "") -> Any:
            if at == "revocations" and self.manifest_made and prefix == revoked_prefix(str(step)):
                self.manifest_made = False
                await stall(prefix)
            return await super().list(prefix)

    return StallBeforeFence(inner)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--root", required=True)
    ap.add_argument("--good", type=int, required=True)
    ap.add_argument("--step", type=int, required=True)
    ap.add_argument("--go", required=True)
    ap.add_argument("--stall-at", choices=["claim", "revocations"], default="claim")
    a = ap.parse_args()

    from crash_campaign import state_for

    import ckptio
    from ckptio.backends import open_backend

    backend = stall_before_fence(open_backend(a.root, object_size=1 << 20), a.step, a.go, a.stall_at)
    mngr = ckptio.CheckpointManager(a.root, backend=backend)
    mngr.save(a.good, state_for(a.good), force=True)
    mngr.wait_until_finished()
    _emit("ready")
    try:
        mngr.save(a.step, state_for(a.step + STATE_OFFSET), force=True)
        mngr.wait_until_finished()
        _emit("ok")
    except Exception as e:  # the test judges the outcome
        _emit("failed", error=f"{type(e).__name__}: {e}")
    mngr.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
