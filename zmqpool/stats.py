"""Per-env statistics: what ``pool.stats()`` reports, and the table people read."""

from __future__ import annotations

from typing import Any

from zmqpool.state import EnvSlot


def _percentile_ms(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return 1000.0 * ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def env_stats(slot: EnvSlot) -> dict[str, Any]:
    latencies = list(slot.latencies_s)
    return {
        "steps": slot.steps,
        "restarts": slot.restarts,
        "last_restart_cause": slot.last_restart_cause,
        "latency_ms_p50": _percentile_ms(latencies, 0.5),
        "latency_ms_p99": _percentile_ms(latencies, 0.99),
        "in_flight": len(slot.in_flight),
        "lost": slot.lost is not None,
    }


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def stats_table(stats: dict[int, dict[str, Any]]) -> str:
    """A fixed-width table, one line per env.

    Example:
        >>> print(stats_table({0: {"steps": 3, "restarts": 0, "last_restart_cause": None,
        ...     "latency_ms_p50": 0.5, "latency_ms_p99": 1.25, "in_flight": 0, "lost": False}}))
        env    steps  restarts  p50 ms  p99 ms  last restart
          0        3         0    0.50    1.25  -
    """
    lines = [
        f"{'env':>3}  {'steps':>7}  {'restarts':>8}  {'p50 ms':>6}  {'p99 ms':>6}  last restart"
    ]
    for env, s in sorted(stats.items()):
        cause = s["last_restart_cause"] or "-"
        if s["lost"]:
            cause = f"LOST ({cause})"
        lines.append(
            f"{env:>3}  {s['steps']:>7}  {s['restarts']:>8}  {_ms(s['latency_ms_p50']):>6}  "
            f"{_ms(s['latency_ms_p99']):>6}  {cause}"
        )
    return "\n".join(lines)
