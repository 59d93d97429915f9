"""The stream cursor: a small JSON-serialisable dict that reproduces the next batch exactly.

webdataset has no resumable state, so the stream owns its position (docs/design.md §2). A cursor only makes sense for
the stream layout it was taken from: a different world size, rank, lane count, segment length (or data) would
silently read other documents, so such a cursor is refused with a ValueError naming every difference.
"""

from __future__ import annotations

CURSOR_VERSION = 1

# Settings that fix which documents a reader reads and how lanes cut them; a cursor must match all of them.
LAYOUT_KEYS = ("split", "mode", "world_size", "rank", "num_workers", "worker", "lanes", "seg_len",
               "continuous", "shuffle", "shuffle_window", "data")


def check_cursor(saved: dict, layout: dict) -> None:
    """Raise ValueError unless `saved` was taken from a stream with this layout."""
    if not isinstance(saved, dict) or saved.get("version") != CURSOR_VERSION:
        version = saved.get("version") if isinstance(saved, dict) else type(saved).__name__
        raise ValueError(f"not a lane-stream cursor of version {CURSOR_VERSION} (got {version!r})")
    changed = [f"{key}: cursor has {saved.get(key)!r}, this stream has {layout[key]!r}"
               for key in LAYOUT_KEYS if saved.get(key) != layout[key]]
    if changed:
        raise ValueError("stream cursor does not match this stream (" + "; ".join(changed) + "); a cursor only "
                         "resumes the same split with the same world size, rank, workers, lanes, segment length "
                         "and data ('data' is the split's shard checksums)")
    if len(saved.get("lanes_state", ())) != layout["lanes"]:
        raise ValueError(f"stream cursor holds {len(saved.get('lanes_state', ()))} lane states for "
                         f"{layout['lanes']} lanes")
