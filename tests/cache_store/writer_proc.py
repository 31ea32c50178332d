"""A preprocessing writer as a real process: encodes rows ``start::step`` below ``stop``.

Used by the kill, concurrency and S3 tests.  Prints one line per put and a final
``encoded N`` (entries it had to write, i.e. not already in the cache).
Storage options, when needed, come as JSON in $CACHE_STORAGE_OPTIONS.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

from cache_store import open_cache
from tests.cache_store.samples import key_of, make_entry


def write_rows(url: str, rows, *, backend=None, writer=None, commit_every=5, scale=1, delay=0.0,
               storage_options=None, say=print) -> int:
    """Encode (synthesise) the given rows into the cache; return how many were not there yet."""
    store = open_cache(url, "a", backend=backend, fingerprint="test-encoders", writer=writer,
                       storage_options=storage_options)
    encoded = 0
    for i in rows:
        if store.has(key_of(i)):
            continue
        store.put(key_of(i), make_entry(i, scale))
        encoded += 1
        say(f"put {i}")
        if encoded % commit_every == 0:
            store.commit()
        time.sleep(delay)
    store.commit()
    return encoded


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("url")
    ap.add_argument("--backend", default=None)
    ap.add_argument("--writer", default=None)
    ap.add_argument("--start", type=int, default=0)
    ap.add_argument("--stop", type=int, required=True)
    ap.add_argument("--step", type=int, default=1)
    ap.add_argument("--commit-every", type=int, default=5)
    ap.add_argument("--scale", type=int, default=1)
    ap.add_argument("--delay", type=float, default=0.0, help="seconds per entry, to overlap writers")
    args = ap.parse_args()
    options = json.loads(os.environ.get("CACHE_STORAGE_OPTIONS", "null"))
    encoded = write_rows(args.url, range(args.start, args.stop, args.step), backend=args.backend,
                         writer=args.writer, commit_every=args.commit_every, scale=args.scale,
                         delay=args.delay, storage_options=options, say=lambda m: print(m, flush=True))
    print(f"encoded {encoded}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
