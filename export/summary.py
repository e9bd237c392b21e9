"""What `edgepfl export` prints of a bundle: its roles and sizes, the personal part, its engines, and the blocks."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from edgepfl.manifest import Manifest


def summarize(manifest: Manifest) -> dict:
    """Numbers per role for the export table and bench/export.py."""
    rows = {}
    for role in ("base", "personal", "buffer"):
        specs = manifest.by_role(role)
        rows[role] = {
            "tensors": len(specs),
            "parameters": sum(s.nbytes // 4 if s.dtype == "float32" else 0 for s in specs),
            "bytes": sum(s.nbytes for s in specs),
            "blocks": sorted({s.block for s in specs}),
        }
    return rows


def print_summary(manifest: Manifest, out: Path, console=None) -> None:
    """The rich table printed after an export: blocks, parameters and bytes per role, upload size."""
    from rich.console import Console
    from rich.table import Table

    console = console or Console()
    rows = summarize(manifest)
    first_personal = manifest.personal_block_start
    table = Table(title=f"{manifest.model['name']} personal {manifest.personal_spec} -> {out}")
    for column in ("role", "blocks", "tensors", "parameters", "bytes"):
        table.add_column(column, justify="left" if column in ("role", "blocks") else "right")
    for role, row in rows.items():
        blocks = _block_range(manifest.blocks, row["blocks"])
        table.add_row(role, blocks, str(row["tensors"]), f"{row['parameters']:,}", _human(row["bytes"]))
    console.print(table)
    if manifest.personal_spec.is_suffix:
        console.print(
            f"blocks: {len(manifest.blocks)} ({', '.join(manifest.blocks[:first_personal][-2:])} | "
            f"personal: {', '.join(manifest.blocks[first_personal:]) or 'none'})"
        )
    else:
        console.print(
            f"blocks: {len(manifest.blocks)}; personal tensors in "
            f"{_block_range(manifest.blocks, rows['personal']['blocks'])}"
        )
    full = rows["base"]["bytes"] + rows["personal"]["bytes"]
    console.print(
        f"one round uploads {_human(rows['base']['bytes'])} of base tensors "
        f"(FedAvg would send {_human(full)}); base_layout_hash {manifest.base_layout_hash[:16]}…"
    )
    console.print(f"engines: {', '.join(manifest.engines) or 'none'}; files: {len(manifest.files)}")


def print_blocks(rows: list[dict], title: str, console=None) -> None:
    """`export --show-blocks`: each block's size, the K_P whose personal part starts there, and its upload."""
    from rich.console import Console
    from rich.table import Table

    console = console or Console()
    table = Table(title=title)
    for column in ("#", "block", "parameters", "bytes", "K_P if personal from here", "one round uploads"):
        table.add_column(column, justify="left" if column == "block" else "right")
    for row in rows:
        table.add_row(
            str(row["index"]),
            row["block"],
            f"{row['parameters']:,}",
            _human(row["bytes"]),
            str(row["kp"]),
            _human(row["upload_bytes"]),
        )
    console.print(table)
    total = sum(row["bytes"] for row in rows)
    console.print(
        f"{len(rows)} blocks; --kp K keeps the last K blocks on the device and uploads the base parameters "
        f"before them each round (--kp 0 = FedAvg uploads all {_human(total)})"
    )


def _block_range(names: Sequence[str], indices: list[int]) -> str:
    if not indices:
        return "-"
    if len(indices) == 1:
        return names[indices[0]]
    return f"{names[indices[0]]}..{names[indices[-1]]}"


def _human(count: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if count < 1024 or unit == "GiB":
            return f"{count:.0f} {unit}" if unit == "B" else f"{count:.1f} {unit}"
        count /= 1024
    return str(count)
