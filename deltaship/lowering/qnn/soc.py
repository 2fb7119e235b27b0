"""The Snapdragon SoCs a `qnn` bundle can be compiled for: QNN's SoC model number and HTP architecture.

Values from Qualcomm's public tables (the QNN SDK's SoC list, as ExecuTorch's QNN backend and LiteRT's Qualcomm
vendor code carry them: SM8550 = 43 / v73, SM8650 = 57 / v75, SM8750 = 69 / v79). They are what
onnxruntime-qnn's provider options `soc_model` and `htp_arch` take.
"""

from __future__ import annotations

from dataclasses import dataclass

from deltaship.errors import DeltashipError


@dataclass(frozen=True)
class QnnSoc:
    name: str  # what --qnn-soc takes
    chip: str  # Qualcomm's part number
    marketing: str
    soc_model: int  # QNN's SoC model number (provider option soc_model)
    htp_arch: int  # Hexagon tensor processor architecture (provider option htp_arch)


SOCS: dict[str, QnnSoc] = {
    s.name: s
    for s in (
        QnnSoc("8gen2", "SM8550", "Snapdragon 8 Gen 2", 43, 73),
        QnnSoc("8gen3", "SM8650", "Snapdragon 8 Gen 3", 57, 75),
        QnnSoc("8elite", "SM8750", "Snapdragon 8 Elite", 69, 79),
    )
}
DEFAULT_SOC = "8elite"


def soc(name: str) -> QnnSoc:
    """The SoC called `name` (a --qnn-soc value, or its part number such as SM8650)."""
    for s in SOCS.values():
        if name.lower() in (s.name, s.chip.lower()):
            return s
    known = ", ".join(f"{s.name} ({s.chip}, {s.marketing}, HTP v{s.htp_arch})" for s in SOCS.values())
    raise DeltashipError(f"unknown Snapdragon SoC {name!r} for the qnn target", f"pass --qnn-soc as one of: {known}")
