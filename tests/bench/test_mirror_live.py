"""bench.ordering.mirror_live's report (its measurement needs a live service: run it by hand)."""

from __future__ import annotations

from pathlib import Path

from bench.ordering.mirror_live import plot


def test_the_plot_draws_predicted_against_delivered(tmp_path: Path) -> None:
    rows = [{"predicted": n * 32, "delivered": n * 32, "prompt_tokens": 400} for n in range(5)]
    path = tmp_path / "mirror_live.png"
    plot({"answers": {"rows": rows}}, path)
    assert path.read_bytes().startswith(b"\x89PNG")
    plot({"restart": {}}, tmp_path / "restart_only.png")  # the restart phase alone has no rows
    assert (tmp_path / "restart_only.png").stat().st_size > 0
