"""What hardware is attached or reachable: the host, ssh hosts, Android phones (adb), Apple devices.

Every device gets a fingerprint (PROFILING.md's device record): model/SoC, cores, RAM, OS,
runtimes and versions, and CPU frequency / thermal state where readable.
"""

from __future__ import annotations

import json
import os
import platform
import re
import shutil
import subprocess
import tempfile
from importlib import metadata
from pathlib import Path
from typing import Any

from deltaship.errors import DeltashipError
from deltaship.files import parse_json

RUNTIME_PACKAGES = ("onnxruntime", "onnxruntime-gpu", "executorch", "coremltools", "torch")


def _read(path: str) -> str | None:
    try:
        return Path(path).read_text()
    except OSError:
        return None


def cpu_model() -> str:
    info = _read("/proc/cpuinfo") or ""
    m = re.search(r"^model name\s*:\s*(.+)$", info, re.M)
    if m:
        return m.group(1).strip()
    if platform.system() == "Darwin":
        try:
            return subprocess.run(
                ["sysctl", "-n", "machdep.cpu.brand_string"], capture_output=True, text=True, timeout=5
            ).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            pass
    return platform.processor() or platform.machine()


def total_ram() -> int:
    info = _read("/proc/meminfo")
    if info:
        m = re.search(r"^MemTotal:\s*(\d+) kB", info, re.M)
        if m:
            return int(m.group(1)) * 1024
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        return 0


def default_threads() -> int:
    """The intra-op threads a CPU runtime picks by itself (ONNX Runtime: one per physical core), within the
    cores this process may run on: physical cores from /proc/cpuinfo, else the usable logical CPUs."""
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    info = _read("/proc/cpuinfo") or ""
    cores = {
        (m.group(1), m.group(2))
        for m in re.finditer(r"physical id\s*:\s*(\d+)[^\n]*\n(?:[^\n]+\n)*?core id\s*:\s*(\d+)", info)
    }
    return max(1, min(usable, len(cores) or usable))


def cpu_frequency_mhz() -> float | None:
    cur = _read("/sys/devices/system/cpu/cpu0/cpufreq/scaling_cur_freq")
    if cur:
        return int(cur) / 1000
    info = _read("/proc/cpuinfo") or ""
    m = re.search(r"^cpu MHz\s*:\s*([\d.]+)", info, re.M)
    return float(m.group(1)) if m else None


def thermal_c() -> float | None:
    temps = []
    for zone in Path("/sys/class/thermal").glob("thermal_zone*/temp"):
        t = _read(str(zone))
        if t and t.strip().lstrip("-").isdigit():
            temps.append(int(t) / 1000)
    return max(temps) if temps else None


def nvidia_gpus() -> list[dict[str, Any]]:
    """NVIDIA GPUs through NVML (pynvml) when installed, else nvidia-smi; empty when none."""
    try:
        import pynvml  # lazy: pynvml; type: ignore

        pynvml.nvmlInit()
        out = []
        for i in range(pynvml.nvmlDeviceGetCount()):
            h = pynvml.nvmlDeviceGetHandleByIndex(i)
            mem = pynvml.nvmlDeviceGetMemoryInfo(h)
            name = pynvml.nvmlDeviceGetName(h)
            out.append(
                {
                    "index": i,
                    "name": name.decode() if isinstance(name, bytes) else name,
                    "memory_bytes": int(mem.total),
                    "driver": pynvml.nvmlSystemGetDriverVersion(),
                }
            )
        return out
    except Exception:  # no pynvml, no driver, no GPU: all the same to us
        pass
    if shutil.which("nvidia-smi"):
        try:
            r = subprocess.run(
                ["nvidia-smi", "--query-gpu=index,name,memory.total,driver_version", "--format=csv,noheader,nounits"],
                capture_output=True,
                text=True,
                timeout=10,
            )
            gpus = []
            for line in r.stdout.strip().splitlines():
                idx, name, mem, drv = [x.strip() for x in line.split(",")]
                gpus.append({"index": int(idx), "name": name, "memory_bytes": int(float(mem)) << 20, "driver": drv})
            return gpus
        except (OSError, subprocess.SubprocessError, ValueError):
            return []
    return []


def runtimes() -> dict[str, str]:
    out = {}
    for p in RUNTIME_PACKAGES:
        try:
            out[p] = metadata.version(p)
        except metadata.PackageNotFoundError:
            pass
    try:
        import onnxruntime as ort  # lazy: onnxruntime

        out["onnxruntime_providers"] = ",".join(ort.get_available_providers())
    except ImportError:
        pass
    out["coreml_runtime"] = "yes" if platform.system() == "Darwin" else "no (macOS only)"
    return out


def host_fingerprint() -> dict[str, Any]:
    return {
        "device": "host",
        "kind": "host",
        "model": cpu_model(),
        "cores": os.cpu_count() or 0,
        "ram_bytes": total_ram(),
        "os": f"{platform.system()} {platform.release()}",
        "machine": platform.machine(),
        "python": platform.python_version(),
        "runtimes": runtimes(),
        "gpus": nvidia_gpus(),
        "cpu_mhz": cpu_frequency_mhz(),
        "thermal_c": thermal_c(),
    }


