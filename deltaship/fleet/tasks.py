"""What runs on the fleet's nodes: an export as a Ray task (`build`), a device as a Ray actor (`Device`). Both are
plain Python here; fleet/run.py wraps them with `ray.remote` and the resources that place them."""

from __future__ import annotations

import os
import socket
import time
from pathlib import Path
from typing import Any

from deltaship.compile import export
from deltaship.devices.discovery import fingerprint
from deltaship.fleet.store import Store
from deltaship.profiling.profile import profile
from deltaship.profiling.settings import ProfileSettings


def node_id() -> str | None:
    """The Ray node this runs on (None outside Ray)."""
    import ray  # lazy: ray (the fleet extra)

    return ray.get_runtime_context().get_node_id() if ray.is_initialized() else None


def build(store: str, key: str, model: str, target: str, precision: str, options: dict[str, Any]) -> dict[str, Any]:
    """Build one bundle into the store unless its key is there; returns its record, whether it was built here,
    and where."""
    started = time.monotonic()

    def make(out: Path) -> None:
        export(model, out, target=target, precision=precision, progress=False, **options)

    record, built = Store(store).build(key, make)
    return {
        **record,
        "built": built,
        "node": node_id(),
        "host": socket.gethostname(),
        "seconds": time.monotonic() - started,
    }


def _kept(doc: dict[str, Any]) -> dict[str, Any]:
    """A profile document without its raw samples and RSS trace (a row holds the statistics)."""
    out = {k: v for k, v in doc.items() if k != "rss_trace"}
    out["results"] = [{k: v for k, v in r.items() if k != "samples"} for r in doc.get("results", [])]
    return out


class Device:
    """One device, owned by one actor on the node it is attached to: its profiles run one at a time, with a
    cool-down between them; tier names run on this node's host under the tier's limits (as `profile --tier`)."""

    def __init__(self, device: str, tiers: tuple[str, ...], cooldown_s: float = 0.0):
        self.device, self.cooldown_s, self.last = device, cooldown_s, None
        self.settings = {"device": "host", "tier": device} if device in tiers else {"device": device}

    def where(self) -> dict[str, Any]:
        return {"node": node_id(), "host": socket.gethostname(), "pid": os.getpid()}

    def fingerprint(self) -> dict[str, Any]:
        return fingerprint(self.settings["device"])

    def profile(self, store: str, key: str, sha256: str, workload: dict[str, Any]) -> dict[str, Any]:
        """Profile the store's bundle `key` (checked against `sha256` first); returns the profile document
        without its samples, and where it ran."""
        bundle = Store(store).arrive(key, sha256)
        if self.last is not None and (wait := self.cooldown_s - (time.monotonic() - self.last)) > 0:
            time.sleep(wait)
        try:
            doc = profile(bundle, ProfileSettings(**self.settings, **workload))
        finally:
            self.last = time.monotonic()
        return {**_kept(doc), "where": self.where()}
