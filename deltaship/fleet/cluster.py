"""The Ray cluster a fleet runs on: an embedded local one (no set-up) or the user's (`--address HOST:PORT`), and what
its nodes advertise: `device:<id>` per attached device (and per tier a host emulates), `toolchain:<target>` per
target whose toolchain imports there.

Ray's token authentication is on (RAY_AUTH_MODE=token; the token is read from RAY_AUTH_TOKEN_PATH or ~/.ray). A
cluster on loopback (the embedded one, or an --address of 127.0.0.1/localhost) keeps every Ray process on loopback:
Ray otherwise swaps 127.0.0.1 for the host's routable address and listens on every interface. Its session files go
to a private temporary directory (RAY_TMPDIR), never the machine-wide /tmp/ray another user's cluster lives in.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import sys
import tempfile
from contextlib import contextmanager
from typing import Any, Iterator

from deltaship.devices.discovery import adb_devices
from deltaship.errors import DeltashipEnvironmentError, DeltashipError
from deltaship.targets import all_targets

LOOPBACK = ("127.0.0.1", "localhost", "::1", "[::1]")
OBJECT_STORE_BYTES = 100 << 20  # results are small dicts; bundles go through the store, never here


def toolchains() -> dict[str, float]:
    """`toolchain:<target>` for every target whose export toolchain this machine can import."""
    return {
        f"toolchain:{t.name}": 1.0
        for t in all_targets()
        if all(importlib.util.find_spec(p) is not None for p in t.tool_packages)
    }


def advertised(tiers: tuple[str, ...], adb: bool = False) -> dict[str, float]:
    """What this machine offers the cluster: its host (and every tier it can emulate), its toolchains, and with
    adb=True the phones `adb devices` lists."""
    out = {"device:host": 1.0, **{f"device:{t}": 1.0 for t in tiers}, **toolchains()}
    if adb:
        out.update({f"device:adb:{s}": 1.0 for s in adb_devices()})
    return out


def is_loopback(address: str | None) -> bool:
    return address is None or address.rsplit(":", 1)[0] in LOOPBACK


def split_address(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise DeltashipError(f"--address {address!r} is not HOST:PORT", "pass the head's address, e.g. 10.0.0.5:6379")
    return host, int(port)


@contextmanager
def loopback_only(on: bool) -> Iterator[None]:
    """With on=True, Ray takes 127.0.0.1 as this node's address (its switch for a machine that is not in a
    multi-node cluster), so its servers bind loopback only; restored afterwards."""
    import_ray()
    import ray._private.ray_constants as constants  # lazy: ray (the fleet extra)

    saved = constants.ENABLE_RAY_CLUSTER, os.environ.get("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER")
    if on:
        constants.ENABLE_RAY_CLUSTER = False
        os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"  # the processes Ray starts read it at import
    try:
        yield
    finally:
        constants.ENABLE_RAY_CLUSTER = saved[0]
        if saved[1] is None:
            os.environ.pop("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", None)
        else:
            os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = saved[1]


def import_ray() -> Any:
    """Ray, imported with token authentication on: Ray reads RAY_AUTH_MODE when it is first imported (a driver
    that imported it without would start a cluster whose servers wait for a token it never made)."""
    if "ray" not in sys.modules:
        os.environ.setdefault("RAY_AUTH_MODE", "token")
    if os.environ.get("RAY_AUTH_MODE") != "token":
        raise DeltashipError(
            f"RAY_AUTH_MODE={os.environ.get('RAY_AUTH_MODE')}: the fleet runs only with Ray's token authentication",
            "unset RAY_AUTH_MODE (or set it to token) before the process imports ray",
        )
    import ray  # lazy: ray (the fleet extra)

    return ray


def ensure_token() -> None:
    """This machine's Ray token (RAY_AUTH_TOKEN_PATH, else ~/.ray/auth_token), made when missing: what a head
    started outside ray.init() (ray.cluster_utils, `ray start --head`) authenticates with."""
    import_ray()
    from ray._private.authentication.authentication_token_setup import (  # lazy: ray (the fleet extra)
        ensure_token_if_auth_enabled,
    )

    ensure_token_if_auth_enabled(create_token_if_missing=True)


@contextmanager
def connect(address: str | None, resources: dict[str, float]) -> Iterator[None]:
    """A connected Ray driver for the run: a new local cluster advertising `resources` (address None), or the
    cluster at `address`; shut down (the embedded cluster with its processes) when the run ends."""
    if address is not None:
        split_address(address)
    ray = import_ray()
    if ray.is_initialized():
        raise DeltashipEnvironmentError(
            "this process is already connected to a Ray cluster", "run the fleet from a process of its own"
        )
    tmp = tempfile.mkdtemp(prefix="dsray-") if address is None else None  # short: Ray's socket paths are bounded
    saved_tmp = os.environ.get("RAY_TMPDIR")
    try:
        with loopback_only(is_loopback(address)):
            if tmp is not None:
                os.environ["RAY_TMPDIR"] = tmp
                ray.init(
                    address="local",
                    _node_ip_address="127.0.0.1",
                    include_dashboard=False,
                    resources=resources,
                    num_cpus=os.cpu_count() or 1,
                    object_store_memory=OBJECT_STORE_BYTES,
                    _temp_dir=tmp,
                    logging_level="ERROR",
                    log_to_driver=False,
                )
            else:
                try:
                    ray.init(address=address, logging_level="ERROR", log_to_driver=False)
                except (ConnectionError, RuntimeError) as e:
                    raise DeltashipEnvironmentError(
                        f"--address {address}: cannot join the Ray cluster ({str(e).splitlines()[0]})",
                        "start its head (`ray start --head`) and give this machine its token (RAY_AUTH_TOKEN_PATH)",
                    ) from None
            try:
                yield
            finally:
                ray.shutdown()
    finally:
        if tmp is not None:
            if saved_tmp is None:
                os.environ.pop("RAY_TMPDIR", None)
            else:
                os.environ["RAY_TMPDIR"] = saved_tmp
            shutil.rmtree(tmp, ignore_errors=True)


def nodes() -> list[dict[str, Any]]:
    """The alive nodes: id and resources."""
    return [{"id": n["NodeID"], "resources": n["Resources"]} for n in import_ray().nodes() if n.get("Alive")]


def offered(prefix: str) -> dict[str, list[str]]:
    """What the alive nodes advertise under `prefix` ("device:", "toolchain:"): name -> node ids."""
    out: dict[str, list[str]] = {}
    for n in nodes():
        for r in n["resources"]:
            if r.startswith(prefix):
                out.setdefault(r[len(prefix) :], []).append(n["id"])
    return out