# ---- ssh ------------------------------------------------------------------------------------
# What a device spec may name. A host, a user or a serial becomes an argument of ssh or adb: a leading `-` would
# be an option (`ssh://-oProxyCommand=...` runs a command), so each is checked against its grammar before any
# process starts, and ssh also gets `--` before the destination (adb has no `--` for `-s`: the grammar is all).
_LABEL = r"[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?"
_HOST_NAME = re.compile(rf"{_LABEL}(?:\.{_LABEL})*\.?")
_IPV4 = re.compile(r"(?:25[0-5]|2[0-4]\d|1\d\d|[1-9]?\d)(?:\.(?:25[0-5]|2[0-4]\d|1\d\d|[1-9]?\d)){3}")
_USER = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,63}")
_SERIAL = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:+\[\]-]{0,127}")
SSH_FIX = "use ssh://[user@]host[:port]: a host name, an IPv4 or [IPv6] address; a user of letters, digits, _ . -"
DEVICE_FIX = "use host, ssh://user@host[:port] or adb:SERIAL"


def _is_ipv6(text: str) -> bool:
    import ipaddress  # lazy: only an ssh://[...] address needs it

    try:
        return isinstance(ipaddress.ip_address(text), ipaddress.IPv6Address)
    except ValueError:
        return False


def parse_ssh(spec: str) -> dict[str, Any]:
    """An ssh://[user@]host[:port] device as {user, host, port}: refused (DeltashipError) unless the host is a host
    name, an IPv4 address or a bracketed IPv6 address, the user a user name and the port 1..65535."""
    m = re.fullmatch(r"ssh://(?:([^@/\[\]]*)@)?(\[[^\]/]*\]|[^@/:\[\]]*)(?::(\d{1,5}))?/?", spec, re.S)
    if not m:
        raise DeltashipError(f"--device {spec!r} is not an ssh address", SSH_FIX)
    user, host, port = m.group(1), m.group(2), int(m.group(3) or 22)
    if host.startswith("["):
        host = host[1:-1]
        if not _is_ipv6(host) or not host.isprintable() or " " in host:  # a zone id may hold anything
            raise DeltashipError(f"--device {spec!r}: {host!r} is not an IPv6 address", SSH_FIX)
    elif not (len(host) <= 253 and (_IPV4.fullmatch(host) or _HOST_NAME.fullmatch(host))):
        raise DeltashipError(f"--device {spec!r}: {host!r} is not a host name or an IP address", SSH_FIX)
    if user is not None and not _USER.fullmatch(user):
        raise DeltashipError(f"--device {spec!r}: {user!r} is not a user name", SSH_FIX)
    if not 1 <= port <= 65535:
        raise DeltashipError(f"--device {spec!r}: port {port} is not in 1..65535", SSH_FIX)
    return {"user": user, "host": host, "port": port, "python": None}


def check_serial(serial: str) -> str:
    """An adb serial (`emulator-5554`, `192.168.1.5:5555`, a USB serial), refused unless it is one: it becomes
    adb's `-s` argument, where a leading `-` or a space would be another option."""
    if not _SERIAL.fullmatch(serial):
        raise DeltashipError(
            f"--device adb:{serial!r}: not an adb serial",
            "use adb:SERIAL with a serial as `adb devices` lists it (letters, digits, . _ : + - [ ])",
        )
    return serial


def check_device(device: str) -> str:
    """A --device spec, refused before any process starts unless it is host, a valid ssh://... or adb:SERIAL."""
    if not isinstance(device, str):
        raise DeltashipError(f"device must be a string, not {type(device).__name__}", DEVICE_FIX)
    if device.startswith("ssh://"):
        parse_ssh(device)
    elif device.startswith("adb:"):
        check_serial(device[4:])
    elif device != "host":
        raise DeltashipError(f"unknown device {device!r}", DEVICE_FIX)
    return device


def ssh_base(target: dict[str, Any], options: list[str] | None = None) -> list[str]:
    dest = f"{target['user']}@{target['host']}" if target["user"] else target["host"]
    opts = ["-p", str(target["port"]), "-o", "BatchMode=yes", "-o", "ConnectTimeout=10", *(options or [])]
    return ["ssh", *opts, "--", dest]  # `--`: nothing after it is an option, whatever the host says


def ssh_run(
    target: dict[str, Any], command: str, options: list[str] | None = None, timeout: float = 600, what: str = "command"
) -> str:
    if not shutil.which("ssh"):
        raise DeltashipError("ssh is not installed on this machine", "install OpenSSH's client (ssh, scp)")
    r = subprocess.run(ssh_base(target, options) + [command], capture_output=True, text=True, timeout=timeout)
    if r.returncode == 255:
        raise DeltashipError(
            f"ssh://{target['host']}:{target['port']} is unreachable: {r.stderr.strip()[-300:]}",
            "check the address, that sshd runs there, and that key-based login works (BatchMode)",
        )
    if r.returncode != 0:
        raise DeltashipError(
            f"the remote {what} failed on {target['host']} (exit {r.returncode}): "
            f"{(r.stderr or r.stdout).strip()[-500:]}",
            "install deltaship on the remote machine (pip install deltaship) and check it runs there",
        )
    return r.stdout


