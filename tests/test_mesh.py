"""Mesh: axes, links, and construction from a torch DeviceMesh."""

from __future__ import annotations

import pytest
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.testing._internal.distributed.fake_pg import FakeStore

import autopar
from autopar.errors import InputError
from autopar.mesh import Mesh, parse_mesh_spec


def test_axes_inside_a_node_use_nvlink_and_outer_axes_the_network() -> None:
    mesh = autopar.Mesh({"dp": 16, "tp": 8}, "h100")
    assert mesh.link(1).intra_node and not mesh.link(0).intra_node
    assert mesh.link(1).bandwidth > mesh.link(0).bandwidth
    assert mesh.size == 128 and mesh.names == ("dp", "tp")


def test_mesh_from_device_mesh() -> None:
    dist.init_process_group("fake", rank=0, world_size=4, store=FakeStore())
    try:
        device_mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        mesh = autopar.Mesh.from_device_mesh(device_mesh)
    finally:
        dist.destroy_process_group()
    assert mesh.axes == {"dp": 2, "tp": 2}
    assert mesh.hardware.name == "cpu"


def test_mesh_spec_parsing_and_errors() -> None:
    assert parse_mesh_spec("dp=2, tp=4") == {"dp": 2, "tp": 4}
    with pytest.raises(ValueError, match="bad mesh spec"):
        parse_mesh_spec("dp2")
    with pytest.raises(ValueError, match="positive"):
        autopar.Mesh({"dp": 0})


def test_zigzag_axes_cut_twice_as_many_chunks() -> None:
    """A zig-zag axis (``Mesh.zigzag``) cuts a split dim in 2n chunks; it is part of the mesh's
    identity and its JSON, and must name an axis of the mesh."""
    mesh = Mesh({"dp": 2, "cp": 4}, "h100", zigzag=("cp",))
    assert mesh.chunks == (2, 8) and mesh.zigzag_dims() == frozenset({1})
    assert mesh.to_json()["zigzag"] == ["cp"] and "zigzag" not in Mesh({"dp": 2, "cp": 4}).to_json()
    assert mesh != Mesh({"dp": 2, "cp": 4}, "h100") and mesh.with_zigzag(()) == Mesh({"dp": 2, "cp": 4}, "h100")
    with pytest.raises(InputError, match="zig-zag axes \\['sp'\\] are not axes of the mesh"):
        Mesh({"cp": 2}, zigzag=("sp",))


@pytest.mark.parametrize("make,message", [
    (lambda: Mesh({"dp": True, "tp": 2}), "mesh axis 'dp' has size True; sizes must be positive ints"),
    (lambda: Mesh({"dp": 2.0}), "mesh axis 'dp' has size 2.0"),
    (lambda: Mesh({"": 2}), "mesh axis names must be non-empty strings, got ''"),
    (lambda: Mesh({3: 2}), "mesh axis names must be non-empty strings, got 3"),
    (lambda: Mesh({"dp": 2}, devices_per_node=float("nan")), "devices_per_node must be a positive int, got nan"),
    (lambda: Mesh({"dp": 2}, devices_per_node=True), "devices_per_node must be a positive int, got True"),
    (lambda: Mesh([("dp", 2)]), r"a mesh's axes are a dict of axis name -> size.*got list \[\('dp', 2\)\]"),
    (lambda: parse_mesh_spec("dp=\u00b2"), "bad mesh spec"),
], ids=["bool-size", "float-size", "empty-name", "int-name", "nan-devices-per-node", "bool-devices-per-node",
        "list-of-pairs", "superscript-digit"])
def test_meshes_refuse_what_is_not_axis_names_and_sizes(make: object, message: str) -> None:
    """Each was accepted as given (a bool size is an int, nan compares false) or failed as an
    AttributeError or a bare int() ValueError."""
    with pytest.raises(InputError, match=message):
        make()  # type: ignore[operator]
