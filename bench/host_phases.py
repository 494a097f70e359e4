"""Where the host's time went in bench/constrained_tbt.py's waves, ms a step: the engine thread's own
phases (wall) and the part of them it spent off its CPU (waiting for the GIL, or on a vCPU the
hypervisor paused), its waits for the GPU and for the fill, and each of the fill's phases (`fill.*`,
wall, on the fill's threads). In a plain step the wait for the GPU is the slack the decode queued
ahead leaves the host; a json_schema step's draw waits for its masks, so its host work is on the
step's path (engine.md "Session 37")."""

from __future__ import annotations

WAITS = ("gpu_wait", "fill_wait")


def wave_host(phases: dict[str, dict[str, float]]) -> dict[str, float]:
    """One wave's phases (`/v1/engine/stats`' per step, as constrained_tbt.py records them) summed up."""
    own = [phase for name, phase in phases.items() if name not in WAITS and not name.startswith("fill.")]
    spent = {"own": sum(phase["wall_s"] for phase in own),
             "off CPU": sum(phase["wall_s"] - phase["cpu_s"] for phase in own)}
    spent.update((name, phase["wall_s"]) for name, phase in phases.items()
                 if name in WAITS or name.startswith("fill."))
    return spent


def host_ranges(waves: list[dict[str, dict[str, float]]]) -> str:
    """`wave_host` of each wave's phases as ranges over the waves; those under 0.05 ms in every wave left out."""
    spent: dict[str, list[float]] = {}
    for phases in waves:
        for name, ms in wave_host(phases).items():
            spent.setdefault(name, []).append(ms)
    return ", ".join(f"{name} {min(values):.2f}-{max(values):.2f}" for name, values in spent.items()
                     if max(values) >= 0.05)