def ssh_fingerprint(spec: str, options: list[str] | None = None, remote_cmd: str = "deltaship") -> dict[str, Any]:
    target = parse_ssh(spec)
    out = ssh_run(target, f"{remote_cmd} devices --json --local", options, timeout=120, what="`deltaship devices`")
    try:
        info = parse_json(out, spec, "`deltaship devices` answer", "install the same deltaship version remotely")[0]
        if not isinstance(info, dict):
            raise TypeError
    except (DeltashipError, IndexError, KeyError, TypeError):
        raise DeltashipError(
            f"{spec}: unexpected answer from the remote deltaship: {out[:200]!r}",
            "install the same deltaship version on the remote machine",
        ) from None
    info.update(device=spec, kind="ssh")
    return info


# ---- Android (adb) -------------------------------------------------------------------------
def adb_devices() -> list[str]:
    """Serials of attached Android devices in the 'device' state; empty when adb is absent."""
    if not shutil.which("adb"):
        return []
    r = subprocess.run(["adb", "devices"], capture_output=True, text=True, timeout=30)
    serials = []
    for line in r.stdout.splitlines()[1:]:
        parts = line.split()
        if len(parts) >= 2 and parts[1] == "device":
            serials.append(parts[0])
    return serials


def parse_getprop(text: str) -> dict[str, str]:
    return dict(re.findall(r"^\[([^\]]+)\]: \[([^\]]*)\]$", text, re.M))


def adb_fingerprint(serial: str) -> dict[str, Any]:
    check_serial(serial)  # before adb sees it
    if not shutil.which("adb"):
        raise DeltashipError("adb is not installed", "install Android platform-tools (adb)")
    if serial not in adb_devices():
        raise DeltashipError(
            f"Android device {serial!r} is not attached (adb devices lists: {', '.join(adb_devices()) or 'none'})",
            "connect the phone, enable USB debugging, accept the host key, and check `adb devices`",
        )
    props = parse_getprop(
        subprocess.run(["adb", "-s", serial, "shell", "getprop"], capture_output=True, text=True, timeout=30).stdout
    )
    meminfo = subprocess.run(
        ["adb", "-s", serial, "shell", "cat", "/proc/meminfo"], capture_output=True, text=True, timeout=30
    ).stdout
    m = re.search(r"MemTotal:\s*(\d+) kB", meminfo)
    return {
        "device": f"adb:{serial}",
        "kind": "android",
        "model": props.get("ro.product.model", "?"),
        "soc": props.get("ro.soc.model") or props.get("ro.board.platform", "?"),
        "abi": props.get("ro.product.cpu.abi", "?"),
        "os": f"Android {props.get('ro.build.version.release', '?')}",
        "ram_bytes": int(m.group(1)) * 1024 if m else 0,
        "cores": None,
        "runtimes": {},
    }


# ---- Apple (xcrun devicectl, macOS only) ----------------------------------------------------
def apple_devices() -> list[dict[str, Any]]:
    if platform.system() != "Darwin" or not shutil.which("xcrun"):
        return []

    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        r = subprocess.run(
            ["xcrun", "devicectl", "list", "devices", "--json-output", f.name],
            capture_output=True,
            text=True,
            timeout=60,
        )
        if r.returncode != 0:
            return []
        data = json.loads(Path(f.name).read_text())
    out = []
    for d in data.get("result", {}).get("devices", []):
        hw, props = d.get("hardwareProperties", {}), d.get("deviceProperties", {})
        out.append(
            {
                "device": f"apple:{d.get('identifier')}",
                "kind": "apple",
                "model": hw.get("marketingName", "?"),
                "soc": hw.get("cpuType", {}).get("name", "?"),
                "os": f"{hw.get('platform', '?')} {props.get('osVersionNumber', '?')}",
                "ram_bytes": None,
                "cores": None,
                "runtimes": {},
            }
        )
    return out


def discover(local_only: bool = False) -> list[dict[str, Any]]:
    """The host, then attached Android and Apple devices."""
    found = [host_fingerprint()]
    if not local_only:
        for serial in adb_devices():
            try:
                found.append(adb_fingerprint(serial))
            except DeltashipError:
                continue
        found += apple_devices()
    return found


def fingerprint(device: str, ssh_options: list[str] | None = None) -> dict[str, Any]:
    """The fingerprint of one device spec: host, ssh://..., adb:SERIAL."""
    check_device(device)
    if device == "host":
        return host_fingerprint()
    if device.startswith("ssh://"):
        return ssh_fingerprint(device, ssh_options)
    if device.startswith("adb:"):
        return adb_fingerprint(device[4:])
    raise DeltashipError(f"unknown device {device!r}", DEVICE_FIX)
