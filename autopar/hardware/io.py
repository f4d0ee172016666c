"""Profiles as JSON: what ``benchmarks/calibrate_gpu.py`` writes and ``load_profile`` reads.

The format (``FORMAT``)::

    {"format": "autopar-profile/1", "name": "h100-lab", "base": "h100", "source": "...",
     "fields": {"peak_flops_bf16": 9.89e14, "memory_bandwidth": 3.35e12, "op_overhead": 1e-05, ...},
     "matmul_efficiency": {"bf16": [[flops_per_call, fraction_of_peak], ...]},
     "attention_efficiency": [{"head_dim": 128, "causal": true, "by_keys": [[keys, fraction], ...]}],
     "bus_bandwidth": [{"kind": "all_reduce", "intra_node": 4.8e11, "per_nic": 4.7e10}],
     "allocator": {"context_bytes": 4e8, "nccl_bytes": 2.1e9, "fragmentation": 0.1}}

``base`` names a built-in profile whose figures stand for what the file does not give (a
single-GPU calibration measures no network); without it ``fields`` must give every figure a
profile needs. Any curve or table given replaces the base's.
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import Any

from autopar.errors import InputError
from autopar.hardware.curve import Curve
from autopar.hardware.profile import AllocatorMargin, AttentionCurve, BusBandwidth, HardwareProfile
from autopar.hardware.profiles import get_profile

FORMAT = "autopar-profile/1"
STRUCTURED = ("matmul_efficiency", "attention_efficiency", "bus_bandwidth", "allocator")
"""Fields written as their own JSON sections rather than under ``fields``."""
_KINDS = {"float": (int, float), "int": (int,), "bool": (bool,), "str": (str,)}


def _scalar_fields() -> dict[str, str]:
    """Name -> annotation of every field ``fields`` may set."""
    return {f.name: str(f.type) for f in dataclasses.fields(HardwareProfile) if f.name not in STRUCTURED}


def profile_to_json(profile: HardwareProfile, base: str | None = None) -> dict[str, Any]:
    """``profile`` in the JSON format above (``base``: the built-in profile it was measured against)."""
    scalars = {name: getattr(profile, name) for name in _scalar_fields() if name not in ("name", "source")}
    out: dict[str, Any] = {"format": FORMAT, "name": profile.name, "source": profile.source, "fields": scalars,
                           "matmul_efficiency": {p: c.to_json() for p, c in profile.matmul_efficiency},
                           "attention_efficiency": [{"head_dim": a.head_dim, "causal": a.causal,
                                                     "by_keys": a.by_keys.to_json()}
                                                    for a in profile.attention_efficiency],
                           "bus_bandwidth": [dataclasses.asdict(b) for b in profile.bus_bandwidth],
                           "allocator": None if profile.allocator is None else dataclasses.asdict(profile.allocator)}
    if base is not None:
        out["base"] = base
    return out


def save_profile(profile: HardwareProfile, path: str | Path, base: str | None = None) -> None:
    Path(path).write_text(json.dumps(profile_to_json(profile, base), indent=1) + "\n")


def load_profile(path: str | Path) -> HardwareProfile:
    """The profile a JSON file (module docstring) describes, usable wherever a profile is
    (``autopar.Mesh(..., hardware=load_profile(path))``). Bad content is an ``InputError``
    naming the file and the key."""
    try:
        data = json.loads(Path(path).read_text())
    except OSError as exc:
        raise InputError(f"load_profile: cannot read {str(path)!r}: {exc.strerror or exc}") from None
    except json.JSONDecodeError as exc:
        raise InputError(f"load_profile: {str(path)!r} is not JSON: {exc}") from None
    try:
        return profile_from_json(data)
    except InputError as exc:
        raise InputError(f"load_profile: {str(path)!r}: {exc}") from None


def profile_from_json(data: object) -> HardwareProfile:
    """``load_profile`` of already parsed JSON."""
    if not isinstance(data, dict):
        raise InputError(f"a profile is a JSON object, got {type(data).__name__}")
    if data.get("format") != FORMAT:
        raise InputError(f"'format' must be {FORMAT!r}, got {data.get('format')!r}")
    unknown = sorted(set(data) - {"format", "name", "base", "source", "fields", *STRUCTURED})
    if unknown:
        raise InputError(f"unknown keys {unknown}")
    values = _fields(data.get("fields", {}))
    for key in ("name", "source"):
        if key in data:
            if not isinstance(data[key], str) or (key == "name" and not data[key]):
                raise InputError(f"'{key}' must be a {'non-empty ' if key == 'name' else ''}string")
            values[key] = data[key]
    values.update(_structured(data))
    base = data.get("base")
    if base is None:
        missing = [f.name for f in dataclasses.fields(HardwareProfile)
                   if f.default is dataclasses.MISSING and f.name not in values]
        if missing:
            raise InputError(f"no 'base' profile, so 'fields' must give {missing}")
        return HardwareProfile(**values)
    if not isinstance(base, str):
        raise InputError(f"'base' must name a built-in profile, got {base!r}")
    return dataclasses.replace(get_profile(base), **values)


def _fields(raw: object) -> dict[str, Any]:
    if not isinstance(raw, dict):
        raise InputError(f"'fields' must be an object, got {type(raw).__name__}")
    known = _scalar_fields()
    values: dict[str, Any] = {}
    for name, value in raw.items():
        if name not in known:
            raise InputError(f"unknown field {name!r} in 'fields'")
        kinds = _KINDS[known[name].split(" ")[0]]
        ok = isinstance(value, kinds) and (bool in kinds or not isinstance(value, bool))
        if not ok or (isinstance(value, float) and not math.isfinite(value)):
            raise InputError(f"field {name!r} must be {known[name]}, got {value!r}")
        values[name] = float(value) if known[name] == "float" else value
    return values


def _structured(data: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    if "matmul_efficiency" in data:
        raw = data["matmul_efficiency"]
        if not isinstance(raw, dict) or not all(p in ("bf16", "fp32") for p in raw):
            raise InputError("'matmul_efficiency' must map 'bf16' / 'fp32' to [[flops, fraction], ...]")
        out["matmul_efficiency"] = tuple((p, Curve.from_json(c, f"matmul_efficiency[{p!r}]")) for p, c in raw.items())
    if "attention_efficiency" in data:
        out["attention_efficiency"] = tuple(_attention(i, a) for i, a in enumerate(_list(data, "attention_efficiency")))
    if "bus_bandwidth" in data:
        out["bus_bandwidth"] = tuple(_record(BusBandwidth, f"bus_bandwidth[{i}]", b)
                                     for i, b in enumerate(_list(data, "bus_bandwidth")))
    if "allocator" in data:
        raw = data["allocator"]
        out["allocator"] = None if raw is None else _record(AllocatorMargin, "allocator", raw)
    return out


def _list(data: dict[str, Any], key: str) -> list[Any]:
    if not isinstance(data[key], list):
        raise InputError(f"'{key}' must be a list")
    return data[key]


def _attention(i: int, raw: object) -> AttentionCurve:
    where = f"attention_efficiency[{i}]"
    if not isinstance(raw, dict) or set(raw) != {"head_dim", "causal", "by_keys"}:
        raise InputError(f"{where} must be {{'head_dim', 'causal', 'by_keys'}}, got {raw!r}")
    if isinstance(raw["head_dim"], bool) or not isinstance(raw["head_dim"], int) or raw["head_dim"] < 1:
        raise InputError(f"{where}['head_dim'] must be a positive int")
    if not isinstance(raw["causal"], bool):
        raise InputError(f"{where}['causal'] must be true or false")
    return AttentionCurve(raw["head_dim"], raw["causal"], Curve.from_json(raw["by_keys"], f"{where}['by_keys']"))


def _record(cls: type, where: str, raw: object) -> Any:
    names = {f.name for f in dataclasses.fields(cls)}
    if not isinstance(raw, dict) or set(raw) != names:
        raise InputError(f"{where} must have exactly the keys {sorted(names)}, got {raw!r}")
    if any(isinstance(v, bool) or not isinstance(v, (int, float, str)) for v in raw.values()):
        raise InputError(f"{where} must hold numbers (and a 'kind' name), got {raw!r}")
    try:
        return cls(**raw)
    except (InputError, TypeError) as exc:
        raise InputError(f"{where}: {exc}") from None
