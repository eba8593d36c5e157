"""Peak memory of `s3_checkpoint_convert` conversions, in a fresh process:
``python -m convert_memory_worker --endpoint URL --case NAME SRC DST [--case ...] --out result.json``.

Each case converts SRC into DST once, after a warm-up conversion of the same kind (first-use allocations, imports
and connection pools are not the conversion's); a thread samples the process's RSS every millisecond meanwhile.
The result is, per case, the highest RSS seen minus the RSS just before the conversion started. A case named
``control`` does what the conversion avoids, ``torch.load`` of the whole SRC, to show the measurement sees it.
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
import warnings

warnings.filterwarnings("ignore")


class PeakSampler:
    def __init__(self) -> None:
        import psutil

        self._process = psutil.Process()
        self._stop = threading.Event()
        self.baseline = self._process.memory_info().rss
        self.peak = self.baseline
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, self._process.memory_info().rss)
            time.sleep(0.005)

    def __enter__(self) -> PeakSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self._process.memory_info().rss)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--endpoint", required=True)
    parser.add_argument("--case", nargs=4, action="append", metavar=("NAME", "WARMUP_SRC", "SRC", "DST"), default=[])
    parser.add_argument("--chunk-size-mb", type=float, default=5)
    parser.add_argument("--concurrency", type=int, default=1, help="GETs and parts in flight")
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)

    import gc

    import s3_checkpoint_convert
    import s3_utils

    utils = s3_utils.S3Utils(s3_utils.S3ClientSettings(endpoint_url=args.endpoint))
    options = {
        "s3_utils": utils,
        "chunk_size_MB": args.chunk_size_mb,
        "max_read_concurrency": args.concurrency,
        "max_write_concurrency": args.concurrency,
        "overwrite": True,
    }
    results = {}
    for name, warmup, src, dst in args.case:
        if name == "control":
            import torch

            torch.load(warmup, weights_only=True)
            gc.collect()
            with PeakSampler() as sampler:
                state = torch.load(src, weights_only=True)
            results[name] = {"peak_extra_bytes": sampler.peak - sampler.baseline}
            del state
            continue
        s3_checkpoint_convert.convert_checkpoint(warmup, dst, **options)
        gc.collect()
        with PeakSampler() as sampler:
            report = s3_checkpoint_convert.convert_checkpoint(src, dst, **options)
        results[name] = {"peak_extra_bytes": sampler.peak - sampler.baseline, "tensor_bytes": report.tensor_bytes}
    with open(args.out, "w") as stream:
        json.dump(results, stream)
    return 0


if __name__ == "__main__":
    sys.exit(main())
