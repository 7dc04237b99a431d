"""A fake host's sysfs for the NUMA tests (``--sysfs-root``): NUMA nodes with their CPUs, memory and
distances, and NVIDIA GPU functions under bus/pci/devices with their ``numa_node``. Only what
kvoffd/pool/topology.py reads, written as the kernel writes it."""

from __future__ import annotations

from pathlib import Path


def make_sysfs(root: Path, cpus: list[str], gpus: dict[str, int] | None = None, far: int = 20) -> Path:
    """``cpus``: each node's cpulist (node i: ``cpus[i]``); ``gpus``: bus id -> numa_node."""
    node_dir = root / "devices" / "system" / "node"
    node_dir.mkdir(parents=True, exist_ok=True)
    n = len(cpus)
    (node_dir / "online").write_text(f"0-{n - 1}\n" if n > 1 else "0\n")
    (node_dir / "has_memory").write_text(f"0-{n - 1}\n" if n > 1 else "0\n")
    for i, cl in enumerate(cpus):
        d = node_dir / f"node{i}"
        d.mkdir(exist_ok=True)
        (d / "cpulist").write_text(cl + "\n")
        (d / "distance").write_text(" ".join("10" if j == i else str(far) for j in range(n)) + "\n")
    pci = root / "bus" / "pci" / "devices"
    pci.mkdir(parents=True, exist_ok=True)
    for bus_id, node in (gpus or {}).items():
        d = pci / bus_id
        d.mkdir(exist_ok=True)
        (d / "vendor").write_text("0x10de\n")
        (d / "class").write_text("0x030200\n")
        (d / "numa_node").write_text(f"{node}\n")
    return root
