"""Hostile input: every command and the Python API refuse it with exit 2/3 (a DeltashipError), never exit 1.

The corpus (issue 45): deeply nested JSON, a 5000-digit integer, floats where integers belong, NaN/Infinity,
duplicate keys, a max_context beyond the graph's KV cache, a vocabulary beyond the graph's logits, hosts that are
ssh options, bad tier values, wrong API types. Commands run in-process through `deltaship.cli.main` (the exit
code) and the API; the readers of compare files, tiers files and JSON metadata are fuzzed with hypothesis.
"""

from __future__ import annotations

import subprocess

import pytest

from deltaship import cli
from deltaship.devices.discovery import check_device, parse_ssh, ssh_base
from deltaship.errors import DeltashipError

BAD_DEVICES = [
    "ssh://-oProxyCommand=touch /tmp/pwned",
    "ssh://-oProxyCommand=x",
    "ssh://user@-oProxyCommand=x",
    "ssh://-l@host",
    "ssh://host name",
    "ssh://host\nname",
    "ssh://ho\x00st",
    "ssh://host:0",
    "ssh://host:70000",
    "ssh://[not-ipv6]",
    "ssh://[::1 -x]",
    "ssh://a..b",
    "ssh://" + "a" * 300,
    "adb:-s",
    "adb:--help",
    "adb:emu 5554",
    "adb:emu\t5554",
    "adb:",
    "telnet://host",
]


@pytest.mark.parametrize("device", BAD_DEVICES)
def test_a_host_or_serial_that_is_no_host_is_refused_before_any_process(device, bundles, monkeypatch, capsys):
    started = []
    monkeypatch.setattr(subprocess, "run", lambda *a, **k: started.append(a) or pytest.fail(f"ran {a}"))
    monkeypatch.setattr(subprocess, "Popen", lambda *a, **k: started.append(a) or pytest.fail(f"started {a}"))
    with pytest.raises(DeltashipError):
        check_device(device)
    code = cli.main(["profile", str(bundles("base")), "--device", device])
    assert code == 2 and not started, capsys.readouterr().err
    assert "device" in capsys.readouterr().err


@pytest.mark.parametrize(
    "device, user, host, port",
    [
        ("ssh://me@example.com", "me", "example.com", 22),
        ("ssh://10.0.0.7:2222", None, "10.0.0.7", 2222),
        ("ssh://me@[::1]:2200", "me", "::1", 2200),
        ("ssh://build-box.local/", None, "build-box.local", 22),
    ],
)
def test_hosts_and_serials_that_are_hosts_pass_and_ssh_gets_a_double_dash(device, user, host, port):
    target = parse_ssh(device)
    assert (target["user"], target["host"], target["port"]) == (user, host, port)
    argv = ssh_base(target, ["-o", "StrictHostKeyChecking=no"])
    assert argv[-2:] == ["--", f"{user}@{host}" if user else host]  # nothing after `--` is an ssh option
    for serial in ("emulator-5554", "192.168.1.5:5555", "R58M123ABC", "adb-R58M._adb-tls-connect._tcp"):
        assert check_device(f"adb:{serial}") == f"adb:{serial}"
