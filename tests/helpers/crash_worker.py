"""A save that SIGKILLs its own process just before its Nth S3 request (tests/test_crash_safety.py).

    python crash_worker.py URL SIZE FILL KILL_BEFORE [--fence]

Writes SIZE bytes of FILL (one byte value) to URL through `S3MultipartWriter` (a multipart upload at 5 MiB parts, or
one PUT below that), with the directory fence when ``--fence``. KILL_BEFORE < 0: no kill; the process prints the
operations it sent, one JSON list, so the test knows how many instants there are. Otherwise the process kills itself
(SIGKILL: nothing runs after it, no abort, no clean-up) when it is about to send request number KILL_BEFORE (from 0),
every request before it having been answered. The S3 endpoint and keys come from the environment.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading

from s3_dirpath_utils import s3_url_parent
from s3_fencing import DirectoryFence, current_run
from s3_utils import S3Utils


def main() -> None:
    url, size, fill, kill_before = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
    fenced = "--fence" in sys.argv[5:]
    utils = S3Utils()
    sent: list[str] = []
    lock = threading.Lock()

    def before_call(model: object, params: dict[str, object], **_: object) -> None:
        with lock:
            if len(sent) == kill_before:
                os.kill(os.getpid(), signal.SIGKILL)
            key = str(params.get("Key", ""))
            sent.append(f"{getattr(model, 'name', '?')} {key.rpartition('/')[2]}")

    utils.client.meta.events.register("before-call.s3", before_call)
    fence = DirectoryFence(utils, s3_url_parent(url), current_run()) if fenced else None
    with utils.open_writer(url, 5, 2, "auto", fence=fence) as writer:
        block = bytes([fill]) * min(size, 1 << 20)
        left = size
        while left:
            left -= writer.write(block[: min(left, len(block))])
    print(json.dumps(sent), flush=True)


if __name__ == "__main__":
    main()
